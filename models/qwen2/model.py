"""The Qwen2 causal language model: embedding, decoder layers, final norm, LM head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxflash
from models.qwen2.block import DecoderLayer
from models.qwen2.cache import KVCache
from models.qwen2.config import Qwen2Config
from models.qwen2.initializers import dense_init, embed_init
from models.qwen2.norm import RMSNorm
from models.qwen2.plan import DecodeWorkspace, StepPlan
from models.qwen2.rope import rope_frequencies


def document_positions(segment_ids: jax.Array) -> jax.Array:
  """segment_ids [B, T] -> positions [B, T] int32 counting from 0 at each document's first
  token (wherever the id differs from the token before)."""
  steps = segment_ids.shape[1]
  index = jnp.arange(steps, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)  # [B, T]
  first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # the document's first index
  return index - first


class Qwen2ForCausalLM(nnx.Module):
  """Token ids [B, T] -> logits [B, T, vocab] (and an updated KV cache when given one).

  `dtype` is the computation dtype, `param_dtype` the storage dtype of the weights.
  `tensor_parallel` is set by `models.qwen2.shard_model` on a model split over devices (a
  TensorParallel: mesh and axes), so that its caches are made split to match; None on one
  device.
  """

  tensor_parallel = None

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    self.config = config
    self.dtype = dtype
    self.embedder = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                              param_dtype=param_dtype, embedding_init=embed_init, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                         sliding_window=window)
                            for window in config.layer_windows])
    self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                              param_dtype=param_dtype)
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                                param_dtype=param_dtype, kernel_init=dense_init, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               cache: KVCache | None = None, *, lengths: jax.Array | None = None,
               attention_impl: str | None = None, plan: StepPlan | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
    """tokens [B, T] int -> logits [B, T, vocab] without a cache, (logits, cache) with one.

    positions [B, T]: default 0..T-1 after the tokens already cached. lengths [B]: the
    valid tokens of each right-padded row (default T); padding is neither attended to nor
    written to the cache. With a cache, the T new tokens of row b go after its
    cache.lengths[b] cached ones and attend to those and to themselves (causal; on a layer
    with a sliding window W, to the last W of them only: `Qwen2Config`): T == 1 is a
    decode step, T > 1 a prompt or a chunk of one (lengths 0 marks a finished row: nothing
    is written for it). segment_ids [B, T] int: packed documents (training rows holding
    several texts; no cache): a token attends only to earlier tokens of its own document,
    and positions default to restarting at 0 where the id changes. Calls with a cache run
    the forward-only decode-step kernels when they have at most 16 token rows (models/qwen2/plan.py); differentiate calls without one.

    attention_impl: `jaxflash.attention`'s `implementation` (one of jaxflash.IMPLEMENTATIONS;
    None: the best kernel). plan: how the call runs (default `StepPlan.build`: for A/B runs).
    Token ids must lie in [0, vocab): checked where `tokens` is concrete; under jit it cannot
    be, and an id out of range gives meaningless logits. T may not exceed the config's
    max_position_embeddings (ValueError); positions after a cache's tokens are data and are
    not checked.
    """
    hidden, cache, _ = self.hidden_states(tokens, positions, cache, lengths=lengths,
                                          attention_impl=attention_impl, plan=plan,
                                          segment_ids=segment_ids)
    logits = self.logits(hidden)
    return logits if cache is None else (logits, cache)

  def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                    cache: KVCache | None = None, *, lengths: jax.Array | None = None,
                    attention_impl: str | None = None, plan: StepPlan | None = None,
                    workspace: DecodeWorkspace | None = None, segment_ids: jax.Array | None = None
                    ) -> tuple[jax.Array, KVCache | None, DecodeWorkspace | None]:
    """As `__call__` but stops before the LM head: -> (hidden [B, T, hidden], cache,
    workspace). `workspace`: the decode loop's scratch (models/qwen2/plan.py), passed from
    step to step (default: a fresh one when the plan needs it)."""
    if attention_impl not in jaxflash.IMPLEMENTATIONS:
      raise ValueError(f"attention_impl must be one of {jaxflash.IMPLEMENTATIONS}, got {attention_impl!r}")
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [B, T] token ids, got shape {tuple(tokens.shape)}")
    self._check_token_ids(tokens)
    batch, steps = tokens.shape
    if steps > self.config.max_position_embeddings:
      raise ValueError(f"tokens {tuple(tokens.shape)} hold T = {steps} positions, more than the model's "
                       f"max_position_embeddings ({self.config.max_position_embeddings})")
    if plan is None:
      plan = StepPlan.build(self, tokens.shape, cache, attention_impl)
    elif attention_impl is not None and attention_impl != plan.attention_impl:
      raise ValueError(f"attention_impl={attention_impl!r} differs from the given plan's "
                       f"{plan.attention_impl!r}: leave it None with a plan")
    elif plan.cache_write != "scatter" and (cache is None or steps != 1):
      raise ValueError(f"plan.cache_write={plan.cache_write!r} is for decode steps (a cache and one "
                       f"token a row), got tokens {tuple(tokens.shape)}"
                       + (" and no cache" if cache is None else ""))
    if plan.qkv_counters and workspace is None:
      workspace = DecodeWorkspace.create()
    if segment_ids is not None:
      if cache is not None:
        raise ValueError("segment_ids (packed documents) are for calls without a cache")
      if tuple(segment_ids.shape) != (batch, steps):
        raise ValueError(f"segment_ids must have the tokens' shape {(batch, steps)}, got "
                         f"{tuple(segment_ids.shape)}")
      if positions is None:
        positions = document_positions(segment_ids)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
      if cache is not None:
        positions = positions + cache.lengths[:, None]
    if lengths is not None:
      lengths = jnp.asarray(lengths, jnp.int32)
    with jax.named_scope("embed"):
      x = self.embedder(tokens)  # [B, T, hidden]
      rope = rope_frequencies(positions, self.config.head_dim, self.config.rope_theta)
    layer_caches = []
    for index, layer in enumerate(self.layers):
      with jax.named_scope(f"layer_{index}"):
        kv = None if cache is None else cache.layer(index)
        x, kv, workspace = layer(x, rope, lengths, kv, plan=plan, workspace=workspace,
                                 segment_ids=segment_ids)
        layer_caches.append(kv)
    with jax.named_scope("final_norm"):
      x = self.final_norm(x)
    if cache is not None:
      new_lengths = jnp.full((batch,), steps, jnp.int32) if lengths is None else lengths
      cache = cache.update(layer_caches, new_lengths)
    return x, cache, workspace

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., hidden_size] -> logits [..., vocab] (in the computation dtype)."""
    with jax.named_scope("lm_head"):
      if self.config.tie_word_embeddings:
        return self.embedder.attend(hidden)
      return self.lm_head(hidden)

  def _check_token_ids(self, tokens) -> None:
    """ValueError for ids outside [0, vocab) where `tokens` is concrete (not under a trace)."""
    if isinstance(tokens, jax.core.Tracer):
      return
    ids = np.asarray(tokens)
    if not np.issubdtype(ids.dtype, np.integer):
      raise TypeError(f"tokens must be integer ids, got {ids.dtype}")
    vocab = self.config.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
      raise ValueError(f"token ids must lie in [0, {vocab}) (vocab_size), got ids from {ids.min()} "
                       f"to {ids.max()}")
