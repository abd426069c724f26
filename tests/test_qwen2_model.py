"""models.qwen2 beyond parity: config mapping, checkpoint loading and its errors, sampling,
EOS stopping, the page allocator, streaming, and the `python -m models.generate` command.

Generation here runs attention through jaxflash's plain-JAX path ("xla") unless the
kernels are the point: they are interpreted on a CPU, and tests/test_qwen2_parity.py
already runs them end to end against transformers.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.qwen2 as qwen2
from models.qwen2.sampling import SamplingParams, sample_logits

NEW_TOKENS = 6


# ----------------------------------------------------------------------------- config

QWEN25_STYLE = {  # as Qwen2.5-0.5B-Instruct's config.json writes it (transformers 4.x)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "eos_token_id": 151645, "bos_token_id": 151643, "rope_scaling": None,
    "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu",
}


def test_config_from_hf_dict():
  config = qwen2.Qwen2Config.from_hf_dict(QWEN25_STYLE)
  assert config == qwen2.Qwen2Config.qwen2_5_0_5b(eos_token_id=151645)
  assert config.head_dim == 64  # hidden / heads when the file has no head_dim
  # The sliding-window keys are parsed; the window is kept only where it is used (as in HF).
  assert (config.use_sliding_window, config.sliding_window, config.max_window_layers) == (False, None, None)
  # transformers 5 nests rope_theta in rope_parameters and writes "dtype".
  v5 = {**QWEN25_STYLE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "dtype": "float32", "head_dim": 32, "eos_token_id": [1, 2]}
  del v5["rope_theta"], v5["torch_dtype"]
  config = qwen2.Qwen2Config.from_hf_dict(v5)
  assert (config.rope_theta, config.torch_dtype, config.head_dim) == (5e5, "float32", 32)
  assert config.eos_token_ids == (1, 2)


@pytest.mark.parametrize("change, error", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, ValueError),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, NotImplementedError),
    ({"use_sliding_window": True, "sliding_window": 0}, ValueError),
    ({"num_key_value_heads": 3}, ValueError),
    ({"num_attention_heads": 0}, ValueError),
    ({"vocab_size": -1}, ValueError),
])
def test_config_refuses_what_it_cannot_run(change, error):
  with pytest.raises(error):
    qwen2.Qwen2Config.from_hf_dict({**QWEN25_STYLE, **change})


def test_qwen2_5_1_5b_parameter_count():
  """The preset builds the published model: 1,543,714,304 parameters (1.54B)."""
  model = nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(qwen2.Qwen2Config.qwen2_5_1_5b(),
                                                        rngs=nnx.Rngs(0)))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert sum(p.size for p in params) == 1_543_714_304


def test_random_model_forward():
  config = qwen2.Qwen2Config.tiny()
  model = qwen2.random_model(config, seed=0, dtype="bfloat16")
  assert model.embedder.embedding.dtype == jnp.bfloat16
  ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 8)))
  logits = model(ids, attention_impl="xla")
  assert logits.shape == (2, 8, config.vocab_size) and logits.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(logits, np.float32)).all()


def _empty_cache(model, batch, capacity=32, kind="contiguous"):
  if kind == "paged":
    cache = qwen2.PagedCache.create(model.config, batch, capacity, model.dtype, page_size=8)
    table = jnp.arange(batch * cache.block_table.shape[1], dtype=jnp.int32).reshape(batch, -1)
    return dataclasses.replace(cache, block_table=table)
  return qwen2.ContiguousCache.create(model.config, batch, capacity, model.dtype)


def _jaxpr(fn, *args) -> str:
  return str(jax.make_jaxpr(fn)(*args))


def test_step_plan_follows_the_batch():
  """One plan per call, from the model and the batch: the decode-step kernels for a call
  with a cache of at most 16 rows, split-KV into the output projection at one row, the
  cache write in the q/k/v kernel for one token a row; nothing of it without a cache."""
  model = qwen2.random_model(qwen2.Qwen2Config.tiny(), seed=0)
  cache = _empty_cache(model, 1)
  build = lambda shape, c=cache, **kw: qwen2.StepPlan.build(model, shape, c, **kw)
  assert build((1, 1)) == qwen2.StepPlan(skinny=True, fused_qkv=True, cache_write="qkv",
                                         qkv_counters=True, residual_norm=True, split_kv=True)
  assert not build((2, 1)).split_kv and build((2, 1)).cache_write == "qkv"
  assert build((3, 5)).cache_write == "scatter" and build((3, 5)).fused_qkv  # a prompt chunk
  assert build((17, 1)) == qwen2.StepPlan(cache_write="kernel")  # too many rows for the fusions
  assert build((2, 8), None) == qwen2.StepPlan()  # no cache: plain XLA, differentiable
  assert not build((1, 1), attention_impl="xla").split_kv
  # Head dim 80 does not divide the q/k/v kernel's 128-column blocks: two launches, no counters.
  wide_heads = qwen2.random_model(qwen2.Qwen2Config.tiny(head_dim=80), seed=0)
  plan = qwen2.StepPlan.build(wide_heads, (1, 1), _empty_cache(wide_heads, 1))
  assert plan.fused_qkv and not plan.qkv_counters
  with pytest.raises(ValueError, match="split_kv needs residual_norm"):
    qwen2.StepPlan(skinny=True, split_kv=True)
  with pytest.raises(ValueError, match="cache_write"):
    qwen2.StepPlan(cache_write="in place")


def test_skinny_projections_match_xla_dots():
  """A step with a cache and at most 16 rows multiplies through jaxflash.skinny_matmul: the
  same logits as XLA's dots (another plan); more rows, or no cache, never do."""
  config = qwen2.Qwen2Config.tiny()
  model = qwen2.random_model(config, seed=1)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (3, 5)))  # 15 rows
  cache = _empty_cache(model, 3)
  plain = qwen2.StepPlan(attention_impl="xla")
  call = lambda t, c, plan=None: model(t, cache=c, attention_impl=None if plan else "xla", plan=plan)[0]
  with jax.default_matmul_precision("highest"):  # XLA's fp32 dots on a GPU default to TF32
    skinny, apart = call(ids, cache), call(ids, cache, plain)
    without_cache = model(ids, attention_impl="xla")
  np.testing.assert_allclose(np.asarray(skinny), np.asarray(apart), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(without_cache), np.asarray(apart), rtol=2e-5, atol=2e-5)
  assert "jaxflash_skinny_matmul" in _jaxpr(call, ids, cache)
  assert "pallas_call" not in _jaxpr(lambda t: model(t, attention_impl="xla"), ids)
  wide = jnp.concatenate([ids, ids], axis=1)  # 30 rows: XLA's dots
  assert "skinny" not in _jaxpr(call, wide, _empty_cache(model, 3, 64))


@pytest.mark.parametrize("impl", [None, "xla"], ids=["default", "xla"])
def test_gradient_of_a_small_batch(impl):
  """model(ids) without a cache is a training forward pass: with B * T <= 16 rows it takes
  none of the forward-only decode-step kernels, so jax.grad of a next-token loss works; the
  gradient's derivative along a random direction matches a central difference of the loss."""
  config = qwen2.Qwen2Config.tiny(num_hidden_layers=1)
  model = qwen2.random_model(config, seed=2)
  graphdef, params = nnx.split(model)
  ids = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (2, 6)))  # 12 rows
  forward = _jaxpr(lambda t: model(t, attention_impl=impl), ids)
  for kernel in ("skinny_matmul", "qkv", "add_rms_norm", "kv_cache_write", "split_kv_projection"):
    assert f"jaxflash_{kernel}" not in forward

  def loss(params):
    logits = nnx.merge(graphdef, params)(ids, attention_impl=impl)  # [B, T, vocab]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

  grads = jax.grad(loss)(params)
  leaves = jax.tree.leaves(grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  keys = iter(jax.random.split(jax.random.key(0), len(leaves)))
  direction = jax.tree.map(lambda g: jax.random.normal(next(keys), g.shape, g.dtype), grads)
  norm = np.sqrt(sum(float(jnp.vdot(d, d)) for d in jax.tree.leaves(direction)))
  direction = jax.tree.map(lambda d: d / norm, direction)  # a unit step over all parameters
  along = sum(float(jnp.vdot(g, d)) for g, d in zip(leaves, jax.tree.leaves(direction)))
  eps = 1e-2
  step = lambda sign: jax.tree.map(lambda p, d: p + sign * eps * d, params, direction)
  central = (float(loss(step(1))) - float(loss(step(-1)))) / (2 * eps)
  np.testing.assert_allclose(along, central, rtol=2e-2, atol=1e-3)


def test_projections_route_weights_by_shape(monkeypatch):
  """Weights sharing x run in ONE skinny launch, with their biases; a weight over
  SKINNY_MAX_WEIGHT elements stays an XLA dot unless tall (K >= 4 N: a down projection) or
  wide (N >= 4 K: gate and up, with narrow column blocks)."""
  from jaxflash.fused import configs as fused_configs
  from models.qwen2 import linear
  rngs = nnx.Rngs(0)
  q = nnx.Linear(32, 16, use_bias=True, bias_init=nnx.initializers.normal(1.0), rngs=rngs)
  k = nnx.Linear(32, 8, use_bias=True, bias_init=nnx.initializers.normal(1.0), rngs=rngs)
  big = nnx.Linear(32, 24, use_bias=False, rngs=rngs)
  tall = nnx.Linear(128, 32, use_bias=False, rngs=rngs)  # 4096 elements, K = 4 N
  wide = nnx.Linear(32, 128, use_bias=False, rngs=rngs)  # N = 4 K
  monkeypatch.setattr(fused_configs, "SKINNY_MAX_WEIGHT", 32 * 16)
  plan = qwen2.StepPlan(skinny=True)
  launches = lambda layers, x: _jaxpr(lambda x: linear.project(layers, x, plan, "column"), x).count("pallas_call")
  x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 2, 32)), jnp.float32)
  assert launches((q, k), x) == 1
  assert launches((big,), x) == 0
  assert launches((tall,), jnp.zeros((1, 2, 128))) == 1
  assert launches((wide,), x) == 1 and linear.skinny_config((wide.kernel[...],)) == fused_configs.WIDE_CONFIG
  assert _jaxpr(lambda x: linear.project((q, k), x, qwen2.StepPlan(), "column"), x).count("pallas_call") == 0
  with jax.default_matmul_precision("highest"):
    for out, layer in zip(linear.project((q, k), x, plan, "column"), (q, k)):
      np.testing.assert_allclose(np.asarray(out), np.asarray(layer(x)), rtol=1e-5, atol=1e-5)


def test_token_ids_out_of_range_raise():
  model = qwen2.random_model(qwen2.Qwen2Config.tiny(), seed=0)
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
    model(jnp.asarray([[1, 256]]))
  with pytest.raises(ValueError, match="token ids"):
    model(jnp.asarray([[-1, 2]]))


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_chunked_prefill_matches_one_shot(kind):
  """A prompt written through the cache in chunks (positions after the cached tokens, each
  chunk attending to the cache and to itself, bottom-right causal) gives the logits and the
  greedy continuation of the prompt in one call; rows of different lengths included."""
  config = qwen2.Qwen2Config.tiny(num_hidden_layers=1)
  model = qwen2.random_model(config, seed=3)
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(0, config.vocab_size, (2, 11)), jnp.int32)
  lengths = jnp.asarray([11, 7], jnp.int32)
  want = np.asarray(model(ids, lengths=lengths, attention_impl="xla"))

  def prefill(chunks, impl):
    cache, pieces = _empty_cache(model, 2, 32, kind), []
    for start, stop in chunks:
      chunk_lengths = jnp.clip(lengths - start, 0, stop - start)
      logits, cache = model(ids[:, start:stop], cache=cache, lengths=chunk_lengths, attention_impl=impl)
      pieces.append(np.asarray(logits))
    return np.concatenate(pieces, axis=1), cache

  def continuation(chunks, impl, steps=3):
    """Greedy tokens [steps][B] after prefilling the prompt in `chunks`."""
    _, cache = prefill(chunks, impl)
    token = jnp.argmax(jnp.asarray(want)[jnp.arange(2), lengths - 1], axis=-1)[:, None]
    tokens = []
    for _ in range(steps):
      logits, cache = model(token.astype(jnp.int32), cache=cache, attention_impl=impl)
      token = jnp.argmax(logits[:, -1], axis=-1)[:, None]
      tokens.append(np.asarray(token[:, 0]).tolist())
    return tokens

  # jaxflash's plain-JAX path over several chunkings (row 1 gets no new token in the last
  # chunk of the second), then the kernels (prefill, then decode) over three chunks.
  cases = [("xla", [(0, 11)]), ("xla", [(0, 8), (8, 11)]), ("xla", [(0, 3), (3, 5), (5, 11)]),
           (None, [(0, 3), (3, 5), (5, 11)])]
  for impl, chunks in cases:
    got, cache = prefill(chunks, impl)
    assert np.asarray(cache.lengths).tolist() == [11, 7]
    for row, n in enumerate(np.asarray(lengths)):
      np.testing.assert_allclose(got[row, :n], want[row, :n], rtol=2e-5, atol=2e-5,
                                 err_msg=f"{impl} {chunks} row {row}")
  one_shot = continuation([(0, 11)], "xla")
  assert continuation([(0, 3), (3, 5), (5, 11)], "xla") == one_shot
  assert continuation([(0, 3), (3, 5), (5, 11)], None, steps=2) == one_shot[:2]


# ----------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def checkpoint():
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from tests import qwen2_fixtures
  return qwen2_fixtures.hf_checkpoint(tied=True)[0]


@pytest.fixture(scope="module")
def model(checkpoint):
  return qwen2.from_pretrained(checkpoint)


def _rewrite_checkpoint(source: str, target: str, edit) -> str:
  """Copies a single-file checkpoint with edit(tensors) applied to its tensors."""
  from safetensors.numpy import load_file, save_file
  os.makedirs(target, exist_ok=True)
  shutil.copy(os.path.join(source, "config.json"), target)
  tensors = load_file(os.path.join(source, "model.safetensors"))
  edit(tensors)
  save_file(tensors, os.path.join(target, "model.safetensors"))
  return target


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
     r"missing 1 parameter\(s\): model\.layers\.1\.self_attn\.k_proj\.bias"),
    (lambda t: t.update({"model.layers.0.self_attn.rotary_bias": np.zeros(3, np.float32)}),
     r"unexpected 1 tensor\(s\): model\.layers\.0\.self_attn\.rotary_bias"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((64, 64), np.float32)}),
     r"model\.layers\.0\.mlp\.up_proj\.weight: checkpoint \(64, 64\), model expects \(128, 64\)"),
], ids=["missing", "unexpected", "misshaped"])
def test_loader_names_the_bad_tensor(checkpoint, tmp_path, edit, message):
  broken = _rewrite_checkpoint(checkpoint, str(tmp_path / "broken"), edit)
  with pytest.raises(qwen2.CheckpointError, match=message):
    qwen2.from_pretrained(broken)


def test_loader_needs_safetensors(tmp_path, checkpoint):
  shutil.copy(os.path.join(checkpoint, "config.json"), tmp_path)
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    qwen2.from_pretrained(tmp_path)


def test_sharded_checkpoint(checkpoint, model, tmp_path):
  """A checkpoint split over several files (model.safetensors.index.json) loads the same."""
  from transformers import Qwen2ForCausalLM
  sharded = str(tmp_path / "sharded")
  Qwen2ForCausalLM.from_pretrained(checkpoint).save_pretrained(sharded, max_shard_size="40KB")
  files = os.listdir(sharded)
  assert "model.safetensors.index.json" in files
  assert sum(f.endswith(".safetensors") for f in files) > 1
  loaded = qwen2.from_pretrained(sharded)
  for a, b in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dtype_by_name_or_dtype(checkpoint):
  by_name = qwen2.from_pretrained(checkpoint, dtype="bfloat16")
  by_dtype = qwen2.from_pretrained(checkpoint, dtype=jnp.bfloat16, param_dtype="float32")
  assert by_name.embedder.embedding.dtype == jnp.bfloat16 and by_name.dtype == jnp.bfloat16
  assert by_dtype.embedder.embedding.dtype == jnp.float32 and by_dtype.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="dtype"):
    qwen2.from_pretrained(checkpoint, dtype="int8")


# ----------------------------------------------------------------------------- sampling

def test_sample_logits_rules():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 64)
  greedy = jnp.argmax(logits, axis=-1)
  draw = lambda params: jax.vmap(lambda k: sample_logits(logits, k, params))(keys)  # [64, 4]
  np.testing.assert_array_equal(sample_logits(logits, keys[0], SamplingParams()), greedy)
  np.testing.assert_array_equal(draw(SamplingParams(1.0, top_k=1)), np.broadcast_to(greedy, (64, 4)))
  np.testing.assert_array_equal(draw(SamplingParams(1.0, top_p=1e-6)), np.broadcast_to(greedy, (64, 4)))
  top3 = np.asarray(jax.lax.top_k(logits, 3)[1])
  drawn = np.asarray(draw(SamplingParams(2.0, top_k=3)))
  for row in range(4):
    assert set(drawn[:, row]) <= set(top3[row]) and len(set(drawn[:, row])) > 1
  # Reproducible: the same key draws the same tokens.
  nucleus = SamplingParams(1.5, top_p=0.9)
  np.testing.assert_array_equal(draw(nucleus), draw(nucleus))
  with pytest.raises(ValueError):
    SamplingParams(temperature=-1.0)


def _prompts():
  from tests import qwen2_fixtures
  return qwen2_fixtures.prompts((4, 13), seed=5)


def test_sampling_top_k_1_is_greedy_and_seeded(model):
  prompts = _prompts()
  run = lambda **kw: qwen2.generate(model, prompts, NEW_TOKENS, attention_impl="xla", **kw)
  greedy = run()
  assert run(temperature=0.7, top_k=1, seed=3) == greedy
  sampled = run(temperature=1.5, seed=11)
  assert run(temperature=1.5, seed=11) == sampled
  assert any(run(temperature=1.5, seed=s) != sampled for s in (12, 13))


# ----------------------------------------------------------------------------- EOS, pages, streaming

def test_eos_stops_each_sequence_and_is_included(model):
  prompts = _prompts()
  full = qwen2.generate(model, prompts, NEW_TOKENS, attention_impl="xla", cache="contiguous")
  eos = full[0][2]
  expected = [seq[:seq.index(eos) + 1] if eos in seq else seq for seq in full]
  assert len(expected[0]) <= 3
  for cache in ("contiguous", "paged"):
    got = qwen2.generate(model, prompts, NEW_TOKENS, eos_token_id=eos, attention_impl="xla",
                         cache=cache, page_size=8)
    assert got == expected, cache


def _donated_outputs(hlo: str) -> int:
  """How many outputs of a compiled program reuse an input's buffer (its alias table)."""
  aliased = hlo.split("input_output_alias={", 1)[1].split("\n", 1)[0]
  return aliased.count("may-alias") + aliased.count("must-alias")


def _cache_sized_copies(hlo: str, cache_array) -> list[str]:
  """The compiled program's copy instructions whose result has one layer cache's shape."""
  shape = f"[{','.join(map(str, cache_array.shape))}]"
  return [l for l in hlo.splitlines()
          if " copy(" in l and shape in l.split("=", 1)[1].split("(", 1)[0]]


def _prefilled(sampler, eos):
  """A LoopState after prefilling two prompts (lengths 3 and 2) into a fresh cache."""
  return sampler.prefill(jnp.asarray([[5, 6, 7], [8, 9, 0]], jnp.int32), jnp.asarray([3, 2], jnp.int32),
                         sampler.make_cache(2, 32), jax.random.key(0), eos, SamplingParams())


def test_decode_step_returns_its_inputs_buffers(model):
  """The decode step donates everything it returns (its LoopState: tokens, done, cache,
  workspace, key): every output reuses its input's buffer, so the step's CUDA graph keeps
  its addresses (sampler.py)."""
  sampler = qwen2.Sampler(model, cache="contiguous", attention_impl="xla")
  eos = jnp.asarray([-1], jnp.int32)
  state = _prefilled(sampler, eos)
  assert isinstance(state, qwen2.LoopState)
  chex.assert_shape((state.tokens, state.done), (2,))
  before = jax.tree.leaves(state)
  after = sampler.decode(state, eos, SamplingParams())
  assert all(x.is_deleted() for x in before)  # donated
  compiled = sampler.steps.decode.lower(sampler.params, after, eos, sampling=SamplingParams(),
                                        attention_impl=sampler.attention_impl).compile()
  assert _donated_outputs(compiled.as_text()) == len(jax.tree.leaves(after))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.7), SamplingParams(0.7, top_k=5)],
                         ids=lambda p: p.mode)
def test_decode_steps_branch_on_no_device_value(model, sampling):
  """XLA:GPU runs a `lax.cond` or a data-dependent while loop by copying its predicate to
  the host and waiting, which makes a dispatch synchronous: the generate loop's steps hold
  neither (the sampling mode is static, the multi-step loop a scan of a fixed count), and
  only the filtered mode ranks the vocabulary."""
  from tests.jaxprs import HOST_SYNCING, primitives_outside_kernels
  sampler = qwen2.Sampler(model, cache="paged", page_size=8, attention_impl="xla")
  eos = jnp.asarray([-1], jnp.int32)
  state = _prefilled(sampler, eos)
  settings = dict(sampling=sampling.as_arrays(), attention_impl="xla")
  traced = [sampler.steps.decode.trace(sampler.params, state, eos, **settings),
            sampler.steps.decode_steps.trace(sampler.params, state, jnp.zeros((3, 2), jnp.int32),
                                             jnp.int32(2), eos, **settings)]
  for names in (primitives_outside_kernels(t.jaxpr.jaxpr) for t in traced):
    assert not names & HOST_SYNCING, names & HOST_SYNCING
    assert ("sort" in names) == (sampling.mode == "filtered"), names


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_several_steps_per_call_give_the_single_step_tokens(model, cache):
  """The generate loop runs `steps_per_call` decode steps per dispatch. Six new tokens with
  four steps a call: a full call, then one live step and three that must change nothing;
  with an EOS, a sequence stops inside a call and the others go on."""
  prompts = _prompts()
  run = lambda k, **kw: qwen2.Sampler(model, cache=cache, page_size=8, attention_impl="xla",
                                      steps_per_call=k)(prompts, NEW_TOKENS, **kw)
  single = run(1, eos_token_id=())
  assert single.decode_steps == NEW_TOKENS - 1
  for k in (4, 8):
    several = run(k, eos_token_id=())
    assert several.tokens == single.tokens and several.decode_steps == NEW_TOKENS - 1, k
  eos = single.tokens[0][2]  # sequence 0 stops at its third token, in the first call
  stopped = run(1, eos_token_id=eos).tokens
  assert stopped[0] == single.tokens[0][:3] and run(4, eos_token_id=eos).tokens == stopped


def test_multi_step_call_donates_its_outputs_and_copies_no_cache(model):
  """Like the single step: every output of a multi-step call reuses its input's buffer
  (the LoopState and the history), and the loop over steps updates the cache in place.
  The one-launch q/k/v kernel leaves the workspace's counters zero, ready for the next call."""
  sampler = qwen2.Sampler(model, cache="contiguous", attention_impl="xla", steps_per_call=3)
  eos = jnp.asarray([-1], jnp.int32)
  state = _prefilled(sampler, eos)
  history = jnp.full((3, 2), -1, jnp.int32)
  before = jax.tree.leaves((state, history))
  state, history = sampler.decode_steps(state, history, 2, eos, SamplingParams())
  assert all(x.is_deleted() for x in before)  # donated
  chex.assert_shape(history, (3, 2))
  assert (np.asarray(history)[2] == 0).all()  # the third step was not live: no tokens
  assert np.asarray(state.cache.lengths).tolist() == [5, 4]  # two tokens written, not three
  chex.assert_shape(state.workspace.qkv_counters, (qwen2.plan.COUNTER_SLOTS,))
  assert not np.asarray(state.workspace.qkv_counters).any()
  compiled = sampler.steps.decode_steps.lower(
      sampler.params, state, history, jnp.int32(3), eos, sampling=SamplingParams(),
      attention_impl="xla").compile().as_text()
  assert _donated_outputs(compiled) == len(jax.tree.leaves((state, history)))
  assert not _cache_sized_copies(compiled, state.cache.layer(0).keys)


def _decode_plan(model, cache_kind, batch, impl=None, **changes):
  """The default plan of a decode step of `batch` rows, with `changes` (an A/B run's)."""
  plan = qwen2.StepPlan.build(model, (batch, 1), _empty_cache(model, batch, 32, cache_kind), impl)
  return dataclasses.replace(plan, **changes)


@pytest.mark.parametrize("writer", ["qkv", "kernel"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_cache_write_kernel_matches_the_scatter(model, cache, writer):
  """Decode steps write new keys/values with a kernel (jaxflash.qkv_projection's by default,
  or jaxflash.kv_cache_write where the q/k/v products are not fused): the same tokens as
  XLA's scatter, and the compiled step copies no cache-sized buffer (written in place)."""
  prompts = _prompts()
  apart = dict(fused_qkv=False, cache_write="kernel", qkv_counters=False)
  plan = _decode_plan(model, cache, 2, "xla", **({} if writer == "qkv" else apart))
  scatter = dataclasses.replace(plan, cache_write="scatter", qkv_counters=False)
  sampler = lambda plan: qwen2.Sampler(model, cache=cache, page_size=8, attention_impl="xla", plan=plan)
  assert sampler(plan)(prompts, NEW_TOKENS).tokens == sampler(scatter)(prompts, NEW_TOKENS).tokens
  sampler = sampler(plan)
  eos = jnp.asarray([-1], jnp.int32)
  state = _prefilled(sampler, eos)
  step = lambda *args: sampler.steps.decode(*args, sampling=SamplingParams(), attention_impl="xla",
                                             plan=plan)
  jaxpr = _jaxpr(step, sampler.params, state, eos)
  name = "jaxflash_qkv_projection" if writer == "qkv" else "jaxflash_kv_cache_write"
  assert name in jaxpr and "scatter" not in jaxpr
  compiled = sampler.steps.decode.lower(sampler.params, state, eos, sampling=SamplingParams(),
                                        attention_impl="xla", plan=plan).compile().as_text()
  copies = _cache_sized_copies(compiled, state.cache.layer(0).keys)
  assert not copies, copies


def test_fused_qkv_matches_the_separate_steps(model):
  """Steps with a cache and at most 16 rows take jaxflash.qkv_projection for the
  pre-attention RMSNorm, q/k/v, biases and RoPE: the same logits as those steps apart (a
  plan without the fusion), the same generated tokens; more rows never take it."""
  ids = jnp.asarray(np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 7)))  # 14 rows
  cache = _empty_cache(model, 2)
  apart = dataclasses.replace(qwen2.StepPlan.build(model, ids.shape, cache), fused_qkv=False)
  call = lambda t, c, plan=None: model(t, cache=c, plan=plan)[0]
  assert "jaxflash_qkv_projection" in _jaxpr(call, ids, cache)
  assert "jaxflash_qkv" not in _jaxpr(functools.partial(call, plan=apart), ids, cache)
  wide = jnp.concatenate([ids, ids, ids], axis=1)  # 42 rows
  assert "jaxflash_qkv" not in _jaxpr(call, wide, _empty_cache(model, 2, 64))
  prompts = _prompts()
  decode_apart = _decode_plan(model, "paged", 2, "xla", fused_qkv=False, cache_write="kernel",
                              qkv_counters=False)
  run = lambda plan: qwen2.Sampler(model, cache="paged", page_size=8, attention_impl="xla",
                                   plan=plan)(prompts, NEW_TOKENS).tokens
  with jax.default_matmul_precision("highest"):  # XLA's fp32 dots on a GPU default to TF32
    fused_logits, apart_logits = call(ids, cache), call(ids, cache, apart)
    assert run(None) == run(decode_apart)
  np.testing.assert_allclose(np.asarray(fused_logits), np.asarray(apart_logits), rtol=2e-5, atol=2e-5)


def test_residual_norm_kernel_keeps_the_logits(model):
  """The residual add + RMSNorm kernel after the output projection (jaxflash.add_rms_norm):
  the same logits as XLA's add and norm, and only in steps with a cache of <= 16 rows."""
  ids = jnp.asarray(np.random.default_rng(4).integers(0, model.config.vocab_size, (2, 5)))  # 10 rows
  cache = _empty_cache(model, 2)
  plan = qwen2.StepPlan.build(model, ids.shape, cache)
  off = dataclasses.replace(plan, residual_norm=False)
  call = lambda t, c, plan=None: model(t, cache=c, plan=plan)[0]
  wide = _jaxpr(call, jnp.concatenate([ids, ids], axis=1), cache)  # 20 rows: XLA everywhere
  assert "skinny" not in wide and "add_rms_norm" not in wide
  assert "jaxflash_add_rms_norm" in _jaxpr(call, ids, cache)
  assert "jaxflash_add_rms_norm" not in _jaxpr(functools.partial(call, plan=off), ids, cache)
  with jax.default_matmul_precision("highest"):  # XLA's fp32 dots on a GPU default to TF32
    on, apart = call(ids, cache), call(ids, cache, off)
  np.testing.assert_allclose(np.asarray(on), np.asarray(apart), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_decode_step_merges_attention_in_the_output_projection(model, cache_kind):
  """On jaxflash's kernels a batch-1 decode step hands attention's split-KV chunks to
  jaxflash.project_split_kv (merge and output projection in one kernel), then to
  add_rms_norm; a batch of 2 keeps the merge kernel and the skinny product. Either way, the
  same tokens as the separate merge, product, add and norm."""
  prompts = _prompts()

  def step_jaxpr(batch, plan=None):
    cache = _empty_cache(model, batch, 32, cache_kind)
    return _jaxpr(lambda t, c: model(t, cache=c, plan=plan), jnp.zeros((batch, 1), jnp.int32), cache)

  one = _decode_plan(model, cache_kind, 1)
  assert one.split_kv and "jaxflash_split_kv_projection" in step_jaxpr(1)
  batch_two = step_jaxpr(2)
  assert "jaxflash_split_kv_projection" not in batch_two and "jaxflash_add_rms_norm" in batch_two
  apart = dataclasses.replace(one, residual_norm=False, split_kv=False)
  assert "jaxflash_split_kv_projection" not in step_jaxpr(1, apart)
  run = lambda plan: qwen2.Sampler(model, cache=cache_kind, page_size=8, plan=plan)(
      prompts[:1], NEW_TOKENS).tokens
  assert run(None) == run(apart)


def _kernel_counts(jaxpr, counts=None) -> collections.Counter:
  """Pallas kernels by name, XLA dots and scatters, over every nested jaxpr (each call counted)."""
  counts = collections.Counter() if counts is None else counts
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      name = eqn.params.get("name_and_src_info", eqn.params.get("name"))  # by JAX version
      counts[str(name).split(" ")[0]] += 1
      continue
    if eqn.primitive.name in ("dot_general", "scatter"):
      counts[eqn.primitive.name] += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _kernel_counts(inner, counts)
  return counts


@pytest.mark.parametrize("preset, batch, kind, kernels", [
    # Batch 1: per layer the one-launch q/k/v with the cache write, split-KV decode merged in
    # the output projection, add_rms_norm, and two skinny products (gate+up wide, down tall).
    ("1.5b", 1, "contiguous", dict(jaxflash_qkv_projection=28, jaxflash_decode=28,
                                   jaxflash_split_kv_projection=28, jaxflash_add_rms_norm=28,
                                   jaxflash_skinny_matmul=56, dot_general=1)),
    # Batch 8: the merge kernel and the skinny o_proj instead of the split-KV projection.
    ("1.5b", 8, "paged", dict(jaxflash_qkv_projection=28, jaxflash_paged_decode=28,
                              jaxflash_decode_combine=28, jaxflash_add_rms_norm=28,
                              jaxflash_skinny_matmul=84, dot_general=1)),
    # More than 16 rows: XLA's dots, the cache-write kernel, the decode kernels.
    ("1.5b", 32, "contiguous", dict(jaxflash_kv_cache_write=28, jaxflash_decode=28,
                                    jaxflash_decode_combine=28, dot_general=197)),
    # 7B's o_proj (3584 x 3584) is XLA's: no add_rms_norm, no split-KV projection.
    ("7b", 1, "paged", dict(jaxflash_qkv_projection=28, jaxflash_paged_decode=28,
                            jaxflash_decode_combine=28, jaxflash_skinny_matmul=56, dot_general=29)),
])
def test_decode_step_kernels_of_the_published_shapes(preset, batch, kind, kernels):
  """The kernels a decode step of Qwen2.5-1.5B / 7B launches (abstract shapes, nothing run):
  the figures of the H200 benchmarks rest on exactly these (bench/studies/profile_step.py)."""
  config = {"1.5b": qwen2.Qwen2Config.qwen2_5_1_5b, "7b": qwen2.Qwen2Config.qwen2_5_7b}[preset]()
  model = nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                       param_dtype=jnp.bfloat16))
  graphdef, state = nnx.split(model)
  cache_type = qwen2.PagedCache if kind == "paged" else qwen2.ContiguousCache
  cache = jax.eval_shape(lambda: cache_type.create(config, batch, 1024, jnp.bfloat16))
  step = lambda state, tokens, cache, lengths: nnx.merge(graphdef, state)(tokens, cache=cache,
                                                                          lengths=lengths)
  closed = jax.make_jaxpr(step)(state, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache,
                                jax.ShapeDtypeStruct((batch,), jnp.int32))
  assert dict(_kernel_counts(closed.jaxpr)) == kernels


def test_finished_sequences_return_their_pages(model):
  """Prompt 0 stops at once (its first token is EOS); prompt 1 can only grow into a third
  page if the allocator hands it prompt 0's page back."""
  prompts = _prompts()  # lengths 4 and 13: one page and two pages of 8
  new_tokens = 10  # prompt 1 reaches position 13 + 9 = 22 > 16: a third page
  full = qwen2.generate(model, prompts, new_tokens, attention_impl="xla", cache="contiguous")
  eos = full[0][0]
  assert eos not in full[1], "pick other prompts: prompt 1 must not stop early"
  sampler = qwen2.Sampler(model, cache="paged", page_size=8, num_pages=3, attention_impl="xla")
  out = sampler(prompts, new_tokens, eos_token_id=eos)
  assert out.tokens == [[eos], full[1]]
  assert sampler.allocator.free_pages == 3  # every page back once all sequences finished
  with pytest.raises(qwen2.OutOfPagesError):
    qwen2.Sampler(model, cache="paged", page_size=8, num_pages=3, attention_impl="xla")(
        prompts, new_tokens)  # without the EOS nobody finishes early: 2 + 3 pages needed


def test_page_allocator():
  allocator = qwen2.PageAllocator(num_pages=4, page_size=8, batch=2, max_pages=3)
  allocator.reserve(0, 9)  # two pages
  allocator.reserve(1, 1)
  assert allocator.block_table.tolist() == [[0, 1, 0], [2, 0, 0]] and allocator.free_pages == 1
  allocator.reserve(0, 16)  # still two pages: nothing new
  assert allocator.free_pages == 1
  allocator.release(0)
  assert allocator.free_pages == 3 and allocator.block_table[0].tolist() == [0, 0, 0]
  allocator.reserve(1, 24)
  assert allocator.block_table[1].tolist() == [2, 0, 1]  # freed pages are reused, lowest first
  with pytest.raises(ValueError, match="block table"):
    allocator.reserve(1, 25)


def test_stream_callback_sees_every_token(model):
  prompts = _prompts()
  seen = []
  got = qwen2.generate(model, prompts, NEW_TOKENS, attention_impl="xla",
                       stream=lambda step: seen.append(list(step)))
  assert len(seen) == NEW_TOKENS and all(len(step) == len(prompts) for step in seen)
  assert [[step[i] for step in seen if step[i] is not None] for i in range(len(prompts))] == got
  # Returning True stops generation.
  stopped = qwen2.generate(model, prompts, NEW_TOKENS, attention_impl="xla",
                           stream=lambda step: len(seen) > 0)
  assert stopped == [seq[:1] for seq in got]


def test_generate_checks_its_arguments(model):
  with pytest.raises(ValueError, match="non-empty"):
    qwen2.generate(model, [[1], []], 2)
  with pytest.raises(ValueError, match="cache"):
    qwen2.generate(model, [[1]], 2, cache="ring")
  with pytest.raises(ValueError, match="attention_impl"):
    qwen2.generate(model, [[1]], 2, attention_impl="flash")
  with pytest.raises(ValueError, match="max_position_embeddings"):
    qwen2.generate(model, [[1]], 10_000)
  with pytest.raises(ValueError, match="steps_per_call"):
    qwen2.generate(model, [[1]], 2, steps_per_call=0)


# ----------------------------------------------------------------------------- the command

def test_generate_command_random_model(capsys):
  from models import generate as command
  assert command.main(["--max-new-tokens", "4", "--prompt", "Hi"]) == 0
  out = capsys.readouterr().out
  assert "RANDOM WEIGHTS" in out and "prefill:" in out and "tokens/s" in out


def test_generate_command_with_checkpoint(checkpoint, tmp_path, capsys):
  from models import generate as command
  from models.tokenizer import byte_tokenizer
  directory = tmp_path / "with_tokenizer"
  shutil.copytree(checkpoint, directory)
  byte_tokenizer().save(str(directory / "tokenizer.json"))  # "abc" encodes to ids 97-99
  assert command.main(["--checkpoint", str(directory), "--prompt", "abc", "--max-new-tokens", "3",
                       "--attention", "xla", "--cache", "contiguous", "--no-stream"]) == 0
  out = capsys.readouterr().out
  assert f"checkpoint {directory}" in out and "decode:" in out


def test_generate_command_user_errors_print_one_line(checkpoint, tmp_path, capsys):
  """A folder that does not exist, a .bin-only checkpoint and an empty prompt: one line on
  stderr, exit status 2, no traceback."""
  from models import generate as command
  from models.tokenizer import byte_tokenizer
  missing = tmp_path / "no_such_folder"
  bin_only = tmp_path / "bin_only"
  bin_only.mkdir()
  shutil.copy(os.path.join(checkpoint, "config.json"), bin_only)
  byte_tokenizer().save(str(bin_only / "tokenizer.json"))
  (bin_only / "pytorch_model.bin").write_bytes(b"")
  cases = [(["--checkpoint", str(missing)], "does not exist"),
           (["--checkpoint", str(bin_only)], "safetensors"),
           (["--prompt", ""], "prompt is empty")]
  for argv, message in cases:
    assert command.main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_generate_command_zero_new_tokens(capsys):
  from models import generate as command
  assert command.main(["--max-new-tokens", "0", "--prompt", "Hi"]) == 0
  out = capsys.readouterr().out
  assert "no new tokens" in out and "decode:" not in out


def test_from_pretrained_expands_home(checkpoint, tmp_path, monkeypatch):
  home = tmp_path / "home"
  shutil.copytree(checkpoint, home / "qwen")
  monkeypatch.setenv("HOME", str(home))
  model = qwen2.from_pretrained("~/qwen")
  assert model.config.vocab_size == qwen2.Qwen2Config.from_pretrained(checkpoint).vocab_size
  with pytest.raises(FileNotFoundError, match="does not exist"):
    qwen2.from_pretrained("~/elsewhere")
