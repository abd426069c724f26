"""Paged prefill against contiguous prefill at the same lengths (device time).

Qwen2.5-1.5B attention (12 query heads, 2 KV heads, head dim 128, bf16, causal,
bottom-right): batch 1 with n = 4096 ... 32768 keys, for a whole prompt (T = n new tokens)
and for one chunk of chunked prefill (the last T = 512 tokens over n keys). The contiguous
kernel (jaxflash.prefill.prefill_attention) reads [1, n, K, H] caches; the paged one
(jaxflash.paged_prefill_attention) reads the same keys scattered over a pool of 16- or
64-token pages through a random block table. On sm_90 the Mosaic prefill joins, over the
cache and over the same pools (jaxflash.mosaic.prefill_attention(block_table=)), its paged
time given over its contiguous time. All run in one profiler session per row.
TFLOP/s count 4 d per visible (query, key) pair and head.

  python -m bench.paged_prefill [--quick] [--out DIR]     # GPU, ~1-2 min on an H200
  python -m bench.paged_prefill --smoke                   # tiny CPU run, interpret mode
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import timing
from bench.cli import log
from bench.report import format_value, value_with_pct
from bench.runner import Benchmark, Run
from bench.runner import main as run_benchmark

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128
DTYPE = jnp.bfloat16
CHUNK = 512


def causal_pairs(t: int, n: int) -> int:
  """Visible (query, key) pairs when t queries are the last t of n keys."""
  return t * (n - t) + t * (t + 1) // 2


def bench_row(n: int, t: int, page_sizes, ceiling):
  from jaxflash import mosaic
  from jaxflash.paged_prefill import paged_prefill_attention
  from jaxflash.prefill import prefill_attention

  rng = np.random.default_rng(n + t)
  key = jax.random.key(n + t)
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (1, t, NUM_HEADS, HEAD_DIM), DTYPE)
  k = jax.random.normal(kk, (1, n, NUM_KV_HEADS, HEAD_DIM), DTYPE)
  v = jax.random.normal(kv, (1, n, NUM_KV_HEADS, HEAD_DIM), DTYPE)
  q_len = jnp.asarray([t], jnp.int32)
  kv_len = jnp.asarray([n], jnp.int32)
  cases = {"contiguous": (lambda q, k, v, ql, kl: prefill_attention(q, k, v, ql, kl, is_causal=True),
                          (q, k, v, q_len, kv_len))}
  # On sm_90 the Mosaic prefill too, over the cache and over the same pools.
  with_mosaic = mosaic.supports(q, k, v, q_len, kv_len, is_causal=True) is None
  if with_mosaic:
    cases["mosaic"] = (lambda q, k, v, ql, kl: mosaic.prefill_attention(q, k, v, ql, kl, is_causal=True),
                       (q, k, v, q_len, kv_len))
  for page in page_sizes:
    pages = n // page
    table = rng.permutation(pages)  # logical page j -> a random pool page
    pool = np.zeros((pages, page, NUM_KV_HEADS, HEAD_DIM), np.float32)
    k_pool = jnp.asarray(pool, DTYPE).at[table].set(k[0].reshape(pages, page, NUM_KV_HEADS, HEAD_DIM))
    v_pool = jnp.asarray(pool, DTYPE).at[table].set(v[0].reshape(pages, page, NUM_KV_HEADS, HEAD_DIM))
    paged_args = (q, k_pool, v_pool, kv_len, jnp.asarray(table[None], jnp.int32), q_len)
    cases[f"paged{page}"] = (
        lambda q, kp, vp, kl, tb, ql: paged_prefill_attention(q, kp, vp, kl, tb, ql, is_causal=True),
        paged_args)
    if with_mosaic:
      cases[f"mosaic_paged{page}"] = (
          lambda q, kp, vp, kl, tb, ql: mosaic.prefill_attention(q, kp, vp, ql, kl, is_causal=True,
                                                                 block_table=tb), paged_args)
  timings = timing.device_times_us(cases, keep_output=True, log=log)
  flops = 4 * causal_pairs(t, n) * HEAD_DIM * NUM_HEADS
  row = {"n": n, "t": t, "errors": {}}
  reference = getattr(timings.get("contiguous"), "output", None)
  for name, measured in timings.items():
    if isinstance(measured, dict):
      row["errors"][name] = measured["error"]
      continue
    row[f"{name}_us"] = measured.us
    row[f"{name}_tflops"] = flops / measured.us / 1e6
    if ceiling:
      row[f"{name}_pct"] = 100 * row[f"{name}_tflops"] / ceiling
    if name != "contiguous" and reference is not None:
      row[f"{name}_max_diff"] = float(jnp.max(jnp.abs(measured.output.astype(jnp.float32)
                                                      - reference.astype(jnp.float32))))
      row[f"{name}_over_contiguous"] = measured.us / row["contiguous_us"] if "contiguous_us" in row else None
    if name.startswith("mosaic_paged") and "mosaic_us" in row:
      row[f"{name}_over_mosaic"] = measured.us / row["mosaic_us"]
  return row


def columns(page_sizes):
  cols = [("n", "keys n"), ("t", "new tokens T"),
          (lambda r: value_with_pct(r, "contiguous_tflops", "contiguous_pct"), "contiguous TFLOP/s"),
          ("contiguous_us", "contiguous us")]
  for page in page_sizes:
    cols += [(f"paged{page}_us", f"paged {page} us"),
             (f"paged{page}_over_contiguous", f"paged {page} / contiguous", "{:.3f}"),
             (f"paged{page}_max_diff", f"paged {page} max |diff|")]
  cols.append(("mosaic_us", "Mosaic contiguous us"))
  for page in page_sizes:
    cols += [(f"mosaic_paged{page}_over_mosaic", f"Mosaic paged {page} / Mosaic contiguous", "{:.3f}"),
             (f"mosaic_paged{page}_max_diff", f"Mosaic paged {page} max |diff|")]
  return cols


PAGE_SIZES = (16, 64)


def collect(args, run: Run):
  """Rows of contiguous and paged prefill at each length, for a whole prompt and for a chunk."""
  if args.smoke:
    ns, chunk = [128, 256], 64
  else:
    ns, chunk = ([4096, 32768] if args.quick else [4096, 8192, 16384, 32768]), CHUNK
  run.meta.update(shapes=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                              dtype="bfloat16", causal="bottom_right", batch=1),
                  flops="4 d per visible (query, key) pair and head")
  ceiling = run.meta["ceilings"].get("matmul_tflops")
  rows, notes = [], []
  for n in ns:
    for t in (n, chunk):
      if run.limit.exhausted():
        notes.append(f"n={n} T={t}: skipped (time limit)")
        continue
      log(f"[{run.limit.elapsed():6.1f}s] n={n} T={t}")
      row, err = timing.try_call(bench_row, n, t, PAGE_SIZES, ceiling)
      if err:
        notes.append(f"n={n} T={t}: row failed: {err[:300]}")
        continue
      notes += [f"n={n} T={t} {name}: {e[:300]}" for name, e in row.pop("errors").items()]
      log("  " + ", ".join(f"{k} {format_value(row.get(k))}" for k in row if k.endswith("_us")))
      rows.append(row)
      run.save(rows, notes)
  return rows, notes


BENCHMARK = Benchmark(
    name="paged_prefill", doc=__doc__, collect=collect, columns=columns(PAGE_SIZES), time_limit_s=240.0,
    smoke="tiny CPU run end to end (interpret mode)", quick="4K and 32K keys only",
    plot={"x": "n", "y": [f"paged{p}_over_contiguous" for p in PAGE_SIZES], "logx": True,
          "where": lambda r: r["t"] == r["n"], "xlabel": "keys n (whole prompt, batch 1)",
          "ylabel": "paged time / contiguous time", "title": "Paged prefill overhead",
          "labels": {f"paged{p}_over_contiguous": f"{p}-token pages" for p in PAGE_SIZES}})


def main(argv=None):
  run_benchmark(BENCHMARK, argv)
  return 0


if __name__ == "__main__":
  main()
