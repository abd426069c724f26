"""What every benchmark script shares: its command-line options, its time limit, its start
(metadata and ceilings) and its log."""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench import ceilings
from bench.environment import env_metadata
from bench.report import RESULTS_DIR
from bench.timing import WALL_NO_GPU, has_gpu


def bench_arguments(doc: str, *, smoke: str, time_limit_s: float, time_limit_help: str | None = None,
                    quick: str | None = None, sweep: bool = False) -> argparse.ArgumentParser:
  """The options the benchmark scripts share: --smoke (what it runs), --time-limit-s, --out,
  and --quick (when `quick` says what it keeps) and --sweep/--no-sweep (when `sweep`); a
  script adds its own options to the parser returned. `doc`: the script's docstring."""
  p = argparse.ArgumentParser(description=doc.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help=smoke)
  if quick is not None:
    p.add_argument("--quick", action="store_true", help=quick)
  if sweep:
    p.add_argument("--sweep", dest="sweep", action="store_true", default=True)
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
  p.add_argument("--time-limit-s", type=float, default=time_limit_s,
                 help=time_limit_help or
                 "skip the cells left after this many seconds (results are still written)")
  p.add_argument("--out", default=None, help=f"results folder (default {RESULTS_DIR})")
  return p


def log(msg: str) -> None:
  print(msg, flush=True)


class TimeLimit:
  """A script's time limit: cells that would start past it are skipped (and the results say
  so), so that a run always ends with its result files written."""

  def __init__(self, seconds: float):
    self.start, self.seconds = time.perf_counter(), seconds

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def exhausted(self) -> bool:
    return self.elapsed() > self.seconds


def smoke_out_dir(prefix: str) -> Path:
  """A fresh /tmp folder for a --smoke run's results (they never overwrite bench/results)."""
  return Path(tempfile.mkdtemp(prefix=f"jaxflash_{prefix}_smoke_", dir="/tmp"))


def begin_run(name: str, args, *, matmul_n: int, hbm_gib: float) -> tuple[dict, Path]:
  """The start every kernel benchmark shares: its metadata (GPU, versions, commit, date, the
  ceilings measured now, the timing method) and its output folder (a fresh /tmp folder for
  a --smoke run)."""
  out_dir = smoke_out_dir(name) if args.smoke else Path(args.out or RESULTS_DIR)
  meta = env_metadata()
  log(f"{name} benchmark on {meta['device']} ({meta['backend']}), jax {meta['versions'].get('jax')}")
  meta["ceilings"] = ceilings.measure(matmul_n=matmul_n, hbm_gib=hbm_gib)
  log(f"ceilings: {meta['ceilings']}")
  meta.update(timing=("device time: sum of the GPU kernels one call launches (jax.profiler trace)"
                      if has_gpu() else WALL_NO_GPU),
              smoke=args.smoke, quick=args.quick)
  return meta, out_dir
