"""One benchmark's run, shared: parse its options, start its clock and metadata, collect its
rows, write its JSON + MD + PNG. A benchmark is a `Benchmark` (what it measures and how its
table reads); `main(benchmark, argv)` runs it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

from bench import cli, report
from bench.cli import TimeLimit, log  # noqa: F401 -- re-exported: a benchmark needs one import
from bench.environment import env_metadata
from bench.timing import error_text  # noqa: F401 -- re-exported


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """name: its result files' stem; doc: its module docstring (the first line is --help's);
  collect(args, limit) -> (rows, notes); columns and plot: report.write_results'; ceilings:
  measure the matmul and HBM ceilings into the metadata (kernel timings) or not (accuracy);
  arguments(parser): the benchmark's own options."""
  name: str
  doc: str
  collect: Callable
  columns: Sequence
  time_limit_s: float
  smoke: str
  quick: str | None = None
  plot: dict | None = None
  ceilings: bool = True
  arguments: Callable | None = None


def parse(benchmark: Benchmark, argv=None):
  parser = cli.bench_arguments(benchmark.doc, smoke=benchmark.smoke, time_limit_s=benchmark.time_limit_s,
                               quick=benchmark.quick)
  if benchmark.arguments is not None:
    benchmark.arguments(parser)
  return parser.parse_args(argv)


def main(benchmark: Benchmark, argv=None) -> dict:
  """Runs `benchmark` with the command line `argv`; returns the paths written."""
  args = parse(benchmark, argv)
  if benchmark.ceilings:
    small = args.smoke or not _has_gpu()
    meta, out_dir = cli.begin_run(benchmark.name, args, matmul_n=256 if small else 8192,
                                  hbm_gib=1 / 64 if small else 4.0)
  else:
    out_dir = cli.smoke_out_dir(benchmark.name) if args.smoke else Path(args.out or report.RESULTS_DIR)
    meta = env_metadata()
    meta.update(smoke=args.smoke, quick=getattr(args, "quick", False))
    log(f"{benchmark.name} on {meta['device']} ({meta['backend']}), jax {meta['versions'].get('jax')}")
  meta.setdefault("title", benchmark.doc.split("\n")[0].rstrip("."))
  limit = TimeLimit(args.time_limit_s)
  rows, notes = benchmark.collect(args, limit)
  paths = report.write_results(benchmark.name, rows, meta, benchmark.columns, benchmark.plot,
                               out_dir=out_dir, notes=notes)
  log(f"wrote {paths['json']} ({len(rows)} rows, {limit.elapsed():.0f} s)")
  return paths


def _has_gpu() -> bool:
  from bench.timing import has_gpu
  return has_gpu()
