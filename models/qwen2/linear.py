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
# (K >= SKINNY_MIN_ASPECT * N: a long sum into few outputs) and, with `wide`, wide ones
# (N >= SKINNY_MIN_ASPECT * K); other large ones are XLA's. On the H200 at batch 1
# (bench/NOTES.md) XLA lowers the 1.5B model's q/k/v and o products (<= 3.1M elements) to a
# broadcast multiply and a reduction (2.4x slower than the kernel), its down projection
# (8960 x 1536) to a GEMM split 16 ways over K plus a reduction kernel (10.8 us in the step
# against the kernel's 8.7), and gate and up (1536 x 8960 each, merged by XLA) to a GEMM
# of 16.7 us, where the kernel with narrow column blocks (WIDE_CONFIG) takes 15.4.
SKINNY_MAX_WEIGHT = 1 << 23
SKINNY_MIN_ASPECT = 4
WIDE_CONFIG = jaxflash.LinearConfig(block_n=64, block_k=64)  # more column blocks than SMs: no K chunks
# jaxflash.project_split_kv (the decode merge in the output projection) paid at batch 1 on the
# H200 (1.5B step -0.02 ms) and lost at batch 8 (+0.1 ms, against the merge kernel and the
# skinny product): bench/NOTES.md.
SPLIT_KV_MAX_ROWS = 1


@dataclasses.dataclass(frozen=True)
class Projector:
  """How the layers of one forward pass multiply by their weights.

  With `skinny`, at most 16 rows (a decode step of up to 16 sequences) and a weight of at
  most SKINNY_MAX_WEIGHT elements (or a tall one, or with `wide` a wide one), a product runs
  through `jaxflash.skinny_matmul`, which reads the weight once where XLA's lowering of small
  products reads it three times (jaxflash/linear.py); the bias add and the kernel's partial
  sums fuse into one XLA kernel. On a model split over devices (`tensor_parallel`) each
  device multiplies its own shard of the weight. Otherwise, and by default, it is plain
  `layer(x)`.
  """

  skinny: bool = False
  tensor_parallel: Any = None  # a models.qwen2.parallel.TensorParallel, or None
  fused_qkv: bool = False  # with `skinny`: norm, q/k/v, bias, RoPE, cache write fused (`qkv`)
  wide: bool = False  # with `skinny`: wide weights (the MLP's gate and up) through the kernel too
  residual_norm: bool = False  # with `skinny`: `add_norm`'s residual add and RMSNorm in one kernel
  one_launch_qkv: bool = True  # with `fused_qkv`: qkv_projection's one-launch form where it applies

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
      outs = jaxflash.skinny_matmul(x, ws, config=_config(ws))
    else:
      outs = self.tensor_parallel.skinny_matmul(x, ws, split)
    return tuple(out if layer.bias is None else out + layer.bias[...].astype(dtype)
                 for layer, out in zip(layers, outs))

  def qkv(self, norm, layers: tuple[nnx.Linear, nnx.Linear, nnx.Linear], x: jax.Array, rope,
          head_dim: int, kv=None, new_lengths=None):
    """(q, k, v, kv): RoPE'd q and k and plain v of norm(x) from `jaxflash.qkv_projection`,
    one kernel (two with `one_launch_qkv` off, or a head dim that does not divide the
    product's column blocks) in place of the RMSNorm's two, the product's, three for bias
    and RoPE and the cache write's; None when this projector does not take that path (then:
    norm, `many`, RoPE, as usual).

    norm: the models.qwen2.norm.RMSNorm before the projections; rope: (cos, sin)
    [B, T, head_dim/2]. Taken with `fused_qkv` and `skinny`, on one device, for at most 16
    rows. With a decode step's LayerKV `kv` that writes with the kernel (models/qwen2/
    cache.py), k and v go straight into its cache at kv.lengths (rows with new_lengths 0
    write nothing): k and v come back None and kv updated; otherwise kv as given.
    """
    if not (self.fused_qkv and self.skinny and self.tensor_parallel is None
            and math.prod(x.shape[:-1]) <= MAX_ROWS and _one_dtype(layers)):
      return None
    dtype = _compute_dtype(layers, x)
    biases = (None if any(layer.bias is None for layer in layers)
              else tuple(layer.bias[...].astype(dtype) for layer in layers))
    args = (x.astype(dtype), norm.scale[...], tuple(layer.kernel[...].astype(dtype) for layer in layers),
            biases, *rope)
    options = dict(head_dim=head_dim, eps=norm.eps, one_launch=self.one_launch_qkv)
    if kv is None or not kv.write_kernel or x.shape[1] != 1:
      return (*jaxflash.qkv_projection(*args, **options), kv)
    # The cache's counters (zero, and left zero) spare the kernel a zeroed buffer per layer.
    q, keys, values, *counters = jaxflash.qkv_projection(
        *args, **options, kv_cache=(kv.keys, kv.values), positions=kv.token_positions(new_lengths),
        block_table=kv.block_table, counters=kv.counters)
    counters = counters[0] if counters else kv.counters  # none come back when none went in
    return q, None, None, dataclasses.replace(kv, keys=keys, values=values, counters=counters)

  def fuses_residual_norm(self, layer: nnx.Linear, residual: jax.Array, norm) -> bool:
    """Whether `add_norm(layer, ., residual, norm)` takes the fused kernels: `residual_norm`
    on one device, decode-sized rows, and one dtype for the residual, the norm and the product."""
    return (self.residual_norm and self.tensor_parallel is None and layer.bias is None
            and self._takes_skinny((layer,), residual) and residual.dtype == norm.dtype
            and _compute_dtype((layer,), residual) == residual.dtype)

  def takes_split_kv(self, layer: nnx.Linear, residual: jax.Array, norm) -> bool:
    """Whether `add_norm` should get a decode step's attention as its unmerged split-KV chunks:
    when it fuses, for at most SPLIT_KV_MAX_ROWS rows."""
    return (math.prod(residual.shape[:-1]) <= SPLIT_KV_MAX_ROWS
            and self.fuses_residual_norm(layer, residual, norm))

  def add_norm(self, layer: nnx.Linear, heads, residual: jax.Array, norm, split: str
               ) -> tuple[jax.Array, jax.Array]:
    """(h, norm(h)) with h = residual + layer(heads): the output projection, the residual add
    and the RMSNorm before the MLP.

    When `fuses_residual_norm`, the product's partial sums go straight to
    `jaxflash.add_rms_norm`, which adds them, adds the residual and normalises in one kernel:
    the product's K chunks from `jaxflash.skinny_matmul`, or, when `heads` is a decode step's
    `jaxflash.SplitKV` (attention's chunks, unmerged), the heads' products from
    `jaxflash.project_split_kv`, which merges the chunks as it multiplies. Two kernels in
    all, where apart they are four (merge, product, and XLA's two)."""
    if not self.fuses_residual_norm(layer, residual, norm):
      h = residual + self(layer, heads, split)
      return h, norm(h)
    weight = layer.kernel[...].astype(residual.dtype)
    if isinstance(heads, jaxflash.SplitKV):
      partials = jaxflash.project_split_kv(heads, weight, return_partials=True)
    else:
      partials = jaxflash.skinny_matmul(heads.astype(residual.dtype), weight, config=_config((weight,)),
                                        return_partials=True)
    return jaxflash.add_rms_norm(residual, partials, norm.scale[...], eps=norm.eps)

  def _takes_skinny(self, layers, x) -> bool:
    def fits(kernel) -> bool:
      rows, cols = kernel.shape
      return (math.prod(kernel.shape) <= SKINNY_MAX_WEIGHT or rows >= SKINNY_MIN_ASPECT * cols
              or (self.wide and cols >= SKINNY_MIN_ASPECT * rows))
    return (self.skinny and math.prod(x.shape[:-1]) <= MAX_ROWS
            and all(fits(layer.kernel) for layer in layers) and _one_dtype(layers))


def _config(weights) -> jaxflash.LinearConfig | None:
  """The skinny kernel's tiles for these weights [K, N_i]: WIDE_CONFIG when they are wide."""
  k_size, n_size = weights[0].shape[0], sum(w.shape[1] for w in weights)
  return WIDE_CONFIG if n_size >= SKINNY_MIN_ASPECT * k_size else None


def _one_dtype(layers) -> bool:
  """The layers compute in one dtype from weights of one dtype (one kernel launch serves all)."""
  return len({(layer.dtype, layer.kernel.dtype) for layer in layers}) == 1


def _compute_dtype(layers, x):
  """What nnx.Linear computes in: its `dtype`, else the promotion of x and the weights."""
  return layers[0].dtype or jnp.result_type(x.dtype, layers[0].kernel.dtype)
