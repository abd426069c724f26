"""Small helpers the kernels share: one definition each."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")  # the running max's start, and the LSE of a row that sees no key


def next_power_of_2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1): Triton blocks have power-of-two sides."""
  return 1 << (max(int(n), 1) - 1).bit_length()


def dot_precision(dtype) -> lax.Precision | None:
  """HIGHEST for float32 operands (else `tl.dot` rounds them to TF32), the default otherwise."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
