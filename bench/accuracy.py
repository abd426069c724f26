"""Attention accuracy on hard inputs, next to cuDNN and the Triton kernel.

jaxflash's error against a float32 reference at HIGHEST precision, next to cuDNN's
(jax.nn.dot_product_attention, implementation="cudnn") and the Pallas-Triton kernel's
(jaxflash.attention, implementation="triton") on the same bf16 inputs, for the output, the LSE
and the gradients of query, key and value. Causal attention throughout.

Errors: the output and the LSE as the largest absolute difference; each gradient as the largest
absolute difference over the largest |reference gradient| (floored at 2^-8 of the case's largest
reference gradient, so a gradient the reference makes ~0 is not measured against ~0). Rows a
sequence length pads out are left out (their values are unspecified in cuDNN). A NaN or infinity where the reference is
finite is recorded as the error "nan" (JSON has no NaN). jax.nn rounds cuDNN's LSE to bf16, so its LSE
error is not reported (null); the LSE is compared with the Triton kernel's instead.

Input classes (scores s = q . k * H**-0.5): standard normal; peaky rows (score std 4); key scale
growing 1x -> 5x along the sequence; one dominant key, `margin` nats above the rest, at a
fraction `position` of the sequence (150 nats is past float32's exp range); a constant score
offset; a very negative first key block; ragged lengths; sliding windows; packed documents
(when jaxflash.attention takes `segment_ids`).

  python -m bench.accuracy [--quick] [--out DIR]
  python -m bench.accuracy --kinds normal,peaky --merge   # a part of the run, kept beside the rest
  python -m bench.accuracy --shapes dominant_key:16384:128,peaky:16384:128   # those cases only
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import report, runner

WHICH = ("out", "lse", "dq", "dk", "dv")
PROVIDERS = ("jaxflash", "cudnn", "triton")
LARGE = 8.0  # the query coordinate that carries a chosen score: q[..., 0] = LARGE


@dataclasses.dataclass(frozen=True)
class Case:
  """One input: its class (`kind`), shape and the class's parameter."""
  kind: str
  n: int
  d: int
  heads: int = 2
  kv_heads: int = 2
  batch: int = 1
  margin: float = 0.0  # dominant_key: nats above the rest; offset: the constant; negative_first_block: depth
  position: float = 0.5  # dominant_key: where the key sits, as a fraction of n
  window: int | None = None  # keys each query sees to its left (besides itself)
  first_block: int = 128  # negative_first_block: the keys lowered

  @property
  def name(self) -> str:
    parts = [self.kind]
    if self.kind == "dominant_key":
      parts.append(f"{self.margin:g}nats@{self.position:g}")
    elif self.kind in ("offset", "negative_first_block"):
      parts.append(f"{self.margin:g}nats")
    if self.window is not None:
      parts.append(f"w{self.window}")
    if self.heads != self.kv_heads:
      parts.append(f"gqa{self.heads}/{self.kv_heads}")
    return " ".join(parts)

  def lengths(self):
    """Valid tokens per sequence (queries = keys), or None (all)."""
    if self.kind != "ragged":
      return None
    return jnp.asarray([self.n, (5 * self.n) // 8 + 3][:self.batch], jnp.int32)

  def segment_ids(self):
    """Packed documents: [B, n] document ids (four documents of uneven length), or None."""
    if self.kind != "documents":
      return None
    bounds = np.array([0, self.n // 8 + 5, self.n // 2 - 7, (3 * self.n) // 4 + 1, self.n])
    ids = np.repeat(np.arange(4), np.diff(bounds))
    return jnp.asarray(np.broadcast_to(ids, (self.batch, self.n)), jnp.int32)


def full_cases() -> list[Case]:
  """The GPU run: n from 1K to 32K, d = 64 / 128 / 256, GQA, every default configuration."""
  cases = [Case("normal", n, 128) for n in (1024, 4096, 16384)]
  cases += [Case("normal", 8192, 64), Case("normal", 4096, 256),
            Case("normal", 8192, 128, heads=8, kv_heads=2)]
  cases += [Case("peaky", 4096, 128), Case("peaky", 16384, 128), Case("peaky", 8192, 64),
            Case("peaky", 4096, 256)]
  cases += [Case("key_scale", 16384, 128), Case("key_scale", 4096, 64), Case("key_scale", 4096, 256)]
  cases += [Case("dominant_key", 4096, 128, margin=m) for m in (20.0, 60.0, 150.0)]
  cases += [Case("dominant_key", 4096, 128, margin=60.0, position=p) for p in (0.0, 0.9)]
  cases += [Case("dominant_key", 2048, 128, margin=60.0),  # d = 128's running-max build (< 4096 keys)
            Case("dominant_key", 16384, 128, margin=60.0),
            Case("dominant_key", 32768, 128, margin=60.0, heads=1, kv_heads=1),
            Case("dominant_key", 4096, 256, margin=60.0), Case("dominant_key", 8192, 64, margin=60.0),
            Case("dominant_key", 8192, 128, margin=150.0, heads=5, kv_heads=1)]
  cases += [Case("offset", 8192, 128, margin=100.0), Case("offset", 4096, 256, margin=-100.0)]
  cases += [Case("negative_first_block", 4096, 128, margin=30.0),
            Case("negative_first_block", 4096, 128, margin=120.0),
            Case("negative_first_block", 8192, 64, margin=120.0)]
  cases += [Case("ragged", 8192, 128, batch=2), Case("ragged", 4096, 256, batch=2)]
  cases += [Case("normal", 8192, 128, window=1024),
            Case("dominant_key", 4096, 64, margin=60.0, window=255)]
  cases += [Case("documents", 8192, 128)]
  return cases


def parse_cases(text: str) -> list[Case]:
  """"kind:n:d,..." (the studies' --cases) -> Cases of those input classes and shapes."""
  cases = []
  for item in text.split(","):
    try:
      kind, n, d = item.split(":")
      cases.append(Case(kind, int(n), int(d)))
    except ValueError:
      raise SystemExit(f"--cases: expected kind:n:d, got {item!r}") from None
  return cases


def quick_cases() -> list[Case]:
  """A CPU-sized run (the kernels interpreted): one case per hard class, tiny n."""
  return [Case("dominant_key", 64, 32, margin=150.0, heads=2, kv_heads=1),
          Case("negative_first_block", 64, 32, margin=120.0, first_block=16),
          Case("ragged", 48, 32, batch=2, window=17)]


def takes_segment_ids() -> bool:
  """Whether jaxflash.attention has packed documents (`segment_ids`)."""
  import jaxflash
  return "segment_ids" in inspect.signature(jaxflash.attention).parameters


def make_inputs(case: Case, seed: int = 0):
  """bf16 query, key, value [B, n, heads or kv_heads, d] of the case's class, and an output
  cotangent (zero on padded rows)."""
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  shape_q = (case.batch, case.n, case.heads, case.d)
  shape_kv = (case.batch, case.n, case.kv_heads, case.d)
  q = jax.random.normal(kq, shape_q, jnp.float32)
  k = jax.random.normal(kk, shape_kv, jnp.float32)
  v = jax.random.normal(kv, shape_kv, jnp.float32)
  d_out = jax.random.normal(kd, shape_q, jnp.float32)
  per_unit = LARGE * case.d ** -0.5  # the score one unit of k[..., 0] adds when q[..., 0] = LARGE
  if case.kind == "peaky":
    q = 4.0 * q
  elif case.kind == "key_scale":
    k = k * jnp.linspace(1.0, 5.0, case.n)[None, :, None, None]
  elif case.kind == "dominant_key":
    at = min(int(case.position * case.n), case.n - 1)
    q = q.at[..., 0].set(LARGE)
    k = k.at[..., 0].set(0.0).at[:, at, :, 0].set(case.margin / per_unit)
  elif case.kind == "offset":
    q = q.at[..., 0].set(LARGE)
    k = k.at[..., 0].set(case.margin / per_unit)
  elif case.kind == "negative_first_block":
    q = q.at[..., 0].set(LARGE)
    k = k.at[..., 0].set(0.0).at[:, :case.first_block, :, 0].set(-case.margin / per_unit)
  valid = query_rows(case)
  if valid is not None:
    d_out = jnp.where(valid[:, :, None, None], d_out, 0.0)
  bf16 = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
  return bf16(q), bf16(k), bf16(v), bf16(d_out)


def query_rows(case: Case):
  """[B, n] True where a row (query or key) is inside its sequence's length, or None."""
  lengths = case.lengths()
  if lengths is None:
    return None
  return jnp.arange(case.n)[None, :] < lengths[:, None]


def document_mask(case: Case):
  """[B, 1, n, n] True where query and key are in one document, or None."""
  return _mask_of(case.segment_ids())


def _mask_of(segment_ids):
  """Document ids [B, n] -> [B, 1, n, n] True within a document (None: None)."""
  if segment_ids is None:
    return None
  return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def _window(window: int | None):
  """A case's window (keys each query sees to its left) as jax.nn's (left, right)."""
  return None if window is None else (window, 0)


def reference(case: Case, q, k, v, d_out):
  """The float32 reference at HIGHEST precision: (out, lse, dq, dk, dv), one query head at a
  time so that a 32K x 32K score matrix per head is the most held at once."""
  return _reference_fn(case.window)(q, k, v, d_out, case.lengths(), case.segment_ids())


# The jitted functions are built once per option that changes the program (the window), with
# lengths and document ids as data, so cases of one shape share a compilation: most of a case's
# time is compiling.
@functools.cache
def _reference_fn(window: int | None):
  from jaxflash.reference import attention_reference

  @jax.jit
  def run(q, k, v, d_out, lengths, segment_ids):
    q, k, v, d_out = (x.astype(jnp.float32) for x in (q, k, v, d_out))
    heads, kv_heads = q.shape[2], k.shape[2]
    group, mask = heads // kv_heads, _mask_of(segment_ids)

    def one_head(h):
      def attend(q1, k1, v1):
        return attention_reference(q1, k1, v1, None, mask, scale=q.shape[-1] ** -0.5, is_causal=True,
                                    query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                    local_window_size=_window(window), causal_alignment="top_left")
      pick = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=2)  # noqa: E731
      (out, lse), vjp = jax.vjp(attend, pick(q, h), pick(k, h // group), pick(v, h // group))
      dq, dk, dv = vjp((pick(d_out, h), jnp.zeros_like(lse)))
      return out[:, :, 0], lse[:, :, 0], dq[:, :, 0], dk[:, :, 0], dv[:, :, 0]

    out, lse, dq, dk, dv = jax.lax.map(one_head, jnp.arange(heads))  # each [heads, B, n, ...]
    heads_last = lambda x: jnp.moveaxis(x, 0, 2)  # noqa: E731
    kv_sum = lambda x: heads_last(x.reshape(kv_heads, group, *x.shape[1:]).sum(1))  # noqa: E731
    return heads_last(out), heads_last(lse), heads_last(dq), kv_sum(dk), kv_sum(dv)

  return run


def provider_call(provider: str, case: Case):
  """(q, k, v, d_out) -> (out, lse or None, dq, dk, dv) for one provider."""
  run = _provider_fn(provider, case.window)
  return lambda q, k, v, d_out: run(q, k, v, d_out, case.lengths(), case.segment_ids())


@functools.cache
def _provider_fn(provider: str, window: int | None):
  """jitted (q, k, v, d_out, lengths or None, segment ids or None) -> (out, lse or None, dq,
  dk, dv)."""
  import jaxflash

  def attend(q, k, v, lengths, segment_ids):
    if provider == "cudnn":
      return jax.nn.dot_product_attention(q, k, v, mask=_mask_of(segment_ids), is_causal=True,
                                          query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                          local_window_size=_window(window), implementation="cudnn"), None
    extra = {} if segment_ids is None else {"segment_ids": segment_ids}
    # bottom-right equals top-left here (queries = keys per sequence) and lets the Mosaic
    # prefill serve lengths.
    return jaxflash.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                              local_window_size=_window(window), return_residual=True,
                              implementation=None if provider == "jaxflash" else "triton", **extra)

  @jax.jit
  def run(q, k, v, d_out, lengths, segment_ids):
    (out, lse), vjp = jax.vjp(lambda q, k, v: attend(q, k, v, lengths, segment_ids), q, k, v)
    dq, dk, dv = vjp((d_out, None if lse is None else jnp.zeros_like(lse)))
    return out, lse, dq, dk, dv

  return run


# A gradient is measured against its largest reference entry, but never against less than
# bf16's resolution (2^-8) of the case's largest gradient: where every row saturates on one key
# the reference dQ and dK are ~1e-20, and dividing by that reads float32 noise as an error.
GRADIENT_FLOOR = 2.0 ** -8


def _largest(x, valid) -> float:
  x = np.asarray(x, np.float64)
  x = x if valid is None else x[np.asarray(valid)]
  return float(np.max(np.abs(x[np.isfinite(x)]), initial=0.0))


def max_error(x, ref, valid, *, scale: float | None = None) -> float:
  """Largest |x - ref| over the valid rows ([B, n] or None), over `scale` when given; NaN when
  x holds a NaN or an infinity where the reference is finite."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  if valid is not None:
    keep = np.asarray(valid)
    x, ref = x[keep], ref[keep]
  finite = np.isfinite(ref)
  if not np.all(np.isfinite(x[finite])):
    return math.nan
  err = float(np.max(np.abs(x[finite] - ref[finite]), initial=0.0))
  return err if scale is None else err / max(scale, np.finfo(np.float32).tiny)


def gradient_scales(case: Case, ref) -> dict:
  """{dq, dk, dv: the denominator of that gradient's error}: max |reference gradient|, floored
  at GRADIENT_FLOOR times the case's largest reference gradient."""
  rows = query_rows(case)
  largest = {which: _largest(r, rows) for which, r in zip(WHICH, ref) if which.startswith("d")}
  floor = GRADIENT_FLOOR * max(largest.values())
  return {which: max(value, floor) for which, value in largest.items()}


def errors(case: Case, got, ref) -> dict:
  """{which: error} for one provider's (out, lse, dq, dk, dv)."""
  rows = query_rows(case)  # queries = keys per sequence, so the same mask serves dK and dV
  scales = gradient_scales(case, ref)
  result = {}
  for which, x, r in zip(WHICH, got, ref):
    result[which] = None if x is None else max_error(x, r, rows, scale=scales.get(which))
  return result


def _providers() -> list[str]:
  """cuDNN only on a GPU (jax.nn's cuDNN path has no CPU lowering)."""
  return [p for p in PROVIDERS if p != "cudnn" or jax.default_backend() == "gpu"]


def compile_cases(cases: list[Case], seed: int = 0) -> None:
  """Compiles every case's programs (the reference's and each provider's) on threads before the
  first case runs: most of a case's time is compiling, and XLA compiles without holding the
  interpreter lock. Traced one by one; a call then finds its executable. A program that fails
  to compile is left to its case, whose run reports the error in that provider's column."""
  lowered = []
  for case in cases:
    arguments = (*make_inputs(case, seed), case.lengths(), case.segment_ids())
    for function in [_reference_fn(case.window)] + [_provider_fn(p, case.window) for p in _providers()]:
      try:
        lowered.append(function.lower(*arguments))
      except Exception:  # noqa: BLE001 -- reported by the case's run
        pass

  def compile_one(program):
    try:
      program.compile()
    except Exception:  # noqa: BLE001 -- reported by the case's run
      pass

  with concurrent.futures.ThreadPoolExecutor(max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
    list(pool.map(compile_one, lowered))


def run_case(case: Case, seed: int = 0) -> list[dict]:
  """The five rows (out, lse, dq, dk, dv) of one case."""
  q, k, v, d_out = make_inputs(case, seed)
  ref = reference(case, q, k, v, d_out)
  measured = {}
  for provider in _providers():
    try:
      measured[provider] = errors(case, provider_call(provider, case)(q, k, v, d_out), ref)
    except Exception as e:  # noqa: BLE001 -- a provider that cannot take the case loses its column only
      runner.log(f"  {provider} on {case.name} n={case.n} d={case.d}: {runner.error_text(e)}")
      measured[provider] = {}
  rows = []
  for which in WHICH:
    row = {"case": case.name, "n": case.n, "d": case.d, "heads": f"{case.heads}/{case.kv_heads}",
           "batch": case.batch, "which": which}
    for provider in PROVIDERS:
      row[f"{provider}_err"] = measured.get(provider, {}).get(which)
    row["ratio"] = _ratio(row["jaxflash_err"], row["cudnn_err"])
    row["ratio_triton"] = _ratio(row["jaxflash_err"], row["triton_err"])
    row["label"] = f"{case.name} n={case.n} d={case.d} {which}"
    for provider in PROVIDERS:
      if isinstance(row[f"{provider}_err"], float) and math.isnan(row[f"{provider}_err"]):
        row[f"{provider}_err"] = "nan"
    rows.append(row)
  return rows


def _merged(earlier: list[dict], rows: list[dict], cases: list[Case]) -> list[dict]:
  """earlier's rows with those of the cases run now replaced, in the order of `cases`."""
  fresh = {_key(r) for r in rows}
  merged = [r for r in earlier if _key(r) not in fresh] + rows
  order = {(c.name, c.n, c.d): i for i, c in enumerate(cases)}
  return sorted(merged, key=lambda r: order.get((r["case"], r["n"], r["d"]), len(order)))


def _ratio(a, b):
  numbers = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (a, b))
  if not numbers:
    return None
  return a / max(b, 1e-12)


def _error_cell(err) -> str:
  return err if isinstance(err, str) else f"{err:.2e}"


COLUMNS = [("case", "case"), ("n", "n"), ("d", "d"), ("heads", "heads N/K"), ("batch", "B"),
           ("which", "which"), ("jaxflash_err", "jaxflash", _error_cell), ("cudnn_err", "cuDNN", _error_cell),
           ("triton_err", "Triton", _error_cell), ("ratio", "jaxflash/cuDNN", "{:.2f}"),
           ("ratio_triton", "jaxflash/Triton", "{:.2f}")]


def _arguments(parser):
  parser.add_argument("--kinds", default=None,
                      help="comma-separated input classes to run (default: all), e.g. normal,dominant_key")
  parser.add_argument("--shapes", default=None,
                      help="comma-separated kind:n:d; only the full run's cases of those (every "
                           "margin, position and head count), e.g. dominant_key:16384:128")
  parser.add_argument("--merge", action="store_true",
                      help="keep the other cases' rows of an existing accuracy.json of the same commit "
                           "(a long run split over several calls)")


def _key(row) -> tuple:
  return row["case"], row["n"], row["d"], row["heads"], row["batch"], row["which"]


def _earlier_rows(run: runner.Run) -> list[dict]:
  """With --merge, the rows of <out>/accuracy.json, which must come from this commit."""
  if not run.args.merge:
    return []
  return report.earlier_rows(run.out_dir / "accuracy.json", run.meta.get("commit"))[0]


def collect(args, run: runner.Run) -> tuple[list[dict], list[str]]:
  """Every case's rows (the cases left when the time limit ends are named in the notes)."""
  cases = all_cases = quick_cases() if args.quick or args.smoke else full_cases()
  if not takes_segment_ids():
    cases = [c for c in cases if c.kind != "documents"]
  if args.kinds:
    kinds = set(args.kinds.split(","))
    unknown = kinds - {c.kind for c in full_cases()}
    if unknown:
      raise SystemExit(f"--kinds: no input class {sorted(unknown)}")
    cases = [c for c in cases if c.kind in kinds]
  if args.shapes:
    shapes = {(c.kind, c.n, c.d) for c in parse_cases(args.shapes)}
    cases = [c for c in cases if (c.kind, c.n, c.d) in shapes]
    if not cases:
      raise SystemExit(f"--shapes: no case of the run has the shapes {args.shapes!r}")
  earlier = _earlier_rows(run)
  runner.log(f"compiling {len(cases)} cases' programs")
  compile_cases(cases)
  runner.log(f"[{run.limit.elapsed():6.1f}s] compiled")
  rows, skipped = [], []
  for case in cases:
    if run.limit.exhausted():
      skipped.append(f"{case.name} n={case.n} d={case.d}")
      continue
    runner.log(f"[{run.limit.elapsed():6.1f}s] {case.name} n={case.n} d={case.d} heads={case.heads}/{case.kv_heads} "
               f"B={case.batch}")
    rows += run_case(case)
    run.save(_merged(earlier, rows, all_cases))
  rows = _merged(earlier, rows, all_cases)
  notes = [__doc__.split("\n\n")[2].replace("\n", " ")]
  if skipped:
    notes.append("not run (time limit): " + ", ".join(skipped))
  return rows, notes


BENCHMARK = runner.Benchmark(
    name="accuracy", doc=__doc__, collect=collect, columns=COLUMNS, time_limit_s=3000.0,
    smoke="the --quick cases", quick="one tiny case per hard class (the CPU test)", ceilings=False,
    arguments=_arguments,
    plot={"x": "label", "y": "ratio", "kind": "bar", "figsize": (14, 6),
          "title": "jaxflash error / cuDNN error",
          "ylabel": "jaxflash / cuDNN"})


def main(argv=None):
  return runner.main(BENCHMARK, argv)


if __name__ == "__main__":
  main()
