"""Prefix caching: full KV pages found again by the tokens they hold.

A full page of page_size tokens is keyed by a hash of its tokens and of the key of the page
before it (so a key stands for the whole prefix up to the page's end, as in vLLM's automatic
prefix caching). A request whose first pages' keys are cached maps those pages into its
block table instead of recomputing them. Cached pages that no running sequence holds stay
in the pool (idle) until the allocator needs them back, least recently used first.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from models.qwen2.allocator import PageAllocator


def page_keys(tokens: Sequence[int], page_size: int, parent: bytes = b"",
              start: int = 0) -> list[bytes]:
  """Chained keys of the full pages of `tokens` from page `start` on, the key of page
  start - 1 being `parent` (b"" for the first page)."""
  keys = []
  for j in range(start, len(tokens) // page_size):
    chunk = np.asarray(tokens[j * page_size:(j + 1) * page_size], np.int64).tobytes()
    parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
    keys.append(parent)
  return keys


class PrefixCache:
  """key -> page for full pages of computed tokens, on top of a PageAllocator (which keeps
  the pages registered here and tells this cache when it reclaims one)."""

  def __init__(self, allocator: PageAllocator):
    self.allocator = allocator
    self._page_of: dict[bytes, int] = {}
    self._key_of: dict[int, bytes] = {}
    allocator.on_evict = self._evicted

  def __len__(self) -> int:
    return len(self._page_of)

  def lookup(self, keys: Sequence[bytes]) -> list[int]:
    """The pages of the longest run of `keys` (from the first) that is cached."""
    pages = []
    for key in keys:
      page = self._page_of.get(key)
      if page is None:
        break
      pages.append(page)
    return pages

  def insert(self, key: bytes, page: int) -> None:
    """Registers a held page whose tokens are all computed. A key cached already (two
    requests computed the same prefix at once) keeps its first page; the second stays private."""
    if key in self._page_of or page in self._key_of:
      return
    self._page_of[key] = page
    self._key_of[page] = key
    self.allocator.keep(page)

  def _evicted(self, page: int) -> None:
    del self._page_of[self._key_of.pop(page)]
