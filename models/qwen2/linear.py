"""Projections of a decode step through jaxflash's skinny matmul."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash
from jaxflash.linear import MAX_ROWS


@dataclasses.dataclass(frozen=True)
class Projector:
  """How the layers of one forward pass multiply by their weights.

  With `skinny` and at most 16 rows (a decode step of up to 16 sequences) a product runs
  through `jaxflash.skinny_matmul`, which reads the weights once where XLA's lowering of
  small products reads them three times (jaxflash/linear.py); the bias add and the
  kernel's partial sums fuse into one XLA kernel. On a model split over devices
  (`tensor_parallel`) each device multiplies its own shard of the weight. Otherwise, and
  by default, it is plain `layer(x)`.
  """

  skinny: bool = False
  tensor_parallel: Any = None  # a models.qwen2.parallel.TensorParallel, or None

  def __call__(self, layer: nnx.Linear, x: jax.Array, split: str) -> jax.Array:
    """layer(x); `split` ("column" or "row") names how a split model shards the weight."""
    if not self.skinny or math.prod(x.shape[:-1]) > MAX_ROWS:
      return layer(x)
    dtype = layer.dtype or jnp.result_type(x.dtype, layer.kernel.dtype)
    x, w = x.astype(dtype), layer.kernel[...].astype(dtype)
    if self.tensor_parallel is None:
      out = jaxflash.skinny_matmul(x, w)
    else:
      out = self.tensor_parallel.skinny_matmul(x, w, split)
    if layer.bias is not None:
      out = out + layer.bias[...].astype(dtype)
    return out
