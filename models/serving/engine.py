"""A continuous-batching engine for models.qwen2: requests come and go at every step.

    engine = Engine(model, max_slots=8)
    handle = engine.submit(prompt_ids, max_new_tokens=64, temperature=0.7, seed=1)
    for token in handle:        # streams; steps the engine while no token is ready
      ...
    engine.run_until_idle()     # or drive every submitted request to the end

Each step is ONE jitted call (models/serving/step.py) over prefill chunks [lanes, T] and
every slot's decode token; T is the step's bucket (a power of two from 16 up to the token
budget) and lanes the chunks it feeds, so a run compiles at most one step per (lanes,
bucket) pair plus the decode-only steps, each twice if some request samples (greedy-only
steps trace no sampler: `Engine.compilations`).
Scheduling, pages, preemption and prefix caching are host-side (models/serving/scheduler.py,
prefix_cache.py, models/qwen2/allocator.py).

The host runs one step ahead of the device, as SGLang's overlap scheduler and vLLM's
asynchronous scheduling do: `step` schedules and dispatches step t+1 while step t runs,
and only then waits for step t's tokens (for streaming and the stop checks). The tokens
step t draws stay on the device, where step t+1 reads its decode inputs; the block table
lives on the device too and changes by the rows the allocator touched. A step without
prefill chunks decodes up to `decode_steps` tokens per sequence in one dispatch, stopping a
sequence on the device at its stop ids; the host books them together (they stream in
bursts of up to `decode_steps`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.qwen2.allocator import PageAllocator
from models.qwen2.cache import PagedCache
from models.qwen2.model import Qwen2ForCausalLM
from models.qwen2.plan import DecodeWorkspace
from models.qwen2.sampler import check_attention_impl
from models.serving.prefix_cache import PrefixCache
from models.serving.request import Request, RequestHandle, make_request
from models.serving.scheduler import PLACEHOLDER, Booking, ScheduledStep, Scheduler, Sequence
from models.serving.step import (IDLE_SAMPLING_ROW, STOP_COLUMNS, any_sampled, sampling_row, set_rows,
                                 step_function)

MIN_BUCKET = 16


def chunk_buckets(largest: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
  """Powers of two from `smallest` (a power of two) up to the first >= largest."""
  top = max(smallest, 1 << (max(largest, 1) - 1).bit_length())
  return tuple(1 << e for e in range(smallest.bit_length() - 1, top.bit_length()))


class Engine:
  """Serves generation requests for `model` with continuous batching.

  max_slots: sequences running at once (rows of the paged cache). page_size, num_pages: the
  pool (default: room for every slot at max_seq_len). max_seq_len: the cache's window per
  sequence (default the model's max_position_embeddings). token_budget: tokens one step
  feeds at most (decodes first, prefill chunks share the rest). prefill_lanes: prefill
  chunks per step. chunked_prefill False: a prompt is fed in one piece. prefix_caching:
  reuse the pages of cached prefixes. min_chunk: the smallest chunk bucket (a power of two;
  larger means fewer compilations, more padding). decode_steps: decode steps per dispatch
  while no prefill runs (1: one step per dispatch). attention_impl and kv_dtype: as for
  models.qwen2.generate (an int8 / FP8 pool holds about twice bf16's tokens in its bytes).
  """

  def __init__(self, model: Qwen2ForCausalLM, *, max_slots: int = 8, page_size: int = 16,
               num_pages: int | None = None, max_seq_len: int | None = None,
               token_budget: int = 512, prefill_lanes: int = 2, chunked_prefill: bool = True,
               prefix_caching: bool = True, min_chunk: int = MIN_BUCKET, decode_steps: int = 4,
               attention_impl: str | None = None, kv_dtype: str | None = None):
    config = model.config
    for name, value in (("max_slots", max_slots), ("token_budget", token_budget),
                        ("prefill_lanes", prefill_lanes), ("decode_steps", decode_steps)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(page_size, int) or page_size < 8 or page_size & (page_size - 1):
      raise ValueError(f"page_size must be a power of two >= 8 (the paged kernels' pages), got {page_size!r}")
    if not isinstance(min_chunk, int) or min_chunk < 1 or min_chunk & (min_chunk - 1):
      raise ValueError(f"min_chunk must be a power of two, got {min_chunk!r}")
    self.config = config
    self.max_seq_len = min(max_seq_len or config.max_position_embeddings, config.max_position_embeddings)
    self.max_slots, self.prefill_lanes, self.page_size = max_slots, prefill_lanes, page_size
    self.attention_impl = check_attention_impl(attention_impl)
    self.cache = PagedCache.create(config, max_slots, self.max_seq_len, model.dtype,
                                   page_size=page_size, num_pages=num_pages, kv_dtype=kv_dtype)
    self.workspace = DecodeWorkspace.create()
    self.max_pages = self.cache.block_table.shape[1]
    self.allocator = PageAllocator(self.cache.num_pages, page_size, max_slots, self.max_pages)
    self.prefix_cache = PrefixCache(self.allocator) if prefix_caching else None
    largest = min(token_budget, self.max_seq_len) if chunked_prefill else self.max_seq_len
    self.scheduler = Scheduler(self.allocator, self.prefix_cache, max_slots=max_slots,
                               token_budget=token_budget, prefill_lanes=prefill_lanes,
                               chunked_prefill=chunked_prefill,
                               buckets=chunk_buckets(largest, min_chunk),
                               max_seq_len=self.max_seq_len, decode_steps=decode_steps,
                               stop_ids_on_device=STOP_COLUMNS)
    graphdef, state = nnx.split(model)
    self.params, treedef = jax.tree.flatten(state)
    self._step, self._decode_steps, self._traces = step_function(graphdef, treedef)
    self.decode_steps = decode_steps
    self._traces_at_start = self._traces[0]
    self._next_id = 0
    self._rows = prefill_lanes + max_slots  # rows of a step's output
    self._previous_tokens = jnp.zeros((self._rows,), jnp.int32)  # the last dispatch's last tokens
    self._in_flight: _InFlight | None = None
    # Each output row's sampling settings, on the device and its host copy.
    self._sampling_host = np.tile(IDLE_SAMPLING_ROW, (self._rows, 1))
    self._sampling = jnp.asarray(self._sampling_host)
    self.scheduler.resolve = self._resolve

  # ----------------------------------------------------------------------------- interface

  def submit(self, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, stop_ids=None,
             arrival: float | None = None) -> RequestHandle:
    """Queues a request; returns its handle at once. Bad requests raise ValueError or
    TypeError here and leave the engine as it was. stop_ids None means the model's EOS
    ids. arrival: its arrival time (time.perf_counter; default now), for TTFT."""
    return self.add(self.check_request(prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p, seed=seed, stop_ids=stop_ids), arrival)

  def check_request(self, prompt, max_new_tokens: int, *, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    stop_ids=None) -> Request:
    """The validated Request (ValueError / TypeError otherwise). It reads only the engine's
    fixed settings, so any thread may call it."""
    request = make_request(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, stop_ids=stop_ids, default_stop_ids=self.config.eos_token_ids,
                           vocab_size=self.config.vocab_size, max_seq_len=self.max_seq_len)
    longest = min(len(request.prompt) + request.max_new_tokens, self.max_seq_len + 1) - 1
    if math.ceil(max(longest, 1) / self.page_size) > self.allocator.num_pages:
      raise ValueError(f"a request of {len(request.prompt)} prompt + {request.max_new_tokens} new "
                       f"tokens needs more than the pool's {self.allocator.num_pages} pages of "
                       f"{self.page_size} tokens")
    return request

  def add(self, request: Request, arrival: float | None = None) -> RequestHandle:
    """Queues a request made by `check_request`; its handle."""
    handle = RequestHandle(self._next_id, request, self.step, arrival)
    self._next_id += 1
    if request.max_new_tokens == 0:
      handle.finish_reason = "length"
    else:
      self.scheduler.add(Sequence(handle, list(request.prompt)))
    return handle

  def cancel(self, handle: RequestHandle) -> None:
    """Ends a request now (finish_reason "cancelled"): its slot and pages are freed."""
    self.scheduler.cancel(handle)

  @property
  def idle(self) -> bool:
    return not self.scheduler.has_work() and self._in_flight is None

  def run_until_idle(self) -> None:
    while self.step():
      pass

  @property
  def compilations(self) -> int:
    """Step compilations (traces) since this engine was made; an engine made later for a
    model of the same structure reuses them."""
    return self._traces[0] - self._traces_at_start

  @property
  def stats(self) -> dict:
    return {**self.scheduler.stats, "compilations": self.compilations, "pool_tokens": self.cache.tokens,
            "pool_bytes": self.cache.nbytes, "kv_dtype": str(self.cache.dtype)}

  def warm_up(self, sampling: bool = True) -> None:
    """Compiles the step for every chunk bucket and lane count, the decode-only steps and
    the table updates now, on inputs that change nothing, so that serving never waits for a
    compilation. sampling False compiles the greedy steps only (for a deployment whose
    requests never sample). The steps are traced one by one and compiled together on a
    thread each (XLA compiles without holding the interpreter lock), then run once."""
    calls = [call for sampled in (False, True)[:1 + sampling] for call in self._warm_up_calls(sampled)]
    lowered = [function.lower(*arguments(), **settings) for function, arguments, settings in calls]
    with concurrent.futures.ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1)) as pool:
      list(pool.map(lambda step: step.compile(), lowered))
    for function, arguments, settings in calls:  # compiled: each call finds its executable
      *_, self.cache, self.workspace = function(*arguments(), **settings)
    # An update compiles once per power-of-two count of rows (`_set_rows_padded`): each
    # count here, its rows set to the values the host holds for them.
    for rows in _row_counts(self._rows):
      self._sampling = _set_rows_padded(self._sampling, rows, self._sampling_host)
    for rows in _row_counts(self.max_slots):
      self.cache = dataclasses.replace(self.cache, block_table=_set_rows_padded(
          self.cache.block_table, rows, self.allocator.block_table))
    self._sampling.block_until_ready()

  def _warm_up_calls(self, sampled: bool) -> list:
    """(jitted function, its arguments made from the engine's state now, its static
    settings) for each step shape the scheduler can run: no slot feeds, no lane writes."""
    slots, zeros = self.max_slots, functools.partial(np.zeros, dtype=np.int32)
    settings = dict(sampled=sampled, attention_impl=self.attention_impl)
    idle = lambda: (self.params, self.cache, self.workspace, self._previous_tokens,
                    jnp.full((slots,), -1, jnp.int32), *(jnp.asarray(zeros((slots,))) for _ in range(3)))

    def step(lanes, bucket):
      prefill = None if not bucket else tuple(jnp.asarray(x) for x in (
          zeros((lanes, bucket)), zeros((lanes,)), zeros((lanes,)), zeros((lanes,))))
      return self._step, lambda: (*idle(), prefill, self._sampling), settings

    calls = [step(0, 0)] + [step(lanes, bucket) for bucket in self.scheduler.buckets
                            for lanes in range(1, self.scheduler.lanes_at(bucket) + 1)]
    if self.decode_steps > 1:
      calls.append((self._decode_steps, lambda: (*idle(), self._sampling),
                    dict(settings, num_steps=self.decode_steps)))
    return calls

  # ----------------------------------------------------------------------------- one step

  def step(self) -> bool:
    """Schedules and dispatches one step, then books the tokens of the step before it (the
    host learns a step's tokens one step late). False when there was nothing to do."""
    scheduled = self.scheduler.schedule()
    previous = self._in_flight
    self._in_flight = None
    if scheduled is not None:
      tokens = self._dispatch(scheduled, previous)
      self._in_flight = _InFlight(tokens, self.scheduler.book(scheduled, self.prefill_lanes, self._rows))
    if previous is None:
      return scheduled is not None
    self.scheduler.complete(previous.bookings, previous.values(), time.perf_counter())
    return True

  def _resolve(self) -> None:
    """Fills in the placeholders of the step in flight (waits for it)."""
    if self._in_flight is not None:
      self.scheduler.fill(self._in_flight.bookings, self._in_flight.values())

  def _dispatch(self, scheduled: ScheduledStep, previous: "_InFlight | None"):
    slots, lanes = self.max_slots, self.prefill_lanes
    # A sequence's last booking in the step in flight: its row of that step's last tokens.
    previous_row = {id(seq): row % self._rows for seq, _, row in previous.bookings} if previous else {}
    decode_tokens = np.zeros((slots,), np.int32)
    decode_source = np.full((slots,), -1, np.int32)
    slot_steps = np.zeros((slots,), np.int32)  # decode tokens each slot feeds (0: none)
    decode_cached = np.zeros((slots,), np.int32)
    for seq, steps in zip(scheduled.decodes, scheduled.decode_steps):
      token = seq.tokens[seq.cached]
      if token == PLACEHOLDER:  # drawn by the step in flight: read on the device
        decode_source[seq.slot] = previous_row[id(seq)]
      else:
        decode_tokens[seq.slot] = token
      slot_steps[seq.slot] = steps
      decode_cached[seq.slot] = seq.cached
    prefill = None
    if scheduled.prefills:
      used = len(scheduled.prefills)  # lanes this step computes (the rest draw nothing)
      tokens = np.zeros((used, scheduled.chunk_bucket), np.int32)
      lengths, cached, lane_slots = (np.zeros((used,), np.int32) for _ in range(3))
      for lane, (seq, chunk) in enumerate(scheduled.prefills):
        tokens[lane, :chunk] = seq.tokens[seq.cached:seq.cached + chunk]
        lengths[lane], cached[lane], lane_slots[lane] = chunk, seq.cached, seq.slot
      prefill = tuple(jnp.asarray(x) for x in (tokens, lengths, cached, lane_slots))
    # One sampling row per output row: the prefill lanes, then the slots; idle rows: greedy.
    rows = [s for s, _ in scheduled.prefills] + [None] * (lanes - len(scheduled.prefills))
    sampling = np.tile(IDLE_SAMPLING_ROW, (self._rows, 1))
    for r, seq in enumerate(rows + list(self.scheduler.slots)):
      if seq is not None:
        if seq.sampling_row is None:
          request = seq.handle.request
          seq.sampling_row = sampling_row(request.seed, request.temperature, request.top_k,
                                          request.top_p, len(request.prompt), request.stop_ids)
        sampling[r] = seq.sampling_row
    self._sampling = self._update_rows(self._sampling, self._sampling_host, sampling)
    self._sampling_host = sampling
    self._upload_block_table_rows()
    decode_inputs = (self.params, self.cache, self.workspace, self._previous_tokens,
                     jnp.asarray(decode_source), jnp.asarray(decode_tokens))
    settings = dict(sampled=any_sampled(sampling), attention_impl=self.attention_impl)
    if max(scheduled.decode_steps, default=1) > 1:
      tokens, self._previous_tokens, self.cache, self.workspace = self._decode_steps(
          *decode_inputs, jnp.asarray(decode_cached), jnp.asarray(slot_steps), self._sampling,
          num_steps=self.decode_steps, **settings)
      return tokens  # [num_steps, rows]: booked as row j * rows + r
    tokens, self.cache, self.workspace = self._step(
        *decode_inputs, jnp.asarray(np.minimum(slot_steps, 1)), jnp.asarray(decode_cached), prefill,
        self._sampling, **settings)
    self._previous_tokens = tokens
    return tokens

  def _upload_block_table_rows(self) -> None:
    """Copies the block-table rows the allocator changed to the device."""
    changed = sorted(self.allocator.changed_rows)
    if changed:
      self.allocator.changed_rows.clear()
      self.cache = dataclasses.replace(self.cache, block_table=_set_rows_padded(
          self.cache.block_table, changed, self.allocator.block_table))

  @staticmethod
  def _update_rows(device: jax.Array, old: np.ndarray, new: np.ndarray) -> jax.Array:
    """`device` (a copy of `old`) made equal to `new` by setting the rows that differ."""
    changed = np.flatnonzero((old != new).any(axis=1)).tolist()
    return _set_rows_padded(device, changed, new) if changed else device


def _row_counts(n: int) -> list[list[int]]:
  """Row lists of a table of n rows that `_set_rows_padded` pads to every size it can."""
  return [list(range(min(1 << e, n))) for e in range((n - 1).bit_length() + 1)]


def _set_rows_padded(device: jax.Array, rows: list[int], host: np.ndarray) -> jax.Array:
  """device with `rows` set to host's, padded to a power of two of rows (the last one
  repeated) so that few sizes compile."""
  padded = rows + rows[-1:] * ((1 << (len(rows) - 1).bit_length()) - len(rows))
  return set_rows(device, jnp.asarray(padded, jnp.int32), jnp.asarray(host[padded]))


@dataclasses.dataclass
class _InFlight:
  """A dispatched step: its output tokens on the device and what they are for."""

  tokens: jax.Array  # [lanes + slots], or [decode steps, lanes + slots]
  bookings: list[Booking]
  _values: np.ndarray | None = None

  def values(self) -> np.ndarray:
    """The tokens on the host (waits for the step, once)."""
    if self._values is None:
      self._values = np.asarray(self.tokens).reshape(-1)
    return self._values
