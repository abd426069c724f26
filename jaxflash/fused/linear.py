"""Skinny matmul for decode steps: x [M, K] @ w [K, N] with at most 16 rows, w read once.

A decode step multiplies one token per sequence by every weight matrix, so M is the batch
and the product is bound by reading w, as decode attention is bound by reading the cache.
XLA (0.10-0.11) rewrites the smaller of these products (M * N * K under ~10M: a 1.5B
model's q, k, v and o projections at batch 1) into a broadcast multiply that writes a
[K, N] temporary, then a separate reduction: w's bytes cross HBM three times. Here one
program per (column block, K chunk) streams its [K chunk, block_n] slab of w through
the tensor cores (x's rows padded to the 16 that `tl.dot` needs) with fp32 accumulation.
When N is narrow, K is cut into chunks so that every SM has a slab to read; the chunks'
fp32 partial sums are added by an XLA reduction that fuses into whatever consumes the
product (a bias add, a residual add), so it costs no launch of its own there. Several
weights that multiply the same x (q, k and v) share one launch: their column blocks are
laid side by side in the grid, and each program reads the weight its block belongs to.
Given an RMSNorm's scale, the kernel multiplies x * scale instead and also sums x^2 over its
K chunk, so that a following kernel can finish the norm (`skinny_matmul_partials`, used by
jaxflash/fused/qkv.py).

On the H200 at the 1.5B model's shapes, batch 1, in the model's step (bench/PERFORMANCE.md): gate and
up side by side (1536 x 17920) with 64-column blocks, no K chunks, 15.4 us against XLA's GEMM's
16.7; the tall down projection (8960 x 1536), which XLA splits 16 ways over K and finishes with a
reduction kernel (10.9 us), 8.7. A tile sweep found nothing faster for either (more pipeline
stages were slower). `return_partials=True` hands the K chunks' fp32 sums to a consumer kernel
that adds them as it reads them (`jaxflash.add_rms_norm`).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import device as device_lib
from jaxflash._triton import CompilerParams, dot, load_masked, mask2d, pl, quiet, store, use_interpret
from jaxflash._util import dot_precision
from jaxflash.fused.configs import MAX_ROWS, LinearConfig


def column_block(x_ref, w_ref, o_ref, j, s, *, rows: int, k_size: int, n_size: int, block_n: int,
                 block_k: int, chunk_tiles: int, partial: bool, precision, scale_ref=None,
                 sum_sq_ref=None):
  """Column block j of one weight over K chunk s: x_ref [M, K]; w_ref [K, N]; o_ref [M, N]
  (one chunk) or [splits, M, N] fp32 partials.

  With `scale_ref` [K] (an RMSNorm's weight) the product is (x * scale) @ w and the
  chunk's sum of x^2 per row goes to `sum_sq_ref` [splits, M] (when given), the two
  halves of an RMSNorm that the caller finishes (jaxflash/fused/qkv.py).
  """
  row_ok = jnp.arange(MAX_ROWS) < rows
  cols = j * block_n + jnp.arange(block_n)
  col_ok = None if n_size % block_n == 0 else cols < n_size  # static: no mask when N divides
  first = s * chunk_tiles * block_k
  end = jnp.minimum(first + chunk_tiles * block_k, k_size)
  num_full = lax.div(end - first, block_k)
  num_tiles = lax.div(end - first + block_k - 1, block_k)

  def in_k(k0):
    return (k0 + jnp.arange(block_k)) < k_size

  def fetch(k0, k_ok):
    """The tile of x at k0 (and of the scale): rows past M, and columns where not k_ok (None:
    all in range), read as zeros."""
    x = load_masked(x_ref.at[pl.ds(0, MAX_ROWS), pl.ds(k0, block_k)], mask2d(row_ok, k_ok))
    return x, None if scale_ref is None else load_masked(scale_ref.at[pl.ds(k0, block_k)], k_ok)

  # x as given feeds the dot as it is loaded, and Triton's pipeline prefetches that load.
  # Normalised, it passes through fp32 arithmetic first, and the pipeline leaves such a
  # load to wait its latency in every step: so its tiles are loaded one step ahead here,
  # carried through the loop (the q/k/v product: 5.0 -> 4.7 us a layer, bench/PERFORMANCE.md).
  ahead = scale_ref is not None

  def body(i, carry, *, masked: bool):
    acc, sum_sq, fetched = carry
    k0 = first + i * block_k
    k_ok = in_k(k0) if masked else None
    if ahead:  # the next tile may lie past K, even in the unmasked loop: masked by K always
      (x, scale), fetched = fetched, fetch(k0 + block_k, in_k(k0 + block_k))
    else:
      x, scale = fetch(k0, k_ok)
    if scale_ref is not None:
      x = x.astype(jnp.float32)
      if sum_sq_ref is not None:  # programs that store no sums of squares do not add them up
        sum_sq = sum_sq + jnp.sum(x * x, axis=1)
      x = x * scale.astype(jnp.float32)[None, :]
    w_mask = mask2d(k_ok, col_ok)
    w = load_masked(w_ref.at[pl.ds(k0, block_k), pl.ds(j * block_n, block_n)], w_mask)
    return acc + dot(x.astype(w.dtype), w, precision=precision), sum_sq, fetched  # acc [16, block_n] f32

  # Whole tiles unmasked; only the last tile of K, if ragged, pays for masks.
  carry = (jnp.zeros((MAX_ROWS, block_n), jnp.float32), jnp.zeros((MAX_ROWS,), jnp.float32),
           fetch(first, in_k(first)) if ahead else None)
  carry = lax.fori_loop(0, num_full, functools.partial(body, masked=False), carry)
  acc, sum_sq, _ = lax.fori_loop(num_full, num_tiles, functools.partial(body, masked=True), carry)
  out_mask = mask2d(row_ok, col_ok)
  columns = pl.ds(j * block_n, block_n)
  if partial:
    store(o_ref.at[s, pl.ds(0, MAX_ROWS), columns], acc, mask=out_mask)
  else:
    store(o_ref.at[pl.ds(0, MAX_ROWS), columns], acc.astype(o_ref.dtype), mask=out_mask)
  if sum_sq_ref is not None:
    pl.when(j == 0)(lambda: store(sum_sq_ref.at[s, pl.ds(0, MAX_ROWS)], sum_sq, mask=row_ok))


def _skinny_kernel(x_ref, *refs, widths: tuple[int, ...], block_n: int, normed: bool, **block):
  """Program (j, s): output column block j of the weights laid side by side (the first
  weight's blocks, then the second's...), over K tiles s*chunk_tiles.. .

  x_ref [M, K]; refs = (the RMSNorm scale [K] if `normed`), the weights [K, N_i], their
  outputs, (and the sums of squares [splits, M] if `normed`).
  """
  scale_ref, refs = (refs[0], refs[1:]) if normed else (None, refs)
  w_refs, o_refs = refs[:len(widths)], refs[len(widths):2 * len(widths)]
  sum_sq_ref = refs[-1] if normed else None
  # Program ids are read here, outside the branches: interpret mode resolves them only at
  # the kernel's top level.
  j, s = pl.program_id(0), pl.program_id(1)
  if len(widths) == 1:
    column_block(x_ref, w_refs[0], o_refs[0], j, s, n_size=widths[0], block_n=block_n,
                 scale_ref=scale_ref, sum_sq_ref=sum_sq_ref, **block)
    return
  first_block = 0
  for index, (w_ref, o_ref, n_size) in enumerate(zip(w_refs, o_refs, widths)):
    blocks = pl.cdiv(n_size, block_n)
    is_mine = (j >= first_block) & (j < first_block + blocks)
    # The first weight's programs write the sums of squares (each chunk's, once).
    pl.when(is_mine)(functools.partial(column_block, x_ref, w_ref, o_ref, j - first_block, s,
                                       n_size=n_size, block_n=block_n, scale_ref=scale_ref,
                                       sum_sq_ref=sum_sq_ref if index == 0 else None, **block))
    first_block += blocks


def k_chunks(config: LinearConfig, n_size: int, k_size: int, num_sms: int) -> tuple[int, int]:
  """(K tiles per chunk, chunks): with None splits, as many chunks as keep every SM busy
  (column blocks x chunks <= SMs) and no more than there are K tiles. n_size: the output
  columns in all (several weights side by side: the sum of their column blocks' widths)."""
  n_blocks = pl.cdiv(n_size, config.block_n)
  k_tiles = pl.cdiv(k_size, config.block_k)
  wanted = config.num_splits if config.num_splits is not None else num_sms // n_blocks
  chunk_tiles = pl.cdiv(k_tiles, max(1, min(wanted, k_tiles)))
  return chunk_tiles, pl.cdiv(k_tiles, chunk_tiles)


def _check_inputs(x, weights: tuple):
  shapes = ", ".join(f"w {tuple(w.shape)}" for w in weights)
  if x.ndim < 1 or any(w.ndim != 2 or x.shape[-1] != w.shape[0] for w in weights):
    raise ValueError(f"skinny_matmul takes x [..., K] and w [K, N] (or a tuple of such w), got "
                     f"x {tuple(x.shape)} and {shapes}")
  for name, a in (("x", x), *(("w", w) for w in weights)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"skinny_matmul needs floating-point {name}, got {name} {a.dtype}")
  if len({jnp.dtype(w.dtype) for w in weights}) > 1:
    raise TypeError(f"skinny_matmul's weights must share a dtype, got {[str(w.dtype) for w in weights]}")
  rows = math.prod(x.shape[:-1])
  if rows > MAX_ROWS:
    raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows of x, got x {tuple(x.shape)} "
                     f"({rows} rows): use jnp.dot for larger batches")


@functools.partial(jax.jit, static_argnames=("config", "return_partials", "interpret"))
def skinny_matmul(x: jax.Array, w: jax.Array | Sequence[jax.Array], *, config: LinearConfig | None = None,
                  return_partials: bool = False, interpret: bool | None = None
                  ) -> jax.Array | tuple[jax.Array, ...]:
  """x [..., K] with at most 16 rows in all (the leading dims' product) @ w [K, N] -> [..., N].

  `w` may also be a tuple of weights [K, N_i] that share x (a layer's q, k and v
  projections): one kernel launch computes every product and a tuple of [..., N_i] comes
  back. The product is computed in w's dtype on the tensor cores with fp32 accumulation
  (fp32 inputs multiply at full precision) and returned in the promoted dtype of x and w.
  config: tiles and K chunks (default `LinearConfig()`); interpret: Pallas interpret
  mode (default: when no GPU). With `return_partials` each product comes back unsummed:
  float32 [S, ..., N], the S K chunks' partial sums (S >= 1), for a consumer that adds
  them as it reads them (`jaxflash.add_rms_norm`) instead of a reduction kernel.
  """
  weights = tuple(w) if isinstance(w, (tuple, list)) else (w,)
  if not weights:
    raise ValueError("skinny_matmul needs at least one weight")
  _check_inputs(x, weights)
  config = config or LinearConfig()
  if not isinstance(config, LinearConfig):
    raise TypeError(f"config must be a jaxflash.LinearConfig, got {type(config).__name__}")
  rows, k_size = math.prod(x.shape[:-1]), x.shape[-1]
  widths = tuple(int(w_i.shape[1]) for w_i in weights)
  out_dtype = jnp.result_type(x.dtype, weights[0].dtype)
  lead = (1, *x.shape[:-1]) if return_partials else x.shape[:-1]
  outs = [jnp.zeros((*lead, n), jnp.float32 if return_partials else out_dtype)
          for n in widths]  # empty products stay zeros
  live = [i for i, n in enumerate(widths) if n and rows and k_size]
  if live:
    live_weights, live_widths = tuple(weights[i] for i in live), tuple(widths[i] for i in live)
    if return_partials:
      computed, _ = _pallas_call(x.reshape(rows, k_size), live_weights, live_widths, config, out_dtype,
                                 use_interpret(interpret), force_partial=True)
    else:
      computed = _launch(x.reshape(rows, k_size), live_weights, live_widths, config, out_dtype,
                         use_interpret(interpret))
    for i, out in zip(live, computed):
      outs[i] = out.reshape(*out.shape[:-2], *x.shape[:-1], widths[i])
  return tuple(outs) if isinstance(w, (tuple, list)) else outs[0]


def _launch(x, weights: tuple, widths: tuple, config: LinearConfig, out_dtype, interpret: bool):
  """The pallas_call over x [M, K] and weights [K, N_i] -> outputs [M, N_i]."""
  outs, _ = _pallas_call(x, weights, widths, config, out_dtype, interpret)
  if outs[0].ndim == 3:  # K chunks: their sum fuses into the consumer's elementwise kernel
    outs = tuple(out.sum(axis=0).astype(out_dtype) for out in outs)
  return outs


def _pallas_call(x, weights: tuple, widths: tuple, config: LinearConfig, out_dtype, interpret: bool,
                 norm_scale=None, force_partial: bool = False):
  """(outputs [M, N_i], or fp32 partials [splits, M, N_i] when K is chunked or
  `force_partial`; sums of x^2 per chunk [splits, M] when `norm_scale`, else None)."""
  rows, k_size = x.shape
  n_blocks = sum(pl.cdiv(n, config.block_n) for n in widths)
  chunk_tiles, splits = k_chunks(config, n_blocks * config.block_n, k_size,
                                 device_lib.device_info().sm_count)
  partial = splits > 1 or force_partial
  out_shapes = [jax.ShapeDtypeStruct((splits, rows, n) if partial else (rows, n),
                                     jnp.float32 if partial else out_dtype) for n in widths]
  if norm_scale is not None:
    out_shapes.append(jax.ShapeDtypeStruct((splits, rows), jnp.float32))
  kernel = functools.partial(
      _skinny_kernel, widths=widths, rows=rows, k_size=k_size, block_n=config.block_n,
      block_k=config.block_k, chunk_tiles=chunk_tiles, partial=partial, normed=norm_scale is not None,
      precision=dot_precision(weights[0].dtype))
  inputs = (x, *weights) if norm_scale is None else (x, norm_scale, *weights)
  with quiet():
    outs = pl.pallas_call(
        kernel,
        grid=(n_blocks, splits),
        out_shape=out_shapes,
        compiler_params=CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="jaxflash_skinny_matmul",
    )(*inputs)
  if norm_scale is None:
    return tuple(outs), None
  return tuple(outs[:-1]), outs[-1]


def skinny_matmul_partials(x, weights: tuple, norm_scale, *, config: LinearConfig, interpret: bool):
  """The kernel's raw output for x [M, K] (M <= 16) times (x * norm_scale) @ w_i: fp32
  partial products [splits, M, N_i] of the K chunks, and the chunks' sums of x^2 [splits, M]
  (for the caller to finish an RMSNorm: rms_norm(x) @ w = rsqrt(sum / K + eps) * sum of
  the partials). Unchecked: for jaxflash's fused kernels (jaxflash/fused/qkv.py)."""
  return _pallas_call(x, tuple(weights), tuple(int(w.shape[1]) for w in weights), config,
                      jnp.float32, interpret, norm_scale=norm_scale, force_partial=True)


def skinny_matmul_reference(x, w):
  """x @ w (or a tuple of x @ w_i) in plain JAX with fp32 accumulation, for checking."""
  if isinstance(w, (tuple, list)):
    return tuple(skinny_matmul_reference(x, w_i) for w_i in w)
  out_dtype = jnp.result_type(x.dtype, w.dtype)
  return jnp.matmul(x, w, preferred_element_type=jnp.float32,
                    precision=lax.Precision.HIGHEST).astype(out_dtype)
