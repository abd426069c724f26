"""The model's products: XLA's dots, or jaxflash.skinny_matmul in a step of few rows."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash
from jaxflash.fused import configs as fused_configs


def fits_skinny(shape: tuple[int, int]) -> bool:
  """Whether a weight [K, N] goes through the skinny kernel in a step of few rows: small
  (SKINNY_MAX_WEIGHT elements), tall (K >= SKINNY_MIN_ASPECT * N: a down projection) or wide
  (N >= SKINNY_MIN_ASPECT * K: gate and up). jaxflash/fused/configs.py says why."""
  rows, cols = shape
  aspect = fused_configs.SKINNY_MIN_ASPECT
  return (rows * cols <= fused_configs.SKINNY_MAX_WEIGHT or rows >= aspect * cols
          or cols >= aspect * rows)


def skinny_config(weights) -> jaxflash.LinearConfig | None:
  """The skinny kernel's tiles for weights [K, N_i] side by side: WIDE_CONFIG when wide."""
  k_size, n_size = weights[0].shape[0], sum(w.shape[1] for w in weights)
  return fused_configs.WIDE_CONFIG if n_size >= fused_configs.SKINNY_MIN_ASPECT * k_size else None


def compute_dtype(layer: nnx.Linear, x: jax.Array):
  """What nnx.Linear computes in: its `dtype`, else the promotion of x and the weight."""
  return layer.dtype or jnp.result_type(x.dtype, layer.kernel.dtype)


def project(layers: tuple[nnx.Linear, ...], x: jax.Array, plan, split: str) -> tuple[jax.Array, ...]:
  """(layer(x) for each layer): XLA's dots, or with `plan.skinny` and weights that fit, one
  jaxflash.skinny_matmul launch for all of them (x [..., K] of at most 16 rows), each weight
  read once where XLA's lowering of so few rows reads it three times; the biases are added
  after it (their add fuses with the kernel's partial sums). On a split model
  (`plan.tensor_parallel`) each device multiplies its shard; `split` ("column" or "row")
  says how the weights are split."""
  if not (plan.skinny and all(fits_skinny(layer.kernel.shape) for layer in layers)):
    return tuple(layer(x) for layer in layers)
  dtype = compute_dtype(layers[0], x)
  x, weights = x.astype(dtype), tuple(layer.kernel[...].astype(dtype) for layer in layers)
  if plan.tensor_parallel is None:
    outs = jaxflash.skinny_matmul(x, weights, config=skinny_config(weights))
  else:
    outs = plan.tensor_parallel.skinny_matmul(x, weights, split)
  return tuple(out if layer.bias is None else out + layer.bias[...].astype(dtype)
               for layer, out in zip(layers, outs))


@dataclasses.dataclass(frozen=True)
class PartialSums:
  """A product [..., N] left as terms to add: `terms` [S, ..., N], S >= 1, whose sum rounded
  to `dtype` is the product. A fused consumer (jaxflash.add_rms_norm) adds them as it reads
  them; S is 1 (the product itself) where no kernel split the sum."""

  terms: jax.Array
  dtype: Any

  @classmethod
  def of(cls, product: jax.Array) -> PartialSums:
    return cls(product[None], product.dtype)

  def total(self) -> jax.Array:
    if self.terms.shape[0] == 1:
      return self.terms[0].astype(self.dtype)
    return self.terms.sum(axis=0).astype(self.dtype)


def skinny_partials(layer: nnx.Linear, x: jax.Array) -> PartialSums:
  """layer(x) (no bias) as jaxflash.skinny_matmul's K-chunk partial sums (one device)."""
  dtype = compute_dtype(layer, x)
  weight = layer.kernel[...].astype(dtype)
  terms = jaxflash.skinny_matmul(x.astype(dtype), weight, config=skinny_config((weight,)),
                                 return_partials=True)
  return PartialSums(terms, dtype)
