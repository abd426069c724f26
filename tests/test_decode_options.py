"""Decode and paged decode with the attention options (bias, mask, sliding window, logit
soft-cap, sinks, traced scale) against the float64 reference (T = 1, bottom-right: the query
sits at position length - 1).

Each case runs on a contiguous cache and on the same tokens scattered over a page pool
(entries past a sequence's length are garbage, never read). Tiny shapes and 16- or 32-token
tiles, so the chunk and tile loops run several trips; the axes are covered pairwise.
"""
from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.configs import DecodeConfig
from jaxflash.decode import (SplitKV, _decode_attention, chunk_bounds, chunking, decode_attention,
                             decode_attention_reference, decode_combine_reference)
from jaxflash.paged import paged_decode_attention, paged_decode_attention_reference
from tests.conftest import assert_close, random_array
from tests.reference_np import attention_f64
from tests.test_decode import _poison

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32
GARBAGE = -12345

# name -> (batch, capacity, query heads, kv heads, head dim, dtype, lengths, num_splits,
#          block_k, page size, options). Options: bias/mask name their broadcast shape
# ("full" [B, N, 1, S], "heads" [N, 1, 1], "keys" [S], "batch_keys" [B, 1, 1, S], "scalar" []);
# window an int or (left, right); softcap; sinks; scale "traced" (a JAX scalar) or a float.
CASES = {
    "bias_full_g3_h80": (3, 64, 6, 2, 80, BF16, [0, 37, 64], 3, 16, 16, dict(bias="full")),
    "bias_heads_g5_h64": (2, 64, 5, 1, 64, FP16, [1, 63], 2, 16, 8, dict(bias="heads")),
    "bias_keys_g1_h96": (2, 48, 2, 2, 96, FP32, [48, 20], 2, 16, 16, dict(bias="keys")),
    "mask_full_g4_h128": (2, 64, 8, 2, 128, BF16, [64, 50], 2, 16, 32, dict(mask="full")),
    "mask_batch_keys_g7_h64": (2, 96, 7, 1, 64, BF16, [96, 40], 3, 32, 32, dict(mask="batch_keys")),
    "mask_heads_rows_empty_g2_h64": (2, 32, 4, 2, 64, FP32, [32, 9], 2, 16, 8, dict(mask="heads")),
    "window_g2_h256": (2, 96, 4, 2, 256, FP32, [96, 30], None, 16, 16, dict(window=20)),
    "window_left_right_g3_h64": (2, 128, 3, 1, 64, BF16, [128, 100], 2, 16, 8, dict(window=(33, 5))),
    "window_one_key_g4_h80": (3, 64, 4, 1, 80, FP16, [64, 1, 0], 4, 16, 16, dict(window=0)),
    "window_wider_than_cache_g2_h64": (2, 32, 2, 1, 64, BF16, [32, 5], 2, 16, 8, dict(window=100)),
    "softcap_g8_h128": (2, 64, 8, 1, 128, BF16, [64, 3], 2, 16, 16, dict(softcap=1.5, scale=0.9)),
    "sinks_g5_h96_one_chunk": (3, 48, 5, 1, 96, FP32, [48, 0, 17], 1, 16, 16, dict(sinks=True)),
    "sinks_g6_h64_chunks": (2, 64, 12, 2, 64, BF16, [0, 61], 4, 16, 8, dict(sinks=True)),
    "traced_scale_g17_h64": (2, 32, 17, 1, 64, BF16, [32, 11], 2, 16, 16, dict(scale="traced")),
    "all_g3_h128": (2, 96, 6, 2, 128, BF16, [96, 45], 3, 16, 16,
                    dict(bias="batch_keys", mask="full", window=(40, 0), softcap=2.0, sinks=True,
                         scale="traced")),
    "all_g32_h64": (2, 64, 32, 1, 64, FP16, [64, 0], 2, 16, 8,
                    dict(bias="full", mask="keys", window=25, softcap=3.0, sinks=True)),
}
BROADCAST = {"full": lambda b, n, s: (b, n, 1, s), "heads": lambda b, n, s: (n, 1, 1),
             "keys": lambda b, n, s: (s,), "batch_keys": lambda b, n, s: (b, 1, 1, s),
             "scalar": lambda b, n, s: ()}


def _options(rng, case):
  batch, capacity, heads, *_, opts = CASES[case]
  kernel, ref = {}, {}
  if "bias" in opts:
    bias = rng.standard_normal(BROADCAST[opts["bias"]](batch, heads, capacity)).astype(np.float32) * 2
    kernel["bias"], ref["bias"] = jnp.asarray(bias), bias
  if "mask" in opts:
    mask = rng.random(BROADCAST[opts["mask"]](batch, heads, capacity)) < 0.7
    if opts["mask"] == "heads":
      mask[1] = False  # query head 1 sees nothing: zeros and LSE -inf, never NaN
    kernel["mask"], ref["mask"] = jnp.asarray(mask), mask
  if "window" in opts:
    window = opts["window"]
    kernel["local_window_size"] = window
    ref["window"] = (window, window) if isinstance(window, int) else window
  if "softcap" in opts:
    kernel["logits_soft_cap"] = ref["softcap"] = opts["softcap"]
  if opts.get("sinks"):
    sinks = (rng.standard_normal(heads) * 2).astype(np.float32)
    kernel["sinks"], ref["sinks"] = jnp.asarray(sinks), sinks
  scale = opts.get("scale")
  if scale == "traced":
    kernel["scale"], ref["scale"] = jnp.float32(0.2), 0.2
  elif scale is not None:
    kernel["scale"] = ref["scale"] = scale
  return kernel, ref


def _paged(rng, k, v, lengths, page):
  """The caches' tokens scattered over a pool with spare pages; entries past the length garbage."""
  batch, capacity, kv_heads, head_dim = k.shape
  max_pages = capacity // page
  table = rng.permutation(batch * max_pages + 3)[:batch * max_pages].reshape(batch, max_pages)
  k_pages = random_array(rng, (batch * max_pages + 3, page, kv_heads, head_dim), k.dtype)
  v_pages = random_array(rng, (batch * max_pages + 3, page, kv_heads, head_dim), k.dtype)
  rows = k.reshape(batch * max_pages, page, kv_heads, head_dim)
  k_pages = k_pages.at[table.reshape(-1)].set(rows)
  v_pages = v_pages.at[table.reshape(-1)].set(v.reshape(batch * max_pages, page, kv_heads, head_dim))
  used = np.arange(max_pages)[None, :] < -(-np.asarray(lengths)[:, None] // page)
  return k_pages, v_pages, jnp.asarray(np.where(used, table, GARBAGE), jnp.int32)


def _inputs(rng, case):
  batch, capacity, heads, kv_heads, head_dim, dtype, lengths, *_ = CASES[case]
  q = random_array(rng, (batch, 1, heads, head_dim), dtype)
  k = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  v = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  return q, k, v, jnp.asarray(lengths, jnp.int32)


def _call(layout, rng, q, k, v, lengths, page, **kwargs):
  if layout == "contiguous":
    return decode_attention(q, k, v, lengths, **kwargs)
  k_pages, v_pages, table = _paged(rng, k, v, lengths, page)
  return paged_decode_attention(q, k_pages, v_pages, lengths, table, **kwargs)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_options_match_reference(case, layout, interpret, rng):
  *_, dtype, lengths, splits, block_k, page, _ = CASES[case]
  q, k, v, lengths = _inputs(rng, case)
  kernel_opts, ref_opts = _options(rng, case)
  if not interpret:
    _poison(q)
  out, lse = _call(layout, rng, q, k, v, lengths, page, num_splits=splits, config=DecodeConfig(block_k),
                   return_residual=True, interpret=interpret, **kernel_opts)
  chex.assert_shape(out, q.shape)
  chex.assert_shape(lse, q.shape[:3])
  assert out.dtype == dtype and lse.dtype == FP32
  ref_out, ref_lse = attention_f64(q, k, v, kv_lengths=np.asarray(lengths), **ref_opts)
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, FP32, what="lse")


@pytest.mark.parametrize("case", ["all_g3_h128", "sinks_g6_h64_chunks"])
def test_plain_jax_twins(case, rng):
  """decode_attention_reference and paged_decode_attention_reference take the same options."""
  *_, dtype, lengths, _, _, page, _ = CASES[case]
  q, k, v, lengths = _inputs(rng, case)
  kernel_opts, ref_opts = _options(rng, case)
  ref_out, ref_lse = attention_f64(q, k, v, kv_lengths=np.asarray(lengths), **ref_opts)
  out, lse = decode_attention_reference(q, k, v, lengths, **kernel_opts)
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, FP32, what="lse")
  k_pages, v_pages, table = _paged(rng, k, v, lengths, page)
  clean = jnp.where(table < 0, 0, table)
  out, lse = paged_decode_attention_reference(q, k_pages, v_pages, lengths, clean, **kernel_opts)
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, FP32, what="lse")


# --------------------------------------------------------------------------------------
# Sinks through the chunks' partials: the SplitKV carries the sink as one more chunk.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_sinks_in_split_kv(layout, interpret, rng):
  case = "sinks_g6_h64_chunks"
  *_, dtype, lengths, splits, block_k, page, _ = CASES[case]
  q, k, v, lengths = _inputs(rng, case)
  kernel_opts, ref_opts = _options(rng, case)
  split = _call(layout, rng, q, k, v, lengths, page, num_splits=splits, config=DecodeConfig(block_k),
                return_partials=True, interpret=interpret, **kernel_opts)
  assert isinstance(split, SplitKV)
  batch, heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
  chex.assert_shape(split.out, (batch, splits + 1, heads, head_dim))  # the last chunk: the sink's
  np.testing.assert_array_equal(np.asarray(split.out[:, -1]), 0.0)
  np.testing.assert_allclose(np.asarray(split.lse2[:, -1]),
                             np.broadcast_to(ref_opts["sinks"] / np.log(2.0), (batch, heads)), rtol=1e-6)
  ref_out, ref_lse = attention_f64(q, k, v, kv_lengths=np.asarray(lengths), **ref_opts)
  merged, lse = decode_combine_reference(jnp.swapaxes(split.out, 1, 2),
                                         jnp.swapaxes(split.lse2, 1, 2) * np.log(2.0))
  assert_close(merged[:, None], ref_out, dtype)  # p @ v ran in the inputs' dtype
  assert_close(lse[:, None], ref_lse, FP32, what="lse")
  # The merge and output projection of jaxflash.project_split_kv counts the sink once too.
  w = random_array(rng, (heads * head_dim, 24), FP32)
  projected = jaxflash.project_split_kv(split, w, interpret=interpret)
  expect = ref_out.reshape(batch, 1, heads * head_dim) @ np.asarray(w, np.float64)
  assert_close(projected, expect, dtype)


def test_empty_cache_with_sinks(interpret):
  q = jnp.ones((2, 1, 4, 64), BF16)
  cache = jnp.ones((2, 0, 2, 64), BF16)
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], FP32)
  out, lse = decode_attention(q, cache, cache, sinks=sinks, return_residual=True, interpret=interpret)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(np.asarray(sinks), (2, 1, 4)))


# --------------------------------------------------------------------------------------
# A traced scale is an operand: new values never recompile, and jit of a scale works.
# --------------------------------------------------------------------------------------

def test_traced_scale_does_not_recompile(interpret, rng):
  case = "traced_scale_g17_h64"
  *_, lengths, splits, block_k, _, _ = CASES[case]
  q, k, v, lengths = _inputs(rng, case)
  call = functools.partial(decode_attention, q, k, v, lengths, num_splits=splits,
                           config=DecodeConfig(block_k), interpret=interpret)
  call(scale=jnp.float32(0.5)).block_until_ready()
  compiled = _decode_attention._cache_size()
  for scale in (0.1, 0.3, 1.7):
    out = call(scale=jnp.float32(scale))
    assert_close(out, attention_f64(q, k, v, scale=scale, kv_lengths=np.asarray(lengths))[0], BF16)
  assert _decode_attention._cache_size() == compiled
  out = jax.jit(lambda s: call(scale=s * 2.0))(jnp.float32(0.15))  # a tracer from an outer jit
  assert_close(out, attention_f64(q, k, v, scale=0.3, kv_lengths=np.asarray(lengths))[0], BF16)


# --------------------------------------------------------------------------------------
# A windowed decode reads only the window and splits only it over the SMs.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, kv_heads", [(1, 2), (1, 8), (16, 8)])
@pytest.mark.parametrize("left", [4095, 4096])
def test_window_reads_only_the_window(batch, kv_heads, left):
  """At 128K capacity with a window of left + 1 keys the kernel's chunks (the `chunk_bounds`
  each program computes from its sequence's length) cover the window's keys and at most
  one tile more, whatever the length, in at most one chunk more than a plain decode of a
  4096-token cache launches. Without a window the same call would split all 128K."""
  capacity, block_k = 131072, 64
  chunk, chunks = chunking(None, batch, kv_heads, capacity, block_k, window_left=left)
  plain_chunk, plain_chunks = chunking(None, batch, kv_heads, 4096, block_k)
  assert plain_chunks <= chunks <= plain_chunks + 1
  assert chunk <= plain_chunk + block_k
  for length in (0, 1, 63, 64, 4095, 4096, 4097, 4161, 70001, capacity - 1, capacity):
    lo, start, num = (np.asarray(x) for x in jax.vmap(functools.partial(
        chunk_bounds, jnp.int32(length), chunk=chunk, block_k=block_k, window_left=left))(
            jnp.arange(chunks)))
    visible = np.zeros(capacity, bool)
    visible[max(0, length - 1 - left):length] = True
    read = np.zeros(capacity, bool)
    for s, n in zip(start, num):
      assert 0 <= s and (n == 0 or s + n <= length)
      read[s:s + n] = True
    assert (read >= visible).all()  # every key the query sees is read
    assert read.sum() <= min(length, left + 1) + block_k - 1  # and at most one tile more
    assert read.sum() == 0 or read.argmax() >= lo[0] - lo[0] % block_k
  assert chunking(None, batch, kv_heads, capacity, block_k)[0] >= 2048 or batch > 1  # 128K plain


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_window_at_long_capacity(layout, interpret, rng):
  """A small window over a longer cache: chunks of the window only, ragged lengths."""
  batch, capacity, heads, kv_heads, head_dim, window, page = 3, 512, 4, 2, 64, 37, 16
  q = random_array(rng, (batch, 1, heads, head_dim), BF16)
  k = random_array(rng, (batch, capacity, kv_heads, head_dim), BF16)
  v = random_array(rng, (batch, capacity, kv_heads, head_dim), BF16)
  lengths = jnp.asarray([512, 300, 20], jnp.int32)
  if not interpret:
    _poison(q)
  out, lse = _call(layout, rng, q, k, v, lengths, page, local_window_size=window, num_splits=3,
                   config=DecodeConfig(16), return_residual=True, interpret=interpret)
  ref_out, ref_lse = attention_f64(q, k, v, kv_lengths=np.asarray(lengths), window=(window, window))
  assert_close(out, ref_out, BF16)
  assert_close(lse, ref_lse, FP32, what="lse")


# --------------------------------------------------------------------------------------
# Lowered for CUDA (no GPU needed): what the Triton call takes and how many programs it runs.
# --------------------------------------------------------------------------------------

def _triton_call(capacity: int, **options):
  """(operands, grid) of the split-KV kernel's custom call for B = 1, 8 query heads on 2 KV
  heads, d = 128, bf16."""
  sds = jax.ShapeDtypeStruct
  cache = sds((1, capacity, 2, 128), BF16)
  args = (sds((1, 1, 8, 128), BF16), cache, cache, sds((1,), jnp.int32))
  fn = functools.partial(decode_attention, interpret=False, **options)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
  operands = call.split("triton(", 1)[1].split(")", 1)[0].split(", ")
  grid = tuple(int(re.search(rf"grid_{axis} = (\d+)", call).group(1)) for axis in "xyz")
  return operands, grid


def test_no_option_adds_no_operand():
  """Without options the kernel takes lengths, q, k and v only, as before options existed."""
  assert len(_triton_call(1024, num_splits=1)[0]) == 4
  assert len(_triton_call(1024, num_splits=1, sinks=jnp.zeros(8))[0]) == 5
  assert len(_triton_call(1024, num_splits=1, bias=jnp.zeros(1024), mask=jnp.ones(1024, bool))[0]) == 6


@pytest.mark.parametrize("page", [None, 8, 64])
@pytest.mark.parametrize("heads, splits", [(8, 1), (8, 4), (128, 4)])
@pytest.mark.parametrize("broadcast", ["full", "scalar"])
def test_every_option_lowers_to_triton(page, heads, splits, broadcast):
  """Every option at once, with tiles of one and several chunks and several row blocks, goes
  through the Pallas-Triton lowering (to Triton IR, no GPU needed)."""
  sds = jax.ShapeDtypeStruct
  batch, capacity = 2, 1024
  shape = BROADCAST[broadcast](batch, heads, capacity)
  options = dict(bias=sds(shape, BF16), mask=sds(shape, jnp.bool_), sinks=sds((heads,), FP32),
                 scale=sds((), FP32))
  q = sds((batch, 1, heads, 128), BF16)
  if page is None:
    cache = sds((batch, capacity, 2, 128), BF16)
    call = lambda q, k, v, n, t, **o: decode_attention(q, k, v, n, **o)  # noqa: E731
  else:
    cache = sds((batch * capacity // page, page, 2, 128), BF16)
    call = paged_decode_attention
  for return_partials in (False, True):
    fn = functools.partial(call, local_window_size=(300, 0), logits_soft_cap=30.0, num_splits=splits,
                           return_partials=return_partials, interpret=False)
    text = jax.jit(fn).trace(q, cache, cache, sds((batch,), jnp.int32),
                             sds((batch, capacity // (page or 1)), jnp.int32), **options).lower(
                                 lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 + (not return_partials and splits > 1)


def test_windowed_launch_is_a_window_sized_launch():
  """The 128K-capacity call with a 4096-token window launches the programs of a plain
  4096-token decode (at most one chunk more, for the window's start inside a tile)."""
  _, windowed = _triton_call(131072, local_window_size=(4095, 0))
  _, windowed_wide = _triton_call(131072, local_window_size=4096)  # 4097 keys
  _, plain = _triton_call(4096)
  for grid in (windowed, windowed_wide):  # grid axes: batch 1, 2 KV heads, the chunks
    assert sorted(grid)[:2] == sorted(plain)[:2]
    assert max(plain) <= max(grid) <= max(plain) + 1
  assert _triton_call(1024, local_window_size=100, num_splits=1)[1] == (1, 2, 1)  # splits as asked


# --------------------------------------------------------------------------------------
# Errors name the argument and its shape.
# --------------------------------------------------------------------------------------

def _bad_call(paged=False, **options):
  q = jnp.zeros((2, 1, 4, 64), BF16)
  if paged:
    pages = jnp.zeros((6, 16, 2, 64), BF16)
    return paged_decode_attention(q, pages, pages, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32),
                                  interpret=True, **options)
  cache = jnp.zeros((2, 32, 2, 64), BF16)
  return decode_attention(q, cache, cache, interpret=True, **options)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("options, error, message", [
    (dict(bias=jnp.zeros((2, 4, 2, 32))), ValueError,
     r"bias must be broadcastable to \[B, N, 1, S\].*\(2, 4, 2, 32\)"),
    (dict(bias=jnp.zeros((3, 1, 1, 32))), ValueError, r"bias .*shape \(3, 1, 1, 32\)"),
    (dict(bias=jnp.zeros((31,))), ValueError, r"bias .*shape \(31,\)"),
    (dict(bias=jnp.zeros((1, 2, 4, 1, 32))), ValueError, r"bias .*shape \(1, 2, 4, 1, 32\)"),
    (dict(bias=jnp.zeros((32,), jnp.int32)), TypeError, r"bias must be bfloat16, float16 or float32"),
    (dict(mask=jnp.ones((2, 4, 1, 33), bool)), ValueError, r"mask must be broadcastable.*\(2, 4, 1, 33\)"),
    (dict(mask=jnp.ones((32,), jnp.float32)), TypeError, r"mask must be a boolean array"),
    (dict(sinks=jnp.zeros((2,))), ValueError, r"sinks must have shape \(4,\).*\(2,\)"),
    (dict(sinks=jnp.zeros((4,), jnp.int32)), TypeError, r"sinks must be a float array"),
    (dict(local_window_size=-1), ValueError, r"local_window_size must be"),
    (dict(local_window_size=(3, 4, 5)), ValueError, r"local_window_size must be"),
    (dict(logits_soft_cap=0.0), ValueError, r"logits_soft_cap must be"),
    (dict(scale=jnp.ones((2,))), ValueError, r"scale must be a real scalar.*\(2,\)"),
    (dict(scale="big"), TypeError, r"scale must be a number"),
])
def test_bad_options(paged, options, error, message):
  with pytest.raises(error, match=message):
    _bad_call(paged, **options)
