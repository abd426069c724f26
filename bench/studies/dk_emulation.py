"""What sets dK's largest error on a dominant-key input: a numpy emulation of the backward.

bench.accuracy's dominant-key case (one key 60 nats above the rest at half the sequence) has
q[..., 0] = 8 and k[..., 0] = 0 on the other keys, so column 0 of dK is 8 * scale * sum_t dS_ts:
for the first keys, a sum over every row of terms that nearly cancel (each row's dS sums to zero).
Its error comes from two roundings every FlashAttention backward shares (FlashAttention-2, Dao
2023, Algorithm 2): delta = rowsum(dO * O) taken from the output as rounded to bf16, and dS
rounded before dK += dS^T Q. This study emulates the dK/dV kernels' arithmetic in numpy (float32,
P from the float32 LSE, row chunks) on the case's bf16 inputs for each forward's output
(bench.studies.rounding_emulation's Triton and Mosaic policies, and the exact output, rounded
to bf16 or not) and each dS rounding, and reports dK's largest error over max |dK| against
float64, with where it sits. What it leaves out: the tensor cores' summation order, exp2's
approximation.

  python -m bench.studies.dk_emulation [--cases dominant_key:16384:128]   # CPU, ~5 min
  python -m bench.studies.dk_emulation --smoke
"""
from __future__ import annotations

import numpy as np

from bench import accuracy
from bench.cli import TimeLimit, bench_arguments, log, smoke_out_dir
from bench.environment import env_metadata
from bench.report import STUDIES_DIR, write_results
from bench.studies.rounding_emulation import LOG2_E, MOSAIC, POLICIES, _bf16, emulated_forward

ROW_CHUNK = 2048
TRITON = "running max, float32 sums (Triton)"
MOSAIC_OUT_LOW = "Mosaic, output kept as out + out_low"
EXACT_BF16, EXACT_F32 = "exact, rounded to bf16", "exact, float32"
# dS before dK += dS^T Q -> its dtype (None: float32)
DS_DTYPES = {"bf16": "bfloat16", "float16": np.float16, "float32": None}
VARIANTS = [(TRITON, "bf16"), (MOSAIC, "bf16"), (MOSAIC_OUT_LOW, "bf16"), (EXACT_BF16, "bf16"),
            (EXACT_F32, "bf16"), (TRITON, "float16"), (MOSAIC, "float16"), (MOSAIC_OUT_LOW, "float16"),
            (EXACT_BF16, "float16"), (EXACT_F32, "float16"), (EXACT_F32, "float32")]


def _round(x, dtype):
  if dtype is None:
    return x
  if dtype == "bfloat16":
    return _bf16(x)
  return x.astype(dtype).astype(np.float32)


def exact(q, k, v, d_out):
  """float64 (out [n, d], lse [n], dk [n, d]) of causal attention, one head."""
  q, k, v, d_out = (x.astype(np.float64) for x in (q, k, v, d_out))
  n, d = q.shape
  scale = d ** -0.5
  out, lse, dk = np.zeros((n, d)), np.zeros(n), np.zeros((n, d))
  for r0 in range(0, n, ROW_CHUNK):
    rows = np.arange(r0, min(r0 + ROW_CHUNK, n))
    s = np.where(np.arange(n)[None, :] <= rows[:, None], q[rows] @ k.T * scale, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(axis=1, keepdims=True)
    p /= total
    out[rows], lse[rows] = p @ v, (m + np.log(total))[:, 0]
    dp = d_out[rows] @ v.T
    dk += (p * (dp - (d_out[rows] * out[rows]).sum(axis=1, keepdims=True))).T @ q[rows] * scale
  return out, lse, dk


def emulated_dk(q, k, v, d_out, out, lse, ds_dtype):
  """The dK/dV kernels' dK arithmetic on float32 operands: P from the LSE, delta from `out`,
  dS rounded to `ds_dtype`, dK summed over row chunks, the scale applied last."""
  n, d = q.shape
  scale = np.float32(d ** -0.5)
  lse2 = (lse * LOG2_E).astype(np.float32)
  delta = (d_out * out).sum(axis=1).astype(np.float32)
  dk = np.zeros((n, d), np.float32)
  for r0 in range(0, n, ROW_CHUNK):
    rows = np.arange(r0, min(r0 + ROW_CHUNK, n))
    s = (q[rows] @ k.T) * scale * LOG2_E
    p = np.where(np.arange(n)[None, :] <= rows[:, None], np.exp2(s - lse2[rows, None]), 0).astype(np.float32)
    ds = p * (d_out[rows] @ v.T - delta[rows, None])
    dk += _round(ds, ds_dtype).T @ q[rows]
  return dk * scale


def study_case(case: accuracy.Case, heads) -> list[dict]:
  q, k, v, d_out = (np.asarray(x, np.float32) for x in accuracy.make_inputs(case))
  group = case.heads // case.kv_heads
  rows = []
  for head in heads:
    qh, doh = q[0, :, head], d_out[0, :, head]
    kh, vh = k[0, :, head // group], v[0, :, head // group]
    out64, lse64, dk64 = exact(qh, kh, vh, doh)
    positions = np.arange(case.n)
    forwards = {}
    for name in (TRITON, MOSAIC, MOSAIC_OUT_LOW):
      block, fixed, rounded, low = POLICIES[name]
      forwards[name] = emulated_forward(qh, kh, vh, positions, block=block, fixed_reference=fixed,
                                        rounded_sums=rounded, out_low=low)
    forwards[EXACT_BF16] = (_bf16(out64.astype(np.float32)), lse64.astype(np.float32))
    forwards[EXACT_F32] = (out64.astype(np.float32), lse64.astype(np.float32))
    dk_max = float(np.abs(dk64).max())
    for forward, ds_rounding in VARIANTS:
      out, lse = forwards[forward]
      error = np.abs(emulated_dk(qh, kh, vh, doh, out, lse, DS_DTYPES[ds_rounding]) - dk64)
      key, column = np.unravel_index(error.argmax(), error.shape)
      rows.append({"case": case.name, "n": case.n, "d": case.d, "head": head, "output": forward,
                   "ds_rounding": ds_rounding, "dk_rel": float(error.max()) / dk_max,
                   "at": f"key {key}, column {column}"})
  return rows


def main(argv=None):
  p = bench_arguments(__doc__, smoke="one tiny dominant-key case", time_limit_s=1800.0)
  p.add_argument("--cases", default="dominant_key:16384:128",
                 help="kind:n:d, comma-separated (bench.accuracy's input classes; dominant_key at 60 nats)")
  args = p.parse_args(argv)
  limit = TimeLimit(args.time_limit_s)
  specs = ["dominant_key:256:64"] if args.smoke else args.cases.split(",")
  cases = []
  for spec in specs:
    (case,) = accuracy.parse_cases(spec)
    cases.append(accuracy.Case(case.kind, case.n, case.d, margin=60.0) if case.kind == "dominant_key" else case)
  out_dir = smoke_out_dir("dk_emulation") if args.smoke else (args.out or STUDIES_DIR)
  meta = env_metadata()
  meta["title"] = "dK's largest error on hard inputs: the output's and dS's roundings, emulated in numpy"
  rows, notes = [], []
  for case in cases:
    if limit.exhausted():
      notes.append(f"{case.name} n={case.n} d={case.d}: skipped (time limit)")
      continue
    case_rows = study_case(case, range(case.heads))
    rows += case_rows
    for r in case_rows:
      log(f"{case.name} n={case.n} head {r['head']} {r['output']:36s} dS {r['ds_rounding']:8s} "
          f"dK {r['dk_rel']:.2e} ({r['at']})")
  write_results("dk_emulation", rows, meta,
                [("case", "case"), ("n", "n"), ("d", "d"), ("head", "head"), ("output", "delta from the output of"),
                 ("ds_rounding", "dS before dS^T Q"), ("dk_rel", "dK max err / max |dK|", "{:.2e}"),
                 ("at", "where")],
                out_dir=out_dir, notes=notes)
  return rows


if __name__ == "__main__":
  main()
