"""The Qwen2 causal language model: embedding, decoder layers, final norm, LM head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen2.block import DecoderLayer
from models.qwen2.cache import KVCache
from models.qwen2.config import ATTENTION_IMPLS, Qwen2Config
from models.qwen2.initializers import dense_init, embed_init
from models.qwen2.linear import Projector
from models.qwen2.norm import RMSNorm
from models.qwen2.rope import rope_frequencies

_UNSET = "unset"


class Qwen2ForCausalLM(nnx.Module):
  """Token ids [B, T] -> logits [B, T, vocab] (and an updated KV cache when given one).

  `dtype` is the computation dtype, `param_dtype` the storage dtype of the weights.
  `attention_impl` (from the config, changeable per call): None = jaxflash kernels,
  "xla" = jaxflash's plain-JAX path, "cudnn" = jax.nn's cuDNN attention.
  """

  # Set by `models.qwen2.shard_model` (a TensorParallel: mesh and axes) on a model split
  # over devices, so that its caches are made split to match; None on one device.
  tensor_parallel = None
  # Decode steps (at most 16 rows) multiply by the weights through jaxflash.skinny_matmul
  # (models/qwen2/linear.py; on a split model, each device its own shard); False: XLA's
  # dots everywhere.
  skinny_decode = True
  # Decode steps write each layer's new keys and values with a kernel, in place (in the
  # fused q/k/v kernel below, else jaxflash.kv_cache_write) instead of XLA's scatter (four
  # small kernels). A split model keeps the scatter, which XLA partitions; False: the
  # scatter everywhere.
  cache_write_kernel = True
  # With skinny_decode on one device: the pre-attention RMSNorm, the q/k/v products, their
  # biases, RoPE and the cache write in jaxflash.qkv_projection instead of seven kernels;
  # False: apart.
  fused_qkv = True
  # With fused_qkv: qkv_projection in one launch (the product's last K chunk program
  # finishes each head) where the head dim divides its column blocks; False: two launches.
  one_launch_qkv = True
  # With skinny_decode: the MLP's gate and up products (wide weights) through the skinny
  # kernel too, with narrow column blocks (models/qwen2/linear.py); False: XLA's GEMM.
  skinny_wide = True
  # With skinny_decode on one device: the output projection's partial sums, the residual add
  # and the RMSNorm before the MLP in one kernel after the product (jaxflash.add_rms_norm)
  # instead of XLA's two; False: apart.
  fused_residual_norm = True

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    self.config = config
    self.dtype = dtype
    self.attention_impl = config.attention_impl
    self.embedder = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                              param_dtype=param_dtype, embedding_init=embed_init, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                            for _ in range(config.num_hidden_layers)])
    self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                              param_dtype=param_dtype)
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                                param_dtype=param_dtype, kernel_init=dense_init, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               cache: KVCache | None = None, *, lengths: jax.Array | None = None,
               attention_impl=_UNSET):
    """tokens [B, T] int -> logits [B, T, vocab] without a cache, (logits, cache) with one.

    positions [B, T]: default 0..T-1 after the tokens already cached. lengths [B]: the
    valid tokens of each right-padded row (default T); padding is neither attended to nor
    written to the cache. With a cache, row b's new tokens go after the cache.lengths[b]
    tokens it holds and attend to them (T > 1: a prompt, or a chunk of one; T == 1: a decode
    step); lengths 0 marks an idle row: nothing is written for it.
    """
    hidden, cache = self.hidden_states(tokens, positions, cache, lengths=lengths,
                                       attention_impl=attention_impl)
    logits = self.logits(hidden)
    return logits if cache is None else (logits, cache)

  def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                    cache: KVCache | None = None, *, lengths: jax.Array | None = None,
                    attention_impl=_UNSET) -> tuple[jax.Array, KVCache | None]:
    """As `__call__` but stops before the LM head: -> (hidden [B, T, hidden], cache)."""
    impl = self.attention_impl if attention_impl == _UNSET else attention_impl
    if impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    batch, steps = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
      if cache is not None:
        positions = positions + cache.lengths[:, None]
    if lengths is not None:
      lengths = jnp.asarray(lengths, jnp.int32)
    with jax.named_scope("embed"):
      x = self.embedder(tokens)  # [B, T, hidden]
      rope = rope_frequencies(positions, self.config.head_dim, self.config.rope_theta)
    projector = Projector(self.skinny_decode, self.tensor_parallel, self.fused_qkv, self.skinny_wide,
                          self.fused_residual_norm, self.one_launch_qkv)
    write_kernel = self.cache_write_kernel and self.tensor_parallel is None
    layer_caches, counters = [], None
    for index, layer in enumerate(self.layers):
      with jax.named_scope(f"layer_{index}"):
        kv = None if cache is None else cache.layer(index, write_kernel=write_kernel, counters=counters)
        x, kv = layer(x, rope, lengths, kv, attention_impl=impl, projector=projector)
        layer_caches.append(kv)
        # The fused q/k/v kernel's counters go on to the next layer (models/qwen2/cache.py).
        counters = None if kv is None else kv.counters
    with jax.named_scope("final_norm"):
      x = self.final_norm(x)
    if cache is not None:
      new_lengths = jnp.full((batch,), steps, jnp.int32) if lengths is None else lengths
      cache = cache.update(layer_caches, new_lengths)
    return x, cache

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., hidden_size] -> logits [..., vocab] (in the computation dtype)."""
    with jax.named_scope("lm_head"):
      if self.config.tie_word_embeddings:
        return self.embedder.attend(hidden)
      return self.lm_head(hidden)
