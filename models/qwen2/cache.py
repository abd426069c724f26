"""KV caches as plain data: pytrees passed into the model and returned by it.

Two layouts, one interface. `ContiguousCache` keeps one [B, S, K, H] buffer per layer for
keys and one for values (S = capacity). `PagedCache` keeps one page pool [P, page, K, H] per
layer and a block table [B, max_pages] int32 that maps a sequence's i-th page of tokens to a
pool page (PagedAttention, "Efficient Memory Management for Large Language Model Serving
with PagedAttention"). `lengths` [B] int32 counts
the tokens already in the cache of each sequence, so the next token of sequence b lands at
position lengths[b].

The model sees one layer at a time through `LayerKV`, which knows how to write new keys
and values and what to hand the attention kernel.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

import jaxflash
from models.qwen2.config import Qwen2Config

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
  """One layer's cache: contiguous buffers [B, S, K, H] (block_table None) or page pools
  [P, page, K, H] with block_table [B, max_pages]; lengths [B] tokens already stored."""

  keys: jax.Array
  values: jax.Array
  lengths: jax.Array
  block_table: jax.Array | None = None

  @property
  def paged(self) -> bool:
    return self.block_table is not None

  def token_positions(self, new_lengths: jax.Array) -> jax.Array:
    """Where a decode step's token of each sequence goes: lengths[b], or -1 (a kernel
    writes nothing there) for rows with no new token (new_lengths[b] == 0)."""
    return jnp.where(new_lengths > 0, self.lengths, -1)

  def write(self, k_new: jax.Array, v_new: jax.Array, new_lengths: jax.Array, *,
            kernel: bool = False) -> LayerKV:
    """Stores k_new, v_new [B, T, K, H] at positions lengths[b] + t for t < new_lengths[b];
    tokens past new_lengths[b] (padding, finished sequences) are dropped. `kernel` (T == 1,
    one device): jaxflash.kv_cache_write, in place, where XLA's scatter takes four kernels."""
    if kernel:
      if k_new.shape[1] != 1:
        raise ValueError(f"the cache-write kernel takes one token a row, got k_new {tuple(k_new.shape)}")
      keys, values = jaxflash.kv_cache_write(self.keys, self.values, k_new[:, 0], v_new[:, 0],
                                             self.token_positions(new_lengths),
                                             block_table=self.block_table)
      return dataclasses.replace(self, keys=keys, values=values)
    if self.paged:
      keys, values = jaxflash.paged_kv_write(self.keys, self.values, self.block_table, self.lengths,
                                             k_new.astype(self.keys.dtype),
                                             v_new.astype(self.values.dtype), new_lengths)
      return dataclasses.replace(self, keys=keys, values=values)
    batch, steps = k_new.shape[:2]
    offsets = jnp.arange(steps, dtype=jnp.int32)[None, :]  # [1, T]
    positions = self.lengths[:, None] + offsets  # [B, T]
    capacity = self.keys.shape[1]
    # An out-of-range index with mode="drop" skips the write: padding never lands.
    positions = jnp.where(offsets < new_lengths[:, None], positions, capacity)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]  # [B, 1]
    keys = self.keys.at[rows, positions].set(k_new.astype(self.keys.dtype), mode="drop")
    values = self.values.at[rows, positions].set(v_new.astype(self.values.dtype), mode="drop")
    return dataclasses.replace(self, keys=keys, values=values)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousCache:
  """Per-layer keys/values [B, S, K, H] and lengths [B] int32."""

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  lengths: jax.Array

  @classmethod
  def create(cls, config: Qwen2Config, batch: int, capacity: int, dtype, *,
             sharding=None) -> ContiguousCache:
    """Zeros; `sharding` (a model's `tensor_parallel`, or None) splits them as the model's
    heads are split (models/qwen2/parallel.py)."""
    shape = (batch, capacity, config.num_key_value_heads, config.head_dim)
    layers = range(config.num_hidden_layers)
    kv_device = None if sharding is None else sharding.contiguous_kv(batch)
    row_device = None if sharding is None else sharding.per_sequence(1, batch)
    return cls(keys=tuple(jnp.zeros(shape, dtype, device=kv_device) for _ in layers),
               values=tuple(jnp.zeros(shape, dtype, device=kv_device) for _ in layers),
               lengths=jnp.zeros((batch,), jnp.int32, device=row_device))

  @property
  def capacity(self) -> int:
    return self.keys[0].shape[1]

  @property
  def dtype(self):
    return self.keys[0].dtype

  def layer(self, index: int) -> LayerKV:
    """Layer `index`'s view."""
    return LayerKV(self.keys[index], self.values[index], self.lengths)

  def update(self, layers: list[LayerKV], new_lengths: jax.Array) -> ContiguousCache:
    """The cache with each layer's written keys/values and new_lengths [B] more tokens a row."""
    return ContiguousCache(keys=tuple(l.keys for l in layers), values=tuple(l.values for l in layers),
                           lengths=self.lengths + new_lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
  """Per-layer page pools [P, page, K, H], block_table [B, max_pages] int32, lengths [B]."""

  key_pages: tuple[jax.Array, ...]
  value_pages: tuple[jax.Array, ...]
  block_table: jax.Array
  lengths: jax.Array

  @classmethod
  def create(cls, config: Qwen2Config, batch: int, capacity: int, dtype, *, page_size: int = 16,
             num_pages: int | None = None, sharding=None) -> PagedCache:
    """A pool of `num_pages` pages (default: enough for every sequence at `capacity`)
    and an all-zero block table of ceil(capacity / page_size) entries per sequence.
    `sharding`: as for `ContiguousCache.create` (pools split over KV heads only)."""
    max_pages = math.ceil(capacity / page_size)
    num_pages = batch * max_pages if num_pages is None else num_pages
    shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
    layers = range(config.num_hidden_layers)
    pool_device = None if sharding is None else sharding.kv_pages()
    table_device = None if sharding is None else sharding.per_sequence(2, batch)
    row_device = None if sharding is None else sharding.per_sequence(1, batch)
    return cls(key_pages=tuple(jnp.zeros(shape, dtype, device=pool_device) for _ in layers),
               value_pages=tuple(jnp.zeros(shape, dtype, device=pool_device) for _ in layers),
               block_table=jnp.zeros((batch, max_pages), jnp.int32, device=table_device),
               lengths=jnp.zeros((batch,), jnp.int32, device=row_device))

  @property
  def page_size(self) -> int:
    return self.key_pages[0].shape[1]

  @property
  def num_pages(self) -> int:
    return self.key_pages[0].shape[0]

  @property
  def capacity(self) -> int:
    return self.block_table.shape[1] * self.page_size

  @property
  def dtype(self):
    return self.key_pages[0].dtype

  def layer(self, index: int) -> LayerKV:
    """Layer `index`'s view."""
    return LayerKV(self.key_pages[index], self.value_pages[index], self.lengths, self.block_table)

  def update(self, layers: list[LayerKV], new_lengths: jax.Array) -> PagedCache:
    """The cache with each layer's written pages and new_lengths [B] more tokens a row."""
    return PagedCache(key_pages=tuple(l.keys for l in layers),
                      value_pages=tuple(l.values for l in layers),
                      block_table=self.block_table, lengths=self.lengths + new_lengths)


KVCache = ContiguousCache | PagedCache
