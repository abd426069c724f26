"""`jaxflash.attention` as a drop-in: jax.nn.dot_product_attention's values (its "xla" path, in
float32) for the causal semantics and for mask, bias and window; the float64 reference for the
options jax.nn lacks; the implementation registry; traced scales; bad input.

The kernel path runs as the machine has it (interpreted without a GPU, compiled on one).
Rows jax.nn leaves unspecified (a query with no key to attend to) are compared with the
float64 reference only (zeros here).
"""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.score_mods import ScoreMods
from tests.conftest import HAS_GPU, assert_close, d_scale_limit, random_array
from tests.reference_np import attention_f64, gather_pages_np

F32 = jnp.float32
ATTENTION = importlib.import_module("jaxflash.attention")
HAS_GPU_SM90 = HAS_GPU and jaxflash.device_info().compute_capability >= (9, 0)


def _qkv(rng, batch, seq_q, seq_kv, heads=4, kv_heads=2, head_dim=32):
  return (random_array(rng, (batch, seq_q, heads, head_dim), F32),
          random_array(rng, (batch, seq_kv, kv_heads, head_dim), F32),
          random_array(rng, (batch, seq_kv, kv_heads, head_dim), F32))


def _jax_nn(q, k, v, bias=None, mask=None, **kwargs):
  with jax.default_matmul_precision("highest"):  # float32, not TF32, on a GPU
    return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kwargs)


def _as_lengths(x):
  return None if x is None else jnp.asarray(x, jnp.int32)


def _check_against_jax_nn(got, want, ref_lse):
  """Rows with a key to attend to equal jax.nn's; the others are zeros."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  attended = np.isfinite(ref_lse)  # [B, T, N]
  assert attended.any()
  np.testing.assert_allclose(got[attended], want[attended], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(got[~attended], 0.)


# (batch, T, S, query lengths, key lengths): right-padded keys (issue 22's example), query
# and key lengths, T < S, T > S, a single query.
CAUSAL_CASES = [
    (2, 8, 8, None, [3, 8]),
    (2, 9, 9, [9, 4], [5, 9]),
    (1, 5, 12, None, None),
    (2, 12, 5, [12, 7], None),
    (2, 1, 7, None, [7, 3]),  # T == 1: jax.nn's tril lets the query see key 0 only
    (2, 20, 35, [20, 11], [35, 17]),
]


@pytest.mark.parametrize("case", CAUSAL_CASES, ids=lambda c: f"b{c[0]}-t{c[1]}-s{c[2]}-"
                         f"{'ql' if c[3] else ''}{'kl' if c[4] else ''}")
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_causal_defaults_match_jax_nn(case, implementation, rng):
  batch, t, s, q_lengths, kv_lengths = case
  q, k, v = _qkv(rng, batch, t, s)
  lengths = dict(query_seq_lengths=_as_lengths(q_lengths),
                 key_value_seq_lengths=_as_lengths(kv_lengths))
  for is_causal in (True, False):
    got = jaxflash.attention(q, k, v, is_causal=is_causal, implementation=implementation, **lengths)
    want = _jax_nn(q, k, v, is_causal=is_causal, **lengths)
    _, ref_lse = attention_f64(q, k, v, is_causal=is_causal, q_lengths=q_lengths,
                               kv_lengths=kv_lengths, alignment="top_left")
    _check_against_jax_nn(got, want, ref_lse)


def test_bottom_right_on_request(rng):
  """causal_alignment="bottom_right": each sequence's queries are its last positions."""
  q, k, v = _qkv(rng, 2, 6, 10)
  ql, kl = np.array([6, 3]), np.array([10, 5])
  for implementation in (None, "xla"):
    out, lse = jaxflash.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                  query_seq_lengths=_as_lengths(ql), key_value_seq_lengths=_as_lengths(kl),
                                  return_residual=True, implementation=implementation)
    ref_out, ref_lse = attention_f64(q, k, v, is_causal=True, q_lengths=ql, kv_lengths=kl)
    assert_close(out, ref_out, F32)
    assert_close(lse, ref_lse, F32, what="lse")


def _mask_bias_window(rng, b, n, t, s, which):
  options = {}
  if "mask" in which:
    options["mask"] = jnp.asarray(rng.random((b, 1, t, s)) < 0.7)
  if "bias" in which:
    options["bias"] = random_array(rng, (1, n, t, s), F32)
  if "window" in which:
    options["local_window_size"] = (3, 2)
  if "int_window" in which:
    options["local_window_size"] = 4
  return options


@pytest.mark.parametrize("t,s", [(16, 16), (9, 23)], ids=["t_eq_s", "t_lt_s"])
@pytest.mark.parametrize("which", [("mask",), ("bias",), ("window",), ("int_window",),
                                   ("mask", "bias", "window")], ids="+".join)
def test_mask_bias_window_match_jax_nn(t, s, which, rng):
  b, n = 2, 4
  q, k, v = _qkv(rng, b, t, s, heads=n)
  options = _mask_bias_window(rng, b, n, t, s, which)
  window = options.get("local_window_size")
  window = (window, window) if isinstance(window, int) else window
  lengths = dict(query_seq_lengths=jnp.asarray([t, t - 2], jnp.int32),
                 key_value_seq_lengths=jnp.asarray([s, s - 4], jnp.int32))
  for is_causal in (False, True):
    want = _jax_nn(q, k, v, is_causal=is_causal, **options, **lengths)
    _, ref_lse = attention_f64(q, k, v, is_causal=is_causal, bias=options.get("bias"),
                               mask=options.get("mask"), window=window, q_lengths=[t, t - 2],
                               kv_lengths=[s, s - 4], alignment="top_left")
    for implementation in (None, "xla"):
      got = jaxflash.attention(q, k, v, is_causal=is_causal, implementation=implementation,
                               **options, **lengths)
      _check_against_jax_nn(got, want, ref_lse)


def test_beyond_jax_nn_soft_cap_and_sinks(rng):
  """logits_soft_cap and sinks (no jax.nn counterpart) against the float64 reference, with
  the LSE including the sink; a sequence with no key gives out 0 and lse = sink."""
  q, k, v = _qkv(rng, 2, 10, 14)
  sinks = jnp.asarray(rng.standard_normal(4), F32)
  kl = np.array([14, 0])
  for implementation in (None, "xla"):
    out, lse = jaxflash.attention(q, k, v, is_causal=True, logits_soft_cap=2.5, sinks=sinks,
                                  key_value_seq_lengths=_as_lengths(kl), return_residual=True,
                                  implementation=implementation)
    ref_out, ref_lse = attention_f64(q, k, v, is_causal=True, softcap=2.5, sinks=sinks,
                                     kv_lengths=kl, alignment="top_left")
    assert_close(out, ref_out, F32)
    assert_close(lse, ref_lse, F32, what="lse")
    np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks), (10, 4)),
                               rtol=1e-6)


@pytest.mark.parametrize("scale", [0.3, np.float32(0.2), jnp.float32(0.7)], ids=["float", "numpy", "jax"])
def test_scale_may_be_any_scalar(scale, rng):
  q, k, v = _qkv(rng, 1, 7, 9)
  want = _jax_nn(q, k, v, scale=float(scale), is_causal=True)
  assert_close(jaxflash.attention(q, k, v, scale=scale, is_causal=True), want, F32)
  traced = jax.jit(lambda s: jaxflash.attention(q, k, v, scale=s, is_causal=True))(scale)
  assert_close(traced, want, F32)


def test_new_scale_values_do_not_recompile(rng):
  q, k, v = _qkv(rng, 1, 7, 9)
  jaxflash.attention(q, k, v, scale=0.1)
  compiled = ATTENTION._attention._cache_size()
  for scale in (0.2, 0.3, np.float32(0.4)):
    jaxflash.attention(q, k, v, scale=scale)
  assert ATTENTION._attention._cache_size() == compiled


def test_registry(rng):
  assert jaxflash.IMPLEMENTATIONS == (None, "triton", "pallas", "mosaic", "xla", "cudnn")
  q, k, v = _qkv(rng, 1, 5, 6)
  np.testing.assert_array_equal(jaxflash.attention(q, k, v, implementation="pallas"),
                                jaxflash.attention(q, k, v, implementation="triton"))
  # No GPU here, or float32 inputs on one: the reason is in the message.
  with pytest.raises(ValueError, match=r"implementation='mosaic' cannot serve this call: .*"
                     r"(no GPU|float32|sm_)"):
    jaxflash.attention(q, k, v, implementation="mosaic")
  with pytest.raises(ValueError, match=r"implementation must be one of \(None, 'triton'.*'bogus'"):
    jaxflash.attention(q, k, v, implementation="bogus")


@pytest.mark.parametrize("options,match", [
    (dict(logits_soft_cap=3.0), "logits_soft_cap"),
    (dict(sinks=jnp.zeros(4)), "sinks"),
    (dict(return_residual=True), "return_residual"),
])
def test_cudnn_refuses_what_jax_nn_lacks(options, match, rng):
  q, k, v = _qkv(rng, 1, 5, 8)
  with pytest.raises(NotImplementedError, match=match):
    jaxflash.attention(q, k, v, implementation="cudnn", **options)


def test_cudnn_refuses_a_traced_scale(rng):
  q, k, v = _qkv(rng, 1, 5, 8)
  with pytest.raises(NotImplementedError, match="traced scale"):
    jax.jit(lambda s: jaxflash.attention(q, k, v, scale=s, implementation="cudnn"))(0.5)


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_one_token_top_left_causal_is_not_decode(implementation, rng):
  """T == 1, top-left, causal: the query sits at position 0 and sees key 0 only, also over
  a paged cache (decode's semantics, the last position, need causal_alignment="bottom_right")."""
  page, pages, batch = 8, 6, 2
  q = random_array(rng, (batch, 1, 4, 32), F32)
  k_pages, v_pages = (random_array(rng, (pages, page, 2, 32), F32) for _ in range(2))
  table = jnp.asarray(rng.permutation(pages)[:batch * 3].reshape(batch, 3), jnp.int32)
  lengths = jnp.asarray([20, 9], jnp.int32)
  out = jaxflash.attention(q, k_pages, v_pages, key_value_seq_lengths=lengths, block_table=table,
                           is_causal=True, implementation=implementation)
  k, v = gather_pages_np(k_pages, table), gather_pages_np(v_pages, table)
  ref, _ = attention_f64(q, k, v, kv_lengths=np.asarray(lengths), is_causal=True, alignment="top_left")
  assert_close(out, ref, F32)
  np.testing.assert_allclose(np.asarray(out[:, 0]), np.repeat(v[:, 0], 2, axis=1), atol=1e-6)


def _decode_options(rng, heads, capacity):
  return dict(bias=random_array(rng, (1, heads, 1, capacity), F32),
              mask=jnp.asarray(rng.random((2, 1, 1, capacity)) < 0.8),
              sinks=jnp.asarray(rng.standard_normal(heads), F32),
              logits_soft_cap=4.0, local_window_size=(9, 0))


def _decode_reference(q, k, v, lengths, options):
  return attention_f64(q, k, v, kv_lengths=np.asarray(lengths), bias=options["bias"],
                       mask=options["mask"], sinks=options["sinks"], softcap=4.0, window=(9, 0),
                       is_causal=True)


@pytest.mark.parametrize("implementation", ["xla", None])
def test_decode_options(implementation, rng):
  """One token, bottom-right: the decode kernel's path (its query at kv_len - 1)."""
  q, k, v = _qkv(rng, 2, 1, 40)
  lengths = jnp.asarray([40, 13], jnp.int32)
  options = _decode_options(rng, 4, 40)
  out, lse = jaxflash.attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True,
                                causal_alignment="bottom_right", return_residual=True,
                                implementation=implementation, **options)
  ref_out, ref_lse = _decode_reference(q, k, v, lengths, options)
  assert_close(out, ref_out, F32)
  assert_close(lse, ref_lse, F32, what="lse")


@pytest.mark.parametrize("implementation", ["xla", None])
def test_paged_decode_options(implementation, rng):
  page, pages, batch = 8, 12, 2
  q = random_array(rng, (batch, 1, 4, 32), F32)
  k_pages, v_pages = (random_array(rng, (pages, page, 2, 32), F32) for _ in range(2))
  table = jnp.asarray(rng.permutation(pages)[:batch * 5].reshape(batch, 5), jnp.int32)
  lengths = jnp.asarray([40, 13], jnp.int32)
  options = _decode_options(rng, 4, 40)
  out, lse = jaxflash.attention(q, k_pages, v_pages, key_value_seq_lengths=lengths, block_table=table,
                                causal_alignment="bottom_right", is_causal=True, return_residual=True,
                                implementation=implementation, **options)
  k, v = gather_pages_np(k_pages, table), gather_pages_np(v_pages, table)
  ref_out, ref_lse = _decode_reference(q, k, v, lengths, options)
  assert_close(out, ref_out, F32)
  assert_close(lse, ref_lse, F32, what="lse")


def test_decode_with_a_traced_scale_uses_the_prefill_kernel(rng):
  """The decode path compiles the scale in; a traced one goes to the prefill kernel, which
  takes it as an operand (and differentiates it)."""
  q, k, v = _qkv(rng, 2, 1, 20)
  lengths = jnp.asarray([20, 6], jnp.int32)
  run = jax.jit(lambda s: jaxflash.attention(q, k, v, scale=s, key_value_seq_lengths=lengths))
  ref, _ = attention_f64(q, k, v, scale=0.4, kv_lengths=np.asarray(lengths))
  assert_close(run(0.4), ref, F32)
  assert "jaxflash_prefill" in str(jax.make_jaxpr(run)(0.4))


BAD = [
    (dict(bias=jnp.zeros((3, 5, 6))), ValueError, r"bias must be broadcastable to \[B, N, T, S\] = "
     r"\(1, 4, 5, 6\), got shape \(3, 5, 6\)"),
    (dict(mask=jnp.zeros((1, 1, 5, 7), bool)), ValueError, r"mask must be broadcastable.*\(1, 1, 5, 7\)"),
    (dict(mask=jnp.zeros((5, 6), jnp.int32)), TypeError, r"mask must be a boolean"),
    (dict(sinks=jnp.zeros((2,))), ValueError, r"sinks must have shape \(4,\)"),
    (dict(local_window_size=-2), ValueError, r"local_window_size"),
    (dict(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap"),
    (dict(causal_alignment="left"), ValueError, r"causal_alignment"),
    (dict(scale=jnp.ones((3,))), ValueError, r"scale must be a real scalar"),
]


@pytest.mark.parametrize("options,error,match", BAD)
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_bad_options_name_the_argument(options, error, match, implementation, rng):
  q, k, v = _qkv(rng, 1, 5, 6)
  with pytest.raises(error, match=match):
    jaxflash.attention(q, k, v, implementation=implementation, **options)


@pytest.mark.parametrize("paged", [False, True], ids=["decode", "paged"])
def test_decode_route_passes_the_options(paged, monkeypatch, rng):
  """The decode kernels get the options by OPTIONS.md's keywords (a stand-in kernel records
  them), whatever this build's decode kernels take."""
  import jaxflash.decode
  import jaxflash.paged
  seen = {}

  def stand_in(query, *arrays, **kwargs):
    seen.update(kwargs)
    batch, _, heads, head_dim = query.shape
    return jnp.zeros(query.shape, query.dtype), jnp.zeros((batch, 1, heads), F32)

  monkeypatch.setattr(jaxflash.paged if paged else jaxflash.decode,
                      "paged_decode_attention" if paged else "decode_attention", stand_in)
  q = random_array(rng, (2, 1, 4, 48), F32)  # a head dim no other test uses: a fresh trace
  lengths = jnp.asarray([16, 5], jnp.int32)
  if paged:
    k = random_array(rng, (4, 8, 2, 48), F32)
    extra = dict(block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32))
  else:
    k = random_array(rng, (2, 16, 2, 48), F32)
    extra = {}
  options = dict(bias=jnp.zeros((1, 4, 1, 16)), mask=jnp.ones((2, 1, 1, 16), bool),
                 sinks=jnp.zeros(4), logits_soft_cap=2.0, local_window_size=3)
  jaxflash.attention(q, k, k, key_value_seq_lengths=lengths, causal_alignment="bottom_right",
                     is_causal=True, scale=0.5, **options, **extra)
  assert seen["scale"] == 0.5 and seen["local_window_size"] == (3, 3)
  assert seen["logits_soft_cap"] == 2.0 and seen["return_residual"] is True
  assert seen["bias"].shape == (1, 4, 1, 16) and seen["mask"].shape == (2, 1, 1, 16)
  assert seen["sinks"].shape == (4,)


def test_mosaic_dispatch_reasons():
  """What keeps a call off the Mosaic prefill, decided before any kernel is traced."""
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  one = jax.ShapeDtypeStruct((1, 1, 4, 128), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((8, 16, 2, 128), jnp.bfloat16)
  lengths = jnp.array([200], jnp.int32)
  causal_tl = ScoreMods(is_causal=True, causal_alignment="top_left")
  reason = ATTENTION.mosaic_reason
  # A one-token call over pages is the paged decode's; chunks over pages are served (on sm_90).
  assert "decode" in reason(one, pages, pages, None, lengths, jnp.zeros((1, 4), jnp.int32))
  assert "decode" in reason(one, kv, kv, mods=ScoreMods())
  assert "traced scale" in reason(q, kv, kv, scale=jax.ShapeDtypeStruct((), jnp.float32))
  assert "top-left" in reason(q, kv, kv, None, lengths, mods=causal_tl)
  sinks = reason(q, kv, kv, sinks=jnp.zeros(4), mods=ScoreMods())
  assert "sinks" in sinks if HAS_GPU_SM90 else sinks is not None
  # Top-left and bottom-right agree at T == S without lengths: only the device decides.
  left = reason(q, kv, kv, mods=causal_tl)
  assert (left is None) if HAS_GPU_SM90 else ("GPU" in left or "sm_" in left)
  # A sliding window is a loop bound in the Mosaic kernel too.
  window = reason(q, kv, kv, None, lengths, mods=ScoreMods(is_causal=True, window=(64, 0)))
  assert (window is None) if HAS_GPU_SM90 else ("GPU" in window or "sm_" in window)


@pytest.mark.gpu
def test_cudnn_bottom_right_through_an_explicit_mask(rng):
  """jax.nn aligns causal masks top-left; bottom-right with T < S and lengths reaches cuDNN as
  a mask, and rows with no visible key give zeros, as the kernels give."""
  q = random_array(rng, (2, 64, 4, 64), jnp.bfloat16)
  k = random_array(rng, (2, 128, 2, 64), jnp.bfloat16)
  v = random_array(rng, (2, 128, 2, 64), jnp.bfloat16)
  q_len, kv_len = jnp.array([64, 20], jnp.int32), jnp.array([128, 50], jnp.int32)
  kwargs = dict(is_causal=True, causal_alignment="bottom_right", query_seq_lengths=q_len,
                key_value_seq_lengths=kv_len)
  out = jaxflash.attention(q, k, v, implementation="cudnn", **kwargs)
  ref, _ = attention_f64(q, k, v, is_causal=True, q_lengths=np.asarray(q_len),
                         kv_lengths=np.asarray(kv_len))
  out = np.where(np.arange(64)[None, :, None, None] < np.asarray(q_len)[:, None, None, None], out, 0)
  assert_close(out, ref, jnp.bfloat16)


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_gradients_through_every_option_match_xla(path, rng):
  """jax.grad through jaxflash.attention (jax.nn's top-left semantics, every option, a
  traced scale on the prefill path) equals the "xla" path's gradients, bias and sinks
  included; the one-token decode path is differentiated by the same backward."""
  t = 13 if path == "prefill" else 1
  q, k, v = _qkv(rng, 2, t, 21, heads=4, kv_heads=2)
  bias = random_array(rng, (1, 4, t, 21), F32)
  sinks = random_array(rng, (4,), F32)
  mask = jnp.asarray(rng.random((2, 1, t, 21)) < 0.85)
  kv_lengths = jnp.array([21, 9], jnp.int32)
  options = dict(mask=mask, key_value_seq_lengths=kv_lengths, logits_soft_cap=4.0)
  if path == "prefill":
    options.update(is_causal=True, local_window_size=(7, 0))
  scale = 0.2

  def loss(implementation, q, k, v, bias, sinks, scale):
    out = jaxflash.attention(q, k, v, bias, sinks=sinks, scale=scale,
                             implementation=implementation, **options)
    return jnp.sum(jnp.sin(out))

  argnums = (0, 1, 2, 3, 4, 5) if path == "prefill" else (0, 1, 2, 3, 4)
  got, want = (jax.jit(jax.grad(functools.partial(loss, impl), argnums=argnums))(
      q, k, v, bias, sinks, jnp.float32(scale) if path == "prefill" else scale)
      for impl in (None, "xla"))
  for name, g, w in zip(("dq", "dk", "dv", "d_bias", "d_sinks", "d_scale"), got, want):
    # d_scale: a sum whose terms can cancel (two float32 paths, not float64)
    limit = (d_scale_limit(q, got[0], want[0], scale) if name == "d_scale"
             else 2e-5 * max(1., float(jnp.abs(w).max())))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=limit, err_msg=name)


def test_prefill_attention_chooses_its_kernel(rng):
  """`jaxflash.prefill_attention` is the Triton kernel where Mosaic cannot serve (here: no
  sm_90 GPU, or float32); forcing "mosaic" then says why; configs of the other kernel and
  unknown names are refused."""
  from jaxflash.prefill import prefill_attention as triton_prefill
  assert jaxflash.PREFILL_IMPLEMENTATIONS == (None, "triton", "pallas", "mosaic")
  q, k, v = _qkv(rng, 2, 19, 23)
  lengths = jnp.asarray([19, 11], jnp.int32)
  kwargs = dict(is_causal=True, return_residual=True)
  want = triton_prefill(q, k, v, lengths, None, **kwargs)
  for implementation in (None, "triton", "pallas"):
    got = jaxflash.prefill_attention(q, k, v, lengths, None, implementation=implementation, **kwargs)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"implementation='mosaic' cannot serve this call: .*(GPU|float32|sm_)"):
    jaxflash.prefill_attention(q, k, v, implementation="mosaic")
  with pytest.raises(ValueError, match=r"implementation must be one of \(None, 'triton', 'pallas', "
                     r"'mosaic'\), got 'xla'"):
    jaxflash.prefill_attention(q, k, v, implementation="xla")
  with pytest.raises(TypeError, match="config is a MosaicPrefillConfig, which implementation='triton'"):
    jaxflash.prefill_attention(q, k, v, implementation="triton", config=jaxflash.MosaicPrefillConfig())
  with pytest.raises(TypeError, match="config is a PrefillConfig, which implementation='mosaic'"):
    jaxflash.prefill_attention(q, k, v, implementation="mosaic", config=jaxflash.PrefillConfig(16, 16))
  with pytest.raises(TypeError, match="config must be a PrefillConfig or a MosaicPrefillConfig, got dict"):
    jaxflash.prefill_attention(q, k, v, config={"block_q": 16})


def test_prefill_attention_routes_to_mosaic_and_differentiates(monkeypatch, rng):
  """Where Mosaic serves (a stand-in for the device rule and for the compiled kernel, which
  records what it is given), `jaxflash.prefill_attention` runs it with the compile-time
  scale, the causal flag, the window and the config, and the Triton backward, with the
  given backward_config, gives the Triton path's gradients. interpret=True or a Triton
  config keeps the Triton kernel."""
  import jaxflash.mosaic
  from jaxflash.prefill import prefill_attention as triton_prefill
  calls = []

  def stand_in(q, k, v, q_len, kv_len, *, scale, is_causal, local_window_size, return_residual,
               config, interpret):
    calls.append(dict(scale=scale, is_causal=is_causal, window=local_window_size, config=config))
    assert return_residual and not interpret
    return triton_prefill(q, k, v, q_len, kv_len, scale=scale, is_causal=is_causal,
                          local_window_size=local_window_size, return_residual=True)

  monkeypatch.setattr(ATTENTION, "mosaic_reason", lambda *args, **kwargs: None)
  monkeypatch.setattr(jaxflash.mosaic, "prefill_attention", stand_in)
  q, k, v = _qkv(rng, 2, 21, 30, heads=6, kv_heads=2)
  d_out = random_array(rng, q.shape, F32)
  q_len, kv_len = jnp.asarray([21, 9], jnp.int32), jnp.asarray([30, 17], jnp.int32)
  options = dict(scale=0.3, is_causal=True, local_window_size=(7, 2))
  backward = jaxflash.BackwardConfig(16, 16, q_splits=2)

  def loss(run, q, k, v):
    out, lse = run(q, k, v, q_len, kv_len, return_residual=True, backward_config=backward, **options)
    return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  got = jax.grad(functools.partial(loss, jaxflash.prefill_attention), (0, 1, 2))(q, k, v)
  want = jax.grad(functools.partial(loss, triton_prefill), (0, 1, 2))(q, k, v)
  assert calls and calls[0] == dict(scale=0.3, is_causal=True, window=(7, 2), config=None)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  out = jaxflash.prefill_attention(q, k, v, q_len, kv_len, **options)
  np.testing.assert_allclose(out, triton_prefill(q, k, v, q_len, kv_len, **options), atol=1e-6)

  config = jaxflash.MosaicPrefillConfig(64, 64, 2)
  jaxflash.prefill_attention(q, k, v, config=config)
  assert calls[-1]["config"] == config and calls[-1]["scale"] == 32 ** -0.5
  calls.clear()
  jaxflash.prefill_attention(q, k, v, interpret=True)
  jaxflash.prefill_attention(q, k, v, config=jaxflash.PrefillConfig(16, 16))
  jaxflash.prefill_attention(q, k, v, implementation="triton")
  assert not calls
