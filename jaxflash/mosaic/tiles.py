"""Where the Mosaic prefill's producer finds a key block: the TMA copies that bring the K and
V tiles of block j of one (sequence, KV head) into a ring slot.

* Contiguous caches [B, S, K, H]: one copy each, rows j * block_kv.. of the sequence (V^T
  [B, K, H + 8, S] with the row sums from PV).
* Page pools [P, page, K, H], viewed as rows [P * page, K, H] (a bitcast: read in place), with
  a block table [B, max_pages] ("Efficient Memory Management for Large Language Model Serving
  with PagedAttention"): key s of sequence b sits at row table[b, s // page] * page + s % page.
  Pages of at least block_kv keys hold a whole block: one copy, its first row from one table
  entry. Smaller pages give block_kv / page copies into consecutive row slices of the slot,
  each from its own entry, all completing one "ready" barrier that expects that many arrivals
  (`copies_per_block`). Entries are clamped into the table and the pool, so a bad entry, or
  a block reaching past the table's last page, reads some page of the pool, never memory
  outside it; the keys there are past the sequence's end and masked.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jaxflash._mosaic import pl


def copies_per_block(block_kv: int, page_size: int) -> int:
  """TMA copies a key block takes, per tensor (the arrivals its "ready" barrier expects):
  page_size 0 for a contiguous cache."""
  return block_kv // page_size if 0 < page_size < block_kv else 1


@dataclasses.dataclass(frozen=True)
class KeyTiles:
  k_ref: object  # [B, S_pad, K, H] GMEM, or a pool's rows [P * page, K, H]
  v_ref: object  # as k_ref, or V^T [B, K, H + 8, S_pad] (v_transposed)
  block_kv: int
  v_transposed: bool = False
  table_ref: object = None  # [B, max_pages] int32 GMEM (a pool), or None (caches)
  page_size: int = 0
  num_pages: int = 0

  def copies(self, batch, kv_head, block):
    """[(rows of the slot or None for all, K source, V source)] for key block `block`."""
    first_key = block * self.block_kv
    if self.table_ref is None:
      keys = pl.ds(first_key, self.block_kv)
      v_rows = (batch, kv_head, slice(None), keys) if self.v_transposed else (batch, keys, kv_head)
      return [(None, self.k_ref.at[batch, keys, kv_head], self.v_ref.at[v_rows])]
    shift = self.page_size.bit_length() - 1  # pages are powers of two
    max_pages = self.table_ref.shape[1]

    def pool_row(logical_page):
      entry = self.table_ref[batch, jnp.minimum(logical_page, max_pages - 1)]
      return jnp.clip(entry, 0, self.num_pages - 1) * self.page_size

    first_page = lax.shift_right_logical(first_key, shift)
    if self.page_size >= self.block_kv:
      rows = pl.ds(pool_row(first_page) + (first_key & (self.page_size - 1)), self.block_kv)
      return [(None, self.k_ref.at[rows, kv_head], self.v_ref.at[rows, kv_head])]
    copies = []
    for i in range(copies_per_block(self.block_kv, self.page_size)):
      rows = pl.ds(pool_row(first_page + i), self.page_size)
      copies.append((pl.ds(i * self.page_size, self.page_size),
                     self.k_ref.at[rows, kv_head], self.v_ref.at[rows, kv_head]))
    return copies
