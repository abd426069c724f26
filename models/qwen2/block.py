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
    # Fused, a batch-1 decode step's attention hands its chunks to the output projection
    # unmerged (models/qwen2/linear.py, SPLIT_KV_MAX_ROWS).
    split_kv = projector.takes_split_kv(self.attention.o_proj, x, self.pre_mlp_norm)
    heads, kv = self.attention.attend(x, rope, lengths, kv, norm=self.pre_attention_norm,
                                      attention_impl=attention_impl, projector=projector,
                                      split_kv=split_kv)
    with jax.named_scope("output_projection"):  # x + o_proj(heads), and the MLP's input
      x, normed = projector.add_norm(self.attention.o_proj, heads, x, self.pre_mlp_norm, "row")
    x = x + self.mlp(normed, projector=projector)
    return x, kv
