"""The FlashAttention-2 backward pass (jaxflash/prefill_backward.py) against float64 gradients.

Tolerance, as the FlashAttention tests set it: the kernel's gradient error against float64
is at most a small multiple of the error of plain XLA attention computed in the same dtype
(plus a small epsilon). Each kernel case runs interpreted (any machine) and compiled (GPU
only, `-m gpu`); the interpreted shapes stay tiny and BackwardConfig(16, 16) tiles give
them multi-block loops, so the unmasked loops, the diagonal blocks and the ragged edges run.
"""
from __future__ import annotations

import functools
import json

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import BackwardConfig, PrefillConfig
from jaxflash.prefill import prefill_attention  # the Pallas-Triton kernel itself
from tests.conftest import (SM90_ONLY, d_scale_limit, poison_allocator, random_array,
                            run_on_forced_cpu_devices)
from tests.reference_np import attention_f64

SMALL = dict(config=PrefillConfig(16, 16), backward_config=BackwardConfig(16, 16))
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# error <= MULTIPLE * (plain XLA attention's error in the same dtype) + EPS * max |grad|
MULTIPLE = 3.0
EPS = {jnp.dtype(F32): 1e-5, jnp.dtype(F16): 2e-3, jnp.dtype(BF16): 1e-2}


def _visible(b, t, s, is_causal, q_lengths, kv_lengths, window=None):
  """[B, 1, T, S] bool, bottom-right: row t at key position p = t + kv_len - q_len sees
  p - left <= s <= p + right (window (left, right)), s <= p when causal."""
  q_len = np.full(b, t) if q_lengths is None else np.asarray(q_lengths)
  kv_len = np.full(b, s) if kv_lengths is None else np.asarray(kv_lengths)
  rows, cols = np.arange(t)[None, :, None], np.arange(s)[None, None, :]
  visible = (rows < q_len[:, None, None]) & (cols < kv_len[:, None, None])
  position = rows + (kv_len - q_len)[:, None, None]
  if is_causal:
    visible &= cols <= position
  if window is not None:
    visible &= (cols >= position - window[0]) & (cols <= position + window[1])
  return visible[:, None]  # [B, 1, T, S]


def grads_f64(q, k, v, d_out, *, is_causal=False, q_lengths=None, kv_lengths=None, scale=None,
              d_lse=None, window=None, mask=None):
  """Float64 NumPy (dq, dk, dv) of bottom-right attention (and of its LSE, with d_lse)."""
  q, k, v, d_out = (np.asarray(jnp.asarray(x, F32), np.float64) for x in (q, k, v, d_out))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  scale = h ** -0.5 if scale is None else scale
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # [B, S, N, H]
  visible = _visible(b, t, s, is_causal, q_lengths, kv_lengths, window)
  if mask is not None:  # [B, 1, T, S] bool, e.g. segment ids as an explicit mask
    visible = visible & np.asarray(mask)
  scores = np.where(visible, np.einsum("btnh,bsnh->bnts", q, kr) * scale, -np.inf)
  m = scores.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.)
  p = np.where(visible, np.exp(scores - m), 0.)
  denom = p.sum(-1, keepdims=True)
  p = p / np.where(denom > 0, denom, 1.)  # [B, N, T, S]
  dp = np.einsum("btnh,bsnh->bnts", d_out, vr)
  delta = (p * dp).sum(-1, keepdims=True)
  if d_lse is not None:
    delta = delta - np.asarray(d_lse, np.float64).transpose(0, 2, 1)[..., None]
  ds = p * (dp - delta)
  dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
  dk = (np.einsum("bnts,btnh->bsnh", ds, q) * scale).reshape(b, s, kh, g, h).sum(3)
  dv = np.einsum("bnts,btnh->bsnh", p, d_out).reshape(b, s, kh, g, h).sum(3)
  return dq, dk, dv


@jax.jit
def _xla_in_dtype_grads(q, k, v, d_out, visible):
  """Plain attention computed in the inputs' dtype (the FlashAttention tests' baseline)."""
  def attend(q, k, v):
    g = q.shape[2] // k.shape[2]
    kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, kr) * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    scores = jnp.where(visible, scores, -jnp.inf)
    m = lax.stop_gradient(jnp.max(scores, -1, keepdims=True))
    p = jnp.where(visible, jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.)), 0.)
    denom = jnp.sum(p, -1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1)
    return jnp.einsum("bnts,bsnh->btnh", p.astype(q.dtype), vr)
  return jax.vjp(attend, q, k, v)[1](d_out)


def _check_grads(grads, q, k, v, d_out, *, is_causal, q_lengths=None, kv_lengths=None,
                 window=None, mask=None):
  want = grads_f64(q, k, v, d_out, is_causal=is_causal, q_lengths=q_lengths, kv_lengths=kv_lengths,
                   window=window, mask=mask)
  visible = _visible(q.shape[0], q.shape[1], k.shape[1], is_causal, q_lengths, kv_lengths, window)
  visible = jnp.asarray(visible if mask is None else visible & np.asarray(mask))
  baseline = _xla_in_dtype_grads(q, k, v, d_out, visible)
  for name, got, ref, base, x in zip(("dq", "dk", "dv"), grads, want, baseline, (q, k, v)):
    chex.assert_shape(got, x.shape)
    chex.assert_type(got, x.dtype)
    got = np.asarray(jnp.asarray(got, F32), np.float64)
    assert not np.isnan(got).any(), f"{name} has NaN"
    err = np.abs(got - ref).max(initial=0.)
    base_err = np.abs(np.asarray(jnp.asarray(base, F32), np.float64) - ref).max(initial=0.)
    limit = MULTIPLE * base_err + EPS[jnp.dtype(x.dtype)] * max(1., np.abs(ref).max(initial=0.))
    assert err <= limit, f"{name}: error {err:.3g} over {limit:.3g} (XLA in-dtype error {base_err:.3g})"


def _inputs(rng, b, t, s, n, kh, h, dtype):
  return (random_array(rng, (b, t, n, h), dtype), random_array(rng, (b, s, kh, h), dtype),
          random_array(rng, (b, s, kh, h), dtype), random_array(rng, (b, t, n, h), dtype))


def _grads(q, k, v, d_out, q_lengths=None, kv_lengths=None, *, interpret, **kwargs):
  if not interpret:
    poison_allocator(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))
  f = lambda q, k, v: prefill_attention(q, k, v, q_lengths, kv_lengths, interpret=interpret,
                                        **kwargs)
  return jax.vjp(f, q, k, v)[1](d_out)


# (batch, T, S, N, K, head_dim, dtype, causal): odd lengths, T < S and T > S, GQA groups
# 1, 2, 5, 7, 8, every head dim and dtype.
CASES = [
    (1, 17, 17, 2, 1, 64, F32, True),
    (1, 33, 50, 5, 1, 80, BF16, True),  # T < S: bottom-right diagonal
    (1, 40, 23, 7, 1, 96, F16, True),  # T > S: the first rows see no key
    (1, 21, 37, 2, 2, 128, F32, False),
    (2, 24, 24, 8, 1, 64, BF16, False),
    (1, 19, 19, 4, 2, 256, F16, True),
    (1, 32, 48, 2, 1, 64, F16, True),  # exact multiples: only the diagonal is masked
    (1, 1, 30, 4, 2, 64, F32, True),  # one query row
]


def _case_id(case):
  b, t, s, n, kh, h, dtype, causal = case
  return f"b{b}-t{t}-s{s}-n{n}-k{kh}-h{h}-{jnp.dtype(dtype).name}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gradients_match_float64(case, interpret, rng):
  b, t, s, n, kh, h, dtype, causal = case
  q, k, v, d_out = _inputs(rng, b, t, s, n, kh, h, dtype)
  grads = _grads(q, k, v, d_out, interpret=interpret, is_causal=causal, **SMALL)
  _check_grads(grads, q, k, v, d_out, is_causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ragged_lengths_give_zero_gradients_on_padding(causal, interpret, rng):
  # Full; short queries over long keys; zero keys; zero queries; more queries than keys.
  q_lengths = np.array([29, 5, 20, 0, 29], np.int32)
  kv_lengths = np.array([37, 37, 0, 30, 9], np.int32)
  q, k, v, d_out = _inputs(rng, 5, 29, 37, 4, 2, 80, BF16)
  # Padding holds garbage (NaN, inf): none of it may reach a gradient.
  pad_q = (np.arange(29)[None, :] >= q_lengths[:, None])[:, :, None, None]
  pad_kv = (np.arange(37)[None, :] >= kv_lengths[:, None])[:, :, None, None]
  dirty = (jnp.where(pad_q, jnp.nan, q), jnp.where(pad_kv, jnp.inf, k), jnp.where(pad_kv, jnp.nan, v))
  grads = _grads(*dirty, d_out, jnp.asarray(q_lengths), jnp.asarray(kv_lengths),
                 interpret=interpret, is_causal=causal, **SMALL)
  _check_grads(grads, q, k, v, d_out, is_causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
  dq, dk, dv = (np.asarray(x.astype(F32)) for x in grads)
  assert (dq[np.broadcast_to(pad_q, dq.shape)] == 0).all(), "padded query rows: zero dq"
  assert (dk[np.broadcast_to(pad_kv, dk.shape)] == 0).all(), "padded keys: zero dk"
  assert (dv[np.broadcast_to(pad_kv, dv.shape)] == 0).all(), "padded keys: zero dv"
  assert (dq[2] == 0).all() and (dk[3] == 0).all(), "nothing to attend: zero gradients"


def test_lse_cotangent_and_value_and_grad(interpret, rng):
  """return_residual=True is differentiable in out and in the LSE (delta - dLSE)."""
  q, k, v, d_out = _inputs(rng, 1, 20, 26, 4, 2, 64, F32)
  d_lse = random_array(rng, (1, 20, 4), F32)

  def loss(q, k, v):
    out, lse = prefill_attention(q, k, v, is_causal=True, return_residual=True,
                                 interpret=interpret, **SMALL)
    return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.) * d_lse)

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert np.isfinite(float(value))
  want = grads_f64(q, k, v, d_out, is_causal=True, d_lse=d_lse)
  for got, ref in zip(grads, want):
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5 * max(1, np.abs(ref).max()))


def test_transformations_and_residuals(rng):
  """jit, vmap, jax.checkpoint and lax.scan over layers; the VJP keeps O(n) residuals."""
  q, k, v, d_out = _inputs(rng, 1, 18, 18, 2, 1, 64, F32)
  attend = lambda q, k, v: prefill_attention(q, k, v, is_causal=True, **SMALL)
  want = grads_f64(q, k, v, d_out, is_causal=True)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v) * d_out)
  tol = dict(atol=3e-5)
  for fn in (jax.jit(jax.grad(loss, (0, 1, 2))), jax.grad(jax.checkpoint(loss), (0, 1, 2))):
    for got, ref in zip(fn(q, k, v), want):
      np.testing.assert_allclose(np.asarray(got), ref, **tol)
  # vmap over a leading axis of two problems.
  stacked = [jnp.stack([x, x[:, ::-1]]) for x in (q, k, v)]
  batched = jax.vmap(jax.grad(loss, (0, 1, 2)))(*stacked)
  for got, ref in zip(batched, want):
    np.testing.assert_allclose(np.asarray(got[0]), ref, **tol)
  # lax.scan over two "layers" that feed attention's output back in as the next query.
  def layers(q, k, v):
    def layer(x, _):
      return attend(x, k, v) + x, None
    return jnp.sum(lax.scan(jax.checkpoint(layer), q, None, length=2)[0])
  got = jax.jit(jax.grad(layers, (0, 1, 2)))(q, k, v)
  ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(lax.scan(
      lambda x, _: (jaxflash.attention(x, k, v, is_causal=True, implementation="xla") + x, None),
      q, None, length=2)[0]), (0, 1, 2)))(q, k, v)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
  # Residuals: q, k, v, out, the LSE and the scale, nothing of size T x S.
  _, vjp = jax.vjp(attend, q, k, v)
  saved = sum(x.size for x in jax.tree.leaves(vjp))
  assert saved <= 2 * q.size + k.size + v.size + q.size // q.shape[-1] + 1, saved


def test_public_attention_is_differentiable(rng):
  """jaxflash.attention: prefill and one-token decode paths against the "xla" path; paged
  decode, jax.jvp and second derivatives raise clear errors."""
  q, k, v, _ = _inputs(rng, 2, 19, 27, 4, 2, 64, F32)
  lengths = jnp.array([27, 6], jnp.int32)
  for query, kwargs in ((q, dict(is_causal=True)), (q[:, :1], dict(key_value_seq_lengths=lengths))):
    grads = {impl: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jaxflash.attention(
        q, k, v, implementation=impl, **kwargs))), (0, 1, 2))(query, k, v) for impl in (None, "xla")}
    for a, b in zip(grads[None], grads["xla"]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda q: jaxflash.attention(q, k, v), (q,), (q,))
  with pytest.raises(NotImplementedError, match="second derivatives"):
    jax.grad(lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(jaxflash.attention(q, k, v) ** 2))(q)))(q)
  pages = jnp.zeros((4, 8, 2, 64), F32)
  table = jnp.arange(4, dtype=jnp.int32).reshape(2, 2)
  with pytest.raises(NotImplementedError, match="paged decode"):
    jax.grad(lambda p: jnp.sum(jaxflash.attention(q[:, :1], p, p, key_value_seq_lengths=lengths // 2,
                                                  block_table=table)))(pages)


def _enable_x64():
  """JAX's float64 context manager (jax.enable_x64 since 0.10; jax.experimental before)."""
  manager = getattr(jax, "enable_x64", None)
  if manager is None:
    from jax.experimental import enable_x64 as manager
  return manager(True)


def _loss(attend, d_out, d_lse):
  """A scalar of out and the LSE (padded rows' -inf LSE left out), so every gradient runs
  through both cotangents."""
  def loss(q, k, v, bias, sinks, scale):
    out, lse = attend(q, k, v, bias, sinks, scale)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.)
    return jnp.sum(out * d_out.astype(out.dtype)) + jnp.sum(lse * d_lse.astype(lse.dtype))
  return loss


def _option_grads_f64(q, k, v, bias, sinks, scale, d_out, d_lse, q_lengths, kv_lengths, options):
  """Float64 gradients (q, k, v, bias, sinks, scale) of the plain-JAX reference."""
  from jaxflash.reference import attention_reference
  f64 = lambda x: None if x is None else jnp.asarray(np.asarray(jnp.asarray(x, F32), np.float64))
  with _enable_x64():
    def attend(q, k, v, bias, sinks, scale):
      return attention_reference(q, k, v, bias, options.get("mask"), scale=scale,
                                 query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                                 sinks=sinks, **{n: x for n, x in options.items() if n != "mask"})
    loss = _loss(attend, f64(d_out), f64(d_lse))
    grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))(
        f64(q), f64(k), f64(v), f64(bias), f64(sinks), jnp.float64(scale))
    return [None if g is None else np.asarray(g, np.float64) for g in grads]


# Each option alone and combined: (batch, T, S, N, K, H, lengths, options); "bias" and
# "sinks" name the shape of the differentiated array (a broadcastable bias, or [N]).
OPTION_CASES = {
    "bias-full": (2, 19, 27, 4, 2, 32, False, dict(bias=(2, 4, 19, 27))),
    "bias-broadcast": (2, 19, 27, 4, 2, 32, True, dict(bias=(1, 4, 1, 27))),
    "bias-rank2": (1, 21, 21, 2, 1, 32, False, dict(bias=(21, 21), is_causal=True)),
    "mask": (2, 19, 27, 4, 2, 32, True, dict(mask=(2, 1, 19, 27))),
    "window": (1, 37, 37, 2, 1, 32, False, dict(local_window_size=(5, 3))),
    "window-causal": (2, 23, 40, 5, 1, 32, True, dict(local_window_size=(9, 0), is_causal=True)),
    # q_splits = 2 with windows, where some split's share of a loop is empty: the compiled
    # dK/dV kernel read out of bounds at these shapes (the empty loop's index; Triton's
    # software pipeliner, see _dkdv_kernel)
    "window-splits": (2, 24, 31, 4, 2, 64, False, dict(local_window_size=(12, 0), is_causal=True)),
    "window-narrow-splits": (2, 24, 31, 4, 2, 64, False, dict(local_window_size=(5, 0), is_causal=True)),
    "window-zero-splits": (2, 24, 31, 4, 2, 64, False, dict(local_window_size=(0, 0), is_causal=True)),
    "window-wide-splits": (2, 24, 31, 4, 2, 64, False, dict(local_window_size=(40, 0), is_causal=True)),
    "top-left": (2, 21, 33, 2, 2, 32, True, dict(is_causal=True, causal_alignment="top_left")),
    "top-left-window": (1, 30, 18, 2, 1, 32, False, dict(local_window_size=(4, 6),
                                                          causal_alignment="top_left")),
    "soft-cap": (1, 20, 29, 7, 7, 32, False, dict(logits_soft_cap=2.0, is_causal=True)),
    "sinks": (3, 17, 24, 4, 2, 32, True, dict(sinks=(4,))),
    "combined": (2, 26, 35, 5, 1, 48, True, dict(
        bias=(1, 5, 26, 1), mask=(2, 5, 26, 35), sinks=(5,), local_window_size=(11, 2),
        is_causal=True, logits_soft_cap=3.0, causal_alignment="top_left")),
}


@pytest.mark.parametrize("case", list(OPTION_CASES), ids=str)
def test_option_gradients_match_float64(case, interpret, rng):
  """Gradients of q, k, v, the bias (summed over its broadcast axes), the sinks and a
  traced scale through every option, against float64 gradients of the reference."""
  b, t, s, n, kh, h, ragged, spec = OPTION_CASES[case]
  q, k, v, d_out = _inputs(rng, b, t, s, n, kh, h, F32)
  d_lse = random_array(rng, (b, t, n), F32)
  options = dict(spec)
  bias = random_array(rng, options.pop("bias"), F32) if "bias" in spec else None
  sinks = random_array(rng, options.pop("sinks"), F32) if "sinks" in spec else None
  if "mask" in spec:
    options["mask"] = jnp.asarray(rng.random(spec["mask"]) < 0.8)
  q_lengths = kv_lengths = None
  if ragged:  # the last sequence attends to nothing (lse = its sink with sinks)
    q_lengths = jnp.asarray(np.r_[rng.integers(1, t + 1, b - 1), t], jnp.int32)
    kv_lengths = jnp.asarray(np.r_[rng.integers(1, s + 1, b - 1), 0], jnp.int32)
  scale = 0.7 * h ** -0.5

  def attend(q, k, v, bias, sinks, scale):
    return prefill_attention(q, k, v, q_lengths, kv_lengths, bias=bias, sinks=sinks, scale=scale,
                             return_residual=True, interpret=interpret, **options, **SMALL)

  got = jax.jit(jax.grad(_loss(attend, d_out, d_lse), argnums=(0, 1, 2, 3, 4, 5)))(
      q, k, v, bias, sinks, jnp.float32(scale))
  want = _option_grads_f64(q, k, v, bias, sinks, scale, d_out, d_lse, q_lengths, kv_lengths, options)
  for name, g, ref, x in zip(("dq", "dk", "dv", "d_bias", "d_sinks", "d_scale"), got, want,
                             (q, k, v, bias, sinks, jnp.float32(scale))):
    if x is None:
      assert g is None and ref is None, name
      continue
    chex.assert_shape(g, x.shape)
    chex.assert_type(g, x.dtype)
    g = np.asarray(g, np.float64)
    assert np.isfinite(g).all(), f"{name} is not finite"
    err, size = np.abs(g - ref).max(), max(1., np.abs(ref).max())
    limit = d_scale_limit(q, got[0], want[0], scale) if name == "d_scale" else 5e-5 * size
    assert err <= limit, f"{case} {name}: error {err:.3g} over {limit:.3g} (max |grad| {size:.3g})"


def test_option_gradients_in_bfloat16(interpret, rng):
  """bf16 inputs with every option: the FlashAttention tolerance rule for q, k, v against
  float64 (error <= MULTIPLE x the same loss computed by plain attention in bf16)."""
  from jaxflash.reference import attention_reference
  b, t, s, n, kh, h = 2, 24, 31, 4, 2, 64
  q, k, v, d_out = _inputs(rng, b, t, s, n, kh, h, BF16)
  d_lse = random_array(rng, (b, t, n), F32)
  bias = random_array(rng, (1, n, t, s), BF16)
  sinks = random_array(rng, (n,), F32)
  options = dict(mask=jnp.asarray(rng.random((b, 1, t, s)) < 0.9), is_causal=True,
                 local_window_size=(12, 0), logits_soft_cap=5.0)
  scale = h ** -0.5

  def attend(q, k, v, bias, sinks, scale):
    return prefill_attention(q, k, v, bias=bias, sinks=sinks, scale=scale, return_residual=True,
                             interpret=interpret, **options, **SMALL)

  def plain(q, k, v, bias, sinks, scale):  # the baseline: all in bf16 but the LSE
    return attention_reference(q, k, v, bias, options["mask"], scale=scale, sinks=sinks,
                               **{n: x for n, x in options.items() if n != "mask"})

  args = (q, k, v, bias, sinks, jnp.float32(scale))
  got = jax.grad(_loss(attend, d_out, d_lse), argnums=(0, 1, 2, 3, 4))(*args)
  base = jax.grad(_loss(plain, d_out, d_lse), argnums=(0, 1, 2, 3, 4))(*args)
  want = _option_grads_f64(*args[:5], scale, d_out, d_lse, None, None, options)
  for name, g, bs, ref in zip(("dq", "dk", "dv", "d_bias", "d_sinks"), got, base, want):
    g, bs = (np.asarray(jnp.asarray(x, F32), np.float64) for x in (g, bs))
    err, base_err = np.abs(g - ref).max(), np.abs(bs - ref).max()
    limit = MULTIPLE * base_err + 1e-2 * max(1., np.abs(ref).max())
    if name == "d_sinks":
      limit += _d_sinks_shift_from_out(attend, args, d_out, options)
    assert err <= limit, f"{name}: error {err:.3g} over {limit:.3g} (bf16 baseline {base_err:.3g})"


def _d_sinks_shift_from_out(attend, args, d_out, options) -> float:
  """What the forward's bf16 output costs d_sinks = -sum_rows P_sink * rowsum(dO * O): the
  backward, as FlashAttention-2's, takes delta from the stored O (rounded to bf16, and
  computed from bf16 P), so its d_sinks moves by sum_rows P_sink * rowsum(dO * (O - O_exact))
  (largest over the heads). The plain-JAX baseline differentiates through its own O, so its
  error says nothing of this term."""
  q, k, v, bias, sinks, scale = args
  out_ref, lse_ref = attention_f64(q, k, v, scale=float(scale), is_causal=options["is_causal"],
                                   bias=bias, mask=options["mask"],
                                   window=options["local_window_size"],
                                   softcap=options["logits_soft_cap"], sinks=sinks)
  out = np.asarray(jnp.asarray(attend(*args)[0], F32), np.float64)
  p_sink = np.exp(np.asarray(sinks, np.float64)[None, None, :] - lse_ref)  # [B, T, N]
  shift = (np.asarray(jnp.asarray(d_out, F32), np.float64) * (out - out_ref)).sum(-1)  # [B, T, N]
  return float(np.abs((p_sink * shift).sum(axis=(0, 1))).max())


def test_the_forward_is_pluggable(rng):
  """vjp.with_backward takes any forward with the reference's out and LSE: with the
  plain-JAX reference as a stand-in forward (as the Mosaic kernel is on Hopper) the
  Triton backward's gradients equal float64 ones, and the stand-in is what runs forward."""
  from jaxflash import prefill_backward, vjp
  from jaxflash.reference import attention_reference
  from jaxflash.score_mods import ScoreMods
  q, k, v, d_out = _inputs(rng, 2, 20, 20, 4, 2, 64, F32)
  d_lse = jnp.zeros((2, 20, 4), F32)
  kv_lengths = jnp.array([20, 13], jnp.int32)
  mods = ScoreMods(is_causal=True)
  calls = []

  def forward(q, k, v, o: vjp.Options, with_lse):
    calls.append(with_lse)
    return attention_reference(q, k, v, o.bias, o.mask, scale=o.scale, is_causal=True, sinks=o.sinks,
                               query_seq_lengths=o.q_lengths, key_value_seq_lengths=o.kv_lengths)

  def backward(q, k, v, o: vjp.Options, out, lse, d_out, d_lse):
    return prefill_backward.backward_kernels(q, k, v, o.q_lengths, o.kv_lengths, out, lse, d_out,
                                             d_lse, bias=o.bias, mask=o.mask, scale=o.scale, mods=mods,
                                             config=BackwardConfig(16, 16), interpret=True)

  def attend(q, k, v, bias, sinks, scale):
    return vjp.with_backward(forward, q, k, v, vjp.Options(None, kv_lengths, scale=scale),
                             backward=backward, return_residual=True)

  scale = jnp.float32(64 ** -0.5)
  got = jax.grad(_loss(attend, d_out, d_lse), argnums=(0, 1, 2, 5))(q, k, v, None, None, scale)
  assert calls == [True]
  want = _option_grads_f64(q, k, v, None, None, float(scale), d_out, d_lse, None, kv_lengths,
                           dict(is_causal=True))
  for name, g, ref in zip(("dq", "dk", "dv", "d_scale"), got, [want[i] for i in (0, 1, 2, 5)]):
    limit = (d_scale_limit(q, got[0], want[0], scale) if name == "d_scale"
             else 3e-5 * max(1., np.abs(ref).max()))
    np.testing.assert_allclose(np.asarray(g), ref, atol=limit, err_msg=name)


@pytest.mark.gpu
@SM90_ONLY
def test_mosaic_forward_is_differentiable(rng):
  """On sm_90: jax.grad through implementation="mosaic" (and the default path, which takes
  it) runs the Triton backward on the Mosaic forward's out and LSE; bf16 against float64."""
  b, t, n, kh, h = 2, 384, 8, 2, 128
  q, k, v, d_out = _inputs(rng, b, t, t, n, kh, h, BF16)
  d_lse = jnp.zeros((b, t, n), F32)
  for impl in ("mosaic", None):
    attend = lambda q, k, v, bias, sinks, scale: jaxflash.attention(
        q, k, v, is_causal=True, implementation=impl, return_residual=True)
    got = jax.jit(jax.grad(_loss(attend, d_out, d_lse), argnums=(0, 1, 2)))(q, k, v, None, None, 1.)
    _check_grads(got, q, k, v, d_out, is_causal=True)


@pytest.mark.parametrize("config,error,match", [
    (BackwardConfig(256, 256, 8, 4), ValueError, "shared memory"),
    (BackwardConfig(24, 16), ValueError, "block_q"),
    ((16, 16), TypeError, "BackwardConfig"),
])
def test_bad_backward_configs_are_refused(config, error, match):
  q = jnp.zeros((1, 16, 2, 256), BF16)
  kv = jnp.zeros((1, 16, 1, 256), BF16)
  with pytest.raises(error, match=match):
    jax.grad(lambda q: jnp.sum(prefill_attention(q, kv, kv, backward_config=config)))(q)


def test_sharded_gradients_cpu_mesh():
  """On 4 forced CPU devices: gradients keep the inputs' batch/head splits, match one
  device's, and the compiled program has no all-gather, also with a bias, sinks, a window
  and a soft-cap (subprocess: see `_sharded_cases`)."""
  results = run_on_forced_cpu_devices("tests.test_prefill_backward")
  assert {r["layout"] for r in results} == {"heads", "both", "kv_replicated", "options"}
  for r in results:
    assert r["err"] <= 2e-5, r
    assert r["dq_spec"] == r["want_q_spec"] and r["dk_spec"] == r["want_k_spec"], r
    assert "all-gather" not in r["collectives"], r
    if r["layout"] != "kv_replicated":  # there the KV heads' parts are summed: an all-reduce
      assert r["collectives"] == [], r


def _sharded_cases():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  rng = np.random.default_rng(0)
  results = []
  layouts = {"heads": ((4,), ("model",), None, "model", 4),
             "both": ((2, 2), ("data", "model"), "data", "model", 4),
             "kv_replicated": ((4,), ("model",), None, "model", 2),
             "options": ((2, 2), ("data", "model"), "data", "model", 4)}
  for name, (shape, axes, batch_axis, head_axis, kv_heads) in layouts.items():
    q, k, v, d_out = _inputs(rng, 4, 8, 24, 8, kv_heads, 16, F32)
    lengths = jnp.array([8, 5, 8, 1], jnp.int32), jnp.array([24, 9, 0, 17], jnp.int32)
    options = {} if name != "options" else dict(
        bias=random_array(rng, (4, 8, 8, 24), F32), sinks=random_array(rng, (8,), F32),
        local_window_size=(6, 0), logits_soft_cap=3.0, causal_alignment="bottom_right")
    loss = lambda q, k, v, ql, kl: jnp.sum(jaxflash.attention(
        q, k, v, is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl, **options) * d_out)
    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    want = [np.asarray(x) for x in grad(q, k, v, *lengths)]
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), axes)
    kv_head_axis = head_axis if kv_heads % 4 == 0 or name == "both" else None
    q_spec, k_spec = P(batch_axis, None, head_axis, None), P(batch_axis, None, kv_head_axis, None)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = (put(q, q_spec), put(k, k_spec), put(v, k_spec), put(lengths[0], P(batch_axis)),
            put(lengths[1], P(batch_axis)))
    hlo = grad.lower(*args).compile().as_text()
    dq, dk, dv = grad(*args)
    spec = lambda x: [a for a in x.sharding.spec] + [None] * (4 - len(x.sharding.spec))
    results.append(dict(
        layout=name, err=max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip((dq, dk, dv), want)),
        dq_spec=spec(dq), dk_spec=spec(dk), want_q_spec=list(q_spec), want_k_spec=list(k_spec),
        collectives=sorted({c for c in ("all-gather", "all-to-all", "collective-permute",
                                        "all-reduce", "reduce-scatter") if c in hlo})))
  print(json.dumps(results))


@pytest.mark.gpu
def test_backward_temp_memory_is_linear_in_length():
  """Compiled: the backward never materialises the n x n scores (temporary memory O(n))."""
  def temp_bytes(n):
    q = jax.ShapeDtypeStruct((1, n, 12, 128), BF16)
    kv = jax.ShapeDtypeStruct((1, n, 2, 128), BF16)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        prefill_attention(q, k, v, is_causal=True).astype(F32)), (0, 1, 2)))
    return grad.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(4096), temp_bytes(16384)
  scores_16k = 12 * 16384 * 16384 * 4  # one float32 score matrix
  assert large <= 5 * max(small, 1 << 20), (small, large)
  assert large < scores_16k // 100, (small, large)


def test_q_splits_sum_the_same_gradients(interpret, rng):
  """BackwardConfig.q_splits: the dK/dV kernel's query range split over programs whose
  float32 partial sums XLA adds in a fixed order: the same gradients as one program per
  key block (to float32 rounding), the same bits run to run, with a window and GQA."""
  q, k, v, d_out = _inputs(rng, 2, 45, 38, 6, 2, 64, F32)
  bias = random_array(rng, (1, 6, 45, 38), F32)
  kwargs = dict(is_causal=True, local_window_size=(20, 0), causal_alignment="top_left")

  def grads(q_splits):
    config = BackwardConfig(16, 16, q_splits=q_splits)
    f = lambda q, k, v, bias: jnp.sum(prefill_attention(
        q, k, v, bias=bias, config=PrefillConfig(16, 16), backward_config=config,
        interpret=interpret, **kwargs) * d_out)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, bias)

  one, three = grads(1), grads(3)
  for a, b in zip(one, three):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  for a, b in zip(three, grads(3)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_q_splits_default():
  """The automatic split: only where the dK/dV grid leaves the SMs less than two programs
  each, and then MAX_Q_SPLITS, never more than the query blocks; a set value is kept."""
  from jaxflash import configs
  from jaxflash.device import DeviceInfo
  h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 227 * 1024)
  auto = BackwardConfig(64, 64)
  assert configs.backward_q_splits(auto, 1 * 2 * 64, 64, h200) == 4  # B=1, K=2, n=4096
  assert configs.backward_q_splits(auto, 1 * 2 * 128, 128, h200) == 4  # n=8192
  assert configs.backward_q_splits(auto, 1 * 2 * 256, 256, h200) == 1  # n=16384: enough
  assert configs.backward_q_splits(auto, 2, 64, h200) == configs.MAX_Q_SPLITS
  assert configs.backward_q_splits(auto, 2, 2, h200) == 2
  assert configs.backward_q_splits(BackwardConfig(64, 64, q_splits=1), 2, 64, h200) == 1
  q = jnp.zeros((1, 16, 2, 64), F32)
  with pytest.raises(ValueError, match="q_splits"):
    jax.grad(lambda q: jnp.sum(prefill_attention(
        q, q[:, :, :1], q[:, :, :1], backward_config=BackwardConfig(16, 16, q_splits=0))))(q)


def test_gradients_inside_shard_map(rng):
  """jax.grad inside jax.shard_map (check_vma on) with a bias and sinks: interpreted there
  the plain-JAX reference stands in for the kernels (jaxflash/prefill.py says why); the
  gradients equal the xla path's outside."""
  from jax.sharding import Mesh, PartitionSpec as P
  q, k, v, d_out = _inputs(rng, 2, 12, 17, 4, 2, 32, F32)
  bias = random_array(rng, (1, 4, 12, 17), F32)
  sinks = random_array(rng, (4,), F32)

  def loss(q, k, v, bias, sinks, implementation=None):
    out = jaxflash.attention(q, k, v, bias, is_causal=True, sinks=sinks, implementation=implementation)
    return jnp.sum(out * d_out)

  mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  mapped = jax.jit(jax.shard_map(lambda *a: grad(*a), mesh=mesh,
                                 in_specs=(P("data"),) * 3 + (P(), P()),
                                 out_specs=(P("data"),) * 3 + (P(), P())))
  got = mapped(q, k, v, bias, sinks)
  want = jax.grad(functools.partial(loss, implementation="xla"), argnums=(0, 1, 2, 3, 4))(
      q, k, v, bias, sinks)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


if __name__ == "__main__":
  _sharded_cases()
