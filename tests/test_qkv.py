"""Fused RMSNorm + q/k/v + bias + RoPE (jaxflash/fused/qkv.py) against a float64 NumPy version.

Cases cover GQA ratios (1 to 8, with 5 and 7), head dims 64 to 256 with 80 and 96 (whose
halves are not multiples of the 16-dim slices: masked), K that is not a multiple of the
tile (a masked tail), 1 to 16 rows, with and without biases, in bf16, fp16 and fp32; each
in one launch (the last K chunk's program finishes the heads) where the column blocks hold
whole heads, and in two.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.fused.cache_write import kv_cache_write_reference
from jaxflash.fused.configs import LinearConfig
from jaxflash.fused.qkv import qkv_projection, qkv_projection_reference
from tests.conftest import assert_close, poison_allocator, random_array

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (x shape, head_dim, (q heads, k heads, v heads), bias, dtype, config)
CASES = {
    "qwen_like_gqa6_bf16": ((1, 1, 192), 64, (6, 1, 1), True, BF16, None),
    "gqa5_head80_ragged_k_fp32": ((3, 1, 200), 80, (5, 1, 1), True, FP32, LinearConfig(64, 64, num_splits=3)),
    "gqa7_head96_no_bias_fp16": ((2, 96), 96, (7, 1, 1), False, FP16, LinearConfig(32, 32, num_splits=1)),
    "sixteen_rows_head256_bf16": ((4, 4, 64), 256, (2, 1, 1), True, BF16, LinearConfig(128, 16, num_splits=4)),
    "gqa1_head128_fp32": ((2, 1, 128), 128, (2, 2, 2), True, FP32, LinearConfig(64, 32, num_splits=20)),
    "gqa8_head64_bf16": ((5, 64), 64, (8, 1, 1), True, BF16, LinearConfig(16, 16, num_stages=2)),
    "gqa8_head64_two_heads_a_block_bf16": ((5, 64), 64, (8, 1, 1), True, BF16,
                                           LinearConfig(128, 16, num_stages=2)),
    "sixteen_rows_head256_one_head_a_block_bf16": ((4, 4, 64), 256, (2, 1, 1), True, BF16,
                                                   LinearConfig(256, 16, num_splits=4)),
    "gqa1_head128_four_chunks_fp32": ((2, 1, 128), 128, (2, 2, 2), True, FP32, LinearConfig(128, 32, num_splits=4)),
}


def _one_launch_possible(case) -> bool:
  """Whether the case's column blocks hold whole heads (else qkv_projection takes two launches)."""
  _, head_dim, _, _, _, config = case
  return (config or LinearConfig()).block_n % head_dim == 0


LAUNCH_CASES = [(name, one) for name, case in CASES.items() for one in (True, False)
                if not one or _one_launch_possible(case)]


def qkv_f64(x, scale, weights, biases, cos, sin, head_dim, eps):
  x, scale = np.asarray(x, np.float64), np.asarray(scale, np.float64)
  normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale
  cos, sin = np.asarray(cos, np.float64)[..., None, :], np.asarray(sin, np.float64)[..., None, :]
  outs = []
  for which, w in enumerate(weights):
    y = normed @ np.asarray(w, np.float64)
    if biases is not None:
      y = y + np.asarray(biases[which], np.float64)
    if which < 2:  # RoPE on q and k: dim d pairs with d + head_dim / 2
      heads = y.reshape(*y.shape[:-1], -1, head_dim)
      x1, x2 = heads[..., :head_dim // 2], heads[..., head_dim // 2:]
      y = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(y.shape)
    outs.append(y)
  return outs


def make_inputs(rng, x_shape, head_dim, heads, bias, dtype):
  k_size = x_shape[-1]
  x = random_array(rng, x_shape, dtype, scale=3.0)
  scale = jnp.asarray(1.0 + 0.5 * rng.standard_normal(k_size), dtype)
  weights = tuple(random_array(rng, (k_size, n * head_dim), dtype, scale=k_size ** -0.5) for n in heads)
  biases = tuple(random_array(rng, (n * head_dim,), dtype) for n in heads) if bias else None
  angles = rng.uniform(0.0, 2000.0, (*x_shape[:-1], head_dim // 2))  # positions x frequencies
  return x, scale, weights, biases, jnp.asarray(np.cos(angles), FP32), jnp.asarray(np.sin(angles), FP32)


@pytest.mark.parametrize("case,one_launch", LAUNCH_CASES,
                         ids=[f"{name}-{'one' if one else 'two'}_launches" for name, one in LAUNCH_CASES])
def test_qkv_projection_matches_float64(case, one_launch, interpret, rng):
  x_shape, head_dim, heads, bias, dtype, config = CASES[case]
  x, scale, weights, biases, cos, sin = make_inputs(rng, x_shape, head_dim, heads, bias, dtype)
  widths = [n * head_dim for n in heads]
  if not interpret:
    poison_allocator(*(jax.ShapeDtypeStruct((*x_shape[:-1], n), dtype) for n in widths))
  outs = qkv_projection(x, scale, weights, biases, cos, sin, head_dim=head_dim, eps=1e-5,
                        config=config, one_launch=one_launch, interpret=interpret)
  expected = qkv_f64(x, scale, weights, biases, cos, sin, head_dim, 1e-5)
  reference = qkv_projection_reference(x, scale, weights, biases, cos, sin, head_dim=head_dim, eps=1e-5)
  assert isinstance(outs, tuple) and len(outs) == 3
  for name, out, ref, want, n in zip("qkv", outs, reference, expected, widths):
    chex.assert_shape(out, (*x_shape[:-1], n))
    chex.assert_type(out, dtype)
    assert_close(out, want, dtype, what=name)
    assert_close(ref, want, dtype, what=f"reference {name}")


# (batch, head_dim, (q heads, kv heads), page size or None for a contiguous cache, dtype)
CACHE_CASES = {
    "contiguous_gqa6_bf16": (3, 64, (6, 1), None, BF16),
    "paged8_gqa7_head80_fp32": (4, 80, (7, 1), 8, FP32),
    "paged16_gqa2_head128_bf16": (2, 128, (4, 2), 16, BF16),
}


@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "two_launches"])
@pytest.mark.parametrize("case", list(CACHE_CASES), ids=list(CACHE_CASES))
def test_k_and_v_written_into_the_cache(case, one_launch, interpret, rng):
  """With kv_cache, k and v land in the cache at each sequence's position (dropped for -1
  and past the cache), exactly where kv_cache_write puts the separately computed k and v;
  q is as without a cache; nothing else in the cache changes."""
  batch, head_dim, (nq, nkv), page, dtype = CACHE_CASES[case]
  x, scale, weights, biases, cos, sin = make_inputs(rng, (batch, 1, 96), head_dim, (nq, nkv, nkv), True, dtype)
  capacity = 32
  # Sequence 0 writes nothing (-1), sequence 1 one past the cache (dropped too), the last
  # one (a row the padding rows of the 16-row tile must not disturb) a real slot.
  positions = jnp.asarray(rng.integers(0, capacity, batch), jnp.int32).at[0].set(-1).at[1].set(capacity)
  if page is None:
    shape, table = (batch, capacity, nkv, head_dim), None
  else:  # a pool with spare pages; sequences 0 and 1 share their first page
    num_pages = batch * capacity // page + 3
    table = rng.permutation(num_pages)[:batch * capacity // page].reshape(batch, capacity // page)
    table[1, 0] = table[0, 0]
    table = jnp.asarray(table, jnp.int32)
    shape = (num_pages, page, nkv, head_dim)
  keys, values = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
  q, new_keys, new_values = qkv_projection(x, scale, weights, biases, cos, sin, head_dim=head_dim,
                                           kv_cache=(keys, values), positions=positions,
                                           block_table=table, one_launch=one_launch, interpret=interpret)
  q_plain, k_plain, v_plain = qkv_projection(x, scale, weights, biases, cos, sin, head_dim=head_dim,
                                             one_launch=one_launch, interpret=interpret)
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_plain, np.float32))
  want_keys, want_values = kv_cache_write_reference(
      keys, values, k_plain.reshape(batch, nkv, head_dim), v_plain.reshape(batch, nkv, head_dim), positions,
      block_table=table)
  chex.assert_trees_all_equal_shapes_and_dtypes((new_keys, new_values), (keys, values))
  np.testing.assert_array_equal(np.asarray(new_keys, np.float32), np.asarray(want_keys, np.float32))
  np.testing.assert_array_equal(np.asarray(new_values, np.float32), np.asarray(want_values, np.float32))


def test_cache_arguments_are_checked():
  x, scale, weights, biases, cos, sin = _args(rows=2, k=32, head_dim=16, heads=(2, 1, 1))
  cache = (jnp.zeros((2, 8, 1, 16), FP32), jnp.zeros((2, 8, 1, 16), FP32))
  call = lambda **kw: qkv_projection(x, scale, weights, biases, cos, sin, head_dim=16, **kw)
  with pytest.raises(ValueError, match=r"positions \[B\] = \(2,\) are needed"):
    call(kv_cache=cache)
  with pytest.raises(ValueError, match=r"caches hold \[K, H\] = \(1, 8\)"):
    call(kv_cache=(jnp.zeros((2, 8, 1, 8), FP32),) * 2, positions=jnp.zeros((2,), jnp.int32))
  with pytest.raises(TypeError, match=r"kv_cache must be a tuple \(keys, values\)"):
    call(kv_cache=cache[0], positions=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"one token per sequence.*\(2, 3, 32\)"):
    qkv_projection(jnp.zeros((2, 3, 32), FP32), scale, weights, biases, jnp.ones((2, 3, 8), FP32),
                   jnp.zeros((2, 3, 8), FP32), head_dim=16, kv_cache=cache, positions=jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("head_dim,one_launch,launches", [(64, True, 1), (64, False, 2), (80, True, 2)])
def test_launches_and_nothing_else(head_dim, one_launch, launches, interpret, rng):
  """One launch when the product's column blocks hold whole heads (head_dim 64 in 128-column
  blocks), else two (the product, then the finishing step); the norm, bias and RoPE are inside."""
  x, scale, weights, biases, cos, sin = make_inputs(rng, (1, 64), head_dim, (2, 1, 1), True, FP32)
  fn = lambda *a: qkv_projection(*a, head_dim=head_dim, one_launch=one_launch, interpret=interpret)
  jaxpr = str(jax.make_jaxpr(fn)(x, scale, weights, biases, cos, sin))
  assert jaxpr.count("pallas_call") == launches


@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "two_launches"])
def test_counters_come_back_zero_and_serve_again(one_launch, interpret, rng):
  """Given counters, the one-launch kernel counts its K chunks in them and leaves them zero,
  so the same buffer serves the next call (a decode loop's next layer or step): three calls
  in a row give the first call's q, k and v; two launches hand the counters back untouched."""
  x, scale, weights, biases, cos, sin = make_inputs(rng, (2, 1, 96), 64, (4, 2, 2), True, FP32)
  config = LinearConfig(64, 32, num_splits=3)  # 3 K chunks to count in each of 8 column blocks
  call = lambda counters: qkv_projection(x, scale, weights, biases, cos, sin, head_dim=64, config=config,
                                         one_launch=one_launch, counters=counters, interpret=interpret)
  want = qkv_projection(x, scale, weights, biases, cos, sin, head_dim=64, config=config,
                        one_launch=one_launch, interpret=interpret)
  counters = jnp.zeros((12,), jnp.int32)
  for _ in range(3):
    *outs, counters = call(counters)
    chex.assert_shape(counters, (12,))
    chex.assert_type(counters, jnp.int32)
    np.testing.assert_array_equal(np.asarray(counters), 0)
    for out, expected in zip(outs, want):
      np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_bad_counters_are_refused():
  call = lambda counters: qkv_projection(*_args(heads=(4, 2, 2)), head_dim=16, counters=counters,
                                         config=LinearConfig(32, 16))
  with pytest.raises(TypeError, match=r"counters must be int32.*float32"):
    call(jnp.zeros((8,), FP32))
  with pytest.raises(ValueError, match=r"counters must be \[n\] int32.*\(2, 4\)"):
    call(jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"one slot per column block \(4\).*\(3,\)"):
    call(jnp.zeros((3,), jnp.int32))


def test_scale_of_x_cancels(interpret, rng):
  """RMSNorm makes the result independent of x's scale (up to eps): 8x gives the same q/k/v."""
  x, scale, weights, biases, cos, sin = make_inputs(rng, (2, 96), 64, (3, 1, 1), True, FP32)
  a = qkv_projection(x, scale, weights, biases, cos, sin, head_dim=64, eps=0.0, interpret=interpret)
  b = qkv_projection(8.0 * x, scale, weights, biases, cos, sin, head_dim=64, eps=0.0, interpret=interpret)
  for u, v in zip(a, b):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-5)


def _args(rows=2, k=32, head_dim=16, heads=(2, 1, 1), dtype=FP32):
  return (jnp.zeros((rows, k), dtype), jnp.ones((k,), dtype),
          tuple(jnp.zeros((k, n * head_dim), dtype) for n in heads),
          tuple(jnp.zeros((n * head_dim,), dtype) for n in heads),
          jnp.ones((rows, head_dim // 2), FP32), jnp.zeros((rows, head_dim // 2), FP32))


@pytest.mark.parametrize("change,error,match", [
    (lambda a: (jnp.zeros((17, 32), FP32), *a[1:]), ValueError, r"at most 16 rows.*\(17, 32\)"),
    (lambda a: (a[0], jnp.ones((31,), FP32), *a[2:]), ValueError, r"norm_scale must be \[K\].*\(31,\)"),
    (lambda a: (*a[:2], (a[2][0], jnp.zeros((32, 24), FP32), a[2][2]), *a[3:]), ValueError,
     r"wk must be \[K, heads \* head_dim\].*\(32, 24\)"),
    (lambda a: (*a[:2], (a[2][0], a[2][1], jnp.zeros((32, 0), FP32)), *a[3:]), ValueError, r"wv must be.*n >= 1"),
    (lambda a: (*a[:3], (a[3][0], a[3][1], jnp.zeros((8,), FP32)), *a[4:]), ValueError,
     r"bv must be \[16\].*\(8,\)"),
    (lambda a: (*a[:4], jnp.ones((2, 4), FP32), a[5]), ValueError, r"cos must be \[\.\.\., head_dim/2\].*\(2, 4\)"),
    (lambda a: (*a[:2], a[2][:2], *a[3:]), TypeError, r"weights must be a tuple \(wq, wk, wv\)"),
    (lambda a: (jnp.zeros((2, 32), jnp.int32), *a[1:]), TypeError, r"x must be bfloat16.*int32"),
    (lambda a: (*a[:2], (a[2][0], a[2][1], a[2][2].astype(BF16)), *a[3:]), TypeError, r"share a dtype"),
])
def test_bad_input_is_refused(change, error, match):
  with pytest.raises(error, match=match):
    qkv_projection(*change(_args()), head_dim=16)


def test_odd_head_dim_is_refused():
  with pytest.raises(ValueError, match=r"head_dim must be even.*head_dim=15"):
    qkv_projection(*_args(head_dim=16), head_dim=15)


def test_public_name():
  assert jaxflash.qkv_projection is qkv_projection
