"""Bad argument values raise a TypeError/ValueError naming the argument at trace time where
the values are concrete: lengths outside [0, T] / [0, S], block-table entries outside the
pool, a non-bool `is_causal`, head dims above 256, model inputs longer than
max_position_embeddings and Engine page sizes the kernels cannot page. Under jit lengths and
tables are traced and clamped instead (tests/test_decode.py, tests/test_paged.py).
Every call here fails before a kernel runs, so the file is quick."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash

B, T, S, N, K, H = 2, 5, 16, 4, 2, 32
PAGE, NUM_PAGES = 8, 3


def _qkv(t=T, s=S, h=H):
  return (jnp.zeros((B, t, N, h), jnp.float32), jnp.zeros((B, s, K, h), jnp.float32),
          jnp.zeros((B, s, K, h), jnp.float32))


def _pool(h=H):
  return jnp.zeros((NUM_PAGES, PAGE, K, h), jnp.float32)


GOOD_TABLE = np.array([[0, 1], [2, 0]], np.int32)


@pytest.mark.parametrize("name, lengths", [
    ("key_value_seq_lengths", [3, -1]), ("key_value_seq_lengths", [S + 1, 2]),
    ("key_value_seq_lengths", [2**31 - 1, 2]), ("query_seq_lengths", [T + 1, 1]),
    ("query_seq_lengths", [-2, 1])])
def test_lengths_out_of_range(name, lengths):
  q, k, v = _qkv()
  for call in (jaxflash.attention, lambda *a, **kw: jaxflash.prefill_attention(*a, **kw, interpret=True)):
    with pytest.raises(ValueError, match=rf"{name} must lie in \[0, {S if name[0] == 'k' else T}\]"):
      call(q, k, v, **{name: jnp.asarray(lengths, jnp.int32)})


def test_decode_length_above_capacity():
  q, k, v = _qkv(t=1)
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, 16\], got \[17\]"):
    jaxflash.decode_attention(q, k, v, jnp.asarray([17, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, 16\]"):
    jaxflash.paged_decode_attention(q, _pool(), _pool(), jnp.asarray([3, 17], jnp.int32), GOOD_TABLE)
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, 16\]"):
    jaxflash.paged_prefill_attention(jnp.zeros((B, T, N, H)), _pool(), _pool(), jnp.asarray([5, 17]),
                                     GOOD_TABLE)


@pytest.mark.parametrize("entry", [NUM_PAGES, -1, 10**6])
def test_block_table_entry_outside_the_pool(entry):
  table = GOOD_TABLE.copy()
  table[1, 1] = entry  # read: sequence 1 holds 9 tokens, two pages
  lengths = jnp.asarray([3, 9], jnp.int32)
  q = jnp.zeros((B, 1, N, H), jnp.float32)
  match = rf"block_table\[1, 1\] = {entry} lies outside the pool of {NUM_PAGES} pages"
  with pytest.raises(ValueError, match=match):
    jaxflash.paged_decode_attention(q, _pool(), _pool(), lengths, table)
  with pytest.raises(ValueError, match=match):
    jaxflash.attention(q, _pool(), _pool(), key_value_seq_lengths=lengths, block_table=table)
  with pytest.raises(ValueError, match=match):
    jaxflash.paged_prefill_attention(jnp.zeros((B, 3, N, H)), _pool(), _pool(), lengths, table)


def test_unread_table_entries_are_not_checked():
  """Entries past a sequence's pages are never read: padding there is fine."""
  table = GOOD_TABLE.copy()
  table[0, 1] = -1  # sequence 0 holds 3 tokens: one page
  out = jaxflash.paged_decode_attention(jnp.ones((B, 1, N, H)), _pool(), _pool(),
                                        jnp.asarray([3, 9], jnp.int32), table, interpret=True)
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("flag", ["yes", 1, None, jnp.asarray(True)])
def test_is_causal_must_be_a_bool(flag):
  q, k, v = _qkv()
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    jaxflash.attention(q, k, v, is_causal=flag)
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    jaxflash.prefill_attention(q, k, v, is_causal=flag, interpret=True)
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    jaxflash.paged_prefill_attention(jnp.zeros((B, 3, N, H)), _pool(), _pool(), jnp.asarray([3, 9]),
                                     GOOD_TABLE, is_causal=flag)


@pytest.mark.parametrize("head_dim", [257, 512])
def test_head_dims_above_256(head_dim):
  q, k, v = _qkv(h=head_dim)
  match = rf"head dims up to 256 are supported, got query \({B}, {T}, {N}, {head_dim}\)"
  for call in (jaxflash.attention, lambda *a: jaxflash.prefill_attention(*a, interpret=True),
               lambda q, k, v: jaxflash.decode_attention(q[:, :1], k, v)):
    with pytest.raises(ValueError, match=match.replace(rf"{T}, {N}", rf"\d, {N}")):
      call(q, k, v)
  with pytest.raises(ValueError, match="head dims up to 256"):
    jaxflash.paged_decode_attention(q[:, :1], _pool(head_dim), _pool(head_dim), jnp.asarray([3, 9]),
                                    GOOD_TABLE)


def test_traced_lengths_are_not_checked():
  """Under jit the values are tracers: no error, the kernels clamp (documented)."""
  q, k, v = _qkv(t=1)
  run = jax.jit(lambda lengths: jaxflash.decode_attention(q + 1, k + 1, v + 1, lengths, interpret=True))
  out = run(jnp.asarray([-3, 100], jnp.int32))
  np.testing.assert_array_equal(np.asarray(out[0]), 0.)  # length 0: zeros
  np.testing.assert_allclose(np.asarray(out[1]), 1., rtol=1e-6)  # clamped to S: the mean of ones


def test_model_input_longer_than_max_position_embeddings():
  from models.qwen2 import Qwen2Config, Qwen2ForCausalLM
  from flax import nnx
  model = Qwen2ForCausalLM(Qwen2Config.tiny(max_position_embeddings=8), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"T = 9 positions, more than the model's max_position_embeddings \(8\)"):
    model(jnp.zeros((1, 9), jnp.int32))


@pytest.mark.parametrize("page_size", [12, 0, 4, "16"])
def test_engine_page_size(page_size):
  from models.qwen2 import Qwen2Config, Qwen2ForCausalLM
  from models.serving import Engine
  from flax import nnx
  model = Qwen2ForCausalLM(Qwen2Config.tiny(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=rf"page_size must be a power of two >= 8 .*got {page_size!r}"):
    Engine(model, page_size=page_size)
