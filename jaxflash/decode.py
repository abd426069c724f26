"""Split-KV decode attention (Flash-Decoding) over a contiguous KV cache.

One query token per sequence reads the whole cache once, so decode is bound by memory
bandwidth, not FLOPs ("Writing an Attention Kernel: FlashAttention and Decode in Triton",
Step 3: ~6 FLOPs per byte at any length). One program
per (sequence, KV head) would leave most SMs idle at small batch, so the cache is cut into
chunks along the sequence (Flash-Decoding, Dao et al. 2023): one program per
(sequence, KV head, chunk) runs FlashAttention's online softmax over its chunk and writes a
normalised partial output and its log-sum-exp in fp32; a small combine kernel merges the
chunks by their share of the softmax mass, exp(LSE_i - LSE).

The kernel body here is shared with the paged kernel (jaxflash/paged.py): both differ only in
how a tile of tokens is addressed.

Options (bias, mask, sliding window, logit soft-cap, sinks, traced scale) are optional refs
and static flags: an absent one is a None ref and compiles out, so a call without options
runs the kernel it always ran. A window moves the chunks, not just the mask: they cover only
the tiles the window touches (`chunking`, `chunk_bounds`). A KV group of G query heads is
one tile of max(16, 2^ceil(log2 G)) rows up to 64 rows, several programs past that.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _checks, configs
from jaxflash._types import Array, DecodeResult, Lengths, Scale, Window
from jaxflash._triton import (LN_2, LOG2_E, CompilerParams, dot, load, load_masked, mask2d, pl, quiet, store,
                              use_interpret)
from jaxflash._util import dot_precision
from jaxflash.configs import DecodeConfig
from jaxflash.quantize import check_scales, dequantize_kv
from jaxflash.reference import attention_reference
from jaxflash.score_mods import soft_cap, window_size
from jaxflash.sharding import result_struct

NEG_INF = float("-inf")


class SplitKV(NamedTuple):
  """Split-KV decode's chunk results before the merge (`return_partials=True`).

  out [B, S, N, H] float32: each chunk's softmax-normalised output; lse2 [B, S, N] float32:
  each chunk's log-sum-exp in base 2 (-inf for a chunk holding no tokens). Chunk i holds
  the share 2^(lse2_i - LSE2) of the softmax mass, LSE2 = log2(sum_i 2^lse2_i), so the
  attention output is the sum of the chunks' outputs weighted by those shares
  (`decode_combine_reference`; `jaxflash.project_split_kv` merges and projects in one kernel).
  With `sinks`, the last chunk is the sink's: out 0 and lse2 = sinks[n] * log2(e), so any
  merge of the chunks counts the sink in the denominator once and LSE2 includes it.
  """

  out: jax.Array
  lse2: jax.Array


# --------------------------------------------------------------------------------------
# Kernel pieces shared with the paged kernel.
# --------------------------------------------------------------------------------------

def _attend_tile(carry, s, v, *, visible, may_be_empty: bool, precision, v_scale=None):
  """One step of the online softmax (FlashAttention-2, Alg. 1) in base 2.

  s [R, block_k] the scores of R query heads of one KV group in log2 units (the scale folds
  in log2(e), so every exponential is the GPU's native exp2: Writing an Attention Kernel,
  Step 2); v [block_k, Hp]. `visible` (broadcastable to s; None in the hot loop's full tiles) masks keys
  past the sequence's end, outside the window or masked out. Without a mask or bias every
  tile holds a visible key, so m_new is finite; with one (`may_be_empty`) a row may see no
  key of a tile yet, and its exponentials are taken against 0 instead of -inf (no NaN).
  v_scale [block_k] (a quantized V's per-token scales, or None) weighs P's columns in P V.
  """
  acc, m_i, l_i = carry  # [R, Hp] f32, [R] f32, [R] f32
  if visible is not None:
    s = jnp.where(visible, s, NEG_INF)
  m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
  m_ref = jnp.where(m_new == NEG_INF, 0.0, m_new) if may_be_empty else m_new
  alpha = jnp.exp2(m_i - m_ref)
  p = jnp.exp2(s - m_ref[:, None])
  l_i = l_i * alpha + jnp.sum(p, axis=1)
  pv = p if v_scale is None else p * v_scale[None, :]
  acc = acc * alpha[:, None] + dot(pv.astype(v.dtype), v, precision=precision)
  return acc, m_new, l_i


def _to_matmul_dtype(tile, dtype):
  """A loaded int8 / FP8 tile in the matmul's dtype (exact: see the kernel)."""
  if jnp.issubdtype(tile.dtype, jnp.floating):
    tile = tile.astype(jnp.float32)
  return tile.astype(dtype)


def chunk_bounds(length, c, *, chunk: int, block_k: int, window_left: int | None):
  """(lo, start, num_tokens) of chunk c for a sequence of `length` valid tokens (traced).

  The query sits at position length - 1 and sees keys [lo, length): lo = 0, or
  max(0, length - 1 - left) with a window. Chunks tile that range from lo rounded down to a
  tile (so tiles stay tile-aligned, which the paged kernel's page slices need): chunk c reads
  tokens [start, start + num_tokens). Past the range num_tokens is 0: nothing is loaded.
  """
  if window_left is None:
    lo, start = 0, c * chunk
  else:
    lo = jnp.maximum(length - 1 - window_left, 0)
    start = lo - lax.rem(lo, block_k) + c * chunk
  return lo, start, jnp.clip(length - start, 0, chunk)


def _option_tile(ref, full, b, head0, tok0, rows_ok, key_ok, *, query_rows: int, block_k: int, other):
  """A bias or mask ref [B or 1, N or 1, S or 1] -> what sequence b's query heads head0.. and
  tokens tok0.. see of it, broadcastable to [R, block_k]. `full` says which of the three axes
  the ref spans: a broadcast axis is read at index 0 (stride 0), never expanded in memory."""
  full_b, full_n, full_s = full
  zero = jnp.int32(0)  # an array index: Python ints do not mix with slices in the loads
  b = b if full_b else zero

  def read(at, mask):
    return load(at) if mask is None else load(at, mask=mask, other=other)

  if full_n and full_s:
    return read(ref.at[b, pl.ds(head0, query_rows), pl.ds(tok0, block_k)], mask2d(rows_ok, key_ok))
  if full_n:
    return read(ref.at[b, pl.ds(head0, query_rows), zero], rows_ok)[:, None]
  if full_s:
    return read(ref.at[b, zero, pl.ds(tok0, block_k)], key_ok)[None, :]
  return ref[b, zero, zero]


def _split_kv_kernel(
    lengths_ref,  # [B] int32
    table_ref,  # [B, max_pages] int32 (paged kernel), None (contiguous)
    scale_ref,  # [1] float32 a traced softmax scale, None (static `scale`)
    sinks_ref,  # [N] float32 sink logits, None
    bias_ref,  # [B or 1, N or 1, S or 1] float, None
    mask_ref,  # [B or 1, N or 1, S or 1] int8 (nonzero: attend), None
    q_ref,  # [B, N, H]
    k_ref,  # [B, S, K, H] cache, or [num_pages * page_size, K, H] pool rows
    v_ref,  # same as k_ref
    k_scale_ref,  # k_ref's shape without H, float32: a quantized cache's scales; None (float cache)
    v_scale_ref,  # same for v_ref
    o_ref,  # [B, chunks (+1 sink chunk), N, H] f32 partials, or [B, N, H] final (one chunk)
    lse_ref,  # [B, chunks (+1), N] f32 log2 partials, or [B, N] f32 natural-log final
    *,
    tile_index,  # (table_ref, b, h, tok0, key_ok) -> index of one K/V tile [block_k, Hp]
    group: int,
    query_rows: int,
    row_blocks: int,
    head_dim: int,
    block_k: int,
    chunk: int,
    chunks: int,
    capacity: int,
    scale: float | None,
    window_left: int | None,
    soft_cap: float | None,
    bias_full: tuple[bool, bool, bool] | None,
    mask_full: tuple[bool, bool, bool] | None,
    final: bool,
    precision,
):
  """One program: sequence b, KV head h (row block r of its query heads), chunk c of `chunk`
  tokens. Every option absent (None refs, static None) compiles out."""
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
  rows_ok = None if group % query_rows == 0 else rows < group  # for the options' loads
  qk_scale = scale * LOG2_E if scale_ref is None else scale_ref[0] * LOG2_E
  may_be_empty = bias_ref is not None or mask_ref is not None

  # Lengths past the capacity are clamped (and negative ones read as 0): the kernel never
  # reads past the cache whatever it is given.
  length = jnp.clip(lengths_ref[b], 0, capacity)
  lo, start, num_tokens = chunk_bounds(length, c, chunk=chunk, block_k=block_k, window_left=window_left)
  num_full = lax.div(num_tokens, block_k)  # non-negative: C division, no floor fix-ups
  num_tiles = lax.div(num_tokens + block_k - 1, block_k)  # num_full, +1 for a ragged tail

  # The query heads of KV group h (GQA by index: heads h*G .. h*G+G-1) as one tile of
  # R >= 16 rows, since tl.dot needs 16 rows; the padded rows load zeros and are never stored.
  q_mask = mask2d(rows < group, col_ok)
  q = load(q_ref.at[b, pl.ds(head0, query_rows), pl.ds(0, head_dim_p)], mask=q_mask, other=0.0)
  # A quantized cache is dequantized tile by tile into the query's dtype for the matmuls.
  compute_dtype = k_ref.dtype if k_scale_ref is None else q_ref.dtype
  q = q.astype(compute_dtype)

  def body(i, carry, *, masked: bool):
    tok0 = start + i * block_k
    key_ok = None
    if masked:
      tokens = tok0 + jnp.arange(block_k)
      key_ok = tokens < length
      if window_left is not None:
        key_ok = key_ok & (tokens >= lo)
    index = tile_index(table_ref, b, h, tok0, key_ok)
    kv_mask = mask2d(key_ok, col_ok)
    k = load_masked(k_ref.at[index], kv_mask)  # [block_k, Hp]
    v = load_masked(v_ref.at[index], kv_mask)
    k_cols = v_cols = None
    if k_scale_ref is not None:
      # A quantized tile converts exactly to the matmul's dtype (int8 and e4m3 values are
      # bf16 and fp16 values); the per-token scales [block_k] then weigh the score columns
      # and P's columns: R x block_k multiplies a tile instead of block_k x H. FP8 goes
      # through float32, which Triton converts faster than e4m3 straight to bf16 (1.52x
      # against 1.18x bf16's tokens/s at 1 x 128K on an H100, bench/studies/quantized_decode_tiles.py).
      k, v = _to_matmul_dtype(k, compute_dtype), _to_matmul_dtype(v, compute_dtype)
      k_cols = load_scales(k_scale_ref, index, key_ok, block_k)
      v_cols = load_scales(v_scale_ref, index, key_ok, block_k)
    # Scale the fp32 scores, not the bf16 query: scaling q in bf16 costs accuracy (Writing an
    # Attention Kernel).
    s = dot(q, k, trans_b=True, precision=precision) * qk_scale  # [R, block_k], log2 units
    if k_cols is not None:
      s = s * k_cols[None, :]
    tile = functools.partial(_option_tile, b=b, head0=head0, tok0=tok0, rows_ok=rows_ok, key_ok=key_ok,
                             query_rows=query_rows, block_k=block_k)
    if bias_ref is not None:  # added to the natural-scale scores: times log2(e) here
      s = s + tile(bias_ref, bias_full, other=0.0).astype(jnp.float32) * LOG2_E
    if soft_cap is not None:  # cap * tanh(s / cap) on natural scores is the same in log2 units
      cap2 = soft_cap * LOG2_E
      s = cap2 * jnp.tanh(s * (1.0 / cap2))
    visible = None if key_ok is None else key_ok[None, :]
    if mask_ref is not None:
      keep = tile(mask_ref, mask_full, other=0) != 0
      visible = keep if visible is None else visible & keep
    return _attend_tile(carry, s, v, visible=visible, may_be_empty=may_be_empty, precision=precision,
                        v_scale=v_cols)

  carry = (jnp.zeros((query_rows, head_dim_p), jnp.float32),
           jnp.full((query_rows,), NEG_INF, jnp.float32),
           jnp.zeros((query_rows,), jnp.float32))
  # The hot loop runs over whole tiles with no masks at all; only the sequence's last,
  # partial tile pays for them (Writing an Attention Kernel's split of the causal loop,
  # applied to the length), and with a window the tile where the window begins. A chunk
  # past the end runs zero trips of every loop and loads nothing.
  num_head = 0
  if window_left is not None:
    num_head = jnp.minimum((start < lo).astype(jnp.int32), num_full)
    carry = lax.fori_loop(0, num_head, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(num_head, num_full, functools.partial(body, masked=False), carry)
  acc, m_i, l_i = lax.fori_loop(num_full, num_tiles, functools.partial(body, masked=True), carry)

  head_rows = pl.ds(head0, query_rows)
  if sinks_ref is not None:
    sink2 = load(sinks_ref.at[head_rows], mask=rows < group, other=NEG_INF) * LOG2_E  # [R]
    if final:  # the one chunk: the sink joins its denominator here, once
      m_new = jnp.maximum(m_i, sink2)
      m_ref = jnp.where(m_new == NEG_INF, 0.0, m_new)
      alpha = jnp.exp2(m_i - m_ref)
      acc, l_i, m_i = acc * alpha[:, None], l_i * alpha + jnp.exp2(sink2 - m_ref), m_new
    else:  # the sink is one more chunk, of no value and mass 2^sink2, that the merge adds once

      @pl.when(c == 0)
      def _():
        slot = jnp.int32(chunks)  # an array index, as in _option_tile
        store(o_ref.at[b, slot, head_rows, pl.ds(0, head_dim_p)],
              jnp.zeros((query_rows, head_dim_p), jnp.float32), mask=mask2d(rows < group, col_ok))
        store(lse_ref.at[b, slot, head_rows], sink2, mask=rows < group)

  # Normalise once, after the loop (FlashAttention-2 Sec. 3.1). Empty chunks (l = 0) give
  # zeros and LSE -inf: the combine gives them weight exp2(-inf) = 0. A NaN seen leaves
  # l = NaN, which `!= 0` keeps, so it reaches the output as jax.nn's does.
  nonempty = l_i != 0.0
  out = acc / jnp.where(nonempty, l_i, 1.0)[:, None]
  lse2 = jnp.where(nonempty, m_i + jnp.log2(jnp.where(nonempty, l_i, 1.0)), NEG_INF)
  out_mask = mask2d(rows < group, col_ok)
  if final:
    store(o_ref.at[b, head_rows, pl.ds(0, head_dim_p)], out.astype(o_ref.dtype), mask=out_mask)
    store(lse_ref.at[b, head_rows], lse2 * LN_2, mask=rows < group)
  else:
    store(o_ref.at[b, c, head_rows, pl.ds(0, head_dim_p)], out, mask=out_mask)
    store(lse_ref.at[b, c, head_rows], lse2, mask=rows < group)


def load_scales(scale_ref, index, key_ok, block_k: int):
  """The scales [block_k] float32 of the K/V tile at `index` (a tile index as the
  addressers give it): the same index without its head-dim part. A gathered tile's token
  index is a column [block_k, 1], a sliced one a range; masked keys load scale 0."""
  token_index = index[:-1]
  gathered = any(getattr(i, "ndim", 0) == 2 for i in token_index)
  mask = None if key_ok is None else (key_ok[:, None] if gathered else key_ok)
  return load_masked(scale_ref.at[token_index], mask).reshape(block_k)


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
  return jnp.sum(share[:, None] * chunks, axis=0) / jnp.where(total != 0.0, total, 1.0)


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
  """Merges the chunks of one (sequence, query head) over dims j*block_h..: the
  `decode_combine` of Writing an Attention Kernel.

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
    lse_ref[b, n] = jnp.where(total != 0.0, (m + jnp.log2(jnp.where(total != 0.0, total, 1.0))) * LN_2,
                              NEG_INF)


# --------------------------------------------------------------------------------------
# Launch helpers shared with the paged kernel.
# --------------------------------------------------------------------------------------

def resolve_config(config: DecodeConfig | None, head_dim: int, dtype, *, paged: bool) -> DecodeConfig:
  """The tuned config (the paged kernel's with `paged`), or `config` checked."""
  default = functools.partial(configs.decode_config, paged=paged)
  return configs.resolve(config, DecodeConfig, default, head_dim, dtype)


def chunking(num_splits: int | None, batch: int, programs: int, capacity: int, block_k: int,
             window_left: int | None = None) -> tuple[int, int]:
  """(chunk tokens, chunks): chunks are whole tiles, so only a sequence's last tile is ragged.

  `programs` per sequence (KV heads x row blocks) before the chunks multiply them. Without a
  window the chunks split the capacity. With one they split only the tiles a window of
  left + 1 keys can touch (one more than its length in tiles, as its start falls inside a
  tile: `chunk_bounds`), into about as many chunks as a plain decode of the window's length
  would: a windowed call over a 128K cache launches like a 4K decode. Asking for more splits
  than there are tiles gives one tile per chunk.
  """
  span = max(capacity, 1) if window_left is None else min(max(capacity, 1), window_left + 1)
  if num_splits is None:
    num_splits = configs.num_splits(batch, programs, span)
  if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
    raise ValueError(f"num_splits must be a positive int (or None), got {num_splits!r}")
  if window_left is None:
    chunk = pl.cdiv(pl.cdiv(span, num_splits), block_k) * block_k
    return chunk, pl.cdiv(span, chunk)
  tiles = pl.cdiv(min(max(capacity, 1), span + block_k - 1), block_k)
  per_chunk = max(1, (tiles + num_splits // 2) // num_splits)  # tiles per chunk, rounded to nearest
  return per_chunk * block_k, pl.cdiv(tiles, per_chunk)


class DecodeOptions(NamedTuple):
  """A decode call's options as the kernel takes them (`decode_options` builds them).

  bias/mask: the caller's arrays viewed as [B or 1, N or 1, S or 1] (a broadcast axis stays
  of size 1: the kernel reads it with stride 0); mask as int8. scale: a traced scale as
  float32 [1], or None with `static_scale` a Python float. sinks: float32 [N].
  """

  bias: jax.Array | None = None
  mask: jax.Array | None = None
  scale: jax.Array | None = None
  sinks: jax.Array | None = None
  static_scale: float | None = None
  window_left: int | None = None
  soft_cap: float | None = None


def launch_split_kv(lengths, table, query3, k_rows, v_rows, *, tile_index, out_dtype, kv_heads: int,
                    capacity: int, options: DecodeOptions, num_splits: int | None,
                    config: DecodeConfig, interpret: bool, name: str, merge: bool = True,
                    k_scale=None, v_scale=None):
  """Runs the split-KV kernel and, with more than one chunk, the combine.

  query3 [B, N, H]; k_rows/v_rows the caches as the kernel indexes them; k_scale/v_scale
  their scales (the same shapes without H) for a quantized cache, else None.
  Returns out [B, N, H] (out_dtype) and lse [B, N] float32 (natural log); without `merge`,
  the chunks' SplitKV instead (even for one chunk).
  """
  batch, num_heads, head_dim = query3.shape
  window_left = options.window_left
  if window_left is not None and window_left + 1 >= capacity:
    window_left = None  # the window holds the whole cache: nothing to cut
  if capacity == 0:  # an empty cache: nothing to attend to but the sinks
    return _empty(batch, num_heads, head_dim, out_dtype, options.sinks, merge=merge)
  group = num_heads // kv_heads
  compute_dtype = k_rows.dtype if k_scale is None else query3.dtype
  query_rows = configs.decode_query_rows(group, config, head_dim, compute_dtype)
  row_blocks = pl.cdiv(group, query_rows)  # 1 unless the group has more than query_rows heads
  # Programs per sequence: one per (KV head, row block), before the chunks multiply them.
  chunk, splits = chunking(num_splits, batch, kv_heads * row_blocks, capacity, config.block_k,
                           window_left)
  final = splits == 1 and merge
  # With sinks, the partials carry one more chunk: the sink's (see the kernel).
  slots = splits + int(options.sinks is not None)
  # Inside jax.shard_map the results vary over every manual axis the inputs do.
  inputs = (lengths, table, options.scale, options.sinks, options.bias, options.mask, query3,
            k_rows, v_rows, k_scale, v_scale)
  if final:  # one chunk: the kernel writes the answer itself and no combine runs
    out_shape = [result_struct((batch, num_heads, head_dim), out_dtype, *inputs),
                 result_struct((batch, num_heads), jnp.float32, *inputs)]
  else:
    out_shape = [result_struct((batch, slots, num_heads, head_dim), jnp.float32, *inputs),
                 result_struct((batch, slots, num_heads), jnp.float32, *inputs)]
  full = lambda x: None if x is None else tuple(d > 1 for d in x.shape)  # noqa: E731
  kernel = functools.partial(
      _split_kv_kernel, tile_index=tile_index, group=group, query_rows=query_rows,
      row_blocks=row_blocks, head_dim=head_dim, block_k=config.block_k, chunk=chunk, chunks=splits,
      capacity=capacity, scale=options.static_scale, window_left=window_left,
      soft_cap=options.soft_cap, bias_full=full(options.bias), mask_full=full(options.mask),
      final=final, precision=dot_precision(compute_dtype))
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


def _empty(batch: int, num_heads: int, head_dim: int, out_dtype, sinks, *, merge: bool):
  """The answer over an empty cache: zeros, and an LSE of -inf (the sink's logit with sinks)."""
  lse = (jnp.full((batch, num_heads), NEG_INF, jnp.float32) if sinks is None
         else jnp.broadcast_to(sinks, (batch, num_heads)))
  if not merge:
    return SplitKV(jnp.zeros((batch, 1, num_heads, head_dim), jnp.float32), lse[:, None] * LOG2_E)
  return jnp.zeros((batch, num_heads, head_dim), out_dtype), lse


def public_outputs(out, *, return_residual: bool):
  """launch_split_kv's (out [B, N, H], lse [B, N]) -> out [B, 1, N, H], with lse [B, 1, N] when
  `return_residual`; its SplitKV (`return_partials`) as it is."""
  if isinstance(out, SplitKV):
    return out
  out, lse = out
  return (out[:, None], lse[:, None]) if return_residual else out[:, None]


def _combine(o_part, lse_part, *, out_dtype, interpret: bool):
  """o_part [B, splits, N, H] f32, lse_part [B, splits, N] (log2) -> out [B, N, H], lse [B, N].

  A Pallas kernel rather than plain JAX: a max, then a weighted sum over the chunks would
  otherwise be two or three XLA reductions, each a launch of its own; this is one launch
  that reads the few kilobytes of partials once. Its time is latency: one program per
  (sequence, head, 32 dims) with one warp each ends ~0.5 us sooner on the H200 than one
  per (sequence, head) with two warps (bench/PERFORMANCE.md).
  """
  batch, splits, num_heads, head_dim = o_part.shape
  block_h = min(COMBINE_BLOCK_H, configs.padded_head_dim(head_dim))
  with quiet():
    return pl.pallas_call(
        functools.partial(_combine_kernel, num_splits=splits, head_dim=head_dim, block_h=block_h),
        grid=(batch, num_heads, pl.cdiv(head_dim, block_h)),
        out_shape=[result_struct((batch, num_heads, head_dim), out_dtype, o_part, lse_part),
                   result_struct((batch, num_heads), jnp.float32, o_part, lse_part)],
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


def _kernel_view(x):
  """A checked bias/mask [B or 1, N or 1, 1, S or 1] -> [B or 1, N or 1, S or 1], no copy (a
  mask is converted to int8 at its own size)."""
  if x is None:
    return None
  x = x.reshape(x.shape[0], x.shape[1], x.shape[3])
  return x.astype(jnp.int8) if x.dtype == jnp.bool_ else x


def decode_options(query, capacity: int, *, bias, mask, traced_scale, scale, sinks, local_window_size,
                   logits_soft_cap) -> DecodeOptions:
  """Checks a decode call's options (trace time, naming the argument and its shape)."""
  batch, _, num_heads, head_dim = query.shape
  target = (batch, num_heads, 1, capacity)  # S: the cache's capacity
  bias = _checks.check_bias(bias, target, axes="[B, N, 1, S]")
  mask = _checks.check_mask(mask, target, axes="[B, N, 1, S]")
  window = window_size(local_window_size)
  return DecodeOptions(
      bias=_kernel_view(bias), mask=_kernel_view(mask), scale=traced_scale,
      sinks=_checks.check_sinks(sinks, num_heads),
      static_scale=None if traced_scale is not None else _checks.default_scale(scale, head_dim),
      window_left=None if window is None else window[0],
      soft_cap=soft_cap(logits_soft_cap))


# Static arguments of the jitted decode functions, after `_checks.split_scale` took a traced scale out.
STATIC_ARGNAMES = ("scale", "local_window_size", "logits_soft_cap", "num_splits", "return_residual",
                   "return_partials", "config", "interpret")


def decode_attention(query: Array, k_cache: Array, v_cache: Array, key_value_seq_lengths: Lengths = None, *,
                     bias: Array | None = None, mask: Array | None = None, scale: Scale = None,
                     local_window_size: Window = None, logits_soft_cap: float | None = None,
                     sinks: Array | None = None, num_splits: int | None = None,
                     return_residual: bool = False, return_partials: bool = False,
                     config: DecodeConfig | None = None, interpret: bool | None = None,
                     k_scale: Array | None = None, v_scale: Array | None = None) -> DecodeResult:
  """Attention of one new token per sequence over a KV cache, split-KV (Flash-Decoding).

  query [B, 1, N, H]; k_cache, v_cache [B, S, K, H] (S = capacity) read in place;
  key_value_seq_lengths [B] int32 valid tokens per sequence (None: all S; values are
  traced, so changing them never recompiles; concrete ones outside [0, S] raise ValueError,
  traced ones, which cannot be read at trace time, are clamped to [0, S]). N must be a
  multiple of K (query head n reads KV head n // (N // K)), any ratio. The query is cast to
  the caches' dtype for the matmuls, which accumulate in fp32. The query sits at position
  length - 1: it sees every valid key unless the options below say otherwise.

  Options (semantics of `jaxflash.attention_reference` with T = 1; each absent one costs nothing):
    bias [B, N, 1, S]-broadcastable float, added to the scaled scores; mask likewise, bool,
    True = attend (both read tile by tile; broadcast axes are never expanded in memory).
    scale: a number (compiled in; default H ** -0.5) or a JAX scalar (traced: new values do
    not recompile). local_window_size: w or (left, right): keys [length - 1 - left, length)
    (right cannot reach past the query, the last valid key); only the window's part of the
    cache is read and split over the SMs. logits_soft_cap: scores become cap * tanh(s / cap)
    after the bias. sinks [N]: a logit per query head in the softmax's denominator only.

  num_splits: chunks per sequence (default `jaxflash.num_splits(B, K, S)`, S the window's
  length with a window); config: tiles (default `jaxflash.decode_config(H, dtype)`);
  interpret: Pallas interpret mode (default: when no GPU). Returns out [B, 1, N, H] in the
  query's dtype, and with `return_residual=True` also lse [B, 1, N] float32 (natural log,
  sink included; -inf for a row that sees no key, whose output is zeros, or the sink's
  logit with sinks). With `return_partials=True` the chunks are not merged: their SplitKV
  comes back instead (with sinks its last chunk is the sink's), for `jaxflash.project_split_kv`.

  A quantized cache (int8 or float8_e4m3fn, `jaxflash.quantize_kv`) comes with k_scale and
  v_scale [B, S, K] float32; each tile is dequantized after its load, matmuls in the query's
  dtype, accumulation in float32.
  """
  static_scale, traced_scale = _checks.split_scale(scale)
  if hasattr(k_cache, "shape") and k_cache.ndim == 4:  # concrete lengths: read before the jit
    _checks.check_length_values("key_value_seq_lengths", key_value_seq_lengths, k_cache.shape[1])
  return _decode_attention(query, k_cache, v_cache, key_value_seq_lengths, bias, mask, traced_scale, sinks,
                           k_scale, v_scale,
                           scale=static_scale, local_window_size=window_size(local_window_size),
                           logits_soft_cap=soft_cap(logits_soft_cap), num_splits=num_splits,
                           return_residual=return_residual, return_partials=return_partials,
                           config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def _decode_attention(query, k_cache, v_cache, key_value_seq_lengths, bias, mask, traced_scale, sinks,
                      k_scale, v_scale, *, scale, local_window_size, logits_soft_cap, num_splits,
                      return_residual, return_partials, config, interpret):
  check_return_flags(return_residual, return_partials)
  quantized = check_scales(k_cache, v_cache, k_scale, v_scale, key_name="k_cache", value_name="v_cache")
  _checks.check_qkv(query, k_cache, v_cache, key_name="k_cache", value_name="v_cache", quantized=quantized)
  batch, capacity, kv_heads, head_dim = k_cache.shape
  check_decode_query(query, batch, "k_cache")
  lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  if lengths is None:
    lengths = jnp.full((batch,), capacity, jnp.int32)
  options = decode_options(query, capacity, bias=bias, mask=mask, traced_scale=traced_scale, scale=scale,
                           sinks=sinks, local_window_size=local_window_size,
                           logits_soft_cap=logits_soft_cap)
  config = resolve_config(config, head_dim, k_cache.dtype, paged=False)
  num_heads = query.shape[2]

  out = launch_split_kv(
      lengths, None, query.reshape(batch, num_heads, head_dim), k_cache, v_cache,
      tile_index=_contiguous_tile(config.block_k, configs.padded_head_dim(head_dim)),
      out_dtype=query.dtype, kv_heads=kv_heads, capacity=capacity, options=options,
      num_splits=num_splits, config=config, interpret=use_interpret(interpret), name="jaxflash_decode",
      merge=not return_partials, k_scale=k_scale, v_scale=v_scale)
  return public_outputs(out, return_residual=return_residual)


def decode_attention_reference(query, k_cache, v_cache, key_value_seq_lengths=None, *, bias=None,
                               mask=None, scale=None, local_window_size=None, logits_soft_cap=None,
                               sinks=None, k_scale=None, v_scale=None):
  """Plain-JAX decode with the same semantics (materialises the scores): for checking. A
  quantized cache is dequantized with k_scale/v_scale first."""
  if k_scale is not None:
    k_cache = dequantize_kv(k_cache, k_scale, query.dtype)
    v_cache = dequantize_kv(v_cache, v_scale, query.dtype)
  batch, capacity = k_cache.shape[:2]
  lengths = (jnp.full((batch,), capacity, jnp.int32) if key_value_seq_lengths is None
             else jnp.clip(jnp.asarray(key_value_seq_lengths, jnp.int32), 0, capacity))
  return attention_reference(query, k_cache, v_cache, bias, mask,
                             scale=query.shape[-1] ** -0.5 if scale is None else scale,
                             key_value_seq_lengths=lengths, local_window_size=window_size(local_window_size),
                             logits_soft_cap=logits_soft_cap, sinks=sinks)


def decode_combine_reference(o_part, lse_part):
  """Plain-JAX merge of chunk results: o_part [..., splits, H], lse_part [..., splits]
  (natural log) -> (out [..., H], lse [...]); the math of the combine kernel. A SplitKV with
  sinks merges right as it is: its last chunk, of zeros and the sink's logit, puts the sink
  in the denominator once."""
  lse = jax.nn.logsumexp(lse_part, axis=-1)
  w = jnp.exp(lse_part - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
  return jnp.sum(w[..., None] * o_part, axis=-2), lse
