"""Does the forward's rounding policy move dQ's error? A numpy emulation of the prefill's roundings.

The Triton and the Mosaic prefill differ in how they round the softmax (FlashAttention-2's
online softmax, Dao 2023): the Triton kernel subtracts the running max (a dominant key's P is
exactly 1) and divides the output by float32 sums of P; the Mosaic kernel's long-sequence
config subtracts a fixed reference (the first key block's row max, so a dominant key's P is
rounded too) and divides by the sums of P as rounded to bf16 for PV. Both backwards then share
one arithmetic: P from the LSE, delta = rowsum(dO * O), dS = P (dP - delta) rounded to bf16
before dQ += dS K. This study emulates exactly those roundings in numpy (float32 arithmetic,
bf16 rounding through numpy's bfloat16), key block by key block, on bench.accuracy's bf16 inputs, for
windows of query rows, and reports the output's and dQ's largest errors against float64 for
each forward policy, and dQ's with the exact output (rounded to bf16) in place of the
forward's, which leaves the backward's own rounding alone. For the Mosaic forward it also
varies the backward's rounding of dS before dQ += dS K: to bf16 as the kernels do, to bf16
with the softmax scale folded in first, to float16, or none (float32: the rest of the
arithmetic's floor). What it leaves out: the order of the tensor cores' float32 sums, and
exp2's approximation.

  python -m bench.studies.rounding_emulation [--cases peaky:16384:128] [--rows 512]
                                             [--starts 4096,14730]             # CPU, ~2 min
  python -m bench.studies.rounding_emulation --smoke
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bench import accuracy
from bench.cli import TimeLimit, bench_arguments, log, smoke_out_dir
from bench.environment import env_metadata
from bench.report import STUDIES_DIR, write_results

LOG2_E = np.float32(np.log2(np.e))
# policy -> (key block, subtract a fixed reference in the blocks a row sees whole, divide the
# output by the sums of P rounded to bf16, keep the float32 output to ~16 bits as out + out_low
# for the backward instead of rounding it to bf16)
POLICIES = {
    "running max, float32 sums (Triton)": (64, False, False, False),
    "running max, rounded sums": (128, False, True, False),
    "fixed reference, rounded sums (Mosaic)": (128, True, True, False),
    "Mosaic, output kept as out + out_low": (128, True, True, True),
}
BACKWARD_BLOCK = 64
# dS before the dQ product -> (its dtype, or None for float32; fold the scale in before the
# rounding). float16 keeps 3 more bits than bf16; a kernel would multiply it with K in float16
# (wgmma takes one dtype for both operands), exact for bf16 keys in float16's range.
DS_ROUNDINGS = {"bf16 (the kernels')": (jnp.bfloat16, False),
                "bf16, scale folded in": (jnp.bfloat16, True),
                "float16": (np.float16, False), "none (float32)": (None, False)}
KERNELS_DS = "bf16 (the kernels')"
MOSAIC = "fixed reference, rounded sums (Mosaic)"


def _bf16(x):
  return x.astype(jnp.bfloat16).astype(np.float32)


def _visible(rows, start: int, size: int):
  """[R, size] True where query position rows[r] sees key start + c (causal, top-left)."""
  return np.arange(start, start + size)[None, :] <= rows[:, None]


def emulated_forward(q, k, v, rows, *, block: int, fixed_reference: bool, rounded_sums: bool,
                     out_low: bool = False):
  """q [R, d] (the queries at positions `rows`), k, v [n, d] float32 holding bf16 values ->
  (out [R, d] rounded to bf16, or with `out_low` bf16(out) + bf16(out - bf16(out)),
  natural-log LSE [R] float32)."""
  num_rows, d = q.shape
  c = np.float32(d ** -0.5) * LOG2_E
  m = np.full(num_rows, -np.inf, np.float32)
  sums_f32 = np.zeros(num_rows, np.float32)
  sums_rounded = np.zeros(num_rows, np.float32)
  acc = np.zeros((num_rows, d), np.float32)
  for start in range(0, int(rows.max()) + 1, block):
    k_blk, v_blk = k[start:start + block], v[start:start + block]
    visible = _visible(rows, start, len(k_blk))
    s = np.where(visible, q @ k_blk.T, -np.inf).astype(np.float32)
    m_block = s.max(axis=1) * c
    m_new = np.maximum(m, m_block)
    if fixed_reference:  # the first block's max stays the reference where the block is seen whole
      m_new = np.where((m > -np.inf) & visible.all(axis=1), m, m_new)
    m_safe = np.where(m_new == -np.inf, 0, m_new)
    alpha = np.exp2(m - m_safe).astype(np.float32)
    p = np.exp2(s * c - m_safe[:, None]).astype(np.float32)
    p_tile = _bf16(p)
    sums_f32 = sums_f32 * alpha + p.sum(axis=1)
    sums_rounded = sums_rounded * alpha + p_tile.sum(axis=1)
    acc = acc * alpha[:, None] + p_tile @ v_blk
    m = m_new
  out = acc / (sums_rounded if rounded_sums else sums_f32)[:, None]
  high = _bf16(out)
  kept = high + _bf16(out - high) if out_low else high
  return kept, ((m + np.log2(sums_f32)) / LOG2_E).astype(np.float32)


def emulated_dq(q, k, v, d_out, out, lse, rows, ds_rounding: str = KERNELS_DS):
  """The backwards' dQ arithmetic (dS rounded as DS_ROUNDINGS[ds_rounding] says) -> dq [R, d]
  rounded to bf16."""
  d = q.shape[1]
  scale = np.float32(d ** -0.5)
  ds_dtype, scale_first = DS_ROUNDINGS[ds_rounding]
  delta = (d_out * out).sum(axis=1).astype(np.float32)
  lse2 = (lse * LOG2_E).astype(np.float32)
  dq = np.zeros_like(q)
  for start in range(0, int(rows.max()) + 1, BACKWARD_BLOCK):
    k_blk, v_blk = k[start:start + BACKWARD_BLOCK], v[start:start + BACKWARD_BLOCK]
    visible = _visible(rows, start, len(k_blk))
    p = np.where(visible, np.exp2((q @ k_blk.T) * scale * LOG2_E - lse2[:, None]), 0).astype(np.float32)
    ds = p * (d_out @ v_blk.T - delta[:, None])
    if scale_first:
      ds = ds * scale
    dq += (ds if ds_dtype is None else ds.astype(ds_dtype).astype(np.float32)) @ k_blk
  return _bf16(dq if scale_first else dq * scale)


def exact(q, k, v, d_out, rows):
  """float64 (out, dq) for the queries at positions `rows`."""
  q, k, v, d_out = (x.astype(np.float64) for x in (q, k, v, d_out))
  n = int(rows.max()) + 1
  k, v = k[:n], v[:n]
  s = np.where(_visible(rows, 0, n), q @ k.T * q.shape[1] ** -0.5, -np.inf)
  p = np.exp(s - s.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  dp = d_out @ v.T
  ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))
  return p @ v, ds @ k * q.shape[1] ** -0.5


def study_case(case: accuracy.Case, num_rows: int, starts=None) -> list[dict]:
  """Rows of the case's queries (windows of num_rows from each of `starts`; default n/4, n/2
  and the last), every head: one row per forward policy with the kernels' dS rounding, and
  for the Mosaic forward one per other dS rounding."""
  q, k, v, d_out = (np.asarray(x, np.float32) for x in accuracy.make_inputs(case))
  starts = sorted(set(starts or (case.n // 4, case.n // 2, case.n - num_rows)))
  if not all(0 <= s_ <= case.n - num_rows for s_ in starts):
    raise SystemExit(f"--starts: windows of {num_rows} rows must fit in n = {case.n}, got {starts}")
  group = case.heads // case.kv_heads
  variants = [(name, KERNELS_DS) for name in POLICIES] + [(MOSAIC, r) for r in DS_ROUNDINGS if r != KERNELS_DS]
  worst = {v_: {"out": 0.0, "dq": 0.0, "dq_exact_out": 0.0, "at": None} for v_ in variants}
  dq_max = 0.0
  for head in range(case.heads):
    for start in starts:
      rows = np.arange(start, start + num_rows)
      qh, doh = q[0, rows, head], d_out[0, rows, head]
      kh, vh = k[0, :, head // group], v[0, :, head // group]
      out64, dq64 = exact(qh, kh, vh, doh, rows)
      dq_max = max(dq_max, float(np.abs(dq64).max()))
      forwards = {}
      for name, ds_rounding in variants:
        if name not in forwards:
          block, fixed, rounded, low = POLICIES[name]
          forwards[name] = emulated_forward(qh, kh, vh, rows, block=block, fixed_reference=fixed,
                                            rounded_sums=rounded, out_low=low)
        out, lse = forwards[name]
        error = np.abs(emulated_dq(qh, kh, vh, doh, out, lse, rows, ds_rounding) - dq64)
        dq_exact_out = emulated_dq(qh, kh, vh, doh, _bf16(out64.astype(np.float32)), lse, rows, ds_rounding)
        w = worst[(name, ds_rounding)]
        w["out"] = max(w["out"], float(np.abs(out - out64).max()))
        if error.max() > w["dq"]:
          w["dq"], w["at"] = float(error.max()), (int(rows[error.max(axis=1).argmax()]), head)
        w["dq_exact_out"] = max(w["dq_exact_out"], float(np.abs(dq_exact_out - dq64).max()))
  return [{"case": case.name, "n": case.n, "d": case.d, "rows": num_rows * len(starts) * case.heads,
           "policy": name, "ds_rounding": ds_rounding, "out_abs": w["out"], "dq_rel": w["dq"] / dq_max,
           "dq_at": f"row {w['at'][0]}, head {w['at'][1]}", "dq_rel_exact_out": w["dq_exact_out"] / dq_max}
          for (name, ds_rounding), w in worst.items()]


def main(argv=None):
  p = bench_arguments(__doc__, smoke="one tiny peaky case", time_limit_s=1800.0)
  p.add_argument("--cases", default="peaky:16384:128,peaky:4096:128",
                 help="kind:n:d, comma-separated (bench.accuracy's input classes)")
  p.add_argument("--rows", type=int, default=512, help="query rows a window")
  p.add_argument("--starts", default=None,
                 help="first query position of each window, comma-separated (default n/4, n/2, the last)")
  args = p.parse_args(argv)
  starts = None if args.starts is None else [int(x) for x in args.starts.split(",")]
  limit = TimeLimit(args.time_limit_s)
  cases = [accuracy.Case("peaky", 256, 64)] if args.smoke else accuracy.parse_cases(args.cases)
  num_rows = 32 if args.smoke else args.rows
  out_dir = smoke_out_dir("rounding_emulation") if args.smoke else (args.out or STUDIES_DIR)
  meta = env_metadata()
  meta["title"] = "The forward's rounding policies, the backward's dS rounding and dQ's error, emulated in numpy"
  rows, notes = [], []
  for case in cases:
    if limit.exhausted():
      notes.append(f"{case.name} n={case.n} d={case.d}: skipped (time limit)")
      continue
    case_rows = study_case(case, num_rows, None if args.smoke else starts)
    rows += case_rows
    for r in case_rows:
      log(f"{case.name} n={case.n} d={case.d} {r['policy']:40s} dS {r['ds_rounding']:22s} out "
          f"{r['out_abs']:.2e} dq {r['dq_rel']:.2e} ({r['dq_at']}) on the exact output {r['dq_rel_exact_out']:.2e}")
  write_results("rounding_emulation", rows, meta,
                [("case", "case"), ("n", "n"), ("d", "d"), ("rows", "query rows"), ("policy", "forward"),
                 ("ds_rounding", "dS before dS K"), ("out_abs", "output max abs err", "{:.2e}"),
                 ("dq_rel", "dQ max err / max |dQ|", "{:.2e}"), ("dq_at", "where"),
                 ("dq_rel_exact_out", "dQ on the exact output", "{:.2e}")],
                out_dir=out_dir, notes=notes)
  return rows


if __name__ == "__main__":
  main()
