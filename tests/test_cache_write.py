"""One-token KV cache write (jaxflash/fused/cache_write.py) against a NumPy write.

Every other row of the cache must come back bit-identical, the written rows must hold the
new token exactly (cast to the cache's dtype), and dropped writes (negative positions,
positions past the cache or table, table entries outside the pool) must change nothing.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.fused.cache_write import kv_cache_write, kv_cache_write_reference
from tests.conftest import random_array

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32


def _write_np(cache, new, places):
  out = np.array(cache, np.float32)
  for b, place in enumerate(places):
    if place is not None:
      out[place] = np.asarray(new[b].astype(cache.dtype), np.float32)
  return out


# (batch, capacity, kv heads, head dim, cache dtype, new dtype, positions)
CONTIGUOUS = {
    "k2_h128_bf16": (3, 40, 2, 128, BF16, BF16, [0, 17, 39]),
    "k5_h80_fp32_dropped": (4, 24, 5, 80, FP32, FP32, [3, -1, 24, 23]),  # -1 and 24: dropped
    "k7_h96_fp16_from_fp32": (2, 9, 7, 96, FP16, FP32, [8, 0]),
    "k1_h64_bf16_one_row": (1, 8, 1, 64, BF16, BF16, [5]),
}


@pytest.mark.parametrize("case", list(CONTIGUOUS), ids=list(CONTIGUOUS))
def test_contiguous_write(case, interpret, rng):
  batch, capacity, kv_heads, head_dim, dtype, new_dtype, positions = CONTIGUOUS[case]
  keys = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  values = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  k_new = random_array(rng, (batch, kv_heads, head_dim), new_dtype)
  v_new = random_array(rng, (batch, kv_heads, head_dim), new_dtype)
  positions = jnp.asarray(positions, jnp.int32)
  out_k, out_v = kv_cache_write(keys, values, k_new, v_new, positions, interpret=interpret)
  chex.assert_trees_all_equal_shapes_and_dtypes((out_k, out_v), (keys, values))
  places = [(b, int(p)) if 0 <= p < capacity else None for b, p in enumerate(positions)]
  np.testing.assert_array_equal(np.asarray(out_k, np.float32), _write_np(keys, k_new, places))
  np.testing.assert_array_equal(np.asarray(out_v, np.float32), _write_np(values, v_new, places))
  ref_k, ref_v = kv_cache_write_reference(keys, values, k_new, v_new, positions)
  np.testing.assert_array_equal(np.asarray(ref_k, np.float32), np.asarray(out_k, np.float32))
  np.testing.assert_array_equal(np.asarray(ref_v, np.float32), np.asarray(out_v, np.float32))


# (batch, pages, page size, max pages, kv heads, head dim, dtype, positions, table)
GARBAGE = -12345
PAGED = {
    "p8_scattered_bf16": (3, 12, 8, 3, 2, 128, BF16, [0, 9, 23], [[5, 1, 7], [0, 11, 3], [2, 9, 4]]),
    # shared page 4 (two sequences' positions land in it at different slots); -1: dropped;
    # 16 is past the 2-page table; entry GARBAGE and entry 99 lie outside the pool.
    "p8_shared_and_dropped_fp32": (5, 6, 8, 2, 3, 80, FP32, [1, 12, -1, 16, 8],
                                   [[4, 0], [2, 4], [1, 3], [5, 5], [0, GARBAGE]]),
    "p16_entry_outside_pool_fp16": (2, 4, 16, 2, 1, 96, FP16, [20, 3], [[0, 99], [3, 2]]),
}


@pytest.mark.parametrize("case", list(PAGED), ids=list(PAGED))
def test_paged_write(case, interpret, rng):
  batch, num_pages, page_size, max_pages, kv_heads, head_dim, dtype, positions, table = PAGED[case]
  pool_shape = (num_pages, page_size, kv_heads, head_dim)
  keys, values = random_array(rng, pool_shape, dtype), random_array(rng, pool_shape, dtype)
  k_new = random_array(rng, (batch, kv_heads, head_dim), dtype)
  v_new = random_array(rng, (batch, kv_heads, head_dim), dtype)
  table = jnp.asarray(table, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  out_k, out_v = kv_cache_write(keys, values, k_new, v_new, positions, block_table=table,
                                interpret=interpret)
  places = []
  for b, p in enumerate(np.asarray(positions)):
    logical = p // page_size
    page = int(table[b, logical]) if 0 <= p and logical < max_pages else -1
    places.append((page, p % page_size) if 0 <= page < num_pages else None)
  np.testing.assert_array_equal(np.asarray(out_k, np.float32), _write_np(keys, k_new, places))
  np.testing.assert_array_equal(np.asarray(out_v, np.float32), _write_np(values, v_new, places))
  ref_k, _ = kv_cache_write_reference(keys, values, k_new, v_new, positions, block_table=table)
  np.testing.assert_array_equal(np.asarray(ref_k, np.float32), np.asarray(out_k, np.float32))


def test_donated_cache_is_updated_in_place():
  """Under jit with the caches donated, the compiled write copies no cache-sized buffer."""
  keys = jnp.zeros((2, 64, 2, 128), BF16)
  new = jnp.ones((2, 2, 128), BF16)
  step = jax.jit(lambda k, v, kn, vn, pos: kv_cache_write(k, v, kn, vn, pos), donate_argnums=(0, 1))
  hlo = step.lower(keys, keys, new, new, jnp.zeros((2,), jnp.int32)).compile().as_text()
  cache_shape = "[2,64,2,128]"
  copies = [line for line in hlo.splitlines() if " copy(" in line and cache_shape in line.split("=")[1]]
  assert not copies, copies


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k_new=(2, 3, 16)), ValueError, r"k_new and v_new must be \[B, K, H\] of one shape.*\(2, 3, 16\)"),
    (dict(k_new=(2, 3, 16), v_new=(2, 3, 16)), ValueError, r"\[K, H\] = \(3, 16\).*caches hold \[K, H\] = \(2, 16\)"),
    (dict(keys=(2, 8, 2)), ValueError, r"keys and values must be .*\(2, 8, 2\)"),
    (dict(positions=(3,)), ValueError, r"positions must have shape \(2,\)"),
    (dict(keys=(3, 8, 2, 16), values=(3, 8, 2, 16)), ValueError, r"one row per sequence"),
])
def test_bad_shapes_are_refused(kwargs, error, match):
  shapes = dict(keys=(2, 8, 2, 16), values=(2, 8, 2, 16), k_new=(2, 2, 16), v_new=(2, 2, 16))
  shapes.update({k: v for k, v in kwargs.items() if k != "positions"})
  arrays = {k: jnp.zeros(v, FP32) for k, v in shapes.items()}
  positions = jnp.zeros(kwargs.get("positions", (2,)), jnp.int32)
  with pytest.raises(error, match=match):
    kv_cache_write(arrays["keys"], arrays["values"], arrays["k_new"], arrays["v_new"], positions)


def test_float_positions_and_tables_are_refused():
  cache, new = jnp.zeros((2, 8, 1, 16), FP32), jnp.zeros((2, 1, 16), FP32)
  with pytest.raises(TypeError, match="positions must be an integer array"):
    kv_cache_write(cache, cache, new, new, jnp.zeros((2,), FP32))
  with pytest.raises(TypeError, match="block_table must be an integer array"):
    kv_cache_write(cache, cache, new, new, jnp.zeros((2,), jnp.int32), block_table=jnp.zeros((2, 1)))


def test_public_name():
  assert jaxflash.kv_cache_write is kv_cache_write
