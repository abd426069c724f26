"""models.qwen2 beyond parity: config mapping, checkpoint loading and its errors, sampling,
EOS stopping, the page allocator, streaming, and the `python -m models.generate` command.

Generation here runs attention through jaxflash's plain-JAX path ("xla") unless the
kernels are the point: they are interpreted on a CPU, and tests/test_qwen2_parity.py
already runs them end to end against transformers.
"""
from __future__ import annotations

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
    ({"use_sliding_window": True}, NotImplementedError),
    ({"num_key_value_heads": 3}, ValueError),
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


def test_skinny_projections_match_xla_dots():
  """Decode-sized inputs (<= 16 rows) go through jaxflash.skinny_matmul: same logits as
  XLA's dots, and larger inputs never do (the kernel refuses more than 16 rows)."""
  config = qwen2.Qwen2Config.tiny()
  model = qwen2.random_model(config, seed=1)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (3, 5)))  # 15 rows
  with jax.default_matmul_precision("highest"):  # XLA's fp32 dots on a GPU default to TF32
    skinny = model(ids, attention_impl="xla")
    model.skinny_decode = False
    plain = model(ids, attention_impl="xla")
  np.testing.assert_allclose(np.asarray(skinny), np.asarray(plain), rtol=2e-5, atol=2e-5)
  model.skinny_decode = True
  assert "jaxflash_skinny_matmul" in str(jax.make_jaxpr(lambda t: model(t, attention_impl="xla"))(ids))
  wide = jnp.concatenate([ids, ids], axis=1)  # 30 rows: XLA's dots
  assert "skinny" not in str(jax.make_jaxpr(lambda t: model(t, attention_impl="xla"))(wide))


def skinny_calls_of(fn, x) -> int:
  return str(jax.make_jaxpr(fn)(x)).count("pallas_call")


def test_projector_routes_small_weights_to_one_skinny_launch(monkeypatch):
  """q/k/v-like weights sharing x run in ONE skinny launch, with their biases; a weight over
  SKINNY_MAX_WEIGHT elements, unless it is tall (K >= 4 N: a down projection), or more
  than 16 rows, stays an XLA dot."""
  from models.qwen2 import linear as linear_module
  rngs = nnx.Rngs(0)
  q = nnx.Linear(32, 16, use_bias=True, bias_init=nnx.initializers.normal(1.0), rngs=rngs)
  k = nnx.Linear(32, 8, use_bias=True, bias_init=nnx.initializers.normal(1.0), rngs=rngs)
  big = nnx.Linear(32, 24, use_bias=False, rngs=rngs)
  tall = nnx.Linear(128, 32, use_bias=False, rngs=rngs)  # 4096 elements, K = 4 N
  wide = nnx.Linear(32, 128, use_bias=False, rngs=rngs)  # N = 4 K: skinny only with `wide`
  monkeypatch.setattr(linear_module, "SKINNY_MAX_WEIGHT", 32 * 16)
  projector = linear_module.Projector(skinny=True)
  assert skinny_calls_of(lambda x: projector(wide, x, "column"), jnp.zeros((1, 32))) == 0
  wide_projector = linear_module.Projector(skinny=True, wide=True)
  assert skinny_calls_of(lambda x: wide_projector(wide, x, "column"), jnp.zeros((1, 32))) == 1
  assert linear_module._config((wide.kernel[...],)) == linear_module.WIDE_CONFIG
  x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 2, 32)), jnp.float32)

  assert skinny_calls_of(lambda x: projector.many((q, k), x, "column"), x) == 1
  assert skinny_calls_of(lambda x: projector(big, x, "row"), x) == 0
  assert skinny_calls_of(lambda x: projector(tall, x, "row"), jnp.zeros((1, 2, 128))) == 1
  assert skinny_calls_of(lambda x: projector.many((q, k), x, "column"), jnp.zeros((17, 32))) == 0
  with jax.default_matmul_precision("highest"):
    for out, layer in zip(projector.many((q, k), x, "column"), (q, k)):
      np.testing.assert_allclose(np.asarray(out), np.asarray(layer(x)), rtol=1e-5, atol=1e-5)


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


def test_decode_step_returns_its_inputs_buffers(model):
  """The decode step donates everything it returns (tokens, done, cache, key): every output
  reuses its input's buffer, so the step's CUDA graph keeps its addresses (sampler.py)."""
  sampler = qwen2.Sampler(model, cache="contiguous", attention_impl="xla")
  cache = sampler.make_cache(2, 32)
  eos = jnp.asarray([-1], jnp.int32)
  tokens = jnp.asarray([[5, 6, 7], [8, 9, 0]], jnp.int32)
  state = sampler.prefill(tokens, jnp.asarray([3, 2], jnp.int32), cache, jax.random.key(0), eos,
                          SamplingParams())
  before = jax.tree.leaves(state)
  after = jax.tree.leaves(sampler.decode(*state, eos, SamplingParams()))
  assert all(x.is_deleted() for x in before)  # donated
  compiled = sampler.steps.decode.lower(sampler.params, *jax.tree.unflatten(
      jax.tree.structure(state), after), eos, sampling=SamplingParams(),
      attention_impl=sampler.attention_impl).compile()
  assert _donated_outputs(compiled.as_text()) == len(after)


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
  (tokens, done, cache, key, history), and the loop over steps updates the cache in place.
  The one-launch q/k/v kernel leaves the cache's counters zero, ready for the next call."""
  sampler = qwen2.Sampler(model, cache="contiguous", attention_impl="xla", steps_per_call=3)
  eos = jnp.asarray([-1], jnp.int32)
  state = sampler.prefill(jnp.asarray([[5, 6, 7], [8, 9, 0]], jnp.int32),
                          jnp.asarray([3, 2], jnp.int32), sampler.make_cache(2, 32),
                          jax.random.key(0), eos, SamplingParams())
  history = jnp.full((3, 2), -1, jnp.int32)
  before = jax.tree.leaves((state, history))
  after = sampler.decode_steps(*state, history, 2, eos, SamplingParams())
  assert all(x.is_deleted() for x in before)  # donated
  chex.assert_shape(after[4], (3, 2))
  assert (np.asarray(after[4])[2] == 0).all()  # the third step was not live: no tokens
  assert np.asarray(after[2].lengths).tolist() == [5, 4]  # two tokens written, not three
  chex.assert_shape(after[2].counters, (qwen2.cache.COUNTER_SLOTS,))
  assert not np.asarray(after[2].counters).any()
  compiled = sampler.steps.decode_steps.lower(
      sampler.params, *after, jnp.int32(3), eos, sampling=SamplingParams(),
      attention_impl=sampler.attention_impl).compile().as_text()
  assert _donated_outputs(compiled) == len(jax.tree.leaves(after))
  assert not _cache_sized_copies(compiled, after[2].layer(0).keys)


@pytest.mark.parametrize("fused_qkv", [True, False], ids=["in_qkv_projection", "kv_cache_write"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_cache_write_kernel_matches_the_scatter(model, cache, fused_qkv):
  """Decode steps write new keys/values with a kernel (jaxflash.qkv_projection's, or
  jaxflash.kv_cache_write without the fused q/k/v): the same tokens as XLA's
  scatter, and the compiled step copies no cache-sized buffer (written in place)."""
  prompts = _prompts()
  run = lambda: qwen2.generate(model, prompts, NEW_TOKENS, attention_impl="xla", cache=cache,
                               page_size=8)
  model.fused_qkv = fused_qkv
  try:
    with_kernel = run()
    model.cache_write_kernel = False
    try:
      assert run() == with_kernel
    finally:
      model.cache_write_kernel = True
    sampler = qwen2.Sampler(model, cache=cache, attention_impl="xla", page_size=8)
    kv = sampler.make_cache(2, 32)
    eos = jnp.asarray([-1], jnp.int32)
    state = sampler.prefill(jnp.asarray([[5, 6, 7], [8, 9, 0]], jnp.int32), jnp.asarray([3, 2], jnp.int32),
                            kv, jax.random.key(0), eos, SamplingParams())
    step = lambda *args: sampler.steps.decode(*args, sampling=SamplingParams(),
                                               attention_impl=sampler.attention_impl)
    jaxpr = str(jax.make_jaxpr(step)(sampler.params, *state, eos))
    writer = "jaxflash_qkv_projection" if fused_qkv else "jaxflash_kv_cache_write"
    assert writer in jaxpr and "scatter" not in jaxpr
    lowered = sampler.steps.decode.lower(sampler.params, *state, eos, sampling=SamplingParams(),
                                         attention_impl=sampler.attention_impl)
  finally:
    model.fused_qkv = True
  copies = _cache_sized_copies(lowered.compile().as_text(), kv.layer(0).keys)
  assert not copies, copies


@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "two_launches"])
def test_fused_qkv_matches_the_separate_steps(model, one_launch):
  """Decode-sized inputs (<= 16 rows) take jaxflash.qkv_projection for the pre-attention
  RMSNorm, q/k/v, biases and RoPE (one kernel, or two with one_launch_qkv off): the same
  logits as those steps apart, the same generated tokens, and larger inputs never take it."""
  ids = jnp.asarray(np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 7)))  # 14 rows
  call = lambda t: model(t, attention_impl="xla")
  kernel = "jaxflash_qkv_projection" if one_launch else "jaxflash_qkv_finish"
  model.one_launch_qkv = one_launch
  try:
    assert kernel in str(jax.make_jaxpr(call)(ids))
    wide = jnp.concatenate([ids, ids, ids], axis=1)  # 42 rows
    assert "jaxflash_qkv" not in str(jax.make_jaxpr(call)(wide))
    prompts = _prompts()
    run = lambda: qwen2.generate(model, prompts, NEW_TOKENS, attention_impl="xla", cache="paged", page_size=8)
    with jax.default_matmul_precision("highest"):  # XLA's fp32 dots on a GPU default to TF32
      fused_logits, fused_tokens = call(ids), run()
      model.fused_qkv = False
      try:
        assert "jaxflash_qkv" not in str(jax.make_jaxpr(call)(ids))
        apart_logits, apart_tokens = call(ids), run()
      finally:
        model.fused_qkv = True
  finally:
    model.one_launch_qkv = True
  np.testing.assert_allclose(np.asarray(fused_logits), np.asarray(apart_logits), rtol=2e-5, atol=2e-5)
  assert fused_tokens == apart_tokens


@pytest.mark.parametrize("switch", ["fused_residual_norm", "skinny_wide"])
def test_decode_step_switches_keep_the_logits(model, switch, monkeypatch):
  """The residual add + RMSNorm kernel after the output projection, and the MLP's gate and up
  (wide weights) through the skinny kernel: the same logits as without them, and only for
  decode-sized inputs."""
  from models.qwen2 import linear as linear_module
  # The tiny model's gate and up (64 x 128) are small and only 2x wide: with these limits
  # only `skinny_wide` sends them to the kernel (the down projection, 128 x 64, counts as
  # tall and takes it either way).
  monkeypatch.setattr(linear_module, "SKINNY_MAX_WEIGHT", 64 * 64)
  monkeypatch.setattr(linear_module, "SKINNY_MIN_ASPECT", 2)
  ids = jnp.asarray(np.random.default_rng(4).integers(0, model.config.vocab_size, (2, 5)))  # 10 rows
  call = lambda t: model(t, attention_impl="xla")
  jaxpr = lambda t: str(jax.make_jaxpr(lambda u: call(u))(t))  # a fresh function: traced anew
  wide = jaxpr(jnp.concatenate([ids, ids], axis=1))  # 20 rows: XLA everywhere
  assert "skinny" not in wide and "add_rms_norm" not in wide
  with jax.default_matmul_precision("highest"):  # XLA's fp32 dots on a GPU default to TF32
    on, text_on = call(ids), jaxpr(ids)
    setattr(model, switch, False)
    try:
      off, text_off = call(ids), jaxpr(ids)
    finally:
      setattr(model, switch, True)
  if switch == "fused_residual_norm":
    assert "jaxflash_add_rms_norm" in text_on and "jaxflash_add_rms_norm" not in text_off
  else:  # gate and up leave XLA's dots for one more kernel (printed once for all layers)
    assert text_on.count("pallas_call") == text_off.count("pallas_call") + 1
  np.testing.assert_allclose(np.asarray(on), np.asarray(off), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_decode_step_merges_attention_in_the_output_projection(model, cache_kind):
  """On jaxflash's kernels a batch-1 decode step hands attention's split-KV chunks to
  jaxflash.project_split_kv (merge and output projection in one kernel), then to
  add_rms_norm; a batch of 2 keeps the merge kernel and the skinny product. Either way, the
  same tokens as the separate merge, product, add and norm."""
  prompts = _prompts()
  sampler = qwen2.Sampler(model, cache=cache_kind, page_size=8)

  def step_jaxpr(batch):
    cache = sampler.make_cache(batch, 32)
    return str(jax.make_jaxpr(lambda t, c: model(t, cache=c))(jnp.zeros((batch, 1), jnp.int32), cache))

  run = lambda: [qwen2.generate(model, p, NEW_TOKENS, cache=cache_kind, page_size=8)
                 for p in (prompts[:1], prompts)]
  assert "jaxflash_split_kv_projection" in step_jaxpr(1)
  batch_two = step_jaxpr(2)
  assert "jaxflash_split_kv_projection" not in batch_two and "jaxflash_add_rms_norm" in batch_two
  fused = run()
  model.fused_residual_norm = False
  try:
    assert "jaxflash_split_kv_projection" not in step_jaxpr(1)
    apart = run()
  finally:
    model.fused_residual_norm = True
  assert fused == apart


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
