"""One Qwen2 decoder layer: pre-norm attention and pre-norm SwiGLU, each with a residual."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen2.attention import Attention
from models.qwen2.cache import LayerKV
from models.qwen2.config import Qwen2Config
from models.qwen2.mlp import MLP
from models.qwen2.norm import RMSNorm, add_and_norm
from models.qwen2.plan import DecodeWorkspace, StepPlan


class DecoderLayer(nnx.Module):
  """x [B, T, hidden] -> h = x + attention(norm(x)), then h + mlp(norm(h)). `sliding_window`:
  the layer's attention window (`Qwen2Config.layer_window`; None: every earlier key)."""

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32, sliding_window: int | None = None):
    kinds = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.pre_attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kinds)
    self.attention = Attention(config.hidden_size, config.num_attention_heads,
                               config.num_key_value_heads, config.head_dim,
                               sliding_window=sliding_window, **kinds)
    self.pre_mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kinds)
    self.mlp = MLP(config.hidden_size, config.intermediate_size, **kinds)

  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], lengths: jax.Array | None,
               kv: LayerKV | None, *, plan: StepPlan, workspace: DecodeWorkspace | None = None,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, LayerKV | None, DecodeWorkspace | None]:
    """x [B, T, hidden] -> (x [B, T, hidden], kv, workspace); `plan` says which kernels run;
    segment_ids [B, T]: packed documents (attention stays inside each)."""
    out, kv, workspace = self.attention(x, self.pre_attention_norm, rope, lengths, kv, plan=plan,
                                        workspace=workspace, segment_ids=segment_ids)
    with jax.named_scope("output_projection"):
      x, normed = add_and_norm(x, out, self.pre_mlp_norm, fused=plan.residual_norm)
    x = x + self.mlp(normed, plan=plan)
    return x, kv, workspace
