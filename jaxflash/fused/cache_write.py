"""Writing one new token per sequence into a KV cache, keys and values in one kernel.

A decode step adds each sequence's new key and value to the cache before attention reads
it. XLA lowers that scatter (one row per sequence, some rows dropped) to a select that
reads back the old row and a dynamic-update-slice, per tensor: four kernels a layer, each a
microsecond or more of launch for a few hundred bytes. Here one program per sequence
stores its [K, H] key and value rows in place (the caches are aliased to the outputs, so
under jit with the caches donated nothing is copied), contiguous or through the block
table of a page pool.
"""
from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp

from jaxflash import _checks, configs
from jaxflash._triton import load, mask2d, pl, quiet, store, use_interpret
from jaxflash._util import next_power_of_2
from jaxflash.paged import paged_kv_write
from jaxflash.quantize import check_scales, quantize_kv


def _write_kernel(positions_ref, *refs, paged: bool, capacity: int, page_size: int,
                  kv_heads: int, head_dim: int):
  """Program b: k_new[b], v_new[b] [K, H] -> row positions[b] of sequence b's cache.

  refs: (block_table [B, max_pages] if paged), k_new, v_new [B, K, H], keys, values (the
  caches as rows [R, K, H]: inputs aliased to the outputs and not read), keys_out, values_out.
  """
  if paged:
    table_ref, k_new_ref, v_new_ref, _, _, k_out_ref, v_out_ref = refs
  else:
    table_ref, (k_new_ref, v_new_ref, _, _, k_out_ref, v_out_ref) = None, refs
  b = pl.program_id(0)
  row, valid = cache_rows(positions_ref, table_ref if paged else None, b, capacity=capacity,
                          page_size=page_size)
  heads_p, dim_p = next_power_of_2(kv_heads), configs.padded_head_dim(head_dim)
  heads, dims = pl.ds(0, heads_p), pl.ds(0, dim_p)
  in_range = mask2d(jnp.arange(heads_p) < kv_heads, jnp.arange(dim_p) < head_dim, (heads_p, dim_p))
  for new_ref, out_ref in ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref)):
    new = load(new_ref.at[b, heads, dims], mask=in_range, other=0)
    store(out_ref.at[row, heads, dims], new.astype(out_ref.dtype), mask=in_range & valid)


def check_cache_target(keys, values, new_shape: tuple, batch: int, positions, block_table,
                       quantized: bool = False):
  """Checks a one-token-per-sequence write of [K, H] rows (`new_shape`) for `batch`
  sequences into keys/values (contiguous [B, S, K, H] or pools [P, page, K, H] with
  block_table [B, max_pages]; `quantized`: caches whose scales check_scales checked);
  returns (positions, block_table) as int32."""
  for name, x in (("keys", keys), ("values", values)):
    if not quantized:
      _checks.check_float(name, x)
  if keys.ndim != 4 or keys.shape != values.shape:
    raise ValueError(f"keys and values must be [B, S, K, H] caches or [P, page, K, H] pools of one "
                     f"shape, got keys {tuple(keys.shape)} and values {tuple(values.shape)}")
  if tuple(new_shape) != tuple(keys.shape[2:]):
    raise ValueError(f"the new keys and values are [B, K, H] with B={batch}, [K, H] = "
                     f"{tuple(new_shape)}, but the caches hold [K, H] = {tuple(keys.shape[2:])} "
                     f"(keys {tuple(keys.shape)})")
  positions = _checks.check_lengths("positions", positions, batch)
  if positions is None:
    raise ValueError(f"positions [B] = ({batch},) are needed with a cache to write to")
  if block_table is not None:
    block_table = _checks.check_block_table(block_table, batch)
    _checks.check_page_size(keys.shape[1])
  elif keys.shape[0] != batch:
    raise ValueError(f"a contiguous cache holds one row per sequence: keys {tuple(keys.shape)} "
                     f"for {batch} new tokens")
  return positions, block_table


def cache_rows(positions_ref, table_ref, batch_rows, *, capacity: int, page_size: int):
  """Where token positions[b] of sequence b goes in the cache viewed as rows [R, K, H]
  (contiguous [B, S, K, H] -> [B * S, K, H]; a pool [P, page, K, H] -> [P * page, K, H]).

  batch_rows: sequence indices b (a scalar, or an int32 vector of them); returns
  (row, ok) of its shape: `ok` is False for a write that is dropped (a negative position,
  one past the cache or the table, a table entry outside the pool); `row` is then clamped.
  """
  pos = load(positions_ref.at[batch_rows])
  if table_ref is None:  # capacity = S
    ok = (pos >= 0) & (pos < capacity)
    return batch_rows * capacity + jnp.clip(pos, 0, capacity - 1), ok
  max_pages = table_ref.shape[1]  # capacity = pages in the pool
  logical = pos // page_size
  ok = (pos >= 0) & (logical < max_pages)
  page = load(table_ref.at[batch_rows, jnp.clip(logical, 0, max_pages - 1)])
  ok &= (page >= 0) & (page < capacity)
  return jnp.clip(page, 0, capacity - 1) * page_size + pos % page_size, ok


@functools.partial(jax.jit, static_argnames=("interpret",))
@typing.overload
def kv_cache_write(keys: jax.Array, values: jax.Array, k_new: jax.Array, v_new: jax.Array,
                   positions: jax.Array, *, block_table: jax.Array | None = None,
                   interpret: bool | None = None, k_scale: None = None,
                   v_scale: None = None) -> tuple[jax.Array, jax.Array]: ...
@typing.overload
def kv_cache_write(keys: jax.Array, values: jax.Array, k_new: jax.Array, v_new: jax.Array,
                   positions: jax.Array, *, block_table: jax.Array | None = None,
                   interpret: bool | None = None, k_scale: jax.Array,
                   v_scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]: ...
def kv_cache_write(keys: jax.Array, values: jax.Array, k_new: jax.Array, v_new: jax.Array,
                   positions: jax.Array, *, block_table: jax.Array | None = None,
                   interpret: bool | None = None, k_scale: jax.Array | None = None,
                   v_scale: jax.Array | None = None) -> tuple[jax.Array, ...]:
  """Stores one token per sequence: k_new, v_new [B, K, H] at token position positions[b].

  keys/values: contiguous caches [B, S, K, H], or page pools [P, page, K, H] with
  block_table [B, max_pages] int32 (position p of sequence b is slot p % page of pool page
  block_table[b, p // page]). A negative position, one past the cache or the table, or a
  table entry outside [0, P) writes nothing (so a finished sequence can pass -1). Returns
  the updated (keys, values); with them donated under jit the write is in place.
  interpret: Pallas interpret mode (default: when no GPU).

  Quantized caches (int8 or float8_e4m3fn) come with their scale caches k_scale, v_scale
  (the caches' shape without H, float32): the new rows are quantized on the way in
  (`jaxflash.quantize_kv`; the kernel stores them, a scatter the few scales) and
  (keys, values, k_scale, v_scale) come back.
  """
  quantized = check_scales(keys, values, k_scale, v_scale, key_name="keys", value_name="values")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    _checks.check_float(name, x)
  if k_new.shape != v_new.shape or k_new.ndim != 3:
    raise ValueError(f"k_new and v_new must be [B, K, H] of one shape, got k_new {tuple(k_new.shape)} "
                     f"and v_new {tuple(v_new.shape)}")
  batch = k_new.shape[0]
  positions, block_table = check_cache_target(keys, values, k_new.shape[1:], batch, positions, block_table,
                                              quantized)
  if quantized:
    k_new, k_new_scale = quantize_kv(k_new, keys.dtype)
    v_new, v_new_scale = quantize_kv(v_new, values.dtype)
    keys, values = _store(keys, values, k_new, v_new, positions, block_table, interpret=interpret)
    # The scales: [K] floats a row, a scatter (the same writes and drops, one value per head).
    k_scale, v_scale = kv_cache_write_reference(k_scale[..., None], v_scale[..., None],
                                                k_new_scale[..., None], v_new_scale[..., None], positions,
                                                block_table=block_table)
    return keys, values, k_scale[..., 0], v_scale[..., 0]
  return _store(keys, values, k_new, v_new, positions, block_table, interpret=interpret)


def _store(keys, values, k_new, v_new, positions, block_table, *, interpret):
  """The write kernel over checked arguments (k_new, v_new already in the caches' dtype if quantized)."""
  batch = k_new.shape[0]
  paged = block_table is not None
  kv_heads, head_dim = keys.shape[2:]
  if batch == 0:
    return keys, values
  kernel = functools.partial(_write_kernel, paged=paged, capacity=keys.shape[0 if paged else 1],
                             page_size=keys.shape[1], kv_heads=kv_heads, head_dim=head_dim)
  rows = keys.reshape(-1, kv_heads, head_dim), values.reshape(-1, kv_heads, head_dim)  # bitcasts
  operands = (positions, *((block_table,) if paged else ()), k_new, v_new, *rows)
  first_cache = len(operands) - 2
  with quiet():
    keys_out, values_out = pl.pallas_call(
        kernel,
        grid=(batch,),
        out_shape=(jax.ShapeDtypeStruct(rows[0].shape, keys.dtype),
                   jax.ShapeDtypeStruct(rows[1].shape, values.dtype)),
        input_output_aliases={first_cache: 0, first_cache + 1: 1},
        interpret=use_interpret(interpret),
        name="jaxflash_kv_cache_write",
    )(*operands)
  return keys_out.reshape(keys.shape), values_out.reshape(values.shape)


def kv_cache_write_reference(keys, values, k_new, v_new, positions, *, block_table=None):
  """The same write as an XLA scatter, for checking."""
  k_new, v_new = k_new.astype(keys.dtype), v_new.astype(values.dtype)
  if block_table is not None:  # paged_kv_write drops the same tokens
    return paged_kv_write(keys, values, block_table, positions, k_new[:, None], v_new[:, None])
  capacity = keys.shape[1]
  rows = jnp.arange(k_new.shape[0])
  in_cache = (positions >= 0) & (positions < capacity)
  slots = jnp.where(in_cache, positions, capacity)  # past the end: dropped by mode="drop"
  return (keys.at[rows, slots].set(k_new, mode="drop"), values.at[rows, slots].set(v_new, mode="drop"))
