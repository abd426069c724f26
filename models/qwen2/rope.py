"""Rotary position embedding (RoPE), in the split-halves layout Qwen2 uses."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_frequencies(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """positions [B, T] int -> (cos, sin), each [B, T, head_dim // 2] in float32."""
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim  # [H/2]
  inv_freq = 1.0 / (theta ** exponents)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, heads, H] rotated by (cos, sin) [B, T, H/2]: the first half of the head dim
  pairs with the second half (HF's `rotate_half`), computed in float32.

  The halves are swapped by reversing a size-2 axis rather than by concatenating: XLA fuses
  a reverse into the elementwise kernels around it (the bias add before, the cache write
  after), where a concatenate becomes a kernel of its own in a decode step.
  """
  half = x.shape[-1] // 2
  halves = x.reshape(*x.shape[:-1], 2, half).astype(jnp.float32)  # [B, T, heads, 2, H/2]: x1, x2
  swapped = halves[..., ::-1, :] * jnp.array([-1.0, 1.0], jnp.float32)[:, None]  # -x2, x1
  cos, sin = cos[:, :, None, None, :], sin[:, :, None, None, :]  # [B, T, 1, 1, H/2]
  rotated = halves * cos + swapped * sin  # x1 cos - x2 sin, x2 cos + x1 sin
  return rotated.reshape(x.shape).astype(x.dtype)
