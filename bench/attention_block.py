"""A decode step's attention half per layer: jaxflash.decode_attention_block (one persistent
launch) against the four launches it replaces (qkv_projection, split-KV decode,
project_split_kv, add_rms_norm) and against the same phases as three launches.

Qwen2.5-1.5B shapes (hidden 1536, 12 query heads, 2 KV heads, d = 128, bf16, random weights).
One compiled function runs L = 28 layers, each with its own weights and cache (x passes from
layer to layer, as in the model), so every weight and cache is read cold; the caches are
donated and updated in place, and each call feeds the next. Time per layer = device time
(sum of the GPU kernels of a call, from the profiler) / L. Bytes per layer = wq, wk, wv, w_o
and the biases and norms, plus the K/V cache read (context x 2 x KV heads x d x 2 bytes):
GB/s against the HBM read ceiling measured in the same run.

  python bench/attention_block.py [--quick] [--out DIR]    # GPU, ~1-2 min on an H200
  python bench/attention_block.py --smoke                  # tiny CPU run, interpret mode
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.common import log  # noqa: E402

import jaxflash  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shapes:
  hidden: int = 1536
  heads: int = 12
  kv_heads: int = 2
  head_dim: int = 128
  layers: int = 28


SMOKE = Shapes(hidden=128, heads=4, kv_heads=2, head_dim=32, layers=2)
VARIANTS = ("persistent", "persistent_3_launches", "apart")
LABELS = {"persistent": "decode_attention_block (1 launch)",
          "persistent_3_launches": "decode_attention_block, phases as 3 launches",
          "apart": "qkv_projection + decode + project_split_kv + add_rms_norm (4 launches)"}


def make_layers(shapes: Shapes, batch: int, capacity: int, paged: bool, seed: int = 0):
  """Per-layer weights and caches (random bf16), the block table and the counters."""
  s = shapes
  key = jax.random.key(seed)
  dt = jnp.bfloat16

  @jax.jit
  def one(key):
    ks = jax.random.split(key, 10)
    n = lambda k, shape, scale: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dt)
    weights = (n(ks[0], (s.hidden, s.heads * s.head_dim), s.hidden ** -0.5),
               n(ks[1], (s.hidden, s.kv_heads * s.head_dim), s.hidden ** -0.5),
               n(ks[2], (s.hidden, s.kv_heads * s.head_dim), s.hidden ** -0.5))
    biases = tuple(n(k, (w.shape[1],), 0.1) for k, w in zip(ks[3:6], weights))
    w_o = n(ks[6], (s.heads * s.head_dim, s.hidden), (s.heads * s.head_dim) ** -0.5)
    norms = (1.0 + n(ks[7], (s.hidden,), 0.1).astype(jnp.float32)).astype(dt), jnp.ones((s.hidden,), dt)
    cache_shape = ((batch * capacity // 16, 16) if paged else (batch, capacity)) + (s.kv_heads, s.head_dim)
    keys, values = n(ks[8], cache_shape, 1.0), n(ks[9], cache_shape, 1.0)
    return dict(weights=weights, biases=biases, w_o=w_o, norm=norms[0], mlp_norm=norms[1], keys=keys,
                values=values)

  layers = [one(k) for k in jax.random.split(key, shapes.layers)]
  table = None
  if paged:  # pages scattered at random, as a page allocator's would be
    perm = np.random.default_rng(seed).permutation(batch * capacity // 16).astype(np.int32)
    table = jnp.asarray(perm.reshape(batch, capacity // 16))
  return layers, table


def step_function(variant: str, shapes: Shapes, table):
  """(x, cos, sin, positions, lengths, layers, counters) -> the same, caches and counters updated."""
  def attention_half(x, cos, sin, positions, lengths, layer, counters):
    args = (x, layer["norm"], layer["weights"], layer["biases"], cos, sin)
    if variant != "apart":
      h, normed, keys, values, counters = jaxflash.decode_attention_block(
          *args, layer["keys"], layer["values"], positions, lengths, layer["w_o"], layer["mlp_norm"],
          head_dim=shapes.head_dim, block_table=table, counters=counters,
          one_launch=variant == "persistent")
    else:
      q, keys, values, counters = jaxflash.qkv_projection(
          *args, head_dim=shapes.head_dim, kv_cache=(layer["keys"], layer["values"]), positions=positions,
          block_table=table, counters=counters)
      q = q.reshape(x.shape[0], 1, shapes.heads, shapes.head_dim)
      if table is None:
        split = jaxflash.decode_attention(q, keys, values, lengths, return_partials=True)
      else:
        split = jaxflash.paged_decode_attention(q, keys, values, lengths, table, return_partials=True)
      partials = jaxflash.project_split_kv(split, layer["w_o"], return_partials=True)
      h, normed = jaxflash.add_rms_norm(x, partials[:, :, 0], layer["mlp_norm"])
    del normed  # computed by the same kernel as h (pallas calls are not pruned)
    return h, dict(layer, keys=keys, values=values), counters

  def run(x, cos, sin, positions, lengths, layers, counters):
    new_layers = []
    for layer in layers:
      x, layer, counters = attention_half(x, cos, sin, positions, lengths, layer, counters)
      new_layers.append(layer)
    return x, cos, sin, positions, lengths, new_layers, counters

  return jax.jit(run, donate_argnums=(5, 6))


def time_steps(fn, state, iters: int):
  """Device us per call of fn(*state) -> state, each call fed the last one's outputs."""
  for _ in range(2):
    state = fn(*state)
  jax.block_until_ready(state)
  if not common.has_gpu():
    import time
    t0 = time.perf_counter()
    for _ in range(iters):
      state = fn(*state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) * 1e6 / iters, {}, 0.0, state

  def run():
    nonlocal state
    for _ in range(iters):
      state = fn(*state)
    jax.block_until_ready(state)

  trace = common._profile(run)
  us, kernels, launches = common.summarize_kernels(common.gpu_kernel_events(trace), iters)
  return us, kernels, launches, state


def main(argv=None):
  parser = common.bench_arguments(__doc__, smoke="tiny shapes, interpret mode (CPU)", budget_s=240,
                                  quick="batch 1 at 1K only")
  args = parser.parse_args(argv)
  meta, out_dir = common.begin_run("attention_block", args, matmul_n=4096 if args.smoke else 8192,
                                   hbm_gib=0.25 if args.smoke else 4.0)
  shapes = SMOKE if args.smoke else Shapes()
  ceiling = meta["ceilings"].get("hbm_read_gbs")
  cells = [(1, 1024, False)] if args.quick or args.smoke else [
      (1, 1024, False), (1, 1024, True), (1, 8192, False), (1, 32768, False), (8, 1024, False)]
  budget = common.Budget(args.budget_s)
  rows = []
  for batch, context, paged in cells:
    capacity = context + 64
    layers, table = make_layers(shapes, batch, capacity, paged)
    weight_bytes = sum(x.size * x.dtype.itemsize for k, v in layers[0].items() if k not in ("keys", "values")
                       for x in jax.tree.leaves(v))
    kv_bytes = batch * context * 2 * shapes.kv_heads * shapes.head_dim * 2
    x = jax.random.normal(jax.random.key(1), (batch, shapes.hidden), jnp.float32).astype(jnp.bfloat16)
    angles = jnp.linspace(0.0, 100.0, shapes.head_dim // 2)[None, :].repeat(batch, 0)
    positions = jnp.full((batch,), context - 1, jnp.int32)
    counters = jnp.zeros((256,), jnp.int32)
    outputs = {}
    for variant in VARIANTS:
      if budget.exhausted():
        log(f"budget spent: {variant} at B={batch} x {context} skipped")
        continue
      fn = step_function(variant, shapes, table)
      state = (x, jnp.cos(angles), jnp.sin(angles), positions, positions + 1,
               [dict(layer) for layer in layers], counters)
      # The same inputs for every variant: the caches are copied, since each call donates them.
      state = state[:5] + ([jax.tree.map(jnp.copy, layer) for layer in layers], jnp.copy(counters))
      first, err = common.try_call(lambda: fn(*state))
      if err:
        rows.append(dict(batch=batch, context=context, cache="paged 16" if paged else "contiguous",
                         variant=LABELS[variant], error=err))
        log(f"B={batch} ctx={context} {variant}: ERROR {err[:400]}")
        continue
      outputs[variant] = np.asarray(first[0], np.float32)
      us, kernels, launches, _ = time_steps(fn, first, 3 if args.smoke else 20)
      per_layer = us / shapes.layers
      gbs = (weight_bytes + kv_bytes) / (per_layer * 1e-6) / 1e9
      row = dict(batch=batch, context=context, cache="paged 16" if paged else "contiguous", variant=LABELS[variant],
                 us_per_layer=per_layer, kernels_per_layer=launches / shapes.layers,
                 mb_per_layer=(weight_bytes + kv_bytes) / 1e6, gbs=gbs,
                 pct_ceiling=100 * gbs / ceiling if ceiling else None,
                 top_kernels={k[:60]: v / shapes.layers for k, v in list(kernels.items())[:6]})
      rows.append(row)
      log(f"B={batch} ctx={context} {'paged' if paged else 'contig'} {variant:24s} {per_layer:7.2f} us/layer "
          f"{launches / shapes.layers:4.1f} kernels  {gbs:6.0f} GB/s")
    if "apart" in outputs:  # the same layer outputs, whichever way they were computed
      for variant, out in outputs.items():
        err = float(np.max(np.abs(out - outputs["apart"])))
        for row in rows:
          if row.get("variant") == LABELS[variant] and row["batch"] == batch and row["context"] == context \
              and row["cache"] == ("paged 16" if paged else "contiguous"):
            row["max_diff_vs_apart"] = err
    del layers
    common.free_memory()
  for row in rows:
    if row.get("variant") == LABELS["persistent"]:
      apart = next((r for r in rows if r.get("variant") == LABELS["apart"] and r["batch"] == row["batch"]
                    and r["context"] == row["context"] and r["cache"] == row["cache"] and "us_per_layer" in r), None)
      if apart and "us_per_layer" in row:
        row["speedup_vs_apart"] = apart["us_per_layer"] / row["us_per_layer"]
  columns = ["batch", "context", "cache", "variant", "us_per_layer", "kernels_per_layer", "mb_per_layer", "gbs",
             "pct_ceiling", "speedup_vs_apart", "max_diff_vs_apart"]
  meta["title"] = "Decode step: a layer's attention half (Qwen2.5-1.5B shapes, bf16)"
  paths = common.write_results("attention_block", rows, meta, columns, out_dir=out_dir, plot={
      "kind": "bar", "x": "variant", "y": "us_per_layer", "ylabel": "us per layer (device time)",
      "title": "Attention half per layer, B=1 x 1K", "where": lambda r: r["batch"] == 1 and r["context"] == 1024
      and r["cache"] == "contiguous"})
  log(f"wrote {paths}")
  log(common.markdown_table(rows, columns))


if __name__ == "__main__":
  main()
