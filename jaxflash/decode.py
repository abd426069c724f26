"""Split-KV decode attention (Flash-Decoding) over a contiguous KV cache.

One query token per sequence reads the whole cache once, so decode is bound by memory
bandwidth, not FLOPs (the article, Step 3: ~6 FLOPs per byte at any length). One program
per (sequence, KV head) would leave most SMs idle at small batch, so the cache is cut into
chunks along the sequence (Flash-Decoding, Dao et al. 2023): one program per
(sequence, KV head, chunk) runs FlashAttention's online softmax over its chunk and writes a
normalised partial output and its log-sum-exp in fp32; a small combine kernel merges the
chunks by their share of the softmax mass, exp(LSE_i - LSE).

The kernel body here is shared with the paged kernel (jaxflash/paged.py): both differ only in
how a tile of tokens is addressed.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _checks, configs
from jaxflash._triton import (LN_2, LOG2_E, CompilerParams, dot, load, load_masked, mask2d, pl, quiet, store,
                              use_interpret)
from jaxflash.configs import DecodeConfig
from jaxflash.reference import attention_reference

NEG_INF = float("-inf")


class SplitKV(NamedTuple):
  """Split-KV decode's chunk results before the merge (`return_partials=True`).

  out [B, S, N, H] float32: each chunk's softmax-normalised output; lse2 [B, S, N] float32:
  each chunk's log-sum-exp in base 2 (-inf for a chunk holding no tokens). Chunk i holds
  the share 2^(lse2_i - LSE2) of the softmax mass, LSE2 = log2(sum_i 2^lse2_i), so the
  attention output is the sum of the chunks' outputs weighted by those shares
  (`decode_combine_reference`; `jaxflash.project_split_kv` merges and projects in one kernel).
  """

  out: jax.Array
  lse2: jax.Array


# --------------------------------------------------------------------------------------
# Kernel pieces shared with the paged kernel.
# --------------------------------------------------------------------------------------

def _attend_tile(carry, q, k, v, *, qk_scale: float, key_ok, precision):
  """One step of the online softmax (FlashAttention-2, Alg. 1) in base 2.

  q [R, Hp] (R query heads of one KV group, padded), k/v [block_k, Hp]; the running max
  m and sum l are in log2 units because `qk_scale` folds in log2(e), so every exponential
  is the GPU's native exp2 (the article, Step 2). `key_ok` [block_k] masks the keys past
  the sequence's end; it is None for the full tiles of the hot loop.
  """
  acc, m_i, l_i = carry  # [R, Hp] f32, [R] f32, [R] f32
  # Scale the fp32 scores, not the bf16 query: scaling q in bf16 costs accuracy (the article).
  s = dot(q, k, trans_b=True, precision=precision) * qk_scale  # [R, block_k]
  if key_ok is not None:
    s = jnp.where(key_ok[None, :], s, NEG_INF)
  # Every tile holds at least one valid key, so m_new is finite and no exp2(-inf + inf) arises.
  m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.exp2(s - m_new[:, None])
  l_i = l_i * alpha + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, precision=precision)
  return acc, m_new, l_i


def _split_kv_kernel(
    lengths_ref,  # [B] int32
    table_ref,  # [B, max_pages] int32 (paged kernel), None (contiguous)
    q_ref,  # [B, N, H]
    k_ref,  # [B, S, K, H] cache, or [num_pages * page_size, K, H] pool rows
    v_ref,  # same as k_ref
    o_ref,  # [B, num_splits, N, H] f32 partials, or [B, N, H] final (one split)
    lse_ref,  # [B, num_splits, N] f32 log2 partials, or [B, N] f32 natural-log final
    *,
    tile_index,  # (table_ref, b, h, tok0, key_ok) -> index of one K/V tile [block_k, Hp]
    group: int,
    query_rows: int,
    row_blocks: int,
    head_dim: int,
    block_k: int,
    chunk: int,
    capacity: int,
    qk_scale: float,
    final: bool,
    precision,
):
  """One program: sequence b, KV head h (row block r of its query heads), chunk c of `chunk`
  tokens."""
  b, c = pl.program_id(0), pl.program_id(2)
  if row_blocks == 1:  # static: a group of up to DECODE_MAX_QUERY_ROWS heads, one program
    h, head0 = pl.program_id(1), pl.program_id(1) * group
    rows = jnp.arange(query_rows)
  else:  # larger groups: heads r*R.. of group h, grid axis 1 = h * row_blocks + r
    h, r = lax.div(pl.program_id(1), row_blocks), lax.rem(pl.program_id(1), row_blocks)
    head0 = h * group + r * query_rows
    rows = r * query_rows + jnp.arange(query_rows)  # the rows' places in the group
  head_dim_p = configs.padded_head_dim(head_dim)
  cols = jnp.arange(head_dim_p)
  col_ok = None if head_dim_p == head_dim else cols < head_dim  # static: no mask when H is 2^k

  # Lengths past the capacity are clamped (and negative ones read as 0): the kernel never
  # reads past the cache whatever it is given.
  length = jnp.clip(lengths_ref[b], 0, capacity)
  start = c * chunk
  num_tokens = jnp.clip(length - start, 0, chunk)  # 0 for chunks past the sequence's end
  num_full = lax.div(num_tokens, block_k)  # non-negative: C division, no floor fix-ups
  num_tiles = lax.div(num_tokens + block_k - 1, block_k)  # num_full, +1 for a ragged tail

  # The query heads of KV group h (GQA by index: heads h*G .. h*G+G-1) as one tile of
  # R >= 16 rows, since tl.dot needs 16 rows; the padded rows load zeros and are never stored.
  q_mask = mask2d(rows < group, col_ok)
  q = load(q_ref.at[b, pl.ds(head0, query_rows), pl.ds(0, head_dim_p)], mask=q_mask, other=0.0)
  q = q.astype(k_ref.dtype)

  def body(i, carry, *, masked: bool):
    tok0 = start + i * block_k
    key_ok = (tok0 + jnp.arange(block_k)) < length if masked else None
    index = tile_index(table_ref, b, h, tok0, key_ok)
    kv_mask = mask2d(key_ok, col_ok)
    k = load_masked(k_ref.at[index], kv_mask)  # [block_k, Hp]
    v = load_masked(v_ref.at[index], kv_mask)
    return _attend_tile(carry, q, k, v, qk_scale=qk_scale, key_ok=key_ok, precision=precision)

  carry = (jnp.zeros((query_rows, head_dim_p), jnp.float32),
           jnp.full((query_rows,), NEG_INF, jnp.float32),
           jnp.zeros((query_rows,), jnp.float32))
  # The hot loop runs over whole tiles with no masks at all; only the sequence's last,
  # partial tile pays for them (the article's split of the causal loop, applied to the
  # length). A chunk past the end runs zero trips of both loops and loads nothing.
  carry = lax.fori_loop(0, num_full, functools.partial(body, masked=False), carry)
  acc, m_i, l_i = lax.fori_loop(num_full, num_tiles, functools.partial(body, masked=True), carry)

  # Normalise once, after the loop (FlashAttention-2 Sec. 3.1). Empty chunks (l = 0) give
  # zeros and LSE -inf: the combine gives them weight exp2(-inf) = 0.
  nonempty = l_i > 0.0
  out = acc / jnp.where(nonempty, l_i, 1.0)[:, None]
  lse2 = jnp.where(nonempty, m_i + jnp.log2(jnp.where(nonempty, l_i, 1.0)), NEG_INF)
  out_mask = mask2d(rows < group, col_ok)
  head_rows = pl.ds(head0, query_rows)
  if final:
    store(o_ref.at[b, head_rows, pl.ds(0, head_dim_p)], out.astype(o_ref.dtype), mask=out_mask)
    store(lse_ref.at[b, head_rows], lse2 * LN_2, mask=rows < group)
  else:
    store(o_ref.at[b, c, head_rows, pl.ds(0, head_dim_p)], out, mask=out_mask)
    store(lse_ref.at[b, c, head_rows], lse2, mask=rows < group)


def _contiguous_tile(block_k: int, head_dim_p: int):
  """Tile addresser of the contiguous cache [B, S, K, H]: tokens tok0.. of sequence b, in
  place (the rows of a tile are K * H elements apart; the head dim is contiguous)."""
  def tile_index(table_ref, b, h, tok0, key_ok):
    del table_ref, key_ok
    return (b, pl.ds(tok0, block_k), h, pl.ds(0, head_dim_p))
  return tile_index


def chunk_shares(lse2):
  """lse2 [S_p] the chunks' log2-sum-exps (-inf: an empty or padding chunk) -> (top, share
  [S_p], total): chunk i holds share_i / total of the softmax mass, and the merged
  log2-sum-exp is top + log2(total). Every chunk empty (length 0): shares and total 0, never
  NaN. Shared by the combine kernel and jaxflash/split_kv_projection.py."""
  top = jnp.max(lse2)
  top = jnp.where(top == NEG_INF, 0.0, top)
  share = jnp.exp2(lse2 - top)
  return top, share, jnp.sum(share)


def merge_chunks(share, total, chunks):
  """chunks [S_p, W] the chunks' normalised outputs -> [W], weighted by `chunk_shares`'
  shares (zeros when total is 0)."""
  return jnp.sum(share[:, None] * chunks, axis=0) / jnp.where(total > 0.0, total, 1.0)


COMBINE_BLOCK_H = 32  # head dims per combine program: more, smaller programs finish sooner


def _combine_kernel(
    o_part_ref,  # [B, num_splits, N, H] f32, each chunk's normalised output
    lse_part_ref,  # [B, num_splits, N] f32, each chunk's log2-sum-exp (-inf: empty chunk)
    o_ref,  # [B, N, H] query dtype
    lse_ref,  # [B, N] f32 natural log
    *,
    num_splits: int,
    head_dim: int,
    block_h: int,
):
  """Merges the chunks of one (sequence, query head) over dims j*block_h..: the article's
  `decode_combine`.

  Chunk i holds the share exp(LSE_i - LSE) of the softmax mass, so the exact output is the
  sum of the chunks' normalised outputs weighted by those shares.
  """
  b, n, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  splits_p = max(2, 1 << (num_splits - 1).bit_length())
  split_ok = jnp.arange(splits_p) < num_splits
  col_ok = (j * block_h + jnp.arange(block_h)) < head_dim
  dims = pl.ds(j * block_h, block_h)
  lse = load(lse_part_ref.at[b, pl.ds(0, splits_p), n], mask=split_ok, other=NEG_INF)
  m, w, total = chunk_shares(lse)  # w [splits_p]
  o = load(o_part_ref.at[b, pl.ds(0, splits_p), n, dims], mask=split_ok[:, None] & col_ok[None, :],
           other=0.0)
  out = merge_chunks(w, total, o)
  store(o_ref.at[b, n, dims], out.astype(o_ref.dtype), mask=col_ok)

  @pl.when(j == 0)
  def _():
    lse_ref[b, n] = jnp.where(total > 0.0, (m + jnp.log2(jnp.where(total > 0.0, total, 1.0))) * LN_2,
                              NEG_INF)


# --------------------------------------------------------------------------------------
# Launch helpers shared with the paged kernel.
# --------------------------------------------------------------------------------------

def resolve_config(config: DecodeConfig | None, head_dim: int, dtype, *, paged: bool) -> DecodeConfig:
  """The tuned config, or `config` checked: power-of-two block_k >= 16 that fits in smem."""
  if config is None:
    return configs.decode_config(head_dim, dtype, paged=paged)
  if not isinstance(config, DecodeConfig):
    raise TypeError(f"config must be a jaxflash.DecodeConfig, got {type(config).__name__}")
  if config.block_k < 16 or config.block_k & (config.block_k - 1):
    raise ValueError(f"DecodeConfig.block_k must be a power of two >= 16 (tl.dot's minimum), "
                     f"got {config.block_k=}")
  if config.num_warps < 1 or config.num_stages < 1:
    raise ValueError(f"DecodeConfig needs num_warps >= 1 and num_stages >= 1, got {config}")
  configs.check_fits(config, head_dim, dtype)
  return config


def chunking(num_splits: int | None, batch: int, kv_heads: int, capacity: int,
             block_k: int) -> tuple[int, int]:
  """(chunk tokens, chunks): chunks are whole tiles, so only a sequence's last tile is ragged.

  Asking for more splits than the capacity has tiles gives one tile per chunk.
  """
  if num_splits is None:
    num_splits = configs.num_splits(batch, kv_heads, capacity)
  if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
    raise ValueError(f"num_splits must be a positive int (or None), got {num_splits!r}")
  chunk = pl.cdiv(pl.cdiv(max(capacity, 1), num_splits), block_k) * block_k
  return chunk, pl.cdiv(max(capacity, 1), chunk)


def launch_split_kv(lengths, table, query3, k_rows, v_rows, *, tile_index, out_dtype, kv_heads: int,
                    capacity: int, scale: float, num_splits: int | None, config: DecodeConfig,
                    interpret: bool, name: str, merge: bool = True):
  """Runs the split-KV kernel and, with more than one chunk, the combine.

  query3 [B, N, H]; k_rows/v_rows the caches as the kernel indexes them.
  Returns out [B, N, H] (out_dtype) and lse [B, N] float32 (natural log); without `merge`,
  the chunks' SplitKV instead (even for one chunk).
  """
  batch, num_heads, head_dim = query3.shape
  if capacity == 0:  # an empty cache: nothing to attend to
    if not merge:
      return SplitKV(jnp.zeros((batch, 1, num_heads, head_dim), jnp.float32),
                     jnp.full((batch, 1, num_heads), NEG_INF, jnp.float32))
    return (jnp.zeros((batch, num_heads, head_dim), out_dtype),
            jnp.full((batch, num_heads), NEG_INF, jnp.float32))
  group = num_heads // kv_heads
  query_rows = configs.decode_query_rows(group, config, head_dim, k_rows.dtype)
  row_blocks = pl.cdiv(group, query_rows)  # 1 unless the group has more than query_rows heads
  # Programs per sequence: one per (KV head, row block), before the chunks multiply them.
  chunk, splits = chunking(num_splits, batch, kv_heads * row_blocks, capacity, config.block_k)
  final = splits == 1 and merge
  if final:  # one chunk: the kernel writes the answer itself and no combine runs
    out_shape = [jax.ShapeDtypeStruct((batch, num_heads, head_dim), out_dtype),
                 jax.ShapeDtypeStruct((batch, num_heads), jnp.float32)]
  else:
    out_shape = [jax.ShapeDtypeStruct((batch, splits, num_heads, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, splits, num_heads), jnp.float32)]
  fp32 = jnp.dtype(k_rows.dtype) == jnp.float32
  kernel = functools.partial(
      _split_kv_kernel, tile_index=tile_index, group=group, query_rows=query_rows,
      row_blocks=row_blocks, head_dim=head_dim,
      block_k=config.block_k, chunk=chunk, capacity=capacity, qk_scale=scale * LOG2_E,
      final=final, precision=lax.Precision.HIGHEST if fp32 else None)
  if table is None:
    kernel = _without_table(kernel)
  inputs = (lengths, query3, k_rows, v_rows) if table is None else (lengths, table, query3, k_rows, v_rows)
  with quiet():
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads * row_blocks, splits),
        out_shape=out_shape,
        compiler_params=CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)
  if final:
    return out, lse
  if not merge:
    return SplitKV(out, lse)
  return _combine(out, lse, out_dtype=out_dtype, interpret=interpret)


def public_outputs(out, *, return_residual: bool):
  """launch_split_kv's (out [B, N, H], lse [B, N]) -> out [B, 1, N, H], with lse [B, 1, N] when
  `return_residual`; its SplitKV (`return_partials`) as it is."""
  if isinstance(out, SplitKV):
    return out
  out, lse = out
  return (out[:, None], lse[:, None]) if return_residual else out[:, None]


def _without_table(kernel):
  def contiguous_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    kernel(lengths_ref, None, q_ref, k_ref, v_ref, o_ref, lse_ref)
  return contiguous_kernel


def _combine(o_part, lse_part, *, out_dtype, interpret: bool):
  """o_part [B, splits, N, H] f32, lse_part [B, splits, N] (log2) -> out [B, N, H], lse [B, N].

  A Pallas kernel rather than plain JAX: a max, then a weighted sum over the chunks would
  otherwise be two or three XLA reductions, each a launch of its own; this is one launch
  that reads the few kilobytes of partials once. Its time is latency: one program per
  (sequence, head, 32 dims) with one warp each ends ~0.5 us sooner on the H200 than one
  per (sequence, head) with two warps (bench/NOTES.md).
  """
  batch, splits, num_heads, head_dim = o_part.shape
  block_h = min(COMBINE_BLOCK_H, configs.padded_head_dim(head_dim))
  with quiet():
    return pl.pallas_call(
        functools.partial(_combine_kernel, num_splits=splits, head_dim=head_dim, block_h=block_h),
        grid=(batch, num_heads, pl.cdiv(head_dim, block_h)),
        out_shape=[jax.ShapeDtypeStruct((batch, num_heads, head_dim), out_dtype),
                   jax.ShapeDtypeStruct((batch, num_heads), jnp.float32)],
        compiler_params=CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="jaxflash_decode_combine",
    )(o_part, lse_part)


def check_decode_query(query, batch: int, key_name: str) -> None:
  """query must be [B, 1, N, H] with B equal to the caches' (or block table's) batch."""
  if query.shape[1] != 1:
    raise ValueError(f"decode takes one query token per sequence: query must be [B, 1, N, H], "
                     f"got query {tuple(query.shape)} (use jaxflash.prefill_attention for T > 1)")
  if query.shape[0] != batch:
    raise ValueError(f"query and {key_name} must have the same batch size, got query "
                     f"{tuple(query.shape)} and batch {batch} from {key_name}")


# --------------------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------------------

def check_return_flags(return_residual: bool, return_partials: bool) -> None:
  if return_residual and return_partials:
    raise ValueError("return_residual and return_partials exclude each other: the chunks' "
                     "SplitKV carries their log-sum-exps")


@functools.partial(
    jax.jit, static_argnames=("scale", "num_splits", "return_residual", "return_partials", "config",
                              "interpret"))
def decode_attention(query, k_cache, v_cache, key_value_seq_lengths=None, *, scale=None,
                     num_splits=None, return_residual=False, return_partials=False,
                     config: DecodeConfig | None = None, interpret: bool | None = None):
  """Attention of one new token per sequence over a KV cache, split-KV (Flash-Decoding).

  query [B, 1, N, H]; k_cache, v_cache [B, S, K, H] (S = capacity) read in place;
  key_value_seq_lengths [B] int32 valid tokens per sequence (None: all S; values are
  traced, so changing them never recompiles; they are clamped to [0, S]). N must be a
  multiple of K (query head n reads KV head n // (N // K)). The query is cast to the
  caches' dtype for the matmuls, which accumulate in fp32.

  num_splits: chunks per sequence (default `jaxflash.num_splits(B, K, S)`); config: tiles
  (default `jaxflash.decode_config(H, dtype)`); interpret: Pallas interpret mode (default:
  when no GPU). Returns out [B, 1, N, H] in the query's dtype, and with
  `return_residual=True` also lse [B, 1, N] float32 (natural log; -inf for length 0,
  whose output is zeros). With `return_partials=True` the chunks are not merged: their
  SplitKV comes back instead, for `jaxflash.project_split_kv`.
  """
  check_return_flags(return_residual, return_partials)
  _checks.check_qkv(query, k_cache, v_cache, key_name="k_cache", value_name="v_cache")
  batch, capacity, kv_heads, head_dim = k_cache.shape
  check_decode_query(query, batch, "k_cache")
  lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  if lengths is None:
    lengths = jnp.full((batch,), capacity, jnp.int32)
  scale = _checks.default_scale(scale, head_dim)
  config = resolve_config(config, head_dim, k_cache.dtype, paged=False)
  num_heads = query.shape[2]

  out = launch_split_kv(
      lengths, None, query.reshape(batch, num_heads, head_dim), k_cache, v_cache,
      tile_index=_contiguous_tile(config.block_k, configs.padded_head_dim(head_dim)),
      out_dtype=query.dtype, kv_heads=kv_heads, capacity=capacity, scale=scale,
      num_splits=num_splits, config=config, interpret=use_interpret(interpret), name="jaxflash_decode",
      merge=not return_partials)
  return public_outputs(out, return_residual=return_residual)


def decode_attention_reference(query, k_cache, v_cache, key_value_seq_lengths=None, *, scale=None):
  """Plain-JAX decode with the same semantics (materialises the scores): for checking."""
  batch, capacity = k_cache.shape[:2]
  lengths = (jnp.full((batch,), capacity, jnp.int32) if key_value_seq_lengths is None
             else jnp.clip(jnp.asarray(key_value_seq_lengths, jnp.int32), 0, capacity))
  return attention_reference(query, k_cache, v_cache, scale=_checks.default_scale(scale, query.shape[-1]),
                             key_value_seq_lengths=lengths)


def decode_combine_reference(o_part, lse_part):
  """Plain-JAX merge of chunk results: o_part [..., splits, H], lse_part [..., splits]
  (natural log) -> (out [..., H], lse [...]); the math of the combine kernel."""
  lse = jax.nn.logsumexp(lse_part, axis=-1)
  w = jnp.exp(lse_part - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  return jnp.sum(w[..., None] * o_part, axis=-2), lse
