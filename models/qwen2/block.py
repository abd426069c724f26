"""One Qwen2 decoder layer: pre-norm attention and pre-norm SwiGLU, each with a residual."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen2.attention import Attention
from models.qwen2.cache import LayerKV
from models.qwen2.config import Qwen2Config
from models.qwen2.linear import Projector
from models.qwen2.mlp import MLP
from models.qwen2.norm import RMSNorm


class DecoderLayer(nnx.Module):
  """x [B, T, hidden] -> x + attention(norm(x)), then + mlp(norm(.))."""

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    kinds = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.pre_attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kinds)
    self.attention = Attention(config.hidden_size, config.num_attention_heads,
                               config.num_key_value_heads, config.head_dim,
                               rope_theta=config.rope_theta, **kinds)
    self.pre_mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kinds)
    self.mlp = MLP(config.hidden_size, config.intermediate_size, **kinds)

  def __call__(self, x: jax.Array, rope, lengths, kv: LayerKV | None = None, *,
               attention_impl: str | None = None, projector: Projector = Projector()
               ) -> tuple[jax.Array, LayerKV | None]:
    attended, kv = self.attention(x, rope, lengths, kv, norm=self.pre_attention_norm,
                                  attention_impl=attention_impl, projector=projector)
    x = x + attended
    x = x + self.mlp(self.pre_mlp_norm(x), projector=projector)
    return x, kv
