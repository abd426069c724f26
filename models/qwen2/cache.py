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

`kv_dtype` "int8" or "float8_e4m3fn" makes a quantized cache: keys and values in one byte
with one float32 scale per token and KV head beside them (`jaxflash.quantize_kv`; quantized
as they are written, dequantized inside the attention kernels), about half of bf16's bytes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

import jaxflash
from jaxflash.quantize import is_quantized
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
  k_scale: jax.Array | None = None  # a quantized cache's scales: keys' shape without H, float32
  v_scale: jax.Array | None = None

  @property
  def paged(self) -> bool:
    return self.block_table is not None

  @property
  def scales(self) -> dict:
    """The attention kernels' k_scale/v_scale arguments: empty for a float cache."""
    return {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)

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
      written = jaxflash.kv_cache_write(self.keys, self.values, k_new[:, 0], v_new[:, 0],
                                        self.token_positions(new_lengths),
                                        block_table=self.block_table, **self.scales)
      return self._replace(*written)
    if self.paged:
      if not self.scales:
        k_new, v_new = k_new.astype(self.keys.dtype), v_new.astype(self.values.dtype)
      return self._replace(*jaxflash.paged_kv_write(self.keys, self.values, self.block_table, self.lengths,
                                                    k_new, v_new, new_lengths, **self.scales))
    batch, steps = k_new.shape[:2]
    offsets = jnp.arange(steps, dtype=jnp.int32)[None, :]  # [1, T]
    positions = self.lengths[:, None] + offsets  # [B, T]
    capacity = self.keys.shape[1]
    # An out-of-range index with mode="drop" skips the write: padding never lands.
    positions = jnp.where(offsets < new_lengths[:, None], positions, capacity)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]  # [B, 1]
    if not self.scales:
      return self._replace(self.keys.at[rows, positions].set(k_new.astype(self.keys.dtype), mode="drop"),
                           self.values.at[rows, positions].set(v_new.astype(self.values.dtype), mode="drop"))
    (k_q, k_scale), (v_q, v_scale) = (jaxflash.quantize_kv(x, self.keys.dtype) for x in (k_new, v_new))
    return self._replace(*(cache.at[rows, positions].set(new, mode="drop") for cache, new in
                           ((self.keys, k_q), (self.values, v_q), (self.k_scale, k_scale),
                            (self.v_scale, v_scale))))

  def _replace(self, keys, values, k_scale=None, v_scale=None) -> LayerKV:
    """This layer with new keys/values (and scales, for a quantized cache)."""
    return dataclasses.replace(self, keys=keys, values=values, k_scale=k_scale, v_scale=v_scale)


def cache_dtype(dtype, kv_dtype):
  """The cache's element dtype: kv_dtype ("int8", "float8_e4m3fn" or None: the model's `dtype`)."""
  if kv_dtype is None:
    return jnp.dtype(dtype)
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"kv_dtype must be one of {KV_DTYPES} or None, got {kv_dtype!r}")
  return jnp.dtype(kv_dtype)


def _zeros(shape, dtype, device, layers):
  """Per-layer zero buffers of `shape` (and for a quantized dtype their zero scales,
  `shape` without H; else None) -> (buffers, scales)."""
  buffers = tuple(jnp.zeros(shape, dtype, device=device) for _ in layers)
  if not is_quantized(dtype):
    return buffers, None
  if device is not None:  # the buffers' NamedSharding without the head-dim axis
    device = jax.sharding.NamedSharding(device.mesh, jax.sharding.PartitionSpec(*device.spec[:len(shape) - 1]))
  return buffers, tuple(jnp.zeros(shape[:-1], jnp.float32, device=device) for _ in layers)


def _layer_scales(scales, index):
  return None if scales is None else scales[index]


def _collect_scales(layers, name):
  first = getattr(layers[0], name)
  return None if first is None else tuple(getattr(l, name) for l in layers)


KV_DTYPES = ("int8", "float8_e4m3fn")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousCache:
  """Per-layer keys/values [B, S, K, H] and lengths [B] int32."""

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  lengths: jax.Array
  k_scales: tuple[jax.Array, ...] | None = None  # [B, S, K] float32 per layer: a quantized cache
  v_scales: tuple[jax.Array, ...] | None = None

  @classmethod
  def create(cls, config: Qwen2Config, batch: int, capacity: int, dtype, *,
             sharding=None, kv_dtype: str | None = None) -> ContiguousCache:
    """Zeros; `sharding` (a model's `tensor_parallel`, or None) splits them as the model's
    heads are split (models/qwen2/parallel.py). kv_dtype: "int8" / "float8_e4m3fn" for a
    quantized cache (None: `dtype`)."""
    shape = (batch, capacity, config.num_key_value_heads, config.head_dim)
    layers = range(config.num_hidden_layers)
    kv_device = None if sharding is None else sharding.contiguous_kv(batch)
    row_device = None if sharding is None else sharding.per_sequence(1, batch)
    dtype = cache_dtype(dtype, kv_dtype)
    keys, k_scales = _zeros(shape, dtype, kv_device, layers)
    values, v_scales = _zeros(shape, dtype, kv_device, layers)
    return cls(keys=keys, values=values, lengths=jnp.zeros((batch,), jnp.int32, device=row_device),
               k_scales=k_scales, v_scales=v_scales)

  @property
  def capacity(self) -> int:
    return self.keys[0].shape[1]

  @property
  def dtype(self):
    return self.keys[0].dtype

  def layer(self, index: int) -> LayerKV:
    """Layer `index`'s view."""
    return LayerKV(self.keys[index], self.values[index], self.lengths,
                   k_scale=_layer_scales(self.k_scales, index), v_scale=_layer_scales(self.v_scales, index))

  def update(self, layers: list[LayerKV], new_lengths: jax.Array) -> ContiguousCache:
    """The cache with each layer's written keys/values and new_lengths [B] more tokens a row."""
    return ContiguousCache(keys=tuple(l.keys for l in layers), values=tuple(l.values for l in layers),
                           lengths=self.lengths + new_lengths, k_scales=_collect_scales(layers, "k_scale"),
                           v_scales=_collect_scales(layers, "v_scale"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
  """Per-layer page pools [P, page, K, H], block_table [B, max_pages] int32, lengths [B]."""

  key_pages: tuple[jax.Array, ...]
  value_pages: tuple[jax.Array, ...]
  block_table: jax.Array
  lengths: jax.Array
  k_scales: tuple[jax.Array, ...] | None = None  # [P, page, K] float32 per layer: a quantized pool
  v_scales: tuple[jax.Array, ...] | None = None

  @classmethod
  def create(cls, config: Qwen2Config, batch: int, capacity: int, dtype, *, page_size: int = 16,
             num_pages: int | None = None, sharding=None, kv_dtype: str | None = None) -> PagedCache:
    """A pool of `num_pages` pages (default: enough for every sequence at `capacity`)
    and an all-zero block table of ceil(capacity / page_size) entries per sequence.
    `sharding`: as for `ContiguousCache.create` (pools split over KV heads only).
    kv_dtype: "int8" / "float8_e4m3fn" for a quantized pool (None: `dtype`)."""
    max_pages = math.ceil(capacity / page_size)
    num_pages = batch * max_pages if num_pages is None else num_pages
    shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
    layers = range(config.num_hidden_layers)
    pool_device = None if sharding is None else sharding.kv_pages()
    table_device = None if sharding is None else sharding.per_sequence(2, batch)
    row_device = None if sharding is None else sharding.per_sequence(1, batch)
    dtype = cache_dtype(dtype, kv_dtype)
    key_pages, k_scales = _zeros(shape, dtype, pool_device, layers)
    value_pages, v_scales = _zeros(shape, dtype, pool_device, layers)
    return cls(key_pages=key_pages, value_pages=value_pages,
               block_table=jnp.zeros((batch, max_pages), jnp.int32, device=table_device),
               lengths=jnp.zeros((batch,), jnp.int32, device=row_device), k_scales=k_scales,
               v_scales=v_scales)

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
    return LayerKV(self.key_pages[index], self.value_pages[index], self.lengths, self.block_table,
                   k_scale=_layer_scales(self.k_scales, index), v_scale=_layer_scales(self.v_scales, index))

  def update(self, layers: list[LayerKV], new_lengths: jax.Array) -> PagedCache:
    """The cache with each layer's written pages and new_lengths [B] more tokens a row."""
    return PagedCache(key_pages=tuple(l.keys for l in layers),
                      value_pages=tuple(l.values for l in layers),
                      block_table=self.block_table, lengths=self.lengths + new_lengths,
                      k_scales=_collect_scales(layers, "k_scale"),
                      v_scales=_collect_scales(layers, "v_scale"))

  @property
  def tokens(self) -> int:
    """Tokens the pool holds: pages times page size."""
    return self.num_pages * self.page_size

  @property
  def nbytes(self) -> int:
    """Bytes of the pools over every layer, scales included."""
    return sum(x.nbytes for x in (*self.key_pages, *self.value_pages, *(self.k_scales or ()),
                                  *(self.v_scales or ())))


KVCache = ContiguousCache | PagedCache
