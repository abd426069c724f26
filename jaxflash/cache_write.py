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

import jax
import jax.numpy as jnp

from jaxflash import _checks, configs
from jaxflash._triton import load, mask2d, pl, quiet, store, use_interpret
from jaxflash.paged import paged_kv_write


def _write_kernel(positions_ref, *refs, paged: bool, capacity: int, page_size: int,
                  kv_heads: int, head_dim: int):
  """Program b: k_new[b], v_new[b] [K, H] -> row positions[b] of sequence b's cache.

  refs: (block_table [B, max_pages] if paged), k_new, v_new [B, K, H], keys, values (the
  inputs, aliased to the outputs and not read), keys_out, values_out.
  """
  if paged:
    table_ref, k_new_ref, v_new_ref, _, _, k_out_ref, v_out_ref = refs
  else:
    k_new_ref, v_new_ref, _, _, k_out_ref, v_out_ref = refs
  b = pl.program_id(0)
  pos = load(positions_ref.at[b])
  if paged:
    max_pages = table_ref.shape[1]
    logical = pos // page_size
    valid = (pos >= 0) & (logical < max_pages)
    page = load(table_ref.at[b, jnp.clip(logical, 0, max_pages - 1)])
    valid &= (page >= 0) & (page < capacity)
    index = (jnp.clip(page, 0, capacity - 1), pos % page_size)
  else:
    valid = (pos >= 0) & (pos < capacity)
    index = (b, jnp.clip(pos, 0, capacity - 1))
  heads_p, dim_p = pl.next_power_of_2(kv_heads), configs.padded_head_dim(head_dim)
  heads, dims = pl.ds(0, heads_p), pl.ds(0, dim_p)
  in_range = mask2d(jnp.arange(heads_p) < kv_heads, jnp.arange(dim_p) < head_dim, (heads_p, dim_p))
  for new_ref, out_ref in ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref)):
    row = load(new_ref.at[b, heads, dims], mask=in_range, other=0.0)
    store(out_ref.at[(*index, heads, dims)], row.astype(out_ref.dtype), mask=in_range & valid)


@functools.partial(jax.jit, static_argnames=("interpret",))
def kv_cache_write(keys, values, k_new, v_new, positions, *, block_table=None,
                   interpret: bool | None = None):
  """Stores one token per sequence: k_new, v_new [B, K, H] at token position positions[b].

  keys/values: contiguous caches [B, S, K, H], or page pools [P, page, K, H] with
  block_table [B, max_pages] int32 (position p of sequence b is slot p % page of pool page
  block_table[b, p // page]). A negative position, one past the cache or the table, or a
  table entry outside [0, P) writes nothing (so a finished sequence can pass -1). Returns
  the updated (keys, values); with them donated under jit the write is in place.
  interpret: Pallas interpret mode (default: when no GPU).
  """
  for name, x in (("keys", keys), ("values", values), ("k_new", k_new), ("v_new", v_new)):
    _checks.check_float(name, x)
  if keys.ndim != 4 or keys.shape != values.shape:
    raise ValueError(f"keys and values must be [B, S, K, H] caches or [P, page, K, H] pools of one "
                     f"shape, got keys {tuple(keys.shape)} and values {tuple(values.shape)}")
  kv_heads, head_dim = keys.shape[2:]
  if k_new.shape != v_new.shape or k_new.ndim != 3 or k_new.shape[1:] != (kv_heads, head_dim):
    raise ValueError(f"k_new and v_new must be [B, K={kv_heads}, H={head_dim}], got k_new "
                     f"{tuple(k_new.shape)} and v_new {tuple(v_new.shape)}")
  batch = k_new.shape[0]
  positions = _checks.check_lengths("positions", positions, batch)
  paged = block_table is not None
  if paged:
    block_table = _checks.check_block_table(block_table, batch)
    _checks.check_page_size(keys.shape[1])
  elif keys.shape[0] != batch:
    raise ValueError(f"a contiguous cache holds one row per sequence: keys {tuple(keys.shape)} "
                     f"for k_new {tuple(k_new.shape)}")
  if batch == 0:
    return keys, values
  kernel = functools.partial(_write_kernel, paged=paged, capacity=keys.shape[0 if paged else 1],
                             page_size=keys.shape[1], kv_heads=kv_heads, head_dim=head_dim)
  operands = (positions, *((block_table,) if paged else ()), k_new, v_new, keys, values)
  first_cache = len(operands) - 2
  with quiet():
    return pl.pallas_call(
        kernel,
        grid=(batch,),
        out_shape=(jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                   jax.ShapeDtypeStruct(values.shape, values.dtype)),
        input_output_aliases={first_cache: 0, first_cache + 1: 1},
        interpret=use_interpret(interpret),
        name="jaxflash_kv_cache_write",
    )(*operands)


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
