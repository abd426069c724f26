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


# Weights of up to this many elements go through the skinny kernel, and so do tall ones
# (K >= SKINNY_MIN_ASPECT * N: a long sum into few outputs); other large ones are XLA's. On
# the H200 at batch 1 (bench/NOTES.md) XLA lowers the 1.5B model's q/k/v and o products
# (<= 3.1M elements) to a broadcast multiply and a reduction (2.4x slower than the kernel),
# its down projection (8960 x 1536) to a GEMM split 16 ways over K plus a reduction kernel
# (10.8 us in the step against the kernel's 8.7), and gate and up (1536 x 8960 each,
# merged by XLA) to a GEMM that reads 7-12% faster than the kernel.
SKINNY_MAX_WEIGHT = 1 << 23
SKINNY_MIN_ASPECT = 4


@dataclasses.dataclass(frozen=True)
class Residual:
  """The residual stream x + parts.sum(0), the sum not yet formed: `parts` [S, *x.shape] are
  a product's fp32 K-chunk partials (the attention's output projection, or the MLP's down
  projection), which the next fused kernel adds as it reads x instead of an XLA kernel of
  their own (jaxflash.gated_mlp's and jaxflash.qkv_projection's `addend`)."""

  x: jax.Array
  parts: jax.Array

  def value(self) -> jax.Array:
    return (self.x.astype(jnp.float32) + self.parts.sum(axis=0)).astype(self.x.dtype)


def materialize(x: jax.Array | Residual) -> jax.Array:
  """x itself, or a Residual's sum."""
  return x.value() if isinstance(x, Residual) else x


@dataclasses.dataclass(frozen=True)
class Projector:
  """How the layers of one forward pass multiply by their weights.

  With `skinny`, at most 16 rows (a decode step of up to 16 sequences) and a weight of at
  most SKINNY_MAX_WEIGHT elements (or a tall one), a product runs through `jaxflash.skinny_matmul`, which
  reads the weight once where XLA's lowering of small products reads it three times
  (jaxflash/linear.py); the bias add and the kernel's partial sums fuse into one XLA
  kernel. On a model split over devices (`tensor_parallel`) each device multiplies its
  own shard of the weight. Otherwise, and by default, it is plain `layer(x)`.
  """

  skinny: bool = False
  tensor_parallel: Any = None  # a models.qwen2.parallel.TensorParallel, or None
  fused_qkv: bool = False  # with `skinny`: norm, q/k/v, bias, RoPE, cache write in two kernels (`qkv`)
  fused_mlp: bool = False  # with `skinny`: norm and SwiGLU in two kernels, sums left as partials (`mlp`)

  def __call__(self, layer: nnx.Linear, x: jax.Array, split: str) -> jax.Array:
    """layer(x); `split` ("column" or "row") names how a split model shards the weight."""
    return self.many((layer,), x, split)[0]

  def many(self, layers: tuple[nnx.Linear, ...], x: jax.Array, split: str) -> tuple[jax.Array, ...]:
    """(layer(x) for each layer), in one skinny kernel launch when they take that path."""
    if not self._takes_skinny(layers, x):
      return tuple(layer(x) for layer in layers)
    dtype = _compute_dtype(layers, x)
    x, ws = x.astype(dtype), tuple(layer.kernel[...].astype(dtype) for layer in layers)
    if self.tensor_parallel is None:
      outs = jaxflash.skinny_matmul(x, ws)
    else:
      outs = self.tensor_parallel.skinny_matmul(x, ws, split)
    return tuple(out if layer.bias is None else out + layer.bias[...].astype(dtype)
                 for layer, out in zip(layers, outs))

  def qkv(self, norm, layers: tuple[nnx.Linear, nnx.Linear, nnx.Linear], x: jax.Array | Residual,
          rope, head_dim: int, kv=None, new_lengths=None):
    """(q, k, v, kv, x): RoPE'd q and k and plain v of norm(x) from `jaxflash.qkv_projection`,
    two kernels in place of the RMSNorm's two, the product's, three for bias and RoPE and
    the cache write's, and x in full (a Residual's sum, formed by the kernel); None when
    this projector does not take that path (then: norm, `many`, RoPE, as usual).

    norm: the models.qwen2.norm.RMSNorm before the projections; rope: (cos, sin)
    [B, T, head_dim/2]. Taken with `fused_qkv` and `skinny`, on one device, for at most 16
    rows. With a decode step's LayerKV `kv` that writes with the kernel (models/qwen2/
    cache.py), k and v go straight into its cache at kv.lengths (rows with new_lengths 0
    write nothing): k and v come back None and kv updated; otherwise kv as given.
    """
    base = x.x if isinstance(x, Residual) else x
    if not (self.fused_qkv and self._fuses(base) and _one_dtype(layers)):
      return None
    dtype = _compute_dtype(layers, base)
    biases = (None if any(layer.bias is None for layer in layers)
              else tuple(layer.bias[...].astype(dtype) for layer in layers))
    args = (base.astype(dtype), norm.scale[...], tuple(layer.kernel[...].astype(dtype) for layer in layers),
            biases, *rope)
    addend = x.parts if isinstance(x, Residual) else None
    if kv is None or not kv.write_kernel or base.shape[1] != 1:
      q, k, v, *x_sum = jaxflash.qkv_projection(*args, head_dim=head_dim, eps=norm.eps, addend=addend)
    else:
      q, keys, values, *x_sum = jaxflash.qkv_projection(
          *args, head_dim=head_dim, eps=norm.eps, kv_cache=(kv.keys, kv.values),
          positions=kv.token_positions(new_lengths), block_table=kv.block_table, addend=addend)
      k, v, kv = None, None, dataclasses.replace(kv, keys=keys, values=values)
    x_sum = x_sum[0].astype(base.dtype) if x_sum else base
    return q, k, v, kv, x_sum

  def residual_add(self, x: jax.Array, layer: nnx.Linear, inputs: jax.Array) -> jax.Array | Residual:
    """x + layer(inputs), the sum left to the fused MLP (a Residual of the product's
    partials) when this projector runs it (`fused_mlp`)."""
    if not (self.fused_mlp and self._fuses(x) and self._takes_skinny((layer,), inputs)
            and layer.bias is None):
      return x + self(layer, inputs, "row")
    dtype = _compute_dtype((layer,), inputs)
    parts = jaxflash.skinny_matmul(inputs.astype(dtype), layer.kernel[...].astype(dtype),
                                   return_partials=True)
    return Residual(x, parts)

  def mlp(self, norm, layers: tuple[nnx.Linear, nnx.Linear, nnx.Linear],
          x: jax.Array | Residual) -> Residual | None:
    """x + down(silu(gate(norm(x))) * up(norm(x))) from `jaxflash.gated_mlp`, two kernels in
    place of the norm's two, the products' and SiLU's, with x's pending sum added by the
    first and down's left as partials (a Residual); None when this projector does not take
    that path. layers: (gate, up, down), without biases."""
    base = x.x if isinstance(x, Residual) else x
    if not (self.fused_mlp and self._fuses(base) and _one_dtype(layers)
            and all(layer.bias is None for layer in layers)):
      return None
    dtype = _compute_dtype(layers, base)
    gate, up, down = (layer.kernel[...].astype(dtype) for layer in layers)
    h, parts = jaxflash.gated_mlp(base, norm.scale[...], gate, up, down, eps=norm.eps,
                                  addend=x.parts if isinstance(x, Residual) else None,
                                  return_partials=True)
    return Residual(h, parts)

  def _fuses(self, x: jax.Array) -> bool:
    """Fused kernels run for at most 16 rows, with `skinny`, on one device."""
    return self.skinny and self.tensor_parallel is None and math.prod(x.shape[:-1]) <= MAX_ROWS

  def _takes_skinny(self, layers, x) -> bool:
    return (self.skinny and math.prod(x.shape[:-1]) <= MAX_ROWS
            and all(math.prod(layer.kernel.shape) <= SKINNY_MAX_WEIGHT
                    or layer.kernel.shape[0] >= SKINNY_MIN_ASPECT * layer.kernel.shape[1]
                    for layer in layers)
            and _one_dtype(layers))


def _one_dtype(layers) -> bool:
  """The layers compute in one dtype from weights of one dtype (one kernel launch serves all)."""
  return len({(layer.dtype, layer.kernel.dtype) for layer in layers}) == 1


def _compute_dtype(layers, x):
  """What nnx.Linear computes in: its `dtype`, else the promotion of x and the weights."""
  return layers[0].dtype or jnp.result_type(x.dtype, layers[0].kernel.dtype)
