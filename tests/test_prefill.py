"""The FlashAttention-2 prefill kernel against the float64 reference.

Each kernel case runs interpreted (any machine) and compiled (GPU only, `-m gpu`). The
interpreted shapes stay small; PrefillConfig(16, 16) tiles give them multi-block loops,
so the unmasked loop, the diagonal blocks and the ragged edges all run.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import PrefillConfig
from jaxflash.prefill import prefill_attention, prefill_reference  # the Pallas-Triton kernel itself
from tests.conftest import assert_close, poison_allocator, random_array
from tests.reference_np import attention_f64

SMALL = PrefillConfig(16, 16, num_warps=4, num_stages=2)
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _qkv(rng, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, kv_dtype=None):
  kv_dtype = kv_dtype or dtype
  return (random_array(rng, (batch, seq_q, heads, head_dim), dtype),
          random_array(rng, (batch, seq_kv, kv_heads, head_dim), kv_dtype),
          random_array(rng, (batch, seq_kv, kv_heads, head_dim), kv_dtype))


def _run(q, k, v, q_lengths=None, kv_lengths=None, *, interpret, **kwargs):
  if not interpret:
    poison_allocator(jax.ShapeDtypeStruct(q.shape, q.dtype),
                     jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
  out, lse = prefill_attention(q, k, v, q_lengths, kv_lengths, return_residual=True,
                               interpret=interpret, **kwargs)
  chex.assert_shape(out, q.shape)
  chex.assert_type(out, q.dtype)
  chex.assert_shape(lse, q.shape[:3])
  chex.assert_type(lse, jnp.float32)
  return out, lse


def _check(out, lse, q, k, v, *, is_causal, q_lengths=None, kv_lengths=None, scale=None,
           window=None):
  ref_out, ref_lse = attention_f64(q, k, v, scale=scale, is_causal=is_causal,
                                   q_lengths=q_lengths, kv_lengths=kv_lengths, window=window)
  assert_close(out, ref_out, q.dtype)
  # The LSE comes from float32 scores whatever the input dtype: a tighter check than the output.
  lse_tol = F32 if q.dtype == F32 else F16
  assert_close(lse, ref_lse, lse_tol, what="lse")


# (batch, T, S, N, K, head_dim, dtype, causal, config): pairwise coverage of odd lengths,
# T < S and T > S, GQA groups 1, 2, 5, 6, 7, 8, every head dim and dtype.
CASES = [
    (1, 1, 1, 1, 1, 64, F32, True, SMALL),
    (1, 17, 17, 2, 1, 64, BF16, True, SMALL),
    (2, 100, 129, 5, 1, 80, F16, True, SMALL),  # T < S: bottom-right diagonal
    (1, 129, 100, 6, 1, 96, F32, True, None),  # T > S: the first 29 rows see no key
    (1, 33, 70, 7, 1, 128, BF16, False, SMALL),
    (1, 100, 100, 8, 1, 256, F16, False, None),
    (1, 100, 1, 4, 4, 128, F32, True, SMALL),  # one key: all but the last row are empty
    (1, 130, 130, 2, 2, 64, F16, False, None),  # default (H200) tiles, ragged edge
    (2, 1, 129, 4, 2, 96, BF16, True, None),  # one query row
    (1, 64, 128, 6, 3, 128, BF16, True, None),  # exact multiples: only the diagonal is masked
    (2, 48, 64, 2, 1, 64, F32, False, SMALL),  # exact multiples, not causal: no masked loop at all
]


def _case_id(case):
  b, t, s, n, k, h, dtype, causal, config = case
  return (f"b{b}-t{t}-s{s}-n{n}-k{k}-h{h}-{jnp.dtype(dtype).name}-{'causal' if causal else 'full'}"
          f"-{'small' if config else 'default'}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case, interpret, rng):
  batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, causal, config = case
  q, k, v = _qkv(rng, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
  out, lse = _run(q, k, v, is_causal=causal, config=config, interpret=interpret)
  _check(out, lse, q, k, v, is_causal=causal)


def check_ragged_lengths(run, rng, *, causal: bool, seq_q: int, seq_kv: int, head_dim: int) -> None:
  """`run(q, k, v, q_lengths, kv_lengths, is_causal)` -> (out, lse) over six sequences: full;
  short queries over a long cache; zero keys; zero queries; more queries than keys (causal:
  the first rows see nothing); keys shorter than S with T < S. Padding holds garbage (NaN
  and inf): none of it may reach the output; padded rows are zeros, zero keys give LSE -inf."""
  q_lengths = np.array([seq_q, 7, seq_q - 15, 0, seq_q, 20], np.int32)
  kv_lengths = np.array([seq_kv, seq_kv, 0, seq_kv - 11, 13, seq_kv - 28], np.int32)
  q, k, v = _qkv(rng, 6, seq_q, seq_kv, 4, 2, head_dim, BF16)
  rows, keys = np.arange(seq_q), np.arange(seq_kv)
  pad_q = (rows[None, :] >= q_lengths[:, None])[:, :, None, None]
  pad_kv = (keys[None, :] >= kv_lengths[:, None])[:, :, None, None]
  dirty_q = jnp.where(pad_q, jnp.nan, q)
  dirty_k = jnp.where(pad_kv, jnp.inf, k)
  dirty_v = jnp.where(pad_kv, jnp.nan, v)
  out, lse = run(dirty_q, dirty_k, dirty_v, jnp.asarray(q_lengths), jnp.asarray(kv_lengths), causal)
  _check(out, lse, q, k, v, is_causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
  out = np.asarray(out.astype(F32))
  assert (out[np.broadcast_to(pad_q, out.shape)] == 0).all(), "padded query rows must be zeros"
  assert (out[2] == 0).all() and np.isneginf(np.asarray(lse)[2]).all(), "zero keys: zeros, LSE -inf"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ragged_lengths_ignore_padding(causal, interpret, rng):
  check_ragged_lengths(
      lambda q, k, v, q_len, kv_len, is_causal: _run(q, k, v, q_len, kv_len, is_causal=is_causal,
                                                     config=SMALL, interpret=interpret),
      rng, causal=causal, seq_q=45, seq_kv=61, head_dim=80)


def test_mixed_dtypes_and_scale(interpret, rng):
  # float32 queries over a bfloat16 cache: computed in float32, returned as float32.
  q, k, v = _qkv(rng, 1, 31, 47, 4, 2, 64, F32, kv_dtype=BF16)
  out, lse = _run(q, k, v, scale=0.3, is_causal=True, config=SMALL, interpret=interpret)
  _check(out, lse, q, k, v, is_causal=True, scale=0.3)


def test_residual_off_returns_only_the_output(interpret, rng):
  q, k, v = _qkv(rng, 1, 20, 20, 2, 1, 64, F16)
  out = prefill_attention(q, k, v, is_causal=True, config=SMALL, interpret=interpret)
  assert isinstance(out, jax.Array)
  ref, _ = attention_f64(q, k, v, is_causal=True)
  assert_close(out, ref, F16)


def test_lengths_are_data_not_shapes(rng):
  """Changing the lengths reuses the compiled kernel: its loop bounds are computed in-kernel."""
  q, k, v = _qkv(rng, 2, 24, 40, 2, 1, 64, F32)
  run = lambda ql, kl: prefill_attention(q, k, v, jnp.asarray(ql, jnp.int32), jnp.asarray(kl, jnp.int32),
                                         is_causal=True, return_residual=True, config=SMALL)
  run([24, 3], [40, 17])
  compiled = prefill_attention._cache_size()
  for ql, kl in [([5, 24], [0, 40]), ([24, 24], [24, 9])]:
    out, lse = run(ql, kl)
    _check(out, lse, q, k, v, is_causal=True, q_lengths=np.array(ql), kv_lengths=np.array(kl))
  assert prefill_attention._cache_size() == compiled


def test_explicit_configs(interpret, rng):
  q, k, v = _qkv(rng, 1, 70, 70, 2, 1, 96, BF16)
  for config in (PrefillConfig(32, 16, num_warps=4, num_stages=1), PrefillConfig(16, 32)):
    out, lse = _run(q, k, v, is_causal=True, config=config, interpret=interpret)
    _check(out, lse, q, k, v, is_causal=True)


@pytest.mark.parametrize("config,error,match", [
    (PrefillConfig(256, 256, 8, 4), ValueError, "shared memory"),
    (PrefillConfig(24, 16), ValueError, "block_q"),
    (PrefillConfig(16, 8), ValueError, "block_k"),
    ((16, 16), TypeError, "PrefillConfig"),
])
def test_bad_configs_are_refused(config, error, match, rng):
  q, k, v = _qkv(rng, 1, 16, 16, 2, 1, 256, BF16)
  with pytest.raises(error, match=match):
    prefill_attention(q, k, v, config=config)


def _zeros(shape, dtype=BF16):
  return jnp.zeros(shape, dtype)


BAD_INPUTS = [
    # (query, key, value, q_lengths, kv_lengths, error, regex naming the argument and shapes)
    ((2, 8, 4, 64), (2, 8, 4), (2, 8, 4), None, None, ValueError, r"key must have rank 4.*\(2, 8, 4\)"),
    ((8, 4, 64), (8, 4, 64), (8, 4, 64), None, None, ValueError, r"query must have rank 4.*\(8, 4, 64\)"),
    ((2, 8, 4, 64), (2, 8, 2, 32), (2, 8, 2, 32), None, None, ValueError,
     r"same head dim.*\(2, 8, 4, 64\).*\(2, 8, 2, 32\)"),
    ((2, 8, 6, 64), (2, 8, 4, 64), (2, 8, 4, 64), None, None, ValueError, r"multiple of key heads \(4\)"),
    ((2, 8, 4, 64), (2, 8, 2, 64), (2, 9, 2, 64), None, None, ValueError,
     r"key and value must have the same shape.*\(2, 8, 2, 64\).*\(2, 9, 2, 64\)"),
    ((2, 8, 4, 64), (3, 8, 2, 64), (3, 8, 2, 64), None, None, ValueError, r"batch size.*\(3, 8, 2, 64\)"),
    ((2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 64), (3,), None, ValueError,
     r"query_seq_lengths must have shape \(2,\).*\(3,\)"),
    ((2, 8, 4, 64), (2, 8, 2, 64), (2, 8, 2, 64), None, (2, 1), ValueError,
     r"key_value_seq_lengths must have shape \(2,\)"),
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,q_len,kv_len,error,match", BAD_INPUTS)
def test_bad_shapes_name_the_argument(q_shape, k_shape, v_shape, q_len, kv_len, error, match):
  lengths = lambda s: None if s is None else jnp.zeros(s, jnp.int32)
  with pytest.raises(error, match=match):
    prefill_attention(_zeros(q_shape), _zeros(k_shape), _zeros(v_shape), lengths(q_len), lengths(kv_len))


@pytest.mark.parametrize("which", ["query", "key", "value", "lengths"])
def test_bad_dtypes_name_the_argument(which):
  q, k, v = _zeros((1, 8, 2, 64)), _zeros((1, 8, 1, 64)), _zeros((1, 8, 1, 64))
  lengths = jnp.full((1,), 8, jnp.int32)
  if which == "query":
    q = q.astype(jnp.int32)
  elif which == "key":
    k = k.astype(jnp.int8)
  elif which == "value":
    v = v.astype(jnp.float64) if jax.config.jax_enable_x64 else v.astype(jnp.uint8)
  else:
    lengths = lengths.astype(F32)
  name = "key_value_seq_lengths" if which == "lengths" else which
  with pytest.raises(TypeError, match=name):
    prefill_attention(q, k, v, None, lengths)


def test_through_the_public_api(rng):
  """jaxflash.attention: batched and unbatched, under jit and vmap, kernel and "xla" paths
  (bottom-right here; tests/test_attention.py checks the top-left default against jax.nn)."""
  q, k, v = _qkv(rng, 2, 19, 27, 4, 2, 64, F32)
  ref_out, ref_lse = attention_f64(q, k, v, is_causal=True)
  causal = dict(is_causal=True, causal_alignment="bottom_right")
  for implementation in (None, "xla"):
    out, lse = jaxflash.attention(q, k, v, return_residual=True, implementation=implementation,
                                  **causal)
    assert_close(out, ref_out, F32)
    assert_close(lse, ref_lse, F32, what="lse")
  # Unbatched [T, N, H], inside jit, and vmapped over a batch of them.
  single = jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, **causal))(q[0], k[0], v[0])
  chex.assert_shape(single, q.shape[1:])
  assert_close(single, ref_out[0], F32)
  batched = jax.vmap(lambda q, k, v: jaxflash.attention(q, k, v, **causal))(q, k, v)
  assert_close(batched, ref_out, F32)
  # Ragged lengths through the public API match the "xla" path.
  ql, kl = jnp.array([19, 4], jnp.int32), jnp.array([10, 27], jnp.int32)
  kwargs = dict(is_causal=False, query_seq_lengths=ql, key_value_seq_lengths=kl)
  np.testing.assert_allclose(jaxflash.attention(q, k, v, **kwargs),
                             jaxflash.attention(q, k, v, implementation="xla", **kwargs), atol=2e-5)


def test_reference_beside_the_kernel(rng):
  q, k, v = _qkv(rng, 2, 9, 12, 4, 2, 64, F32)
  ql, kl = np.array([9, 3]), np.array([12, 0])
  out, lse = prefill_reference(q, k, v, jnp.asarray(ql), jnp.asarray(kl), is_causal=True,
                               return_residual=True)
  _check(out, lse, q, k, v, is_causal=True, q_lengths=ql, kv_lengths=kl)


@pytest.mark.gpu
def test_scratch_memory_is_linear_in_length():
  """The compiled kernel never materialises the n x n scores: temp memory is O(n)."""
  def temp_bytes(n):
    q = jax.ShapeDtypeStruct((1, n, 12, 128), BF16)
    kv = jax.ShapeDtypeStruct((1, n, 2, 128), BF16)
    compiled = prefill_attention.lower(q, kv, kv, is_causal=True, return_residual=True).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(4096), temp_bytes(16384)
  scores_16k = 12 * 16384 * 16384 * 2  # what one bf16 score matrix would take
  assert large <= 4 * max(small, 1 << 20), (small, large)
  assert large < scores_16k // 100, (small, large)


# --- Options (jaxflash/score_mods.py): bias, mask, window, soft-cap, sinks, alignment -----------

def _operand(rng, spec: str, shape, dtype):
  """spec: one letter per axis of [B, N, T, S], "1" where the operand broadcasts."""
  dims = tuple(1 if c == "1" else d for c, d in zip(spec, shape))
  if dtype == jnp.bool_:
    return jnp.asarray(rng.random(dims) < 0.75)
  return random_array(rng, dims, dtype)


# (batch, T, S, N, K, head_dim, dtype, ragged lengths, options): every option alone, then
# combined; pairwise over T == S / T < S / T > S, GQA 1, 2, 5, 7, 8, head dims 64-256.
# bias / mask given as a broadcast spec over [B, N, T, S].
OPTION_CASES = [
    (2, 50, 50, 2, 1, 64, F32, True, dict(is_causal=True, local_window_size=(16, 0))),
    (2, 20, 45, 5, 1, 80, BF16, False, dict(local_window_size=(6, 3))),
    (1, 45, 20, 7, 1, 96, F16, False,
     dict(is_causal=True, local_window_size=5, causal_alignment="top_left")),
    (2, 24, 24, 8, 1, 128, F32, True, dict(bias="1nts", is_causal=True)),
    (2, 30, 50, 2, 2, 256, BF16, False, dict(mask="b1ts")),
    (1, 40, 40, 4, 2, 64, F16, False, dict(logits_soft_cap=5.0, bias="11ts", is_causal=True)),
    (3, 40, 40, 6, 3, 80, F32, True, dict(sinks=True, is_causal=True)),
    (2, 37, 61, 8, 2, 96, BF16, True,
     dict(bias="bnts", mask="11t1", local_window_size=(10, 2), logits_soft_cap=3.0, sinks=True,
          is_causal=True)),
    (2, 50, 30, 5, 5, 128, F32, True,
     dict(mask="1nts", sinks=True, bias="b11s", causal_alignment="top_left", is_causal=True)),
]


def _option_id(case):
  b, t, s, n, k, h, dtype, ragged, options = case
  names = "+".join(f"{key}={value}" if isinstance(value, str) else key for key, value in options.items())
  return f"t{t}-s{s}-n{n}-k{k}-h{h}-{jnp.dtype(dtype).name}{'-ragged' if ragged else ''}-{names}"


def _lengths(batch, seq_q, seq_kv):
  """Ragged lengths with a zero-key sequence at index 1 (2 or more sequences)."""
  q_lengths = np.array([seq_q, max(seq_q // 2, 1), seq_q - 3][:batch], np.int32)
  kv_lengths = np.array([seq_kv - 5, 0, seq_kv][:batch], np.int32)
  return q_lengths, kv_lengths


@pytest.mark.parametrize("case", OPTION_CASES, ids=_option_id)
def test_options_match_reference(case, interpret, rng):
  batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, ragged, options = case
  q, k, v = _qkv(rng, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
  shape = (batch, heads, seq_q, seq_kv)
  kwargs, ref = dict(options), {}
  if "bias" in kwargs:
    kwargs["bias"] = ref["bias"] = _operand(rng, kwargs["bias"], shape, dtype)
  if "mask" in kwargs:
    kwargs["mask"] = ref["mask"] = _operand(rng, kwargs["mask"], shape, jnp.bool_)
  if kwargs.pop("sinks", False):
    kwargs["sinks"] = ref["sinks"] = jnp.asarray(rng.standard_normal(heads) * 2, F32)
  window = kwargs.get("local_window_size")
  ref.update(is_causal=kwargs.get("is_causal", False), softcap=kwargs.get("logits_soft_cap"),
             alignment=kwargs.get("causal_alignment", "bottom_right"),
             window=(window, window) if isinstance(window, int) else window)
  q_lengths, kv_lengths = _lengths(batch, seq_q, seq_kv) if ragged else (None, None)
  out, lse = _run(q, k, v, None if q_lengths is None else jnp.asarray(q_lengths),
                  None if kv_lengths is None else jnp.asarray(kv_lengths),
                  config=SMALL, interpret=interpret, **kwargs)
  ref_out, ref_lse = attention_f64(q, k, v, q_lengths=q_lengths, kv_lengths=kv_lengths, **ref)
  assert_close(out, ref_out, dtype)
  lse_tol = F32 if dtype == F32 else F16
  assert_close(lse, ref_lse, lse_tol, what="lse")
  if ragged and "sinks" in kwargs:  # sequence 1 has no key: out 0, lse = the sink
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.)
    valid = int(q_lengths[1])
    np.testing.assert_allclose(np.asarray(lse[1, :valid]),
                               np.broadcast_to(np.asarray(kwargs["sinks"]), (valid, heads)), rtol=1e-6)


def _pallas_operand_shapes(jaxpr):
  """Shapes of every pallas_call operand in a (closed) jaxpr, nested jaxprs included."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      shapes += [tuple(var.aval.shape) for var in eqn.invars]
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        shapes += _pallas_operand_shapes(inner if hasattr(inner, "eqns") else inner.jaxpr)
  return shapes


def test_broadcast_operands_keep_their_shape(rng):
  """A [1, 1, T, S] mask and an [N, 1, S] bias reach the kernel as they are (stride-0 axes):
  no operand of the pallas_call is [B, N, T, S]."""
  q, k, v = _qkv(rng, 2, 32, 48, 4, 2, 64, F32)
  mask = jnp.ones((1, 1, 32, 48), bool)
  bias = jnp.zeros((4, 1, 48), F32)  # rank 3: [N, 1, S], broadcast as [1, N, 1, S]
  jaxpr = jax.make_jaxpr(lambda q, k, v, b, m: prefill_attention(q, k, v, bias=b, mask=m))(
      q, k, v, bias, mask)
  shapes = _pallas_operand_shapes(jaxpr.jaxpr)
  assert (1, 1, 32, 48) in shapes and (1, 4, 1, 48) in shapes, shapes
  assert (2, 4, 32, 48) not in shapes, shapes


@pytest.mark.parametrize("window,causal,alignment", [((20, 0), True, "bottom_right"),
                                                       ((0, 20), False, "top_left")])
def test_window_never_loads_keys_outside(window, causal, alignment, interpret, rng):
  """Key blocks outside the window are never loaded: NaN keys and values there cannot
  reach the output. 16 queries over 256 keys; the window spans 3 of the 16 key blocks."""
  q, k, v = _qkv(rng, 1, 16, 256, 1, 1, 64, F32)
  keys = np.arange(256)
  # bottom-right: queries at 240..255 see keys from 220 (block 13 on); top-left: queries at
  # 0..15 see keys up to 35 (blocks 0-2).
  outside = keys < 208 if alignment == "bottom_right" else keys >= 48
  poison = jnp.asarray(outside)[None, :, None, None]
  out, lse = _run(q, jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v), config=SMALL,
                  interpret=interpret, is_causal=causal, local_window_size=window,
                  causal_alignment=alignment)
  ref_out, ref_lse = attention_f64(q, k, v, is_causal=causal, window=window, alignment=alignment)
  assert_close(out, ref_out, F32)
  assert_close(lse, ref_lse, F32, what="lse")


def test_windowed_prefill_visits_o_n_w_key_blocks():
  """The loops' bounds (the kernel's own `score_mods.key_blocks`, summed by
  `count_key_blocks`) at n = 32768: a causal window w visits the blocks that meet each
  query block's band [start - w, end] and no others, O(n w) against O(n^2) without it.
  (Counting from the kernel's bound function keeps the check exact and instant; the test
  above shows the blocks outside those bounds are never read.)"""
  from jaxflash.prefill import count_key_blocks
  from jaxflash.score_mods import ScoreMods
  n, block_q, block_k = 32768, 128, 64
  starts = np.arange(0, n, block_q)
  for w in (1024, 4096):
    visited = count_key_blocks(ScoreMods(is_causal=True, window=(w, 0)), n, n, block_q, block_k)
    # Rows start..start+127 see keys max(0, start - w) .. start + 127.
    expected = int(np.sum((starts + block_q - 1) // block_k - np.maximum(starts - w, 0) // block_k + 1))
    assert visited == expected, (w, visited, expected)
    assert visited <= (n // block_q) * ((w + block_q) // block_k + 1)
  full = count_key_blocks(ScoreMods(is_causal=True), n, n, block_q, block_k)
  assert full == int(np.sum((starts + block_q - 1) // block_k + 1))  # causal: O(n^2 / 2)
  windowed = count_key_blocks(ScoreMods(is_causal=True, window=(1024, 0)), n, n, block_q, block_k)
  assert windowed / full < 2 * (1024 + block_q) / n  # about 2 (w + block_q) / n of the causal work


def test_scale_is_an_operand(rng):
  """A traced or NumPy scale works, and a new value reuses the compiled kernel."""
  q, k, v = _qkv(rng, 1, 20, 20, 2, 1, 64, F32)
  run = jax.jit(lambda s: prefill_attention(q, k, v, scale=s, is_causal=True, config=SMALL))
  for scale in (0.3, np.float32(0.2), jnp.float32(0.7)):
    ref, _ = attention_f64(q, k, v, is_causal=True, scale=float(scale))
    assert_close(run(scale), ref, F32)
  prefill_attention(q, k, v, scale=0.1, config=SMALL)
  compiled = prefill_attention._cache_size()
  prefill_attention(q, k, v, scale=0.4, config=SMALL)
  assert prefill_attention._cache_size() == compiled


BAD_OPTIONS = [
    (dict(bias=jnp.zeros((2, 3), F32)), ValueError, r"bias must be broadcastable.*\(2, 3\)"),
    (dict(bias=jnp.zeros((2, 3, 8, 8), F32)), ValueError, r"bias must be broadcastable.*\(2, 3, 8, 8\)"),
    (dict(mask=jnp.zeros((1, 1, 8, 9), bool)), ValueError, r"mask must be broadcastable.*\(1, 1, 8, 9\)"),
    (dict(mask=jnp.zeros((8, 8), F32)), TypeError, r"mask must be a boolean"),
    (dict(bias=jnp.zeros((8, 8), jnp.int32)), TypeError, r"bias must be"),
    (dict(sinks=jnp.zeros((3,), F32)), ValueError, r"sinks must have shape \(4,\).*\(3,\)"),
    (dict(local_window_size=(-1, 2)), ValueError, r"local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, r"local_window_size"),
    (dict(logits_soft_cap=0.0), ValueError, r"logits_soft_cap"),
    (dict(causal_alignment="center"), ValueError, r"causal_alignment"),
    (dict(scale=jnp.ones((2,), F32)), ValueError, r"scale must be a real scalar.*\(2,\)"),
]


@pytest.mark.parametrize("options,error,match", BAD_OPTIONS)
def test_bad_options_name_the_argument(options, error, match):
  q, k = _zeros((2, 8, 4, 64), F32), _zeros((2, 8, 2, 64), F32)
  with pytest.raises(error, match=match):
    prefill_attention(q, k, k, **options)


@pytest.mark.parametrize("mods", [
    dict(), dict(is_causal=True), dict(window=(5, 2)), dict(window=(0, 7)),
    dict(is_causal=True, window=(4, 9)), dict(is_causal=True, causal_alignment="top_left"),
    dict(window=(3, 3), causal_alignment="top_left")], ids=str)
def test_loop_bounds_cover_exactly_the_visible_keys(mods):
  """score_mods' key and query ranges against the visible mask, by brute force: the key
  blocks a query block visits are those holding a key some row sees (no more, no fewer),
  and the blocks it runs unmasked hold only keys every row sees; `query_range` (for a pass
  over queries per key block) gives exactly the rows that see a key of the block, and
  `query_blocks` the query blocks that hold them, unmasked only where every row sees all."""
  from jaxflash import score_mods
  mods = score_mods.ScoreMods(**mods)
  block = 4
  for seq_q, seq_kv, q_len, kv_len in [(13, 21, 13, 21), (13, 21, 9, 17), (21, 13, 20, 5)]:
    shift = int(mods.shift(jnp.int32(q_len), jnp.int32(kv_len)))
    rows, keys = jnp.arange(seq_q), jnp.arange(seq_kv)
    seen = np.asarray(score_mods.visible(mods, rows, keys, shift, kv_len)) & (np.arange(seq_q) < q_len)[:, None]
    for first in range(0, q_len, block):
      last = min(first + block, q_len) - 1
      lo, full_lo, full_hi, hi = (int(x) for x in score_mods.key_blocks(
          mods, jnp.int32(first), jnp.int32(last), shift, jnp.int32(kv_len), block))
      band = seen[first:last + 1]
      needed = {j for j in range(-(-seq_kv // block)) if band[:, j * block:(j + 1) * block].any()}
      assert set(range(lo, hi)) >= needed and (not needed or (lo == min(needed) and hi == max(needed) + 1))
      for j in range(full_lo, full_hi):
        assert band[:, j * block:(j + 1) * block].all(), (first, j)
    for first_key in range(0, kv_len, block):
      last_key = min(first_key + block, kv_len) - 1
      lo, hi = (int(x) for x in score_mods.query_range(mods, first_key, last_key, shift, q_len))
      want = np.flatnonzero(seen[:, first_key:last_key + 1].any(axis=1))
      assert list(range(lo, hi)) == list(want) or (want.size == 0 and lo >= hi), (first_key, lo, hi, want)
      # query_blocks (the dK/dV kernel's loops): every row that sees a key of the block is
      # in a visited query block, and the blocks it runs unmasked see every key (rows past
      # q_len are left to the LSE of +inf, so they are not asked to).
      lo, full_lo, full_hi, hi = (int(x) for x in score_mods.query_blocks(
          mods, jnp.int32(first_key), jnp.int32(last_key), shift, jnp.int32(q_len), block))
      assert lo <= full_lo <= full_hi <= hi
      assert all(lo * block <= r < hi * block for r in want), (first_key, lo, hi, want)
      for i in range(full_lo, full_hi):
        rows_i = np.arange(i * block, min((i + 1) * block, q_len))
        assert seen[rows_i, first_key:last_key + 1].all(), (first_key, i)
