"""One benchmark's run, shared: parse its options, start its clock and metadata, collect its
rows, write its JSON + MD + PNG. A benchmark is a `Benchmark` (what it measures and how its
table reads); `main(benchmark, argv)` runs it, so a script's main() is one line."""
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
  collect(args, run) -> (rows, notes), where run is the `Run` (its time limit, metadata and
  partial saves); columns and plot: report.write_results'; ceilings: measure the matmul and HBM
  ceilings into the metadata (kernel timings) or not (accuracy); arguments(parser): the
  benchmark's own options; sweep: it has --sweep / --no-sweep; stem(args): its result files'
  stem when the options choose it (default: name)."""
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
  sweep: bool = False
  stem: Callable | None = None


@dataclasses.dataclass
class Run:
  """One run in progress: its options, time limit, metadata (a benchmark may add to it), where
  and under which stem it writes, and the plot and extra JSON fields of its last write (a
  benchmark may set them). save() writes the rows so far, so that a run cut short keeps them;
  save_table() writes a side table of the same run (e.g. memory, a sweep)."""
  benchmark: Benchmark
  args: object
  limit: TimeLimit
  meta: dict
  out_dir: Path
  name: str
  plot: dict | None = None
  extra: dict | None = None

  def save(self, rows, notes=(), *, plot=None, extra=None) -> dict:
    return report.write_results(self.name, rows, self.meta, self.benchmark.columns, plot,
                                out_dir=self.out_dir, notes=notes, extra=extra)

  def save_table(self, name: str, rows, columns, *, title: str, notes=(), plot=None) -> dict:
    meta = {k: v for k, v in self.meta.items() if k != "notes_header"}
    return report.write_results(name, rows, {**meta, "title": title}, columns, plot,
                                out_dir=self.out_dir, notes=notes)


def parse(benchmark: Benchmark, argv=None):
  parser = cli.bench_arguments(benchmark.doc, smoke=benchmark.smoke, time_limit_s=benchmark.time_limit_s,
                               quick=benchmark.quick, sweep=benchmark.sweep)
  if benchmark.arguments is not None:
    benchmark.arguments(parser)
  return parser.parse_args(argv)


def main(benchmark: Benchmark, argv=None) -> dict:
  """Runs `benchmark` with the command line `argv`; returns the paths written."""
  args = parse(benchmark, argv)
  name = benchmark.stem(args) if benchmark.stem is not None else benchmark.name
  if benchmark.ceilings:
    meta, out_dir = cli.begin_run(name, args, matmul_n=256 if args.smoke else 8192,
                                  hbm_gib=1 / 64 if args.smoke else 4.0)
  else:
    out_dir = cli.smoke_out_dir(name) if args.smoke else Path(args.out or report.RESULTS_DIR)
    meta = env_metadata()
    meta.update(smoke=args.smoke, quick=getattr(args, "quick", False))
    log(f"{name} on {meta['device']} ({meta['backend']}), jax {meta['versions'].get('jax')}")
  meta.setdefault("title", benchmark.doc.split("\n")[0].rstrip("."))
  run = Run(benchmark, args, TimeLimit(args.time_limit_s), meta, out_dir, name, plot=benchmark.plot)
  rows, notes = benchmark.collect(args, run)
  paths = run.save(rows, notes, plot=run.plot, extra=run.extra)
  log(f"wrote {paths['json']} ({len(rows)} rows, {run.limit.elapsed():.0f} s)")
  return paths
