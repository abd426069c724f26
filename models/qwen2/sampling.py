"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings, checked when made. temperature 0 is greedy (argmax); top_k None
  (or 0 once traced) keeps every token, top_p None (or 1) makes no nucleus cut.

  A pytree whose leaves are the three values and whose static part is the `mode`
  (greedy, plain sampling, or sampling with a top-k / top-p cut): a new temperature, top_k
  or top_p never recompiles (`as_arrays` makes the device copies once); a new mode traces
  its own step. The mode is chosen on the host rather than with a `lax.cond` on the device,
  which XLA:GPU runs by copying the predicate to the host and waiting: the step would be
  synchronous, and the host could not prepare the next one while the GPU runs this one."""

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
  def mode(self) -> str:
    """"greedy", "plain" (temperature only) or "filtered" (a top-k or top-p cut too)."""
    if "_mode" in self.__dict__:  # values traced or on the device: the mode they were made with
      return self.__dict__["_mode"]
    if self.temperature == 0.0:
      return "greedy"
    return "filtered" if self.top_k is not None or self.top_p not in (None, 1.0) else "plain"

  def values(self) -> tuple:
    """(temperature, top_k, top_p) with the defaults as numbers: top_k 0, top_p 1."""
    return (self.temperature, 0 if self.top_k is None else self.top_k,
            1.0 if self.top_p is None else self.top_p)

  def as_arrays(self) -> SamplingParams:
    """The same settings as float32 / int32 / float32 device scalars."""
    temperature, top_k, top_p = self.values()
    return _unchecked(self.mode, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                      jnp.asarray(top_p, jnp.float32))


def _unchecked(mode, temperature, top_k, top_p) -> SamplingParams:
  """A SamplingParams of (possibly traced) scalars, its mode given: tracers cannot be checked."""
  params = object.__new__(SamplingParams)
  for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                      ("_mode", mode)):
    object.__setattr__(params, name, value)
  return params


jax.tree_util.register_pytree_node(SamplingParams, lambda p: (p.values(), p.mode),
                                   lambda mode, leaves: _unchecked(mode, *leaves))


def sample_logits(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """logits [B, V] -> token ids [B] int32. params' values may be traced; its mode is static."""
  temperature, top_k, top_p = params.values()
  logits = logits.astype(jnp.float32)
  if params.mode == "greedy":
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / temperature
  if params.mode == "plain":
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
  rows = logits.shape[0]
  masked = nucleus_mask(scaled, jnp.broadcast_to(top_k, (rows,)), jnp.broadcast_to(top_p, (rows,)))
  return jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)


def nucleus_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """scaled [R, V] (logits over temperature), top_k [R] int (0: all), top_p [R] (1: all) ->
  scaled with every token outside the row's cut at -inf: its top k tokens, then the
  smallest prefix of them, best first, whose probability reaches top_p (a token stays while
  the mass before it is short of top_p, so the best token always stays; ties at the cut
  stay in)."""
  vocab = scaled.shape[-1]
  ranked = -jnp.sort(-scaled, axis=-1)  # [R, V] best first
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)  # [R, 1]
  ranked = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ranked, -jnp.inf)
  probs = jax.nn.softmax(ranked, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  kept = jnp.sum(mass_before < top_p[:, None], axis=-1)  # >= 1
  cut = jnp.take_along_axis(ranked, (kept - 1)[:, None], axis=-1)  # [R, 1]
  return jnp.where(scaled >= jnp.maximum(kth, cut), scaled, -jnp.inf)
