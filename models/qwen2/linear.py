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


# Weights of up to this many elements go through the skinny kernel; larger ones are XLA's.
# On the H200 at batch 1 (bench/NOTES.md) XLA lowers the 1.5B model's q/k/v and o products
# (<= 3.1M elements) to a broadcast multiply and a reduction (2.4x slower than the kernel)
# and its MLP products (13.8M each) to a GEMM that reads 7-12% faster than the kernel.
SKINNY_MAX_WEIGHT = 1 << 23


@dataclasses.dataclass(frozen=True)
class Projector:
  """How the layers of one forward pass multiply by their weights.

  With `skinny`, at most 16 rows (a decode step of up to 16 sequences) and a weight of at
  most SKINNY_MAX_WEIGHT elements, a product runs through `jaxflash.skinny_matmul`, which
  reads the weight once where XLA's lowering of small products reads it three times
  (jaxflash/linear.py); the bias add and the kernel's partial sums fuse into one XLA
  kernel. On a model split over devices (`tensor_parallel`) each device multiplies its
  own shard of the weight. Otherwise, and by default, it is plain `layer(x)`.
  """

  skinny: bool = False
  tensor_parallel: Any = None  # a models.qwen2.parallel.TensorParallel, or None

  def __call__(self, layer: nnx.Linear, x: jax.Array, split: str) -> jax.Array:
    """layer(x); `split` ("column" or "row") names how a split model shards the weight."""
    return self.many((layer,), x, split)[0]

  def many(self, layers: tuple[nnx.Linear, ...], x: jax.Array, split: str) -> tuple[jax.Array, ...]:
    """(layer(x) for each layer), in one skinny kernel launch when they take that path."""
    if not self._takes_skinny(layers, x):
      return tuple(layer(x) for layer in layers)
    dtype = layers[0].dtype or jnp.result_type(x.dtype, layers[0].kernel.dtype)
    x, ws = x.astype(dtype), tuple(layer.kernel[...].astype(dtype) for layer in layers)
    if self.tensor_parallel is None:
      outs = jaxflash.skinny_matmul(x, ws)
    else:
      outs = self.tensor_parallel.skinny_matmul(x, ws, split)
    return tuple(out if layer.bias is None else out + layer.bias[...].astype(dtype)
                 for layer, out in zip(layers, outs))

  def _takes_skinny(self, layers, x) -> bool:
    return (self.skinny and math.prod(x.shape[:-1]) <= MAX_ROWS
            and all(math.prod(layer.kernel.shape) <= SKINNY_MAX_WEIGHT for layer in layers)
            and len({(layer.dtype, layer.kernel.dtype) for layer in layers}) == 1)
