"""Which keys a query row of the Mosaic prefill sees, inside a key block that straddles an
edge: the end of the sequence's keys, the causal diagonal, a window's edges or a document's. Blocks that
every row sees whole skip this; blocks no row sees are never loaded (pipeline.KeyBlocks)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jaxflash._mosaic import plgpu
from jaxflash.mosaic.segments import Segments
from jaxflash.score_mods import ScoreMods


def iota(shape, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


@dataclasses.dataclass(frozen=True)
class KeyMask:
  mods: ScoreMods
  block_q: int
  block_kv: int
  segments: Segments | None = None

  def apply(self, s, j, q_base, shift, kv_valid, batch=None, row_ids=None):
    """Scores s [block_q, block_kv] of key block j for rows q_base + r -> -inf where the row
    does not see the key. Key s is visible to row r (at position p = q_base + r + shift) when
    s < kv_valid and p - left <= s <= p + right: one or two compares per score, and with
    segments, when the row's id (row_ids [block_q], of sequence `batch`) is the key's."""
    shape = (self.block_q, self.block_kv)
    keys = iota(shape, 1) + j * self.block_kv
    rows = iota(shape, 0)
    if self.mods.right is None:
      visible = keys < kv_valid
    else:
      visible = keys <= jnp.minimum(rows + (q_base + shift + self.mods.right), kv_valid - 1)
    if self.mods.left is not None:
      visible &= keys >= rows + (q_base + shift - self.mods.left)
    if self.segments is not None:
      key_ids = self.segments.key_ids(batch, j)
      visible &= (lax.broadcast_in_dim(row_ids, shape, [0])
                  == lax.broadcast_in_dim(key_ids, shape, [1]))
    return jnp.where(visible, s, -jnp.inf)
