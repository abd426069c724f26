"""The operands of the Mosaic backward's dQ product in float16, scaled by powers of two.

The dQ kernel multiplies dS by K on the tensor cores, whose two operands share one 16-bit
type. In bfloat16, dS keeps 8 significant bits; on rows where one key dominates, which way
one rounding of dS falls moved dQ's largest error to 1.47x cuDNN's (bench/PERFORMANCE.md,
"Accuracy on hard inputs"). float16 keeps 11, at the price of range (largest 65504, normal
down to 2^-14). Scaling by powers of two is exact in float16 and float32, so:

* Q16 = Q 2^-a (a per row and query head) and K16 = K 2^-e (e per sequence and KV head),
  each scaled below 2^15: a bfloat16 or float16 value (at most 11 significant bits) is held
  exactly, so the float32 sums Q16 K16^T are the scores S times 2^-(a+e), rounded as S is;
* dS is scaled by 2^r per row and query head, r from the bound |dS_ts| = P_ts |dP_ts -
  delta_t| <= |dO_t| max_s |V_s| + |delta_t| (Cauchy-Schwarz; P <= 1), so dS 2^r < 2^15.

The kernel undoes them: P 2^r = exp2(S16 * score_scale - lse2), with score_scale = (scale
log2 e) 2^(a+e) and lse2 = LSE log2 e - r, and dQ = sum_s (dS 2^r)_s K16_s * out_scale, with
out_scale = scale 2^(e-r). NaN anywhere stays NaN.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jaxflash._mosaic import LOG2_E

# Scaled magnitudes stay below 2^15 (float16's largest is 65504); dS's bound is computed in
# float32, so it keeps one power of two to spare.
OPERAND_EXPONENT = 15
DS_EXPONENT = 14
R_LIMIT = 126  # |r|: 2^r stays a normal float32


class Float16DQOperands(NamedTuple):
  q: object  # [B, T, N, H] float16: Q 2^-a
  k: object  # [B, S, K, H] float16: K 2^-e
  score_scale: object  # [B, N, T] float32: scale log2(e) 2^(a+e)
  lse2: object  # [B, N, T] float32: the base-2 LSE minus r (+inf stays +inf)
  out_scale: object  # [B, N, T] float32: scale 2^(e-r)


def exponent_above(x):
  """The smallest integer E with |x| < 2^E, elementwise (0 where x is 0 or not finite)."""
  _, exponent = jnp.frexp(x)
  return jnp.where(jnp.isfinite(x) & (x != 0), exponent, 0)


def float16_dq_operands(q, k, v, do, lse2, delta, *, scale: float) -> Float16DQOperands:
  """q, do [B, T, N, H] and k, v [B, S, K, H] (bfloat16 or float16, zero past the lengths),
  lse2 (the base-2 LSE, +inf on rows that attend nothing) and delta [B, N, T] float32 ->
  the dQ kernel's operands."""
  f32 = jnp.float32
  group = q.shape[2] // k.shape[2]
  a = exponent_above(jnp.max(jnp.abs(q.astype(f32)), axis=-1)) - OPERAND_EXPONENT  # [B, T, N]
  e = exponent_above(jnp.max(jnp.abs(k.astype(f32)), axis=(1, 3))) - OPERAND_EXPONENT  # [B, K]
  q16 = jnp.ldexp(q.astype(f32), -a[..., None]).astype(jnp.float16)
  k16 = jnp.ldexp(k.astype(f32), -e[:, None, :, None]).astype(jnp.float16)
  e_heads = jnp.repeat(e, group, axis=1)[:, :, None]  # [B, N, 1]: each query head's KV head's
  v_norm = jnp.max(jnp.linalg.norm(v.astype(f32), axis=-1), axis=1)  # [B, K]
  do_norm = jnp.linalg.norm(do.astype(f32), axis=-1).transpose(0, 2, 1)  # [B, N, T]
  bound = do_norm * jnp.repeat(v_norm, group, axis=1)[:, :, None] + jnp.abs(delta)
  r = jnp.clip(DS_EXPONENT - exponent_above(bound), -R_LIMIT, R_LIMIT)  # [B, N, T]
  qk_scale = f32(scale * LOG2_E)  # as the kernels take it
  score_scale = jnp.ldexp(qk_scale, a.transpose(0, 2, 1) + e_heads)
  out_scale = jnp.ldexp(f32(scale), e_heads - r)
  return Float16DQOperands(q16, k16, score_scale, lse2 - r.astype(f32), out_scale)


def float16_dq_reference(operands: Float16DQOperands, v, do, delta, visible=None):
  """dQ [B, T, N, H] float32 from the operands, computed as the dQ kernel computes it (float32
  sums of float16 products, dS rounded to float16); `visible` [B, N | 1, T, S] bool or None.
  For the tests: the scaling's effect without a GPU."""
  f32 = jnp.float32
  group = operands.q.shape[2] // operands.k.shape[2]
  k16 = jnp.repeat(operands.k, group, axis=2).astype(f32)
  v_ = jnp.repeat(v, group, axis=2).astype(f32)
  s = jnp.einsum("btnh,bsnh->bnts", operands.q.astype(f32), k16)
  if visible is not None:
    s = jnp.where(visible, s, -jnp.inf)
  p = jnp.exp2(s * operands.score_scale[..., None] - operands.lse2[..., None])
  dp = jnp.einsum("btnh,bsnh->bnts", do.astype(f32), v_)
  ds = (p * (dp - delta[..., None])).astype(jnp.float16).astype(f32)
  dq = jnp.einsum("bnts,bsnh->btnh", ds, k16)
  return dq * operands.out_scale.transpose(0, 2, 1)[..., None]
