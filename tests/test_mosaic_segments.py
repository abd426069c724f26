"""Packed documents (segment ids) and NaN inputs in the Mosaic GPU (sm_90) prefill.

Compiled cases (marker `gpu`) against the float64 reference with the equivalent explicit
mask; on the CPU, the block ranges that skip key blocks against a brute-force check, the
argument checks, `supports`, and the kernel's tracing and lowering with segments.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash import _mosaic
from jaxflash import mosaic
from jaxflash.device import H200
from jaxflash.mosaic import MosaicPrefillConfig, prefill_attention, supports
from jaxflash.mosaic.segments import block_ranges, check_segment_ids
from tests.conftest import HAS_GPU, SM90_ONLY, assert_close
from tests.reference_np import attention_f64
from tests.test_mosaic_prefill import _run
from tests.test_prefill import _qkv

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
gpu = pytest.mark.gpu
CPU_ONLY = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")
NEEDS_MOSAIC = pytest.mark.skipif(not _mosaic.AVAILABLE,
                                  reason=f"no Mosaic GPU in this JAX: {_mosaic.IMPORT_ERROR}")
C = MosaicPrefillConfig
PAIR = C(64, 128, 2)
OVERLAP = C(64, 128, 2, overlap_softmax=True, separate_output=True)
THREE_SUMMED = C(64, 128, 2, overlap_softmax=True, separate_output=True, num_consumers=3,
                 tensor_core_row_sums=True)
RESCALED = C(64, 64, 2, overlap_softmax=True, conditional_rescale=True)


def _packed_ids(rng, batch, n, min_len, max_len):
  """[batch, n] int32 ids of documents of min_len..max_len tokens packed back to back
  (non-decreasing, starting at a random id)."""
  rows = []
  for _ in range(batch):
    lengths = rng.integers(min_len, max_len + 1, size=n)
    ids = np.repeat(np.arange(n), lengths)[:n] + rng.integers(0, 5)
    rows.append(ids)
  return np.stack(rows).astype(np.int32)


def _segment_mask(q_ids, kv_ids):
  return np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]  # [B, 1, T, S]


def _check_segments(out, lse, q, k, v, q_ids, kv_ids, **options):
  ref_out, ref_lse = attention_f64(q, k, v, mask=_segment_mask(q_ids, kv_ids), **options)
  assert_close(out, ref_out, q.dtype)
  assert_close(lse, ref_lse, F16, what="lse")


# (batch, T, S, N, K, head_dim, dtype, causal, document lengths, config)
PACKED_CASES = [
    (2, 1000, 1000, 6, 2, 128, BF16, True, (30, 400), None),
    (1, 777, 777, 5, 1, 64, F16, True, (1, 100), None),  # many short documents, GQA 5
    (1, 513, 513, 7, 1, 256, BF16, True, (100, 300), None),  # GQA 7
    (2, 1000, 1000, 6, 2, 128, BF16, False, (60, 500), None),  # no causal mask
    (1, 4100, 4100, 4, 1, 128, BF16, True, (500, 2000), None),  # the long-sequence default
    (1, 640, 640, 4, 1, 64, BF16, True, (64, 256), PAIR),
    (2, 1000, 1000, 12, 2, 128, F16, True, (10, 300), OVERLAP),
    (1, 900, 900, 6, 2, 64, BF16, True, (50, 200), THREE_SUMMED),
    (1, 600, 600, 4, 2, 192, BF16, True, (100, 250), RESCALED),
    (1, 300, 300, 8, 8, 128, BF16, True, (300, 300), None),  # one document: as without ids
]


@gpu
@SM90_ONLY
@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: f"b{c[0]}-t{c[1]}-h{c[5]}-docs{c[8][0]}_{c[8][1]}-{c[9]}")
def test_packed_documents_match_the_masked_reference(case, rng):
  batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, causal, (lo, hi), config = case
  q, k, v = _qkv(rng, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
  ids = _packed_ids(rng, batch, seq_q, lo, hi)
  out, lse = _run(q, k, v, is_causal=causal, config=config, segment_ids=jnp.asarray(ids))
  _check_segments(out, lse, q, k, v, ids, ids, is_causal=causal)


@gpu
@SM90_ONLY
@pytest.mark.parametrize("config", [None, PAIR, THREE_SUMMED], ids=["default", "pair", "three"])
def test_any_ids_stay_exact(config, rng):
  """Ids that are not sorted (each token's id drawn from 0..3): blocks are rarely skipped
  but every comparison is made; rows whose id no visible key shares give zeros."""
  q, k, v = _qkv(rng, 2, 500, 500, 4, 2, 64 if config is THREE_SUMMED else 128, BF16)
  ids = rng.integers(0, 4, size=(2, 500)).astype(np.int32)
  out, lse = _run(q, k, v, is_causal=True, config=config, segment_ids=jnp.asarray(ids))
  _check_segments(out, lse, q, k, v, ids, ids, is_causal=True)


@gpu
@SM90_ONLY
def test_segments_with_lengths_window_and_t_ne_s(rng):
  """Queries over a longer cache (T < S, bottom-right), ragged lengths, a window and ids of
  their own for the keys: each restriction ANDed with the documents."""
  q, k, v = _qkv(rng, 2, 300, 700, 6, 2, 128, BF16)
  kv_ids = _packed_ids(rng, 2, 700, 50, 300)
  q_ids = kv_ids[:, 400:]  # the queries are the last 300 keys' tokens
  q_len, kv_len = np.array([300, 250], np.int32), np.array([700, 650], np.int32)
  out, lse = _run(q, k, v, jnp.asarray(q_len), jnp.asarray(kv_len), is_causal=True,
                  local_window_size=(200, 0), segment_ids=jnp.asarray(q_ids),
                  kv_segment_ids=jnp.asarray(kv_ids))
  _check_segments(out, lse, q, k, v, q_ids, kv_ids, is_causal=True, q_lengths=q_len,
                  kv_lengths=kv_len, window=(200, 0))


@gpu
@SM90_ONLY
def test_segments_under_vmap(rng):
  """jax.vmap over a leading axis folds it into the batch, the ids with it."""
  q, k, v = (jnp.stack(x) for x in zip(*(_qkv(rng, 1, 400, 400, 4, 2, 128, BF16) for _ in range(2))))
  ids = jnp.asarray(np.stack([_packed_ids(rng, 1, 400, 20, 200) for _ in range(2)]))
  run = lambda q, k, v, ids: prefill_attention(q, k, v, is_causal=True, segment_ids=ids)
  got = jax.jit(jax.vmap(run))(q, k, v, ids)
  for i in range(2):
    np.testing.assert_array_equal(got[i], run(q[i], k[i], v[i], ids[i]))


def _check_nan_rows(out, lse, ref_out, ref_lse):
  """NaN exactly where the reference has NaN (whole rows); elsewhere close to it."""
  out = np.asarray(out.astype(F32), np.float64)
  lse = np.asarray(lse, np.float64)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
  np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
  keep = ~np.isnan(ref_out)
  assert np.abs(out[keep] - ref_out[keep]).max() <= 1.6e-2 * max(1.0, np.abs(ref_out[keep]).max())


@gpu
@SM90_ONLY
@pytest.mark.parametrize("head_dim,seq,config", [
    (128, 700, None), (128, 4100, None), (64, 700, None), (64, 8200, None), (256, 2100, None),
    (128, 700, PAIR)], ids=lambda x: str(x))
def test_nan_propagates_as_in_jax_nn(head_dim, seq, config, rng):
  """A NaN in one query row gives a NaN row; a NaN in one key gives NaN in every row that
  sees it (causal: the rows from its position on) and nowhere else; rows that see no key
  (T > S) still give zeros. Every default config, the fixed reference's second pass included."""
  q, k, v = _qkv(rng, 1, seq + 50, seq, 4, 2, head_dim, BF16)
  q = q.at[0, 100, 1, 3].set(jnp.nan)
  k = k.at[0, seq // 2, 0, 5].set(jnp.nan)
  out, lse = _run(q, k, v, is_causal=True, config=config)
  ref_out, ref_lse = attention_f64(q, k, v, is_causal=True)
  assert np.isnan(ref_out[0, 100, 1]).all() and np.isnan(ref_out[0, -1, 0]).all()
  assert not np.isnan(ref_out[0, 60, 0]).any()  # this row does not see the key
  assert (np.asarray(out[0, :50].astype(F32)) == 0).all()  # the first 50 rows see no key
  _check_nan_rows(out, lse, ref_out, ref_lse)


# --------------------------------------------------------------------- no GPU needed

def _brute_force_ranges(q_ids, kv_ids, block_q, block_kv):
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  meets = np.zeros((b, t // block_q, s // block_kv), bool)
  uniform = np.zeros_like(meets)
  for i in range(b):
    for r in range(t // block_q):
      qs = q_ids[i, r * block_q:(r + 1) * block_q]
      for j in range(s // block_kv):
        ks = kv_ids[i, j * block_kv:(j + 1) * block_kv]
        meets[i, r, j] = np.isin(qs, ks).any()
        uniform[i, r, j] = len(set(qs)) == 1 and set(qs) == set(ks)
  return meets, uniform


@pytest.mark.parametrize("kind", ["packed", "random", "one"])
def test_block_ranges_keep_every_block_that_meets(kind, rng):
  """Every key block holding an id of a query row block lies in its [lo, hi); every block of
  [full_lo, full_hi) holds the row block's one id alone; for packed (sorted) ids, [lo, hi)
  is exactly the blocks that meet."""
  t, s, block_q, block_kv = 64 * 12, 128 * 7, 64, 128
  if kind == "packed":
    q_ids = _packed_ids(rng, 3, s, 20, 300)
  elif kind == "random":
    q_ids = rng.integers(0, 3, size=(3, s)).astype(np.int32)
  else:
    q_ids = np.full((3, s), 7, np.int32)
  kv_ids = q_ids
  q_ids = q_ids[:, :t]
  ranges = np.asarray(block_ranges(jnp.asarray(q_ids), jnp.asarray(kv_ids), block_q, block_kv))
  assert ranges.shape == (3, t // block_q, 4) and ranges.dtype == np.int32
  meets, uniform = _brute_force_ranges(q_ids, kv_ids, block_q, block_kv)
  j = np.arange(s // block_kv)
  lo, hi, full_lo, full_hi = (ranges[..., i, None] for i in range(4))
  assert not (meets & ((j < lo) | (j >= hi))).any()
  assert (uniform | ~((j >= full_lo) & (j < full_hi))).all()
  if kind == "packed":
    np.testing.assert_array_equal(meets, (j >= lo) & (j < hi))
  if kind == "one":
    assert (full_lo == 0).all() and (full_hi == s // block_kv).all()


def test_segment_ids_are_checked():
  ids = jnp.zeros((2, 8), jnp.int32)
  q_ids, kv_ids = check_segment_ids(ids, None, 2, 8, 8)
  assert q_ids.dtype == jnp.int32 and kv_ids is q_ids
  assert check_segment_ids(None, None, 2, 8, 8) == (None, None)
  with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 8\), got .*\(2, 9\)"):
    check_segment_ids(jnp.zeros((2, 9), jnp.int32), ids, 2, 8, 8)
  with pytest.raises(TypeError, match="segment_ids must be an integer array"):
    check_segment_ids(ids.astype(F32), None, 2, 8, 8)
  with pytest.raises(ValueError, match=r"kv_segment_ids must have shape \(2, 16\)"):
    check_segment_ids(ids, ids, 2, 8, 16)
  with pytest.raises(ValueError, match="kv_segment_ids is needed"):
    check_segment_ids(ids, None, 2, 8, 16)
  with pytest.raises(ValueError, match="needs segment_ids"):
    check_segment_ids(None, ids, 2, 8, 8)


def test_bad_segment_ids_are_refused_by_the_kernel():
  q = jnp.zeros((1, 8, 4, 128), BF16)
  kv = jnp.zeros((1, 8, 2, 128), BF16)
  with pytest.raises(ValueError, match=r"segment_ids must have shape \(1, 8\)"):
    prefill_attention(q, kv, kv, segment_ids=jnp.zeros((1, 9), jnp.int32))


@NEEDS_MOSAIC
def test_supports_segments():
  q = jax.ShapeDtypeStruct((1, 64, 12, 128), BF16)
  kv = jax.ShapeDtypeStruct((1, 64, 2, 128), BF16)
  ids = jax.ShapeDtypeStruct((1, 64), jnp.int32)
  assert supports(q, kv, kv, info=H200, segment_ids=ids, kv_segment_ids=ids, is_causal=True) is None


@CPU_ONLY
@NEEDS_MOSAIC
@pytest.mark.parametrize("config,window", [(None, None), (PAIR, (70, 0)), (THREE_SUMMED, None),
                                           (RESCALED, None)], ids=["default", "pair-window",
                                                                   "three-consumers", "rescaled"])
def test_kernel_with_segments_traces_and_lowers(config, window, monkeypatch):
  """Off the GPU the kernel cannot run, but with segments it traces and lowers for CUDA."""
  monkeypatch.setattr(_mosaic, "interpret_params", lambda interpret: None)
  monkeypatch.setattr(mosaic.forward, "device_info", lambda: H200)
  head_dim = 64 if config is THREE_SUMMED else 128
  q = jax.ShapeDtypeStruct((2, 300, 6, head_dim), BF16)
  kv = jax.ShapeDtypeStruct((2, 333, 2, head_dim), BF16)
  q_ids, kv_ids = jax.ShapeDtypeStruct((2, 300), jnp.int32), jax.ShapeDtypeStruct((2, 333), jnp.int32)
  run = lambda q, k, v, a, b: prefill_attention(q, k, v, is_causal=True, local_window_size=window,
                                                segment_ids=a, kv_segment_ids=b,
                                                return_residual=True, config=config)
  lowered = jax.jit(run).trace(q, kv, kv, q_ids, kv_ids).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
