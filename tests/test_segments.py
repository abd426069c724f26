"""Packed documents (segment_ids / kv_segment_ids): the Pallas-Triton prefill forward and
backward against float64 attention with the equivalent explicit [B, 1, T, S] mask, block
skipping, the checks, and the model and trainer that pack documents.

Each kernel case runs interpreted (any machine) and compiled (GPU only, `-m gpu`), with 16 x 16
tiles so the shapes stay tiny and still span several blocks and documents.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import BackwardConfig, PrefillConfig, segments
from jaxflash.prefill import prefill_attention
from jaxflash.reference import attention_reference
from tests.conftest import assert_close, poison_allocator, random_array
from tests.reference_np import attention_f64

SMALL = dict(config=PrefillConfig(16, 16), backward_config=BackwardConfig(16, 16))
BF16, F32 = jnp.bfloat16, jnp.float32
GRAD_TOL = {jnp.dtype(F32): 3e-5, jnp.dtype(BF16): 3e-2}


def _enable_x64():
  manager = getattr(jax, "enable_x64", None)
  if manager is None:
    from jax.experimental import enable_x64 as manager
  return manager(True)


def _packed_ids(rng, batch: int, length: int, mean_doc: int) -> np.ndarray:
  """[batch, length] non-decreasing ids: documents of random lengths end to end."""
  ids = np.zeros((batch, length), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=max(1, length // mean_doc), replace=False))
    ids[row] = np.searchsorted(cuts, np.arange(length), side="right")
  return ids


def _case_ids(rng, kind: str, batch: int, t: int, s: int):
  """(segment_ids [B, T], kv_segment_ids [B, S] or None)."""
  if kind == "packed":
    return _packed_ids(rng, batch, t, 9), None
  if kind == "scattered":  # non-monotone: ids drawn independently per token
    return rng.integers(0, 3, (batch, t)).astype(np.int32), None
  # "cross": T != S, and query id 7 appears in no key: those rows see nothing (zeros)
  q_ids = rng.integers(0, 3, (batch, t)).astype(np.int32)
  q_ids[:, ::5] = 7
  return q_ids, np.sort(rng.integers(0, 3, (batch, s)), axis=1).astype(np.int32)


# (batch, T, S, N, K, H, dtype, ids, options): GQA 1, 2, 5, 7, 8; head dims 64, 80, 128.
CASES = {
    "packed-causal-gqa5": (2, 45, 45, 5, 1, 64, F32, "packed", dict(is_causal=True)),
    "scattered-gqa7-h80": (1, 33, 33, 7, 1, 80, BF16, "scattered", dict(is_causal=True)),
    "cross-lengths-gqa2": (2, 29, 40, 4, 2, 64, F32, "cross",
                           dict(query_seq_lengths=(29, 17), key_value_seq_lengths=(40, 31))),
    "packed-window-gqa8-h128": (1, 50, 50, 8, 1, 128, BF16, "packed",
                                dict(is_causal=True, local_window_size=(12, 0))),
    "scattered-window-gqa1": (2, 37, 37, 2, 2, 64, F32, "scattered", dict(local_window_size=(6, 4))),
}


def _explicit_mask(q_ids, kv_ids):
  return (np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :])  # [B, 1, T, S]


def _f64_grads(q, k, v, d_out, mask, options):
  """Float64 (dq, dk, dv) of the plain-JAX reference with the explicit mask."""
  f64 = lambda x: jnp.asarray(np.asarray(jnp.asarray(x, F32), np.float64))
  lengths = {name: None if options.get(name) is None else jnp.asarray(options[name], jnp.int32)
             for name in ("query_seq_lengths", "key_value_seq_lengths")}
  window = options.get("local_window_size")
  with _enable_x64():
    def attend(q, k, v):
      return attention_reference(q, k, v, None, jnp.asarray(mask), scale=q.shape[-1] ** -0.5,
                                 is_causal=options.get("is_causal", False),
                                 local_window_size=window, **lengths)[0]
    _, vjp = jax.vjp(attend, f64(q), f64(k), f64(v))
    return [np.asarray(g, np.float64) for g in vjp(f64(d_out))]


@pytest.mark.parametrize("name", CASES)
def test_forward_and_gradients_match_the_explicit_mask(name, rng, interpret):
  b, t, s, n, kh, h, dtype, kind, options = CASES[name]
  q, k, v = (random_array(rng, shape, dtype) for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, h)))
  d_out = random_array(rng, (b, t, n, h), dtype)
  q_ids, kv_ids = _case_ids(rng, kind, b, t, s)
  options = dict(options)
  lengths = {name: None if options.get(name) is None else jnp.asarray(options.pop(name), jnp.int32)
             for name in ("query_seq_lengths", "key_value_seq_lengths")}

  def attend(q, k, v):
    return prefill_attention(q, k, v, lengths["query_seq_lengths"], lengths["key_value_seq_lengths"],
                             segment_ids=jnp.asarray(q_ids),
                             kv_segment_ids=None if kv_ids is None else jnp.asarray(kv_ids),
                             return_residual=True, interpret=interpret, **SMALL, **options)

  if not interpret:
    poison_allocator(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))
  (out, lse), vjp = jax.vjp(attend, q, k, v)
  kv_ids_full = q_ids if kv_ids is None else kv_ids
  mask = _explicit_mask(q_ids, kv_ids_full)
  ref_lengths = {"q_lengths": lengths["query_seq_lengths"], "kv_lengths": lengths["key_value_seq_lengths"]}
  want_out, want_lse = attention_f64(q.astype(F32), k.astype(F32), v.astype(F32), mask=mask,
                                     is_causal=options.get("is_causal", False),
                                     window=options.get("local_window_size"), **ref_lengths)
  chex.assert_shape(out, q.shape)
  chex.assert_type(out, dtype)
  assert_close(out, want_out, dtype)
  assert_close(lse, want_lse, F32 if dtype == F32 else dtype, what="lse")

  grads = vjp((d_out, jnp.zeros_like(lse)))
  want = _f64_grads(q, k, v, d_out, mask, {**options, **{n: v for n, v in lengths.items()}})
  for label, got, ref, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
    chex.assert_shape(got, x.shape)
    chex.assert_type(got, x.dtype)
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    assert not np.isnan(got).any(), f"{label} has NaN"
    err = np.abs(got - ref).max()
    limit = GRAD_TOL[jnp.dtype(dtype)] * max(1., np.abs(ref).max())
    assert err <= limit, f"{label}: error {err:.3g} over {limit:.3g}"


def test_rows_that_see_no_key_give_zeros(rng, interpret):
  """A query whose id no key carries: out exactly 0, LSE -inf, and zero, finite gradients."""
  q, k, v = (random_array(rng, (1, 20, 2, 64), F32) for _ in range(3))
  q_ids = jnp.asarray(np.r_[np.zeros(10), np.full(10, 5)][None], jnp.int32)
  kv_ids = jnp.zeros((1, 20), jnp.int32)

  def attend(q, k, v):
    return prefill_attention(q, k, v, segment_ids=q_ids, kv_segment_ids=kv_ids, return_residual=True,
                             interpret=interpret, **SMALL)

  (out, lse), vjp = jax.vjp(attend, q, k, v)
  np.testing.assert_array_equal(np.asarray(out[:, 10:]), 0.)
  assert np.all(np.isneginf(np.asarray(lse[:, 10:])))
  assert np.all(np.isfinite(np.asarray(lse[:, :10])))
  dq, dk, dv = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
  np.testing.assert_array_equal(np.asarray(dq[:, 10:]), 0.)
  assert all(np.isfinite(np.asarray(g)).all() for g in (dq, dk, dv))


def test_key_blocks_of_other_documents_are_never_read(interpret):
  """Three 16-token documents, one 16 x 16 tile each, no causal mask. A block that were
  loaded and masked would still multiply its zero weights into NaN (0 * NaN), so NaN planted
  in the middle document shows which blocks the loops visit: NaN values there (forward, dQ
  kernel) and NaN output cotangents on its rows (dK/dV kernel) reach that document only.
  The other documents' rows equal attention over each document alone."""
  rng = np.random.default_rng(0)
  q, k, v = (random_array(rng, (1, 48, 2, 64), F32) for _ in range(3))
  v = v.at[:, 16:32].set(jnp.nan)
  ids = jnp.asarray(np.repeat([0, 1, 2], 16)[None], jnp.int32)
  attend = lambda q, k, v: prefill_attention(q, k, v, segment_ids=ids, interpret=interpret, **SMALL)
  out, vjp = jax.vjp(attend, q, k, v)
  dq, dk, dv = vjp(jnp.ones_like(out).at[:, 16:32].set(jnp.nan))
  assert np.isnan(np.asarray(out[:, 16:32])).all()  # NaN in, NaN out
  for doc in (slice(0, 16), slice(32, 48)):
    alone = prefill_attention(q[:, doc], k[:, doc], v[:, doc], interpret=interpret, **SMALL)
    np.testing.assert_allclose(np.asarray(out[:, doc]), np.asarray(alone), atol=2e-6)
    for g in (dq, dk, dv):
      assert np.isfinite(np.asarray(g[:, doc])).all()


def test_block_spans_shrink_with_the_documents():
  """For packed ids a query block's span is exactly the key blocks of its documents, so the
  visited blocks fall with the documents' length; for any ids every block left out of a span
  shares no id with the rows."""
  ids = jnp.asarray(np.repeat(np.arange(8), 64)[None], jnp.int32)  # 8 documents of 64 tokens
  spans = np.asarray(segments.block_spans(ids, ids, 64, 64))
  np.testing.assert_array_equal(spans[0], np.stack([np.arange(8), np.arange(1, 9)], axis=1))
  visited = {doc: segments.count_blocks(jnp.asarray(np.arange(512)[None] // doc, jnp.int32),
                                        jnp.asarray(np.arange(512)[None] // doc, jnp.int32), 64, 64)
             for doc in (512, 256, 128, 64)}
  assert visited == {512: 64, 256: 32, 128: 16, 64: 8}, visited
  rng = np.random.default_rng(1)
  row_ids, col_ids = rng.integers(0, 6, (3, 50)), rng.integers(0, 6, (3, 70))
  spans = np.asarray(segments.block_spans(jnp.asarray(row_ids), jnp.asarray(col_ids), 16, 16))
  for b in range(3):
    for i, (first, end) in enumerate(spans[b]):
      rows = set(row_ids[b, i * 16:(i + 1) * 16])
      for j in range(-(-70 // 16)):
        if not first <= j < end:
          assert not rows & set(col_ids[b, j * 16:(j + 1) * 16]), (b, i, j)


def test_public_attention_takes_segments(rng):
  """jaxflash.attention with segment ids (default kernel) equals implementation="xla", in value
  and gradient, and cuDNN's explicit-mask route is built from the same ids (xla compared)."""
  q, k, v = (random_array(rng, (2, 40, 4, 64), F32) for _ in range(3))
  ids = jnp.asarray(_packed_ids(rng, 2, 40, 12))
  f = lambda impl: (lambda q, k, v: jnp.sum(jnp.sin(jaxflash.attention(
      q, k, v, is_causal=True, segment_ids=ids, implementation=impl))))
  got = jax.value_and_grad(f(None), (0, 1, 2))(q, k, v)
  want = jax.value_and_grad(f("xla"), (0, 1, 2))(q, k, v)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=3e-5 * max(1., float(jnp.abs(w).max())))


def test_bad_segment_ids_raise_naming_the_argument():
  q = jnp.zeros((1, 20, 2, 64), F32)
  kv = jnp.zeros((1, 24, 2, 64), F32)
  ids = jnp.zeros((1, 20), jnp.int32)
  with pytest.raises(TypeError, match="segment_ids must be an integer"):
    jaxflash.attention(q, q, q, segment_ids=ids.astype(F32))
  with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\]"):
    jaxflash.attention(q, q, q, segment_ids=jnp.zeros((1, 19), jnp.int32))
  with pytest.raises(ValueError, match=r"kv_segment_ids must have shape \[B, S\]"):
    jaxflash.prefill_attention(q, kv, kv, segment_ids=ids, kv_segment_ids=ids)
  with pytest.raises(ValueError, match="segment_ids without kv_segment_ids"):
    jaxflash.prefill_attention(q, kv, kv, segment_ids=ids)
  with pytest.raises(NotImplementedError, match="segment_ids: packed documents are for prefill"):
    jaxflash.attention(q[:, :1], kv, kv, segment_ids=ids[:, :1], kv_segment_ids=jnp.zeros((1, 24), jnp.int32),
                       is_causal=True, causal_alignment="bottom_right")


def test_backward_implementation_is_chosen_at_trace_time():
  q = jnp.ones((1, 16, 2, 64), F32)
  with pytest.raises(ValueError, match="backward_implementation='mosaic' cannot serve this call: no GPU"):
    jax.grad(lambda q: jnp.sum(jaxflash.attention(q, q, q, backward_implementation="mosaic")))(q)
  with pytest.raises(ValueError, match="backward_implementation must be one of"):
    jaxflash.prefill_attention(q, q, q, backward_implementation="cuda")
  got = jax.grad(lambda q: jnp.sum(jaxflash.attention(q, q, q, backward_implementation="triton")))(q)
  want = jax.grad(lambda q: jnp.sum(jaxflash.attention(q, q, q, implementation="xla")))(q)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_packed_model_row_equals_its_documents_run_alone():
  """model(ids, segment_ids=...) on a row of three documents gives each document's logits as
  the model run on that document alone (positions restart per document)."""
  from models import qwen2
  from models.qwen2 import Qwen2Config
  config = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       rope_theta=10_000.0, max_position_embeddings=256, tie_word_embeddings=True)
  model = qwen2.random_model(config, seed=2)
  lengths = (13, 21, 6)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 259, (1, sum(lengths))), jnp.int32)
  ids = jnp.asarray(np.repeat(np.arange(3), lengths)[None], jnp.int32)
  packed = model(tokens, segment_ids=ids)
  start = 0
  for length in lengths:
    alone = model(tokens[:, start:start + length])
    np.testing.assert_allclose(np.asarray(packed[:, start:start + length]), np.asarray(alone),
                               atol=2e-4, rtol=2e-4)
    start += length


def test_train_pack_smoke():
  """`python -m models.train --pack`: packed rows train, the loss finite and falling."""
  from models import train
  args = train.parse_args(["--pack", "--steps", "8", "--batch", "2", "--seq-len", "48",
                           "--doc-len", "16", "--log-every", "100"])
  rows = train.packed_batches(np.arange(1000, dtype=np.int32), 2, 48, 16, 0)
  tokens, ids = next(rows)
  assert tokens.shape == ids.shape == (2, 49)
  assert (np.diff(ids, axis=1) >= 0).all() and ids.max() >= 2
  losses = train.train(args, log=lambda _: None)
  assert len(losses) == 8 and all(np.isfinite(losses))
  assert losses[-1] < losses[0], losses
