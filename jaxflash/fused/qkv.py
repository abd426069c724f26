"""A decode step's q, k and v in one kernel: RMSNorm folded into the product, then bias and RoPE.

The attention half of a decoder layer starts with small steps: RMSNorm of the residual
stream x, the q/k/v products, their biases, and rotary embeddings on q and k. At batch 1
the products read a few MB of weights, and XLA runs the rest as five elementwise and
reduction kernels of ~1.3 us each, about what the weights take to read (bench/PERFORMANCE.md).
Here it is one launch:

  1. The skinny matmul's programs (jaxflash/fused/linear.py), K cut into chunks so every SM reads
     a slab of the weights. RMSNorm is a per-row factor r = rsqrt(mean(x^2) + eps), so
     rms_norm(x) @ w = r * ((x * scale) @ w): each program multiplies its chunk of x * scale
     by its slab and stores an fp32 partial product.
  2. Each program then counts itself in for its column block (an atomic add); the last of a
     block's chunks to arrive adds up the chunks, applies r, adds the bias and rotates q and
     k (RoPE in the split-halves layout of Llama and Qwen: dim d of a head pairs with
     d + head_dim/2), and stores q, k and v in x's dtype, or k and v straight into a KV cache
     (the write `jaxflash.kv_cache_write` does). No program waits for another.

Step 2 needs the column blocks to hold whole heads (head_dim dividing block_n); otherwise
(head dims 80, 96) it is a second kernel, one small program per head, that the product's
programs hand their partials and sums of x^2 to. On the H200 at the 1.5B model's shapes,
batch 1: 6.9 us a layer in one launch, 4.7 + 3.3 in two, 10.4 for the six launches of the
separate steps (bench/PERFORMANCE.md).

A first version did it all in one kernel with one program per slice of a head (no K
chunks, so every program read whole weight columns): 64 programs streaming the 1.5B
model's weights took 16-18 us against 4.7 for the chunked product (bench/PERFORMANCE.md).

The product runs in w's dtype with fp32 accumulation; x * scale is rounded to w's dtype for
the tensor cores (Hugging Face rounds x * r instead: the difference is one rounding of a
bf16 value), and everything after the product is fp32, rounded once at the store.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _checks
from jaxflash import device as device_lib
from jaxflash._triton import (CompilerParams, atomic_add, block_barrier, load, load_masked, mask2d, pl, quiet,
                              store, use_interpret)
from jaxflash._util import dot_precision, next_power_of_2
from jaxflash.fused.cache_write import cache_rows, check_cache_target
from jaxflash.fused.configs import MAX_ROWS, LinearConfig
from jaxflash.fused.linear import column_block, k_chunks, skinny_matmul_partials

MAX_SPLITS = 8  # K chunks of the product: the finishing step adds them with unrolled loads
NORM_TILE = 256  # columns of x per load when the one-launch kernel recomputes the RMSNorm factor


def _norm_factor(sum_sq_ref, *, splits: int, rows: int, k_size: int, eps: float):
  """The RMSNorm factor rsqrt(mean(x^2) + eps) per row [16, 1] from the product's K chunks'
  sums of squares sum_sq_ref [splits, M]."""
  splits_p = max(2, next_power_of_2(splits))
  row_ok = jnp.arange(MAX_ROWS) < rows
  sum_sq = load(sum_sq_ref.at[pl.ds(0, splits_p), pl.ds(0, MAX_ROWS)],
                mask=(jnp.arange(splits_p) < splits)[:, None] & row_ok[None, :], other=0.0)
  return lax.rsqrt(jnp.sum(sum_sq, axis=0) / k_size + eps)[:, None]


def _norm_factor_of_x(x_ref, *, rows: int, k_size: int, eps: float):
  """The RMSNorm factor per row [16, 1] from x_ref [M, K] itself (static tiles, all in flight)."""
  row_ok = jnp.arange(MAX_ROWS) < rows
  sum_sq = jnp.zeros((MAX_ROWS,), jnp.float32)
  for k0 in range(0, k_size, NORM_TILE):
    cols_ok = None if k0 + NORM_TILE <= k_size else jnp.arange(NORM_TILE) < k_size - k0
    x = load_masked(x_ref.at[pl.ds(0, MAX_ROWS), pl.ds(k0, NORM_TILE)], mask2d(row_ok, cols_ok))
    x = x.astype(jnp.float32)
    sum_sq = sum_sq + jnp.sum(x * x, axis=1)
  return lax.rsqrt(sum_sq / k_size + eps)[:, None]


def _finish_head(r, cos_ref, sin_ref, part_ref, b_ref, head, *, splits: int, rows: int, head_dim: int,
                 rope: bool):
  """Head `head` of one product: the sum of the chunks, times the RMSNorm factor r [16, 1],
  plus the bias, rotated -> its two halves (a1, a2), each [16, half_p] f32 (rows past M and
  dims past head_dim/2 are padding).

  cos_ref/sin_ref [M, head_dim/2] f32; part_ref [splits, M, heads*H] f32; b_ref [heads*H]
  or None.
  """
  half = head_dim // 2
  half_p = _padded_half(head_dim)
  row_ok = jnp.arange(MAX_ROWS) < rows
  dim_ok = None if half_p == half else jnp.arange(half_p) < half
  mask = mask2d(row_ok, dim_ok)
  first, second = head * head_dim, head * head_dim + half  # columns of the head's two halves
  a1 = a2 = jnp.zeros((MAX_ROWS, half_p), jnp.float32)
  for s in range(splits):  # static: independent loads, all in flight at once
    chunk = jnp.int32(s)  # (interpret mode's masked loads take array indices only)
    a1 = a1 + load_masked(part_ref.at[chunk, pl.ds(0, MAX_ROWS), pl.ds(first, half_p)], mask)
    a2 = a2 + load_masked(part_ref.at[chunk, pl.ds(0, MAX_ROWS), pl.ds(second, half_p)], mask)
  a1, a2 = a1 * r, a2 * r
  if b_ref is not None:
    a1 = a1 + load_masked(b_ref.at[pl.ds(first, half_p)], dim_ok).astype(jnp.float32)[None, :]
    a2 = a2 + load_masked(b_ref.at[pl.ds(second, half_p)], dim_ok).astype(jnp.float32)[None, :]
  if rope:  # x1 cos - x2 sin, x2 cos + x1 sin
    cos = load_masked(cos_ref.at[pl.ds(0, MAX_ROWS), pl.ds(0, half_p)], mask)
    sin = load_masked(sin_ref.at[pl.ds(0, MAX_ROWS), pl.ds(0, half_p)], mask)
    a1, a2 = a1 * cos - a2 * sin, a2 * cos + a1 * sin
  return a1, a2


def _padded_half(head_dim: int) -> int:
  return max(16, next_power_of_2(head_dim // 2))


def _store_head(o_ref, head, halves, *, rows: int, head_dim: int):
  """Stores a head's two halves into o_ref [M, heads*H]."""
  half, half_p = head_dim // 2, _padded_half(head_dim)
  mask = mask2d(jnp.arange(MAX_ROWS) < rows, None if half_p == half else jnp.arange(half_p) < half)
  for offset, value in zip((0, half), halves):
    store(o_ref.at[pl.ds(0, MAX_ROWS), pl.ds(head * head_dim + offset, half_p)], value.astype(o_ref.dtype),
          mask=mask)


def _store_head_in_cache(cache_ref, row, ok, head, halves, *, head_dim: int):
  """Stores a head's two halves as key (or value) head `head` of cache rows `row` [16]
  (cache_ref: the cache as rows [R, K, H]), where `ok` [16]."""
  half, half_p = head_dim // 2, _padded_half(head_dim)
  dims = jnp.arange(half_p)
  mask = mask2d(ok, None if half_p == half else dims < half)
  # Lanes that store nothing aim one past the last row: compiled, a masked lane touches no
  # memory; interpreted, a masked store writes the old value back to every lane's address,
  # which must then not be a row that another lane writes.
  row = jnp.where(ok, row, cache_ref.shape[0])
  for offset, value in zip((0, half), halves):
    store(cache_ref.at[row[:, None], head, offset + dims[None, :]], value.astype(cache_ref.dtype), mask=mask)


def _cache_target(positions_ref, table_ref, *, rows: int, capacity: int, page_size: int):
  """(row [16], ok [16]): the cache row each sequence's new k and v go to, and whether they
  are written (sequences past M never are)."""
  sequences = jnp.arange(MAX_ROWS)
  row, ok = cache_rows(positions_ref, table_ref, jnp.minimum(sequences, rows - 1), capacity=capacity,
                       page_size=page_size)
  return row, ok & (sequences < rows)


def _bias_and_cache_refs(refs, *, has_bias: bool, cache: str | None, rows: int, capacity: int,
                         page_size: int):
  """Takes from the iterator `refs` the biases (if has_bias), then with a `cache` the positions,
  the block table (if paged) and the caches' inputs -> (the three bias refs or Nones, the
  cache target (row, ok) of `_cache_target` or None)."""
  b_refs = [next(refs) for _ in range(3)] if has_bias else [None] * 3
  if cache is None:
    return b_refs, None
  positions_ref = next(refs)
  table_ref = next(refs) if cache == "paged" else None
  next(refs), next(refs)  # the caches' inputs: their outputs are the same buffers
  return b_refs, _cache_target(positions_ref, table_ref, rows=rows, capacity=capacity, page_size=page_size)


def _head_finisher(cos_ref, sin_ref, part_refs, b_refs, out_refs, target, *, splits: int, rows: int,
                   head_dim: int):
  """finish(which, head, r): head `head` of product `which` (0: q, 1: k, 2: v) finished with
  the RMSNorm factor r and stored: into out_refs[which] [M, heads*H], or for k and v, when
  `target` = (row, ok) is given, into the cache rows out_refs[which] [R, K, H]."""
  def finish(which, head, r):
    halves = _finish_head(r, cos_ref, sin_ref, part_refs[which], b_refs[which], head, splits=splits,
                          rows=rows, head_dim=head_dim, rope=which < 2)
    if which == 0 or target is None:
      _store_head(out_refs[which], head, halves, rows=rows, head_dim=head_dim)
    else:
      _store_head_in_cache(out_refs[which], *target, head, halves, head_dim=head_dim)
  return finish


def _finish_kernel(*refs, heads: tuple[int, int, int], has_bias: bool, cache: str | None,
                   capacity: int, page_size: int, splits: int, rows: int, k_size: int, head_dim: int,
                   eps: float):
  """Program p: head p of q, then of k, then of v.

  refs: sum_sq, cos, sin, the three partial products, (bq, bk, bv if has_bias), then with a
  `cache` ("contiguous" or "paged"): positions, (block_table if paged), keys and values
  (rows [R, K, H], aliased to the outputs and not read); then the outputs: q, k, v, or q,
  keys, values.
  """
  refs = iter(refs)
  sum_sq_ref, cos_ref, sin_ref = next(refs), next(refs), next(refs)
  part_refs = [next(refs) for _ in range(3)]
  b_refs, target = _bias_and_cache_refs(refs, has_bias=has_bias, cache=cache, rows=rows, capacity=capacity,
                                        page_size=page_size)
  # Program ids, the cache rows and the norm factor are computed here, outside the branches:
  # interpret mode resolves program ids only at the kernel's top level.
  p = pl.program_id(0)
  r = _norm_factor(sum_sq_ref, splits=splits, rows=rows, k_size=k_size, eps=eps)
  finish = _head_finisher(cos_ref, sin_ref, part_refs, b_refs, list(refs), target, splits=splits,
                          rows=rows, head_dim=head_dim)
  first_head = 0
  for which, count in enumerate(heads):
    mine = (p >= first_head) & (p < first_head + count)
    pl.when(mine)(functools.partial(finish, which, p - first_head, r))
    first_head += count


def _one_launch_kernel(*refs, widths: tuple[int, int, int], heads: tuple[int, int, int], block_n: int,
                       has_bias: bool, cache: str | None, capacity: int, page_size: int, splits: int,
                       rows: int, k_size: int, head_dim: int, eps: float, interpret: bool, product: dict):
  """Program (j, s): the product's column block j over K chunk s, as the skinny kernel's;
  then the last of block j's chunk programs to finish finishes the heads of block j
  (block_n is a multiple of head_dim, so a block holds whole heads).

  No program waits for another: each stores its partial product, then counts itself in
  (an atomic add, acquire-release at GPU scope, after a barrier so that all of the
  program's stores come before it); the one that counts last sees every chunk's partials,
  and sets the count back to zero when it is done.

  refs: x, norm scale, wq, wk, wv, cos, sin, (bq, bk, bv if has_bias), (positions,
  (block_table if paged), keys, values with a `cache`), the counters [>= blocks], zero
  (aliased, not read); then the outputs: the three partial products [splits, M, N_i], the
  counters (zero again), and q, k, v (or q, keys, values).
  """
  refs = iter(refs)
  x_ref, scale_ref = next(refs), next(refs)
  w_refs = [next(refs) for _ in range(3)]
  cos_ref, sin_ref = next(refs), next(refs)
  b_refs, target = _bias_and_cache_refs(refs, has_bias=has_bias, cache=cache, rows=rows, capacity=capacity,
                                        page_size=page_size)
  next(refs)  # the counters' input: its output is the same buffer
  part_refs = [next(refs) for _ in range(3)]
  counter_ref = next(refs)
  finish = _head_finisher(cos_ref, sin_ref, part_refs, b_refs, list(refs), target, splits=splits,
                          rows=rows, head_dim=head_dim)
  j, s = pl.program_id(0), pl.program_id(1)
  heads_per_block = block_n // head_dim
  owners, first_block = [], 0
  for w_ref, part_ref, n_size in zip(w_refs, part_refs, widths):
    blocks = pl.cdiv(n_size, block_n)
    mine = (j >= first_block) & (j < first_block + blocks)
    pl.when(mine)(functools.partial(column_block, x_ref, w_ref, part_ref, j - first_block, s, n_size=n_size,
                                    block_n=block_n, scale_ref=scale_ref, **product))
    owners.append((mine, j - first_block))
    first_block += blocks
  if not interpret:  # interpreted, programs run one after another
    block_barrier()
  arrived = atomic_add(counter_ref, j, jnp.int32(1))  # how many of block j's chunks were in before this one

  def finish_block():
    r = _norm_factor_of_x(x_ref, rows=rows, k_size=k_size, eps=eps)
    for which, (mine, local) in enumerate(owners):
      for t in range(heads_per_block):
        head = local * heads_per_block + t
        pl.when(mine & (head < heads[which]))(functools.partial(finish, which, head, r))
    counter_ref[j] = jnp.int32(0)  # every chunk of block j is in: the count is free again

  pl.when(arrived == splits - 1)(finish_block)


def _check_inputs(x, norm_scale, weights, biases, cos, sin, head_dim: int):
  for name, a in (("x", x), ("norm_scale", norm_scale), ("cos", cos), ("sin", sin)):
    _checks.check_float(name, a)
  if not isinstance(weights, (tuple, list)) or len(weights) != 3:
    raise TypeError(f"weights must be a tuple (wq, wk, wv), got {type(weights).__name__}")
  if biases is not None and (not isinstance(biases, (tuple, list)) or len(biases) != 3):
    raise TypeError(f"biases must be a tuple (bq, bk, bv) or None, got {type(biases).__name__}")
  if head_dim < 2 or head_dim % 2:
    raise ValueError(f"head_dim must be even (RoPE pairs its two halves), got head_dim={head_dim}")
  if x.ndim < 1 or x.shape[-1] == 0:
    raise ValueError(f"x must be [..., K] with K >= 1, got x {tuple(x.shape)}")
  k_size, rows = x.shape[-1], math.prod(x.shape[:-1])
  if rows > MAX_ROWS:
    raise ValueError(f"qkv_projection takes at most {MAX_ROWS} rows of x, got x {tuple(x.shape)}")
  if tuple(norm_scale.shape) != (k_size,):
    raise ValueError(f"norm_scale must be [K] = ({k_size},), got norm_scale {tuple(norm_scale.shape)}")
  for name, a in (("cos", cos), ("sin", sin)):
    if tuple(a.shape) != (*x.shape[:-1], head_dim // 2):
      raise ValueError(f"{name} must be [..., head_dim/2] = {(*x.shape[:-1], head_dim // 2)} for x "
                       f"{tuple(x.shape)}, got {name} {tuple(a.shape)}")
  for name, w in zip(("wq", "wk", "wv"), weights):
    _checks.check_float(name, w)
    if w.ndim != 2 or w.shape[0] != k_size or w.shape[1] % head_dim or not w.shape[1]:
      raise ValueError(f"{name} must be [K, heads * head_dim] = [{k_size}, n * {head_dim}] with "
                       f"n >= 1, got {name} {tuple(w.shape)}")
    if w.dtype != weights[0].dtype:
      raise TypeError(f"wq, wk and wv must share a dtype, got {[jnp.dtype(w.dtype).name for w in weights]}")
  for name, b, w in zip(("bq", "bk", "bv"), biases or (), weights):
    _checks.check_float(name, b)
    if tuple(b.shape) != (w.shape[1],):
      raise ValueError(f"{name} must be [{w.shape[1]}] to match its weight, got {name} {tuple(b.shape)}")


@functools.partial(jax.jit, static_argnames=("head_dim", "eps", "config", "one_launch", "interpret"))
def qkv_projection(x: jax.Array, norm_scale: jax.Array, weights: Sequence[jax.Array],
                   biases: Sequence[jax.Array] | None, cos: jax.Array, sin: jax.Array, *, head_dim: int,
                   eps: float = 1e-6, kv_cache: tuple[jax.Array, jax.Array] | None = None,
                   positions: jax.Array | None = None, block_table: jax.Array | None = None,
                   config: LinearConfig | None = None, one_launch: bool = True,
                   counters: jax.Array | None = None, interpret: bool | None = None
                   ) -> tuple[jax.Array, ...]:
  """q, k, v of a decode step: rope(rms_norm(x) @ wq + bq), rope(rms_norm(x) @ wk + bk),
  rms_norm(x) @ wv + bv, in one kernel launch (two when head_dim does not divide the
  config's block_n, or with `one_launch=False`).

  x [..., K] with at most 16 rows in all (one token per sequence); norm_scale [K] (the
  RMSNorm weight: rms_norm(x) = x / sqrt(mean(x^2) + eps) * norm_scale); weights = (wq, wk,
  wv), each [K, heads * head_dim]; biases = (bq, bk, bv) matching their columns, or None;
  cos, sin [..., head_dim/2] (float) for each row's position, RoPE in the split-halves
  layout (dim d pairs with d + head_dim/2). Returns (q, k, v), each [..., heads * head_dim]
  in x's dtype.

  With kv_cache = (keys, values), k and v go straight into the cache instead: row b of x
  (x [B, K] or [B, 1, K]) is sequence b's new token, stored at token position positions[b]
  as `jaxflash.kv_cache_write` stores it (contiguous caches [B, S, K, H], or page pools
  [P, page, K, H] through block_table [B, max_pages]; a negative or out-of-range position
  writes nothing). Returns (q, keys, values) then; with the caches donated under jit the
  write is in place.

  In one launch, the last of each column block's K-chunk programs to finish (an atomic
  count) finishes that block's heads. The counts need a zeroed int32 buffer, which the
  kernel leaves zeroed: `counters` [n >= column blocks] int32, all zero, lets a caller that
  runs one step after another (a decode loop, donating it under jit) pass the same buffer
  every time and skip zeroing a fresh one per call, which costs the graph a memset node; it
  then comes back (zero) as a last output. None: a fresh one each call.

  config: the product's tiles (default `LinearConfig()`; at most 8 K chunks); interpret:
  Pallas interpret mode (default: when no GPU).
  """
  _check_inputs(x, norm_scale, weights, biases, cos, sin, head_dim)
  config = config or LinearConfig()
  if not isinstance(config, LinearConfig):
    raise TypeError(f"config must be a jaxflash.LinearConfig, got {type(config).__name__}")
  interpret = use_interpret(interpret)
  lead, k_size = x.shape[:-1], x.shape[-1]
  rows = math.prod(lead)
  widths = tuple(int(w.shape[1]) for w in weights)
  heads = tuple(n // head_dim for n in widths)
  cache = None
  if kv_cache is not None:
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
      raise TypeError(f"kv_cache must be a tuple (keys, values) or None, got {type(kv_cache).__name__}")
    if len(lead) > 2 or (len(lead) == 2 and lead[1] != 1):
      raise ValueError(f"with kv_cache, x holds one token per sequence: [B, K] or [B, 1, K], got x "
                       f"{tuple(x.shape)}")
    positions, block_table = check_cache_target(*kv_cache, (heads[1], head_dim), rows, positions, block_table)
    if kv_cache[0].shape[2] != heads[2]:
      raise ValueError(f"wv has {heads[2]} heads but the caches hold {kv_cache[0].shape[2]} "
                       f"(values {tuple(kv_cache[1].shape)})")
    cache = "contiguous" if block_table is None else "paged"
  if counters is not None:
    if counters.dtype != jnp.int32:
      raise TypeError(f"counters must be int32, got counters {counters.dtype}")
    if counters.ndim != 1:
      raise ValueError(f"counters must be [n] int32, got counters {tuple(counters.shape)}")
  extra = () if counters is None else (counters,)
  if rows == 0:
    if cache is not None:
      return jnp.zeros((*lead, widths[0]), x.dtype), *kv_cache, *extra
    return *(jnp.zeros((*lead, n), x.dtype) for n in widths), *extra
  n_blocks = sum(pl.cdiv(n, config.block_n) for n in widths)
  sm_count = device_lib.device_info().sm_count
  _, splits = k_chunks(config, n_blocks * config.block_n, k_size, sm_count)
  config = dataclasses.replace(config, num_splits=min(splits, MAX_SPLITS))
  x2d = x.reshape(rows, k_size)
  rope_tables = [cos.reshape(rows, -1).astype(jnp.float32), sin.reshape(rows, -1).astype(jnp.float32)]
  one_launch = one_launch and config.block_n % head_dim == 0
  if one_launch:
    if counters is not None and counters.shape[0] < n_blocks:
      raise ValueError(f"counters must have at least one slot per column block ({n_blocks}), got counters "
                       f"{tuple(counters.shape)}")
    counts = jnp.zeros((n_blocks,), jnp.int32) if counters is None else counters
    chunk_tiles, splits = k_chunks(config, n_blocks * config.block_n, k_size, sm_count)
    operands = [x2d, norm_scale, *weights, *rope_tables, *(biases or ())]
    out_shapes = [jax.ShapeDtypeStruct((splits, rows, n), jnp.float32) for n in widths]
    out_shapes.append(jax.ShapeDtypeStruct(counts.shape, jnp.int32))
  else:
    parts, sum_sq = skinny_matmul_partials(x2d, tuple(weights), norm_scale, config=config, interpret=interpret)
    splits = sum_sq.shape[0]
    operands = [sum_sq, *rope_tables, *parts, *(biases or ())]
    out_shapes = []
  first_out = len(out_shapes)  # q, k, v (or q, keys, values) come after the partials and counters
  out_shapes += [jax.ShapeDtypeStruct((rows, n), x.dtype) for n in widths]
  aliases, capacity, page_size = {}, 0, 0
  if cache is not None:
    keys, values = kv_cache
    capacity = keys.shape[0] if cache == "paged" else keys.shape[1]
    page_size = keys.shape[1]
    operands += [positions, *(() if block_table is None else (block_table,))]
    aliases = {len(operands): first_out + 1, len(operands) + 1: first_out + 2}
    operands += [keys.reshape(-1, *keys.shape[2:]), values.reshape(-1, *values.shape[2:])]  # bitcasts
    out_shapes[first_out + 1:] = [jax.ShapeDtypeStruct(operands[-2].shape, keys.dtype),
                                  jax.ShapeDtypeStruct(operands[-1].shape, values.dtype)]
  common = dict(heads=heads, has_bias=biases is not None, cache=cache, capacity=capacity, page_size=page_size,
                splits=splits, rows=rows, k_size=k_size, head_dim=head_dim, eps=float(eps))
  if one_launch:
    aliases[len(operands)] = len(widths)  # the counters, updated in place
    operands.append(counts)
    product = dict(rows=rows, k_size=k_size, block_k=config.block_k, chunk_tiles=chunk_tiles, partial=True,
                   precision=dot_precision(weights[0].dtype))
    kernel = functools.partial(_one_launch_kernel, widths=widths, block_n=config.block_n, interpret=interpret,
                               product=product, **common)
    grid, params, name = (n_blocks, splits), (config.num_warps, config.num_stages), "jaxflash_qkv_projection"
  else:
    kernel = functools.partial(_finish_kernel, **common)
    grid, params, name = (sum(heads),), (4, 1), "jaxflash_qkv_finish"
  with quiet():
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shapes,
        input_output_aliases=aliases,
        compiler_params=CompilerParams(num_warps=params[0], num_stages=params[1]),
        interpret=interpret,
        name=name,
    )(*operands)
  q, k, v = outs[first_out:]
  q = q.reshape(*lead, widths[0])
  if counters is not None and one_launch:
    extra = (outs[len(widths)],)
  if cache is not None:
    return q, k.reshape(kv_cache[0].shape), v.reshape(kv_cache[1].shape), *extra
  return q, k.reshape(*lead, widths[1]), v.reshape(*lead, widths[2]), *extra


def qkv_projection_reference(x, norm_scale, weights, biases, cos, sin, *, head_dim: int, eps: float = 1e-6):
  """Plain JAX, fp32 throughout (HIGHEST-precision products), in x's dtype: for checking."""
  x32 = x.astype(jnp.float32)
  normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * norm_scale.astype(jnp.float32)
  outs = []
  for which, w in enumerate(weights):
    y = jnp.matmul(normed, w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    if biases is not None:
      y = y + biases[which].astype(jnp.float32)
    if which < 2:
      heads = y.reshape(*y.shape[:-1], -1, 2, head_dim // 2)  # [..., n, 2, H/2]
      c, s = cos.astype(jnp.float32)[..., None, :], sin.astype(jnp.float32)[..., None, :]
      x1, x2 = heads[..., 0, :], heads[..., 1, :]
      y = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-2).reshape(y.shape)
    outs.append(y.astype(x.dtype))
  return tuple(outs)
