"""NaN and extreme logits, as jax.nn treats them: a row whose softmax sees a NaN gives NaN
(forward and backward, every kernel), a row that sees no key gives zeros, and logits of
~1e9 give the float64 reference's answer.

Each case puts NaN where some rows see it and others do not (causal rows before the NaN key,
other heads, other sequences, keys past a sequence's length) and checks the exact NaN
pattern; the rows that do not see it must match the float64 reference on the clean inputs.
The `interpret` fixture runs every case compiled on a GPU too; `test_prefill_default_*`
covers the default implementation (the Mosaic GPU kernel on sm_90) there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from tests.conftest import assert_close, random_array
from tests.reference_np import attention_f64

FP32 = jnp.float32
T, N, K, H = 7, 4, 2, 32  # T queries and keys, GQA group 2
NAN_KEY = 4  # sequence 0's key 4 of KV head 0 is NaN
NAN_QUERY = (1, 3)  # sequence 0's query row 1 of head 3 is NaN


def _prefill_inputs(rng):
  """Sequence 0 holds the NaNs; sequence 1 has no keys (length 0)."""
  q = np.array(random_array(rng, (2, T, N, H), FP32))
  k = np.array(random_array(rng, (2, T, K, H), FP32))
  v = np.array(random_array(rng, (2, T, K, H), FP32))
  clean_q, clean_k = q.copy(), k.copy()
  q[0, NAN_QUERY[0], NAN_QUERY[1], 5] = np.nan
  k[0, NAN_KEY, 0, 7] = np.nan
  return q, k, v, clean_q, clean_k, np.array([T, 0], np.int32)


def _prefill_nan_rows():
  """[T, N] the causal rows of sequence 0 that see a NaN: heads of KV head 0 at t >= NAN_KEY,
  and the NaN query's own row."""
  rows = np.zeros((T, N), bool)
  rows[NAN_KEY:, : N // K] = True
  rows[NAN_QUERY] = True
  return rows


def _check_prefill(out, lse, clean_q, clean_k, v, kv_lengths):
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  nan_rows = _prefill_nan_rows()
  np.testing.assert_array_equal(np.isnan(out[0]).all(-1), nan_rows)
  np.testing.assert_array_equal(np.isnan(out[0]).any(-1), nan_rows)
  np.testing.assert_array_equal(np.isnan(lse[0]), nan_rows)
  np.testing.assert_array_equal(out[1], 0.)  # no key: zeros
  np.testing.assert_array_equal(lse[1], -np.inf)
  ref_out, ref_lse = attention_f64(clean_q, clean_k, v, is_causal=True, kv_lengths=kv_lengths)
  assert_close(out[0][~nan_rows], ref_out[0][~nan_rows], FP32)
  assert_close(lse[0][~nan_rows], ref_lse[0][~nan_rows], FP32, what="lse")


def _prefill(q, k, v, kv_lengths, *, implementation, interpret):
  return jaxflash.prefill_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), key_value_seq_lengths=jnp.asarray(kv_lengths),
      is_causal=True, return_residual=True, implementation=implementation, interpret=interpret)


def test_prefill_nan_rows(rng, interpret):
  q, k, v, clean_q, clean_k, kv_lengths = _prefill_inputs(rng)
  out, lse = _prefill(q, k, v, kv_lengths, implementation="triton", interpret=interpret)
  _check_prefill(out, lse, clean_q, clean_k, v, kv_lengths)


def test_prefill_default_implementation_nan_rows(rng, interpret):
  """The default implementation: on an sm_90 GPU compiled, the Mosaic GPU kernel."""
  q, k, v, clean_q, clean_k, kv_lengths = _prefill_inputs(rng)
  out, lse = _prefill(q, k, v, kv_lengths, implementation=None, interpret=interpret)
  _check_prefill(out, lse, clean_q, clean_k, v, kv_lengths)


def test_prefill_backward_nan_gradients(rng, interpret):
  """dq and dk NaN exactly where jax.nn's are (dq on the rows that saw a NaN); dv NaN on the
  keys a NaN row saw and finite on the keys hidden from it (jax.nn's softmax spreads a NaN
  row over hidden keys too, so dv is checked against the pattern itself); the other
  sequence's gradients finite."""
  q, k, v, _, _, kv_lengths = _prefill_inputs(rng)
  kv_lengths = np.array([T, 5], np.int32)  # sequence 1 attends here, so its gradients are real
  d_out = random_array(rng, q.shape, FP32)

  def grads(fn):
    _, vjp = jax.vjp(fn, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    return [np.asarray(g) for g in vjp(d_out)]

  dq, dk, dv = grads(lambda q, k, v: jaxflash.prefill_attention(
      q, k, v, key_value_seq_lengths=jnp.asarray(kv_lengths), is_causal=True, implementation="triton",
      interpret=interpret))
  dq_nn, dk_nn, _ = grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=jnp.asarray(kv_lengths), is_causal=True))
  np.testing.assert_array_equal(np.isnan(dq), np.isnan(dq_nn))
  np.testing.assert_array_equal(np.isnan(dk), np.isnan(dk_nn))
  np.testing.assert_array_equal(np.isnan(dq[0]).all(-1), _prefill_nan_rows())
  assert np.isnan(dv[0, :, 0]).all()  # rows t >= NAN_KEY saw every key of KV head 0
  nan_row = NAN_QUERY[0]  # the NaN query (KV head 1) saw keys 0..nan_row only
  assert np.isnan(dv[0, : nan_row + 1, 1]).all() and np.isfinite(dv[0, nan_row + 1:, 1]).all()
  for g in (dq, dk, dv):
    assert np.isfinite(g[1]).all()


def _decode_inputs(rng, capacity=16):
  """Sequence 0 sees a NaN key (KV head 0); sequence 1 has no keys; sequence 2 has a NaN key
  past its length (not seen)."""
  q = np.array(random_array(rng, (3, 1, N, H), FP32))
  k = np.array(random_array(rng, (3, capacity, K, H), FP32))
  v = np.array(random_array(rng, (3, capacity, K, H), FP32))
  clean_k = k.copy()
  k[0, 3, 0, 2] = np.nan
  k[2, 9, 1, 0] = np.nan
  return q, k, v, clean_k, np.array([11, 0, 6], np.int32)


def _check_decode(out, lse, q, clean_k, v, lengths):
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  group = N // K
  assert np.isnan(out[0, 0, :group]).all() and np.isnan(lse[0, 0, :group]).all()
  np.testing.assert_array_equal(out[1], 0.)
  np.testing.assert_array_equal(lse[1], -np.inf)
  ref_out, ref_lse = attention_f64(q, clean_k, v, kv_lengths=lengths)
  assert_close(out[0, :, group:], ref_out[0, :, group:], FP32)
  assert_close(out[2], ref_out[2], FP32)
  assert_close(lse[2], ref_lse[2], FP32, what="lse")


def test_decode_nan_rows(rng, interpret):
  q, k, v, clean_k, lengths = _decode_inputs(rng)
  out, lse = jaxflash.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                                       num_splits=2, return_residual=True, interpret=interpret)
  _check_decode(out, lse, q, clean_k, v, lengths)


def _paged(cache, page=8):
  """[B, S, K, H] -> (pages [B * S / page, page, K, H], block table [B, S / page]), pages in
  reversed order so the table is not the identity."""
  b, s = cache.shape[:2]
  pages = cache.reshape(b * s // page, page, *cache.shape[2:])[::-1]
  table = (b * s // page - 1 - np.arange(b * s // page)).reshape(b, s // page).astype(np.int32)
  return jnp.asarray(np.ascontiguousarray(pages)), jnp.asarray(table)


def test_paged_decode_nan_rows(rng, interpret):
  q, k, v, clean_k, lengths = _decode_inputs(rng)
  (k_pages, table), (v_pages, _) = _paged(k), _paged(v)
  out, lse = jaxflash.paged_decode_attention(jnp.asarray(q), k_pages, v_pages, jnp.asarray(lengths), table,
                                             num_splits=2, return_residual=True, interpret=interpret)
  _check_decode(out, lse, q, clean_k, v, lengths)


def test_paged_prefill_nan_rows(rng, interpret):
  q, k, v, clean_q, clean_k, kv_lengths = _prefill_inputs(rng)
  pad = lambda x: np.concatenate([x, np.zeros((2, 8 - T, K, H), np.float32)], axis=1)  # one page
  (k_pages, table), (v_pages, _) = _paged(pad(k)), _paged(pad(v))
  out, lse = jaxflash.paged_prefill_attention(jnp.asarray(q), k_pages, v_pages, jnp.asarray(kv_lengths), table,
                                              is_causal=True, return_residual=True, interpret=interpret)
  _check_prefill(out, lse, clean_q, clean_k, v, kv_lengths)


def _lse_bound(q, k):
  """float32 scores are rounded relative to the terms of their dot products, not to the
  result: |error| <= ~H * eps * scale * sum_h |q_h k_h|, taken as 1e-6 of the largest such
  magnitude (for ~1e9 logits, tens in the LSE: the documented bound)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  return 1e-6 * q.shape[-1] ** -0.5 * np.einsum("btnh,bsnh->btns", np.abs(q), np.abs(k)).max()


def test_extreme_logits_prefill_and_decode(rng, interpret):
  """Logits of ~1e9 (a key scaled by 1e9): the reference's output and a finite LSE within
  float32's rounding of the scores (`_lse_bound`)."""
  q = random_array(rng, (1, T, N, H), FP32)
  k = np.array(random_array(rng, (1, T, K, H), FP32))
  v = random_array(rng, (1, T, K, H), FP32)
  k[0, 2] *= 1e9
  k[0, 5, 1] *= -1e9
  k = jnp.asarray(k)
  ref_out, ref_lse = attention_f64(q, k, v)
  out, lse = jaxflash.prefill_attention(q, k, v, return_residual=True, implementation="triton",
                                        interpret=interpret)
  assert_close(out, ref_out, FP32)
  assert np.isfinite(np.asarray(lse)).all()
  np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=0, atol=_lse_bound(q, k))
  ref_out, ref_lse = attention_f64(q[:, :1], k, v)  # one query, every key
  out, lse = jaxflash.decode_attention(q[:, :1], k, v, num_splits=2, return_residual=True, interpret=interpret)
  assert_close(out, ref_out, FP32)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=0, atol=_lse_bound(q[:, :1], k))
