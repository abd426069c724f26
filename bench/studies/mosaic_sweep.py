"""Mosaic GPU prefill on the H200: a tile/stage sweep and the causal prefill table.

Shapes: the seed's Qwen2.5-1.5B attention, B = 1 (and 4 x 4096), 12 query heads, 2 KV
heads, head dim 128, bf16, causal. TFLOP/s count 4 n^2 d per head, halved for causal.
Every figure is device time (the sum of the call's GPU kernel durations in a JAX profiler
trace, bench.timing), all implementations in one process: jaxflash's Mosaic kernel,
jaxflash's Pallas-Triton prefill and cuDNN (jax.nn.dot_product_attention, "cudnn").

  python -m bench.studies.mosaic_sweep                  # sweeps (d = 128 at 8192 and 32768; d = 64
                                                #   and 256 at 8192), then the table
  python -m bench.studies.mosaic_sweep --no-sweep --sizes 4096 16384
  python -m bench.studies.mosaic_sweep --configs 64x128x2 64x128x3 64x128x2os   # o: overlap, s:
                                                # separate output (flags: parse_config)

Writes mosaic_sweep.json to --out (default $OUT when set, else bench/studies/results) and
prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import environment, timing
from bench.ceilings import measure as measure_ceilings
from bench.cli import log
from bench.prefill import HEAD_DIM, causal_flops, make_inputs
from bench.report import STUDIES_DIR
import jaxflash
from jaxflash import mosaic

SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_SIZES = (8192, 32768)
SWEEP_CONFIGS = ("64x64x2", "64x64x4", "64x128x2", "64x128x3", "64x192x2", "64x256x1", "64x128x2s",
                 "64x128x2o", "64x128x2os", "64x128x3o", "64x192x2o", "64x128x2osf")
# Other head dims, swept at 8192 only (their table rows in jaxflash/mosaic/config.py).
HEAD_DIM_SWEEP = {64: ("64x64x4", "64x128x2", "64x128x4", "64x256x2", "64x128x2s", "64x128x2o",
                       "64x128x2osw", "64x128x2oswr", "64x128x4osw", "64x128x2oswrf"),
                  256: ("64x64x2", "64x64x2o", "64x64x2oc", "64x64x2ocf")}


def parse_config(text: str) -> mosaic.MosaicPrefillConfig:
  """'64x128x3' -> block_q 64, block_kv 128, 3 stages; trailing flags: 'o' the intra-warpgroup
  overlap (on the named-barrier ring), 's' a separate output buffer, 'c' conditional
  rescaling, 'w' three consumer warpgroups, 'r' row sums on the tensor cores, 'f' the fixed
  softmax reference."""
  flags = text.split("x")[-1].lstrip("0123456789")
  unknown = set(flags) - set("oscwrf")
  if unknown:
    raise ValueError(f"unknown flags {sorted(unknown)} in config {text!r} (known: o s c w r f)")
  block_q, block_kv, stages = (int(x.rstrip("oscwrf")) for x in text.split("x"))
  return mosaic.MosaicPrefillConfig(block_q, block_kv, stages,
                                    overlap_softmax="o" in flags, separate_output="s" in flags,
                                    conditional_rescale="c" in flags,
                                    num_consumers=3 if "w" in flags else 2,
                                    tensor_core_row_sums="r" in flags,
                                    fixed_reference="f" in flags)


def mosaic_fn(config=None):
  return lambda q, k, v: mosaic.prefill_attention(q, k, v, is_causal=True, config=config)


def triton_fn(q, k, v):
  return jaxflash.prefill_attention(q, k, v, is_causal=True, implementation="triton")


def cudnn_fn(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _tflops(t, flops):
  if not isinstance(t, timing.Timing):
    return None, (t or {}).get("error")
  return flops / (t.us * 1e-6) / 1e12, None


def _max_error(out, ref) -> float:
  return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))


def sweep(n: int, configs, head_dim: int = HEAD_DIM) -> list[dict]:
  args = make_inputs(1, n, head_dim=head_dim)
  cases = {c: (mosaic_fn(parse_config(c)), args) for c in configs}
  timings = timing.device_times_us(cases, log=log)
  rows = []
  for c in configs:
    tflops, err = _tflops(timings.get(c), causal_flops(1, n, head_dim))
    rows.append({"n": n, "head_dim": head_dim, "config": c, "tflops": tflops, "error": err,
                 "us": getattr(timings.get(c), "us", None)})
    log(f"  sweep d={head_dim} n={n} {c}: {tflops if tflops else err}")
  timing.free_memory()
  return rows


def table_row(batch: int, n: int, config=None) -> dict:
  args = make_inputs(batch, n)
  cases = {"mosaic": (mosaic_fn(config), args), "triton": (triton_fn, args), "cudnn": (cudnn_fn, args)}
  timings = timing.device_times_us(cases, keep_output=True, log=log)
  row = {"batch": batch, "n": n}
  for name in cases:
    row[f"{name}_tflops"], err = _tflops(timings.get(name), causal_flops(batch, n))
    if err:
      row[f"{name}_error"] = err
  outputs = {k: getattr(t, "output", None) for k, t in timings.items()}
  if outputs.get("mosaic") is not None and outputs.get("cudnn") is not None:
    row["max_abs_diff_vs_cudnn"] = _max_error(outputs["mosaic"], outputs["cudnn"])
  if row.get("mosaic_tflops") and row.get("cudnn_tflops"):
    row["mosaic_over_cudnn"] = row["mosaic_tflops"] / row["cudnn_tflops"]
  log(f"  {batch}x{n}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()
                                          if k.endswith("tflops") and v))
  timing.free_memory()
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--no-sweep", dest="sweep", action="store_false")
  p.add_argument("--no-table", dest="table", action="store_false")
  p.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
  p.add_argument("--sweep-sizes", type=int, nargs="*", default=list(SWEEP_SIZES))
  p.add_argument("--configs", nargs="*", default=list(SWEEP_CONFIGS))
  p.add_argument("--no-head-dims", dest="head_dims", action="store_false",
                 help="skip the d = 64 and d = 256 sweeps")
  p.add_argument("--no-batch4", dest="batch4", action="store_false", help="skip the 4 x 4096 row")
  p.add_argument("--out", default=os.environ.get("OUT") or str(STUDIES_DIR))
  args = p.parse_args(argv)

  result = {"meta": environment.env_metadata(), "ceilings": measure_ceilings(), "sweep": [], "table": []}
  log(f"ceilings: {result['ceilings']}")
  if args.sweep:
    for n in args.sweep_sizes:
      result["sweep"] += sweep(n, args.configs)
    if args.head_dims:
      for head_dim, configs in HEAD_DIM_SWEEP.items():
        result["sweep"] += sweep(8192, configs, head_dim)
  if args.table:
    for n in args.sizes:
      result["table"].append(table_row(1, n))
    if args.batch4:
      result["table"].append(table_row(4, 4096))
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "mosaic_sweep.json").write_text(json.dumps(result, indent=1, default=str))

  fmt = lambda v: "-" if v is None else f"{v:.0f}" if isinstance(v, float) and v > 10 else f"{v:.3g}"
  if result["sweep"]:
    print("\nsweep (TFLOP/s): d n config tflops")
    for r in result["sweep"]:
      print(f"  {r['head_dim']:3d} {r['n']:6d} {r['config']:10s} {fmt(r['tflops'])} {r['error'] or ''}"[:160])
  print("\nB x n | mosaic | triton | cudnn | mosaic/cudnn | max|diff| vs cudnn")
  for r in result["table"]:
    print(f"{r['batch']} x {r['n']} | {fmt(r.get('mosaic_tflops'))} | {fmt(r.get('triton_tflops'))} | "
          f"{fmt(r.get('cudnn_tflops'))} | {fmt(r.get('mosaic_over_cudnn'))} | "
          f"{fmt(r.get('max_abs_diff_vs_cudnn'))} {r.get('mosaic_error', '')[:200]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
