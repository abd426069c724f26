"""Skinny matmul (jaxflash/fused/linear.py) against a float64 product.

Shapes cover ragged K and N (masked last tiles), 1..16 rows, several K chunks (fp32
partials summed outside the kernel) and one chunk (the kernel writes the result itself).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.fused.configs import LinearConfig
from jaxflash.fused.linear import k_chunks, skinny_matmul, skinny_matmul_reference
from tests.conftest import assert_close, poison_allocator, random_array

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (x shape, N, dtype, config)
CASES = {
    "one_row_bf16_default": ((1, 256), 384, BF16, None),
    "decode_batch_3d_fp16": ((3, 1, 200), 100, FP16, LinearConfig(block_n=32, block_k=64, num_splits=2)),
    "sixteen_rows_fp32_one_chunk": ((16, 96), 80, FP32, LinearConfig(block_n=64, block_k=32, num_splits=1)),
    "ragged_k_many_chunks_bf16": ((5, 130), 48, BF16, LinearConfig(block_n=16, block_k=16, num_splits=4)),
    "splits_past_tiles_fp32": ((2, 40), 24, FP32, LinearConfig(block_n=16, block_k=16, num_splits=9)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_skinny_matmul_matches_reference(case, interpret, rng):
  x_shape, n, dtype, config = CASES[case]
  x = random_array(rng, x_shape, dtype)
  w = random_array(rng, (x_shape[-1], n), dtype, scale=0.1)
  if not interpret:
    poison_allocator(jax.ShapeDtypeStruct((*x_shape[:-1], n), dtype))
  out = skinny_matmul(x, w, config=config, interpret=interpret)
  chex.assert_shape(out, (*x_shape[:-1], n))
  chex.assert_type(out, dtype)
  expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert_close(out, expected, dtype)
  assert_close(skinny_matmul_reference(x, w), expected, dtype, what="reference")


# (x shape, widths, dtype, config): several weights sharing x, one launch
MULTI_CASES = {
    "qkv_like_bf16_chunked": ((1, 192), (96, 32, 32), BF16, LinearConfig(block_n=32, block_k=64, num_splits=3)),
    "ragged_widths_fp16_one_chunk": ((4, 1, 72), (50, 17, 64), FP16, LinearConfig(block_n=16, block_k=32, num_splits=1)),
    "one_weight_in_a_tuple_fp32": ((2, 64), (40,), FP32, LinearConfig(block_n=16, block_k=16)),
}


@pytest.mark.parametrize("case", list(MULTI_CASES), ids=list(MULTI_CASES))
def test_several_weights_share_one_launch(case, interpret, rng):
  x_shape, widths, dtype, config = MULTI_CASES[case]
  x = random_array(rng, x_shape, dtype)
  ws = tuple(random_array(rng, (x_shape[-1], n), dtype, scale=0.1) for n in widths)
  if not interpret:
    poison_allocator(*(jax.ShapeDtypeStruct((*x_shape[:-1], n), dtype) for n in widths))
  outs = skinny_matmul(x, ws, config=config, interpret=interpret)
  assert isinstance(outs, tuple) and len(outs) == len(widths)
  for out, w, n in zip(outs, ws, widths):
    chex.assert_shape(out, (*x_shape[:-1], n))
    chex.assert_type(out, dtype)
    assert_close(out, np.asarray(x, np.float64) @ np.asarray(w, np.float64), dtype)
  jaxpr = str(jax.make_jaxpr(lambda x, ws: skinny_matmul(x, ws, config=config, interpret=interpret))(x, ws))
  assert jaxpr.count("pallas_call") == 1


def test_empty_weight_in_a_tuple_gives_zeros(interpret, rng):
  x = random_array(rng, (2, 32), FP32)
  w = random_array(rng, (32, 24), FP32)
  empty, out = skinny_matmul(x, (jnp.zeros((32, 0), FP32), w), interpret=interpret)
  chex.assert_shape(empty, (2, 0))
  assert_close(out, np.asarray(x, np.float64) @ np.asarray(w, np.float64), FP32)


def test_mixed_dtypes_promote(interpret, rng):
  """fp32 activations times bf16 weights: computed in bf16, returned in fp32 (promotion)."""
  x = random_array(rng, (2, 64), FP32)
  w = random_array(rng, (64, 32), BF16, scale=0.1)
  out = skinny_matmul(x, w, config=LinearConfig(block_n=16, block_k=16), interpret=interpret)
  chex.assert_type(out, FP32)
  expected = np.asarray(x.astype(BF16), np.float64) @ np.asarray(w, np.float64)
  assert_close(out, expected, BF16)


def test_chunking_fills_the_gpu():
  """Narrow N gets K chunks until column blocks x chunks reach the SM count; chunks hold
  whole tiles and never outnumber them."""
  config = LinearConfig(block_n=128, block_k=64)
  assert k_chunks(config, 1536, 1536, 132) == (3, 8)  # 12 blocks x 8 chunks of 3 tiles <= 132
  assert k_chunks(config, 17920, 1536, 132) == (24, 1)  # 140 column blocks: one chunk
  assert k_chunks(config, 64, 100, 132) == (1, 2)  # only 2 tiles of K
  assert k_chunks(LinearConfig(num_splits=3), 1536, 1536, 132) == (8, 3)


@pytest.mark.parametrize("x_shape,w_shape,error,match", [
    ((17, 64), (64, 32), ValueError, r"at most 16 rows.*\(17, 64\)"),
    ((2, 64), (48, 32), ValueError, r"x \[\.\.\., K\] and w \[K, N\].*\(2, 64\).*\(48, 32\)"),
    ((2, 64), (64,), ValueError, r"w \[K, N\]"),
    ((2, 64), ((64, 8), (32, 8)), ValueError, r"tuple of such w.*w \(64, 8\), w \(32, 8\)"),
])
def test_bad_shapes_are_refused(x_shape, w_shape, error, match):
  w = (tuple(jnp.zeros(s, FP32) for s in w_shape) if isinstance(w_shape[0], tuple)
       else jnp.zeros(w_shape, FP32))
  with pytest.raises(error, match=match):
    skinny_matmul(jnp.zeros(x_shape, FP32), w)


def test_integer_inputs_are_refused():
  with pytest.raises(TypeError, match="floating-point x"):
    skinny_matmul(jnp.zeros((2, 8), jnp.int32), jnp.zeros((8, 4), FP32))


def test_weights_of_different_dtypes_are_refused():
  with pytest.raises(TypeError, match="share a dtype"):
    skinny_matmul(jnp.zeros((2, 8), FP32), (jnp.zeros((8, 4), FP32), jnp.zeros((8, 4), BF16)))


def test_public_name():
  assert jaxflash.skinny_matmul is skinny_matmul and jaxflash.LinearConfig is LinearConfig


@pytest.mark.parametrize("changes, match", [
    (dict(block_n=48), "block_n must be a power of two"),
    (dict(block_k=8), "block_k must be a power of two"),
    (dict(num_warps=0), "num_warps must be a positive int"),
    (dict(num_splits=0), "num_splits must be None or a positive int"),
])
def test_bad_configs_are_refused(changes, match):
  with pytest.raises(ValueError, match=match):
    LinearConfig(**changes)
