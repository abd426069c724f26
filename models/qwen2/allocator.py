"""A host-side page allocator for the paged KV cache: a free list of page indices."""
from __future__ import annotations

import math

import numpy as np


class OutOfPagesError(RuntimeError):
  """The page pool has no free page left for a growing sequence."""


class PageAllocator:
  """Hands out pages of a pool of `num_pages` as sequences grow and takes them back when
  they finish. It also keeps the host copy of the block table [batch, max_pages] int32
  (unassigned entries are 0: the kernels never read past a sequence's length)."""

  def __init__(self, num_pages: int, page_size: int, batch: int, max_pages: int):
    self.num_pages = num_pages
    self.page_size = page_size
    # Pop from the end: pages are handed out in ascending order.
    self._free = list(range(num_pages - 1, -1, -1))
    self.block_table = np.zeros((batch, max_pages), np.int32)
    self.pages_held = np.zeros((batch,), np.int32)
    self.pages_dropped = np.zeros((batch,), np.int32)  # leading pages given back (`release_before`)
    self.changed = True  # the device copy of the block table is stale

  @property
  def free_pages(self) -> int:
    return len(self._free)

  def reserve(self, row: int, num_tokens: int) -> None:
    """Makes sure sequence `row` owns enough pages for `num_tokens` tokens."""
    need = math.ceil(num_tokens / self.page_size)
    if need > self.block_table.shape[1]:
      raise ValueError(f"sequence {row} needs {need} pages, over the block table's "
                       f"{self.block_table.shape[1]}")
    while self.pages_held[row] < need:
      if not self._free:
        raise OutOfPagesError(f"the page pool ({self.num_pages} pages of {self.page_size} tokens) "
                              f"is exhausted; pass a larger num_pages")
      self.block_table[row, self.pages_held[row]] = self._free.pop()
      self.pages_held[row] += 1
      self.changed = True

  def release_before(self, row: int, num_tokens: int) -> None:
    """Returns the pages of sequence `row` that lie wholly before token `num_tokens` to the
    free list (a sliding window has passed them). Their block-table entries stay as they
    are, pointing at pages that may be handed out again: the decode kernels never read the
    entries of pages wholly before the window."""
    end = min(max(num_tokens, 0) // self.page_size, int(self.pages_held[row]))
    start = int(self.pages_dropped[row])
    if end > start:
      self._free.extend(int(p) for p in self.block_table[row, start:end][::-1])
      self.pages_dropped[row] = end

  def release(self, row: int) -> None:
    """Returns every page of sequence `row` still held to the free list."""
    held, dropped = int(self.pages_held[row]), int(self.pages_dropped[row])
    self._free.extend(int(p) for p in self.block_table[row, dropped:held][::-1])
    self.block_table[row, :] = 0
    self.pages_held[row] = 0
    self.pages_dropped[row] = 0
    self.changed = True
