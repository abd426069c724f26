"""`python -m bench [--only prefill,decode] [--quick] [--smoke] [--out DIR] [--dry-run]`: runs the
benchmark suite (bench/suite.py) one shape at a time, each script writing its JSON + MD + PNG,
then writes the results index (bench/index.py). A failing benchmark is reported and the
suite goes on; the exit status says whether any failed."""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

import jax

from bench import index, suite
from bench.cli import log
from bench.report import RESULTS_DIR


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", default=None, help="comma-separated benchmarks (default: all): "
                 + ", ".join(b.name for b in suite.SUITE))
  p.add_argument("--quick", action="store_true", help="each script's --quick (fewer sizes)")
  p.add_argument("--smoke", action="store_true", help="each script's --smoke (tiny CPU runs, /tmp results)")
  p.add_argument("--out", default=None, help=f"results folder (default {RESULTS_DIR})")
  p.add_argument("--dry-run", action="store_true", help="print the command lines, run nothing")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    chosen = suite.select(args.only)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  failed = []
  for benchmark in chosen:
    if jax.device_count() < benchmark.min_devices and not args.dry_run:
      log(f"=== {benchmark.name}: not run (needs {benchmark.min_devices} devices, "
          f"{jax.device_count()} here)")
      continue
    for shape in benchmark.shapes:
      argv_ = benchmark.argv(shape, quick=args.quick, smoke=args.smoke, out=args.out)
      log(f"=== {benchmark.name} [{shape.label}]: python -m {benchmark.module} {' '.join(argv_)}")
      if args.dry_run:
        continue
      try:
        importlib.import_module(benchmark.module).main(argv_)
      except Exception:  # noqa: BLE001 -- one benchmark's failure must not lose the others' results
        traceback.print_exc()
        failed.append(f"{benchmark.name} [{shape.label}]")
  if not args.dry_run and not args.smoke:
    log(f"index: {index.write_index(args.out or RESULTS_DIR)}")
  if failed:
    log("failed: " + ", ".join(failed))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
