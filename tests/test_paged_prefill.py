"""Paged prefill (jaxflash/paged_prefill.py: the prefill kernel reading K/V through a block
table) against float64 attention over the gathered pages, every option of the kernel over
pages, jaxflash.attention's paged calls reading the pool in place, and paged_kv_write
serving a chunk of new tokens.

Each sequence's T_b query tokens are its last T_b key positions (bottom-right causal):
a chunk of a prompt whose earlier tokens are already in the pool. Pools are random, tables
scattered or sharing pages (a common prefix, or drawn with replacement), and table entries
past a sequence's length hold garbage that must never be read.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.configs import PrefillConfig
from jaxflash.paged import paged_kv_write
from jaxflash.paged_prefill import _paged_prefill_attention, paged_prefill_attention, paged_prefill_reference
from tests.conftest import assert_close, poison_allocator, random_array
from tests.reference_np import attention_f64, gather_pages_np
from tests.test_decode import cache_sized_data_movement
from tests.test_paged import _make_table
from tests.test_quantized_kv import _deq, _pools

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (pages in pool, page size, max pages, query heads, kv heads, head dim, dtype, T,
#  query lengths (None: all T), key lengths, table kind, config)
#  Key lengths count the new tokens: query t of sequence b sits at kv_len - q_len + t.
CASES = {
    # 8-token pages, 32-key tiles (each gathers 4 pages); G=1; odd lengths; a decode row (q 1).
    "p8_g1_h64_bf16": (40, 8, 10, 2, 2, 64, BF16, 19, [19, 1, 7], [37, 61, 7], "scattered",
                       PrefillConfig(16, 32, 4, 2)),
    # 16-token pages, page == tile; G=2, H=80 (padded head dim), fp32; a shared prefix.
    "p16_g2_h80_fp32": (24, 16, 8, 4, 2, 80, FP32, 33, [33, 20], [100, 20], "prefix",
                        PrefillConfig(16, 16, 4, 2)),
    # 64-token pages, 32-key tiles (half a page each); G=5, H=96, fp16; an empty row (q 0).
    "p64_g5_h96_fp16": (8, 64, 4, 5, 1, 96, FP16, 40, [40, 0], [201, 0], "scattered",
                        PrefillConfig(32, 32, 4, 2)),
    # 256-token pages with the default config; G=7, H=128, bf16, pages drawn with replacement.
    "p256_g7_h128_bf16": (4, 256, 2, 7, 1, 128, BF16, 24, [17, 24], [300, 24], "random", None),
    # G=8, H=64, fp32, 8-token pages; keys start mid-page and the chunk crosses pages.
    "p8_g8_h64_fp32": (16, 8, 6, 8, 1, 64, FP32, 13, [13, 5], [45, 29], "prefix",
                       PrefillConfig(16, 16, 4, 2)),
}


def _case_inputs(rng, case):
  return paged_case_inputs(rng, CASES[case])


def paged_case_inputs(rng, spec):
  """A case tuple as CASES holds them -> (q, k_pages, v_pages, key lengths, table with garbage
  past each sequence's pages, the same table cleaned for the reference, query lengths)."""
  num_pages, page, max_pages, heads, kv_heads, head_dim, dtype, t, q_lengths, kv_lengths, kind, _ = spec
  batch = len(kv_lengths)
  q = random_array(rng, (batch, t, heads, head_dim), dtype)
  k_pages = random_array(rng, (num_pages, page, kv_heads, head_dim), dtype)
  v_pages = random_array(rng, (num_pages, page, kv_heads, head_dim), dtype)
  table, clean = _make_table(rng, kind, batch, num_pages, max_pages, page, kv_lengths)
  return q, k_pages, v_pages, np.asarray(kv_lengths), table, clean, q_lengths


def _reference(q, k_pages, v_pages, kv_lengths, clean, q_lengths, is_causal=True, scale=None, **options):
  return attention_f64(q, gather_pages_np(k_pages, clean), gather_pages_np(v_pages, clean),
                       scale=scale, is_causal=is_causal, kv_lengths=kv_lengths,
                       q_lengths=None if q_lengths is None else np.asarray(q_lengths), **options)


def _poison(q):
  poison_allocator(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:3], FP32))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_prefill_matches_reference(case, interpret, rng):
  dtype, config = CASES[case][6], CASES[case][-1]
  q, k_pages, v_pages, kv_lengths, table, clean, q_lengths = _case_inputs(rng, case)
  if not interpret:
    _poison(q)
  out, lse = paged_prefill_attention(
      q, k_pages, v_pages, jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(table),
      jnp.asarray(q_lengths, jnp.int32), return_residual=True, config=config, interpret=interpret)
  chex.assert_shape(out, q.shape)
  chex.assert_shape(lse, q.shape[:3])
  assert out.dtype == dtype and lse.dtype == FP32
  ref_out, ref_lse = _reference(q, k_pages, v_pages, kv_lengths, clean, q_lengths)
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, FP32, what="lse")


@pytest.mark.parametrize("is_causal", [True, False])
def test_default_lengths_scale_and_non_causal(is_causal, interpret, rng):
  """query_seq_lengths None: every row is a query; a custom scale; non-causal sees all keys."""
  q, k_pages, v_pages, kv_lengths, table, clean, _ = _case_inputs(rng, "p16_g2_h80_fp32")
  kv_lengths = np.array([57, 40])
  table, clean = _make_table(rng, "scattered", 2, 24, 8, 16, kv_lengths)
  out = paged_prefill_attention(q, k_pages, v_pages, jnp.asarray(kv_lengths, jnp.int32),
                                jnp.asarray(table), scale=0.3, is_causal=is_causal,
                                config=CASES["p16_g2_h80_fp32"][-1], interpret=interpret)
  ref_out, _ = _reference(q, k_pages, v_pages, kv_lengths, clean, None, is_causal=is_causal, scale=0.3)
  assert_close(out, ref_out, FP32)


def test_matches_contiguous_prefill_and_plain_jax_twin(rng):
  """The same keys in pages or contiguous give the contiguous kernel's answer."""
  q, k_pages, v_pages, kv_lengths, table, clean, q_lengths = _case_inputs(rng, "p8_g1_h64_bf16")
  args = (jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(table), jnp.asarray(q_lengths, jnp.int32))
  paged = paged_prefill_attention(q, k_pages, v_pages, *args, config=CASES["p8_g1_h64_bf16"][-1])
  contiguous = jaxflash.prefill_attention(
      q, jaxflash.gather_pages(k_pages, jnp.asarray(clean)), jaxflash.gather_pages(v_pages, jnp.asarray(clean)),
      args[2], args[0], is_causal=True, config=PrefillConfig(16, 32, 4, 2))
  np.testing.assert_allclose(np.asarray(paged, np.float32), np.asarray(contiguous, np.float32),
                             atol=1e-2)
  twin = paged_prefill_reference(q, k_pages, v_pages, *args)
  ref_out, _ = _reference(q, k_pages, v_pages, kv_lengths, clean, q_lengths)
  assert_close(twin, ref_out, BF16, what="plain-JAX reference")


def test_lengths_and_table_change_without_recompiling(rng):
  q, k_pages, v_pages, kv_lengths, table, clean, q_lengths = _case_inputs(rng, "p8_g8_h64_fp32")
  config = CASES["p8_g8_h64_fp32"][-1]
  call = lambda kv, tb, ql: paged_prefill_attention(q, k_pages, v_pages, jnp.asarray(kv, jnp.int32),
                                                    jnp.asarray(tb), jnp.asarray(ql, jnp.int32),
                                                    config=config)
  call(kv_lengths, table, q_lengths).block_until_ready()
  compiled = _paged_prefill_attention._cache_size()  # the jitted launch behind the checks
  for kv, ql in (([13, 48], [13, 1]), ([20, 9], [0, 9])):
    table, clean = _make_table(rng, "random", 2, 16, 6, 8, kv)
    assert_close(call(kv, table, ql), _reference(q, k_pages, v_pages, np.asarray(kv), clean, ql)[0], FP32)
  assert _paged_prefill_attention._cache_size() == compiled


def test_chunked_prefill_through_paged_kv_write(rng):
  """A prompt written and attended chunk by chunk (paged_kv_write at each row's start
  position, per-row new lengths) gives the whole prompt's causal attention, row by row."""
  num_pages, page, kv_heads, heads, head_dim, prompt = 12, 8, 2, 4, 64, 29
  q_all = random_array(rng, (2, prompt, heads, head_dim), FP32)
  k_all = random_array(rng, (2, prompt, kv_heads, head_dim), FP32)
  v_all = random_array(rng, (2, prompt, kv_heads, head_dim), FP32)
  table = jnp.asarray(rng.permutation(num_pages)[:8].reshape(2, 4), jnp.int32)
  k_pages = jnp.full((num_pages, page, kv_heads, head_dim), jnp.nan, FP32)  # unwritten = NaN
  v_pages = jnp.full((num_pages, page, kv_heads, head_dim), jnp.nan, FP32)
  write = jax.jit(paged_kv_write, donate_argnums=(0, 1))
  chunk, done = 11, np.zeros(2, np.int64)
  outs = [[], []]
  # Row 1 runs one chunk behind row 0 (rows at different points of their prompts).
  for step in range(4):
    take = np.array([min(chunk, prompt - done[0]), 0 if step == 0 else min(chunk, prompt - done[1])])
    starts = jnp.asarray(done, jnp.int32)
    idx = np.minimum(done[:, None] + np.arange(chunk)[None, :], prompt - 1)  # [2, chunk]
    gather = lambda x: jnp.asarray(np.asarray(x)[np.arange(2)[:, None], idx])
    k_pages, v_pages = write(k_pages, v_pages, table, starts, gather(k_all), gather(v_all),
                             jnp.asarray(take, jnp.int32))
    out = paged_prefill_attention(gather(q_all), k_pages, v_pages, jnp.asarray(done + take, jnp.int32),
                                  table, jnp.asarray(take, jnp.int32),
                                  config=PrefillConfig(16, 16, 4, 2))
    for b in range(2):
      outs[b].append(np.asarray(out[b, :take[b]]))
    done += take
  assert (done == prompt).all()
  ref, _ = attention_f64(q_all, k_all, v_all, is_causal=True)
  for b in range(2):
    assert_close(np.concatenate(outs[b]), ref[b], FP32, what=f"row {b}")


def test_chunk_write_leaves_shared_pages_alone(rng):
  """Two sequences share two full prefix pages; each writes its own chunk after them (from
  start positions past the prefix, with different new lengths): the shared pages are untouched."""
  k_pages = random_array(rng, (8, 16, 1, 64), BF16)
  table = jnp.asarray([[5, 2, 0, 3], [5, 2, 7, 1]], jnp.int32)
  new = random_array(rng, (2, 20, 1, 64), BF16)
  k_out, _ = paged_kv_write(k_pages, k_pages, table, jnp.asarray([32, 35], jnp.int32), new, new,
                            jnp.asarray([20, 7], jnp.int32))
  k_out, before = np.asarray(k_out), np.asarray(k_pages)
  np.testing.assert_array_equal(k_out[[5, 2, 4, 6]], before[[5, 2, 4, 6]])  # shared and unused
  np.testing.assert_array_equal(k_out[0], np.asarray(new[0, :16]))
  np.testing.assert_array_equal(k_out[3, :4], np.asarray(new[0, 16:]))
  np.testing.assert_array_equal(k_out[3, 4:], before[3, 4:])
  np.testing.assert_array_equal(k_out[7, 3:10], np.asarray(new[1, :7]))
  np.testing.assert_array_equal(k_out[7, 10:], before[7, 10:])


@pytest.mark.parametrize("page_size", [8, 16, 64, 256])
def test_lowers_to_one_triton_kernel_reading_pool_in_place(page_size):
  """Compiled lowering (no GPU needed): one Triton call, and the pool is never copied,
  transposed or gathered on its way in (the reshape to rows is a bitcast)."""
  sds = jax.ShapeDtypeStruct
  num_pages = 16384 // page_size
  pool = sds((num_pages, page_size, 2, 128), BF16)
  args = (sds((2, 512, 12, 128), BF16), pool, pool, sds((2,), jnp.int32),
          sds((2, num_pages // 2), jnp.int32), sds((2,), jnp.int32))
  fn = lambda *a: paged_prefill_attention(*a, return_residual=True, interpret=False,
                                          config=PrefillConfig(64, 64, 4, 3))
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert cache_sized_data_movement(text, num_pages * page_size * 2 * 128) == []


def _bad_call(**changes):
  args = dict(query=jnp.zeros((2, 5, 4, 64), BF16), k_pages=jnp.zeros((6, 16, 2, 64), BF16),
              v_pages=jnp.zeros((6, 16, 2, 64), BF16), key_value_seq_lengths=jnp.zeros((2,), jnp.int32),
              block_table=jnp.zeros((2, 3), jnp.int32), query_seq_lengths=None)
  keywords = {key: changes.pop(key) for key in list(changes) if key not in args}
  args.update(changes)
  return paged_prefill_attention(*args.values(), **keywords, interpret=True)


@pytest.mark.parametrize("changes, error, message", [
    (dict(query=jnp.zeros((2, 5, 4))), ValueError, r"query must have rank 4"),
    (dict(query=jnp.zeros((3, 5, 4, 64), BF16)), ValueError, r"block_table must have shape \(3, max_pages\)"),
    (dict(k_pages=jnp.zeros((6, 12, 2, 64), BF16), v_pages=jnp.zeros((6, 12, 2, 64), BF16)),
     ValueError, r"power of two >= 8.*12"),
    (dict(v_pages=jnp.zeros((6, 16, 1, 64), BF16)), ValueError, r"k_pages and v_pages.*same shape"),
    (dict(k_pages=jnp.zeros((6, 16, 3, 64), BF16), v_pages=jnp.zeros((6, 16, 3, 64), BF16)),
     ValueError, r"multiple of k_pages heads"),
    (dict(k_pages=jnp.zeros((0, 16, 2, 64), BF16), v_pages=jnp.zeros((0, 16, 2, 64), BF16)),
     ValueError, r"at least one page"),
    (dict(block_table=jnp.zeros((2, 3), jnp.float32)), TypeError, r"block_table must be an integer"),
    (dict(key_value_seq_lengths=None), ValueError, r"needs key_value_seq_lengths"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, r"query_seq_lengths.*\(2,\)"),
    (dict(query=jnp.zeros((2, 5, 4, 64), jnp.int32)), TypeError, r"query must be bfloat16"),
    (dict(config=PrefillConfig(16, 8)), ValueError, r"block_k must be a power of two >= 16"),
    (dict(local_window_size=-1), ValueError, r"local_window_size must be an int >= 0"),
    (dict(local_window_size=(3, 1, 2)), ValueError, r"local_window_size must be .* pair"),
    (dict(logits_soft_cap=0.0), ValueError, r"logits_soft_cap must be a finite number > 0"),
    (dict(logits_soft_cap=jnp.ones((2,))), TypeError, r"logits_soft_cap must be a concrete number"),
    (dict(bias=jnp.zeros((2, 4, 5, 47))), ValueError, r"bias .*\[B, N, T, S\].*\(2, 4, 5, 48\)"),
    (dict(bias=jnp.zeros((2, 4, 5, 48), jnp.int32)), TypeError, r"bias must be"),
    (dict(mask=jnp.ones((2, 4, 5, 48))), TypeError, r"mask must be a boolean array"),
    (dict(mask=jnp.ones((3, 1, 1, 48), bool)), ValueError, r"mask .*\(2, 4, 5, 48\)"),
    (dict(sinks=jnp.zeros((2,))), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=jnp.zeros((4,), jnp.int32)), TypeError, r"sinks must be a float array"),
    (dict(scale=jnp.ones((2,))), ValueError, r"scale must be a real scalar"),
    (dict(causal_alignment="middle"), ValueError, r"causal_alignment must be one of"),
    (dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
])
def test_bad_inputs(changes, error, message):
  with pytest.raises(error, match=message):
    _bad_call(**changes)


def test_exported():
  assert jaxflash.paged_prefill_attention is paged_prefill_attention


# ------------------------------------------------------------------ options over pages

def _bias(rng, b, n, t, s):
  return random_array(rng, (b, n, t, s), FP32, 2.0)


def _mask(rng, b, n, t, s):
  """A random mask that also hides every key from query row 2: that row gives zeros."""
  mask = rng.random((b, 1, t, s)) < 0.7
  mask[:, :, 2] = False
  return jnp.asarray(mask)


def _sinks(rng, b, n, t, s):
  return random_array(rng, (n,), FP32, 2.0)


# name: (geometry of CASES, static options, array options (name -> maker(rng, B, N, T, S)),
#        f64 reference keywords). Each geometry brings its page size against the key tile
#        (smaller, equal, larger), GQA group (1, 2, 5, 7, 8), table kind and ragged lengths.
OPTION_CASES = {
    "window_causal_p8_g1": ("p8_g1_h64_bf16", dict(local_window_size=(9, 0)), {}, dict(window=(9, 0))),
    "window_two_sided_p64_g5": ("p64_g5_h96_fp16", dict(is_causal=False, local_window_size=(7, 4)), {},
                                dict(is_causal=False, window=(7, 4))),
    "softcap_p16_g2_prefix": ("p16_g2_h80_fp32", dict(logits_soft_cap=2.5), {}, dict(softcap=2.5)),
    "bias_p8_g8_prefix": ("p8_g8_h64_fp32", {}, dict(bias=_bias), {}),
    "mask_p256_g7_random": ("p256_g7_h128_bf16", {}, dict(mask=_mask), {}),
    "sinks_p64_g5": ("p64_g5_h96_fp16", {}, dict(sinks=_sinks), {}),
    "top_left_p16_g2": ("p16_g2_h80_fp32", dict(causal_alignment="top_left"), {},
                        dict(alignment="top_left")),
    "everything_p8_g1": ("p8_g1_h64_bf16", dict(local_window_size=(12, 0), logits_soft_cap=3.0),
                         dict(bias=_bias, mask=_mask, sinks=_sinks), dict(window=(12, 0), softcap=3.0)),
}


@pytest.mark.parametrize("name", list(OPTION_CASES), ids=list(OPTION_CASES))
def test_options_over_pages_match_reference(name, interpret, rng):
  """Window, soft-cap, bias, mask, sinks and top-left positions through the block table,
  against float64 attention on the gathered pages (bias and mask in logical positions)."""
  case, static, makers, ref_options = OPTION_CASES[name]
  dtype, config = CASES[case][6], CASES[case][-1]
  q, k_pages, v_pages, kv_lengths, table, clean, q_lengths = _case_inputs(rng, case)
  batch, t, heads = q.shape[:3]
  capacity = table.shape[1] * k_pages.shape[1]
  arrays = {key: make(rng, batch, heads, t, capacity) for key, make in makers.items()}
  if not interpret:
    _poison(q)
  out, lse = paged_prefill_attention(
      q, k_pages, v_pages, jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(table),
      jnp.asarray(q_lengths, jnp.int32), **static, **arrays, return_residual=True, config=config,
      interpret=interpret)
  ref_options = dict(is_causal=True) | ref_options
  ref_out, ref_lse = _reference(q, k_pages, v_pages, kv_lengths, clean, q_lengths, **ref_options, **arrays)
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, FP32, what="lse")


def test_traced_scale_does_not_recompile(rng):
  """The scale is an operand, as in the contiguous prefill: a new value, traced or not,
  reuses the compiled launch."""
  q, k_pages, v_pages, kv_lengths, table, clean, q_lengths = _case_inputs(rng, "p8_g8_h64_fp32")
  args = (jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(table), jnp.asarray(q_lengths, jnp.int32))
  run = jax.jit(lambda scale: paged_prefill_attention(q, k_pages, v_pages, *args, scale=scale,
                                                      local_window_size=(6, 0),
                                                      config=CASES["p8_g8_h64_fp32"][-1]))
  for scale in (0.3, 0.05):
    ref, _ = _reference(q, k_pages, v_pages, kv_lengths, clean, q_lengths, scale=scale, window=(6, 0))
    assert_close(run(jnp.float32(scale)), ref, FP32)
  assert run._cache_size() == 1


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_pool_with_options(kv_dtype, rng):
  """A one-byte pool, dequantized tile by tile after the load, with a window, sinks and a
  mask: float64 attention on the dequantized gathered pages."""
  batch, t, heads, kv_heads, head_dim, num_pages, page, max_pages = 2, 11, 5, 1, 64, 12, 8, 6
  kv_lengths, q_lengths = [43, 11], [11, 4]
  q = random_array(rng, (batch, t, heads, head_dim), FP32)
  k_pages, k_scale, v_pages, v_scale = _pools(rng, num_pages, page, kv_heads, head_dim, kv_dtype)
  table, clean = _make_table(rng, "scattered", batch, num_pages, max_pages, page, kv_lengths)
  mask, sinks = _mask(rng, batch, heads, t, max_pages * page), _sinks(rng, batch, heads, t, 0)
  out, lse = paged_prefill_attention(
      q, k_pages, v_pages, jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(table),
      jnp.asarray(q_lengths, jnp.int32), local_window_size=(10, 0), mask=mask, sinks=sinks,
      k_scale=k_scale, v_scale=v_scale, return_residual=True, config=PrefillConfig(16, 32, 4, 2))
  ref_out, ref_lse = _reference(q, _deq(k_pages, k_scale), _deq(v_pages, v_scale), np.asarray(kv_lengths),
                                clean, q_lengths, window=(10, 0), mask=mask, sinks=sinks)
  assert_close(out, ref_out, FP32)
  assert_close(lse, ref_lse, FP32, what="lse")


def test_attention_with_options_over_pages(rng):
  """jaxflash.attention with a block table and a window, soft-cap and bias (T > 1) reads the
  pages through the paged prefill kernel: the float64 answer on the gathered pages."""
  q, k_pages, v_pages, kv_lengths, table, clean, q_lengths = _case_inputs(rng, "p64_g5_h96_fp16")
  bias = _bias(rng, 1, q.shape[2], q.shape[1], table.shape[1] * k_pages.shape[1])
  out = jaxflash.attention(q, k_pages, v_pages, bias, key_value_seq_lengths=jnp.asarray(kv_lengths, jnp.int32),
                           query_seq_lengths=jnp.asarray(q_lengths, jnp.int32), block_table=jnp.asarray(table),
                           is_causal=True, causal_alignment="bottom_right", local_window_size=(20, 0),
                           logits_soft_cap=4.0)
  ref, _ = _reference(q, k_pages, v_pages, kv_lengths, clean, q_lengths, bias=bias, window=(20, 0),
                      softcap=4.0)
  assert_close(out, ref, FP16)


# jaxflash.attention's paged calls the paged decode kernel does not serve: each must run the
# one paged prefill kernel on the pool in place (no gather of its pages into [B, S, K, H]).
ATTENTION_PAGED_CALLS = {
    "window": dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(256, 0)),
    "softcap_sinks": dict(is_causal=True, causal_alignment="bottom_right", logits_soft_cap=30.0,
                          sinks=jnp.zeros((12,), FP32)),
    "top_left_causal": dict(is_causal=True),
    "traced_scale": dict(is_causal=True, causal_alignment="bottom_right", scale="traced"),
    "int8_pool_window": dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(256, 0),
                             k_scale="pool", v_scale="pool"),
}


def _equations_outside_kernels(jaxpr):
  """Every equation of a jaxpr and of the jaxprs it calls (jit, custom_jvp, ...), but not
  those of a pallas_call's kernel."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name != "pallas_call":
      for inner in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from _equations_outside_kernels(inner)


@pytest.mark.parametrize("name", list(ATTENTION_PAGED_CALLS), ids=list(ATTENTION_PAGED_CALLS))
def test_attention_paged_calls_read_pool_in_place(name):
  """One kernel launch, the paged prefill's, and outside it no array of an eighth of the
  pool's size or more but the pool's own bitcast to rows: no gather, copy or dequantization
  of the pool or of its pages gathered ([B, S, K, H])."""
  sds = jax.ShapeDtypeStruct
  options = dict(ATTENTION_PAGED_CALLS[name])
  page_size, num_pages, batch = 16, 1024, 2
  quantized = options.get("k_scale") == "pool"
  pool = sds((num_pages, page_size, 2, 128), jnp.int8 if quantized else BF16)
  traced = {key: sds(pool.shape[:3], FP32) for key in ("k_scale", "v_scale") if options.pop(key, None)}
  if options.pop("scale", None) == "traced":
    traced["scale"] = sds((), FP32)
  args = (sds((batch, 64, 12, 128), BF16), pool, pool, sds((batch,), jnp.int32),
          sds((batch, num_pages // batch), jnp.int32), sds((batch,), jnp.int32))

  def call(q, k, v, kv_lengths, table, q_lengths, extra):
    return jaxflash.attention(q, k, v, key_value_seq_lengths=kv_lengths, block_table=table,
                              query_seq_lengths=q_lengths, **options, **extra)

  equations = list(_equations_outside_kernels(jax.make_jaxpr(call)(*args, traced).jaxpr))
  launches = [eqn.params["name"] for eqn in equations if eqn.primitive.name == "pallas_call"]
  assert launches == ["jaxflash_paged_prefill"]
  pool_elements = num_pages * page_size * 2 * 128
  moved = [str(eqn) for eqn in equations if eqn.primitive.name not in ("pallas_call", "reshape")
           and any(np.prod(v.aval.shape) * 8 >= pool_elements for v in eqn.outvars)]
  assert moved == []


def test_paged_prefill_through_attention_is_not_differentiable(rng):
  q, k_pages, v_pages, kv_lengths, table, _, q_lengths = _case_inputs(rng, "p16_g2_h80_fp32")
  loss = lambda q: jaxflash.attention(q, k_pages, v_pages, key_value_seq_lengths=jnp.asarray(kv_lengths),
                                      block_table=jnp.asarray(table), local_window_size=(8, 0)).sum()
  with pytest.raises(NotImplementedError, match=r"paged prefill \(block_table\) is not differentiable"):
    jax.grad(loss)(q)
