"""Qwen2's sliding window (use_sliding_window / sliding_window / max_window_layers) against
Hugging Face transformers: which layers are windowed, the window's width (a query at p sees
keys p - W + 1 .. p), logits and greedy tokens through every path (prefill, chunked
prefill over the cache, decode; contiguous and paged caches) on tiny random checkpoints
whose window is shorter than the prompts, float32 on the CPU against transformers' eager
attention; and the paged cache giving back the pages every layer's window has passed."""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models.qwen2 as qwen2
from tests import qwen2_fixtures as fx

LOGIT_ATOL = 1e-4
PROMPT_LENGTHS = (3, 11, 29)  # the window (fx.WINDOW = 7) is shorter than two of them
NEW_TOKENS = 12  # every sequence runs past the window while generating
PAGE_SIZE = 8

BASE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(autouse=True)
def full_precision_matmuls():
  """float32 matmuls in full precision (TF32 on a GPU is not float32 rounding)."""
  with jax.default_matmul_precision("highest"):
    yield


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("keys", [
    {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 9},
    {"use_sliding_window": True, "sliding_window": 5},  # transformers' default max_window_layers
    {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 3,
     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    {"use_sliding_window": False, "sliding_window": 5, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
], ids=["mixed", "all", "none", "default-layers", "layer-types", "off", "null-window"])
def test_layer_windows_follow_transformers(keys):
  """Each layer is windowed exactly where transformers' Qwen2 windows it (its layer_types,
  and the window its attention layer keeps)."""
  transformers = pytest.importorskip("transformers")
  hf = transformers.Qwen2Config(**{**BASE, **keys})
  theirs = tuple(hf.sliding_window if kind == "sliding_attention" else None for kind in hf.layer_types)
  ours = qwen2.Qwen2Config.from_hf_dict({**BASE, **keys})
  assert ours.layer_windows == theirs
  # A config.json saved by transformers 5 names layer_types itself: the same windows.
  assert qwen2.Qwen2Config.from_hf_dict(hf.to_dict()).layer_windows == theirs


@pytest.mark.parametrize("keys", [
    {"sliding_window": 0}, {"sliding_window": 2.5}, {"max_window_layers": -1},
    {"layer_types": ["sliding_attention"] * 3}, {"layer_types": ["local"] * 4},
])
def test_bad_windows_raise(keys):
  with pytest.raises(ValueError, match="sliding_window|max_window_layers|layer_types"):
    qwen2.Qwen2Config.from_hf_dict({**BASE, "use_sliding_window": True, "sliding_window": 5,
                                    "max_window_layers": 1, **keys})


def test_window_is_a_static_property_of_each_layer():
  config = qwen2.Qwen2Config.tiny(num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                  max_window_layers=1)
  model = qwen2.random_model(config, seed=0)
  assert [layer.attention.sliding_window for layer in model.layers] == [None, 4, 4]


# ------------------------------------------------------------ parity with transformers

pytest.importorskip("torch")
pytest.importorskip("transformers")


@functools.cache
def load(name: str):
  """Our model of the checkpoint `name` (one per process: its jitted steps are cached)."""
  return qwen2.from_pretrained(fx.hf_checkpoint(name)[0])


@pytest.fixture(scope="module", params=list(fx.WINDOWED))
def checkpoint(request):
  return request.param


@pytest.fixture(scope="module")
def model(checkpoint):
  return load(checkpoint)


def test_windowed_checkpoint_config(model, checkpoint):
  first = None if checkpoint == "window-mixed" else fx.WINDOW
  assert model.config.layer_windows == (first, fx.WINDOW)


@pytest.mark.parametrize("impl", [None, "xla"], ids=["jaxflash", "xla"])
def test_windowed_logits_match_transformers(model, checkpoint, impl):
  """24 tokens through a window of 7: an off-by-one in the window's width would move
  every logit past position 6 by far more than float32 rounding."""
  ids = np.random.default_rng(1).integers(0, fx.VOCAB, (2, 24))
  ours = np.asarray(model(jnp.asarray(ids), attention_impl=impl))
  np.testing.assert_allclose(ours, fx.hf_logits(checkpoint, ids), rtol=0, atol=LOGIT_ATOL)


def _cache(model, kind: str, batch: int, capacity: int):
  if kind == "contiguous":
    return qwen2.ContiguousCache.create(model.config, batch, capacity, model.dtype)
  cache = qwen2.PagedCache.create(model.config, batch, capacity, model.dtype, page_size=PAGE_SIZE)
  table = jnp.arange(batch * cache.block_table.shape[1], dtype=jnp.int32).reshape(batch, -1)
  return dataclasses.replace(cache, block_table=table)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_chunked_prefill_and_decode_match_transformers(model, checkpoint, kind):
  """A right-padded prompt written through the cache in two chunks (the second attends to
  the cached first through the window), then decode steps one token at a time: every
  position's logits equal transformers' on the whole sequence."""
  rng = np.random.default_rng(4)
  ids = rng.integers(0, fx.VOCAB, (2, 24))
  lengths = np.array([20, 13], np.int32)  # the prompts; the rest of each row is decoded
  cache = _cache(model, kind, 2, 32)
  got = [[] for _ in range(2)]
  for start, stop in ((0, 9), (9, 20)):
    chunk_lengths = np.clip(lengths - start, 0, stop - start)
    logits, cache = model(jnp.asarray(ids[:, start:stop]), cache=cache,
                          lengths=jnp.asarray(chunk_lengths))
    for row in range(2):
      got[row].extend(np.asarray(logits[row, :chunk_lengths[row]]))
  for _ in range(24 - lengths.min()):  # decode: row b feeds ids[b, cache length]
    live = np.asarray(cache.lengths) < 24
    feed = ids[np.arange(2), np.minimum(np.asarray(cache.lengths), 23)]
    logits, cache = model(jnp.asarray(feed[:, None]), cache=cache,
                          lengths=jnp.asarray(live.astype(np.int32)))
    for row in np.flatnonzero(live):
      got[row].append(np.asarray(logits[row, 0]))
  theirs = fx.hf_logits(checkpoint, ids)
  for row in range(2):
    np.testing.assert_allclose(np.stack(got[row]), theirs[row], rtol=0, atol=LOGIT_ATOL,
                               err_msg=f"row {row}")


# Each case compiles its own decode loop (~20 s on a CPU): the mixed checkpoint through both
# caches. The all-windowed checkpoint's generation is checked below, with its pages given
# back; a batch of one (the split-KV decode path) in test_decode_never_reads_keys_before_the_window.
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_windowed_greedy_generation_matches_transformers(cache):
  prompts = fx.prompts(PROMPT_LENGTHS, seed=3)
  ours = qwen2.generate(load("window-mixed"), prompts, NEW_TOKENS, cache=cache, page_size=PAGE_SIZE)
  theirs = [fx.hf_greedy("window-mixed", tuple(p), NEW_TOKENS) for p in prompts]
  assert ours == theirs
  assert len({t for seq in theirs for t in seq}) > NEW_TOKENS // 2  # the tokens wander


# ------------------------------------------------------------------ pages given back


def test_allocator_release_before():
  allocator = qwen2.PageAllocator(num_pages=6, page_size=4, batch=2, max_pages=4)
  allocator.reserve(0, 13)  # pages 0-3
  allocator.reserve(1, 2)  # page 4
  allocator.release_before(0, 9)  # tokens 0-7 are pages 0 and 1: wholly before token 9
  assert allocator.free_pages == 3 and allocator.pages_dropped[0] == 2
  allocator.release_before(0, 5)  # nothing more (and nothing twice)
  assert allocator.free_pages == 3
  allocator.reserve(1, 9)  # reuses the pages given back
  assert allocator.block_table[1].tolist() == [4, 0, 1, 0] and allocator.free_pages == 1
  allocator.release(0)  # only the pages still held go back
  allocator.release(1)
  assert allocator.free_pages == 6 and sorted(allocator._free) == list(range(6))


def test_all_windowed_paged_generation_frees_pages():
  """With every layer windowed, the paged cache holds at most ceil((W - 1 + K) / page) + 1
  pages a sequence (K decode steps a call are reserved ahead) however long it grows: a pool
  far too small for the whole sequences serves them, and the tokens equal the contiguous
  cache's and transformers'."""
  model = load("window-all")
  prompts = fx.prompts(PROMPT_LENGTHS, seed=3)
  new_tokens, steps_per_call = 40, 2
  bound = math.ceil((fx.WINDOW - 1 + steps_per_call) / PAGE_SIZE) + 1  # pages a sequence
  # Enough for the prompts, which are written whole before any page can go back.
  num_pages = max(bound * len(prompts), sum(math.ceil(n / PAGE_SIZE) for n in PROMPT_LENGTHS))
  whole = sum(math.ceil((n + new_tokens) / PAGE_SIZE) for n in PROMPT_LENGTHS)
  assert num_pages < whole / 2  # without pages given back the pool would run out
  sampler = qwen2.Sampler(model, cache="paged", page_size=PAGE_SIZE, num_pages=num_pages,
                          steps_per_call=steps_per_call)
  in_use = []
  out = sampler(prompts, new_tokens, stream=lambda _: in_use.append(
      sampler.allocator.num_pages - sampler.allocator.free_pages))
  assert max(in_use[1:]) <= bound * len(prompts)  # after the prompts' first decode call
  assert sampler.allocator.free_pages == num_pages  # every page back at the end
  contiguous = qwen2.generate(model, prompts, new_tokens, cache="contiguous")
  assert out.tokens == contiguous
  assert out.tokens == [fx.hf_greedy("window-all", tuple(p), new_tokens) for p in prompts]


@pytest.mark.parametrize("kind, batch", [("paged", 1), ("paged", 2), ("contiguous", 1)])
def test_decode_never_reads_keys_before_the_window(kind, batch):
  """Decode steps over a cache whose pages (paged) or rows (contiguous) wholly before the
  window are filled with NaN as the window passes them (as if handed to another
  sequence): not one of their values reaches the logits, which equal transformers'. Batch 1
  runs the split-KV path (chunks merged in the output projection)."""
  model = load("window-all")
  ids = np.random.default_rng(5).integers(0, fx.VOCAB, (batch, 24))
  theirs = fx.hf_logits("window-all", ids)
  cache = _cache(model, kind, batch, 32)
  _, cache = model(jnp.asarray(ids[:, :17]), cache=cache)
  for t in range(17, 24):  # feed token t: its query sees keys t - W + 1 .. t
    first = max(t - fx.WINDOW + 1, 0)
    if kind == "paged":
      gone = np.asarray(cache.block_table)[:, :first // PAGE_SIZE].ravel()
      cache = dataclasses.replace(
          cache, key_pages=tuple(p.at[gone].set(jnp.nan) for p in cache.key_pages),
          value_pages=tuple(p.at[gone].set(jnp.nan) for p in cache.value_pages))
    else:
      cache = dataclasses.replace(cache, keys=tuple(k.at[:, :first].set(jnp.nan) for k in cache.keys),
                                  values=tuple(v.at[:, :first].set(jnp.nan) for v in cache.values))
    logits, cache = model(jnp.asarray(ids[:, t:t + 1]), cache=cache)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), theirs[:, t], rtol=0, atol=LOGIT_ATOL,
                               err_msg=f"token {t}")


def test_mixed_windows_keep_every_page():
  """A layer without a window reads every token: no page goes back before the end."""
  sampler = qwen2.Sampler(load("window-mixed"), cache="paged", page_size=PAGE_SIZE)
  assert sampler.kept_window is None
