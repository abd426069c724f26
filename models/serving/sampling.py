"""Per-row sampling for a batch of unrelated requests: each row has its own temperature,
top-k, top-p and PRNG stream (models.qwen2.sampling's settings are static, one per batch)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seeds: jax.Array, token_index: jax.Array) -> jax.Array:
  """seeds [R] uint32, token_index [R] int32 -> one PRNG key per row: the request's stream
  `jax.random.key(seed)` folded with the index of the token being drawn, so a token depends
  on neither the batch it runs in nor on how often its sequence was recomputed."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, token_index)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array, *, sampled: bool) -> jax.Array:
  """logits [R, V]; keys [R]; temperature [R] (0: greedy), top_k [R] int (0: all),
  top_p [R] (1: all) -> token ids [R] int32. Top-k and top-p keep the smallest set of best
  tokens as models.qwen2.sample_logits does (ties at the cut stay in).

  sampled (static): whether any row may have temperature > 0; False traces the argmax
  alone. The host knows it from its sampling table, so the choice is made there: a
  `lax.cond` on the device would make XLA copy the predicate to the host and wait for it,
  which turns the whole asynchronous dispatch into a synchronous one."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if not sampled:
    return greedy
  vocab = logits.shape[-1]
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  ranked = -jnp.sort(-scaled, axis=-1)  # [R, V] best first
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)  # [R, 1]
  ranked = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ranked, -jnp.inf)
  probs = jax.nn.softmax(ranked, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  kept = jnp.sum(mass_before < top_p[:, None], axis=-1)  # >= 1: the best token stays
  cut = jnp.take_along_axis(ranked, (kept - 1)[:, None], axis=-1)  # [R, 1]
  masked = jnp.where(scaled >= jnp.maximum(kth, cut), scaled, -jnp.inf)
  drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)
