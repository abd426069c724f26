"""Paged decode kernel (jaxflash/paged.py), the block-table validator and paged_kv_write.

Pools are filled with random pages scattered by a random table; some cases share pages
between sequences, and table entries past a sequence's length hold garbage (never read).
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxflash
from jaxflash import reference
from jaxflash.configs import DecodeConfig
from jaxflash.paged import (_paged_decode_attention, block_table_is_valid, gather_pages,
                            paged_decode_attention, paged_decode_attention_reference, paged_kv_write)
from tests.conftest import assert_close, random_array
from tests.reference_np import attention_f64, gather_pages_np
from tests.test_decode import _poison, cache_sized_data_movement

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32
GARBAGE = -12345  # table entries past a sequence's length: reading one would fail loudly

# (batch, pages in pool, page size, max pages, query heads, kv heads, head dim, dtype,
#  lengths, table kind, num_splits, config)
#  table kinds: "scattered" (distinct random pages), "prefix" (sequences share their first
#  pages, as after a shared prompt), "random" (drawn with replacement: pages shared anywhere)
CASES = {
    # 8-token pages, 32-token tiles: each tile gathers 4 pages; G=3; lengths 0, ragged, full.
    "p8_tile32_g3_h64_bf16": (3, 48, 8, 12, 6, 2, 64, BF16, [0, 45, 96], "scattered", 2, DecodeConfig(32)),
    # page == tile; G=5, H=80 (masked head dim), fp32; shared prompt pages; one split.
    "p16_tile16_g5_h80_fp32": (2, 24, 16, 10, 5, 1, 80, FP32, [17, 160], "prefix", 1, DecodeConfig(16)),
    # 64-token pages, 16-token tiles: each tile is a quarter page; G=7, fp16.
    "p64_tile16_g7_h128_fp16": (2, 8, 64, 4, 7, 1, 128, FP16, [130, 1], "scattered", 3, DecodeConfig(16)),
    # 256-token pages with the tuned paged config (32-token tiles, 5 stages); G=4, H=96.
    "p256_tuned_g4_h96_bf16": (2, 3, 256, 2, 8, 2, 96, BF16, [257, 200], "prefix", None, None),
    # G=8, H=256, fp32, pages drawn with replacement, far more splits than tiles.
    "p8_tile16_g8_h256_fp32": (2, 10, 8, 6, 8, 1, 256, FP32, [48, 9], "random", 32, DecodeConfig(16)),
    # G=1, a pool smaller than the tables: pages shared everywhere; one sequence empty.
    "p16_tile32_g1_h64_fp16": (3, 5, 16, 5, 2, 2, 64, FP16, [80, 33, 0], "random", 2, DecodeConfig(32)),
}


def _make_table(rng, kind, batch, num_pages, max_pages, page_size, lengths):
  if kind == "scattered":
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
  elif kind == "prefix":
    table = np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(batch)])
    table[1:, :max_pages // 2] = table[0, :max_pages // 2]
  else:
    table = rng.integers(0, num_pages, (batch, max_pages))
  used = np.arange(max_pages)[None, :] < -(-np.asarray(lengths)[:, None] // page_size)
  return np.where(used, table, GARBAGE).astype(np.int32), np.where(used, table, 0)


def _case_inputs(rng, case):
  (batch, num_pages, page, max_pages, heads, kv_heads, head_dim, dtype, lengths, kind, *_) = CASES[case]
  q = random_array(rng, (batch, 1, heads, head_dim), dtype)
  k_pages = random_array(rng, (num_pages, page, kv_heads, head_dim), dtype)
  v_pages = random_array(rng, (num_pages, page, kv_heads, head_dim), dtype)
  table, clean_table = _make_table(rng, kind, batch, num_pages, max_pages, page, lengths)
  return q, k_pages, v_pages, jnp.asarray(lengths, jnp.int32), jnp.asarray(table), clean_table


def _reference(q, k_pages, v_pages, lengths, clean_table, scale=None):
  return attention_f64(q, gather_pages_np(k_pages, clean_table), gather_pages_np(v_pages, clean_table),
                       scale=scale, kv_lengths=np.asarray(lengths))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_matches_reference(case, interpret, rng):
  splits, config = CASES[case][-2:]
  dtype = CASES[case][7]
  q, k_pages, v_pages, lengths, table, clean_table = _case_inputs(rng, case)
  if not interpret:
    _poison(q)
  out, lse = paged_decode_attention(q, k_pages, v_pages, lengths, table, num_splits=splits,
                                    config=config, return_residual=True, interpret=interpret)
  chex.assert_shape(out, q.shape)
  chex.assert_shape(lse, q.shape[:3])
  assert out.dtype == dtype and lse.dtype == jnp.float32
  ref_out, ref_lse = _reference(q, k_pages, v_pages, lengths, clean_table)
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, jnp.float32, what="lse")


def test_out_of_pool_entries_are_clamped(interpret, rng):
  """A bad traced entry (under jit: concrete ones raise) inside a sequence's length reads
  page clip(entry, 0, num_pages - 1), never memory outside the pool (documented
  behaviour). Shapes of an earlier case."""
  q, k_pages, v_pages, lengths, table, clean_table = _case_inputs(rng, "p8_tile32_g3_h64_bf16")
  table = np.asarray(table).copy()
  table[1, 0], table[2, 5] = -3, 10**6
  clean_table[1, 0], clean_table[2, 5] = 0, k_pages.shape[0] - 1
  assert not block_table_is_valid(table, lengths, num_pages=k_pages.shape[0], page_size=8)
  splits, config = CASES["p8_tile32_g3_h64_bf16"][-2:]
  if not interpret:
    _poison(q)
  out, lse = jax.jit(lambda table: paged_decode_attention(
      q, k_pages, v_pages, lengths, table, scale=0.2, num_splits=splits, config=config,
      return_residual=True, interpret=interpret))(jnp.asarray(table))
  ref_out, ref_lse = _reference(q, k_pages, v_pages, lengths, clean_table, scale=0.2)
  assert_close(out, ref_out, BF16)
  assert_close(lse, ref_lse, jnp.float32, what="lse")
  jax_out, jax_lse = paged_decode_attention_reference(q, k_pages, v_pages, lengths, jnp.asarray(table),
                                                      scale=0.2)  # the plain-JAX twin clamps alike
  assert_close(jax_out, ref_out, BF16, what="reference output")
  assert_close(jax_lse, ref_lse, jnp.float32, what="reference lse")


def test_lengths_and_table_change_without_recompiling(interpret, rng):
  case = "p64_tile16_g7_h128_fp16"
  splits, config = CASES[case][-2:]
  q, k_pages, v_pages, _, _, _ = _case_inputs(rng, case)
  call = functools.partial(paged_decode_attention, num_splits=splits, config=config, interpret=interpret)
  call(q, k_pages, v_pages, jnp.asarray([1, 2], jnp.int32), jnp.zeros((2, 4), jnp.int32)).block_until_ready()
  compiled = _paged_decode_attention._cache_size()
  for lengths in ([0, 256], [64, 191]):
    table, clean_table = _make_table(rng, "random", 2, 8, 4, 64, lengths)
    out = call(q, k_pages, v_pages, jnp.asarray(lengths, jnp.int32), jnp.asarray(table))
    ref, _ = _reference(q, k_pages, v_pages, lengths, clean_table)
    assert_close(out, ref, FP16)
  assert _paged_decode_attention._cache_size() == compiled


def test_through_attention(rng):
  """jaxflash.attention with block_table dispatches here; its "xla" path gathers the pages.
  Runs compiled on a GPU, interpreted elsewhere."""
  q, k_pages, v_pages, lengths, _, clean_table = _case_inputs(rng, "p16_tile16_g5_h80_fp32")
  table = jnp.asarray(clean_table, jnp.int32)  # the xla path gathers every entry: keep them valid
  ref_out, ref_lse = _reference(q, k_pages, v_pages, lengths, clean_table)
  for implementation in (None, "xla"):
    out, lse = jaxflash.attention(q, k_pages, v_pages, key_value_seq_lengths=lengths, block_table=table,
                                  return_residual=True, implementation=implementation)
    assert_close(out, ref_out, FP32, what=f"output ({implementation})")
    assert_close(lse, ref_lse, jnp.float32, what=f"lse ({implementation})")


# --------------------------------------------------------------------------------------
# The block-table validator.
# --------------------------------------------------------------------------------------

def test_block_table_is_valid():
  table = np.array([[3, 1, GARBAGE], [0, 2, 9]], np.int32)  # page 9 is outside a 4-page pool
  check = functools.partial(block_table_is_valid, num_pages=4, page_size=8)
  assert check(table, [9, 16])  # neither bad entry is read
  assert check(table, [16, 0])
  assert not check(table, [17, 0])  # sequence 0 reads GARBAGE
  assert not check(table, [0, 17])  # sequence 1 reads page 9
  assert not check(table, [25, 0])  # longer than the table
  assert not check(table, [-1, 0])
  assert not jax.jit(check)(table, jnp.array([0, 24]))

  def guarded(table, lengths):  # the checkify pattern the docstring suggests
    checkify.check(check(table, lengths), "block table points outside the page pool")
    return lengths.sum()

  err, _ = jax.jit(checkify.checkify(guarded))(table, jnp.array([9, 16]))
  assert err.get() is None
  err, _ = jax.jit(checkify.checkify(guarded))(table, jnp.array([9, 17]))
  assert "outside the page pool" in err.get()


# --------------------------------------------------------------------------------------
# paged_kv_write.
# --------------------------------------------------------------------------------------

def _write_np(pages, table, starts, new, new_lengths):
  pages, table = np.array(pages), np.asarray(table)
  num_pages, page_size = pages.shape[:2]
  for b in range(new.shape[0]):
    for t in range(new.shape[1]):
      pos = starts[b] + t
      if (new_lengths is not None and t >= new_lengths[b]) or pos // page_size >= table.shape[1]:
        continue
      page = table[b, pos // page_size]
      if 0 <= page < num_pages:
        pages[page, pos % page_size] = np.asarray(new[b, t])
  return pages


@pytest.mark.parametrize("with_lengths", [False, True])
def test_paged_kv_write(with_lengths, rng):
  num_pages, page_size, kv_heads, head_dim, batch, new_tokens = 7, 8, 2, 16, 3, 6
  k_pages = random_array(rng, (num_pages, page_size, kv_heads, head_dim), BF16)
  v_pages = random_array(rng, (num_pages, page_size, kv_heads, head_dim), BF16)
  table = jnp.asarray([[4, 0, 6], [2, 5, 1], [3, 99, GARBAGE]], jnp.int32)
  # Writes crossing a page boundary (5..10), from 0, and ones running past the table (20..25)
  # or through an entry outside the pool: those are dropped.
  starts = np.array([5, 0, 6])
  new_lengths = np.array([6, 3, 4]) if with_lengths else None
  k_new = random_array(rng, (batch, new_tokens, kv_heads, head_dim), FP32)  # cast to the pool's dtype
  v_new = random_array(rng, (batch, new_tokens, kv_heads, head_dim), FP32)
  write = jax.jit(paged_kv_write, donate_argnums=(0, 1))
  expect_k = _write_np(k_pages, table, starts, np.asarray(k_new.astype(BF16)), new_lengths)
  expect_v = _write_np(v_pages, table, starts, np.asarray(v_new.astype(BF16)), new_lengths)
  k_out, v_out = write(k_pages, v_pages, table, jnp.asarray(starts, jnp.int32), k_new, v_new,
                       None if new_lengths is None else jnp.asarray(new_lengths, jnp.int32))
  assert k_out.dtype == BF16 and k_out.shape == expect_k.shape
  np.testing.assert_array_equal(np.asarray(k_out), expect_k)
  np.testing.assert_array_equal(np.asarray(v_out), expect_v)


def test_paged_kv_write_drops_tokens_past_new_lengths(rng):
  """With new_lengths 0 nothing is written: the pool comes back bit for bit."""
  k_pages = random_array(rng, (4, 8, 1, 16), FP16)
  v_pages = random_array(rng, (4, 8, 1, 16), FP16)
  table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
  new = random_array(rng, (2, 5, 1, 16), FP16)
  k_out, v_out = paged_kv_write(k_pages, v_pages, table, jnp.asarray([3, 0], jnp.int32), new, new,
                                jnp.zeros((2,), jnp.int32))
  np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_pages))
  np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_pages))


def test_gather_pages_is_the_reference():
  assert gather_pages is reference.gather_pages


# --------------------------------------------------------------------------------------
# The pool is read in place (its reshape to rows is a bitcast): no transpose, copy or gather.
# --------------------------------------------------------------------------------------

def _paged_shapes(page_size, splits):
  batch, num_pages, kv_heads, heads, head_dim = 2, 16384 // page_size, 2, 12, 128
  sds = jax.ShapeDtypeStruct
  pool = sds((num_pages, page_size, kv_heads, head_dim), BF16)
  args = (sds((batch, 1, heads, head_dim), BF16), pool, pool, sds((batch,), jnp.int32),
          sds((batch, num_pages // batch), jnp.int32))
  fn = functools.partial(paged_decode_attention, num_splits=splits, return_residual=True, interpret=False)
  return fn, args, num_pages * page_size * kv_heads * head_dim


@pytest.mark.parametrize("page_size, splits", [(16, 1), (8, 4), (64, 4), (256, 2)])
def test_lowers_to_triton_reading_pool_in_place(page_size, splits):
  fn, args, pool_elements = _paged_shapes(page_size, splits)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == (1 if splits == 1 else 2)
  assert cache_sized_data_movement(text, pool_elements) == []


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, splits", [(16, 1), (256, 4)])
def test_compiled_hlo_reads_pool_in_place(page_size, splits):
  fn, args, pool_elements = _paged_shapes(page_size, splits)
  text = jax.jit(fn).lower(*args).compile().as_text()
  assert cache_sized_data_movement(text, pool_elements) == [], text


# --------------------------------------------------------------------------------------
# Errors name the argument and the shapes.
# --------------------------------------------------------------------------------------

def _bad_call(**changes):
  args = dict(query=jnp.zeros((2, 1, 4, 64), BF16), k_pages=jnp.zeros((6, 16, 2, 64), BF16),
              v_pages=jnp.zeros((6, 16, 2, 64), BF16), key_value_seq_lengths=jnp.zeros((2,), jnp.int32),
              block_table=jnp.zeros((2, 3), jnp.int32))
  kwargs = {key: changes.pop(key) for key in ("num_splits", "config") if key in changes}
  args.update(changes)
  return paged_decode_attention(*args.values(), interpret=True, **kwargs)


@pytest.mark.parametrize("changes, error, message", [
    (dict(query=jnp.zeros((2, 3, 4, 64), BF16)), ValueError, r"one query token.*\(2, 3, 4, 64\)"),
    (dict(query=jnp.zeros((3, 1, 4, 64), BF16)), ValueError, r"block_table must have shape \(3, max_pages\)"),
    (dict(k_pages=jnp.zeros((6, 12, 2, 64), BF16), v_pages=jnp.zeros((6, 12, 2, 64), BF16)),
     ValueError, r"power of two >= 8.*12"),
    (dict(k_pages=jnp.zeros((6, 4, 2, 64), BF16), v_pages=jnp.zeros((6, 4, 2, 64), BF16)),
     ValueError, r"power of two >= 8.*4 tokens"),
    (dict(v_pages=jnp.zeros((6, 16, 1, 64), BF16)), ValueError, r"k_pages and v_pages.*same shape"),
    (dict(k_pages=jnp.zeros((6, 16, 3, 64), BF16), v_pages=jnp.zeros((6, 16, 3, 64), BF16)),
     ValueError, r"multiple of k_pages heads"),
    (dict(block_table=jnp.zeros((2, 3), jnp.float32)), TypeError, r"block_table must be an integer"),
    (dict(block_table=jnp.zeros((2,), jnp.int32)), ValueError,
     r"block_table must have shape \(2, max_pages\)"),
    (dict(key_value_seq_lengths=None), ValueError, r"needs key_value_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.zeros((2, 1), jnp.int32)), ValueError, r"key_value_seq_lengths.*\(2,\)"),
    (dict(num_splits=-1), ValueError, r"num_splits must be a positive int"),
    (dict(config=DecodeConfig(8)), ValueError, r"block_k must be a power of two >= 16"),
])
def test_bad_inputs(changes, error, message):
  with pytest.raises(error, match=message):
    _bad_call(**changes)


def test_paged_kv_write_bad_inputs():
  pages = jnp.zeros((4, 8, 2, 16), BF16)
  table = jnp.zeros((2, 2), jnp.int32)
  starts = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match=r"K=2 and H=16.*k_new \(2, 3, 1, 16\)"):
    paged_kv_write(pages, pages, table, starts, jnp.zeros((2, 3, 1, 16)), jnp.zeros((2, 3, 1, 16)))
  with pytest.raises(ValueError, match=r"block_table must have shape \(2, max_pages\)"):
    paged_kv_write(pages, pages, table[:1], starts, jnp.zeros((2, 3, 2, 16)), jnp.zeros((2, 3, 2, 16)))
  with pytest.raises(ValueError, match=r"new_lengths.*\(2,\)"):
    paged_kv_write(pages, pages, table, starts, jnp.zeros((2, 3, 2, 16)), jnp.zeros((2, 3, 2, 16)),
                   jnp.zeros((3,), jnp.int32))


# group -> (KV heads, page size): groups past 16 heads take 32- or 64-row tiles, past 64 several
# programs per KV head; pages smaller (gathered tiles) and larger (slices of a page) than a tile.
GQA_GROUPS = {2: (2, 8), 6: (1, 32), 16: (1, 8), 17: (2, 32), 24: (2, 8), 32: (1, 32), 64: (2, 8),
              128: (1, 32)}


@pytest.mark.parametrize("group", list(GQA_GROUPS), ids=[f"g{g}" for g in GQA_GROUPS])
def test_every_gqa_ratio(group, interpret, rng):
  """Every query head of every group is written and right, through scattered pages."""
  kv_heads, page = GQA_GROUPS[group]
  batch, max_pages = 2, 64 // page
  lengths = [61, 0] if group % 2 else [64, 23]
  q = random_array(rng, (batch, 1, group * kv_heads, 64), BF16)
  k_pages = random_array(rng, (batch * max_pages + 1, page, kv_heads, 64), BF16)
  v_pages = random_array(rng, (batch * max_pages + 1, page, kv_heads, 64), BF16)
  table, clean_table = _make_table(rng, "scattered", batch, batch * max_pages + 1, max_pages, page, lengths)
  lengths = jnp.asarray(lengths, jnp.int32)
  if not interpret:
    _poison(q)
  out, lse = paged_decode_attention(q, k_pages, v_pages, lengths, jnp.asarray(table), num_splits=2,
                                    config=DecodeConfig(16), return_residual=True, interpret=interpret)
  ref_out, ref_lse = _reference(q, k_pages, v_pages, lengths, clean_table)
  assert_close(out, ref_out, BF16)
  assert_close(lse, ref_lse, jnp.float32, what="lse")
