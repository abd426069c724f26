"""Where the gradients' errors sit: the Mosaic and the Triton backward on the same residuals.

bench.accuracy gives one number per gradient (the largest error over the largest reference
value). When jaxflash's default trails cuDNN there, this study separates the backward from the
forward: one forward (jaxflash's default), then both backward kernels on its O and LSE
(`backward_implementation="mosaic"` and `"triton"`), and cuDNN's own forward and backward, all
against bench.accuracy's float32 HIGHEST reference on the same bf16 inputs. Per gradient and
provider: the largest error and where it sits (sequence, row, head), the 50 / 99 / 99.9th
percentiles of the errors, and how many elements exceed cuDNN's largest; and the two backwards'
largest difference from each other. A row per (case, gradient, provider).

  python -m bench.studies.backward_error_map [--cases peaky:16384:128,...] [--out DIR]   # GPU
  python -m bench.studies.backward_error_map --smoke                                      # CPU
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import accuracy
from bench.cli import TimeLimit, bench_arguments, log, smoke_out_dir
from bench.environment import env_metadata
from bench.report import STUDIES_DIR, format_value, write_results

GRADIENTS = ("dq", "dk", "dv")
BACKWARDS = ("mosaic", "triton")


def _jaxflash_grads(case: accuracy.Case, backward: str):
  """(q, k, v, d_out) -> (dq, dk, dv): jaxflash's default forward, then `backward`."""
  import jaxflash
  lengths = case.lengths()
  window = None if case.window is None else (case.window, 0)

  def attend(q, k, v):
    return jaxflash.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                              local_window_size=window, backward_implementation=backward)

  @jax.jit
  def grads(q, k, v, d_out):
    _, vjp = jax.vjp(attend, q, k, v)
    return vjp(d_out)

  return grads


def _cudnn_grads(case: accuracy.Case):
  run = accuracy.provider_call("cudnn", case)
  return lambda *args: run(*args)[2:]


def error_map(x, ref, valid) -> dict:
  """|x - ref| / max |ref| over the valid rows: the largest, where it is ([B, n, heads] index),
  and its percentiles; x and ref [B, n, heads, d]."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  err = np.abs(x - ref) / max(float(np.max(np.abs(ref))), np.finfo(np.float32).tiny)
  if valid is not None:
    err = np.where(np.asarray(valid)[:, :, None, None], err, 0.0)
  where = np.unravel_index(int(np.argmax(err)), err.shape)
  return {"max": float(err.max()), "at": [int(i) for i in where[:3]], "errors": err,
          "p50": float(np.percentile(err, 50)), "p99": float(np.percentile(err, 99)),
          "p999": float(np.percentile(err, 99.9))}


def study_case(case: accuracy.Case) -> list[dict]:
  q, k, v, d_out = accuracy.make_inputs(case)
  ref = accuracy.reference(case, q, k, v, d_out)[2:]
  valid = accuracy.query_rows(case)
  providers = {f"{b}_backward": _jaxflash_grads(case, b) for b in BACKWARDS}
  if jax.default_backend() == "gpu":
    providers["cudnn"] = _cudnn_grads(case)
  measured = {}
  for name, grads in providers.items():
    try:
      got = grads(q, k, v, d_out)
    except Exception as e:  # noqa: BLE001 -- a provider that cannot take the case loses its rows only
      log(f"  {name} on {case.name} n={case.n} d={case.d}: {type(e).__name__}: {str(e)[:300]}")
      continue
    measured[name] = (got, {g: error_map(x, r, valid) for g, x, r in zip(GRADIENTS, got, ref)})
  rows = []
  for gi, g in enumerate(GRADIENTS):
    bound = measured["cudnn"][1][g]["max"] if "cudnn" in measured else None
    apart = None
    if all(f"{b}_backward" in measured for b in BACKWARDS):
      a, b = (np.asarray(measured[f"{b}_backward"][0][gi], np.float64) for b in BACKWARDS)
      apart = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(np.asarray(ref[gi])))), 1e-30))
    for name, (_, maps) in measured.items():
      m = maps[g]
      rows.append({"case": case.name, "n": case.n, "d": case.d, "gradient": g, "provider": name,
                   "max": m["max"], "at": m["at"], "p50": m["p50"], "p99": m["p99"], "p999": m["p999"],
                   "over_cudnn_max": None if bound is None else int((m["errors"] > bound).sum()),
                   "backwards_apart": apart})
  return rows


def main(argv=None):
  p = bench_arguments(__doc__, smoke="one tiny peaky case on the CPU (Triton backward only)",
                      time_limit_s=300.0)
  p.add_argument("--cases", default="peaky:16384:128,peaky:4096:128,normal:16384:128",
                 help="kind:n:d, comma-separated (bench.accuracy's input classes)")
  args = p.parse_args(argv)
  limit = TimeLimit(args.time_limit_s)
  cases = [accuracy.Case("peaky", 128, 64)] if args.smoke else accuracy.parse_cases(args.cases)
  out_dir = smoke_out_dir("backward_error_map") if args.smoke else (args.out or STUDIES_DIR)
  meta = env_metadata()
  meta["title"] = "Gradient errors of the Mosaic and the Triton backward on one forward's residuals"
  rows, notes = [], []
  for case in cases:
    if limit.exhausted():
      notes.append(f"{case.name} n={case.n} d={case.d}: skipped (time limit)")
      continue
    log(f"[{limit.elapsed():6.1f}s] {case.name} n={case.n} d={case.d}")
    rows += study_case(case)
    for r in rows[-len(GRADIENTS) * 3:]:
      log(f"  {r['gradient']} {r['provider']:16s} max {format_value(r['max'])} at {r['at']} "
          f"p99.9 {format_value(r['p999'])} over cuDNN's max {r['over_cudnn_max']}")
    write_results("backward_error_map", rows, meta,
                  [("case", "case"), ("n", "n"), ("d", "d"), ("gradient", "gradient"),
                   ("provider", "provider"), ("max", "max err", "{:.2e}"), ("at", "at (b, row, head)"),
                   ("p99", "p99", "{:.1e}"), ("p999", "p99.9", "{:.1e}"),
                   ("over_cudnn_max", "elements over cuDNN's max"),
                   ("backwards_apart", "mosaic − triton", "{:.1e}")],
                  out_dir=out_dir, notes=notes)
  return rows


if __name__ == "__main__":
  main()
