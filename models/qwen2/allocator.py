"""A host-side page allocator for the paged KV cache: a free list of page indices, with
reference counts so that sequences can share pages (a common prefix), and pages kept for
a prefix cache that are reclaimed least recently used first when the free list runs dry."""
from __future__ import annotations

import collections
import math
from typing import Callable, Sequence

import numpy as np


class OutOfPagesError(RuntimeError):
  """The page pool has no free page left for a growing sequence."""


class PageAllocator:
  """Hands out pages of a pool of `num_pages` as sequences grow and takes them back when
  they finish. It also keeps the host copy of the block table [batch, max_pages] int32
  (unassigned entries are 0: the kernels never read past a sequence's length).

  Each page has a reference count (the rows holding it). A page marked with `keep` (it
  holds a prefix cache's tokens) is not freed when its count drops to 0: it becomes idle,
  still mappable by `share`, and is reclaimed, least recently idle first, only when the
  free list is empty; `on_evict(page)` is then called so the cache forgets it.
  """

  def __init__(self, num_pages: int, page_size: int, batch: int, max_pages: int):
    self.num_pages = num_pages
    self.page_size = page_size
    # Pop from the end: pages are handed out in ascending order.
    self._free = list(range(num_pages - 1, -1, -1))
    self.block_table = np.zeros((batch, max_pages), np.int32)
    self.pages_held = np.zeros((batch,), np.int32)
    self.refcount = np.zeros((num_pages,), np.int32)
    self._kept: set[int] = set()
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
    self.on_evict: Callable[[int], None] | None = None
    self.pages_dropped = np.zeros((batch,), np.int32)  # leading pages given back (`release_before`)
    self.changed = True  # the device copy of the block table is stale
    self.changed_rows: set[int] = set()  # rows changed since the engine last copied them

  @property
  def free_pages(self) -> int:
    """Pages on the free list (idle kept pages not counted)."""
    return len(self._free)

  @property
  def available_pages(self) -> int:
    """Pages a sequence could get now: free ones plus idle kept ones (reclaimable)."""
    return len(self._free) + len(self._idle)

  def is_idle(self, page: int) -> bool:
    return page in self._idle

  def _take(self) -> int:
    if self._free:
      page = self._free.pop()
    elif self._idle:
      page, _ = self._idle.popitem(last=False)
      self._kept.discard(page)
      if self.on_evict is not None:
        self.on_evict(page)
    else:
      raise OutOfPagesError(f"the page pool ({self.num_pages} pages of {self.page_size} tokens) "
                            f"is exhausted; pass a larger num_pages")
    self.refcount[page] = 1
    return page

  def _drop(self, page: int) -> None:
    self.refcount[page] -= 1
    if self.refcount[page] == 0:
      if page in self._kept:
        self._idle[page] = None  # most recently used: evicted last
      else:
        self._free.append(page)

  def reserve(self, row: int, num_tokens: int) -> None:
    """Makes sure sequence `row` owns enough pages for `num_tokens` tokens."""
    need = math.ceil(num_tokens / self.page_size)
    if need > self.block_table.shape[1]:
      raise ValueError(f"sequence {row} needs {need} pages, over the block table's "
                       f"{self.block_table.shape[1]}")
    while self.pages_held[row] < need:
      self.block_table[row, self.pages_held[row]] = self._take()
      self.pages_held[row] += 1
      self.changed = True
      self.changed_rows.add(row)

  def share(self, row: int, pages: Sequence[int]) -> None:
    """Maps `pages` (held by other rows, or idle kept pages) as the first pages of sequence
    `row`, which must hold none yet; each gains a reference."""
    if self.pages_held[row]:
      raise ValueError(f"sequence {row} already holds {self.pages_held[row]} pages")
    if len(pages) > self.block_table.shape[1]:
      raise ValueError(f"{len(pages)} pages are over the block table's {self.block_table.shape[1]}")
    for j, page in enumerate(pages):
      if self.refcount[page] == 0 and page not in self._idle:
        raise ValueError(f"page {page} is free: only held or kept pages can be shared")
      self._idle.pop(page, None)
      self.refcount[page] += 1
      self.block_table[row, j] = page
    self.pages_held[row] = len(pages)
    self.changed = True
    self.changed_rows.add(row)

  def keep(self, page: int) -> None:
    """Marks a held page as a prefix cache's: when its last holder lets go, it goes idle
    instead of free."""
    self._kept.add(page)

  def release_before(self, row: int, num_tokens: int) -> None:
    """Drops sequence `row`'s reference to its pages that lie wholly before token
    `num_tokens` (a sliding window has passed them). Their block-table entries stay as they
    are, pointing at pages that may be handed out again: the decode kernels never read the
    entries of pages wholly before the window."""
    end = min(max(num_tokens, 0) // self.page_size, int(self.pages_held[row]))
    start = int(self.pages_dropped[row])
    if end > start:
      for page in self.block_table[row, start:end][::-1]:
        self._drop(int(page))
      self.pages_dropped[row] = end

  def release(self, row: int) -> None:
    """Drops sequence `row`'s reference to each page it still holds (freed, or idle if
    kept)."""
    held, dropped = int(self.pages_held[row]), int(self.pages_dropped[row])
    for page in self.block_table[row, dropped:held][::-1]:
      self._drop(int(page))
    self.block_table[row, :] = 0
    self.pages_held[row] = 0
    self.pages_dropped[row] = 0
    self.changed = True
    self.changed_rows.add(row)
