"""The engine's jitted step, and the small device updates around it.

One step is ONE jitted call over a fixed number of slots (a paged KV cache of `max_slots`
rows): the model runs once over `prefill_lanes` rows of prefill chunks [lanes, T] and once
over every slot's decode token [slots, 1] (lengths 0 for an idle slot: its rows cost the
attention kernels nothing), both writing into the same page pools, then one token is drawn
per row. The output is always [lanes + slots] (a decode-only step leaves the lane rows 0),
so the next step can read its decode inputs from it on the device, without the host.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.serving.sampling import row_keys, sample_rows


@functools.lru_cache(maxsize=16)
def step_function(graphdef, treedef):
  """(the jitted engine step for models of this structure, a one-item list counting its
  traces, i.e. compilations). The structure is bound once, as in models.qwen2.sampler."""
  traces = [0]

  def step(params, cache, workspace, previous_tokens, decode_source, decode_tokens, decode_lengths,
           decode_cached, prefill, sampling, *, attention_impl):
    """cache: the PagedCache (block table [slots, max_pages], kept on the device) and
    workspace: the decode kernels' scratch (models.qwen2.DecodeWorkspace), both donated.
    previous_tokens [lanes + slots]: the previous step's output; decode_source [slots]: the
    row of it that holds a slot's decode token (-1: decode_tokens' value, from the host);
    decode_* [slots] (lengths 1 for a decoding row, 0 for any other); prefill None or
    (tokens [lanes, T], lengths [lanes], cached [lanes], slots [lanes]: whose block-table
    row each lane writes); sampling [lanes + slots, 5] int32: each output row's request
    settings (see `sampling_row`), kept on the device. -> (tokens [lanes + slots] int32,
    cache, workspace)."""
    traces[0] += 1
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    lanes = previous_tokens.shape[0] - decode_tokens.shape[0]
    decode_tokens = jnp.where(decode_source >= 0, previous_tokens[jnp.maximum(decode_source, 0)],
                              decode_tokens)
    logits = []
    if prefill is not None:
      tokens, lengths, cached, slots = prefill
      view = dataclasses.replace(cache, block_table=cache.block_table[slots], lengths=cached)  # same pools
      with jax.named_scope("prefill_chunks"):
        hidden, view, workspace = model.hidden_states(tokens, None, view, lengths=lengths,
                                                      attention_impl=attention_impl,
                                                      workspace=workspace)
      last = hidden[jnp.arange(tokens.shape[0]), jnp.maximum(lengths - 1, 0)]  # [lanes, hidden]
      logits.append(model.logits(last))
      cache = dataclasses.replace(view, block_table=cache.block_table)  # the view's pools and scales
    cache = dataclasses.replace(cache, lengths=decode_cached)
    with jax.named_scope("decode"):
      hidden, cache, workspace = model.hidden_states(
          decode_tokens[:, None], None, cache, lengths=decode_lengths,
          attention_impl=attention_impl, workspace=workspace)
    logits.append(model.logits(hidden[:, 0]))
    logits = jnp.concatenate(logits)  # [rows, vocab]
    # The index of the token a row draws: its position after the prompt (a decode row feeds
    # position `cached` and draws the next; a lane draws after its chunk).
    drawn_at = decode_cached + 1
    if prefill is not None:
      drawn_at = jnp.concatenate([prefill[2] + prefill[1], drawn_at])
    rows = logits.shape[0]
    sampling = sampling[-rows:]
    bits = lambda column, dtype: jax.lax.bitcast_convert_type(sampling[:, column], dtype)
    index = jnp.maximum(drawn_at - sampling[:, 4], 0)
    with jax.named_scope("sample"):
      next_tokens = sample_rows(logits, row_keys(bits(0, jnp.uint32), index), bits(1, jnp.float32),
                                sampling[:, 2], bits(3, jnp.float32))
    next_tokens = jnp.concatenate([jnp.zeros((lanes + decode_tokens.shape[0] - rows,), jnp.int32),
                                   next_tokens])
    return next_tokens, cache, workspace

  jitted = jax.jit(step, static_argnames=("attention_impl",),
                   donate_argnames=("cache", "workspace"))
  return jitted, traces


IDLE_SAMPLING_ROW = np.array([0, 0, 0, np.float32(1.0).view(np.int32), 0], np.int32)  # greedy, no cut


def sampling_row(seed: int, temperature: float, top_k: int, top_p: float, prompt_len: int) -> np.ndarray:
  """One row of the step's sampling table [5] int32: seed (uint32 bits), temperature
  (float32 bits), top_k (0: all), top_p (float32 bits), the prompt's length."""
  return np.array([np.uint32(seed).view(np.int32), np.float32(temperature).view(np.int32), top_k,
                   np.float32(top_p).view(np.int32), prompt_len], np.int32)


@functools.partial(jax.jit, donate_argnums=0)
def set_rows(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
  """table [R, C] with rows[i] set to values[i] ([n], [n, C]; a repeated row must repeat
  its values): the block table and the sampling table change by the rows that changed, not
  a new copy."""
  return table.at[rows].set(values)
