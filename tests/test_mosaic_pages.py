"""The Mosaic GPU prefill over page pools (block_table; jaxflash/mosaic/tiles.py): its tiles
copied from the pages in place, one TMA copy per block for pages of at least a key block,
block_kv / page copies for smaller pages.

Compiled (marker `gpu`): against float64 attention over the gathered pages, chunks of new
tokens at the end of each sequence (bottom-right), scattered and shared pages, table entries
past a sequence's pages holding garbage; jaxflash.attention takes it for paged chunks. On the
CPU: the kernel traces and lowers for CUDA with every page size, jaxflash.attention routes
paged chunks to it where it serves, and bad page arguments are refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _mosaic, mosaic
from jaxflash.device import H200
from jaxflash.mosaic import MosaicPrefillConfig, prefill_attention
from tests.conftest import HAS_GPU, SM90_ONLY, assert_close
from tests.reference_np import attention_f64, gather_pages_np
from tests.test_paged_prefill import paged_case_inputs

BF16, F16 = jnp.bfloat16, jnp.float16
C = MosaicPrefillConfig
FIXED = C(64, 128, 2, overlap_softmax=True, separate_output=True, fixed_reference=True)
NEEDS_MOSAIC = pytest.mark.skipif(not _mosaic.AVAILABLE,
                                  reason=f"no Mosaic GPU in this JAX: {_mosaic.IMPORT_ERROR}")
CPU_ONLY = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")

# (pages in pool, page size, max pages, query heads, kv heads, head dim, dtype, T,
#  query lengths, key lengths, table kind, config)
CASES = {
    # 16-token pages: eight copies a 128-key block; G = 6; a chunk of 77 over 1000 keys.
    "p16_g6_h128": (160, 16, 64, 12, 2, 128, BF16, 77, [77, 40], [1000, 513], "scattered", None),
    # 128-token pages, one copy a block; G = 5; fp16; a whole prompt and a one-token row.
    "p128_g5_h128_f16": (24, 128, 8, 5, 1, 128, F16, 300, [300, 1], [300, 777], "prefix", None),
    # 256-token pages, half a page a block; G = 7, d = 64 (three consumers from 8192 keys).
    "p256_g7_h64": (40, 256, 36, 7, 1, 64, BF16, 200, [200, 150], [9000, 4100], "random", None),
    # 8-token pages, d = 256 (64-key blocks, eight copies); G = 8.
    "p8_g8_h256": (80, 8, 40, 8, 1, 256, BF16, 65, [65, 65], [300, 65], "scattered", None),
    # The fixed reference and its second pass over pages of 32 (four copies a block).
    "p32_fixed": (200, 32, 160, 4, 2, 128, BF16, 130, [130, 64], [5000, 4097], "prefix", FIXED),
}


def _inputs(rng, case):
  q, k_pages, v_pages, kv_lengths, table, clean, q_lengths = paged_case_inputs(rng, CASES[case])
  return q, k_pages, v_pages, jnp.asarray(table), clean, np.asarray(q_lengths), kv_lengths


@pytest.mark.gpu
@SM90_ONLY
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_over_gathered_pages(case, rng):
  q, k_pages, v_pages, table, clean, q_lengths, kv_lengths = _inputs(rng, case)
  config = CASES[case][-1]
  out, lse = prefill_attention(q, k_pages, v_pages, jnp.asarray(q_lengths, jnp.int32),
                               jnp.asarray(kv_lengths, jnp.int32), is_causal=True, block_table=table,
                               return_residual=True, config=config)
  k, v = gather_pages_np(k_pages, clean), gather_pages_np(v_pages, clean)
  ref_out, ref_lse = attention_f64(q, k, v, is_causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths)
  assert_close(out, ref_out, q.dtype)
  assert_close(lse, ref_lse, F16, what="lse")


@pytest.mark.gpu
@SM90_ONLY
def test_same_function_as_the_contiguous_kernel(rng):
  """Over the gathered pages the contiguous Mosaic prefill computes the same rows."""
  q, k_pages, v_pages, table, clean, q_lengths, kv_lengths = _inputs(rng, "p16_g6_h128")
  lengths = (jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32))
  paged = prefill_attention(q, k_pages, v_pages, *lengths, is_causal=True, block_table=table)
  k, v = (jnp.asarray(gather_pages_np(x, clean)) for x in (k_pages, v_pages))
  contiguous = prefill_attention(q, k, v, *lengths, is_causal=True)
  valid = np.arange(q.shape[1])[None, :] < q_lengths[:, None]
  np.testing.assert_allclose(np.asarray(paged, np.float32)[valid], np.asarray(contiguous, np.float32)[valid],
                             rtol=0, atol=2 ** -7)


@pytest.mark.gpu
@SM90_ONLY
def test_attention_runs_it_over_page_pools(rng):
  """jaxflash.attention over a page pool compiles to the Mosaic prefill on sm_90 and gives its
  rows; a one-token call stays on the paged decode."""
  q, k_pages, v_pages, table, clean, q_lengths, kv_lengths = _inputs(rng, "p16_g6_h128")
  lengths = dict(query_seq_lengths=jnp.asarray(q_lengths, jnp.int32),
                 key_value_seq_lengths=jnp.asarray(kv_lengths, jnp.int32))
  run = jax.jit(lambda q, kp, vp, table: jaxflash.attention(q, kp, vp, is_causal=True, block_table=table,
                                                             causal_alignment="bottom_right", **lengths))
  assert "mosaic_gpu" in run.lower(q, k_pages, v_pages, table).as_text()
  direct = prefill_attention(q, k_pages, v_pages, lengths["query_seq_lengths"],
                             lengths["key_value_seq_lengths"], is_causal=True, block_table=table)
  valid = np.arange(q.shape[1])[None, :] < q_lengths[:, None]
  got = np.asarray(run(q, k_pages, v_pages, table), np.float32)
  np.testing.assert_array_equal(got[valid], np.asarray(direct, np.float32)[valid])
  one_token = jax.jit(lambda q, kp, vp, table: jaxflash.attention(
      q, kp, vp, is_causal=True, block_table=table, causal_alignment="bottom_right",
      key_value_seq_lengths=lengths["key_value_seq_lengths"]))
  assert "mosaic_gpu" not in one_token.lower(q[:, :1], k_pages, v_pages, table).as_text()


@NEEDS_MOSAIC
def test_attention_routes_paged_chunks_to_it(monkeypatch, rng):
  """Where the Mosaic prefill serves (the device rule stood in for an H200; the kernel stood
  in for by the Triton paged prefill, recording its arguments), jaxflash.attention hands it
  the page pool and the table; one-token calls keep the paged decode, and segment ids are
  refused as before."""
  from jaxflash.mosaic import config as mosaic_config
  from jaxflash.paged_prefill import paged_prefill_attention
  calls = []

  def stand_in(q, kp, vp, ql, kl, *, block_table, scale, is_causal, local_window_size, return_residual):
    calls.append(dict(scale=scale, is_causal=is_causal, window=local_window_size, paged=block_table is not None))
    return paged_prefill_attention(q, kp, vp, kl, block_table, ql, scale=scale, is_causal=is_causal,
                                   local_window_size=local_window_size, return_residual=return_residual)

  monkeypatch.setattr(mosaic_config, "device_reason", lambda info: None)
  monkeypatch.setattr(mosaic_config, "device_info", lambda: H200)
  monkeypatch.setattr(mosaic, "prefill_attention", stand_in)
  q, k_pages, v_pages, table, clean, q_lengths, kv_lengths = _inputs(rng, "p16_g6_h128")
  q_len, kv_len = jnp.asarray(q_lengths, jnp.int32), jnp.asarray(kv_lengths, jnp.int32)
  assert jaxflash.mosaic_reason(q, k_pages, v_pages, q_len, kv_len, table) is None
  paged = dict(is_causal=True, causal_alignment="bottom_right", block_table=table, key_value_seq_lengths=kv_len)
  out = jaxflash.attention(q, k_pages, v_pages, query_seq_lengths=q_len, local_window_size=(300, 0), **paged)
  assert calls == [dict(scale=128 ** -0.5, is_causal=True, window=(300, 0), paged=True)]
  want = paged_prefill_attention(q, k_pages, v_pages, kv_len, table, q_len, is_causal=True,
                                 local_window_size=(300, 0))
  valid = np.arange(q.shape[1])[None, :] < q_lengths[:, None]
  np.testing.assert_array_equal(np.asarray(out)[valid], np.asarray(want)[valid])
  jaxflash.attention(q[:, :1], k_pages, v_pages, **paged)
  assert len(calls) == 1
  with pytest.raises(NotImplementedError, match="segment_ids"):
    jaxflash.attention(q, k_pages, v_pages, segment_ids=jnp.zeros(q.shape[:2], jnp.int32),
                       kv_segment_ids=jnp.zeros((2, table.shape[1] * 16), jnp.int32), **paged)


@CPU_ONLY
@NEEDS_MOSAIC
@pytest.mark.parametrize("page,head_dim,config,window", [
    (16, 128, None, None), (128, 128, None, None), (256, 128, None, (70, 0)),
    (8, 256, None, None), (32, 128, FIXED, None), (64, 64, None, None),
], ids=["p16", "p128", "p256-window", "p8-d256", "p32-fixed", "p64-d64"])
def test_kernel_lowers_for_every_page_size(page, head_dim, config, window, monkeypatch):
  """Off the GPU the kernel cannot run, but it traces and lowers for CUDA: the copies of
  each page size into their row slices of the swizzled slot, the barriers that expect them."""
  monkeypatch.setattr(_mosaic, "interpret_params", lambda interpret: None)
  monkeypatch.setattr(mosaic.forward, "device_info", lambda: H200)
  q = jax.ShapeDtypeStruct((2, 300, 6, head_dim), BF16)
  pool = jax.ShapeDtypeStruct((64, page, 2, head_dim), BF16)
  table = jax.ShapeDtypeStruct((2, 8192 // page), jnp.int32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  run = lambda q, kp, vp, ql, kl, tb: prefill_attention(q, kp, vp, ql, kl, is_causal=True, block_table=tb,
                                                        local_window_size=window, return_residual=True,
                                                        config=config)
  out, lse = jax.eval_shape(run, q, pool, pool, lengths, lengths, table)
  assert out.shape == q.shape and lse.shape == q.shape[:3]
  lowered = jax.jit(run).trace(q, pool, pool, lengths, lengths, table).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@NEEDS_MOSAIC
@pytest.mark.parametrize("change,error,match", [
    (dict(page=12), ValueError, "page"),
    (dict(kv_lengths=None), ValueError, "key_value_seq_lengths"),
    (dict(segment_ids=True), NotImplementedError, "segment_ids"),
    (dict(config=C(64, 128, 2, overlap_softmax=True, tensor_core_row_sums=True)), ValueError,
     "tensor_core_row_sums"),
    (dict(table_shape=(3, 4)), ValueError, "block_table"),
    (dict(num_pages=0), ValueError, "at least one page"),
])
def test_bad_page_arguments_are_refused(change, error, match):
  page = change.get("page", 16)
  q = jnp.zeros((2, 32, 4, 128), BF16)
  pool = jnp.zeros((change.get("num_pages", 8), page, 2, 128), BF16)
  table = jnp.zeros(change.get("table_shape", (2, 4)), jnp.int32)
  kv_lengths = change.get("kv_lengths", jnp.array([32, 32], jnp.int32))
  ids = jnp.zeros((2, 32), jnp.int32) if change.get("segment_ids") else None
  with pytest.raises(error, match=match):
    prefill_attention(q, pool, pool, None, kv_lengths, is_causal=True, block_table=table,
                      segment_ids=ids, config=change.get("config"))


def test_copies_per_block_follow_the_page_size():
  from jaxflash.mosaic.tiles import copies_per_block
  assert {page: copies_per_block(128, page) for page in (8, 16, 64, 128, 256)} == {
      8: 16, 16: 8, 64: 2, 128: 1, 256: 1}
  assert copies_per_block(128, 0) == 1  # a contiguous cache
  assert copies_per_block(64, 16) == 4
