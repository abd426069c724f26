"""Training attention: forward + backward (gradients of q, k and v), jaxflash against its peers.

Shapes: 12 query heads, 2 KV heads, head dim 128 (`--head-dim 64 | 256`: results in
train_d<H>.*, without the sweep, the model step and the packed rows), bf16, causal; batch 1 at
n = 1K ... 32K and batch 4 at 4096. Every implementation of a row runs in one process and one
profiler trace, timed on device time (the sum of the GPU kernels one call launches,
bench/timing.py). A call is jax.vjp of the attention with a fixed cotangent: the forward and
the backward. TFLOP/s count FLOPs as FlashAttention-2 does: the causal forward's
4 n^2 d per head halved, times 3.5 (forward 1 + backward 2.5).

Contenders: jaxflash (the Pallas-Triton forward and its FlashAttention-2 backward,
jaxflash/prefill_backward.py), jaxflash_default (`jaxflash.attention`'s default path: on
sm_90 the Mosaic GPU forward, and the Mosaic backward where vjp.default_backward_reason
lets it), jaxflash_mosaic_bwd (the Mosaic forward and backward, forced), cuDNN
(jax.nn, implementation="cudnn"), jax.nn "xla", JAX's Pallas `mha` with its own backward
(no GQA: K/V repeated inside the call, so its dK/dV are reduced by XLA), and, when
importable, FlashAttention-3 (flash_attn3_jax.flash_mha) and tokamax "mosaic". Also each
one's peak scratch memory, a whole-model training step (Qwen2.5-0.5B shapes, random bf16
weights, one sequence of 4K tokens: jaxflash vs cuDNN vs xla attention) and a sweep of the
backward's BackwardConfig at n = 4096 and 16384. With `--packed`: packed documents, one
row of 16K tokens holding documents of random lengths (512-4K tokens, then shorter ones),
jaxflash with `segment_ids` against cuDNN given the same documents as an explicit
[B, 1, T, S] mask; jaxflash's time falls with the documents' length (key blocks skipped).

  python -m bench.train [--quick] [--no-sweep] [--sizes 1x4096,...] [--impls ...]
                        [--grid full|splits] [--sweep-ns 4096,16384] [--no-model]
                        [--packed] [--head-dim 64|128|256]                       # GPU
  python -m bench.train --smoke                                # tiny CPU run, interpret mode
"""
from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import peers
from bench.cli import TimeLimit, begin_run, bench_arguments, log
from bench.report import format_value, markdown_table, value_with_pct, write_results
from bench.timing import Timing, device_times_us, free_memory, has_gpu, record_rates, try_call

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128
DTYPE = jnp.bfloat16
IMPLS = ("jaxflash", "jaxflash_default", "jaxflash_mosaic_bwd", "cudnn", "fa3", "tokamax", "pallas_mha", "xla")
LABELS = {"jaxflash": "jaxflash Triton", "jaxflash_default": "jaxflash default",
          "jaxflash_mosaic_bwd": "jaxflash Mosaic fwd + bwd",
          "cudnn": "cuDNN (jax.nn)", "fa3": "FlashAttention-3",
          "tokamax": "tokamax mosaic", "pallas_mha": "JAX Pallas mha", "xla": "jax.nn xla"}
MAX_N_XLA = 16384  # jax.nn "xla" keeps the n x n probabilities for its backward
BACKWARD_FACTOR = 3.5  # FlashAttention-2: backward 2.5x the forward's FLOPs


# ----------------------------------------------------------------------------- the contenders

def jaxflash_attention(backward_config=None):
  def attend(q, k, v):
    from jaxflash.prefill import prefill_attention  # here: an import error is one cell's error
    return prefill_attention(q, k, v, is_causal=True, backward_config=backward_config)
  return attend


def jaxflash_default_attention(q, k, v):
  import jaxflash
  return jaxflash.attention(q, k, v, is_causal=True)


def jaxflash_mosaic_backward_attention(q, k, v):
  import jaxflash
  return jaxflash.attention(q, k, v, is_causal=True, backward_implementation="mosaic")


def cudnn_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def xla_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def pallas_mha_attention(q, k, v):
  """JAX's Pallas-Triton flash attention and its own backward; no GQA, so K/V are repeated
  to every query head inside the call (as a user must)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True,
                                interpret=not has_gpu())


CONTENDERS = {"jaxflash": jaxflash_attention(), "jaxflash_default": jaxflash_default_attention,
              "jaxflash_mosaic_bwd": jaxflash_mosaic_backward_attention,
              "cudnn": cudnn_attention, "fa3": peers.fa3_attention,
              "tokamax": peers.tokamax_attention, "pallas_mha": pallas_mha_attention, "xla": xla_attention}


def forward_backward(attend):
  """attend(q, k, v) -> its forward and backward: (q, k, v, d_out) -> (dq, dk, dv)."""
  def run(q, k, v, d_out):
    _, vjp = jax.vjp(attend, q, k, v)
    return vjp(d_out)
  return run


# ----------------------------------------------------------------------------- measurements

def make_inputs(batch: int, n: int, seed: int = 0, head_dim: int = HEAD_DIM):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (batch, n, NUM_HEADS, head_dim), DTYPE)
  k = jax.random.normal(keys[1], (batch, n, NUM_KV_HEADS, head_dim), DTYPE)
  v = jax.random.normal(keys[2], (batch, n, NUM_KV_HEADS, head_dim), DTYPE)
  d_out = jax.random.normal(keys[3], (batch, n, NUM_HEADS, head_dim), DTYPE)
  return q, k, v, d_out


def train_flops(batch: int, n: int, head_dim: int = HEAD_DIM) -> float:
  return BACKWARD_FACTOR * batch * NUM_HEADS * 4 * n * n * head_dim / 2


def bench_row(batch: int, n: int, ceiling: float | None, budget, impls=IMPLS,
              head_dim: int = HEAD_DIM) -> dict:
  """One (batch, n): every contender's forward + backward in one profiler session."""
  row = {"batch": batch, "n": n, "errors": {}, "kernels": {}}
  args = make_inputs(batch, n, head_dim=head_dim)
  cases = {}
  for impl in impls:
    if impl == "xla" and n > MAX_N_XLA:
      row["errors"][impl] = f"skipped: n > {MAX_N_XLA} (its n x n probabilities)"
    elif budget.exhausted():
      row["errors"][impl] = "skipped: time budget"
    else:
      cases[impl] = (forward_backward(CONTENDERS[impl]), args)
  timings = device_times_us(cases, log=log)
  flops = train_flops(batch, n, head_dim)
  record_rates(row, timings, impls, flops, ceiling)
  add_ratios(row)
  del args
  free_memory()
  return row


def add_ratios(row: dict) -> dict:
  """jaxflash's fwd+bwd over each peer's: `jf_over_<peer>` for jaxflash.attention's default
  path (the Mosaic forward on sm_90), or the Triton prefill where the default was not run."""
  jf = row.get("jaxflash_default_tflops") or row.get("jaxflash_tflops")
  for other in ("cudnn", "pallas_mha", "fa3", "tokamax"):
    theirs = row.get(f"{other}_tflops")
    row[f"jf_over_{other}"] = jf / theirs if jf and theirs else None
  return row


def sweep(n: int, ceiling: float | None, budget, grid) -> list[dict]:
  """jaxflash fwd+bwd at n tokens (batch 1) for each BackwardConfig of `grid`."""
  from jaxflash.configs import BackwardConfig, backward_config
  default = try_call(backward_config, HEAD_DIM, DTYPE)[0]
  args = make_inputs(1, n)
  rows, cases = [], {}
  for tiles in grid:
    config = BackwardConfig(*tiles)
    dq = "" if len(tiles) < 5 or tiles[4] is None else " dq{}x{}".format(*config.dq_tiles)
    splits = "" if config.q_splits is None else f" q{config.q_splits}"
    row = {"n": n, "config": "{}x{} w{} s{}".format(*tiles[:4]) + dq + splits,
           "default": config == default,
           "smem_kib": config.smem_bytes(HEAD_DIM, 2) / 1024}
    rows.append(row)
    if budget.exhausted():
      row["error"] = "skipped: time budget"
      continue
    cases[row["config"]] = (forward_backward(jaxflash_attention(config)), args)
  timings = device_times_us(cases, log=log)
  for row in rows:
    t = timings.get(row["config"])
    if isinstance(t, dict):
      row["error"] = t["error"]
    elif isinstance(t, Timing):
      row.update(us=t.us, tflops=train_flops(1, n) / (t.us * 1e-6) / 1e12)
      row["pct"] = 100 * row["tflops"] / ceiling if ceiling else None
  del args
  free_memory()
  return rows


def model_rows(preset: str, n: int, budget) -> list[dict]:
  """One training step's device time (loss, gradients of every weight) of a Qwen2.5 model
  with random bf16 weights on one sequence of n tokens, per attention implementation."""
  from flax import nnx

  from models import qwen2, train
  if preset == "demo":
    from models.generate import demo_config
    config, label = demo_config(), "demo model"
  else:
    config, label = qwen2.PRESETS[preset](), preset
  model = qwen2.random_model(config, seed=0, dtype="bfloat16")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(0), (1, n + 1), 0, config.vocab_size, jnp.int32)
  cases = {}
  for impl in ("jaxflash", "cudnn", "xla"):
    attention_impl = {"jaxflash": None}.get(impl, impl)
    if budget.exhausted():
      continue

    def step(params, tokens, attention_impl=attention_impl):
      return jax.value_and_grad(lambda p: train.cross_entropy(
          nnx.merge(graphdef, p, rest), tokens, attention_impl))(params)
    cases[impl] = (step, (params, tokens))
  timings = device_times_us(cases, max_iters=10, log=log)
  rows = []
  for impl, t in timings.items():
    row = {"model": label, "n": n, "impl": LABELS[impl]}
    if isinstance(t, Timing):
      row.update(step_ms=t.us / 1e3, temp_mib=None if t.temp_bytes is None else t.temp_bytes / 2**20,
                 method=t.method)
    else:
      row["error"] = t["error"]
    rows.append(row)
  base = next((r.get("step_ms") for r in rows if r["impl"] == LABELS["jaxflash"]), None)
  for row in rows:
    row["vs_jaxflash"] = row["step_ms"] / base if base and row.get("step_ms") else None
  del params, tokens
  free_memory()
  return rows


# (shortest, longest) document of each packed row: the 512-4K, then shorter.
PACKED_DOCS = [(512, 4096), (256, 2048), (128, 1024), (64, 512)]
PACKED_TOKENS = 16384


def packed_ids(n: int, shortest: int, longest: int, seed: int = 0):
  """[1, n] int32 ids of documents with uniform random lengths in [shortest, longest] packed
  end to end (the last cut to fit)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  lengths = []
  while sum(lengths) < n:
    lengths.append(int(rng.integers(shortest, longest + 1)))
  ids = np.repeat(np.arange(len(lengths)), lengths)[:n]
  return jnp.asarray(ids[None], jnp.int32)


def packed_rows(n: int, docs, budget) -> list[dict]:
  """Causal fwd+bwd over one row of n tokens of packed documents for each (shortest,
  longest) of `docs`: jaxflash with segment ids, cuDNN with the equivalent explicit mask."""
  args = make_inputs(1, n)
  rows, cases = [], {}
  for shortest, longest in docs:
    ids = packed_ids(n, shortest, longest)
    label = f"{shortest}-{longest}"
    rows.append({"docs": label, "n": n, "num_docs": int(ids.max()) + 1})
    if budget.exhausted():
      rows[-1]["error"] = "skipped: time budget"
      continue

    def jaxflash_packed(q, k, v, ids=ids):
      import jaxflash
      return jaxflash.attention(q, k, v, is_causal=True, segment_ids=ids)

    def cudnn_packed(q, k, v, ids=ids):
      same = ids[:, None, :, None] == ids[:, None, None, :]  # [1, 1, n, n]
      return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True,
                                          implementation="cudnn")

    cases[f"jaxflash {label}"] = (forward_backward(jaxflash_packed), args)
    cases[f"cudnn {label}"] = (forward_backward(cudnn_packed), args)
  timings = device_times_us(cases, log=log)
  for row in rows:
    for impl in ("jaxflash", "cudnn"):
      t = timings.get(f"{impl} {row['docs']}")
      if isinstance(t, Timing):
        row[f"{impl}_us"] = t.us
      elif isinstance(t, dict):
        row.setdefault("errors", {})[impl] = t["error"]
    mine, theirs = row.get("jaxflash_us"), row.get("cudnn_us")
    row["cudnn_over_jaxflash"] = theirs / mine if mine and theirs else None
  del args
  free_memory()
  return rows


# ----------------------------------------------------------------------------- script

# (block_q, block_k, num_warps, num_stages[, dq_block_q, dq_block_k[, q_splits]])
SWEEP_GRID = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 4, 2), (32, 32, 4, 2), (64, 64, 4, 3),
              (128, 64, 8, 2), (64, 64, 4, 2, 128, 64), (64, 32, 4, 2, 128, 64),
              (128, 32, 4, 2, 128, 64), (64, 64, 4, 2, 128, 32), (64, 128, 8, 2)]
# The dK/dV kernel's query-range split (BackwardConfig.q_splits; None: the automatic
# choice) on the Hopper default tiles and on 64 x 128 tiles, which need it most.
SPLITS_GRID = [(64, 64, 4, 2, None, None, 1), (64, 64, 4, 2, None, None, 2),
               (64, 64, 4, 2, None, None, 3), (64, 64, 4, 2, None, None, 4),
               (64, 128, 8, 2, None, None, 1), (64, 128, 8, 2, None, None, 2),
               (64, 128, 8, 2, None, None, 4), (64, 64, 4, 2, 128, 64, 2)]
GRIDS = {"full": SWEEP_GRID + SPLITS_GRID, "splits": SPLITS_GRID}


def main_columns(impls):
  cols = [("batch", "B"), ("n", "n")]
  cols += [(lambda r, i=impl: value_with_pct(r, f"{i}_tflops", f"{i}_pct"), LABELS[impl])
           for impl in impls]
  mine = "jaxflash default" if "jaxflash_default" in impls else "jaxflash"
  cols += [(f"jf_over_{o}", f"{mine} / {LABELS[o]}", "{:.2f}") for o in ("cudnn", "pallas_mha", "fa3")]
  return cols


def parse_args(argv=None):
  p = bench_arguments(__doc__, smoke="tiny CPU run end to end (interpret mode)",
                             quick="n = 4096 and 16384 only", sweep=True, time_limit_s=420.0)
  p.add_argument("--no-model", dest="model", action="store_false", help="skip the model step row")
  p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
  p.add_argument("--sizes", default=None, help="comma-separated BxN cells, e.g. 1x4096,4x4096 "
                 "(default: B=1 at 1K..32K and 4x4096)")
  p.add_argument("--grid", choices=tuple(GRIDS), default="full",
                 help="BackwardConfig sweep: every config, or the q_splits ones only")
  p.add_argument("--sweep-ns", default="4096,16384", help="comma-separated n of the sweep (B=1)")
  p.add_argument("--packed", action="store_true",
                 help="also time packed documents (segment ids) against cuDNN with an explicit mask")
  p.add_argument("--head-dim", type=int, default=HEAD_DIM,
                 help="head dim of every row (other than 128: results in train_d<H>.*, no sweep, "
                      "model step or packed rows)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  budget = TimeLimit(args.time_limit_s)
  head_dim = args.head_dim
  stem = "train" if head_dim == HEAD_DIM else f"train_d{head_dim}"
  if head_dim != HEAD_DIM:  # the other tables are of d = 128
    args.sweep = args.model = args.packed = False
  if args.smoke:
    sizes, impls = [(1, 128), (2, 64)], ("jaxflash", "jaxflash_default", "pallas_mha", "xla")
    sweep_ns, grid = [128], [(16, 32, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2, None, None, 2)]
    model_case, ceiling_args = ("demo", 64), dict(matmul_n=256, hbm_gib=1 / 64)
    packed_case = (128, [(16, 64), (16, 32)])
  else:
    ns = [4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    sizes = [(1, n) for n in ns] + [(4, 4096)]
    if args.sizes:
      sizes = [tuple(int(x) for x in cell.split("x")) for cell in args.sizes.split(",")]
    impls = tuple(i for i in IMPLS if i in args.impls.split(","))
    sweep_ns, grid = [int(n) for n in args.sweep_ns.split(",")], GRIDS[args.grid]
    model_case, ceiling_args = ("qwen2.5-0.5b", 4096), dict(matmul_n=8192, hbm_gib=4.0)
    packed_case = (PACKED_TOKENS, PACKED_DOCS)
  meta, out_dir = begin_run(stem, args, **ceiling_args)
  ceiling = meta["ceilings"].get("matmul_tflops")
  meta.update(title="Causal attention, forward + backward: TFLOP/s on device time",
              shapes=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                          dtype="bfloat16", causal=True),
              flops="FlashAttention-2 convention: 3.5 x (4 n^2 d per head, halved for causal)")
  meta["notes_header"] = [
      "TFLOP/s: 3.5x the causal forward's FLOPs (4·n²·d per head, halved), % of the bf16 matmul "
      "ceiling beside each.",
      "JAX Pallas mha has no GQA: K/V are repeated to 12 heads inside the call (and dK/dV reduced).",
  ]
  sub_meta = {k: v for k, v in meta.items() if k != "notes_header"}

  rows, notes = [], []
  for batch, n in sizes:
    if budget.exhausted():
      notes.append(f"B={batch} n={n}: skipped (time budget)")
      continue
    log(f"[{budget.elapsed():6.1f}s] B={batch} n={n}")
    row, err = try_call(bench_row, batch, n, ceiling, budget, impls, head_dim)
    if err:
      notes.append(f"B={batch} n={n}: row failed: {err[:300]}")
      continue
    rows.append(row)
    notes += [f"B={batch} n={n} {LABELS[i]}: {e[:200]}" for i, e in row["errors"].items()]
    log("  " + ", ".join(f"{i} {format_value(row.get(f'{i}_tflops'))}" for i in impls))
    write_results(stem, rows, meta, main_columns(impls), out_dir=out_dir, notes=notes)

  memory_rows = [{"batch": r["batch"], "n": r["n"], **{i: r.get(f"{i}_temp_mib") for i in impls}}
                 for r in rows]
  write_results(
      f"{stem}_memory", memory_rows, {**sub_meta, "title": "Forward + backward: peak XLA scratch memory (MiB)"},
      [("batch", "B"), ("n", "n"), *[(i, LABELS[i]) for i in impls]], out_dir=out_dir,
      notes=["Scratch = compiled temp_size_in_bytes (memory_analysis), inputs and outputs excluded."])

  step_rows = []
  if args.model and not budget.exhausted():
    log(f"[{budget.elapsed():6.1f}s] model training step: {model_case}")
    step_rows, err = try_call(model_rows, *model_case, budget)
    step_rows = step_rows or [{"model": model_case[0], "error": err}]
    write_results(
        "train_step", step_rows, {**sub_meta, "title": "Whole-model training step (loss + all gradients)"},
        [("model", "model"), ("n", "tokens"), ("impl", "attention"), ("step_ms", "step ms", "{:.2f}"),
         ("vs_jaxflash", "/ jaxflash", "{:.2f}"), ("temp_mib", "scratch MiB", "{:.0f}"),
         ("error", "error", lambda e: e[:80])], out_dir=out_dir)

  packed = []
  if args.packed and not budget.exhausted():
    log(f"[{budget.elapsed():6.1f}s] packed documents: {packed_case[0]} tokens")
    packed, err = try_call(packed_rows, *packed_case, budget)
    packed = packed or [{"docs": "all", "error": err}]
    write_results(
        "train_packed", packed,
        {**sub_meta, "title": "Packed documents, causal fwd+bwd: segment ids vs an explicit mask"},
        [("n", "tokens"), ("docs", "document lengths"), ("num_docs", "documents"),
         ("jaxflash_us", "jaxflash us", "{:.0f}"), ("cudnn_us", "cuDNN (mask) us", "{:.0f}"),
         ("cudnn_over_jaxflash", "cuDNN / jaxflash", "{:.2f}")], out_dir=out_dir)

  sweep_rows = []
  if args.sweep:
    for n in sweep_ns:
      if budget.exhausted():
        break
      log(f"[{budget.elapsed():6.1f}s] backward sweep at n={n}")
      got, err = try_call(sweep, n, ceiling, budget, grid)
      sweep_rows += got or [{"n": n, "config": "all", "error": err}]
    write_results(
        "train_sweep", sweep_rows, {**sub_meta, "title": "jaxflash fwd+bwd: BackwardConfig sweep, B=1"},
        [("n", "n"), ("config", "config"), ("tflops", "TFLOP/s"), ("pct", "% of matmul"),
         ("smem_kib", "smem KiB (model)"), ("default", "default"), ("error", "error", lambda e: e[:80])],
        out_dir=out_dir)

  plot = {"x": "n", "y": [f"{i}_tflops" for i in impls], "logx": True,
          "labels": {f"{i}_tflops": LABELS[i] for i in impls}, "where": lambda r: r["batch"] == 1,
          "xlabel": "sequence length n (batch 1)", "ylabel": "fwd+bwd TFLOP/s (device time)",
          "title": f"Causal attention fwd+bwd, 12 q heads / 2 kv heads, d={head_dim}, bf16",
          "hline": (ceiling, "bf16 matmul ceiling")}
  paths = write_results(stem, rows, meta, main_columns(impls), plot=plot, out_dir=out_dir,
                               notes=notes, extra={"sweep": sweep_rows, "model_step": step_rows,
                                                   "packed": packed})
  log(f"\n[{budget.elapsed():6.1f}s] results in {Path(paths['json']).parent}")
  log(markdown_table(rows, [("batch", "B"), ("n", "n")] + [
      (f"{i}_tflops", i) for i in impls] + [("jf_over_cudnn", "jf/cudnn", "{:.2f}"),
                                            ("jf_over_pallas_mha", "jf/mha", "{:.2f}")]))
  if step_rows:
    log(markdown_table(step_rows, [("impl", "attention"), ("step_ms", "step ms", "{:.2f}"),
                                          ("error", "error", lambda e: str(e)[:60])]))
  if sweep_rows:
    log(markdown_table(sorted(sweep_rows, key=lambda r: (r["n"], -(r.get("tflops") or 0))),
                              [("n", "n"), ("config", "config"), ("tflops", "TFLOP/s", "{:.0f}"),
                               ("default", "default")]))


if __name__ == "__main__":
  main()
