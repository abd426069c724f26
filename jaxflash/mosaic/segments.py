"""Packed documents (segment ids) in the Mosaic prefill: query t sees key s only where
segment_ids[b, t] == kv_segment_ids[b, s], on top of the causal mask, window and lengths.

The ids are read per tile: each consumer loads its rows' ids once per query tile and the
ids of each key block it masks, never a [T, S] array. Key blocks whose ids cannot meet a
query row block's are skipped as loop bounds: outside the kernel, one reshape and min / max
per block give each block's id range, and for each row block the first and last key block
whose range meets its own, and the first run of key blocks that carry the row block's one
id alone (there every comparison is true, so they run unmasked). For ids non-decreasing
along the sequence (the usual packing) that leaves only the blocks of the row block's own
documents; any other ids stay correct, since every block the bounds keep and that is not
such a run is masked element by element.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jaxflash import _checks
from jaxflash._mosaic import pl, plgpu

NUM_RANGES = 4  # per query row block: key blocks (lo, hi) that may meet, (full_lo, full_hi) uniform


def check_segment_ids(segment_ids, kv_segment_ids, batch: int, seq_q: int, seq_kv: int):
  """-> (segment_ids [B, T] int32, kv_segment_ids [B, S] int32), or (None, None) without
  segments. kv_segment_ids defaults to segment_ids when T == S."""
  if segment_ids is None:
    if kv_segment_ids is not None:
      raise ValueError(f"kv_segment_ids {_checks._describe(kv_segment_ids)} needs segment_ids "
                       f"(the queries' ids) too")
    return None, None
  if kv_segment_ids is None:
    if seq_q != seq_kv:
      raise ValueError(f"kv_segment_ids is needed when the query and key lengths differ "
                       f"(T={seq_q}, S={seq_kv}); segment_ids is {_checks._describe(segment_ids)}")
    kv_segment_ids = segment_ids
  ids = []
  for name, x, length in (("segment_ids", segment_ids, seq_q), ("kv_segment_ids", kv_segment_ids, seq_kv)):
    if not hasattr(x, "dtype"):
      x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array of shape ({batch}, {length}), got "
                      f"{_checks._describe(x)}")
    if tuple(x.shape) != (batch, length):
      raise ValueError(f"{name} must have shape ({batch}, {length}), got {_checks._describe(x)}")
    ids.append(x.astype(jnp.int32))
  return tuple(ids)


def pad_ids(ids, length: int):
  """ids [B, n] -> [B, length], the last id repeated: padding widens no block's id range
  (padded rows are sliced off, padded keys are past the lengths and masked)."""
  return ids if ids.shape[1] == length else jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])), mode="edge")


def block_ranges(q_ids, kv_ids, block_q: int, block_kv: int):
  """q_ids [B, T_pad], kv_ids [B, S_pad] int32 -> [B, T_pad // block_q, 4] int32: per query
  row block, the key blocks [lo, hi) whose id ranges meet its own, and [full_lo, full_hi),
  the first run of key blocks all of whose ids equal the row block's one id (empty when the
  row block holds more than one id)."""
  batch = q_ids.shape[0]
  q_blocks = q_ids.reshape(batch, -1, block_q)  # [B, R, block_q]
  kv_blocks = kv_ids.reshape(batch, -1, block_kv)  # [B, J, block_kv]
  q_min, q_max = q_blocks.min(-1)[:, :, None], q_blocks.max(-1)[:, :, None]  # [B, R, 1]
  kv_min, kv_max = kv_blocks.min(-1)[:, None, :], kv_blocks.max(-1)[:, None, :]  # [B, 1, J]
  num_kv_blocks = kv_blocks.shape[1]
  j = jnp.arange(num_kv_blocks, dtype=jnp.int32)
  meets = (kv_min <= q_max) & (kv_max >= q_min)  # [B, R, J]
  lo = jnp.min(jnp.where(meets, j, num_kv_blocks), axis=-1)
  hi = jnp.max(jnp.where(meets, j + 1, 0), axis=-1)
  uniform = (q_min == q_max) & (kv_min == kv_max) & (kv_min == q_min)  # [B, R, J]
  full_lo = jnp.min(jnp.where(uniform, j, num_kv_blocks), axis=-1)
  full_hi = jnp.min(jnp.where(~uniform & (j >= full_lo[..., None]), j, num_kv_blocks), axis=-1)
  return jnp.stack([lo, hi, full_lo, full_hi], axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Segments:
  """The kernel's view of the segment ids."""

  q_ids_ref: object  # [B, T_pad] int32 GMEM
  kv_ids_ref: object  # [B, S_pad] int32 GMEM
  ranges_ref: object  # [B, T_pad // block_q, 4] int32 GMEM: block_ranges
  block_q: int
  block_kv: int

  def bound(self, batch, q_base, blocks):
    """Key blocks (lo, full_lo, full_hi, hi) of rows [q_base, q_base + block_q), narrowed to
    those whose ids may meet the rows' (and run unmasked only where all ids are one)."""
    lo, full_lo, full_hi, hi = blocks
    row_block = lax.div(q_base, self.block_q)
    seg_lo, seg_hi, seg_full_lo, seg_full_hi = (self.ranges_ref[batch, row_block, i]
                                                for i in range(NUM_RANGES))
    lo = jnp.maximum(lo, seg_lo)
    hi = jnp.maximum(jnp.minimum(hi, seg_hi), lo)
    full_lo = jnp.clip(jnp.maximum(full_lo, seg_full_lo), lo, hi)
    full_hi = jnp.clip(jnp.minimum(full_hi, seg_full_hi), full_lo, hi)
    return [lo, full_lo, full_hi, hi]

  def row_ids(self, batch, q_base):
    """The ids of rows [q_base, q_base + block_q): [block_q] int32 in the wgmma row layout."""
    return plgpu.load(self.q_ids_ref.at[batch, pl.ds(q_base, self.block_q)], (),
                      layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

  def key_ids(self, batch, j):
    """The ids of key block j: [block_kv] int32 in the wgmma column layout."""
    return plgpu.load(self.kv_ids_ref.at[batch, pl.ds(j * self.block_kv, self.block_kv)], (),
                      layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
