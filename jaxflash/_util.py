"""Small helpers the kernels share: one definition each."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")  # the running max's start, and the LSE of a row that sees no key


def next_power_of_2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1): Triton blocks have power-of-two sides."""
  return 1 << (max(int(n), 1) - 1).bit_length()


def dot_precision(dtype) -> lax.Precision | lax.DotAlgorithmPreset | None:
  """The precision of a Triton kernel's dots on `dtype` operands: None (the operands' own)
  for 16-bit floats; for float32, `jax.default_matmul_precision` when it is set ("highest" /
  "float32": IEEE float32 products; "high" / "tensorfloat32", and "default" / "bfloat16",
  which Triton's dot also runs as TF32: one TF32 pass, ~1e-3 relative), else HIGHEST.
  float32 stays float32 unless asked, unlike XLA's GPU matmuls, whose default is TF32.
  Read while a kernel traces, so a `with jax.default_matmul_precision(...)` around the call
  (part of jit's cache key) picks it."""
  if jnp.dtype(dtype) != jnp.float32:
    return None
  chosen = jax.config.jax_default_matmul_precision
  if chosen is None:
    return lax.Precision.HIGHEST
  try:
    return lax.Precision(chosen)
  except ValueError:  # a dot algorithm's name, e.g. "F32_F32_F32" or "TF32_TF32_F32_X3"
    return lax.DotAlgorithmPreset[chosen.upper()]
