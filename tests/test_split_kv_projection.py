"""project_split_kv (jaxflash/fused/split_kv_projection.py): split-KV decode's chunks merged and
multiplied by the output projection in one kernel.

Against float64 attention followed by a float64 product, on fresh random data: contiguous and
paged chunks (random scattered pages), one chunk and many, GQA ratios, head dims 64-256
including 80 and 96, ragged and zero lengths (zero rows give zeros), output widths that do
and do not fill the last column block; per-head partials and their sum.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.fused.split_kv_projection import project_split_kv_reference
from tests.conftest import assert_close, poison_allocator, random_array
from tests.reference_np import attention_f64

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (B, S, N, K, H, D, num_splits, dtype, page_size or None)
CASES = {
    "qwen_like_bf16_many_chunks": (1, 256, 12, 2, 128, 256, 8, BF16, None),
    "gqa5_h80_fp32_ragged": (3, 100, 10, 2, 80, 200, 4, FP32, None),
    "gqa7_h96_fp16_one_chunk": (2, 50, 7, 1, 96, 130, 1, FP16, None),
    "mha_h64_paged16_bf16": (2, 96, 4, 4, 64, 128, 3, BF16, 16),
    "h256_paged8_fp32": (2, 40, 2, 1, 256, 72, 2, FP32, 8),
    "ten_sequences_two_groups_bf16": (10, 64, 6, 2, 64, 96, 2, BF16, None),  # 8 + 2 rows a program
}


def _lengths(batch: int, capacity: int, rng) -> np.ndarray:
  lengths = rng.integers(1, capacity + 1, batch)
  lengths[-1] = 0 if batch > 1 else lengths[-1]  # an empty sequence: zeros, not NaN
  return lengths.astype(np.int32)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_merged_projection_matches_float64(case, interpret, rng):
  batch, capacity, heads, kv_heads, head_dim, width, splits, dtype, page = CASES[case]
  q = random_array(rng, (batch, 1, heads, head_dim), dtype)
  k = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  v = random_array(rng, (batch, capacity, kv_heads, head_dim), dtype)
  w = random_array(rng, (heads * head_dim, width), dtype, scale=0.05)
  lengths = jnp.asarray(_lengths(batch, capacity, rng))
  if page is None:
    split = jaxflash.decode_attention(q, k, v, lengths, num_splits=splits, return_partials=True,
                                      interpret=interpret)
  else:
    pages_per_seq = capacity // page
    table = rng.permutation(batch * pages_per_seq).astype(np.int32).reshape(batch, pages_per_seq)
    inverse = np.argsort(table.reshape(-1))
    to_pages = lambda c: c.reshape(batch * pages_per_seq, page, kv_heads, head_dim)[jnp.asarray(inverse)]
    split = jaxflash.paged_decode_attention(q, to_pages(k), to_pages(v), lengths, jnp.asarray(table),
                                            num_splits=splits, return_partials=True, interpret=interpret)
  assert isinstance(split, jaxflash.SplitKV)
  chex.assert_type(split, FP32)
  if not interpret:
    poison_allocator(jax.ShapeDtypeStruct((heads, batch, 1, width), FP32))
  partials = jaxflash.project_split_kv(split, w, return_partials=True, interpret=interpret)
  chex.assert_shape(partials, (heads, batch, 1, width))
  chex.assert_type(partials, FP32)
  out = jaxflash.project_split_kv(split, w, interpret=interpret)
  chex.assert_shape(out, (batch, 1, width))
  chex.assert_type(out, dtype)

  attended, _ = attention_f64(q, k, v, kv_lengths=np.asarray(lengths))  # [B, 1, N, H] float64
  expected = attended.reshape(batch, 1, heads * head_dim) @ np.asarray(jnp.asarray(w, FP32), np.float64)
  assert_close(out, expected, dtype)
  assert_close(np.asarray(partials, np.float64).sum(axis=0), expected, dtype, what="partials")
  assert_close(project_split_kv_reference(split, w), expected, dtype, what="reference")
  if batch > 1:  # the empty sequence's projection is exactly zero
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)


def test_bad_input_names_the_argument():
  out = jnp.zeros((2, 3, 4, 64), FP32)
  split = jaxflash.SplitKV(out, jnp.zeros((2, 3, 4), FP32))
  with pytest.raises(ValueError, match=r"w must be \[N \* H, D\] = \[256, D\].*w \(128, 32\)"):
    jaxflash.project_split_kv(split, jnp.zeros((128, 32)))
  with pytest.raises(ValueError, match=r"lse2 \(2, 4\)"):
    jaxflash.project_split_kv(jaxflash.SplitKV(out, jnp.zeros((2, 4), FP32)), jnp.zeros((256, 32)))
  with pytest.raises(TypeError, match="SplitKV"):
    jaxflash.project_split_kv((out, out), jnp.zeros((256, 32)))
  with pytest.raises(ValueError, match="exclude each other"):
    jaxflash.decode_attention(jnp.zeros((2, 1, 4, 64)), out, out, return_residual=True, return_partials=True)
