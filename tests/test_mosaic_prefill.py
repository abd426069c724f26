"""The Mosaic GPU (sm_90) prefill against the float64 reference.

The kernel cases run compiled only (marker `gpu`): JAX's Mosaic GPU interpret mode cannot
run this kernel yet (jaxflash._mosaic.INTERPRET_GAPS says why), so on the CPU the tests
check what needs no GPU: `supports` on device descriptions (the dispatch rule), the config
table, the guarded import and the argument checks.
"""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _mosaic
from jaxflash import mosaic
from jaxflash.device import A100, H200, RTX_3090, RTX_4060_LAPTOP, DeviceInfo
from jaxflash.mosaic import MosaicPrefillConfig, mosaic_prefill_config, prefill_attention, supports
from tests.conftest import HAS_GPU, SM90_ONLY, assert_close, poison_allocator
from tests.reference_np import attention_f64
from tests.test_prefill import _check, _qkv, check_ragged_lengths

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
gpu = pytest.mark.gpu
# Checks that hold only off the GPU, and checks of `supports` that need Mosaic GPU in this JAX.
CPU_ONLY = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")
NEEDS_MOSAIC = pytest.mark.skipif(not _mosaic.AVAILABLE,
                                  reason=f"no Mosaic GPU in this JAX: {_mosaic.IMPORT_ERROR}")


def _run(q, k, v, q_lengths=None, kv_lengths=None, **kwargs):
  poison_allocator(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
  out, lse = prefill_attention(q, k, v, q_lengths, kv_lengths, return_residual=True, **kwargs)
  chex.assert_shape(out, q.shape)
  chex.assert_type(out, q.dtype)
  chex.assert_shape(lse, q.shape[:3])
  chex.assert_type(lse, jnp.float32)
  return out, lse


# (batch, T, S, N, K, head_dim, dtype, causal, config): odd lengths, T < S and T > S, GQA
# groups 1, 2, 3, 5, 6, 7, 8, every head dim (64, 128, 192, 256) and both dtypes.
C = MosaicPrefillConfig
SMALL = C(64, 64, 2)  # the mbarrier ping-pong, 64-key blocks
PAIR = C(64, 128, 2)  # the mbarrier ping-pong (the d = 64 default below 8192 keys)
# The intra-warpgroup overlap on the named-barrier ring, and with an output buffer of its own.
OVERLAP = C(64, 128, 2, overlap_softmax=True)
FAST = dataclasses.replace(OVERLAP, separate_output=True)
# Three consumers taking turns in a ring (the d = 64 default from 8192 keys on), and at d = 128
# with 64-key blocks.
THREE = dataclasses.replace(FAST, num_consumers=3)
THREE_64 = dataclasses.replace(THREE, block_kv=64)
# The row sums out of PV (V transposed, with rows of ones): the d = 64 default from 8192 keys on.
SUMMED = dataclasses.replace(FAST, tensor_core_row_sums=True)
THREE_SUMMED = dataclasses.replace(THREE, tensor_core_row_sums=True)
# The fixed softmax reference (bf16 only), with the second pass for the tiles that overflow.
FIXED = dataclasses.replace(FAST, fixed_reference=True)
THREE_SUMMED_FIXED = dataclasses.replace(THREE_SUMMED, fixed_reference=True)
CASES = [
    (1, 1, 1, 1, 1, 64, BF16, True, None),
    (1, 17, 17, 2, 1, 64, BF16, True, SMALL),
    (2, 100, 129, 5, 1, 128, F16, True, SMALL),  # T < S: bottom-right diagonal
    (1, 129, 100, 6, 1, 128, BF16, True, None),  # T > S: the first 29 rows see no key
    (1, 33, 70, 7, 1, 128, BF16, False, None),
    (1, 300, 300, 8, 1, 256, F16, False, None),
    (1, 300, 257, 8, 1, 256, BF16, True, None),
    (1, 100, 1, 4, 4, 128, BF16, True, None),  # one key: all but the last row are empty
    (1, 130, 130, 2, 2, 64, F16, False, None),
    (2, 1, 129, 4, 2, 128, BF16, True, None),  # one query row
    (1, 256, 512, 6, 3, 128, BF16, True, None),  # whole tiles: only the diagonal is masked
    (1, 1000, 1000, 12, 2, 128, BF16, True, None),  # many tiles, deep ring
    (1, 513, 777, 3, 3, 192, F16, True, None),
    (1, 640, 640, 4, 1, 64, F16, True, None),
    (2, 1000, 1100, 12, 2, 128, BF16, True, None),  # 192 tiles: persistent CTAs take several
    (2, 1000, 1100, 12, 2, 128, BF16, True, OVERLAP),
    (1, 333, 333, 4, 2, 256, F16, False, dataclasses.replace(OVERLAP, block_kv=64)),
    # 512 one-block tiles: each CTA walks about four, the ping-pong handed off between them.
    (8, 120, 128, 64, 8, 64, F16, True, None),
    (8, 120, 128, 64, 8, 64, F16, True, OVERLAP),
    (2, 1000, 1100, 12, 2, 128, BF16, True, PAIR),
    (1, 640, 640, 4, 1, 64, F16, True, OVERLAP),
    (8, 120, 128, 64, 8, 64, F16, True, FAST),
    (2, 1000, 1100, 12, 2, 128, BF16, True, dataclasses.replace(FAST, separate_output=False)),
    (1, 129, 100, 6, 1, 128, F16, True, FAST),
    (1, 33, 70, 7, 1, 128, BF16, False, dataclasses.replace(FAST, block_kv=64, num_stages=3)),
    (1, 300, 257, 8, 1, 256, BF16, True, dataclasses.replace(FAST, block_kv=64, separate_output=False)),
    (2, 1000, 1100, 12, 2, 128, BF16, True, THREE_64),  # 96 tiles of 192 rows
    (1, 33, 70, 7, 1, 128, F16, False, THREE_64),
    (1, 129, 100, 6, 1, 128, BF16, True, THREE_64),
    (8, 120, 128, 64, 8, 64, F16, True, THREE),  # the ring handed on between one-block tiles
    (1, 100, 1, 4, 4, 128, BF16, True, SUMMED),  # rows that see no key: their sums stay 0
    (2, 1000, 1100, 12, 2, 128, BF16, True, SUMMED),
    (1, 513, 777, 3, 3, 192, F16, True, dataclasses.replace(SUMMED, block_kv=64,
                                                            separate_output=False)),
    (1, 129, 100, 6, 1, 64, F16, True, THREE_SUMMED),  # T > S
    (2, 100, 129, 5, 1, 64, BF16, False, THREE_SUMMED),  # T < S
    (8, 120, 128, 64, 8, 64, BF16, True, THREE_SUMMED),
    (1, 129, 100, 6, 1, 128, BF16, True, FIXED),  # T > S: rows that see no key
    (2, 100, 129, 5, 1, 128, BF16, True, FIXED),  # T < S
    (1, 33, 70, 7, 1, 128, BF16, False, FIXED),
    (2, 1000, 1100, 12, 2, 128, BF16, True, FIXED),
    (1, 100, 1, 4, 4, 128, BF16, True, FIXED),
    (8, 120, 128, 64, 8, 64, BF16, True, THREE_SUMMED_FIXED),
    (1, 513, 777, 3, 3, 192, BF16, True, dataclasses.replace(FIXED, block_kv=64,
                                                             separate_output=False)),
]


# Configs run on one causal 384-token shape at d = 128 (test_configs).
CONFIGS_AT_D128 = [
    C(64, 128, 2), C(64, 64, 4), C(64, 192, 2), OVERLAP, FAST,
    C(64, 128, 2, separate_output=True), C(64, 64, 3, overlap_softmax=True),
    dataclasses.replace(FAST, conditional_rescale=True), C(64, 128, 2, conditional_rescale=True),
    THREE_64, dataclasses.replace(THREE_64, num_stages=4), SUMMED,
    C(64, 64, 3, overlap_softmax=True, tensor_core_row_sums=True),
    FIXED, dataclasses.replace(FIXED, block_kv=64, num_stages=3),
]


def _case_id(case):
  b, t, s, n, k, h, dtype, causal, config = case
  return (f"b{b}-t{t}-s{s}-n{n}-k{k}-h{h}-{jnp.dtype(dtype).name}-{'causal' if causal else 'full'}"
          f"-{_config_id(config)}")


def _config_id(config):
  if config is None:
    return "default"
  flags = [name for name in ("overlap_softmax", "separate_output", "conditional_rescale",
                             "tensor_core_row_sums", "fixed_reference")
           if getattr(config, name)]
  if config.num_consumers != 2:
    flags.append(f"{config.num_consumers}consumers")
  return "x".join(map(str, (config.block_q, config.block_kv, config.num_stages, *flags)))


@gpu
@SM90_ONLY
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case, rng):
  batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, causal, config = case
  q, k, v = _qkv(rng, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
  out, lse = _run(q, k, v, is_causal=causal, config=config)
  _check(out, lse, q, k, v, is_causal=causal)


# (batch, T, S, N, K, head_dim, dtype, causal, window, config): windows narrower and wider
# than a key block, one-sided and two-sided, T < S and T > S, against the float64 reference.
WINDOW_CASES = [
    (1, 300, 300, 4, 2, 128, BF16, True, (64, 0), None),
    (2, 257, 700, 6, 2, 128, F16, True, (130, 0), SMALL),  # T < S: the window trails the diagonal
    (1, 700, 333, 5, 1, 64, BF16, True, (5, 0), None),  # T > S, a window inside one block
    (1, 400, 400, 7, 1, 256, F16, False, (100, 37), None),  # two-sided, no causal mask
    (1, 1000, 1000, 12, 2, 128, BF16, True, (256, 0), OVERLAP),
    (1, 400, 400, 7, 1, 256, F16, False, (100, 37), dataclasses.replace(OVERLAP, block_kv=64)),
    (2, 1000, 1000, 12, 2, 128, BF16, True, (256, 0), None),  # persistent, ragged, 192 tiles
    (1, 1000, 1000, 8, 8, 128, BF16, False, (0, 300), None),  # keys ahead only
    (2, 1000, 1000, 12, 2, 128, BF16, True, (256, 0), FAST),
    (2, 257, 700, 6, 2, 128, F16, True, (130, 0), THREE_64),  # later consumers' first blocks masked
    (1, 400, 400, 7, 1, 64, BF16, False, (100, 37), THREE),
    (2, 257, 700, 6, 2, 64, F16, True, (130, 0), THREE_SUMMED),
    (2, 257, 700, 6, 2, 128, BF16, True, (130, 0), FIXED),  # (a window keeps the running max)
]


@gpu
@SM90_ONLY
@pytest.mark.parametrize("case", WINDOW_CASES,
                         ids=lambda c: f"b{c[0]}-t{c[1]}-s{c[2]}-w{c[8][0]}x{c[8][1]}-{_config_id(c[9])}")
def test_sliding_window_matches_reference(case, rng):
  batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, causal, window, config = case
  q, k, v = _qkv(rng, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
  q_len = np.array([seq_q] * batch, np.int32)
  kv_len = np.array([seq_kv] + [seq_kv - 77] * (batch - 1), np.int32)
  out, lse = _run(q, k, v, jnp.asarray(q_len), jnp.asarray(kv_len), is_causal=causal,
                  local_window_size=window, config=config)
  _check(out, lse, q, k, v, is_causal=causal, q_lengths=q_len, kv_lengths=kv_len, window=window)


def _assert_mosaic_grads_match_triton(q, k, v, **options):
  """jax.grad (under jit) of a loss of jaxflash.attention(q, k, v, **options) on the Mosaic
  forward equals that on the Triton forward: the same backward on the same out and LSE."""
  grads = {}
  for impl in ("mosaic", "triton"):
    loss = lambda q, k, v: jnp.sum(jnp.sin(jaxflash.attention(
        q, k, v, implementation=impl, **options).astype(F32)))
    grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(grads["mosaic"], grads["triton"]):
    got, want = np.asarray(got.astype(F32)), np.asarray(want.astype(F32))
    np.testing.assert_allclose(got, want, atol=2e-2 * max(1., np.abs(want).max()))


@gpu
@SM90_ONLY
def test_windowed_gradients_through_mosaic_match_triton(rng):
  """jax.grad of jaxflash.attention with a window on the Mosaic forward (the default on
  sm_90) equals the Triton forward's: the same backward on the same out and LSE."""
  q, k, v = _qkv(rng, 1, 777, 777, 6, 2, 128, BF16)
  _assert_mosaic_grads_match_triton(q, k, v, is_causal=True, local_window_size=(200, 0))


@gpu
@SM90_ONLY
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ragged_lengths_ignore_padding(causal, rng):
  check_ragged_lengths(
      lambda q, k, v, q_len, kv_len, is_causal: _run(q, k, v, q_len, kv_len, is_causal=is_causal),
      rng, causal=causal, seq_q=145, seq_kv=261, head_dim=128)


@gpu
@SM90_ONLY
def test_lengths_are_data_not_shapes(rng):
  """Changing the lengths reuses the compiled kernel: its loop bounds are computed in-kernel."""
  q, k, v = _qkv(rng, 2, 200, 300, 2, 1, 64, F16)
  run = lambda ql, kl: prefill_attention(q, k, v, jnp.asarray(ql, jnp.int32), jnp.asarray(kl, jnp.int32),
                                         is_causal=True, return_residual=True)
  run([200, 3], [300, 17])
  compiled = prefill_attention._cache_size()
  for ql, kl in [([5, 200], [0, 300]), ([200, 200], [200, 9])]:
    out, lse = run(ql, kl)
    _check(out, lse, q, k, v, is_causal=True, q_lengths=np.array(ql), kv_lengths=np.array(kl))
  assert prefill_attention._cache_size() == compiled


@gpu
@SM90_ONLY
def test_scale_and_residual_off(rng):
  q, k, v = _qkv(rng, 1, 384, 384, 4, 2, 128, BF16)
  out = prefill_attention(q, k, v, scale=0.3, is_causal=True)
  assert isinstance(out, jax.Array)
  ref, _ = attention_f64(q, k, v, scale=0.3, is_causal=True)
  assert_close(out, ref, BF16)


RESCALED = C(64, 64, 2, overlap_softmax=True, conditional_rescale=True)


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim,config", [
    (64, None), (128, None), (256, None), (256, dataclasses.replace(RESCALED, conditional_rescale=False)),
    (128, dataclasses.replace(FAST, conditional_rescale=True)),
    (64, C(64, 128, 2, conditional_rescale=True)),
    (64, THREE_SUMMED), (128, dataclasses.replace(SUMMED, conditional_rescale=True)),
    (128, FIXED), (64, THREE_SUMMED_FIXED), (256, dataclasses.replace(RESCALED, fixed_reference=True)),
    (192, dataclasses.replace(RESCALED, overlap_softmax=False)),
], ids=lambda x: str(x) if isinstance(x, int) else _config_id(x))
def test_running_max_that_jumps(head_dim, config, rng):
  """Keys that grow along the sequence, and a few far larger, move each row's running max
  by more than conditional rescaling's threshold, again and again: the rescaled and the
  skipped steps must both be exact."""
  q, k, v = _qkv(rng, 2, 333, 900, 6, 2, head_dim, BF16)
  growth = jnp.linspace(0.2, 6.0, 900)[None, :, None, None]
  k = (k.astype(F32) * growth).at[:, ::97].multiply(3.0).astype(BF16)
  out, lse = _run(q, k, v, is_causal=True, config=config)
  _check(out, lse, q, k, v, is_causal=True)


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim,config", [
    (128, FIXED), (64, THREE_SUMMED_FIXED), (256, dataclasses.replace(RESCALED, fixed_reference=True)),
], ids=lambda x: str(x) if isinstance(x, int) else _config_id(x))
def test_fixed_reference_overflow_is_recomputed(head_dim, config, rng):
  """Keys that score far more than 2^128 above a row's first key block (2^300 and more here)
  overflow the fixed reference in sequence 0 from key 700 on, never in sequence 1: after the
  second pass (the flagged tiles recomputed with the running max, in place) every row of
  both matches float64 and no LSE is left NaN."""
  q, k, v = _qkv(rng, 2, 900, 900, 6, 2, head_dim, BF16)
  q = (q.astype(F32) + 1.0).astype(BF16)  # queries lean towards the all-ones direction
  k = k.at[0, 700:].add(30.0)  # scores of ~ 30 * sum(q) * scale there
  out, lse = _run(q, k, v, jnp.array([900, 900], jnp.int32), jnp.array([900, 900], jnp.int32),
                  is_causal=True, config=config)
  _check(out, lse, q, k, v, is_causal=True)
  assert np.isfinite(np.asarray(lse)).all()


@gpu
@SM90_ONLY
@pytest.mark.parametrize("config", CONFIGS_AT_D128, ids=_config_id)
def test_configs(config, rng):
  q, k, v = _qkv(rng, 1, 384, 384, 4, 2, 128, BF16)
  out, lse = _run(q, k, v, is_causal=True, config=config)
  _check(out, lse, q, k, v, is_causal=True)


def _dominant_key_inputs(rng, seq, heads, kv_heads, head_dim, margin_nats=60.0):
  """bf16 q, k, v where key seq // 2 (of every KV head) scores about `margin_nats` above the
  rest for every query row that sees it: the attention sink of trained models."""
  q, k, v = _qkv(rng, 1, seq, seq, heads, kv_heads, head_dim, BF16)
  q = (q.astype(F32) + 1.0).astype(BF16)  # rows lean towards the all-ones direction
  lift = margin_nats / (head_dim * head_dim ** -0.5)  # q . (lift * ones) * scale ~ margin
  k = k.at[:, seq // 2].add(lift)
  return q, k, v


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim,seq", [(128, 4096), (256, 2048), (64, 2048), (64, 8192)])
def test_dominant_key_error_is_the_triton_kernels(head_dim, seq, rng):
  """One key that dominates every row that sees it (probability just under 1): the default
  config's output and LSE land as close to float64 as the Triton kernel's (the fixed
  reference at d = 128 / 256, the running max at d = 64 short, the row sums from PV at d = 64
  long). The LSE is what the backward divides by: its row sums must be float32's, not those
  of P rounded to bf16."""
  q, k, v = _dominant_key_inputs(rng, seq, 4, 1, head_dim)
  ref, ref_lse = attention_f64(q, k, v, is_causal=True)
  out, lse = prefill_attention(q, k, v, is_causal=True, return_residual=True)
  triton, triton_lse = jaxflash.prefill_attention(q, k, v, is_causal=True, return_residual=True,
                                                  implementation="triton")
  err = lambda x, y: float(np.abs(np.asarray(x.astype(F32), np.float64) - y).max())
  assert err(out, ref) <= 1.25 * err(triton, ref) + 1e-4, (err(out, ref), err(triton, ref))
  assert err(lse, ref_lse) <= 1.25 * err(triton_lse, ref_lse) + 2e-5, (
      err(lse, ref_lse), err(triton_lse, ref_lse))


@gpu
@SM90_ONLY
def test_matches_the_triton_prefill(rng):
  """The Qwen-like benchmark shape (12 / 2 heads): the same function as the Triton kernel."""
  q, k, v = _qkv(rng, 1, 2048, 2048, 12, 2, 128, BF16)
  out, lse = prefill_attention(q, k, v, is_causal=True, return_residual=True)
  ref_out, ref_lse = jaxflash.prefill_attention(q, k, v, is_causal=True, return_residual=True,
                                                implementation="triton")
  assert_close(out, np.asarray(ref_out.astype(F32)), BF16)
  assert_close(lse, np.asarray(ref_lse), F16, what="lse")


@gpu
@SM90_ONLY
def test_no_n_by_n_buffer():
  n = 8192
  q = jax.ShapeDtypeStruct((1, n, 12, 128), BF16)
  kv = jax.ShapeDtypeStruct((1, n, 2, 128), BF16)
  compiled = prefill_attention.lower(q, kv, kv, is_causal=True, return_residual=True).compile()
  stats = compiled.memory_analysis()
  assert stats is not None
  assert stats.temp_size_in_bytes < n * n, stats.temp_size_in_bytes  # an [n, n] bf16 buffer is 2 n^2


@gpu
@SM90_ONLY
def test_public_prefill_defaults_to_this_kernel(rng):
  """`jaxflash.prefill_attention` runs this kernel by default on sm_90 (the same bits) and
  the Triton kernel with implementation="triton" or with an option this kernel lacks."""
  from jaxflash.prefill import prefill_attention as triton_prefill
  q, k, v = _qkv(rng, 1, 300, 300, 8, 2, 128, BF16)
  np.testing.assert_array_equal(jaxflash.prefill_attention(q, k, v, is_causal=True),
                                prefill_attention(q, k, v, is_causal=True))
  np.testing.assert_array_equal(jaxflash.prefill_attention(q, k, v, is_causal=True, implementation="triton"),
                                triton_prefill(q, k, v, is_causal=True))
  np.testing.assert_array_equal(jaxflash.prefill_attention(q, k, v, is_causal=True, logits_soft_cap=20.0),
                                triton_prefill(q, k, v, is_causal=True, logits_soft_cap=20.0))


@gpu
@SM90_ONLY
def test_vmap_over_a_leading_axis(rng):
  """jax.vmap of jaxflash.attention (the Mosaic kernel under it) equals one call per slice."""
  q, k, v = (jnp.stack(x) for x in zip(*(_qkv(rng, 2, 200, 200, 6, 2, 128, BF16) for _ in range(3))))
  run = lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True, implementation="mosaic")
  got = jax.jit(jax.vmap(run))(q, k, v)
  chex.assert_shape(got, q.shape)
  for i in range(q.shape[0]):
    np.testing.assert_array_equal(got[i], run(q[i], k[i], v[i]))


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_sequence_defaults_under_grad_and_vmap(head_dim, rng):
  """The long-sequence defaults (three consumers with the row sums from PV at d = 64, the
  fixed reference and its second pass at d = 128) under jax.grad (the Triton backward on
  their out and LSE) equal the Triton forward's gradients, and under jax.vmap equal one call
  per slice."""
  q, k, v = _qkv(rng, 1, 8200, 8200, 4, 1, head_dim, BF16)
  config = mosaic_prefill_config(head_dim, BF16, jaxflash.device_info(), num_keys=8200)
  if head_dim == 64:
    assert config.num_consumers == 3 and config.tensor_core_row_sums
  else:
    assert config.fixed_reference
  _assert_mosaic_grads_match_triton(q, k, v, is_causal=True)
  run = lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True, implementation="mosaic")
  stacked = [jnp.stack([x, x[:, ::-1]]) for x in (q, k, v)]  # two different slices
  got = jax.jit(jax.vmap(run))(*stacked)
  for i in range(2):
    np.testing.assert_array_equal(got[i], run(*(x[i] for x in stacked)))


# --------------------------------------------------------------------- no GPU needed

def _shapes(dtype=BF16, head_dim=128, heads=12, kv_heads=2, n=64):
  return (jax.ShapeDtypeStruct((1, n, heads, head_dim), dtype),
          jax.ShapeDtypeStruct((1, n, kv_heads, head_dim), dtype),
          jax.ShapeDtypeStruct((1, n, kv_heads, head_dim), dtype))


def test_guarded_import():
  assert _mosaic.AVAILABLE == (_mosaic.IMPORT_ERROR is None)
  assert hasattr(mosaic, "prefill_attention") and hasattr(mosaic, "supports")


@NEEDS_MOSAIC
@pytest.mark.parametrize("info", [H200, DeviceInfo("NVIDIA H100 PCIe", (9, 0), 114, 227 * 1024)],
                         ids=["h200", "h100"])
@pytest.mark.parametrize("dtype,head_dim", [(BF16, 64), (BF16, 128), (F16, 256), (F16, 192)])
def test_supports_hopper_shapes(info, dtype, head_dim):
  assert supports(*_shapes(dtype, head_dim), info=info) is None
  assert supports(*_shapes(dtype, head_dim), is_causal=True, scale=0.1,
                  causal_alignment="bottom_right", info=info) is None
  assert supports(*_shapes(dtype, head_dim), is_causal=True, local_window_size=(8, 0),
                  info=info) is None


@pytest.mark.parametrize("info,match", [(A100, "sm_80"), (RTX_3090, "sm_86"), (RTX_4060_LAPTOP, "sm_89"),
                                        (DeviceInfo("NVIDIA B200", (10, 0), 148, 227 * 1024), "sm_100")])
def test_other_gpus_are_refused(info, match):
  reason = supports(*_shapes(), info=info)
  assert reason is not None and (match in reason or not _mosaic.AVAILABLE)


@NEEDS_MOSAIC
@pytest.mark.parametrize("shapes,options,match", [
    (_shapes(F32), {}, "float32"),
    (_shapes(BF16, 80), {}, "head_dim=80"),
    (_shapes(BF16, 96), {}, "head_dim=96"),
    (_shapes(BF16, 32), {}, "head_dim=32"),
    (_shapes(BF16, 512), {}, "head_dim=512"),
    ((_shapes(F16)[0], *_shapes(BF16)[1:]), {}, "one dtype"),
    (_shapes(), {"mask": jax.ShapeDtypeStruct((1, 1, 64, 64), jnp.bool_)}, "mask"),
    (_shapes(), {"bias": jax.ShapeDtypeStruct((1, 1, 64, 64), F32)}, "bias"),
    (_shapes(), {"logits_soft_cap": 30.0}, "logits_soft_cap"),
    (_shapes(), {"sinks": jax.ShapeDtypeStruct((12,), F32)}, "sinks"),
    (_shapes(), {"causal_alignment": "top_left"}, "causal_alignment"),
])
def test_unsupported_calls_give_a_reason(shapes, options, match):
  reason = supports(*shapes, info=H200, **options)
  assert reason is not None and match in reason, reason


@CPU_ONLY
def test_supports_without_a_gpu_says_so():
  reason = supports(*_shapes())
  assert reason is not None and ("GPU" in reason)


@pytest.mark.parametrize("head_dim,dtype,config",
                         [(h, dtype, config) for _, _, _, _, _, h, dtype, _, config in CASES
                          if config is not None]
                         + [(128, BF16, config) for config in CONFIGS_AT_D128])
def test_the_compiled_cases_configs_fit_sm90(head_dim, dtype, config):
  """Every explicit config the compiled tests run is one `check_config` accepts on sm_90
  (shared memory, registers, flags): the compiled tests then test the kernel, not a refusal."""
  mosaic.config.check_config(config, head_dim, dtype, H200)


def test_configs_fit_and_are_tuned_per_head_dim():
  for head_dim in (64, 128, 192, 256):
    for dtype in (BF16, F16):
      config = mosaic_prefill_config(head_dim, dtype, H200)
      assert config.smem_bytes(head_dim, 2) <= H200.smem_per_block
      assert config.block_q % 64 == 0 and config.block_kv % 64 == 0
  small = DeviceInfo("small", (9, 0), 132, 99 * 1024)
  assert mosaic_prefill_config(128, BF16, small).smem_bytes(128, 2) <= small.smem_per_block


def test_long_sequences_at_d64_take_three_consumers():
  long = mosaic_prefill_config(64, BF16, H200, num_keys=8192)
  assert long.num_consumers == 3 and long.tensor_core_row_sums
  assert mosaic_prefill_config(64, BF16, H200, num_keys=8191).num_consumers == 2
  assert mosaic_prefill_config(64, BF16, H200).num_consumers == 2
  assert mosaic_prefill_config(128, BF16, H200, num_keys=32768).num_consumers == 2
  assert mosaic_prefill_config(256, BF16, H200, num_keys=32768).num_consumers == 2


@pytest.mark.parametrize("head_dim,min_keys", [(64, 8192), (128, 4096), (192, 2048), (256, 2048)])
def test_long_sequences_take_the_fixed_reference_in_bf16(head_dim, min_keys):
  assert mosaic_prefill_config(head_dim, BF16, H200, num_keys=min_keys).fixed_reference
  assert not mosaic_prefill_config(head_dim, BF16, H200, num_keys=min_keys - 1).fixed_reference
  assert not mosaic_prefill_config(head_dim, F16, H200, num_keys=32768).fixed_reference


@CPU_ONLY
def test_off_the_gpu_it_raises_not_implemented():
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in _shapes(n=8))
  with pytest.raises(NotImplementedError, match="interpret"):
    prefill_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("config,error,match", [
    (MosaicPrefillConfig(64, 128, 8), ValueError, "shared memory"),
    (MosaicPrefillConfig(48, 64, 2), ValueError, "multiples of 64"),
    (MosaicPrefillConfig(64, 64, 0), ValueError, "num_stages"),
    (MosaicPrefillConfig(64, 64, 1), ValueError, "num_stages must be >= 2"),
    (MosaicPrefillConfig(64, 64, 2, num_consumers=4), ValueError, "num_consumers must be 2 or 3"),
    (MosaicPrefillConfig(64, 64, 2, num_consumers=3), ValueError,
     "needs config.overlap_softmax"),
    (MosaicPrefillConfig(64, 64, 2, tensor_core_row_sums=True), ValueError,
     "tensor_core_row_sums needs config.overlap_softmax"),
    (MosaicPrefillConfig(64, 64, 2, fixed_reference=True), ValueError,
     "fixed_reference needs config.overlap_softmax"),
    (jaxflash.PrefillConfig(64, 64), TypeError, "MosaicPrefillConfig"),
])
def test_bad_configs_are_refused(config, error, match):
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in _shapes(n=8))
  with pytest.raises(error, match=match):
    prefill_attention(q, k, v, config=config)


def test_fixed_reference_is_refused_for_float16():
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in _shapes(F16, n=8))
  with pytest.raises(ValueError, match="fixed_reference takes bfloat16 only, got float16"):
    prefill_attention(q, k, v, config=FIXED)


def test_row_sums_from_pv_are_refused_above_d248():
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in _shapes(head_dim=256, n=8))
  with pytest.raises(ValueError, match=r"tensor_core_row_sums takes head dims up to 248"):
    prefill_attention(q, k, v, config=dataclasses.replace(RESCALED, tensor_core_row_sums=True))


def test_three_consumers_are_refused_above_d128():
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in _shapes(head_dim=256, n=8))
  with pytest.raises(ValueError, match="num_consumers=3 takes head dims up to 128"):
    prefill_attention(q, k, v, config=dataclasses.replace(THREE_64, separate_output=False))


@pytest.mark.parametrize("shapes,error,match", [
    (_shapes(F32, n=8), TypeError, "query must be bfloat16 or float16"),
    (_shapes(BF16, 80, n=8), ValueError, r"multiples of 64.*\(1, 8, 12, 80\)"),
    (_shapes(heads=12, kv_heads=5, n=8), ValueError, r"multiple of key heads \(5\)"),
])
def test_bad_inputs_name_the_argument(shapes, error, match):
  q, k, v = (jnp.zeros(s.shape, s.dtype) for s in shapes)
  with pytest.raises(error, match=match):
    prefill_attention(q, k, v)


@pytest.mark.parametrize("config,window", [(None, None), (OVERLAP, None), (SMALL, None), (None, (70, 0)),
                                           (FAST, (70, 0)), (RESCALED, (70, 0)),
                                           (C(64, 128, 2, conditional_rescale=True), None),
                                           (THREE_64, (70, 0)), (SUMMED, None),
                                           (dataclasses.replace(THREE_SUMMED, block_kv=64), (70, 0)),
                                           (FIXED, None),
                                           (dataclasses.replace(THREE_SUMMED_FIXED, block_kv=64), None)],
                         ids=["default", "overlap", "pair", "window", "overlap-window",
                              "rescaled-window", "rescaled-per-tile", "three-consumers-window",
                              "row-sums", "three-consumers-row-sums-window", "fixed-reference",
                              "three-consumers-fixed-reference"])
@CPU_ONLY
@NEEDS_MOSAIC
def test_kernel_traces_on_this_jax(config, window, monkeypatch):
  """Off the GPU the kernel cannot run, but its body can be traced: this catches Mosaic GPU
  API drift (CI's JAX 0.10.2 against the GPU's 0.11) before a GPU run does."""
  monkeypatch.setattr(_mosaic, "interpret_params", lambda interpret: None)
  q = jax.ShapeDtypeStruct((2, 300, 6, 128), BF16)
  kv = jax.ShapeDtypeStruct((2, 333, 2, 128), BF16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  run = lambda q, k, v, ql, kl: prefill_attention(q, k, v, ql, kl, is_causal=True,
                                                  local_window_size=window,
                                                  return_residual=True, config=config)
  out, lse = jax.eval_shape(run, q, kv, kv, lengths, lengths)
  assert out.shape == q.shape and lse.shape == q.shape[:3]
  # Lowering for CUDA runs the Mosaic GPU lowering rules too (the inline Mosaic GPU helpers).
  monkeypatch.setattr(mosaic.forward, "device_info", lambda: H200)
  lowered = jax.jit(run).trace(q, kv, kv, lengths, lengths).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
