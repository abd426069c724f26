"""The float16 operands of the Mosaic backward's dQ product (jaxflash/mosaic/float16_dq.py),
checked without a GPU: the scaling is exact, keeps float16 in range, and the dQ the kernel's
arithmetic gives from them (float16_dq_reference) lands nearer float64's than with dS in
bfloat16 on rows where one key dominates."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash._mosaic import LOG2_E
from jaxflash.mosaic.float16_dq import float16_dq_operands, float16_dq_reference

F32, BF16 = jnp.float32, jnp.bfloat16


def _case(rng, *, t=192, n=4, kh=2, h=64, peaky=False, row_scales=False):
  """bf16 q, k, v, d_out [1, T, N | K, H], causal, and the float64 residuals: out, the
  base-2 LSE and delta [1, N, T], and the visibility mask [1, 1, T, T]."""
  q = rng.standard_normal((1, t, n, h))
  k = rng.standard_normal((1, t, kh, h))
  if peaky:  # one key ~60 nats above the rest for every row that sees it
    u = rng.standard_normal(h)
    q += u
    k[0, t // 3] = 8 * u
  if row_scales:  # rows and keys spanning float16's range once unscaled
    q *= 10.0 ** rng.uniform(-3, 5, size=(1, t, n, 1))
    k *= 10.0 ** rng.uniform(-3, 4, size=(1, 1, kh, 1))
  v, d_out = rng.standard_normal((1, t, kh, h)), rng.standard_normal((1, t, n, h))
  q, k, v, d_out = (jnp.asarray(x, BF16) for x in (q, k, v, d_out))
  q64, k64, v64, do64 = (np.asarray(x.astype(F32), np.float64) for x in (q, k, v, d_out))
  g = n // kh
  scale = h ** -0.5
  visible = np.tril(np.ones((t, t), bool))[None, None]
  s = np.einsum("btnh,bsnh->bnts", q64, np.repeat(k64, g, 2)) * scale
  s = np.where(visible, s, -np.inf)
  lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)  # [1, N, T]
  p = np.exp(s - lse[..., None])
  out = np.einsum("bnts,bsnh->btnh", p, np.repeat(v64, g, 2))
  out = np.asarray(jnp.asarray(out, BF16).astype(F32), np.float64)  # the forward's bf16 output
  delta = np.einsum("btnh,btnh->bnt", do64, out)
  dp = np.einsum("btnh,bsnh->bnts", do64, np.repeat(v64, g, 2))
  dq64 = np.einsum("bnts,bsnh->btnh", p * (dp - delta[..., None]), np.repeat(k64, g, 2)) * scale
  return (q, k, v, d_out, jnp.asarray(lse * LOG2_E, F32), jnp.asarray(delta, F32),
          jnp.asarray(visible), dq64, scale)


def _bf16_ds_dq(q, k, v, d_out, lse2, delta, visible, scale):
  """dQ as the dQ kernel computed it before: bf16 operands, dS rounded to bf16."""
  g = q.shape[2] // k.shape[2]
  kr, vr = (jnp.repeat(x, g, 2).astype(F32) for x in (k, v))
  s = jnp.where(visible, jnp.einsum("btnh,bsnh->bnts", q.astype(F32), kr), -jnp.inf)
  p = jnp.exp2(s * (scale * LOG2_E) - lse2[..., None])
  dp = jnp.einsum("btnh,bsnh->bnts", d_out.astype(F32), vr)
  ds = (p * (dp - delta[..., None])).astype(BF16).astype(F32)
  return jnp.einsum("bnts,bsnh->btnh", ds, kr) * scale


@pytest.mark.parametrize("row_scales", [False, True], ids=["normal", "scaled-rows"])
def test_scaling_is_exact_and_in_range(row_scales):
  rng = np.random.default_rng(1)
  q, k, v, d_out, lse2, delta, visible, _, scale = _case(rng, row_scales=row_scales)
  ops = float16_dq_operands(q, k, v, d_out, lse2, delta, scale=scale)
  assert ops.q.dtype == ops.k.dtype == jnp.float16
  assert ops.q.shape == q.shape and ops.k.shape == k.shape
  for scaled in (ops.q, ops.k):
    assert np.isfinite(np.asarray(scaled, np.float32)).all()
    assert np.abs(np.asarray(scaled, np.float32)).max() < 2.0 ** 15
  # Undoing the powers of two gives the scores back to float32 rounding: Q16 K16^T 2^(a+e).
  g = q.shape[2] // k.shape[2]
  s = jnp.einsum("btnh,bsnh->bnts", q.astype(F32), jnp.repeat(k, g, 2).astype(F32))
  s16 = jnp.einsum("btnh,bsnh->bnts", ops.q.astype(F32), jnp.repeat(ops.k, g, 2).astype(F32))
  np.testing.assert_allclose(s16 * ops.score_scale[..., None], s * (scale * LOG2_E),
                             rtol=1e-5, atol=1e-5 * float(jnp.abs(s).max()) * scale)
  # dS 2^r, as the kernel forms it before rounding to float16, stays in float16's range.
  vr = jnp.repeat(v, g, 2).astype(F32)
  p = jnp.where(visible, jnp.exp2(s16 * ops.score_scale[..., None] - ops.lse2[..., None]), 0.0)
  dp = jnp.einsum("btnh,bsnh->bnts", d_out.astype(F32), vr)
  ds = p * (dp - delta[..., None])
  assert float(jnp.abs(ds).max()) < 2.0 ** 15


@pytest.mark.parametrize("peaky", [False, True], ids=["normal", "dominant-key"])
def test_dq_from_float16_operands_matches_float64(peaky):
  """The kernel's arithmetic on the scaled float16 operands: dQ within bf16 rounding of
  float64's, and no farther than with dS in bf16 (nearer on the dominant key's rows)."""
  rng = np.random.default_rng(7)
  q, k, v, d_out, lse2, delta, visible, dq64, scale = _case(rng, peaky=peaky)
  ops = float16_dq_operands(q, k, v, d_out, lse2, delta, scale=scale)
  dq16 = np.asarray(float16_dq_reference(ops, v, d_out, delta, visible), np.float64)
  dq_bf16 = np.asarray(_bf16_ds_dq(q, k, v, d_out, lse2, delta, visible, scale), np.float64)
  top = np.abs(dq64).max()
  err16, err_bf16 = np.abs(dq16 - dq64).max() / top, np.abs(dq_bf16 - dq64).max() / top
  assert err16 <= 2.0 ** -9, err16
  assert err16 <= err_bf16 * 1.05, (err16, err_bf16)
  if peaky:
    assert err16 < 0.5 * err_bf16, (err16, err_bf16)


def test_nan_stays_nan_and_empty_rows_stay_zero():
  rng = np.random.default_rng(3)
  q, k, v, d_out, lse2, delta, visible, _, scale = _case(rng, t=64)
  q = q.at[0, 5, 1, 7].set(jnp.nan)
  lse2 = lse2.at[0, 0, 9].set(jnp.inf)  # a row that attends nothing: P = 0
  ops = float16_dq_operands(q, k, v, d_out, lse2, delta, scale=scale)
  dq = np.asarray(float16_dq_reference(ops, v, d_out, delta, visible))
  assert np.isnan(dq[0, 5, 1]).all()
  assert (dq[0, 9, 0] == 0).all()
  assert np.isfinite(np.delete(dq[0, :, 1], 5, axis=0)).all()
