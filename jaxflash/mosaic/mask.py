"""Which keys a query row of the Mosaic prefill sees, inside a key block that straddles an
edge: the end of the sequence's keys, the causal diagonal or a window's edges. Blocks that
every row sees whole skip this; blocks no row sees are never loaded (pipeline.KeyBlocks)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxflash._mosaic import plgpu
from jaxflash.score_mods import ScoreMods


def iota(shape, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


@dataclasses.dataclass(frozen=True)
class KeyMask:
  mods: ScoreMods
  block_q: int
  block_kv: int

  def apply(self, s, j, q_base, shift, kv_valid):
    """Scores s [block_q, block_kv] of key block j for rows q_base + r -> -inf where the row
    does not see the key. Key s is visible to row r (at position p = q_base + r + shift) when
    s < kv_valid and p - left <= s <= p + right: one or two compares per score."""
    shape = (self.block_q, self.block_kv)
    keys = iota(shape, 1) + j * self.block_kv
    rows = iota(shape, 0)
    if self.mods.right is None:
      visible = keys < kv_valid
    else:
      visible = keys <= jnp.minimum(rows + (q_base + shift + self.mods.right), kv_valid - 1)
    if self.mods.left is not None:
      visible &= keys >= rows + (q_base + shift - self.mods.left)
    return jnp.where(visible, s, -jnp.inf)
