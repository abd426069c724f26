"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), no biases."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen2.initializers import dense_init
from models.qwen2.linear import project
from models.qwen2.plan import StepPlan


class MLP(nnx.Module):
  """x [B, T, hidden] -> [B, T, hidden] through `intermediate_size` gated units."""

  def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs,
               dtype=jnp.float32, param_dtype=jnp.float32):
    dense = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, kernel_init=dense_init, rngs=rngs)
    self.gate_proj = nnx.Linear(hidden_size, intermediate_size, **dense)
    self.up_proj = nnx.Linear(hidden_size, intermediate_size, **dense)
    self.down_proj = nnx.Linear(intermediate_size, hidden_size, **dense)

  def __call__(self, x: jax.Array, *, plan: StepPlan = StepPlan()) -> jax.Array:
    with jax.named_scope("mlp"):
      gate, up = project((self.gate_proj, self.up_proj), x, plan, "column")  # one launch when skinny
      hidden = jax.nn.silu(gate) * up
      return project((self.down_proj,), hidden, plan, "row")[0]
