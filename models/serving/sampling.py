"""Per-row sampling for a batch of unrelated requests: each row has its own temperature,
top-k, top-p and PRNG stream (models.qwen2.sampling's settings are static, one per batch)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.qwen2.sampling import nucleus_mask


def row_keys(seeds: jax.Array, token_index: jax.Array) -> jax.Array:
  """seeds [R] uint32, token_index [R] int32 -> one PRNG key per row: the request's stream
  `jax.random.key(seed)` folded with the index of the token being drawn, so a token depends
  on neither the batch it runs in nor on how often its sequence was recomputed."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, token_index)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array, *, sampled: bool) -> jax.Array:
  """logits [R, V]; keys [R]; temperature [R] (0: greedy), top_k [R] int (0: all),
  top_p [R] (1: all) -> token ids [R] int32, the cut `nucleus_mask`'s, as in
  models.qwen2.sample_logits.

  sampled (static): whether any row may have temperature > 0; False traces the argmax
  alone. The host knows it from its sampling table, so the choice is made there: a
  `lax.cond` on the device would make XLA copy the predicate to the host and wait for it,
  which turns the whole asynchronous dispatch into a synchronous one."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if not sampled:
    return greedy
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  drawn = jax.vmap(jax.random.categorical)(keys, nucleus_mask(scaled, top_k, top_p)).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)
