"""Split-KV decode kernel (jaxflash/decode.py) against the float64 reference.

Interpret-mode budget: capacities <= 300 tokens, few heads, small tiles (DecodeConfig(16))
so the chunk and tile loops run many trips; cases cover the axes pairwise, not as a product.
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
from jaxflash.decode import (_combine, _decode_attention, decode_attention, decode_attention_reference,
                             decode_combine_reference)
from tests.conftest import assert_close, poison_allocator, random_array
from tests.reference_np import attention_f64

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (batch, capacity, query heads, kv heads, head dim, dtype, lengths, num_splits, config)
CASES = {
    # G=3, H=80 (masked head dim), single split: the kernel writes the final result itself.
    "g3_h80_bf16_one_split": (3, 100, 6, 2, 80, BF16, [0, 37, 100], 1, DecodeConfig(16)),
    # G=5, fp16, ragged lengths 1 and capacity-1 over 3 chunks of 32-token tiles.
    "g5_h64_fp16_3_splits": (2, 130, 5, 1, 64, FP16, [1, 129], 3, DecodeConfig(32)),
    # G=7, H=96, fp32 (exact dots), default splits and config.
    "g7_h96_fp32_default": (2, 64, 7, 1, 96, FP32, [64, 17], None, None),
    # G=8, full capacity for every sequence (lengths None), 4 chunks of 3-4 tiles each.
    "g8_h128_bf16_full": (1, 200, 8, 1, 128, BF16, None, 4, DecodeConfig(16)),
    # G=1 (multi-head), H=256, fp32; one sequence empty.
    "g1_h256_fp32_empty_row": (2, 48, 4, 4, 256, FP32, [33, 0], 2, DecodeConfig(16)),
    # G=4, far more splits than tiles: clamped to one tile per chunk, most chunks empty.
    "g4_h128_fp16_many_splits": (2, 90, 8, 2, 128, FP16, [5, 90], 16, DecodeConfig(16)),
    # G=2, every sequence empty: zeros and LSE -inf, no NaN anywhere.
    "g2_h64_bf16_all_empty": (3, 40, 2, 1, 64, BF16, [0, 0, 0], 2, DecodeConfig(16)),
    # G=2, 3 KV heads, the tuned config and split count at a capacity of 300.
    "g2_h64_bf16_tuned": (2, 300, 6, 3, 64, BF16, [257, 300], None, None),
}


def _poison(q):
  """Before a compiled call: NaN in the memory the outputs will get (conftest)."""
  poison_allocator(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:3], FP32))


def _inputs(rng, batch, capacity, heads, kv_heads, head_dim, dtype):
  q = random_array(rng, (batch, 1, heads, head_dim), dtype)
  k = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  v = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  return q, k, v


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_decode_matches_reference(case, interpret, rng):
  batch, capacity, heads, kv_heads, head_dim, dtype, lengths, splits, config = CASES[case]
  q, k, v = _inputs(rng, batch, capacity, heads, kv_heads, head_dim, dtype)
  lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
  if not interpret:
    _poison(q)
  out, lse = decode_attention(q, k, v, lengths, num_splits=splits, config=config,
                              return_residual=True, interpret=interpret)
  chex.assert_shape(out, q.shape)
  chex.assert_shape(lse, q.shape[:3])
  assert out.dtype == dtype and lse.dtype == jnp.float32
  ref_out, ref_lse = attention_f64(q, k, v, kv_lengths=None if lengths is None else np.asarray(lengths))
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, jnp.float32, what="lse")
  if lengths is not None:  # length 0: exact zeros, LSE -inf
    empty = np.asarray(lengths) == 0
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
    assert np.all(np.asarray(lse)[empty] == -np.inf)


def test_scale_and_clamped_lengths(interpret, rng):
  """An explicit scale; traced lengths (under jit: concrete ones raise) past the capacity
  read as the capacity, negative as 0. (Shapes of an earlier case: no new compilation.)"""
  batch, capacity, heads, kv_heads, head_dim, dtype, _, splits, config = CASES["g3_h80_bf16_one_split"]
  q, k, v = _inputs(rng, batch, capacity, heads, kv_heads, head_dim, dtype)
  lengths = jnp.asarray([1000, -3, 64], jnp.int32)
  if not interpret:
    _poison(q)
  out, lse = jax.jit(lambda lengths: decode_attention(
      q, k, v, lengths, scale=0.3, num_splits=splits, config=config, return_residual=True,
      interpret=interpret))(lengths)
  ref_out, ref_lse = attention_f64(q, k, v, scale=0.3, kv_lengths=np.array([capacity, 0, 64]))
  assert_close(out, ref_out, dtype)
  assert_close(lse, ref_lse, jnp.float32, what="lse")
  jax_out, jax_lse = decode_attention_reference(q, k, v, lengths, scale=0.3)  # the plain-JAX twin
  assert_close(jax_out, ref_out, dtype, what="reference output")
  assert_close(jax_lse, ref_lse, jnp.float32, what="reference lse")


def test_lengths_change_without_recompiling(interpret, rng):
  batch, capacity, heads, kv_heads, head_dim, dtype, _, splits, config = CASES["g5_h64_fp16_3_splits"]
  q, k, v = _inputs(rng, batch, capacity, heads, kv_heads, head_dim, dtype)
  call = functools.partial(decode_attention, num_splits=splits, config=config, interpret=interpret)
  call(q, k, v, jnp.asarray([3, 4], jnp.int32)).block_until_ready()
  compiled = _decode_attention._cache_size()
  for lengths in ([0, 130], [77, 31], [129, 1]):
    out = call(q, k, v, jnp.asarray(lengths, jnp.int32))
    ref, _ = attention_f64(q, k, v, kv_lengths=np.asarray(lengths))
    assert_close(out, ref, dtype)
  assert _decode_attention._cache_size() == compiled


def test_combine_matches_reference(interpret, rng):
  """The combine kernel alone, on partials with empty (-inf) chunks and an all-empty row."""
  batch, splits, heads, head_dim = 2, 5, 3, 80
  o_part = jnp.asarray(rng.standard_normal((batch, splits, heads, head_dim)), jnp.float32)
  lse_part = rng.standard_normal((batch, splits, heads)) * 4.0
  lse_part[0, 1:3] = -np.inf
  lse_part[1, :, 2] = -np.inf
  lse_part = jnp.asarray(lse_part, jnp.float32)
  out, lse = _combine(o_part, lse_part / np.log(2.0), out_dtype=jnp.float32, interpret=interpret)
  ref_out, ref_lse = decode_combine_reference(jnp.moveaxis(o_part, 1, 2), jnp.moveaxis(lse_part, 1, 2))
  assert_close(out, ref_out, jnp.float32)
  assert_close(lse, ref_lse, jnp.float32, what="lse")


@pytest.mark.parametrize("is_causal", [False, True])
def test_through_attention(is_causal, rng):
  """jaxflash.attention with T == 1 dispatches here; causal or not, one token sees every
  valid key (bottom-right alignment), and the "xla" path agrees. Runs compiled on a GPU,
  interpreted elsewhere."""
  batch, capacity, heads, kv_heads, head_dim, dtype, lengths, *_ = CASES["g2_h64_bf16_tuned"]
  q, k, v = _inputs(rng, batch, capacity, heads, kv_heads, head_dim, dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  ref_out, ref_lse = attention_f64(q, k, v, kv_lengths=np.asarray(lengths))
  for implementation in (None, "xla"):
    out, lse = jaxflash.attention(q, k, v, key_value_seq_lengths=lengths, is_causal=is_causal,
                                  causal_alignment="bottom_right", return_residual=True, implementation=implementation)
    assert_close(out, ref_out, dtype, what=f"output ({implementation})")
    assert_close(lse, ref_lse, jnp.float32, what=f"lse ({implementation})")


def test_empty_capacity(interpret):
  q = jnp.ones((2, 1, 4, 64), BF16)
  cache = jnp.ones((2, 0, 2, 64), BF16)
  out, lse = decode_attention(q, cache, cache, return_residual=True, interpret=interpret)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert np.all(np.asarray(lse) == -np.inf)


# --------------------------------------------------------------------------------------
# The cache is read in place: no transpose, copy or gather of it anywhere in the program.
# --------------------------------------------------------------------------------------

_HLO_OP = re.compile(r"=\s*\(?\w+\[([\d,]*)\][^=]*?\s(transpose|copy|copy-start|gather|dynamic-slice|"
                     r"concatenate|pad|slice|convert)\(")
_STABLEHLO_OP = re.compile(r"stablehlo\.(transpose|gather|dynamic_slice|concatenate|pad|slice|copy|"
                           r"convert)\b.*->\s*tensor<([\dx]+)x\w+>")


def cache_sized_data_movement(text: str, cache_elements: int) -> list[str]:
  """Lines of HLO (compiled) or StableHLO text that move an array of at least an eighth
  of the cache: transposes, copies, gathers, slices, pads, concatenations, converts."""
  found = []
  for line in text.splitlines():
    for match in _HLO_OP.finditer(line):
      dims = [int(d) for d in match.group(1).split(",") if d]
      if np.prod(dims, dtype=np.int64) * 8 >= cache_elements:
        found.append(line.strip())
    match = _STABLEHLO_OP.search(line)
    if match:
      dims = [int(d) for d in match.group(2).split("x") if d]
      if np.prod(dims, dtype=np.int64) * 8 >= cache_elements:
        found.append(line.strip())
  return found


def _decode_shapes(splits):
  batch, capacity, heads, kv_heads, head_dim = 2, 4096, 12, 2, 128
  sds = jax.ShapeDtypeStruct
  args = (sds((batch, 1, heads, head_dim), BF16), sds((batch, capacity, kv_heads, head_dim), BF16),
          sds((batch, capacity, kv_heads, head_dim), BF16), sds((batch,), jnp.int32))
  fn = functools.partial(decode_attention, num_splits=splits, return_residual=True, interpret=False)
  return fn, args, batch * capacity * kv_heads * head_dim


@pytest.mark.parametrize("splits", [1, 8])
def test_lowers_to_triton_reading_cache_in_place(splits):
  """Lowered for CUDA (no GPU needed): the Triton lowering accepts the kernels, and the
  program hands the caches to the kernel as they are."""
  fn, args, cache_elements = _decode_shapes(splits)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == (1 if splits == 1 else 2)
  assert cache_sized_data_movement(text, cache_elements) == []
  # Both caches enter the split kernel's custom call directly as function arguments.
  call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
  assert "%arg1" in call and "%arg2" in call, call


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 8])
def test_compiled_hlo_reads_cache_in_place(splits):
  fn, args, cache_elements = _decode_shapes(splits)
  text = jax.jit(fn).lower(*args).compile().as_text()
  assert cache_sized_data_movement(text, cache_elements) == [], text


# --------------------------------------------------------------------------------------
# Errors name the argument and the shapes.
# --------------------------------------------------------------------------------------

def _bad_call(**changes):
  args = dict(query=jnp.zeros((2, 1, 4, 64), BF16), k_cache=jnp.zeros((2, 32, 2, 64), BF16),
              v_cache=jnp.zeros((2, 32, 2, 64), BF16), key_value_seq_lengths=None)
  kwargs = {key: changes.pop(key) for key in ("num_splits", "config", "scale") if key in changes}
  args.update(changes)
  return decode_attention(*args.values(), interpret=True, **kwargs)


@pytest.mark.parametrize("changes, error, message", [
    (dict(query=jnp.zeros((2, 2, 4, 64), BF16)), ValueError, r"one query token.*\(2, 2, 4, 64\)"),
    (dict(query=jnp.zeros((3, 1, 4, 64), BF16)), ValueError, r"batch.*\(3, 1, 4, 64\)"),
    (dict(query=jnp.zeros((2, 1, 3, 64), BF16)), ValueError, r"multiple of k_cache heads"),
    (dict(query=jnp.zeros((2, 1, 4, 32), BF16)), ValueError, r"head dim.*k_cache \(2, 32, 2, 64\)"),
    (dict(query=jnp.zeros((2, 1, 4, 64), jnp.int8)), TypeError, r"query must be bfloat16"),
    (dict(v_cache=jnp.zeros((2, 16, 2, 64), BF16)), ValueError, r"k_cache and v_cache.*same shape"),
    (dict(v_cache=jnp.zeros((2, 32, 2, 64), FP16)), TypeError, r"k_cache and v_cache.*dtype"),
    (dict(k_cache=jnp.zeros((2, 32, 64), BF16)), ValueError, r"k_cache must have rank 4"),
    (dict(key_value_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, r"key_value_seq_lengths.*\(2,\)"),
    (dict(key_value_seq_lengths=jnp.zeros((2,), jnp.float32)), TypeError, r"key_value_seq_lengths.*integer"),
    (dict(num_splits=0), ValueError, r"num_splits must be a positive int"),
    (dict(config=DecodeConfig(24)), ValueError, r"block_k must be a power of two"),
    (dict(config=DecodeConfig(1024, num_stages=8)), ValueError, r"shared memory"),
])
def test_bad_inputs(changes, error, message):
  with pytest.raises(error, match=message):
    _bad_call(**changes)


# --------------------------------------------------------------------------------------
# Every GQA ratio: groups of more than 16 query heads take rows of 32 or 64, and groups of
# more than 64 several programs per KV head (jaxflash.configs.decode_query_rows).
# --------------------------------------------------------------------------------------

# group -> KV heads: two KV heads where a group spans a padded tile or several row blocks (96:
# a full block of 64 rows and a padded one of 32 heads),
# so the row-block index of the second KV head is exercised too.
GQA_GROUPS = {1: 3, 2: 2, 3: 2, 4: 1, 5: 2, 6: 1, 7: 1, 8: 2, 16: 1, 17: 2, 24: 2, 32: 1, 64: 2, 96: 2,
              128: 1}


@pytest.mark.parametrize("group", list(GQA_GROUPS), ids=[f"g{g}" for g in GQA_GROUPS])
def test_every_gqa_ratio(group, interpret, rng):
  """Every query head of every group is written and right (poisoned outputs; interpret mode
  starts outputs as NaN), over two chunks with a ragged and an empty sequence."""
  kv_heads = GQA_GROUPS[group]
  q, k, v = _inputs(rng, 2, 40, group * kv_heads, kv_heads, 64, BF16)
  lengths = jnp.asarray([37, 0] if group % 2 else [40, 19], jnp.int32)
  if not interpret:
    _poison(q)
  out, lse = decode_attention(q, k, v, lengths, num_splits=2, config=DecodeConfig(16),
                              return_residual=True, interpret=interpret)
  ref_out, ref_lse = attention_f64(q, k, v, kv_lengths=np.asarray(lengths))
  assert_close(out, ref_out, BF16)
  assert_close(lse, ref_lse, jnp.float32, what="lse")
