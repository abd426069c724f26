"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static (hashable) sampling settings. temperature 0 is greedy (argmax)."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k is not None and self.top_k < 1:
      raise ValueError(f"top_k must be >= 1, got {self.top_k}")
    if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def sample_logits(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """logits [B, V] -> token ids [B] int32."""
  logits = logits.astype(jnp.float32)
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / params.temperature
  vocab = logits.shape[-1]
  if params.top_k is not None or params.top_p is not None:
    # Candidates sorted best first: the top k, or the whole vocabulary for top-p alone.
    k = vocab if params.top_k is None else min(params.top_k, vocab)
    candidates, candidate_ids = jax.lax.top_k(logits, k)  # [B, k] each
    if params.top_p is not None:
      probs = jax.nn.softmax(candidates, axis=-1)
      # Keep the smallest prefix whose mass reaches top_p: a token stays when the mass
      # before it is still short of top_p (so the best token always stays).
      mass_before = jnp.cumsum(probs, axis=-1) - probs
      candidates = jnp.where(mass_before < params.top_p, candidates, -jnp.inf)
    choice = jax.random.categorical(key, candidates, axis=-1)  # [B]
    return jnp.take_along_axis(candidate_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
