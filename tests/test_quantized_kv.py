"""Quantized KV caches (jaxflash/quantize.py): int8 and float8_e4m3fn caches with one float32
scale per token and KV head, read by the split-KV decode, the paged decode and the paged
prefill, written by the cache-write helpers, and kept by the model and the engine.

The kernels are checked against a float64 reference on the dequantized cache (so the
quantization itself is not part of the tolerance), the quantization against its error
bounds, and the model's greedy tokens with int8 / FP8 KV against its float KV tokens.
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.configs import DecodeConfig, PrefillConfig
from jaxflash.decode import decode_attention
from jaxflash.paged import paged_decode_attention, paged_kv_write
from jaxflash.paged_prefill import paged_prefill_attention
from jaxflash.quantize import dequantize_kv
from tests.conftest import assert_close, random_array
from tests.reference_np import attention_f64, gather_pages_np
from tests.test_paged import _make_table

BF16, FP32 = jnp.bfloat16, jnp.float32
INT8, FP8 = jnp.int8, jnp.float8_e4m3fn
KV_DTYPES = {"int8": INT8, "fp8": FP8}


def _quantized(rng, shape, kv_dtype, scale=1.0):
  """A random float cache of `shape` and its quantized form: (x, x_q, scales)."""
  x = random_array(rng, shape, FP32, scale)
  x_q, scales = jaxflash.quantize_kv(x, kv_dtype)
  return x, x_q, scales


def _deq(x_q, scales, dtype=FP32):
  """The cache as the kernels see it: dequantized in float32, then rounded to the matmuls'
  dtype (the query's), in float64."""
  return np.asarray(dequantize_kv(x_q, scales, dtype).astype(FP32), np.float64)


# --------------------------------------------------------------------------- quantize_kv

@pytest.mark.parametrize("shape", [(3, 17, 2, 64), (5, 80), (2, 9, 7, 96)])
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES), ids=list(KV_DTYPES))
def test_quantize_error_bounds(shape, kv_dtype, rng):
  """int8: every element within half a step (scale / 2); e4m3: within 2^-4 relative (3
  mantissa bits, round to nearest) plus half its subnormal spacing, 2^-10 * scale."""
  dtype = KV_DTYPES[kv_dtype]
  x = random_array(rng, shape, FP32, scale=float(rng.uniform(0.01, 100.0)))
  x_q, scales = jaxflash.quantize_kv(x, dtype)
  chex.assert_shape(x_q, shape)
  chex.assert_shape(scales, shape[:-1])
  assert x_q.dtype == dtype and scales.dtype == FP32
  x64, s64 = np.asarray(x, np.float64), np.asarray(scales, np.float64)
  qmax = 127.0 if dtype == INT8 else 448.0
  np.testing.assert_allclose(s64, np.abs(x64).max(-1) / qmax, rtol=1e-6)
  err = np.abs(x64 - _deq(x_q, scales))
  slack = 1e-6 * np.abs(x64)  # float32 rounding of x / scale and of the product
  if dtype == INT8:
    bound = s64[..., None] / 2
  else:
    bound = np.abs(x64) * 2.0 ** -4 + s64[..., None] * 2.0 ** -10
  assert np.all(err <= bound + slack), f"max excess {(err - bound - slack).max():.3g}"
  # Each row's absmax element is hit exactly (it maps onto +-qmax).
  top = np.argmax(np.abs(x64), -1)[..., None]
  np.testing.assert_allclose(np.take_along_axis(err, top, -1), 0.0, atol=1e-6 * np.abs(x64).max())


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES), ids=list(KV_DTYPES))
def test_quantize_zero_and_nan_rows(kv_dtype, rng):
  """A zero row: scale 0, zeros back (no NaN). A row holding NaN: NaN scale, NaN back in that
  row only."""
  dtype = KV_DTYPES[kv_dtype]
  x = np.array(random_array(rng, (4, 3, 32), FP32))
  x[1, 2] = 0.0
  x[2, 0, 5] = np.nan
  x_q, scales = jaxflash.quantize_kv(jnp.asarray(x), dtype)
  deq = np.asarray(dequantize_kv(x_q, scales))
  assert float(scales[1, 2]) == 0.0 and np.all(deq[1, 2] == 0.0)
  assert np.isnan(float(scales[2, 0])) and np.all(np.isnan(deq[2, 0]))
  rest = np.ones(x.shape[:2], bool)
  rest[2, 0] = False
  assert not np.isnan(deq[rest]).any()


def test_quantize_bad_arguments():
  x = jnp.ones((2, 8), FP32)
  with pytest.raises(ValueError, match="dtype must be jnp.int8 or jnp.float8_e4m3fn"):
    jaxflash.quantize_kv(x, jnp.bfloat16)
  with pytest.raises(TypeError, match="x must be a float array"):
    jaxflash.quantize_kv(jnp.ones((2, 8), jnp.int32), INT8)


# --------------------------------------------------------------------------- split-KV decode

# (batch, capacity, query heads, KV heads, head dim, query dtype, KV dtype, lengths, splits,
#  options): GQA ratios 1, 2, 5, 7 and 8, odd lengths, head dims 64 / 80 / 96.
DECODE_CASES = {
    "g1_h64_int8_bf16": (2, 37, 2, 2, 64, BF16, INT8, [37, 11], 2, {}),
    "g2_h80_fp8_fp32": (2, 45, 4, 2, 80, FP32, FP8, [45, 1], 3, {}),
    "g5_h96_int8_fp32_window": (2, 53, 10, 2, 96, FP32, INT8, [53, 29], 2,
                                dict(local_window_size=(17, 0), logits_soft_cap=20.0)),
    "g7_h64_fp8_bf16_sinks": (3, 33, 7, 1, 64, BF16, FP8, [33, 0, 19], 2, dict(sinks=True)),
    "g8_h64_int8_fp32_bias_mask": (2, 41, 16, 2, 64, FP32, INT8, [41, 23], 1,
                                   dict(bias=True, mask=True)),
}


def _options(rng, options, batch, heads, capacity):
  """The case's options as decode_attention keywords, and attention_f64's."""
  kernel, ref = {}, {}
  for name, value in options.items():
    if name == "sinks":
      kernel["sinks"] = ref["sinks"] = random_array(rng, (heads,), FP32)
    elif name == "bias":
      kernel["bias"] = ref["bias"] = random_array(rng, (batch, heads, 1, capacity), FP32)
    elif name == "mask":
      kernel["mask"] = ref["mask"] = jnp.asarray(rng.random((batch, 1, 1, capacity)) < 0.8)
    elif name == "local_window_size":
      kernel[name], ref["window"] = value, value
    elif name == "logits_soft_cap":
      kernel[name], ref["softcap"] = value, value
  return kernel, ref


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_matches_dequantized_reference(case, interpret, rng):
  batch, capacity, heads, kv_heads, head_dim, q_dtype, kv_dtype, lengths, splits, options = DECODE_CASES[case]
  q = random_array(rng, (batch, 1, heads, head_dim), q_dtype)
  _, k_q, k_scale = _quantized(rng, (batch, capacity, kv_heads, head_dim), kv_dtype, 3.0)
  _, v_q, v_scale = _quantized(rng, (batch, capacity, kv_heads, head_dim), kv_dtype)
  kernel_options, ref_options = _options(rng, options, batch, heads, capacity)
  lengths = jnp.asarray(lengths, jnp.int32)
  out, lse = decode_attention(q, k_q, v_q, lengths, k_scale=k_scale, v_scale=v_scale, num_splits=splits,
                              config=DecodeConfig(16), return_residual=True, interpret=interpret,
                              **kernel_options)
  chex.assert_shape(out, q.shape)
  assert out.dtype == q_dtype and lse.dtype == FP32
  ref_out, ref_lse = attention_f64(q, _deq(k_q, k_scale), _deq(v_q, v_scale),
                                   kv_lengths=np.asarray(lengths), **ref_options)
  assert_close(out, ref_out, q_dtype)
  assert_close(lse, ref_lse, FP32, what="lse")


def test_long_context_accuracy(rng, capsys):
  """At 3000 tokens the quantized decode stays close to the float cache's exact answer (the
  accumulation is float32 throughout): relative error (Frobenius norm, over 64 query rows)
  below 3e-2 for int8 and 1.5e-1 for FP8 against float64 on the unquantized cache. Over 1000
  seeds of these shapes the largest errors were 2.0e-2 (int8) and 9.4e-2 (e4m3; medians 1.3e-2
  and 6.0e-2): int8 steps are 1/254 of a row's range, e4m3's up to 1/16 of a value, and a peaked
  softmax leans on few keys, so the error of a few rows has a long tail, which the 64 rows
  average down. The errors measured are printed."""
  batch, capacity, heads, kv_heads, head_dim = 4, 3001, 8, 2, 64
  q = random_array(rng, (batch, 1, heads, head_dim), FP32, 2.0)  # peaked softmax: few keys dominate
  k = random_array(rng, (batch, capacity, kv_heads, head_dim), FP32)
  v = random_array(rng, (batch, capacity, kv_heads, head_dim), FP32)
  exact, _ = attention_f64(q, k, v)
  for kv_dtype, bound in ((INT8, 3e-2), (FP8, 1.5e-1)):
    (k_q, k_scale), (v_q, v_scale) = jaxflash.quantize_kv(k, kv_dtype), jaxflash.quantize_kv(v, kv_dtype)
    out = jaxflash.attention(q, k_q, v_q, k_scale=k_scale, v_scale=v_scale)
    err = np.linalg.norm(np.asarray(out, np.float64) - exact) / np.linalg.norm(exact)
    with capsys.disabled():
      print(f"\n3001 tokens, {jnp.dtype(kv_dtype).name} KV: relative error {err:.4f}")
    assert err < bound, (jnp.dtype(kv_dtype).name, err)
    ref, _ = attention_f64(q, _deq(k_q, k_scale), _deq(v_q, v_scale))
    assert_close(out, ref, FP32)


# --------------------------------------------------------------------------- paged decode

# (batch, pages in pool, page size, max pages, query heads, KV heads, head dim, query dtype,
#  KV dtype, lengths, table kind, splits, block_k)
PAGED_CASES = {
    "p8_tile32_g5_int8_scattered": (2, 14, 8, 6, 10, 2, 64, BF16, INT8, [45, 7], "scattered", 2, 32),
    "p16_tile16_g7_fp8_prefix": (2, 10, 16, 4, 7, 1, 80, FP32, FP8, [63, 50], "prefix", 1, 16),
    "p32_tile16_g8_int8_random": (3, 4, 32, 3, 8, 1, 96, FP32, INT8, [65, 0, 31], "random", 3, 16),
    "p8_tile16_g1_fp8_scattered": (2, 12, 8, 5, 2, 2, 64, FP32, FP8, [39, 17], "scattered", 2, 16),
    "p16_tile32_g2_int8_prefix": (2, 8, 16, 3, 4, 2, 64, BF16, INT8, [47, 33], "prefix", 2, 32),
}


def _pools(rng, num_pages, page, kv_heads, head_dim, kv_dtype):
  pools = [_quantized(rng, (num_pages, page, kv_heads, head_dim), kv_dtype, 2.0)[1:] for _ in range(2)]
  return (*pools[0], *pools[1])  # k_pages, k_scale, v_pages, v_scale


@pytest.mark.parametrize("case", list(PAGED_CASES), ids=list(PAGED_CASES))
def test_paged_decode_matches_dequantized_reference(case, interpret, rng):
  """Scattered pages, pages shared between sequences (a common prefix, or drawn with
  replacement), gathered tiles (page < tile) and slices of a page (page > tile)."""
  (batch, num_pages, page, max_pages, heads, kv_heads, head_dim, q_dtype, kv_dtype, lengths, kind, splits,
   block_k) = PAGED_CASES[case]
  q = random_array(rng, (batch, 1, heads, head_dim), q_dtype)
  k_pages, k_scale, v_pages, v_scale = _pools(rng, num_pages, page, kv_heads, head_dim, kv_dtype)
  table, clean = _make_table(rng, kind, batch, num_pages, max_pages, page, lengths)
  lengths = jnp.asarray(lengths, jnp.int32)
  out, lse = paged_decode_attention(q, k_pages, v_pages, lengths, jnp.asarray(table), k_scale=k_scale,
                                    v_scale=v_scale, num_splits=splits, config=DecodeConfig(block_k),
                                    return_residual=True, interpret=interpret)
  chex.assert_shape(out, q.shape)
  ref_out, ref_lse = attention_f64(q, gather_pages_np(_deq(k_pages, k_scale), clean),
                                   gather_pages_np(_deq(v_pages, v_scale), clean),
                                   kv_lengths=np.asarray(lengths))
  assert_close(out, ref_out, q_dtype)
  assert_close(lse, ref_lse, FP32, what="lse")


# --------------------------------------------------------------------------- paged prefill

# (batch, T, pages in pool, page size, max pages, query heads, KV heads, head dim, query dtype,
#  KV dtype, kv lengths, query lengths, table kind)
PREFILL_CASES = {
    "t5_g5_int8_scattered": (2, 5, 14, 8, 6, 10, 2, 64, FP32, INT8, [45, 9], [5, 3], "scattered"),
    "t7_g7_fp8_prefix": (2, 7, 10, 16, 4, 7, 1, 80, BF16, FP8, [61, 50], [7, 7], "prefix"),
    "t3_g2_int8_random": (2, 3, 6, 16, 3, 4, 2, 96, FP32, INT8, [33, 3], [3, 2], "random"),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES), ids=list(PREFILL_CASES))
def test_paged_prefill_matches_dequantized_reference(case, interpret, rng):
  """T > 1 new tokens per sequence, bottom-right causal, padded query rows."""
  (batch, t, num_pages, page, max_pages, heads, kv_heads, head_dim, q_dtype, kv_dtype, kv_lengths, q_lengths,
   kind) = PREFILL_CASES[case]
  q = random_array(rng, (batch, t, heads, head_dim), q_dtype)
  k_pages, k_scale, v_pages, v_scale = _pools(rng, num_pages, page, kv_heads, head_dim, kv_dtype)
  table, clean = _make_table(rng, kind, batch, num_pages, max_pages, page, kv_lengths)
  out, lse = paged_prefill_attention(
      q, k_pages, v_pages, jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(table),
      jnp.asarray(q_lengths, jnp.int32), k_scale=k_scale, v_scale=v_scale, return_residual=True,
      config=PrefillConfig(16, 16, 4, 2), interpret=interpret)
  ref_out, ref_lse = attention_f64(q, gather_pages_np(_deq(k_pages, k_scale, q_dtype), clean),
                                   gather_pages_np(_deq(v_pages, v_scale, q_dtype), clean), is_causal=True,
                                   q_lengths=np.asarray(q_lengths), kv_lengths=np.asarray(kv_lengths))
  assert_close(out, ref_out, q_dtype)
  assert_close(lse, ref_lse, FP32, what="lse")


# --------------------------------------------------------------------------- jaxflash.attention

def test_attention_paths(rng):
  """jaxflash.attention with k_scale/v_scale: decode (contiguous and paged), paged prefill,
  the paths that dequantize first (a contiguous prefill, implementation="xla"), unbatched
  inputs; all agree with float64 on the dequantized cache."""
  batch, capacity, heads, kv_heads, head_dim, page = 2, 48, 6, 2, 64, 16
  lengths = np.array([48, 21])
  _, k_q, k_scale = _quantized(rng, (batch, capacity, kv_heads, head_dim), INT8)
  _, v_q, v_scale = _quantized(rng, (batch, capacity, kv_heads, head_dim), INT8)
  k64, v64 = _deq(k_q, k_scale), _deq(v_q, v_scale)
  scales = dict(k_scale=k_scale, v_scale=v_scale)
  # The same cache as pages: sequence b's page j at pool page b * 3 + j (reversed order).
  table = jnp.asarray(np.arange(batch * 3)[::-1].reshape(batch, 3).copy(), jnp.int32)
  to_pages = lambda x: x.reshape(batch * 3, page, *x.shape[2:])[::-1]  # noqa: E731
  paged = dict(k_scale=to_pages(k_scale), v_scale=to_pages(v_scale))
  kv_len = jnp.asarray(lengths, jnp.int32)
  causal = dict(is_causal=True, causal_alignment="bottom_right")

  q1 = random_array(rng, (batch, 1, heads, head_dim), FP32)
  ref1, _ = attention_f64(q1, k64, v64, kv_lengths=lengths)
  assert_close(jaxflash.attention(q1, k_q, v_q, key_value_seq_lengths=kv_len, **scales), ref1, FP32)
  assert_close(jaxflash.attention(q1, to_pages(k_q), to_pages(v_q), key_value_seq_lengths=kv_len,
                                  block_table=table, **paged), ref1, FP32)
  assert_close(jaxflash.attention(q1, k_q, v_q, key_value_seq_lengths=kv_len, implementation="xla",
                                  **scales), ref1, FP32)

  q4 = random_array(rng, (batch, 4, heads, head_dim), FP32)
  ref4, _ = attention_f64(q4, k64, v64, kv_lengths=lengths, is_causal=True)
  assert_close(jaxflash.attention(q4, to_pages(k_q), to_pages(v_q), key_value_seq_lengths=kv_len,
                                  block_table=table, **causal, **paged), ref4, FP32)
  assert_close(jaxflash.attention(q4, k_q, v_q, key_value_seq_lengths=kv_len, **causal, **scales), ref4, FP32)

  ref_unbatched, _ = attention_f64(q4[:1], k64[:1], v64[:1], is_causal=True)
  out = jaxflash.attention(q4[0], k_q[0], v_q[0], k_scale=k_scale[0], v_scale=v_scale[0], **causal)
  assert_close(out, ref_unbatched[0], FP32)


def test_errors_name_the_arguments(rng):
  q = random_array(rng, (1, 1, 4, 32), BF16)
  k = random_array(rng, (1, 24, 2, 32), BF16)
  k_q, k_scale = jaxflash.quantize_kv(k, INT8)
  with pytest.raises(ValueError, match=r"key is a quantized cache .* pass its k_scale of shape \(1, 24, 2\)"):
    jaxflash.attention(q, k_q, k_q)
  with pytest.raises(ValueError, match=r"v_scale must have value's shape without the head axis"):
    jaxflash.attention(q, k_q, k_q, k_scale=k_scale, v_scale=k_scale[:, :5])
  with pytest.raises(TypeError, match="k_scale must be float32, got k_scale of dtype bfloat16"):
    jaxflash.attention(q, k_q, k_q, k_scale=k_scale.astype(BF16), v_scale=k_scale)
  with pytest.raises(TypeError, match="k_scale is given, but key/value are bfloat16/bfloat16"):
    jaxflash.attention(q, k, k, k_scale=k_scale, v_scale=k_scale)
  with pytest.raises(TypeError, match="key and value must have the same dtype"):
    jaxflash.attention(q, k_q, jaxflash.quantize_kv(k, FP8)[0], k_scale=k_scale, v_scale=k_scale)
  with pytest.raises(NotImplementedError, match="implementation='cudnn' does not read quantized"):
    jaxflash.attention(q, k_q, k_q, k_scale=k_scale, v_scale=k_scale, implementation="cudnn")
  with pytest.raises(ValueError, match="k_cache is a quantized cache"):
    decode_attention(q, k_q, k_q, v_scale=k_scale)
  with pytest.raises(NotImplementedError, match="a quantized KV cache .* is not differentiable"):
    jax.grad(lambda q: jaxflash.attention(q, k_q, k_q, k_scale=k_scale, v_scale=k_scale).sum())(q)


# --------------------------------------------------------------------------- cache writes

@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES), ids=list(KV_DTYPES))
def test_cache_writes_quantize(kv_dtype, rng):
  """kv_cache_write (contiguous and paged) and paged_kv_write store quantize_kv's rows and
  scales at the right slots and leave every other slot as it was; today's float calls
  still return two caches."""
  dtype = KV_DTYPES[kv_dtype]
  batch, capacity, kv_heads, head_dim, page = 3, 24, 2, 32, 8
  _, keys, k_scale = _quantized(rng, (batch, capacity, kv_heads, head_dim), dtype)
  _, values, v_scale = _quantized(rng, (batch, capacity, kv_heads, head_dim), dtype)
  k_new = random_array(rng, (batch, kv_heads, head_dim), FP32)
  v_new = random_array(rng, (batch, kv_heads, head_dim), FP32)
  positions = jnp.asarray([5, -1, 23], jnp.int32)  # -1: a finished row writes nothing
  out = jaxflash.kv_cache_write(keys, values, k_new, v_new, positions, k_scale=k_scale, v_scale=v_scale)
  assert len(out) == 4
  k_want, ks_want = jaxflash.quantize_kv(k_new, dtype)
  v_want, vs_want = jaxflash.quantize_kv(v_new, dtype)
  for cache, scales, old, old_scales, want, want_scales in (
      (out[0], out[2], keys, k_scale, k_want, ks_want), (out[1], out[3], values, v_scale, v_want, vs_want)):
    expect = np.array(old.astype(FP32))
    expect_scales = np.array(old_scales)
    for b, p in ((0, 5), (2, 23)):
      expect[b, p], expect_scales[b, p] = np.asarray(want[b].astype(FP32)), np.asarray(want_scales[b])
    np.testing.assert_array_equal(np.asarray(cache.astype(FP32)), expect)
    np.testing.assert_array_equal(np.asarray(scales), expect_scales)
    assert cache.dtype == dtype

  # Pools: paged_kv_write of T = 3 tokens per sequence through a scattered table, and the
  # one-token kernel write through it; both match the contiguous layout read back.
  num_pages, max_pages = 9, 3
  pools = [jnp.zeros((num_pages, page, kv_heads, head_dim), dtype) for _ in range(2)]
  scale_pools = [jnp.zeros((num_pages, page, kv_heads), FP32) for _ in range(2)]
  table = jnp.asarray(rng.permutation(num_pages).reshape(batch, max_pages), jnp.int32)
  k3 = random_array(rng, (batch, 3, kv_heads, head_dim), FP32)
  starts = jnp.asarray([6, 0, 21], jnp.int32)
  k_pages, v_pages, ks_pages, vs_pages = paged_kv_write(*pools, table, starts, k3, k3,
                                                        k_scale=scale_pools[0], v_scale=scale_pools[1])
  gathered = _deq(k_pages, ks_pages)[np.asarray(table)].reshape(batch, max_pages * page, kv_heads, head_dim)
  want = _deq(*jaxflash.quantize_kv(k3, dtype))
  for b, s in enumerate(np.asarray(starts)):
    np.testing.assert_array_equal(gathered[b, s:s + 3], want[b])
  assert np.count_nonzero(np.asarray(ks_pages)) == batch * 3 * kv_heads
  k_pages, _, ks_pages, _ = jaxflash.kv_cache_write(k_pages, v_pages, k_new, v_new, jnp.asarray([9, 1, 2]),
                                                    block_table=table, k_scale=ks_pages, v_scale=vs_pages)
  gathered = _deq(k_pages, ks_pages)[np.asarray(table)].reshape(batch, max_pages * page, kv_heads, head_dim)
  for b, p in enumerate((9, 1, 2)):
    np.testing.assert_array_equal(gathered[b, p], _deq(k_want, ks_want)[b])
  float_cache = jnp.zeros((batch, capacity, kv_heads, head_dim), FP32)
  assert len(jaxflash.kv_cache_write(float_cache, float_cache, k_new, v_new, positions)) == 2


# --------------------------------------------------------------------------- model and engine

@functools.cache
def _model():
  """The tiny config with weights drawn wider than HF's init, so greedy decoding wanders over
  the vocabulary (at HF's init it repeats one token and agreement would be trivial)."""
  from flax import nnx

  from models import qwen2
  model = qwen2.random_model(qwen2.Qwen2Config.tiny(head_dim=32), seed=7)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.Linear):
      module.kernel[...] = module.kernel[...] * 8.0
    elif isinstance(module, nnx.Embed):
      module.embedding[...] = module.embedding[...] * 8.0
  return model


# Greedy tokens of the quantized caches that must equal the float cache's, as a fraction
# (the first divergence makes the rest differ, so this is a prefix agreement in practice).
MIN_AGREEMENT = {"int8": 0.75, "float8_e4m3fn": 0.5}


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_model_greedy_tokens_agree(cache, capsys):
  from models import qwen2
  prompts = [list(range(40, 75)), [3, 200, 17, 9, 101]]
  steps = 16
  base = qwen2.generate(_model(), prompts, steps, cache=cache, eos_token_id=())
  for kv_dtype, floor in MIN_AGREEMENT.items():
    tokens = qwen2.generate(_model(), prompts, steps, cache=cache, eos_token_id=(), kv_dtype=kv_dtype)
    agree = np.mean([a == b for row, base_row in zip(tokens, base) for a, b in zip(row, base_row)])
    with capsys.disabled():
      print(f"\n{cache} {kv_dtype}: greedy agreement with float KV {agree:.2f}")
    assert agree >= floor, (kv_dtype, agree, tokens, base)


def test_engine_pool_holds_quantized_tokens():
  """Engine(kv_dtype="int8"): the pool is int8 with float32 scales; its stats report the
  tokens it holds and its bytes (about 9/16 of float32's at head dim 32: 1 + 4/32 bytes a
  value against 4), and the engine serves the same greedy tokens as generate with int8 KV."""
  from models import qwen2
  from models.serving import Engine
  engine = Engine(_model(), max_slots=2, max_seq_len=64, kv_dtype="int8")
  float_engine = Engine(_model(), max_slots=2, max_seq_len=64)
  stats, float_stats = engine.stats, float_engine.stats
  assert stats["pool_tokens"] == float_stats["pool_tokens"] == engine.cache.num_pages * engine.cache.page_size
  assert stats["kv_dtype"] == "int8"
  assert stats["pool_bytes"] * 32 == float_stats["pool_bytes"] * (1 * 32 + 4) // 4
  prompt = [5, 60, 7, 201, 33]
  handle = engine.submit(prompt, 6, stop_ids=())
  engine.run_until_idle()
  expected = qwen2.generate(_model(), [prompt], 6, eos_token_id=(), kv_dtype="int8")[0]
  assert list(handle.tokens) == expected
