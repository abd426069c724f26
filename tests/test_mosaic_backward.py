"""The Mosaic GPU (sm_90) backward against float64 gradients.

The kernels run compiled only (marker `gpu`): JAX's Mosaic GPU interpret mode cannot run
wgmma on transposed shared-memory operands nor accumulators in place
(jaxflash._mosaic.INTERPRET_GAPS), so on the CPU the tests check what needs no GPU:
`backward_reason` on device descriptions (the dispatch rule), the config and the argument
checks. The residuals (out, LSE) come from the plain-JAX reference, so a failure here is the
backward's own. Tolerance as tests/test_prefill_backward.py: a small multiple of plain XLA
attention's error in the same dtype.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import _mosaic
from jaxflash.device import A100, H200, RTX_4060_LAPTOP
from jaxflash.mosaic.backward import mosaic_backward
from jaxflash.mosaic.backward_config import (MosaicBackwardConfig, backward_reason,
                                             mosaic_backward_config)
from jaxflash.reference import attention_reference
from jaxflash.score_mods import ScoreMods
from tests.conftest import HAS_GPU, SM90_ONLY, poison_allocator
from tests.test_prefill_backward import _check_grads, _inputs, grads_f64

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
gpu = pytest.mark.gpu
CPU_ONLY = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")
NEEDS_MOSAIC = pytest.mark.skipif(not _mosaic.AVAILABLE,
                                  reason=f"no Mosaic GPU in this JAX: {_mosaic.IMPORT_ERROR}")


def _residuals(q, k, v, *, causal, q_lengths=None, kv_lengths=None, window=None, mask=None):
  """The forward's (out in the inputs' dtype, natural-log LSE), from the float32 reference."""
  out, lse = attention_reference(q.astype(F32), k.astype(F32), v.astype(F32), None,
                                 None if mask is None else jnp.asarray(mask),
                                 scale=q.shape[-1] ** -0.5, is_causal=causal,
                                 query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                                 local_window_size=window)
  return out.astype(q.dtype), lse


def _grads(q, k, v, d_out, q_lengths=None, kv_lengths=None, *, causal, window=None, mask=None,
           **kwargs):
  """mosaic_backward's gradients from the reference's residuals; `mask` [B, 1, T, S] is the
  segment ids' explicit mask, for the residuals (kwargs carry the ids)."""
  out, lse = _residuals(q, k, v, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths,
                        window=window, mask=mask)
  poison_allocator(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))
  return mosaic_backward(q, k, v, out, lse, d_out, q_lengths, kv_lengths, causal=causal,
                         window=window, **kwargs)


# (batch, T, S, N, K, head_dim, dtype, causal): odd lengths, T < S and T > S, GQA groups
# 1, 2, 5, 6, 7, the three head dims (at 256 both consumers share a CTA's 64 keys) and both
# dtypes.
CASES = [
    (1, 17, 17, 2, 1, 64, BF16, True),
    (2, 100, 129, 6, 1, 128, F16, True),  # T < S: bottom-right diagonal
    (1, 129, 100, 5, 1, 128, BF16, True),  # T > S: the first 29 rows see no key
    (1, 33, 70, 7, 1, 64, BF16, False),
    (1, 256, 256, 2, 2, 128, BF16, True),  # whole tiles: only the diagonal is masked
    (1, 300, 257, 4, 2, 64, F16, False),
    (2, 1000, 1100, 12, 2, 128, BF16, True),  # many tiles, the ring wraps many times
    (1, 1, 129, 4, 2, 128, BF16, True),  # one query row
    (1, 100, 129, 6, 1, 256, BF16, True),
    (1, 129, 100, 7, 1, 256, F16, True),
    (1, 300, 257, 4, 2, 256, BF16, False),  # 257 keys: a last CTA of one valid key
    (2, 700, 650, 6, 1, 256, BF16, True),  # the ring and the dQ kernel's one slot wrap
    (1, 1, 129, 4, 2, 256, BF16, True),
]


def _case_id(case):
  b, t, s, n, kh, h, dtype, causal = case
  return f"b{b}-t{t}-s{s}-n{n}-k{kh}-h{h}-{jnp.dtype(dtype).name}-{'causal' if causal else 'full'}"


@gpu
@SM90_ONLY
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gradients_match_float64(case, rng):
  b, t, s, n, kh, h, dtype, causal = case
  q, k, v, d_out = _inputs(rng, b, t, s, n, kh, h, dtype)
  grads = _grads(q, k, v, d_out, causal=causal)
  _check_grads(grads, q, k, v, d_out, is_causal=causal)


# (batch, T, S, N, K, head_dim, dtype, causal, window (left, right)): windows narrower and
# wider than a 64-row block, one-sided and two-sided, T < S and T > S, zero width.
WINDOW_CASES = [
    (1, 300, 300, 6, 2, 128, BF16, True, (40, 0)),
    (2, 200, 331, 5, 1, 64, F16, False, (37, 50)),
    (1, 700, 650, 4, 2, 128, BF16, True, (200, 0)),
    (1, 257, 257, 2, 1, 64, BF16, False, (0, 0)),
    (1, 1000, 1000, 7, 1, 128, BF16, False, (300, 129)),
    (1, 300, 333, 6, 1, 256, BF16, True, (70, 0)),
    (2, 257, 300, 7, 1, 256, F16, False, (37, 50)),
]


@gpu
@SM90_ONLY
@pytest.mark.parametrize("case", WINDOW_CASES,
                         ids=lambda c: f"{_case_id(c[:8])}-w{c[8][0]}-{c[8][1]}")
def test_window_gradients_match_float64(case, rng):
  """Sliding windows: the key blocks outside every row's window are loop bounds, the edges
  masked; the gradients match float64's."""
  b, t, s, n, kh, h, dtype, causal, window = case
  q, k, v, d_out = _inputs(rng, b, t, s, n, kh, h, dtype)
  grads = _grads(q, k, v, d_out, causal=causal, window=window)
  _check_grads(grads, q, k, v, d_out, is_causal=causal, window=window)


@gpu
@SM90_ONLY
def test_window_with_ragged_lengths(rng):
  q_lengths = np.array([129, 5, 100, 0], np.int32)
  kv_lengths = np.array([137, 137, 30, 130], np.int32)
  q, k, v, d_out = _inputs(rng, 4, 129, 137, 6, 2, 128, BF16)
  d_out = jnp.where((np.arange(129)[None, :] < q_lengths[:, None])[:, :, None, None], d_out, 0)
  grads = _grads(q, k, v, d_out, jnp.asarray(q_lengths), jnp.asarray(kv_lengths), causal=True,
                 window=(70, 0))
  _check_grads(grads, q, k, v, d_out, is_causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths,
               window=(70, 0))


def _packed_ids(rng, batch, n, min_len, max_len):
  """[batch, n] int32 ids of documents of min_len..max_len tokens back to back."""
  return np.stack([np.repeat(np.arange(n), rng.integers(min_len, max_len + 1, size=n))[:n]
                   for _ in range(batch)]).astype(np.int32)


def _segment_mask(q_ids, kv_ids):
  return np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]  # [B, 1, T, S]


# (batch, T, S, N, K, head_dim, dtype, causal, ids): packed documents longer and shorter than a
# block, ids in no order (blocks rarely skipped, every comparison made), one document.
SEGMENT_CASES = [
    (2, 1000, 1000, 6, 2, 128, BF16, True, ("packed", 30, 400)),
    (1, 777, 777, 5, 1, 64, F16, True, ("packed", 1, 100)),
    (2, 1000, 1000, 7, 1, 128, BF16, False, ("packed", 60, 500)),
    (2, 500, 500, 4, 2, 128, BF16, True, ("scattered", 0, 4)),
    (1, 300, 300, 8, 8, 64, BF16, True, ("packed", 300, 300)),
    (2, 600, 600, 6, 2, 256, BF16, True, ("packed", 30, 300)),
    (1, 333, 333, 7, 1, 256, BF16, False, ("scattered", 0, 3)),
]


@gpu
@SM90_ONLY
@pytest.mark.parametrize("case", SEGMENT_CASES,
                         ids=lambda c: f"{_case_id(c[:8])}-{c[8][0]}{c[8][1]}_{c[8][2]}")
def test_segment_gradients_match_float64(case, rng):
  """Packed documents: query and key blocks whose ids cannot meet are loop bounds, the rest
  compare ids per element; gradients as float64's with the equivalent explicit mask."""
  b, t, s, n, kh, h, dtype, causal, (kind, lo, hi) = case
  q, k, v, d_out = _inputs(rng, b, t, s, n, kh, h, dtype)
  ids = (_packed_ids(rng, b, t, lo, hi) if kind == "packed"
         else rng.integers(lo, hi, size=(b, t)).astype(np.int32))
  mask = _segment_mask(ids, ids)
  grads = _grads(q, k, v, d_out, causal=causal, mask=mask, segment_ids=jnp.asarray(ids))
  _check_grads(grads, q, k, v, d_out, is_causal=causal, mask=mask)


@gpu
@SM90_ONLY
def test_segments_with_lengths_window_and_t_ne_s(rng):
  """Queries over a longer cache (T < S), ragged lengths, a window and ids of the keys' own:
  each restriction ANDed with the documents."""
  q, k, v, d_out = _inputs(rng, 2, 300, 700, 6, 2, 128, BF16)
  kv_ids = _packed_ids(rng, 2, 700, 50, 300)
  q_ids = kv_ids[:, 400:]  # the queries are the last 300 keys' tokens
  q_len, kv_len = np.array([300, 250], np.int32), np.array([700, 650], np.int32)
  d_out = jnp.where((np.arange(300)[None, :] < q_len[:, None])[:, :, None, None], d_out, 0)
  mask = _segment_mask(q_ids, kv_ids)
  grads = _grads(q, k, v, d_out, jnp.asarray(q_len), jnp.asarray(kv_len), causal=True,
                 window=(200, 0), mask=mask, segment_ids=jnp.asarray(q_ids),
                 kv_segment_ids=jnp.asarray(kv_ids))
  _check_grads(grads, q, k, v, d_out, is_causal=True, q_lengths=q_len, kv_lengths=kv_len,
               window=(200, 0), mask=mask)


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim,sm_count,splits", [
    (128, 18, 1), (128, 30, 2), (128, 50, 3), (128, 132, 6),
    (256, 50, 2), (256, 80, 3), (256, 132, 6)])  # 64 keys a CTA at 256: twice the CTAs
def test_head_splits_match_float64(head_dim, sm_count, splits, monkeypatch, rng):
  """The dK/dV kernel with each KV head's group of 6 split in 1, 2, 3 or 6 parts (partial
  sums added by XLA; the part count follows the SM count, stood in for here) gives what
  float64 gives."""
  from jaxflash.mosaic import backward
  info = dataclasses.replace(H200, sm_count=sm_count)
  monkeypatch.setattr(backward, "device_info", lambda: info)
  # T differs per case: mosaic_backward is jitted, and the part count is read while tracing.
  q, k, v, d_out = _inputs(rng, 2, 1000 + sm_count, 1100, 12, 2, head_dim, BF16)
  config = mosaic_backward_config(head_dim, BF16)
  assert backward.head_splits(k.shape, 6, config, causal=True, sm_count=sm_count) == splits
  _check_grads(_grads(q, k, v, d_out, causal=True), q, k, v, d_out, is_causal=True)


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ragged_lengths_give_zero_gradients_on_padding(causal, head_dim, rng):
  # Full; short queries over long keys; zero keys; zero queries; more queries than keys.
  q_lengths = np.array([129, 5, 100, 0, 129], np.int32)
  kv_lengths = np.array([137, 137, 0, 130, 9], np.int32)
  q, k, v, d_out = _inputs(rng, 5, 129, 137, 6, 2, head_dim, BF16)
  pad_q = (np.arange(129)[None, :] >= q_lengths[:, None])[:, :, None, None]
  pad_kv = (np.arange(137)[None, :] >= kv_lengths[:, None])[:, :, None, None]
  out, lse = _residuals(q, k, v, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
  # Padding holds garbage (NaN, inf): none of it may reach a gradient.
  dirty = (jnp.where(pad_q, jnp.nan, q), jnp.where(pad_kv, jnp.inf, k), jnp.where(pad_kv, jnp.nan, v))
  d_out_dirty = jnp.where(pad_q, jnp.nan, d_out)
  grads = mosaic_backward(*dirty, out, lse, d_out_dirty, jnp.asarray(q_lengths),
                          jnp.asarray(kv_lengths), causal=causal)
  _check_grads(grads, q, k, v, jnp.where(pad_q, 0, d_out), is_causal=causal, q_lengths=q_lengths,
               kv_lengths=kv_lengths)
  dq, dk, dv = (np.asarray(x.astype(F32)) for x in grads)
  assert (dq[np.broadcast_to(pad_q, dq.shape)] == 0).all(), "padded query rows: zero dq"
  assert (dk[np.broadcast_to(pad_kv, dk.shape)] == 0).all(), "padded keys: zero dk"
  assert (dv[np.broadcast_to(pad_kv, dv.shape)] == 0).all(), "padded keys: zero dv"
  assert (dq[2] == 0).all() and (dk[3] == 0).all(), "nothing to attend: zero gradients"


@gpu
@SM90_ONLY
def test_lse_cotangent(rng):
  q, k, v, d_out = _inputs(rng, 1, 200, 190, 4, 2, 64, F16)
  d_lse = jnp.asarray(rng.standard_normal((1, 200, 4)), F32)
  out, lse = _residuals(q, k, v, causal=True)
  grads = mosaic_backward(q, k, v, out, lse, d_out, causal=True, d_lse=d_lse)
  want = grads_f64(q, k, v, d_out, is_causal=True, d_lse=d_lse)
  for got, ref in zip(grads, want):
    err = np.abs(np.asarray(got.astype(F32), np.float64) - ref).max()
    assert err <= 1e-2 * max(1.0, np.abs(ref).max()), err


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim", [128, 256])
def test_deterministic(head_dim, rng):
  """No atomics: every element is summed in one order, so two calls agree bit for bit."""
  q, k, v, d_out = _inputs(rng, 1, 700, 700, 6, 1, head_dim, BF16)
  out, lse = _residuals(q, k, v, causal=True)
  first = mosaic_backward(q, k, v, out, lse, d_out, causal=True)
  second = mosaic_backward(q, k, v, out, lse, d_out, causal=True)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))


@gpu
@SM90_ONLY
@pytest.mark.parametrize("window,packed,head_dim", [
    (None, False, 128), ((100, 0), False, 128), (None, True, 128), (None, False, 256)],
    ids=["causal", "window", "packed", "causal-d256"])
def test_mosaic_forward_with_mosaic_backward(window, packed, head_dim, rng):
  """jax.grad through jaxflash.attention with backward_implementation="mosaic": the Mosaic
  prefill and this backward as its VJP."""
  import jaxflash
  ids = _packed_ids(rng, 1, 300, 20, 150) if packed else None

  def attend(q, k, v):
    return jaxflash.attention(q, k, v, is_causal=True, local_window_size=window,
                              segment_ids=None if ids is None else jnp.asarray(ids),
                              backward_implementation="mosaic")

  q, k, v, d_out = _inputs(rng, 1, 300, 300, 6, 2, head_dim, BF16)
  grads = jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](d_out))(q, k, v)
  _check_grads(grads, q, k, v, d_out, is_causal=True, window=window,
               mask=None if ids is None else _segment_mask(ids, ids))


@gpu
@SM90_ONLY
def test_default_gradient_takes_mosaic_backward(rng):
  """jax.grad through jaxflash.attention with every default: past one wave of dK/dV programs
  (1 x 8 KV heads x 17 blocks of 128 keys = 136 CTAs) the Mosaic backward runs, and its
  gradients match float64's."""
  import jaxflash
  from jaxflash import vjp
  from jaxflash.score_mods import ScoreMods
  q, k, v, d_out = _inputs(rng, 1, 2100, 2100, 16, 8, 64, BF16)
  mods = ScoreMods.from_options(is_causal=True, causal_alignment="top_left")
  assert vjp.default_backward_reason(q, k, v, vjp.Options(), mods=mods, static_scale=0.125) is None
  grads = jax.jit(lambda q, k, v: jax.vjp(
      lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True), q, k, v)[1](d_out))(q, k, v)
  _check_grads(grads, q, k, v, d_out, is_causal=True)


# ----------------------------------------------------------------------------- CPU: no kernels

def _struct(shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = _struct((1, 100, 6, 128)), _struct((1, 90, 2, 128))
_CAUSAL = ScoreMods(is_causal=True)


@NEEDS_MOSAIC
def test_reason_none_on_hopper():
  assert backward_reason(Q, KV, KV, info=H200) is None
  assert backward_reason(Q, KV, KV, info=H200, is_causal=True) is None
  q64, kv64 = _struct((2, 7, 5, 64), F16), _struct((2, 9, 1, 64), F16)
  assert backward_reason(q64, kv64, kv64, info=H200) is None
  assert backward_reason(Q, KV, KV, info=H200, is_causal=True, local_window_size=(8, 0)) is None
  ids = _struct((1, 100), jnp.int32)
  assert backward_reason(Q, Q, Q, info=H200, segment_ids=ids, kv_segment_ids=ids) is None
  q256, kv256 = _struct((1, 100, 7, 256)), _struct((1, 90, 1, 256))
  assert backward_reason(q256, kv256, kv256, info=H200, is_causal=True) is None


@NEEDS_MOSAIC
@pytest.mark.parametrize("info", [A100, RTX_4060_LAPTOP], ids=lambda i: i.name)
def test_reason_other_gpus(info):
  assert "sm_90" in backward_reason(Q, KV, KV, info=info)


@NEEDS_MOSAIC
@pytest.mark.parametrize("option,value", [
    ("logits_soft_cap", 30.0), ("bias", np.zeros((1,))),
    ("mask", np.ones((1,), bool)), ("sinks", np.zeros((6,)))])
def test_reason_names_unserved_options(option, value):
  reason = backward_reason(Q, KV, KV, info=H200, **{option: value})
  assert reason is not None and option in reason


@NEEDS_MOSAIC
def test_reason_shapes_and_dtypes():
  assert "causal_alignment" in backward_reason(Q, KV, KV, info=H200, causal_alignment="top_left")
  for h in (80, 192, 320):
    q, kv = _struct((1, 8, 2, h)), _struct((1, 8, 1, h))
    assert f"head_dim={h}" in backward_reason(q, kv, kv, info=H200)
  q32, kv32 = _struct((1, 8, 2, 64), F32), _struct((1, 8, 1, 64), F32)
  assert "float32" in backward_reason(q32, kv32, kv32, info=H200)
  assert "multiple" in backward_reason(_struct((1, 8, 3, 64)), _struct((1, 8, 2, 64)),
                                       _struct((1, 8, 2, 64)), info=H200)


@NEEDS_MOSAIC
def test_top_left_served_where_it_is_bottom_right(monkeypatch):
  """jaxflash.attention's default alignment is jax.nn's top-left: with as many queries as keys
  and no lengths it is the bottom-right mask, which the Mosaic backward serves."""
  from jaxflash import vjp
  from jaxflash.mosaic import backward_config
  from jaxflash.score_mods import ScoreMods
  monkeypatch.setattr(backward_config, "device_reason", lambda info: None)
  monkeypatch.setattr(backward_config, "device_info", lambda: H200)
  mods = ScoreMods.from_options(is_causal=True, causal_alignment="top_left")
  square = _struct((1, 90, 6, 128))

  def reason(q, options=vjp.Options()):
    return vjp.mosaic_backward_reason(q, KV, KV, options, mods=mods, static_scale=0.1)

  assert reason(square) is None
  assert "causal_alignment" in reason(Q)  # T = 100 queries, S = 90 keys
  lengths = jnp.full((1,), 90, jnp.int32)
  assert "causal_alignment" in reason(square, vjp.Options(q_lengths=lengths, kv_lengths=lengths))


@NEEDS_MOSAIC
@pytest.mark.parametrize("batch,seq,head_dim,chosen", [
    (1, 1024, 128, False), (1, 2048, 128, True), (1, 4096, 128, True), (1, 16384, 128, True),
    (4, 4096, 128, True), (1, 512, 256, False), (1, 1024, 256, False)])
def test_default_takes_mosaic_from_one_wave(monkeypatch, batch, seq, head_dim, chosen):
  """backward_implementation=None: the Mosaic backward once its dK/dV kernel, the group of 6
  query heads split in up to 6 parts, has a CTA per SM (B x 2 KV heads x S / 128 x 6 >= 132
  on the H200; S / 64 at head dim 256, where a CTA holds 64 keys), the Triton one below."""
  from jaxflash import device, vjp
  from jaxflash.mosaic import backward_config
  from jaxflash.score_mods import ScoreMods
  monkeypatch.setattr(backward_config, "device_reason", lambda info: None)
  monkeypatch.setattr(backward_config, "device_info", lambda: H200)
  monkeypatch.setattr(device, "device_info", lambda: H200)
  mods = ScoreMods.from_options(is_causal=True)
  q, kv = _struct((batch, seq, 12, head_dim)), _struct((batch, seq, 2, head_dim))
  reason = vjp.default_backward_reason(q, kv, kv, vjp.Options(), mods=mods, static_scale=0.1)
  assert (reason is None) == chosen, reason
  if not chosen:
    assert ("wave" if head_dim == 128 else "head dims over 128") in reason


@CPU_ONLY
@NEEDS_MOSAIC
@pytest.mark.parametrize("shape,causal,window,segments", [
    ((1, 4096, 4096, 12, 2, 128), True, None, False), ((2, 300, 257, 4, 2, 64), False, None, False),
    ((1, 130, 129, 7, 1, 64), True, None, False), ((2, 300, 333, 6, 2, 128), True, (70, 0), False),
    ((2, 300, 333, 6, 2, 64), False, (37, 50), False), ((2, 300, 333, 6, 2, 128), True, None, True),
    ((2, 300, 333, 6, 2, 64), False, (70, 3), True),
    ((1, 300, 333, 6, 1, 256), True, None, False), ((2, 333, 300, 7, 1, 256), False, None, False),
    ((2, 300, 333, 6, 2, 256), True, (70, 0), False),
    ((2, 300, 333, 7, 1, 256), False, (37, 50), False),
    ((2, 300, 333, 6, 2, 256), True, None, True), ((1, 333, 300, 7, 1, 256), False, (70, 3), True)],
    ids=["4k-g6", "full-d64", "g7", "window", "two-sided-window", "segments", "segments-window",
         "d256-g6", "d256-full-g7", "d256-window", "d256-two-sided-window", "d256-segments",
         "d256-segments-window-g7"])
def test_kernels_lower_for_cuda(shape, causal, window, segments, monkeypatch):
  """Off the GPU the kernels cannot run, but they trace and lower for CUDA: the dK/dV kernel
  with its group parts (float32 partial sums) and the dQ kernel, with windows and segment
  ids too; at head dim 256 both consumers share the keys."""
  from jaxflash.mosaic import backward
  monkeypatch.setattr(_mosaic, "on_gpu", lambda: True)
  monkeypatch.setattr(backward, "device_info", lambda: H200)
  b, t, s, n, kh, h = shape
  q, kv, lse = _struct((b, t, n, h)), _struct((b, s, kh, h)), _struct((b, t, n), F32)
  ids = (_struct((b, t), jnp.int32), _struct((b, s), jnp.int32)) if segments else (None, None)
  config = mosaic_backward_config(h, BF16)

  def run(q, k, v, out, lse, d_out, q_ids, kv_ids):
    return mosaic_backward(q, k, v, out, lse, d_out, causal=causal, window=window,
                           segment_ids=q_ids, kv_segment_ids=kv_ids, config=config)

  grads = jax.eval_shape(run, q, kv, kv, q, lse, q, *ids)
  assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
  text = jax.jit(run).trace(q, kv, kv, q, lse, q, *ids).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 2
  for name in ("mosaic_backward_dkdv", "mosaic_backward_dq"):  # the kernels' symbols
    assert f"{name}_mosaic_gpu" in text, name
  if segments:  # under vmap the mapped axis joins the batch, the ids and their ranges with it
    stacked = [None if x is None else _struct((3, *x.shape), x.dtype)
               for x in (q, kv, kv, q, lse, q, *ids)]
    grads = jax.eval_shape(jax.vmap(run), *stacked)
    assert [g.shape for g in grads] == [(3, *q.shape), (3, *kv.shape), (3, *kv.shape)]


@pytest.mark.parametrize("key_shape,group,causal,splits", [
    ((1, 4096, 2, 128), 6, True, 6), ((1, 16384, 2, 128), 6, True, 2), ((1, 32768, 2, 128), 6, True, 1),
    ((1, 8192, 2, 128), 6, False, 2), ((1, 16384, 2, 128), 6, False, 1), ((1, 4096, 2, 128), 6, False, 3), ((1, 1024, 2, 128), 7, True, 7),
    ((1, 1024, 8, 128), 1, True, 1),
    # Head dim 256: 64 keys a CTA, twice the CTAs of 128 for as many keys, so fewer parts.
    ((1, 4096, 2, 256), 6, True, 3), ((1, 8192, 2, 256), 6, True, 2),
    ((1, 16384, 2, 256), 6, True, 1), ((1, 4096, 2, 256), 6, False, 2),
    ((1, 8192, 2, 256), 6, False, 1)])
def test_head_splits_fill_the_gpu(key_shape, group, causal, splits):
  """The fewest parts (a divisor of the group) giving a CTA per SM, two under a causal mask."""
  from jaxflash.mosaic.backward_config import dkv_programs, head_splits
  config = mosaic_backward_config(key_shape[-1], BF16)
  assert head_splits(key_shape, group, config, causal=causal, sm_count=132) == splits
  keys_per_cta = 64 if key_shape[-1] == 256 else 128
  assert dkv_programs(key_shape, group, config, causal=causal, sm_count=132) == (
      key_shape[0] * key_shape[2] * -(-key_shape[1] // keys_per_cta) * splits)


@CPU_ONLY
def test_reason_without_gpu():
  assert backward_reason(Q, KV, KV) is not None


def test_config_checks_and_default():
  with pytest.raises(ValueError, match="block_kv"):
    MosaicBackwardConfig(64, 128)
  with pytest.raises(ValueError, match="num_stages"):
    MosaicBackwardConfig(num_stages=0)
  with pytest.raises(ValueError, match="dq_stages"):
    MosaicBackwardConfig(dq_stages=0)
  for h in (64, 128, 256):
    config = mosaic_backward_config(h, BF16)
    assert config.smem_bytes(h, 2) <= H200.smem_per_block
    assert dataclasses.replace(config) == config  # frozen and hashable: a static argument
    hash(config)
  # The dQ kernel's ring follows the dK/dV kernel's but at 256, where one slot fits.
  assert MosaicBackwardConfig(num_stages=3).dq_stages == 3
  assert [mosaic_backward_config(h, BF16).dq_stages for h in (64, 128, 256)] == [3, 2, 1]
  assert MosaicBackwardConfig().smem_bytes(256, 2) > H200.smem_per_block  # two dQ slots: no


@CPU_ONLY
@NEEDS_MOSAIC
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_smem_bytes_is_what_the_kernels_allocate(head_dim, monkeypatch):
  """MosaicBackwardConfig.smem_bytes (what backward_reason compares with the GPU's) is the
  shared memory of the larger kernel to the byte: lowering for CUDA passes under that limit
  and fails one byte below it."""
  from jax.experimental.mosaic.gpu import core
  from jaxflash.mosaic import backward
  monkeypatch.setattr(_mosaic, "on_gpu", lambda: True)
  monkeypatch.setattr(backward, "device_info", lambda: H200)
  config = mosaic_backward_config(head_dim, BF16)
  need = config.smem_bytes(head_dim, 2)
  q, kv, lse = (_struct((1, 300, 6, head_dim)), _struct((1, 333, 1, head_dim)),
                _struct((1, 300, 6), F32))
  lower = lambda: jax.jit(functools.partial(mosaic_backward, causal=True, config=config)).trace(
      q, kv, kv, q, lse, q).lower(lowering_platforms=("cuda",))
  with core.artificial_shared_memory_limit(need):
    lower()
  with core.artificial_shared_memory_limit(need - 1), pytest.raises(ValueError, match="shared"):
    lower()


@CPU_ONLY
@NEEDS_MOSAIC
def test_a_config_over_the_shared_memory_raises(monkeypatch):
  """MosaicBackwardConfig() keeps two dQ ring slots, which do not fit at head dim 256: a
  ValueError naming the config, before any kernel is built."""
  from jaxflash.mosaic import backward
  monkeypatch.setattr(_mosaic, "on_gpu", lambda: True)
  monkeypatch.setattr(backward, "device_info", lambda: H200)
  q, kv = jnp.zeros((1, 64, 2, 256), BF16), jnp.zeros((1, 64, 1, 256), BF16)
  with pytest.raises(ValueError, match=r"dq_stages=2\).*shared memory.*\(1, 64, 2, 256\)"):
    mosaic_backward(q, kv, kv, q, jnp.zeros((1, 64, 2), F32), q, config=MosaicBackwardConfig())


@NEEDS_MOSAIC
def test_bad_arguments_raise_naming_them():
  rng = np.random.default_rng(0)
  q, k, v, d_out = _inputs(rng, 1, 8, 8, 2, 1, 64, BF16)
  out, lse = q, jnp.zeros((1, 8, 2), F32)
  with pytest.raises(ValueError, match="lse"):
    mosaic_backward(q, k, v, out, lse[:, :4], d_out)
  with pytest.raises(ValueError, match="d_out"):
    mosaic_backward(q, k, v, out, lse, d_out[:, :4])
  with pytest.raises(TypeError, match="query"):
    mosaic_backward(q.astype(F32), k, v, out, lse, d_out)
  with pytest.raises(ValueError, match="segment_ids"):
    mosaic_backward(q, k, v, out, lse, d_out, segment_ids=jnp.zeros((1, 7), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids"):
    mosaic_backward(q, k, v, out, lse, d_out, segment_ids=jnp.zeros((1, 8), F32))
  with pytest.raises(ValueError, match="local_window_size"):
    mosaic_backward(q, k, v, out, lse, d_out, window=(-1, 0))
  q80, k80 = _inputs(rng, 1, 8, 8, 2, 1, 80, BF16)[:2]
  with pytest.raises(ValueError, match="head dims"):
    mosaic_backward(q80, k80, k80, q80, lse, q80)


@CPU_ONLY
@NEEDS_MOSAIC
def test_off_gpu_raises_not_implemented():
  rng = np.random.default_rng(0)
  q, k, v, d_out = _inputs(rng, 1, 8, 8, 2, 1, 64, BF16)
  with pytest.raises(NotImplementedError):
    mosaic_backward(q, k, v, q, jnp.zeros((1, 8, 2), F32), d_out)


@gpu
@SM90_ONLY
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_temp_memory_is_linear_in_length(packed):
  """Compiled: jax.grad through the default path (the Mosaic forward and backward) never
  materialises an n x n array, with packed documents too (temporary memory O(n))."""
  import jaxflash
  from jaxflash import vjp

  def temp_bytes(n):
    q, kv, ids = _struct((1, n, 12, 128)), _struct((1, n, 2, 128)), _struct((1, n), jnp.int32)
    loss = lambda q, k, v, ids: jnp.sum(jaxflash.attention(
        q, k, v, is_causal=True, segment_ids=ids if packed else None).astype(F32))
    reason = vjp.default_backward_reason(q, kv, kv, vjp.Options(), mods=_CAUSAL, static_scale=0.1)
    assert reason is None, reason
    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    return grad.lower(q, kv, kv, ids).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(4096), temp_bytes(16384)
  assert large <= 5 * max(small, 1 << 20), (small, large)
  assert large < 12 * 16384 * 16384 * 4 // 100, (small, large)  # one float32 score matrix


@gpu
@SM90_ONLY
def test_vmap_joins_the_batch(rng):
  q, k, v, d_out = _inputs(rng, 2, 130, 150, 4, 2, 64, BF16)
  out, lse = _residuals(q, k, v, causal=True)
  f = lambda *a: mosaic_backward(*a, causal=True)
  stacked = [jnp.stack([x, x[:, ::-1]]) for x in (q, k, v, out, lse, d_out)]
  batched = jax.vmap(f)(*stacked)
  single = f(q, k, v, out, lse, d_out)
  # The kernels see the same tiles; the delta pre-pass (rowsum(dO * O)) is an XLA reduction
  # whose order may follow the batch's shape, so a gradient may move by one bf16 ulp.
  for got, want in zip(batched, single):
    np.testing.assert_allclose(np.asarray(got[0].astype(F32)), np.asarray(want.astype(F32)),
                               rtol=2.0**-7, atol=0)


@CPU_ONLY
def test_a_mosaic_backward_config_asks_for_the_mosaic_backward():
  """backward_config=MosaicBackwardConfig() picks the Mosaic backward: refused (TypeError)
  with backward_implementation="triton" or after the Triton forward, and where the Mosaic
  backward cannot serve (here: no GPU) a ValueError says why."""
  import jaxflash
  from jaxflash import vjp
  from jaxflash.score_mods import ScoreMods
  q, kv = jnp.zeros((1, 8, 2, 64), BF16), jnp.zeros((1, 8, 1, 64), BF16)
  config = MosaicBackwardConfig()
  with pytest.raises(TypeError, match="MosaicBackwardConfig"):
    jaxflash.prefill_attention(q, kv, kv, implementation="triton", backward_config=config)
  choose = lambda implementation: vjp.choose_backward(implementation, q, kv, kv, vjp.Options(),
                                                      mods=ScoreMods(), static_scale=0.125, config=config)
  with pytest.raises(TypeError, match="backward_implementation='triton' does not take"):
    choose("triton")
  with pytest.raises(ValueError, match="a MosaicBackwardConfig cannot serve this call: .*GPU"):
    choose(None)
