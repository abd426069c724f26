"""add_rms_norm (jaxflash/fused/residual_norm.py): h = x + sum(deltas), rms_norm(h) * scale.

Against a float64 computation on fresh random data: one update or several K-chunk partial
sums (from the skinny matmul's `return_partials`), rows 1..16, widths that are and are not
powers of two, the three float dtypes; and against its plain-JAX reference, which rounds
where the kernel does.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.fused.configs import LinearConfig
from jaxflash.fused.residual_norm import add_rms_norm_reference
from tests.conftest import assert_close, poison_allocator, random_array

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (x shape, partial sums S (None: one update of x's shape), x dtype, deltas dtype)
CASES = {
    "one_row_1536_eight_chunks_bf16": ((1, 1536), 8, BF16, FP32),
    "decode_batch_3d_96_fp16": ((3, 1, 96), 3, FP16, FP32),
    "sixteen_rows_80_one_update_fp32": ((16, 80), None, FP32, FP32),
    "five_rows_256_bf16_update": ((5, 256), None, BF16, BF16),
    "eleven_chunks_odd_width_bf16": ((2, 200), 11, BF16, FP32),
}


def _float64_expected(x, deltas, scale, eps):
  x64 = np.asarray(jnp.asarray(x, FP32), np.float64)
  deltas64 = np.asarray(jnp.asarray(deltas, FP32), np.float64)
  h = x64 + (deltas64 if deltas.ndim == x.ndim else deltas64.sum(axis=0))
  r = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
  return h, h * r * np.asarray(jnp.asarray(scale, FP32), np.float64)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_add_rms_norm_matches_float64(case, interpret, rng):
  x_shape, splits, dtype, deltas_dtype = CASES[case]
  x = random_array(rng, x_shape, dtype)
  deltas = random_array(rng, x_shape if splits is None else (splits, *x_shape), deltas_dtype, scale=0.3)
  scale = random_array(rng, x_shape[-1:], dtype, scale=0.5) + 1.0
  if not interpret:
    poison_allocator(*[jax.ShapeDtypeStruct(x_shape, dtype)] * 2)
  h, normed = jaxflash.add_rms_norm(x, deltas, scale, eps=1e-6, interpret=interpret)
  chex.assert_shape((h, normed), x_shape)
  chex.assert_type((h, normed), dtype)
  h64, normed64 = _float64_expected(x, deltas, scale, 1e-6)
  assert_close(h, h64, dtype, what="h")
  assert_close(normed, normed64, dtype, what="normed")
  ref_h, ref_normed = add_rms_norm_reference(x, deltas, scale, eps=1e-6)
  # The kernel rounds where the reference does: they differ by at most one rounding of the
  # output (a different order of the fp32 sums can flip the last bit).
  one_ulp = {FP32: 1e-6, FP16: 1e-3, BF16: 8e-3}[dtype]
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(ref_h, np.float32),
                             rtol=one_ulp, atol=one_ulp)
  np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(ref_normed, np.float32),
                             rtol=one_ulp, atol=one_ulp)


def test_skinny_partials_feed_add_rms_norm(interpret, rng):
  """The output projection's K-chunk partial sums, added by add_rms_norm: what the model's
  decode step runs (models/qwen2/norm.py, add_and_norm)."""
  heads, x = random_array(rng, (2, 1, 192), BF16), random_array(rng, (2, 1, 160), BF16)
  w = random_array(rng, (192, 160), BF16, scale=0.1)
  scale = random_array(rng, (160,), BF16, scale=0.5) + 1.0
  config = LinearConfig(block_n=32, block_k=32, num_splits=3)
  partials = jaxflash.skinny_matmul(heads, w, config=config, return_partials=True, interpret=interpret)
  chex.assert_shape(partials, (3, 2, 1, 160))
  chex.assert_type(partials, FP32)
  h, normed = jaxflash.add_rms_norm(x, partials, scale, interpret=interpret)
  product = np.asarray(jnp.asarray(heads, FP32), np.float64) @ np.asarray(jnp.asarray(w, FP32), np.float64)
  h64, normed64 = _float64_expected(x, jnp.asarray(product, FP32), scale, 1e-6)
  assert_close(h, h64, BF16, what="h")
  assert_close(normed, normed64, BF16, what="normed")


def test_zero_rows_give_zeros_not_nan(interpret):
  """A row of zeros (a padded batch row) normalises to zeros: rsqrt(eps) times 0."""
  x = jnp.zeros((2, 64), FP32)
  h, normed = jaxflash.add_rms_norm(x, jnp.zeros((4, 2, 64), FP32), jnp.ones((64,), FP32),
                                    interpret=interpret)
  np.testing.assert_array_equal(np.asarray(normed), 0.0)
  np.testing.assert_array_equal(np.asarray(h), 0.0)


@pytest.mark.parametrize("x_shape, deltas_shape, scale_shape, error, match", [
    ((2, 64), (3, 2, 32), (64,), ValueError, r"deltas \(3, 2, 32\)"),
    ((2, 64), (2, 64), (32,), ValueError, r"scale must be \[D\] = \(64,\).*\(32,\)"),
    ((2, 64), (5, 4, 2, 64), (64,), ValueError, r"deltas \(5, 4, 2, 64\)"),
])
def test_bad_shapes_name_the_argument(x_shape, deltas_shape, scale_shape, error, match):
  with pytest.raises(error, match=match):
    jaxflash.add_rms_norm(jnp.zeros(x_shape), jnp.zeros(deltas_shape), jnp.zeros(scale_shape))


def test_integer_input_is_a_type_error():
  with pytest.raises(TypeError, match="deltas must be bfloat16, float16 or float32"):
    jaxflash.add_rms_norm(jnp.zeros((2, 64)), jnp.zeros((2, 64), jnp.int32), jnp.zeros((64,)))
