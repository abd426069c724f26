"""decode_attention_block (jaxflash/attention_block.py): a decoder layer's attention half for a
decode step in one persistent kernel, against a float64 NumPy version of the same steps.

Cases cover contiguous caches and page pools (scattered and shared pages), GQA ratios 1 to 8
(with 5 and 7), head dims 64 to 256 (with 80 and 96, whose heads do not fill the q/k/v product's
column blocks, so q/k/v are finished in a phase of their own), ragged lengths, a sequence that
writes nothing (position -1), one with nothing to attend to (zeros, not NaN), 1 to 16 rows,
bf16, fp16 and fp32, and persistent grids of 1, a few and one program per SM. Compiled on a
GPU the phases run in one launch with grid barriers between them; interpreted, in three.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash.attention_block import decode_attention_block, decode_attention_block_reference
from tests.conftest import assert_close, poison_allocator, random_array
from tests.reference_np import attention_f64, gather_pages_np
from tests.test_qkv import qkv_f64

BF16, FP16, FP32 = jnp.bfloat16, jnp.float16, jnp.float32

# (batch, hidden, (q heads, kv heads), head_dim, capacity, page size or None, dtype, programs)
CASES = {
    "qwen_like_gqa6_bf16": (1, 256, (12, 2), 128, 96, None, BF16, 7),
    "paged16_gqa7_head80_fp32": (3, 160, (7, 1), 80, 48, 16, FP32, 5),
    "gqa5_head96_fp16": (2, 192, (10, 2), 96, 40, None, FP16, 3),
    "mha_head64_sixteen_rows_paged8_bf16": (16, 128, (2, 2), 64, 24, 8, BF16, 9),
    "gqa8_head256_bf16_one_program": (2, 128, (8, 1), 256, 20, None, BF16, 1),
    "gqa2_head128_fp32_program_per_sm": (2, 192, (4, 2), 128, 70, None, FP32, None),
}


def make_inputs(rng, case):
  batch, hidden, (nq, nkv), head_dim, capacity, page, dtype, _ = CASES[case]
  x = random_array(rng, (batch, hidden), dtype, scale=2.0)
  scale = jnp.asarray(1.0 + 0.3 * rng.standard_normal(hidden), dtype)
  weights = tuple(random_array(rng, (hidden, n * head_dim), dtype, scale=hidden ** -0.5) for n in (nq, nkv, nkv))
  biases = tuple(random_array(rng, (n * head_dim,), dtype, scale=0.5) for n in (nq, nkv, nkv))
  angles = rng.uniform(0.0, 500.0, (batch, head_dim // 2))
  cos, sin = jnp.asarray(np.cos(angles), FP32), jnp.asarray(np.sin(angles), FP32)
  w_o = random_array(rng, (nq * head_dim, hidden), dtype, scale=(nq * head_dim) ** -0.5)
  mlp_scale = jnp.asarray(1.0 + 0.3 * rng.standard_normal(hidden), dtype)
  # Each sequence's new token goes at position lengths - 1; sequence 0 writes nothing (-1) and
  # attends to its cached tokens, and the last one (of several) has nothing at all to attend to.
  lengths = rng.integers(1, capacity + 1, batch)
  positions = lengths - 1
  positions[0] = -1
  if batch > 2:
    lengths[-1], positions[-1] = 0, -1
  if page is None:
    table, shape = None, (batch, capacity, nkv, head_dim)
  else:  # scattered pages, spare ones, and the first page shared by sequences 0 and 1
    per_seq = capacity // page
    num_pages = batch * per_seq + 3
    table = rng.permutation(num_pages)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    if batch > 1:
      table[1, 0] = table[0, 0]
      positions[1] = max(positions[1], page)  # its new token must not land in the shared page
      lengths[1] = positions[1] + 1
    table, shape = jnp.asarray(table), (num_pages, page, nkv, head_dim)
  keys, values = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
  return (x, scale, weights, biases, cos, sin, keys, values, jnp.asarray(positions, jnp.int32),
          jnp.asarray(lengths, jnp.int32), w_o, mlp_scale), table


def block_f64(args, table, head_dim, eps):
  """The same steps in float64 NumPy: q/k/v, the cache write, attention, projection, add, norm."""
  x, scale, weights, biases, cos, sin, keys, values, positions, lengths, w_o, mlp_scale = args
  batch = x.shape[0]
  q, k, v = qkv_f64(x, scale, weights, biases, cos, sin, head_dim, eps)
  keys, values = np.asarray(keys, np.float64).copy(), np.asarray(values, np.float64).copy()
  kv_heads = k.shape[-1] // head_dim
  for b in range(batch):
    pos = int(positions[b])
    if pos < 0:
      continue
    if table is None:
      keys[b, pos], values[b, pos] = k[b].reshape(kv_heads, head_dim), v[b].reshape(kv_heads, head_dim)
    else:
      page, slot = np.asarray(table)[b, pos // keys.shape[1]], pos % keys.shape[1]
      keys[page, slot], values[page, slot] = k[b].reshape(kv_heads, head_dim), v[b].reshape(kv_heads, head_dim)
  k_all, v_all = (keys, values) if table is None else (gather_pages_np(keys, table), gather_pages_np(values, table))
  out, _ = attention_f64(q.reshape(batch, 1, -1, head_dim), k_all, v_all, kv_lengths=np.asarray(lengths))
  h = np.asarray(x, np.float64) + out.reshape(batch, -1) @ np.asarray(w_o, np.float64)
  normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * np.asarray(mlp_scale, np.float64)
  return h, normed, keys, values


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_attention_block_matches_float64(case, interpret, rng):
  batch, hidden, heads, head_dim, capacity, page, dtype, programs = CASES[case]
  args, table = make_inputs(rng, case)
  if not interpret:
    poison_allocator(jax.ShapeDtypeStruct((batch, hidden), dtype), jax.ShapeDtypeStruct((batch, hidden), dtype))
  counters = jnp.zeros((128,), jnp.int32)
  h, normed, keys, values, counters = decode_attention_block(
      *args, head_dim=head_dim, eps=1e-5, block_table=table, counters=counters, programs=programs,
      interpret=interpret)
  chex.assert_shape((h, normed), (batch, hidden))
  chex.assert_type((h, normed), dtype)
  chex.assert_trees_all_equal_shapes_and_dtypes((keys, values), (args[6], args[7]))
  assert not np.asarray(counters).any(), "the counters must come back zeroed"
  want = block_f64(args, table, head_dim, 1e-5)
  for name, got, expected in zip(("h", "normed", "keys", "values"), (h, normed, keys, values), want):
    assert_close(got, expected, dtype, what=name)
  with jax.default_matmul_precision("highest"):  # XLA's GPU dots take TF32 for fp32 otherwise
    reference = decode_attention_block_reference(*args, head_dim=head_dim, eps=1e-5, block_table=table)
  for name, got, expected in zip(("h", "normed"), reference, want):
    assert_close(got, expected, dtype, what=f"reference {name}")
  if batch > 2:  # nothing to attend to: h is x (plus a zero projection), never NaN
    np.testing.assert_array_equal(np.asarray(h[-1], np.float32), np.asarray(args[0][-1], np.float32))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_three_launches_match_one_and_counters_serve_again(paged, interpret, rng):
  """one_launch=False (the phases as three launches) gives the same results as one launch, and
  the counters the kernel hands back serve the next call unchanged (three calls in a row)."""
  case = "mha_head64_sixteen_rows_paged8_bf16" if paged else "qwen_like_gqa6_bf16"
  head_dim = CASES[case][3]
  args, table = make_inputs(rng, case)
  counters = jnp.zeros((256,), jnp.int32)
  outs = []
  for _ in range(3):
    *out, counters = decode_attention_block(*args, head_dim=head_dim, block_table=table, counters=counters,
                                            interpret=interpret)
    outs.append(out)
  apart = decode_attention_block(*args, head_dim=head_dim, block_table=table, one_launch=False,
                                 interpret=interpret)
  for out in (*outs[1:], apart):
    for got, first in zip(out, outs[0]):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(first, np.float32))
  assert not np.asarray(counters).any()


def test_bad_inputs_are_refused_with_their_names(rng):
  args, table = make_inputs(rng, "qwen_like_gqa6_bf16")
  x, scale, weights, biases, cos, sin, keys, values, positions, lengths, w_o, mlp_scale = args
  call = lambda *a, **k: decode_attention_block(*a, head_dim=128, **k)
  with pytest.raises(ValueError, match="w_o must be"):
    call(x, scale, weights, biases, cos, sin, keys, values, positions, lengths, w_o[:, :-1], mlp_scale)
  with pytest.raises(ValueError, match="mlp_norm_scale must be"):
    call(x, scale, weights, biases, cos, sin, keys, values, positions, lengths, w_o, mlp_scale[:-1])
  with pytest.raises(ValueError, match="kv_lengths"):
    call(x, scale, weights, biases, cos, sin, keys, values, positions, lengths[:0], w_o, mlp_scale)
  with pytest.raises(ValueError, match="one token per sequence"):
    call(jnp.stack([x, x], 1), scale, weights, biases, cos[:, None], sin[:, None], keys, values, positions,
         lengths, w_o, mlp_scale)
  with pytest.raises(TypeError, match="caches must have x's dtype"):
    call(x, scale, weights, biases, cos, sin, keys.astype(FP32), values.astype(FP32), positions, lengths, w_o,
         mlp_scale)
  with pytest.raises(ValueError, match="counters must have at least"):
    call(x, scale, weights, biases, cos, sin, keys, values, positions, lengths, w_o, mlp_scale,
         counters=jnp.zeros((8,), jnp.int32))
  with pytest.raises(ValueError, match="programs must be"):
    call(x, scale, weights, biases, cos, sin, keys, values, positions, lengths, w_o, mlp_scale, programs=-1)


def test_exported_at_the_top_level():
  assert jaxflash.decode_attention_block is decode_attention_block
