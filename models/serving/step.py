"""The engine's jitted step, and the small device updates around it.

One step is ONE jitted call over a fixed number of slots (a paged KV cache of `max_slots`
rows): the model runs once over up to `prefill_lanes` rows of prefill chunks [used, T] and once
over every slot's decode token [slots, 1] (lengths 0 for an idle slot: its rows cost the
attention kernels nothing), both writing into the same page pools, then one token is drawn
per row. The output is always [lanes + slots] (a decode-only step leaves the lane rows 0),
so the next step can read its decode inputs from it on the device, without the host.

When no prefill waits, `decode_steps` runs several decode steps in one call instead, each
feeding a slot's own last draw and checking its stop ids on the device: the host's cost
(scheduling, uploads, one dispatch) is paid once for them all.

Neither call branches on device values: XLA:GPU runs a `lax.cond` or a data-dependent
`lax.while_loop` by copying the predicate to the host and waiting for it, which makes the
dispatch synchronous and leaves the GPU idle while the host schedules the next step. So
greedy-only tables trace the argmax alone (`sampled`, static, known from the host's
sampling table), and the multi-step decode runs a fixed count of steps.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.serving.sampling import row_keys, sample_rows
from models.serving.scheduler import PLACEHOLDER


@functools.lru_cache(maxsize=16)
def step_function(graphdef, treedef):
  """(the jitted engine step, the jitted multi-step decode, a one-item list counting their
  traces, i.e. compilations) for models of this structure. The structure is bound once, as
  in models.qwen2.sampler."""
  traces = [0]

  def step(params, cache, workspace, previous_tokens, decode_source, decode_tokens, decode_lengths,
           decode_cached, prefill, sampling, *, sampled, attention_impl):
    """cache: the PagedCache (block table [slots, max_pages], kept on the device) and
    workspace: the decode kernels' scratch (models.qwen2.DecodeWorkspace), both donated.
    previous_tokens [lanes + slots]: the previous dispatch's last token per row; decode_source
    [slots]: the row of it that holds a slot's decode token (-1: decode_tokens' value, from
    the host); decode_* [slots] (lengths 1 for a decoding row, 0 for any other); prefill None
    or (tokens [used, T], lengths [used], cached [used], slots [used]: whose block-table
    row each lane writes), used <= lanes (the other lane rows draw 0); sampling
    [lanes + slots, SAMPLING_COLUMNS] int32: each output row's request settings (see
    `sampling_row`), kept on the device; sampled (static): whether any row's temperature is
    > 0 (False: every row is greedy). -> (tokens [lanes + slots] int32, cache, workspace)."""
    traces[0] += 1
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    lanes = previous_tokens.shape[0] - decode_tokens.shape[0]
    decode_tokens = _decode_inputs(previous_tokens, decode_source, decode_tokens)
    drawn = []
    if prefill is not None:
      tokens, lengths, cached, slots = prefill
      view = dataclasses.replace(cache, block_table=cache.block_table[slots], lengths=cached)  # same pools
      with jax.named_scope("prefill_chunks"):
        hidden, view, workspace = model.hidden_states(tokens, None, view, lengths=lengths,
                                                      attention_impl=attention_impl,
                                                      workspace=workspace)
      used = tokens.shape[0]  # the step's lanes; the others draw nothing
      last = hidden[jnp.arange(used), jnp.maximum(lengths - 1, 0)]  # [used, hidden]
      # A lane draws the token after its chunk.
      drawn.append(_sample(model.logits(last), cached + lengths, sampling[:used], sampled))
      drawn.append(jnp.zeros((lanes - used,), jnp.int32))
      cache = dataclasses.replace(view, block_table=cache.block_table)  # the view's pools and scales
    else:
      drawn.append(jnp.zeros((lanes,), jnp.int32))
    decoded, cache, workspace = _decode(model, cache, workspace, decode_tokens, decode_lengths,
                                        decode_cached, sampling[lanes:], sampled, attention_impl)
    return jnp.concatenate([*drawn, decoded]), cache, workspace

  def decode_steps(params, cache, workspace, previous_tokens, decode_source, decode_tokens,
                   decode_cached, steps, sampling, *, num_steps, sampled, attention_impl):
    """`num_steps` decode steps in one call, each slot's next input its own last draw, as
    jax-llm-examples' serving loop and vLLM's multi-step scheduling run them. steps [slots]:
    the steps slot b may take (0: idle); a slot also stops after drawing one of its stop ids
    (the sampling table's stop columns), so its later steps feed nothing (a step where no
    slot feeds still runs the model's matmuls on idle rows: the count is fixed). Other
    arguments as `step`'s. -> (tokens [num_steps, lanes + slots] int32, PLACEHOLDER (-1)
    where a row drew nothing (the lane rows always), last [lanes + slots]: each row's last
    draw, the next dispatch's previous_tokens; cache, workspace)."""
    traces[0] += 1
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    lanes = previous_tokens.shape[0] - decode_tokens.shape[0]
    slot_sampling = sampling[lanes:]
    stop_ids = slot_sampling[:, SAMPLING_COLUMNS - STOP_COLUMNS:]  # [slots, STOP_COLUMNS], -1 padded

    def one_step(i, carry):
      cache, workspace, tokens, cached, running, out = carry
      active = running & (i < steps)
      drawn, cache, workspace = _decode(model, cache, workspace, tokens, active.astype(jnp.int32),
                                        cached, slot_sampling, sampled, attention_impl)
      out = out.at[i].set(jnp.where(active, drawn, PLACEHOLDER))
      running = active & ~jnp.any(drawn[:, None] == stop_ids, axis=1)
      return cache, workspace, jnp.where(active, drawn, tokens), cached + active, running, out

    tokens = _decode_inputs(previous_tokens, decode_source, decode_tokens)
    out = jnp.full((num_steps, tokens.shape[0]), PLACEHOLDER, jnp.int32)
    cache, workspace, tokens, _, _, out = jax.lax.fori_loop(
        0, num_steps, one_step, (cache, workspace, tokens, decode_cached, steps > 0, out))
    lane_rows = jnp.full((num_steps, lanes), PLACEHOLDER, jnp.int32)
    last = jnp.concatenate([jnp.zeros((lanes,), jnp.int32), tokens])
    return jnp.concatenate([lane_rows, out], axis=1), last, cache, workspace

  donated = ("cache", "workspace")
  return (jax.jit(step, static_argnames=("sampled", "attention_impl"), donate_argnames=donated),
          jax.jit(decode_steps, static_argnames=("num_steps", "sampled", "attention_impl"),
                  donate_argnames=donated),
          traces)


def _decode_inputs(previous_tokens, decode_source, decode_tokens):
  """Each slot's decode token: from the previous dispatch's output on the device where
  decode_source >= 0 (the host does not know it yet), else the host's."""
  return jnp.where(decode_source >= 0, previous_tokens[jnp.maximum(decode_source, 0)], decode_tokens)


def _decode(model, cache, workspace, tokens, lengths, cached, sampling, sampled, attention_impl):
  """One token per slot (tokens [slots]; lengths 1 to feed it, 0 for a slot that feeds
  nothing) after each slot's `cached` ones -> (the token each slot draws [slots], cache,
  workspace)."""
  cache = dataclasses.replace(cache, lengths=cached)
  with jax.named_scope("decode"):
    hidden, cache, workspace = model.hidden_states(tokens[:, None], None, cache, lengths=lengths,
                                                   attention_impl=attention_impl, workspace=workspace)
  return _sample(model.logits(hidden[:, 0]), cached + 1, sampling, sampled), cache, workspace


def _sample(logits, drawn_at, sampling, sampled):
  """logits [R, vocab]; drawn_at [R]: the index in its sequence of the token each row draws;
  sampling [R, SAMPLING_COLUMNS]; sampled: as `step`'s -> tokens [R] int32. The PRNG
  stream is indexed by the token's position after the prompt, so a token depends only on
  its request."""
  bits = lambda column, dtype: jax.lax.bitcast_convert_type(sampling[:, column], dtype)
  index = jnp.maximum(drawn_at - sampling[:, 4], 0)
  with jax.named_scope("sample"):
    return sample_rows(logits, row_keys(bits(0, jnp.uint32), index), bits(1, jnp.float32),
                       sampling[:, 2], bits(3, jnp.float32), sampled=sampled)


STOP_COLUMNS = 8  # stop ids a row's device-side check holds; a request with more decodes singly
SAMPLING_COLUMNS = 5 + STOP_COLUMNS


def sampling_row(seed: int, temperature: float, top_k: int, top_p: float, prompt_len: int,
                 stop_ids=()) -> np.ndarray:
  """One row of the step's sampling table [SAMPLING_COLUMNS] int32: seed (uint32 bits),
  temperature (float32 bits), top_k (0: all), top_p (float32 bits), the prompt's length,
  then up to STOP_COLUMNS stop ids (-1 padded) for the multi-step decode's stop check."""
  stops = sorted(stop_ids)[:STOP_COLUMNS]
  return np.array([np.uint32(seed).view(np.int32), np.float32(temperature).view(np.int32), top_k,
                   np.float32(top_p).view(np.int32), prompt_len,
                   *stops, *[PLACEHOLDER] * (STOP_COLUMNS - len(stops))], np.int32)


IDLE_SAMPLING_ROW = sampling_row(0, 0.0, 0, 1.0, 0)  # greedy, no cut, no stop ids


def any_sampled(table: np.ndarray) -> bool:
  """Whether a sampling table [R, SAMPLING_COLUMNS] has a row with temperature > 0: the
  steps' static `sampled`."""
  return bool((np.ascontiguousarray(table[:, 1]).view(np.float32) > 0).any())


@functools.partial(jax.jit, donate_argnums=0)
def set_rows(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
  """table [R, C] with rows[i] set to values[i] ([n], [n, C]; a repeated row must repeat
  its values): the block table and the sampling table change by the rows that changed, not
  a new copy."""
  return table.at[rows].set(values)
