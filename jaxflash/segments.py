"""Packed documents: segment ids, their checks, and the key blocks two id ranges let meet.

Training batches pack several documents into one row; `segment_ids` [B, T] and
`kv_segment_ids` [B, S] name each token's document, and query t sees key s only where the
two ids are equal (ANDed with every other rule). The kernels read the ids tile by tile
beside Q and K (never a [T, S] mask) and skip the blocks no pair of whose ids can match:
before the launch, XLA reduces each block of ids to its (min, max), and a block of rows
keeps only the span of column blocks whose ranges overlap its own. For ids that never
decrease along the sequence (the usual packing) that span is exactly the blocks of the
documents the rows belong to, so the work falls with the documents' length; for any
other ids the span is still a superset of what is needed, and the per-tile id test keeps
the result exact.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxflash._checks import _describe


def check_segment_ids(segment_ids, kv_segment_ids, batch: int, seq_q: int, seq_kv: int):
  """(segment_ids int32 [B, T], kv_segment_ids int32 [B, S]), or (None, None) when neither
  is given. kv_segment_ids defaults to segment_ids when T == S."""
  if segment_ids is None and kv_segment_ids is None:
    return None, None
  if kv_segment_ids is None or segment_ids is None:
    if seq_q != seq_kv:
      given, missing = (("segment_ids", "kv_segment_ids") if kv_segment_ids is None
                        else ("kv_segment_ids", "segment_ids"))
      raise ValueError(f"{given} without {missing} needs as many queries as keys, got T = {seq_q} "
                       f"and S = {seq_kv}; pass both segment_ids [B, T] and kv_segment_ids [B, S]")
    segment_ids = kv_segment_ids if segment_ids is None else segment_ids
    kv_segment_ids = segment_ids
  return (_check_ids("segment_ids", segment_ids, (batch, seq_q), "[B, T]"),
          _check_ids("kv_segment_ids", kv_segment_ids, (batch, seq_kv), "[B, S]"))


def _check_ids(name: str, ids, shape: tuple[int, int], axes: str):
  if not hasattr(ids, "dtype"):
    ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array of shape {axes} = {shape}, got {_describe(ids)}")
  if tuple(ids.shape) != shape:
    raise ValueError(f"{name} must have shape {axes} = {shape}, got {_describe(ids)}")
  return ids.astype(jnp.int32)


def same_segment(segment_ids, kv_segment_ids):
  """[B, T] and [B, S] ids -> [B, T, S] bool, True where query and key share a document
  (for the references and explicit-mask comparisons; the kernels never build it)."""
  return segment_ids[:, :, None] == kv_segment_ids[:, None, :]


def _block_ranges(ids, block: int):
  """ids [B, L] -> (min, max) int32 [B, ceil(L / block)] of each block of `block` ids."""
  batch, length = ids.shape
  num_blocks = -(-length // block)
  pad = num_blocks * block - length
  info = jnp.iinfo(jnp.int32)
  # Padding ids never widen a block's range: +max for the min, -max for the max.
  low = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=info.max).reshape(batch, num_blocks, block)
  high = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=info.min).reshape(batch, num_blocks, block)
  return jnp.min(low, axis=-1), jnp.max(high, axis=-1)


def block_spans(row_ids, col_ids, block_rows: int, block_cols: int):
  """row_ids [B, R], col_ids [B, C] -> int32 [B, ceil(R / block_rows), 2]: for each block of
  rows, the half-open span [first, end) of column blocks whose id range overlaps the rows'
  (first = end = 0 where none does). Every column block outside the span has no id in
  common with the rows, so a kernel may leave it out of its loop bounds."""
  row_lo, row_hi = _block_ranges(row_ids, block_rows)  # [B, Rb]
  col_lo, col_hi = _block_ranges(col_ids, block_cols)  # [B, Cb]
  meets = ((row_lo[:, :, None] <= col_hi[:, None, :])
           & (col_lo[:, None, :] <= row_hi[:, :, None]))  # [B, Rb, Cb]
  num_cols = meets.shape[-1]
  index = lax.broadcasted_iota(jnp.int32, meets.shape, 2)
  first = jnp.min(jnp.where(meets, index, num_cols), axis=-1)
  end = jnp.max(jnp.where(meets, index + 1, 0), axis=-1)
  first = jnp.where(end > 0, first, 0)
  return jnp.stack([first, end], axis=-1).astype(jnp.int32)


def clamp_bounds(bounds, span_ref):
  """Loop bounds (lo, full_lo, full_hi, hi) cut to a block span ref [2] (`block_spans`),
  keeping lo <= full_lo <= full_hi <= hi (an empty span leaves every loop empty)."""
  lo, full_lo, full_hi, hi = bounds
  first, end = span_ref[0], span_ref[1]
  lo = jnp.maximum(lo, first)
  hi = jnp.maximum(lo, jnp.minimum(hi, end))
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def count_blocks(segment_ids, kv_segment_ids, block_q: int, block_k: int) -> int:
  """Key blocks the segment spans let the kernels visit, summed over query blocks and
  sequences (no causal mask or window): the work the segments leave."""
  spans = block_spans(segment_ids, kv_segment_ids, block_q, block_k)
  return int(jnp.sum(spans[..., 1] - spans[..., 0]))
