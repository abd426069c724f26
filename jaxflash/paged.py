"""Paged decode attention: the split-KV kernel reading the cache through a block table.

The pool is [num_pages, page_size, K, H] (FlashAttention's paged layout; "Writing an
Attention Kernel: FlashAttention and Decode in Triton", Step 5; PagedAttention: "Efficient
Memory Management for Large Language Model Serving with PagedAttention") and sequence b's
logical page j lives at physical page block_table[b, j]. The kernel is jaxflash/decode.py's
with one change, the address arithmetic: the pool is viewed as rows
[num_pages * page_size, K, H] (a free reshape) and token t of sequence b sits at row
block_table[b, t // page_size] * page_size + t % page_size.

- page_size < block_k: a tile spans block_k / page_size whole pages; it does one small
  vector load from the block table, then gathers its K and V rows at the addresses it got.
- page_size >= block_k: a tile is part of one page; one scalar table load, then contiguous
  rows, as in the contiguous kernel.

The K/V addresses depend on the table load, which costs the software pipeline one stage of
lookahead (Writing an Attention Kernel, Step 5); the paged configs (jaxflash.configs) carry one stage more.
"""
from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflash import _checks, configs
from jaxflash._types import Array, ArrayLike, DecodeResult, Lengths, Scale, Window
from jaxflash._triton import load, pl, use_interpret
from jaxflash.configs import DecodeConfig
from jaxflash.decode import (STATIC_ARGNAMES, check_decode_query, check_return_flags, decode_options,
                             launch_split_kv, public_outputs, resolve_config)
from jaxflash.quantize import check_scales, dequantize_kv, quantize_kv
from jaxflash.reference import attention_reference, gather_pages
from jaxflash.score_mods import soft_cap, window_size

__all__ = ["paged_decode_attention", "paged_kv_write", "gather_pages", "block_table_is_valid",
           "paged_decode_attention_reference"]


def _pool_rows(block_k: int, page_size: int, num_pages: int):
  """(table_ref, row, tok0, key_ok) -> the pool rows [num_pages * page_size] holding tokens
  tok0 .. tok0 + block_k - 1 of one sequence: a pl.ds of contiguous rows (page_size >=
  block_k) or their [block_k, 1] int32 column (a tile spanning pages). `row` indexes the
  sequence's table entries: (b,) in the whole table [B, max_pages], () in its own row
  [max_pages]. key_ok [block_k] (None: all) masks the tokens past the sequence's end.

  Table entries are clamped into [0, num_pages): a bad entry reads a wrong page of the
  pool, never memory outside it (see paged_decode_attention).
  """
  # Tokens are non-negative and pages powers of two: shift and mask, not jnp's floor
  # division (which costs a compare-and-select chain per element).
  page_shift = page_size.bit_length() - 1

  def page_and_slot(tok):
    return lax.shift_right_logical(tok, page_shift), tok & (page_size - 1)

  if page_size >= block_k:
    def rows(table_ref, row, tok0, key_ok):
      del key_ok  # tok0 < length, so the one entry read is a valid one
      logical, slot = page_and_slot(tok0)
      page = jnp.clip(table_ref[(*row, logical)], 0, num_pages - 1)
      return pl.ds(page * page_size + slot, block_k)
    return rows

  def rows(table_ref, row, tok0, key_ok):
    logical, slot = page_and_slot(tok0 + jnp.arange(block_k))  # [block_k] each
    # One entry per token (each page's entry repeats page_size times: one vector load of
    # block_k int32 that the L1 serves). In the ragged last tile the entries of pages past
    # the sequence's end are masked: they are never read.
    entries = table_ref.at[(*row, logical)]
    page = load(entries) if key_ok is None else load(entries, mask=key_ok, other=0)
    return (jnp.clip(page, 0, num_pages - 1) * page_size + slot)[:, None]  # [block_k, 1]
  return rows


def _head_dim_index(page_size: int, block_k: int, head_dim_p: int):
  """The head-dim part of a tile index: a slice beside a row slice, a [1, Hp] row of
  indices beside a gathered [block_k, 1] column (a gather takes arrays in every axis)."""
  if page_size >= block_k:
    return pl.ds(0, head_dim_p)
  return jnp.arange(head_dim_p)[None, :]


def _paged_tile(block_k: int, page_size: int, num_pages: int, head_dim_p: int):
  """Tile addresser over the pool's rows [num_pages * page_size, K, H] and the whole table
  [B, max_pages]: (table_ref, b, h, tok0, key_ok) -> the index of a [block_k, Hp] tile."""
  pool_rows = _pool_rows(block_k, page_size, num_pages)

  def tile_index(table_ref, b, h, tok0, key_ok):
    return (pool_rows(table_ref, (b,), tok0, key_ok), h, _head_dim_index(page_size, block_k, head_dim_p))
  return tile_index


def paged_head_tile(block_k: int, page_size: int, num_pages: int, head_dim_p: int):
  """Tile addresser over one KV head's pool rows [num_pages * page_size, H] and one
  sequence's table row [max_pages] (what the prefill kernel's BlockSpecs select):
  (table_row_ref, tok0, key_ok) -> the index of a [block_k, Hp] tile."""
  pool_rows = _pool_rows(block_k, page_size, num_pages)

  def tile_index(table_row_ref, tok0, key_ok):
    return (pool_rows(table_row_ref, (), tok0, key_ok), _head_dim_index(page_size, block_k, head_dim_p))
  return tile_index


def paged_decode_attention(query: Array, k_pages: Array, v_pages: Array, key_value_seq_lengths: ArrayLike,
                           block_table: ArrayLike, *, bias: Array | None = None, mask: Array | None = None,
                           scale: Scale = None, local_window_size: Window = None,
                           logits_soft_cap: float | None = None, sinks: Array | None = None,
                           num_splits: int | None = None, return_residual: bool = False,
                           return_partials: bool = False, config: DecodeConfig | None = None,
                           interpret: bool | None = None,
                           k_scale: Array | None = None, v_scale: Array | None = None) -> DecodeResult:
  """Decode attention over a paged KV cache, split-KV.

  query [B, 1, N, H]; k_pages, v_pages [num_pages, page_size, K, H] (page_size a power of
  two from 8, read in place); key_value_seq_lengths [B] int32 (traced: changing them never
  recompiles; concrete ones outside [0, max_pages * page_size] raise ValueError, traced
  ones are clamped to it); block_table [B, max_pages] int32,
  logical page j of sequence b -> physical page. Only the entries of pages holding a key
  the query sees are read (with a window, pages wholly before it are not); pages may be
  shared between sequences.

  A concrete table entry that is read and lies outside [0, num_pages) raises ValueError.
  Under jit entries cannot be read at trace time: one outside is clamped into that range
  (the kernel never reads outside the pool), but that sequence's result is computed from a
  wrong page. Check traced tables with `block_table_is_valid` where that matters.

  Options as in `decode_attention`, with S = max_pages * page_size: bias and mask
  broadcast to [B, N, 1, S] in logical token positions (position t of sequence b, wherever
  its page lives). Returns out [B, 1, N, H] in the query's dtype, and with
  `return_residual=True` also lse [B, 1, N] float32 (natural log, sink included; -inf for
  length 0, whose output is zeros). num_splits, config (default
  `jaxflash.decode_config(H, dtype, paged=True)`), return_partials and interpret as in
  `decode_attention`. A quantized pool (int8 or float8_e4m3fn) comes with k_scale and v_scale
  [num_pages, page_size, K] float32, dequantized tile by tile as in `decode_attention`.
  """
  static_scale, traced_scale = _checks.split_scale(scale)
  if hasattr(k_pages, "shape") and k_pages.ndim == 4 and len(np.shape(block_table)) == 2:
    # Concrete lengths and table entries: read before the jit, where they become tracers.
    num_pages, page_size = k_pages.shape[:2]
    _checks.check_length_values("key_value_seq_lengths", key_value_seq_lengths,
                                np.shape(block_table)[1] * page_size)
    _checks.check_table_values(block_table, key_value_seq_lengths, num_pages=num_pages, page_size=page_size)
  return _paged_decode_attention(
      query, k_pages, v_pages, key_value_seq_lengths, block_table, bias, mask, traced_scale, sinks,
      k_scale, v_scale,
      scale=static_scale, local_window_size=window_size(local_window_size),
      logits_soft_cap=soft_cap(logits_soft_cap), num_splits=num_splits,
      return_residual=return_residual, return_partials=return_partials, config=config,
      interpret=interpret)


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def _paged_decode_attention(query, k_pages, v_pages, key_value_seq_lengths, block_table, bias, mask,
                            traced_scale, sinks, k_scale, v_scale, *, scale, local_window_size,
                            logits_soft_cap, num_splits, return_residual, return_partials, config,
                            interpret):
  check_return_flags(return_residual, return_partials)
  quantized = check_scales(k_pages, v_pages, k_scale, v_scale, key_name="k_pages", value_name="v_pages")
  _checks.check_qkv(query, k_pages, v_pages, key_name="k_pages", value_name="v_pages", quantized=quantized)
  num_pages, page_size, kv_heads, head_dim = k_pages.shape
  batch = query.shape[0]
  block_table, capacity = _checks.check_pages(k_pages, block_table, key_value_seq_lengths, batch,
                                              caller="paged_decode_attention")
  check_decode_query(query, batch, "block_table")
  lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  options = decode_options(query, capacity, bias=bias, mask=mask, traced_scale=traced_scale, scale=scale,
                           sinks=sinks, local_window_size=local_window_size,
                           logits_soft_cap=logits_soft_cap)
  config = resolve_config(config, head_dim, k_pages.dtype, paged=True)
  num_heads = query.shape[2]
  head_dim_p = configs.padded_head_dim(head_dim)

  # [num_pages, page, K, H] -> [num_pages * page, K, H]: a bitcast, the pool stays in place.
  k_rows = k_pages.reshape(num_pages * page_size, kv_heads, head_dim)
  v_rows = v_pages.reshape(num_pages * page_size, kv_heads, head_dim)
  scale_rows = [None if x is None else x.reshape(num_pages * page_size, kv_heads) for x in (k_scale, v_scale)]
  out = launch_split_kv(
      lengths, block_table, query.reshape(batch, num_heads, head_dim), k_rows, v_rows,
      tile_index=_paged_tile(config.block_k, page_size, num_pages, head_dim_p),
      out_dtype=query.dtype, kv_heads=kv_heads, capacity=capacity, options=options,
      num_splits=num_splits, config=config, interpret=use_interpret(interpret),
      name="jaxflash_paged_decode", merge=not return_partials, k_scale=scale_rows[0],
      v_scale=scale_rows[1])
  return public_outputs(out, return_residual=return_residual)


def block_table_is_valid(block_table, key_value_seq_lengths, *, num_pages: int, page_size: int):
  """True (a jnp bool scalar) when every table entry the kernel will read lies in
  [0, num_pages) and every length lies in [0, max_pages * page_size].

  Plain jnp, usable under jit: assert on it outside (`assert block_table_is_valid(...)`) or
  inside a checkified function (`checkify.check(block_table_is_valid(...), "...")`).
  """
  block_table = jnp.asarray(block_table)
  lengths = jnp.asarray(key_value_seq_lengths)
  max_pages = block_table.shape[1]
  lengths_ok = jnp.all((lengths >= 0) & (lengths <= max_pages * page_size))
  pages_used = (jnp.clip(lengths, 0, max_pages * page_size) + page_size - 1) // page_size  # [B]
  read = jnp.arange(max_pages)[None, :] < pages_used[:, None]  # [B, max_pages]
  in_pool = (block_table >= 0) & (block_table < num_pages)
  return lengths_ok & jnp.all(in_pool | ~read)


@typing.overload
def paged_kv_write(k_pages: Array, v_pages: Array, block_table: ArrayLike, start_positions: ArrayLike,
                   k_new: Array, v_new: Array, new_lengths: Lengths = None, *,
                   k_scale: None = None, v_scale: None = None) -> tuple[Array, Array]: ...
@typing.overload
def paged_kv_write(k_pages: Array, v_pages: Array, block_table: ArrayLike, start_positions: ArrayLike,
                   k_new: Array, v_new: Array, new_lengths: Lengths = None, *,
                   k_scale: Array, v_scale: Array) -> tuple[Array, Array, Array, Array]: ...
def paged_kv_write(k_pages: Array, v_pages: Array, block_table: ArrayLike, start_positions: ArrayLike,
                   k_new: Array, v_new: Array, new_lengths: Lengths = None, *,
                   k_scale: Array | None = None, v_scale: Array | None = None) -> tuple[Array, ...]:
  """Writes new tokens into the pool through the block table (plain JAX).

  k_new, v_new [B, T, K, H] land at token positions start_positions[b] + t of sequence b:
  pool row block_table[b, pos // page_size], slot pos % page_size. Tokens with
  t >= new_lengths[b] (when given), positions past the table, and entries outside
  [0, num_pages) are dropped: they write nothing. Returns the updated (k_pages, v_pages);
  under jit with the pools donated the scatter updates them in place. Two tokens written
  to one slot leave either one.

  A quantized pool (int8 or float8_e4m3fn) comes with its scale pools k_scale, v_scale
  [num_pages, page_size, K] float32: the new tokens are quantized on the way in
  (`jaxflash.quantize_kv`) and (k_pages, v_pages, k_scale, v_scale) come back.
  """
  quantized = check_scales(k_pages, v_pages, k_scale, v_scale, key_name="k_pages", value_name="v_pages")
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages), ("k_new", k_new), ("v_new", v_new)):
    if not (quantized and name.endswith("pages")):
      _checks.check_float(name, x)
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4, got shape {tuple(x.shape)}")
  if k_pages.shape != v_pages.shape or k_new.shape != v_new.shape:
    raise ValueError(f"k_pages/v_pages and k_new/v_new must match in shape, got k_pages "
                     f"{tuple(k_pages.shape)}, v_pages {tuple(v_pages.shape)}, k_new "
                     f"{tuple(k_new.shape)}, v_new {tuple(v_new.shape)}")
  num_pages, page_size, kv_heads, head_dim = k_pages.shape
  batch, num_new = k_new.shape[:2]
  if k_new.shape[2:] != (kv_heads, head_dim):
    raise ValueError(f"k_new [B, T, K, H] must have the pool's K={kv_heads} and H={head_dim}, "
                     f"got k_new {tuple(k_new.shape)} and k_pages {tuple(k_pages.shape)}")
  _checks.check_page_size(page_size)
  block_table = _checks.check_block_table(block_table, batch)
  start_positions = _checks.check_lengths("start_positions", start_positions, batch)
  new_lengths = _checks.check_lengths("new_lengths", new_lengths, batch)
  max_pages = block_table.shape[1]

  pos = start_positions[:, None] + jnp.arange(num_new)[None, :]  # [B, T]
  logical = pos // page_size
  keep = (pos >= 0) & (logical < max_pages)
  if new_lengths is not None:
    keep &= jnp.arange(num_new)[None, :] < new_lengths[:, None]
  page = jnp.take_along_axis(block_table, jnp.clip(logical, 0, max_pages - 1), axis=1)
  keep &= (page >= 0) & (page < num_pages)
  # Dropped tokens aim one past the pool, which mode="drop" discards.
  row = jnp.where(keep, page * page_size + pos % page_size, num_pages * page_size).reshape(-1)

  def write(pages, new):  # pages [P, page, K, ...], new [B, T, K, ...]
    rows = pages.reshape(num_pages * page_size, *pages.shape[2:])
    rows = rows.at[row].set(new.reshape(batch * num_new, *new.shape[2:]).astype(pages.dtype),
                            mode="drop")
    return rows.reshape(pages.shape)

  if not quantized:
    return write(k_pages, k_new), write(v_pages, v_new)
  k_q, k_new_scale = quantize_kv(k_new, k_pages.dtype)
  v_q, v_new_scale = quantize_kv(v_new, v_pages.dtype)
  return (write(k_pages, k_q), write(v_pages, v_q), write(k_scale, k_new_scale),
          write(v_scale, v_new_scale))


def paged_decode_attention_reference(query, k_pages, v_pages, key_value_seq_lengths, block_table, *,
                                     bias=None, mask=None, scale=None, local_window_size=None,
                                     logits_soft_cap=None, sinks=None, k_scale=None, v_scale=None):
  """Plain JAX: gather the pages into contiguous caches (dequantized with their scales if
  given), then attend (for checking)."""
  if k_scale is not None:
    k_pages = dequantize_kv(k_pages, k_scale, query.dtype)
    v_pages = dequantize_kv(v_pages, v_scale, query.dtype)
  capacity = block_table.shape[1] * k_pages.shape[1]
  lengths = jnp.clip(jnp.asarray(key_value_seq_lengths, jnp.int32), 0, capacity)
  table = jnp.clip(jnp.asarray(block_table, jnp.int32), 0, k_pages.shape[0] - 1)
  return attention_reference(query, gather_pages(k_pages, table), gather_pages(v_pages, table), bias, mask,
                             scale=query.shape[-1] ** -0.5 if scale is None else scale,
                             key_value_seq_lengths=lengths, local_window_size=window_size(local_window_size),
                             logits_soft_cap=logits_soft_cap, sinks=sinks)
