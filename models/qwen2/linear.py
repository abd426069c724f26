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


def project(layer: nnx.Linear, x: jax.Array, *, skinny: bool, split: str,
            tensor_parallel=None) -> jax.Array:
  """layer(x). With `skinny` and at most 16 rows (a decode step of up to 16 sequences) the
  product runs through `jaxflash.skinny_matmul`, which reads the weights once where XLA's
  lowering of small products reads them three times (jaxflash/linear.py); the bias add
  and the kernel's partial sums fuse into one XLA kernel. On a model split over devices
  (`tensor_parallel`, a models.qwen2.parallel.TensorParallel) each device multiplies its
  own shard of the weight, which `split` ("column" or "row") names."""
  if not skinny or math.prod(x.shape[:-1]) > MAX_ROWS:
    return layer(x)
  dtype = layer.dtype or jnp.result_type(x.dtype, layer.kernel.dtype)
  x, w = x.astype(dtype), layer.kernel[...].astype(dtype)
  if tensor_parallel is None:
    out = jaxflash.skinny_matmul(x, w)
  else:
    out = tensor_parallel.skinny_matmul(x, w, split)
  if layer.bias is not None:
    out = out + layer.bias[...].astype(dtype)
  return out


@dataclasses.dataclass(frozen=True)
class Projector:
  """How the layers of one forward pass multiply by their weights: `project` with these
  settings (the default: plain `layer(x)`)."""

  skinny: bool = False
  tensor_parallel: Any = None  # a models.qwen2.parallel.TensorParallel, or None

  def __call__(self, layer: nnx.Linear, x: jax.Array, split: str) -> jax.Array:
    return project(layer, x, skinny=self.skinny, split=split, tensor_parallel=self.tensor_parallel)
