"""What precision float32 inputs get in the Pallas-Triton kernels: IEEE float32 dots by
default (not TF32, XLA's GPU default), and what `jax.default_matmul_precision` asks when set.
On the CPU: the mapping and the precision every kernel's dots are traced with (forward,
backward, decode); on a GPU: the compiled kernels' errors against float64."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxflash
from jaxflash._util import dot_precision
from tests.reference_np import attention_f64


@pytest.mark.parametrize("setting,expected", [
    (None, lax.Precision.HIGHEST), ("highest", lax.Precision.HIGHEST), ("float32", lax.Precision.HIGHEST),
    ("tensorfloat32", lax.Precision.HIGH), ("high", lax.Precision.HIGH), ("bfloat16", lax.Precision.DEFAULT),
    ("F32_F32_F32", lax.DotAlgorithmPreset.F32_F32_F32),
    ("TF32_TF32_F32_X3", lax.DotAlgorithmPreset.TF32_TF32_F32_X3)])
def test_float32_dot_precision_follows_the_default_matmul_precision(setting, expected):
  with jax.default_matmul_precision(setting):
    assert dot_precision(jnp.float32) == expected
    for half in (jnp.bfloat16, jnp.float16):
      assert dot_precision(half) is None  # 16-bit operands: the tensor cores' own products


def _dot_precisions(fn, *args) -> set[str]:
  """The precisions of the dot_generals in fn's jaxpr, the kernels' bodies included."""
  text = str(jax.make_jaxpr(fn)(*args))
  return set(re.findall(r"precision=\(Precision\.(\w+)", text))


def _inputs(t, s, dtype=jnp.float32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (2, t, 6, 64), dtype)
  k = jax.random.normal(kk, (2, s, 2, 64), dtype)
  v = jax.random.normal(kv, (2, s, 2, 64), dtype)
  return q, k, v


CALLS = {
    "prefill": (lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True), 17),
    "prefill_backward": (jax.grad(lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True).sum(),
                                  argnums=(0, 1, 2)), 17),
    "decode": (lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True,
                                                  causal_alignment="bottom_right"), 1),
}


@pytest.mark.parametrize("path", list(CALLS))
@pytest.mark.parametrize("setting,expected", [(None, {"HIGHEST"}), ("float32", {"HIGHEST"}),
                                              ("tensorfloat32", {"HIGH"})])
def test_kernels_trace_their_dots_at_the_chosen_precision(path, setting, expected):
  fn, t = CALLS[path]
  q, k, v = _inputs(t, 40)
  with jax.default_matmul_precision(setting):
    assert _dot_precisions(fn, q, k, v) == expected


def test_bf16_kernels_leave_the_precision_to_their_operands():
  fn, t = CALLS["prefill"]
  assert _dot_precisions(fn, *_inputs(t, 40, jnp.bfloat16)) <= {"DEFAULT"}


def _max_error(t, s, setting, grad=False):
  q, k, v = _inputs(t, s, seed=1)
  alignment = "bottom_right"
  with jax.default_matmul_precision(setting):
    if grad:
      # The gradient of sum(out * w) against float64 finite sums is costly; compare dV, whose
      # float64 value is P^T w in closed form.
      w = jax.random.normal(jax.random.key(2), q.shape, jnp.float32)
      got = jax.jit(jax.grad(lambda v_: jnp.sum(jaxflash.attention(
          q, k, v_, is_causal=True, causal_alignment=alignment, implementation="triton") * w)))(v)
      ref = _dv_f64(q, k, w)
      return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))
    got = jax.jit(lambda *a: jaxflash.attention(*a, is_causal=True, causal_alignment=alignment,
                                                implementation="triton"))(q, k, v)
  ref, _ = attention_f64(q, k, v, is_causal=True)
  return float(np.max(np.abs(np.asarray(got, np.float64) - ref)))


def _dv_f64(q, k, w):
  """dV of sum(attention(q, k, v) * w) in float64: sum over query heads of P^T w."""
  q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  kr = np.repeat(k, n // kh, axis=2)
  scores = np.einsum("btnh,bsnh->bnts", q, kr) * h ** -0.5
  scores = np.where(np.tril(np.ones((t, s), bool), s - t), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dv = np.einsum("bnts,btnh->bsnh", p, w)
  return dv.reshape(b, s, kh, n // kh, h).sum(3)


@pytest.mark.gpu
@pytest.mark.parametrize("t,s", [(300, 300), (1, 777)], ids=["prefill", "decode"])
def test_compiled_float32_is_exact_unless_tf32_is_asked(t, s):
  exact = _max_error(t, s, None)
  assert exact < 2e-5
  assert _max_error(t, s, "float32") < 2e-5
  tf32 = _max_error(t, s, "tensorfloat32")
  assert tf32 > 5 * exact and tf32 < 2e-2  # TF32's 10-bit mantissa shows; still attention


@pytest.mark.gpu
def test_compiled_float32_gradients_are_exact_unless_tf32_is_asked():
  exact = _max_error(300, 300, None, grad=True)
  assert exact < 1e-5
  assert _max_error(300, 300, "tensorfloat32", grad=True) > 5 * exact
