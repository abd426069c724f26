"""Decode over int8 / FP8 caches: which tiles carry a one-byte cache at the read ceiling.

A one-byte cache moves half the bytes of a bf16 one, so with the bf16 tiles (64 tokens, 4
stages) each pipeline stage has half the bytes in flight. This study times jaxflash's decode
(contiguous, and paged with 16-token pages through a random block table) over the same caches
quantized with `jaxflash.quantize_kv`, for a grid of DecodeConfigs, against the bf16 cache's
default at the same context: GB/s of the bytes read (values and float32 scales) and tokens/s
over bf16's. Method as bench/decode.py (cold caches: one compiled call over many layers,
each its own cache; device time).

  python -m bench.studies.quantized_decode_tiles [--rows 1x131072,16x4096] [--out DIR]   # GPU
  python -m bench.studies.quantized_decode_tiles --smoke                                 # CPU
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bench import decode as bd
from bench.cli import TimeLimit, begin_run, bench_arguments, log
from bench.report import STUDIES_DIR, format_value, markdown_table, write_results
from bench.timing import free_memory

KV_DTYPES = ("int8", "float8_e4m3fn")
# (block_k, num_warps, num_stages)
# 256-token tiles (4 and 8 warps, 2 stages) ran at 0.56-0.96x bf16 (2026-12-05): left out.
CONTIGUOUS_GRID = [(64, 4, 4), (128, 4, 3), (128, 4, 4), (128, 8, 3)]
PAGED_GRID = [(64, 4, 5), (128, 4, 5), (128, 4, 4)]


def _decode(config=None, paged=False):
  def run(q, k, v, lengths, *table):
    import jaxflash
    from jaxflash.decode import decode_attention
    from jaxflash.paged import paged_decode_attention
    cfg = None if config is None else jaxflash.DecodeConfig(*config)
    kernel = paged_decode_attention if paged else decode_attention
    if isinstance(k, tuple):
      return kernel(q, k[0], v[0], lengths, *table, config=cfg, k_scale=k[1], v_scale=v[1])
    return kernel(q, k, v, lengths, *table, config=cfg)
  return run


def study_row(batch, capacity, plan, ceiling, limit, contiguous_grid, paged_grid):
  sites, nsets = plan
  row = {"batch": batch, "context": capacity, "layers": sites * nsets, "errors": {}, "kernels": {},
         "max_abs_error": {}}
  layers = bd.make_layers(batch, capacity, sites * nsets, seed=capacity + batch)
  layer_sets = [layers[i * sites:(i + 1) * sites] for i in range(nsets)]
  lengths = jnp.full((batch,), capacity, jnp.int32)
  ref = bd.reference_layer0(layers[0], lengths)
  table = bd.random_block_table(batch, capacity // 16, seed=16)
  table_j = jnp.asarray(table)
  bf16_bytes = bd.cache_bytes(batch, capacity)

  def measure(group, sets, shared, nbytes):
    timings = bd.time_group(group, sets, shared, limit, row)
    for name in group:
      bd.record(row, name, timings.get(name), sites, nbytes, ceiling)
      if name in timings and not isinstance(timings[name], dict):
        row["max_abs_error"][name] = bd.max_error(timings[name], ref)

  measure({"bf16": _decode()}, layer_sets, (lengths,), bf16_bytes)
  paged_bf16 = [[(q, bd.to_pages(k, table, 16), bd.to_pages(v, table, 16)) for q, k, v in ls]
                for ls in layer_sets]
  measure({"bf16_paged16": _decode(paged=True)}, paged_bf16, (lengths, table_j), bf16_bytes)
  del paged_bf16
  import jaxflash
  for kv_dtype in KV_DTYPES:
    quantize = jax.jit(lambda x, d=jnp.dtype(kv_dtype): jaxflash.quantize_kv(x, d))
    sets = [[(q, quantize(k), quantize(v)) for q, k, v in ls] for ls in layer_sets]
    nbytes = bd.quantized_bytes(batch, capacity, kv_dtype)
    group = {f"{kv_dtype}_bk{b}_w{w}_s{s}": _decode((b, w, s)) for b, w, s in contiguous_grid}
    measure(group, sets, (lengths,), nbytes)
    paged = [[(q, *(tuple(bd.to_pages(x, table, 16) for x in pair) for pair in (k, v))) for q, k, v in ls]
             for ls in sets]
    group = {f"{kv_dtype}_paged16_bk{b}_w{w}_s{s}": _decode((b, w, s), paged=True) for b, w, s in paged_grid}
    measure(group, paged, (lengths, table_j), nbytes)
    del sets, paged
    free_memory()
  for key in [k for k in row if k.endswith("_us") and not k.startswith("bf16")]:
    base = row.get("bf16_paged16_us" if "_paged16_" in key else "bf16_us")
    row[key.replace("_us", "_tokens_over_bf16")] = base / row[key] if base and row[key] else None
  return row


def table_rows(rows):
  """One line per (row, cache, config): us, GB/s, % of the ceiling, tokens/s over bf16."""
  out = []
  for r in rows:
    for key in sorted(k for k in r if k.endswith("_us")):
      name = key[:-3]
      out.append({"size": f"{r['batch']} × {r['context']}", "config": name, "us": r[key],
                  "gbs": r.get(f"{name}_gbs"), "pct": r.get(f"{name}_pct"),
                  "over_bf16": r.get(f"{name}_tokens_over_bf16"),
                  "err": r["max_abs_error"].get(name)})
  return out


def main(argv=None):
  p = bench_arguments(__doc__, smoke="tiny CPU run end to end (interpret mode)", time_limit_s=400.0)
  p.add_argument("--rows", default="1x131072,16x4096,1x32768", help="BxS cells")
  p.add_argument("--min-mib", type=float, default=1024.0, help="caches per row, MiB (cold reads)")
  args = p.parse_args(argv)
  args.quick = False
  limit = TimeLimit(args.time_limit_s)
  if args.smoke:
    spec, grid, paged_grid = [(1, 256)], [(64, 4, 2), (128, 4, 2)], [(64, 4, 2)]
    plan_args, ceiling_args = (2 * bd.MIB, 2), dict(matmul_n=256, hbm_gib=1 / 64)
  else:
    spec = [tuple(int(x) for x in c.split("x")) for c in args.rows.split(",")]
    grid, paged_grid = CONTIGUOUS_GRID, PAGED_GRID
    plan_args, ceiling_args = (int(args.min_mib * bd.MIB), 64), dict(matmul_n=8192, hbm_gib=4.0)
  meta, out_dir = begin_run("quantized_decode_tiles", args, **ceiling_args)
  if not args.smoke and args.out is None:
    out_dir = STUDIES_DIR
  ceiling = meta["ceilings"].get("hbm_read_gbs")
  meta["title"] = "Decode over int8 / FP8 caches by tile config (12 / 2 heads, d = 128)"
  rows, notes = [], []
  for batch, capacity in spec:
    if limit.exhausted():
      notes.append(f"B={batch} context={capacity}: skipped (time limit)")
      continue
    log(f"[{limit.elapsed():6.1f}s] B={batch} context={capacity}")
    rows.append(study_row(batch, capacity, bd.layer_plan(batch, capacity, *plan_args), ceiling, limit,
                          grid, paged_grid))
    for line in table_rows(rows[-1:]):
      log(f"  {line['config']:32s} {format_value(line['us'])} us {format_value(line['gbs'])} GB/s "
          f"x{format_value(line['over_bf16'])} err {format_value(line['err'])}")
    write_results("quantized_decode_tiles", table_rows(rows), meta,
                  [("size", "B × context"), ("config", "cache / config"), ("us", "µs", "{:.2f}"),
                   ("gbs", "GB/s", "{:.0f}"), ("pct", "% ceiling", "{:.1f}"),
                   ("over_bf16", "tokens/s ÷ bf16", "{:.2f}"), ("err", "max err", "{:.4f}")],
                  out_dir=out_dir, notes=notes)
  return rows


if __name__ == "__main__":
  main()
