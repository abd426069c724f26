"""Decode with options: a sliding window over a long cache, and large GQA groups.

Windowed: batch 1, 128K-token caches, a window of the last 4096 keys (local_window_size =
(4095, 0)); jaxflash windowed (contiguous, and paged with 16-token pages) against jaxflash
and cuDNN on a plain 4096-token cache, and cuDNN through jax.nn with the same
local_window_size on the 128K cache (its T = 1 window alignment is its own: its max error
against the bottom-right reference is in the table). GB/s count only the window's bytes
(4096 keys x KV heads x head dim x 2 bytes x 2), so a kernel that reads the whole cache
scores 32x lower. Issue 22's target: windowed >= 0.9x the plain 4K decode.

Large GQA: batch 1 at 8K, one KV head with 8, 32 and 128 query heads (MQA), d = 128:
jaxflash against cuDNN and XLA through jax.nn; GB/s of K+V read.

Method as bench/decode.py: one compiled call runs L layers, each with its own cache, and
the bytes those layers touch (windows only, for the windowed rows) add up to at least
--min-mib, so every read is cold (the H200's L2 holds 60 MB); time per layer = device time /
L. Layer 0's answer is checked against a float32 jax.nn reference of the same semantics.

  python -m bench.studies.decode_options [--out DIR]     # GPU (H200: ~3 min, ~40 GB of caches)
  python -m bench.studies.decode_options --smoke         # tiny CPU run, interpret mode
"""
from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

from bench import timing
from bench.cli import TimeLimit, begin_run, bench_arguments, log
from bench.report import STUDIES_DIR
from bench.decode import HEAD_DIM, make_layers
from bench.report import markdown_table, value_with_pct, write_results

KV_HEADS = 2
MIB = 2**20
LABELS = {"jaxflash_window": "jaxflash windowed", "jaxflash_paged16_window": "jaxflash paged 16 windowed",
          "jaxflash_plain": "jaxflash plain (window-sized cache)", "cudnn_window": "cuDNN windowed (jax.nn)",
          "cudnn_plain": "cuDNN plain (window-sized cache)", "jaxflash": "jaxflash",
          "cudnn": "cuDNN (jax.nn)", "xla": "jax.nn xla"}


def _decode(**options):
  def run(q, k, v, lengths):
    import jaxflash
    return jaxflash.decode_attention(q, k, v, lengths, **options)
  return run


def _paged_decode(page: int, **options):
  def run(q, k, v, lengths):  # k, v here are pools [P, page, K, H]; the table is the identity
    import jaxflash
    table = jnp.arange(k.shape[0], dtype=jnp.int32).reshape(q.shape[0], -1)
    return jaxflash.paged_decode_attention(q, k, v, lengths, table, **options)
  return run


def _jax_nn(implementation: str, **options):
  def run(q, k, v, lengths):
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                        implementation=implementation, **options)
  return run


def _reference(layer, lengths, window):
  """Layer 0 in float32 (full-precision matmuls): the query at length - 1 sees the last
  left + 1 keys (jaxflash's semantics, through its plain-JAX reference)."""
  import jaxflash
  q, k, v = (x.astype(jnp.float32) for x in layer)
  with _highest_precision():
    out, _ = jax.jit(lambda q, k, v, n: jaxflash.attention_reference(
        q, k, v, scale=q.shape[-1] ** -0.5, key_value_seq_lengths=n,
        local_window_size=window))(q, k, v, lengths)
  return out


def _highest_precision():
  """Full-precision float32 matmuls for the reference (XLA may otherwise use TF32)."""
  ctx = getattr(jax, "default_matmul_precision", None)
  return ctx("highest") if ctx is not None else contextlib.nullcontext()


def time_cells(cells: dict, layers: list, lengths, max_sites: int, touched: int, time_limit, row: dict,
               window=None, ref_layer=None):
  """Times each cell {name: attention(q, k, v, lengths)} over the layers (several argument
  sets past max_sites layers per call), records GB/s of `touched` bytes per layer and layer
  0's max error against the float32 reference (of `ref_layer`, default layers[0])."""
  sites = min(len(layers), max_sites)
  sets = [layers[i:i + sites] for i in range(0, len(layers) - sites + 1, sites)]
  arg_sets = timing.ArgSets([(tuple(l[0] for l in s), tuple(l[1] for l in s), tuple(l[2] for l in s), lengths)
                             for s in sets])

  def over_layers(attention):
    return lambda qs, ks, vs, n: [attention(q, k, v, n) for q, k, v in zip(qs, ks, vs)]

  cases = {}
  for name, fn in cells.items():
    if time_limit.exhausted():
      row["errors"][name] = "skipped: time time_limit"
    else:
      cases[name] = (over_layers(fn), arg_sets)
  timings = timing.device_times_us(cases, max_iters=max(3, min(timing.MAX_ITERS, 512 // sites)),
                                   keep_output=True, log=log)
  ref = _reference(ref_layer or layers[0], lengths, window)
  for name, result in timings.items():
    if not isinstance(result, timing.Timing):
      row["errors"][name] = result["error"]
      continue
    us = result.us / sites
    row[f"{name}_us"], row[f"{name}_gbs"] = us, touched / (us * 1e-6) / 1e9
    if result.output:
      row["max_abs_error"][name] = float(jnp.max(jnp.abs(
          result.output[0].reshape(ref.shape).astype(jnp.float32) - ref)))
  return row


def windowed_row(capacity: int, window: int, page: int, min_bytes: int, max_sites: int, time_limit) -> dict:
  """The window rows: (left, right) = (window - 1, 0), lengths = capacity."""
  window_size = (window - 1, 0)
  touched = window * KV_HEADS * HEAD_DIM * 2 * 2
  count = max(2, math.ceil(min_bytes / touched))
  row = {"case": f"window {window} of {capacity}", "context": capacity, "window": window, "layers": count,
         "bytes_per_layer": touched, "errors": {}, "max_abs_error": {}}
  lengths = jnp.full((1,), capacity, jnp.int32)
  layers = make_layers(1, capacity, count, seed=1, heads=12, kv_heads=KV_HEADS)
  time_cells({"jaxflash_window": _decode(local_window_size=window_size),
              "cudnn_window": _jax_nn("cudnn", local_window_size=window_size)},
             layers, lengths, max_sites, touched, time_limit, row, window=window_size)
  # The same tokens as a pool of pages in order (the identity table): layer 0's reference is
  # the contiguous one.
  first = layers[0]
  pools = []
  while layers:
    q, k, v = layers.pop(0)
    pools.append((q, k.reshape(-1, page, KV_HEADS, HEAD_DIM), v.reshape(-1, page, KV_HEADS, HEAD_DIM)))
  time_cells({"jaxflash_paged16_window": _paged_decode(page, local_window_size=window_size)}, pools, lengths,
             max_sites, touched, time_limit, row, window=window_size, ref_layer=first)
  del pools, first
  timing.free_memory()
  # The same window read as a whole cache: the plain kernels on window-sized caches.
  plain = make_layers(1, window, count, seed=2, heads=12, kv_heads=KV_HEADS)
  time_cells({"jaxflash_plain": _decode(), "cudnn_plain": _jax_nn("cudnn")}, plain,
             jnp.full((1,), window, jnp.int32), max_sites, touched, time_limit, row)
  del plain
  timing.free_memory()
  for name in ("jaxflash_paged16_window", "cudnn_window", "jaxflash_window"):
    num, den = row.get(f"{name}_gbs"), row.get("jaxflash_plain_gbs")
    row[f"{name}_over_plain"] = num / den if num and den else None
  return row


def gqa_row(capacity: int, heads: int, min_bytes: int, max_sites: int, time_limit) -> dict:
  touched = capacity * 1 * HEAD_DIM * 2 * 2
  count = max(2, math.ceil(min_bytes / touched))
  row = {"case": f"{heads} q heads / 1 KV head at {capacity}", "context": capacity, "heads": heads,
         "layers": count, "bytes_per_layer": touched, "errors": {}, "max_abs_error": {}}
  layers = make_layers(1, capacity, count, seed=heads, heads=heads, kv_heads=1)
  time_cells({"jaxflash": _decode(), "cudnn": _jax_nn("cudnn"), "xla": _jax_nn("xla")}, layers,
             jnp.full((1,), capacity, jnp.int32), max_sites, touched, time_limit, row)
  del layers
  timing.free_memory()
  num, den = row.get("jaxflash_gbs"), row.get("cudnn_gbs")
  row["jaxflash_over_cudnn"] = num / den if num and den else None
  return row


def main(argv=None):
  limit = 420.0
  try:
    p = bench_arguments(__doc__, smoke="tiny CPU run end to end (interpret mode)", time_limit_s=limit,
                        quick="the windowed row only")
  except TypeError:  # before the split the option had its older name
    p = bench_arguments(__doc__, smoke="tiny CPU run end to end (interpret mode)", budget_s=limit,
                        quick="the windowed row only")
  p.add_argument("--min-mib", type=float, default=512.0, help="bytes the layers of a row touch, MiB")
  p.add_argument("--max-sites", type=int, default=64, help="layers per compiled call")
  p.set_defaults(out=str(STUDIES_DIR))  # a study's results stay out of the benchmark index
  args = p.parse_args(argv)
  time_limit = TimeLimit(getattr(args, "time_limit_s", None) or getattr(args, "budget_s", limit))
  if args.smoke:
    capacity, window, page, gqa_context, gqa_heads = 512, 64, 16, 256, (8, 32, 128)
    min_bytes, max_sites, ceiling_args = 256 * 1024, 2, dict(matmul_n=256, hbm_gib=1 / 64)
  else:
    capacity, window, page, gqa_context, gqa_heads = 131072, 4096, 16, 8192, (8, 32, 128)
    min_bytes, max_sites = int(args.min_mib * MIB), args.max_sites
    ceiling_args = dict(matmul_n=8192, hbm_gib=4.0)
  meta, out_dir = begin_run("decode_options", args, **ceiling_args)
  ceiling = meta["ceilings"].get("hbm_read_gbs")
  meta.update(title="Decode with options: sliding window and large GQA groups (GB/s on device time)",
              shapes=dict(window_rows=dict(batch=1, num_heads=12, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                           local_window_size=[window - 1, 0], context=capacity),
                          gqa_rows=dict(batch=1, num_kv_heads=1, head_dim=HEAD_DIM, context=gqa_context),
                          dtype="bfloat16", lengths="= capacity"),
              method=(f"one compiled call over L layers, each its own cache, the bytes they touch >= "
                      f"{min_bytes / MIB:.1f} MiB (at most {max_sites} layers a call, rotating between "
                      "argument sets beyond); time per layer = device time / layers per call"),
              bytes="windowed rows: the window's K + V only; GQA rows: K + V of the whole length")

  rows, notes = [], []
  got, err = timing.try_call(windowed_row, capacity, window, page, min_bytes, max_sites, time_limit)
  if err:
    notes.append(f"windowed row failed: {err[:300]}")
  else:
    rows.append(got)
  if not args.quick:
    for heads in gqa_heads:
      got, err = timing.try_call(gqa_row, gqa_context, heads, min_bytes, max_sites, time_limit)
      if err:
        notes.append(f"GQA {heads} row failed: {err[:300]}")
      else:
        rows.append(got)
  for row in rows:
    for name, e in row["errors"].items():
      notes.append(f"{row['case']} {LABELS.get(name, name)}: {e[:300]}")
    for name, e in row["max_abs_error"].items():
      if e > 0.05:
        notes.append(f"{row['case']} {LABELS.get(name, name)}: max abs error vs float32 = {e:.3g}")
    for name in LABELS:
      if row.get(f"{name}_gbs") and ceiling:
        row[f"{name}_pct"] = 100 * row[f"{name}_gbs"] / ceiling
  columns = [("case", "case"), ("layers", "L")]
  columns += [(lambda r, n=n: value_with_pct(r, f"{n}_gbs", f"{n}_pct"), LABELS[n]) for n in LABELS]
  columns += [("jaxflash_window_over_plain", "windowed / plain", "{:.2f}"),
              ("cudnn_window_over_plain", "cuDNN windowed / jaxflash plain", "{:.2f}"),
              ("jaxflash_over_cudnn", "jaxflash / cuDNN", "{:.2f}")]
  paths = write_results("decode_options", rows, meta, columns, out_dir=out_dir, notes=notes)
  log(markdown_table(rows, columns))
  log(f"results in {paths['json']}")


if __name__ == "__main__":
  main()
