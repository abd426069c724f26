"""RMSNorm as Qwen2 defines it: normalise in float32, cast back, then scale."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash


class RMSNorm(nnx.Module):
  """x [..., features] -> x / rms(x) * scale, the statistics in float32."""

  def __init__(self, features: int, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None,
               dtype=jnp.float32, param_dtype=jnp.float32):
    del rngs  # no random initialisation: the scale starts at one
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((features,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    # HF casts the normalised activations back to the input dtype before the scale.
    normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype)
    return normed * self.scale[...].astype(self.dtype)


def add_and_norm(x: jax.Array, update, norm: RMSNorm, *, fused: bool) -> tuple[jax.Array, jax.Array]:
  """(h, norm(h)) with h = x + update, x [..., hidden]; update a models.qwen2.linear.PartialSums.
  `fused` (a decode step on one device): jaxflash.add_rms_norm adds the update's partial sums
  and the residual and normalises in one kernel, where XLA takes two after a reduction."""
  if fused:
    return jaxflash.add_rms_norm(x, update.terms, norm.scale[...], eps=norm.eps)
  h = x + update.total()
  return h, norm(h)
