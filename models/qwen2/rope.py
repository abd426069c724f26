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
  pairs with the second half (HF's `rotate_half`), computed in float32."""
  half = x.shape[-1] // 2
  x1 = x[..., :half].astype(jnp.float32)  # [B, T, heads, H/2]
  x2 = x[..., half:].astype(jnp.float32)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, H/2]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
