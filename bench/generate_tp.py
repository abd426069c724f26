"""Tensor-parallel generation: Qwen2.5-7B shapes with random bf16 weights on one GPU and
split over two (models.qwen2.shard_model's layout: heads and MLP units split, two
all-reduces a layer), through models.qwen2's jitted prefill and decode step.

Rows: prompt 1024, 64 new tokens, batch 1 then 8, paged cache first (the default) then
contiguous; each on 1 GPU (the unsharded model, the single-device program) and on a mesh
over the first 2 GPUs. Per row: prefill ms (median of 2 runs after the compiling one),
decode ms/step as `generate` runs it (steps dispatched back to back, wall clock / steps),
the median of single blocked steps beside it, tokens/s = batch / pipelined step, and the
speed-up of 2 GPUs over 1 for the same case. The weights are drawn on the devices already
split (`random_model(..., mesh=)`): the 15 GB model is never whole on the host.

The time limit (--time-limit-s) starts once the models are drawn: cases run in priority order and
none starts after it, compiles included; skipped cases are listed in the results. With one
GPU only, the 2-GPU rows are skipped (and say why).

  python -m bench.generate_tp [--time-limit-s S] [--batches 1,8] [--caches paged,contiguous]
  python -m bench.generate_tp --smoke   # tiny config, CPU, 2 forced host devices
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

# NVLink multicast (NVLS) stays off, as the lent multi-GPU machines require (it can take a
# shared host's GPUs out of service); NCCL would otherwise try it for the all-reduces.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--smoke" in sys.argv:  # 2 host devices must be asked for before JAX starts
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=2").strip()

import jax
import numpy as np
from flax import nnx

from bench.cli import TimeLimit, bench_arguments, log, smoke_out_dir
from bench.environment import env_metadata
from bench.generate import Shape, bench_jax
from bench.report import RESULTS_DIR, markdown_table, write_results
from bench.timing import free_memory, has_gpu, try_call

PROMPT = 1024
NEW_TOKENS = 64
TP_DEGREES = (1, 2)


def weights_gb_per_device(model) -> float:
  """Parameter bytes held by the first device (a split model holds a share)."""
  total = 0
  for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
    total += x.addressable_shards[0].data.nbytes
  return total / 1e9


def make_model(config, dtype: str, tp: int, devices):
  """tp 1: the unsharded model on the first device; tp > 1: split over a mesh of the
  first `tp` devices, drawn there already split."""
  from jax.sharding import Mesh
  from models import qwen2
  if tp == 1:
    with jax.default_device(devices[0]):
      return qwen2.random_model(config, seed=0, dtype=dtype)
  mesh = Mesh(np.asarray(devices[:tp]), ("model",))
  return qwen2.random_model(config, seed=0, dtype=dtype, mesh=mesh)


def plan(args):
  """-> (config, dtype, [(cache, Shape)] in priority order)."""
  from models import qwen2
  caches = [c.strip() for c in args.caches.split(",") if c.strip()]
  batches = [int(b) for b in args.batches.split(",") if b.strip()]
  if args.smoke:
    config, dtype, prompt, new = qwen2.Qwen2Config.tiny(tie_word_embeddings=False), "float32", 32, 8
  else:
    config, dtype, prompt, new = qwen2.Qwen2Config.qwen2_5_7b(), "bfloat16", PROMPT, NEW_TOKENS
  # Batch 1 for every cache before batch 8: the first rows are the ones that must fit.
  cases = [(cache, Shape(batch, prompt, new)) for batch in batches for cache in caches]
  return config, dtype, cases


def parse_args(argv=None):
  p = bench_arguments(__doc__, smoke="tiny config on 2 CPU host devices", time_limit_s=105.0,
                      time_limit_help="no case starts after this many seconds (the script must end by 150 s)")
  p.add_argument("--batches", default="1,8")
  p.add_argument("--caches", default="paged,contiguous")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  config, dtype, cases = plan(args)
  out_dir = smoke_out_dir("generate_tp") if args.smoke else (args.out or RESULTS_DIR)
  devices = jax.devices()
  meta = env_metadata()
  log(f"generate_tp on {len(devices)} x {meta['device']} ({meta['backend']}), "
      f"jax {meta['versions'].get('jax')}")
  notes: list[str] = []
  degrees = [tp for tp in TP_DEGREES if tp <= len(devices)]
  for tp in TP_DEGREES:
    if tp > len(devices):
      notes.append(f"{tp}-device rows skipped: only {len(devices)} device(s) present")
  if not args.smoke and not has_gpu():
    notes.append("not a GPU run: the numbers are not comparable to the H200 ones")

  rows: list[dict] = []
  models = {}
  budget = TimeLimit(args.time_limit_s)
  try:
    for tp in degrees:
      start = time.perf_counter()
      model, err = try_call(make_model, config, dtype, tp, devices)
      if model is None:
        notes.append(f"{tp}-device model failed: {err}")
        continue
      jax.block_until_ready(nnx.state(model))
      models[tp] = model
      log(f"model on {tp} device(s): {weights_gb_per_device(model):.2f} GB a device, "
          f"drawn in {time.perf_counter() - start:.1f} s")

    # The budget bounds the cases, not the drawing of the models (~80 s for 7B on an H200).
    budget = TimeLimit(args.time_limit_s)

    for cache, shape in cases:
      for tp in degrees:
        if tp not in models:
          continue
        label = f"{cache} B={shape.batch} on {tp}"
        if budget.exhausted():
          notes.append(f"{label}: skipped (time budget)")
          continue
        log(f"[{budget.elapsed():6.1f}s] {label}")
        got, err = try_call(bench_jax, models[tp], shape, None, cache)
        free_memory()
        row = dict(cache=cache, batch=shape.batch, prompt=shape.prompt, new_tokens=shape.new_tokens,
                   devices=tp, weights_gb_device=weights_gb_per_device(models[tp]))
        if got:
          step = got["pipelined_ms_step"] or got["decode_ms_step"]
          row.update(prefill_ms=got["prefill_ms"], decode_ms_step=step,
                     synced_ms_step=got["decode_ms_step"], tokens_per_s=shape.batch / step * 1e3,
                     compile_s=got["compile_s"])
        else:
          row["error"] = err
        rows.append(row)
        log(f"  {got or err}")
  finally:
    _finish(rows, notes, meta, config, dtype, args, out_dir, budget)
  return rows


def _finish(rows, notes, meta, config, dtype, args, out_dir, budget):
  """Speed-ups against the 1-device row of each case, then the result files."""
  single = {(r["cache"], r["batch"]): r for r in rows if r["devices"] == 1 and "error" not in r}
  for row in rows:
    base = single.get((row["cache"], row["batch"]))
    row["case"] = f"{row['cache']} B={row['batch']} {row['devices']} GPU"
    if base and "error" not in row:
      row["decode_speedup"] = base["decode_ms_step"] / row["decode_ms_step"]
      row["prefill_speedup"] = base["prefill_ms"] / row["prefill_ms"]
  name = "Qwen2.5-7B" if not args.smoke else "tiny (smoke)"
  meta.update(
      title=f"Tensor-parallel generation: {name} shapes, random {dtype} weights, 1 vs 2 devices",
      model=dataclasses.asdict(config), dtype=dtype, smoke=args.smoke,
      device_count=jax.device_count(),
      timing="wall clock (time.perf_counter around block_until_ready)",
      method=("prefill: median of runs 2-3 (run 1 compiles); decode ms/step: steps dispatched back "
              "to back as generate runs them, wall clock / steps (second half of the steps); "
              "synced: median of single blocked steps (first half); tokens/s = batch / decode "
              "ms/step; speed-up = 1-device time / 2-device time of the same case"))
  meta["notes_header"] = [
      "1 device: the unsharded model (the single-device program). 2 devices: "
      "models.qwen2.shard_model's layout over a mesh ('model',) of the first two: q/k/v and "
      "gate/up split by columns (whole heads), o/down by rows (an all-reduce after each), "
      "LM head split over the vocabulary, KV caches split over KV heads.",
      "Attention: the jaxflash kernels (paged decode with pages of 16, or split-KV decode over "
      "the contiguous cache); greedy sampling.",
      "Decode projections: jaxflash.skinny_matmul on each device's weight shard.",
  ]
  columns = [("cache", "cache"), ("batch", "B"), ("devices", "GPUs"),
             ("weights_gb_device", "weights GB/GPU", "{:.2f}"), ("prefill_ms", "prefill ms"),
             ("prefill_speedup", "prefill speed-up", "{:.2f}x"),
             ("decode_ms_step", "decode ms/step"), ("synced_ms_step", "synced ms/step"),
             ("tokens_per_s", "tokens/s"), ("decode_speedup", "decode speed-up", "{:.2f}x"),
             ("compile_s", "compile s"), ("error", "error")]
  plot = dict(kind="bar", x="case", y="decode_ms_step",
              ylabel="decode ms/step (pipelined wall clock)",
              title=f"{name}, prompt {rows[0]['prompt'] if rows else PROMPT}: 1 vs 2 devices")
  paths = write_results("generate_tp", rows, meta, columns, plot=plot, out_dir=out_dir,
                        notes=notes)
  log(markdown_table(rows, columns))
  for note in notes:
    log(f"note: {note}")
  log(f"wrote {', '.join(str(p) for p in paths.values())} in {budget.elapsed():.0f} s")


if __name__ == "__main__":
  main()
