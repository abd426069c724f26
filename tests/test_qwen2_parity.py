"""Qwen2 on jaxflash against Hugging Face transformers (CPU, float32, tiny random checkpoints
written by transformers itself): logits within float32 rounding, greedy tokens exact."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models.qwen2 as qwen2  # noqa: E402
from tests import qwen2_fixtures as fx  # noqa: E402

LOGIT_ATOL = 1e-4
PROMPT_LENGTHS = (3, 11, 29)  # buckets 16 and 32: right padding inside a bucket
NEW_TOKENS = 6

CHECKPOINTS = [pytest.param(True, id="tied"), pytest.param(False, id="untied")]


@pytest.fixture(autouse=True)
def full_precision_matmuls():
  """float32 matmuls in full precision: on a GPU XLA may otherwise use TF32 for the
  projections, which is not float32 rounding (no effect on a CPU)."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="module", params=CHECKPOINTS)
def tied(request):
  return request.param


@pytest.fixture(scope="module")
def model(tied):
  path, _ = fx.hf_checkpoint(tied)
  return qwen2.from_pretrained(path)


def test_config_from_checkpoint(model, tied):
  config = model.config
  assert (config.tie_word_embeddings, config.head_dim) == (tied, 16 if tied else 32)
  assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
  assert model.embedder.embedding.dtype == jnp.float32


@pytest.mark.parametrize("impl", [None, "xla"], ids=["jaxflash", "xla"])
def test_logits_match_transformers(model, tied, impl):
  ids = np.random.default_rng(1).integers(0, fx.VOCAB, (2, 24))
  ours = np.asarray(model(jnp.asarray(ids), attention_impl=impl))
  theirs = fx.hf_logits(tied, ids)
  assert ours.shape == theirs.shape == (2, 24, fx.VOCAB)
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOGIT_ATOL)


def test_right_padded_logits_match_transformers(model, tied):
  """Rows of different lengths in one batch: each valid position equals transformers'
  logits of that row alone; padding changes nothing."""
  lengths = np.array([24, 9], np.int32)
  ids = np.random.default_rng(2).integers(0, fx.VOCAB, (2, 24))
  ours = np.asarray(model(jnp.asarray(ids), lengths=jnp.asarray(lengths)))
  for row, n in enumerate(lengths):
    theirs = fx.hf_logits(tied, ids[row:row + 1, :n])[0]
    np.testing.assert_allclose(ours[row, :n], theirs, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_greedy_generation_matches_transformers(model, tied, cache):
  prompts = fx.prompts(PROMPT_LENGTHS, seed=3)
  ours = qwen2.generate(model, prompts, NEW_TOKENS, cache=cache, page_size=8)
  theirs = [fx.hf_greedy(tied, tuple(p), NEW_TOKENS) for p in prompts]
  assert ours == theirs
  # A test that only ever sees one repeated token would prove little.
  assert len({t for seq in theirs for t in seq}) > NEW_TOKENS
