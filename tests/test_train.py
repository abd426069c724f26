"""Training through jaxflash attention: `python -m models.train` lowers the loss, and the
model's gradients with the FlashAttention-2 kernels equal those of jaxflash's plain-JAX path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import qwen2, train
from models.qwen2 import Qwen2Config


def test_a_few_steps_lower_the_loss():
  args = train.parse_args(["--steps", "12", "--batch", "2", "--seq-len", "32", "--log-every", "100"])
  losses = train.train(args, log=lambda _: None)
  assert len(losses) == 12 and all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < losses[0] - 1.0, losses


def test_model_gradients_match_the_xla_path():
  """T = 24 > 16 tokens (prefill kernels), ragged rows: gradients of every weight agree with
  implementation="xla" to float32 rounding."""
  config = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       rope_theta=10_000.0, max_position_embeddings=256, tie_word_embeddings=True)
  model = qwen2.random_model(config, seed=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, 25)), jnp.int32)
  grads = {impl: jax.jit(jax.grad(lambda p, impl=impl: train.cross_entropy(
      nnx.merge(graphdef, p, rest), tokens, impl)))(params) for impl in (None, "xla")}
  flat_kernel, flat_xla = jax.tree.leaves(grads[None]), jax.tree.leaves(grads["xla"])
  assert len(flat_kernel) == len(flat_xla) > 10
  for a, b in zip(flat_kernel, flat_xla):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-6)
    assert np.abs(a - b).max() <= 2e-5 * scale, (np.abs(a - b).max(), scale)

