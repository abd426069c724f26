"""Projections of a decode step through jaxflash's skinny matmul."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash
from jaxflash.linear import MAX_ROWS


def project(layer: nnx.Linear, x: jax.Array, *, skinny: bool) -> jax.Array:
  """layer(x). With `skinny` and at most 16 rows (a decode step of up to 16 sequences) the
  product runs through `jaxflash.skinny_matmul`, which reads the weights once where XLA's
  lowering of small products reads them three times (jaxflash/linear.py); the bias add
  and the kernel's partial sums fuse into one XLA kernel."""
  if not skinny or math.prod(x.shape[:-1]) > MAX_ROWS:
    return layer(x)
  dtype = layer.dtype or jnp.result_type(x.dtype, layer.kernel.dtype)
  out = jaxflash.skinny_matmul(x.astype(dtype), layer.kernel[...].astype(dtype))
  if layer.bias is not None:
    out = out + layer.bias[...].astype(dtype)
  return out
