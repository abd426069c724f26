"""Prefill with options: a sliding window, a mask and a bias; jaxflash against cuDNN (jax.nn).

Shapes as bench/prefill.py (Qwen2.5-1.5B attention: 12 query heads, 2 KV heads, head dim 128,
bf16, batch 1), causal. Every contender of a row runs under one profiler trace, timed on device
time (bench/timing.py).

- Windowed causal prefill at n = 32768, w = 4096 and 1024 (`local_window_size=(w, 0)`):
  jaxflash with the window, cuDNN through jax.nn with the same window, and jaxflash without
  a window. TFLOP/s count only in-window work, 4 d per visible (query, key) pair per head
  (w (w + 1) / 2 + (n - w)(w + 1) pairs; n (n + 1) / 2 without a window), so a windowed
  kernel that skips the blocks outside the window runs at about the unwindowed one's rate.
- Mask and bias at n = 8192, causal, jaxflash and cuDNN given the same arrays: a [1, 1, n, n]
  document mask (documents of 1024 tokens), an ALiBi bias [1, N, n, n] and a [1, 1, n, n]
  bias; plus jaxflash causal with neither. TFLOP/s count the causal pairs.
- The max abs error of each jaxflash option against jax.nn's float32 "xla" path at a smaller n.

  python -m bench.windowed [--out DIR]     # GPU, a few minutes on an H200
  python -m bench.windowed --smoke         # tiny CPU run, interpret mode (cuDNN cells fail)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.cli import log
from bench.report import format_value, markdown_table
from bench.runner import Benchmark, Run
from bench.runner import main as run_benchmark
from bench.timing import device_times_us, free_memory, try_call

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128
DTYPE = jnp.bfloat16
IMPLS = ("jaxflash", "cudnn", "jaxflash_no_window")
LABELS = {"jaxflash": "jaxflash", "cudnn": "cuDNN (jax.nn)",
          "jaxflash_no_window": "jaxflash, no window / no option"}


def jaxflash_fn(**options):
  import jaxflash  # here: an import error is one cell's error
  return lambda q, k, v, *arrays: jaxflash.attention(q, k, v, *arrays, is_causal=True, **options)


def cudnn_fn(**options):
  return lambda q, k, v, *arrays: jax.nn.dot_product_attention(
      q, k, v, *arrays, is_causal=True, implementation="cudnn", **options)


def make_inputs(n: int, seed: int = 0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (1, n, NUM_HEADS, HEAD_DIM), DTYPE),
          jax.random.normal(kk, (1, n, NUM_KV_HEADS, HEAD_DIM), DTYPE),
          jax.random.normal(kv, (1, n, NUM_KV_HEADS, HEAD_DIM), DTYPE))


def window_pairs(n: int, w: int | None) -> int:
  """Visible (query, key) pairs of causal attention over n tokens with window (w, 0)."""
  if w is None or w >= n:
    return n * (n + 1) // 2
  return w * (w + 1) // 2 + (n - w) * (w + 1)


def tflops(pairs: int, us: float) -> float:
  return 4 * HEAD_DIM * NUM_HEADS * pairs / (us * 1e-6) / 1e12


def document_mask(n: int, doc: int):
  """[1, 1, n, n] bool: a token sees the tokens of its own document (packed sequences)."""
  ids = jnp.arange(n) // doc
  return (ids[:, None] == ids[None, :])[None, None]


def alibi_bias(n: int, heads: int):
  """[1, heads, n, n] bf16: ALiBi's -slope_h * (distance) (Press et al., Train Short, Test Long)."""
  slopes = 2.0 ** (-8.0 * (jnp.arange(heads) + 1) / heads)
  distance = jnp.abs(jnp.arange(n)[:, None] - jnp.arange(n)[None, :]).astype(jnp.float32)
  return (-slopes[:, None, None] * distance)[None].astype(DTYPE)


def _timed_row(row: dict, cases: dict, pairs: dict) -> dict:
  timings = device_times_us(cases, log=log)
  for impl, t in timings.items():
    if isinstance(t, dict):
      row["errors"][impl] = t["error"]
      row[f"{impl}_tflops"] = None
      continue
    row[f"{impl}_us"] = t.us
    row[f"{impl}_tflops"] = tflops(pairs[impl], t.us)
    row["method"] = t.method
  return row


def window_row(n: int, w: int, time_limit) -> dict:
  row = {"case": f"window ({w}, 0)", "n": n, "w": w, "errors": {}}
  q, k, v = make_inputs(n)
  cases = {"jaxflash": (jaxflash_fn(local_window_size=(w, 0)), (q, k, v)),
           "cudnn": (cudnn_fn(local_window_size=(w, 0)), (q, k, v)),
           "jaxflash_no_window": (jaxflash_fn(), (q, k, v))}
  if time_limit.exhausted():
    return {**row, "errors": {i: "skipped: time limit" for i in cases}}
  pairs = {"jaxflash": window_pairs(n, w), "cudnn": window_pairs(n, w),
           "jaxflash_no_window": window_pairs(n, None)}
  row = _timed_row(row, cases, pairs)
  jf, cu, full = (row.get(f"{i}_tflops") for i in IMPLS)
  row["window_over_no_window"] = jf / full if jf and full else None  # issue 22: >= 0.9
  row["jf_over_cudnn"] = jf / cu if jf and cu else None  # issue 22: >= 1.0
  row["speedup_over_no_window"] = (row["jaxflash_no_window_us"] / row["jaxflash_us"]
                                   if jf and full else None)
  free_memory()
  return row


def option_row(n: int, name: str, bias, mask, time_limit) -> dict:
  row = {"case": name, "n": n, "w": None, "errors": {}}
  q, k, v = make_inputs(n)
  arrays = (q, k, v, bias, mask)
  cases = {"jaxflash": (jaxflash_fn(), arrays), "cudnn": (cudnn_fn(), arrays),
           "jaxflash_no_window": (jaxflash_fn(), (q, k, v))}
  if time_limit.exhausted():
    return {**row, "errors": {i: "skipped: time limit" for i in cases}}
  pairs = {impl: window_pairs(n, None) for impl in cases}
  row = _timed_row(row, cases, pairs)
  jf, cu = row.get("jaxflash_tflops"), row.get("cudnn_tflops")
  row["jf_over_cudnn"] = jf / cu if jf and cu else None
  free_memory()
  return row


def accuracy(n: int, w: int) -> dict:
  """Max abs error of jaxflash with each option against jax.nn "xla" in float32."""
  import jaxflash
  q, k, v = make_inputs(n, seed=1)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  options = {"window": dict(local_window_size=(w, 0)),
             "mask": dict(mask=document_mask(n, max(n // 8, 1))),
             "bias": dict(bias=alibi_bias(n, NUM_HEADS))}
  errors = {}
  for name, opts in options.items():
    got = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True, **opts))(q, k, v)
    ref_opts = {key: (x.astype(jnp.float32) if key == "bias" else x) for key, x in opts.items()}
    with jax.default_matmul_precision("highest"):
      want = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="xla", **ref_opts))(*f32)
    errors[name] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
  return errors


def columns():
  return [("case", "case"), ("n", "n"),
          *[(f"{i}_tflops", LABELS[i]) for i in IMPLS],
          ("window_over_no_window", "window / no window", "{:.2f}"),
          ("jf_over_cudnn", "jaxflash / cuDNN", "{:.2f}"),
          ("speedup_over_no_window", "time saved (x)", "{:.2f}")]


def collect(args, run: Run):
  """The window rows at 32K, the mask and bias rows at 8K, and the accuracy note."""
  if args.smoke:
    window_n, windows, option_n, doc, acc_n = 256, (64, 32), 128, 32, 64
  else:
    window_n, windows, option_n, doc, acc_n = 32768, (4096, 1024), 8192, 1024, 2048
    windows = windows[:1] if args.quick else windows
  run.meta.update(
      title="Prefill with a sliding window, a mask or a bias: TFLOP/s of in-window work",
      shapes=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                  dtype="bfloat16", causal=True, batch=1),
      flops="4 d per visible (query, key) pair per head: window (w, 0) pairs for windowed "
            "rows, causal pairs otherwise")

  rows, notes = [], []
  cells = [("window", w) for w in windows] + [
      ("mask", "document mask [1, 1, n, n]"), ("alibi", "ALiBi bias [1, N, n, n]"),
      ("bias", "bias [1, 1, n, n]")]
  for kind, what in cells:
    log(f"[{run.limit.elapsed():6.1f}s] {kind} {what}")
    if kind == "window":
      row, err = try_call(window_row, window_n, what, run.limit)
    else:
      n = option_n
      bias = mask = None
      if kind == "mask":
        mask = document_mask(n, doc)
      elif kind == "alibi":
        bias = alibi_bias(n, NUM_HEADS)
      else:
        bias = alibi_bias(n, 1)
      row, err = try_call(option_row, n, what, bias, mask, run.limit)
      del bias, mask
    if err:
      notes.append(f"{kind} {what}: row failed: {err[:300]}")
      log(f"  row failed: {err}")
      continue
    rows.append(row)
    for impl, e in row["errors"].items():
      notes.append(f"{row['case']} n={row['n']} {LABELS[impl]}: {e[:300]}")
    log("  " + ", ".join(f"{i} {format_value(row.get(f'{i}_tflops'))}" for i in IMPLS))
    run.save(rows, notes)

  acc, err = try_call(accuracy, acc_n, max(acc_n // 8, 1))
  run.meta["accuracy"] = {"n": acc_n, "reference": "jax.nn xla, float32 (precision highest), same bf16 inputs",
                          "max_abs_error": acc if acc else err}
  notes.append(f"max abs error vs jax.nn float32 at n={acc_n}: {acc if acc else err}")
  notes.append("window / no window: jaxflash's in-window TFLOP/s with the window over its causal "
               "TFLOP/s without one (issue 22 asks >= 0.9); jaxflash / cuDNN asks >= 1.0.")
  log(markdown_table(rows, columns()))
  return rows, notes


BENCHMARK = Benchmark(name="windowed", doc=__doc__, collect=collect, columns=columns(), time_limit_s=420.0,
                      smoke="tiny CPU run end to end (interpret mode)", quick="one window size")


def main(argv=None):
  return run_benchmark(BENCHMARK, argv)


if __name__ == "__main__":
  main()
