"""Causal prefill: jaxflash against cuDNN, FlashAttention-3, tokamax, XLA, textbook attention
and JAX's Pallas `mha`.

The shapes of "Writing an Attention Kernel: FlashAttention and Decode in Triton" (Qwen2.5-1.5B
attention): 12 query heads, 2 KV heads, head dim 128, bf16, causal; batch 1 at n = 512 ...
32768 and batch 4 at 4096. Every implementation of a row runs in one process under one
profiler trace, and is timed on device time (the sum of the GPU kernels one call launches,
bench/timing.py). TFLOP/s count FLOPs as "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning" does: 4 n^2 d per head, halved for causal. The ceiling is
a bf16 8192^3 matmul measured in the same run.

Also: the peak scratch memory of each implementation, the max abs error against a float32
XLA reference at one size, and a tuning sweep of the kernel at n = 8192 (block_q x block_k
x warps x stages).

  python -m bench.prefill [--quick] [--no-sweep] [--out DIR]    # GPU, <= ~7 min on an H200
  python -m bench.prefill --no-sweep --impls jaxflash cudnn fa3 tokamax --sizes 8192 32768
  python -m bench.prefill --smoke                               # tiny CPU run, interpret mode
"""
from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp

from bench import peers
from bench.cli import log
from bench.report import format_value, markdown_table, value_with_pct
from bench.runner import Benchmark, Run
from bench.runner import main as run_benchmark
from bench.timing import Timing, device_times_us, free_memory, has_gpu, record_rates, try_call

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128
DTYPE = jnp.bfloat16
IMPLS = ("jaxflash", "jaxflash_triton", "jaxflash_mosaic", "cudnn", "fa3", "tokamax", "pallas_mha",
         "xla", "naive")
LABELS = {"jaxflash": "jaxflash (default)", "jaxflash_triton": "jaxflash Triton",
          "jaxflash_mosaic": "jaxflash Mosaic", "cudnn": "cuDNN (jax.nn)", "fa3": "FlashAttention-3",
          "tokamax": "tokamax mosaic", "pallas_mha": "JAX Pallas mha", "xla": "jax.nn xla",
          "naive": "naive einsum"}
# Textbook attention holds the n x n scores several times (bf16 scores, fp32 softmax): at
# 32768 tokens that is ~12 x 32768^2 x 10 bytes = 129 GB, past the card (the seed article's
# laptop ran out of memory at 16384).
MAX_N_MATERIALIZED = 16384


# ----------------------------------------------------------------------------- the contenders

def jaxflash_fn(q, k, v, mask):
  """What a user gets: jaxflash.attention's choice of kernel (the Mosaic prefill on sm_90)."""
  import jaxflash  # here: an import error is one cell's error
  del mask
  return jaxflash.attention(q, k, v, is_causal=True)


def jaxflash_triton_fn(config=None):
  def run(q, k, v, mask):
    from jaxflash.prefill import prefill_attention
    del mask
    return prefill_attention(q, k, v, is_causal=True, config=config)
  return run


def jaxflash_mosaic_fn(q, k, v, mask):
  from jaxflash.mosaic import prefill_attention
  del mask
  return prefill_attention(q, k, v, is_causal=True)


def peer_fn(attend):
  def run(q, k, v, mask):
    del mask
    return attend(q, k, v)
  return run


def cudnn_fn(q, k, v, mask):
  del mask
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def xla_fn(q, k, v, mask):
  del mask
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def naive_fn(q, k, v, mask):
  """Hugging Face eager attention, step for step (the seed article's textbook baseline):
  repeat K/V to every query head, bf16 scores, add the shared causal mask, fp32 softmax, cast."""
  group = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, group, axis=2)  # [B, S, N, H]
  v = jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) * (q.shape[-1] ** -0.5)  # [B, N, T, S] bf16
  scores = scores + mask  # [T, S] 0 / -inf, built once outside
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
  return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _pallas_mha_module():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  return pallas_attention


def pallas_mha_fn(q, k, v, mask):
  """JAX's own Pallas-Triton flash attention: it has no GQA, so K/V are repeated to every
  query head inside the timed call (as a user must); default block sizes (128 x 128)."""
  del mask
  mha = _pallas_mha_module().mha
  group = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, group, axis=2)  # [B, S, N, H]
  v = jnp.repeat(v, group, axis=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True,
               interpret=not has_gpu())


CONTENDERS = {"jaxflash": jaxflash_fn, "jaxflash_triton": jaxflash_triton_fn(),
              "jaxflash_mosaic": jaxflash_mosaic_fn, "cudnn": cudnn_fn,
              "fa3": peer_fn(peers.fa3_attention), "tokamax": peer_fn(peers.tokamax_attention),
              "pallas_mha": pallas_mha_fn, "xla": xla_fn, "naive": naive_fn}


# ----------------------------------------------------------------------------- inputs

def make_inputs(batch: int, n: int, seed: int = 0, head_dim: int = HEAD_DIM):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (batch, n, NUM_HEADS, head_dim), DTYPE)
  k = jax.random.normal(kk, (batch, n, NUM_KV_HEADS, head_dim), DTYPE)
  v = jax.random.normal(kv, (batch, n, NUM_KV_HEADS, head_dim), DTYPE)
  return q, k, v


def causal_mask(n: int):
  """The n x n additive mask HF builds once and shares between layers: 0 on and below the
  diagonal, -inf above."""
  rows = jnp.arange(n)[:, None]
  return jnp.where(jnp.arange(n)[None, :] <= rows, 0.0, -jnp.inf).astype(DTYPE)


def causal_flops(batch: int, n: int, head_dim: int = HEAD_DIM) -> float:
  return batch * NUM_HEADS * 4 * n * n * head_dim / 2


# ----------------------------------------------------------------------------- measurements

def bench_row(batch: int, n: int, ceiling_tflops: float | None, limit, check: bool = False,
              impls=IMPLS, head_dim: int = HEAD_DIM) -> dict:
  """One (batch, n): every contender timed under one profiler trace. With `check`, also each
  one's max abs error against float32 attention (row["max_abs_error"])."""
  flops = causal_flops(batch, n, head_dim)
  row = {"batch": batch, "n": n, "gflop": flops / 1e9, "errors": {}, "kernels": {}}
  q, k, v = make_inputs(batch, n, head_dim=head_dim)
  mask = causal_mask(n) if n <= MAX_N_MATERIALIZED else jnp.zeros((1, 1), DTYPE)
  cases = {}
  for impl in impls:
    if impl in ("xla", "naive") and n > MAX_N_MATERIALIZED:
      row["errors"][impl] = f"skipped: n > {MAX_N_MATERIALIZED} (the n x n scores do not fit)"
      continue
    if limit.exhausted():
      row["errors"][impl] = "skipped: time limit"
      continue
    cases[impl] = (CONTENDERS[impl], (q, k, v, mask))
  timings = device_times_us(cases, keep_output=check, log=log)
  if check:
    ref, err = try_call(reference_f32, q, k, v)
    row["max_abs_error"] = {impl: err if err else float(jnp.max(jnp.abs(
        t.output.astype(jnp.float32) - ref))) for impl, t in timings.items() if isinstance(t, Timing)}
    del ref
  record_rates(row, timings, IMPLS, flops, ceiling_tflops)
  mha = timings.get("pallas_mha")
  if isinstance(mha, Timing) and mha.kernels:
    kernel_us = mha.kernel_us("mha_forward")
    row["pallas_mha_kernel_tflops"] = flops / (kernel_us * 1e-6) / 1e12 if kernel_us else None
  jf = row.get("jaxflash_tflops")
  best_peer = max((row.get(f"{p}_tflops") or 0 for p in ("fa3", "tokamax")), default=0) or None
  for theirs, key in ((row.get("cudnn_tflops"), "jf_over_cudnn"), (best_peer, "jf_over_best_peer"),
                      (row.get("pallas_mha_tflops"), "jf_over_mha")):
    row[key] = jf / theirs if jf and theirs else None
  del q, k, v, mask
  free_memory()
  return row


def reference_f32(q, k, v):
  """Causal attention in float32 with full-precision matmuls, on the same bf16 inputs."""
  with jax.default_matmul_precision("highest"):
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=True,
        implementation="xla"))(q, k, v)


def sweep(n: int, ceiling_tflops: float | None, limit, grid: dict) -> list[dict]:
  """The tuning sweep: every (block_q, block_k, num_warps, num_stages) at n tokens,
  batch 1; a config that fails to compile (or is refused for shared memory) is recorded."""
  from jaxflash.configs import PrefillConfig, prefill_config
  default = try_call(prefill_config, HEAD_DIM, DTYPE)[0]
  q, k, v = make_inputs(1, n)
  mask = jnp.zeros((1, 1), DTYPE)
  rows, cases = [], {}
  for bq, bk, warps, stages in itertools.product(grid["block_q"], grid["block_k"],
                                                 grid["num_warps"], grid["num_stages"]):
    config = PrefillConfig(bq, bk, warps, stages)
    row = {"block_q": bq, "block_k": bk, "num_warps": warps, "num_stages": stages,
           "smem_kib": config.smem_bytes(HEAD_DIM, 2) / 1024, "default": config == default,
           "config": f"{bq}x{bk} w{warps} s{stages}"}
    rows.append(row)
    if limit.exhausted():
      row["error"] = "skipped: time limit"
      continue
    cases[row["config"]] = (jaxflash_triton_fn(config), (q, k, v, mask))
  # One profiler trace per group of configs: a crash or the time limit loses little.
  flops = causal_flops(1, n)
  names = list(cases)
  for start in range(0, len(names), 12):
    group = {name: cases[name] for name in names[start:start + 12]}
    if limit.exhausted():
      for row in rows:
        if row["config"] in group:
          row["error"] = "skipped: time limit"
      continue
    log(f"  sweep configs {start + 1}-{start + len(group)} of {len(names)}")
    timings = device_times_us(group, log=log)
    for row in rows:
      t = timings.get(row["config"])
      if isinstance(t, dict):
        row["error"] = t["error"]
      elif isinstance(t, Timing):
        row.update(us=t.us, tflops=flops / (t.us * 1e-6) / 1e12)
        row["pct"] = 100 * row["tflops"] / ceiling_tflops if ceiling_tflops else None
  del q, k, v
  free_memory()
  return rows


# ----------------------------------------------------------------------------- script

def main_columns():
  cols = [("batch", "B"), ("n", "n")]
  cols += [(lambda r, i=impl: value_with_pct(r, f"{i}_tflops", f"{i}_pct"), LABELS[impl])
           for impl in IMPLS]
  cols += [("pallas_mha_kernel_tflops", "Pallas mha kernel only"),
           ("jf_over_cudnn", "jaxflash / cuDNN", "{:.2f}"),
           ("jf_over_best_peer", "jaxflash / best of FA3, tokamax", "{:.2f}"),
           ("jf_over_mha", "jaxflash / Pallas mha", "{:.2f}")]
  return cols


def _arguments(p):
  p.add_argument("--impls", nargs="*", choices=IMPLS, default=None,
                 help="the contenders to run (default: all; --quick leaves out xla and naive)")
  p.add_argument("--sizes", type=int, nargs="*", default=None,
                 help="batch-1 sequence lengths (default: 512 ... 32768, or --quick's), then 4 x 4096")
  p.add_argument("--head-dim", type=int, default=HEAD_DIM,
                 help="head dim of every row (other than 128: results in prefill_d<H>.*, no "
                      "Triton sweep)")


def _stem(args) -> str:
  return "prefill" if args.head_dim == HEAD_DIM else f"prefill_d{args.head_dim}"


def collect(args, run: Run):
  """The TFLOP/s rows, the scratch-memory table and (d = 128) the Triton tile sweep."""
  limit, meta = run.limit, run.meta
  if args.smoke:
    sizes, acc_n, sweep_n = [(1, 128), (1, 256), (2, 128)], 128, 256
    grid = {"block_q": [64], "block_k": [32, 64], "num_warps": [4], "num_stages": [2]}
  else:
    # --quick: the sizes of the issue targets, without the materialising XLA paths.
    ns = [2048, 4096, 16384, 32768] if args.quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    ns = args.sizes or ns
    sizes = [(1, n) for n in ns] + [(4, 4096)]
    acc_n, sweep_n = 4096, 8192
    grid = {"block_q": [64, 128], "block_k": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4]}
  head_dim = args.head_dim
  ceiling = meta["ceilings"].get("matmul_tflops")
  meta.update(
      title="Causal prefill: TFLOP/s on device time",
      shapes=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, dtype="bfloat16",
                  causal=True),
      flops="FlashAttention-2 convention: 4 n^2 d per head, halved for causal")
  meta["notes_header"] = [
      "TFLOP/s by the FlashAttention-2 count (4·n²·d per head, halved for causal), with the % of "
      "the bf16 matmul ceiling above.",
      "JAX Pallas mha has no GQA: its time includes repeating K/V to 12 heads (the kernel alone: "
      "'kernel only'); default block sizes 128 x 128.",
      "naive = Hugging Face eager attention (repeat K/V, bf16 scores + mask, fp32 softmax).",
  ]

  rows, notes = [], []
  for batch, n in sizes:
    if limit.exhausted():
      notes.append(f"B={batch} n={n}: skipped (time limit)")
      continue
    log(f"[{limit.elapsed():6.1f}s] B={batch} n={n}")
    impls = tuple(i for i in IMPLS if i in (args.impls or IMPLS)
                  and not (args.quick and i in ("xla", "naive")))
    row, err = try_call(bench_row, batch, n, ceiling, limit, check=(batch, n) == (1, acc_n),
                        impls=impls, head_dim=head_dim)
    if err:
      notes.append(f"B={batch} n={n}: row failed: {err[:300]}")
      log(f"  row failed: {err}")
      continue
    rows.append(row)
    if "max_abs_error" in row:
      meta["accuracy"] = {"n": acc_n, "reference": "float32 XLA attention (precision highest), same bf16 inputs",
                          "max_abs_error": row["max_abs_error"]}
      log(f"  max abs error vs float32: {row['max_abs_error']}")
    for impl, err in row["errors"].items():
      notes.append(f"B={batch} n={n} {LABELS[impl]}: {err[:300]}")
    log("  " + ", ".join(f"{impl} {format_value(row.get(f'{impl}_tflops'))}" for impl in IMPLS))
    run.save(rows, notes)

  memory_rows = [{"batch": r["batch"], "n": r["n"],
                  **{impl: r.get(f"{impl}_temp_mib") for impl in IMPLS}} for r in rows]
  run.save_table(f"{run.name}_memory", memory_rows,
                 [("batch", "B"), ("n", "n"), *[(impl, LABELS[impl]) for impl in IMPLS]],
                 title="Causal prefill: peak XLA scratch memory (MiB)",
                 notes=["Scratch = compiled temp_size_in_bytes (memory_analysis), inputs and outputs excluded."])

  sweep_rows = []
  if args.sweep and head_dim == HEAD_DIM:
    log(f"[{limit.elapsed():6.1f}s] tuning sweep at n={sweep_n}")
    sweep_rows, err = try_call(sweep, sweep_n, ceiling, limit, grid)
    if err:
      sweep_rows = [{"config": "all", "error": err}]
    ranked = sorted(sweep_rows, key=lambda r: -(r.get("tflops") or -1))
    run.save_table(
        "prefill_sweep", ranked,
        [("config", "config"), ("tflops", "TFLOP/s"), ("pct", "% of matmul"), ("smem_kib", "smem KiB (model)"),
         ("default", "default"), ("error", "error", lambda e: e[:80])],
        title=f"Prefill tuning sweep, B=1, n={sweep_n}",
        plot={"kind": "bar", "x": "config", "y": "tflops", "figsize": (11, 4.5),
              "title": f"jaxflash prefill configs, n={sweep_n}", "ylabel": "TFLOP/s",
              "hline": (ceiling, "bf16 matmul ceiling")})

  acc = meta.get("accuracy", {}).get("max_abs_error", {})
  if acc:
    notes.append(f"max abs error vs float32 attention at B=1 n={acc_n}: " + ", ".join(
        f"{LABELS[i]} {format_value(v) if isinstance(v, float) else v}" for i, v in acc.items()))
  run.plot = {"x": "n", "y": [f"{impl}_tflops" for impl in IMPLS], "logx": True,
              "labels": {f"{impl}_tflops": LABELS[impl] for impl in IMPLS},
              "where": lambda r: r["batch"] == 1, "xlabel": "sequence length n (batch 1)",
              "ylabel": "TFLOP/s (device time)",
              "title": f"Causal prefill, 12 q heads / 2 kv heads, d={head_dim}, bf16",
              "hline": (ceiling, "bf16 matmul ceiling")}
  run.extra = {"sweep": sweep_rows}

  if sweep_rows:
    best = [r for r in sweep_rows if r.get("tflops")]
    if best:
      top = max(best, key=lambda r: r["tflops"])
      log(f"sweep best: {top['config']} {top['tflops']:.0f} TFLOP/s")
  log(f"matmul ceiling {format_value(ceiling)} TFLOP/s; timing: {meta['timing']}")
  log(markdown_table(rows, [("batch", "B"), ("n", "n")] + [
      (f"{impl}_tflops", impl) for impl in IMPLS] + [("jf_over_cudnn", "jf/cudnn", "{:.2f}"),
                                                       ("jf_over_best_peer", "jf/peer", "{:.2f}"),
                                                       ("jf_over_mha", "jf/mha", "{:.2f}")]))
  return rows, notes


BENCHMARK = Benchmark(name="prefill", doc=__doc__, collect=collect, columns=main_columns(),
                      time_limit_s=360.0, smoke="tiny CPU run end to end (interpret mode)",
                      quick="fewer sizes", sweep=True, arguments=_arguments, stem=_stem)


def main(argv=None):
  return run_benchmark(BENCHMARK, argv)


if __name__ == "__main__":
  main()
