"""The fused SwiGLU block (jaxflash/mlp.py) against a float64 NumPy version.

Cases cover 1 to 16 rows, widths that are not multiples of the tiles (masked tails), one
and several K chunks in each product, with and without a pending residual sum (`addend`),
in bf16, fp16 and fp32.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.linear import LinearConfig
from jaxflash.mlp import gated_mlp, gated_mlp_reference
from tests.conftest import assert_close, poison_allocator, random_array

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (x shape, F, addend chunks (0: none), dtype, up config, down config)
CASES = {
    "one_row_bf16_defaults": ((1, 1, 128), 352, 0, BF16, None, None),
    "ragged_widths_fp32_chunked": ((3, 1, 200), 150, 3, FP32, LinearConfig(32, 32, num_splits=3),
                                   LinearConfig(64, 32, num_splits=4)),
    "sixteen_rows_fp16_one_chunk": ((16, 96), 64, 1, FP16, LinearConfig(16, 32, num_splits=1),
                                    LinearConfig(32, 16, num_splits=1)),
    "addend_many_chunks_bf16": ((2, 1, 64), 256, 11, BF16, LinearConfig(64, 16, num_stages=2),
                                LinearConfig(16, 64, num_splits=20)),
}


def mlp_f64(x, scale, w_gate, w_up, w_down, eps, addend):
  h = np.asarray(x, np.float64)
  if addend is not None:  # the kernel rounds x + addend to x's dtype: so does the reference
    h = np.asarray(jnp.asarray(h + np.asarray(addend, np.float64).sum(0), x.dtype), np.float64)
  n = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)
  g, u = n @ np.asarray(w_gate, np.float64), n @ np.asarray(w_up, np.float64)
  return h, h + (g / (1.0 + np.exp(-g)) * u) @ np.asarray(w_down, np.float64)


def make_inputs(rng, x_shape, f, chunks, dtype):
  d = x_shape[-1]
  x = random_array(rng, x_shape, dtype, scale=2.0)
  scale = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), dtype)
  w_gate, w_up = (random_array(rng, (d, f), dtype, scale=d ** -0.5) for _ in range(2))
  w_down = random_array(rng, (f, d), dtype, scale=f ** -0.5)
  addend = random_array(rng, (chunks, *x_shape), FP32) if chunks else None
  return x, scale, w_gate, w_up, w_down, addend


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_gated_mlp_matches_float64(case, interpret, rng):
  x_shape, f, chunks, dtype, up_config, down_config = CASES[case]
  x, scale, w_gate, w_up, w_down, addend = make_inputs(rng, x_shape, f, chunks, dtype)
  if not interpret:
    poison_allocator(jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct((4, *x_shape), FP32))
  kwargs = dict(eps=1e-5, addend=addend, up_config=up_config, down_config=down_config, interpret=interpret)
  out = gated_mlp(x, scale, w_gate, w_up, w_down, **kwargs)
  h_want, want = mlp_f64(x, scale, w_gate, w_up, w_down, 1e-5, addend)
  chex.assert_shape(out, x_shape)
  chex.assert_type(out, dtype)
  assert_close(out, want, dtype)
  h, parts = gated_mlp(x, scale, w_gate, w_up, w_down, return_partials=True, **kwargs)
  chex.assert_type([h, parts], [dtype, FP32])
  chex.assert_shape(h, x_shape)
  assert parts.shape[1:] == x_shape
  assert_close(h, h_want, dtype, what="h (x + addend)")
  assert_close(h.astype(FP32) + parts.sum(0), want, dtype, what="h + partials")
  reference = gated_mlp_reference(x, scale, w_gate, w_up, w_down, eps=1e-5, addend=addend)
  assert_close(reference, want, dtype, what="reference")


def _primitives_outside_kernels(jaxpr) -> list[str]:
  """The primitives of a jaxpr and of the jaxprs nested in its equations (a jit's), except
  inside pallas_calls."""
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    if eqn.primitive.name != "pallas_call":
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          names += _primitives_outside_kernels(inner)
  return names


def test_two_launches_and_nothing_else(rng):
  """gated_mlp is two pallas_calls and no product or reduction outside them; with
  return_partials nothing adds the chunks (the consumer does)."""
  x, scale, w_gate, w_up, w_down, addend = make_inputs(rng, (1, 64), 96, 2, BF16)
  fn = lambda x, a: gated_mlp(x, scale, w_gate, w_up, w_down, addend=a, return_partials=True)
  names = _primitives_outside_kernels(jax.make_jaxpr(fn)(x, addend).jaxpr)
  assert names.count("pallas_call") == 2, names
  assert not {"dot_general", "reduce_sum", "logistic"} & set(names), names


def test_addend_chains_from_skinny_partials(interpret, rng):
  """The o projection's unsummed partials (skinny_matmul(..., return_partials=True)) feed
  gated_mlp's addend: the same as adding the product first."""
  x, scale, w_gate, w_up, w_down, _ = make_inputs(rng, (2, 64), 128, 0, FP32)
  attn, w_o = random_array(rng, (2, 96), FP32), random_array(rng, (96, 64), FP32, scale=0.1)
  parts = jaxflash.skinny_matmul(attn, w_o, return_partials=True,
                                 config=LinearConfig(16, 16, num_splits=3), interpret=interpret)
  chex.assert_shape(parts, (3, 2, 64))
  out = gated_mlp(x, scale, w_gate, w_up, w_down, addend=parts, interpret=interpret)
  plain = np.asarray(x, np.float64) + np.asarray(attn, np.float64) @ np.asarray(w_o, np.float64)
  _, want = mlp_f64(plain, scale, w_gate, w_up, w_down, 1e-6, None)
  assert_close(out, want, FP32)


def test_no_rows_gives_empty_outputs():
  x = jnp.zeros((0, 32), BF16)
  w = jnp.zeros((32, 48), BF16)
  out = gated_mlp(x, jnp.ones((32,), BF16), w, w, w.T)
  chex.assert_shape(out, (0, 32))


@pytest.mark.parametrize("change,error,match", [
    (dict(x=jnp.zeros((17, 32))), ValueError, r"at most 16 rows.*\(17, 32\)"),
    (dict(norm_scale=jnp.ones((31,))), ValueError, r"norm_scale must be \[D\] = \(32,\).*\(31,\)"),
    (dict(w_up=jnp.zeros((32, 40))), ValueError, r"w_gate and w_up.*\(32, 48\).*\(32, 40\)"),
    (dict(w_down=jnp.zeros((32, 48))), ValueError, r"w_down must be \[F, D\] = \(48, 32\).*\(32, 48\)"),
    (dict(w_down=jnp.zeros((48, 32), BF16)), TypeError, r"share a dtype"),
    (dict(addend=jnp.zeros((2, 3, 32))), ValueError, r"addend must be .*= \[S, 2, 32\].*\(2, 3, 32\)"),
    (dict(x=jnp.zeros((2, 32), jnp.int32)), TypeError, r"x must be bfloat16, float16 or float32"),
])
def test_bad_inputs_are_refused(change, error, match):
  args = dict(x=jnp.zeros((2, 32)), norm_scale=jnp.ones((32,)), w_gate=jnp.zeros((32, 48)),
              w_up=jnp.zeros((32, 48)), w_down=jnp.zeros((48, 32)))
  args.update(change)
  addend = args.pop("addend", None)
  with pytest.raises(error, match=match):
    gated_mlp(*args.values(), addend=addend)


def test_public_name():
  assert jaxflash.gated_mlp is gated_mlp
