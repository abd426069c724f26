"""A continuous-batching engine for models.qwen2: requests come and go at every step.

    engine = Engine(model, max_slots=8)
    handle = engine.submit(prompt_ids, max_new_tokens=64, temperature=0.7, seed=1)
    for token in handle:        # streams; steps the engine while no token is ready
      ...
    engine.run_until_idle()     # or drive every submitted request to the end

Each step is ONE jitted call over a fixed number of slots (a paged KV cache of `max_slots`
rows): the model runs once over `prefill_lanes` rows of prefill chunks [lanes, T] and once
over every slot's decode token [slots, 1], both writing into the same page pools, then one
token is drawn per row. T is the step's bucket (a power of two from 16 up to the token
budget), so a run compiles at most one step per bucket plus one decode-only step
(`Engine.compilations`). Scheduling, pages, preemption and prefix caching are host-side
(models/serving/scheduler.py, prefix_cache.py, models/qwen2/allocator.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
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
from models.serving.sampling import row_keys, sample_rows
from models.serving.scheduler import ScheduledStep, Scheduler, Sequence

MIN_BUCKET = 16


@functools.lru_cache(maxsize=16)
def step_function(graphdef, treedef):
  """(the jitted engine step for models of this structure, a one-item list counting its
  traces, i.e. compilations). The structure is bound once, as in models.qwen2.sampler."""
  traces = [0]

  def step(params, cache, workspace, decode_tokens, decode_lengths, decode_cached, prefill,
           sampling, *, attention_impl):
    """cache: the PagedCache (block table [slots, max_pages]) and workspace: the decode
    kernels' scratch (models.qwen2.DecodeWorkspace), both donated; decode_* [slots]
    (lengths 1 for a decoding row, 0 for any other); prefill None or (tokens [lanes, T],
    lengths [lanes], cached [lanes], block table [lanes, max_pages]); sampling (seeds,
    token index, temperature, top_k, top_p), one per row, prefill rows first.
    -> (tokens [lanes + slots] int32, cache, workspace). Each model call is the model's
    own with a cache: it picks its StepPlan (models/qwen2/plan.py) from the call's shape."""
    traces[0] += 1
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    logits = []
    if prefill is not None:
      tokens, lengths, cached, table = prefill
      view = dataclasses.replace(cache, block_table=table, lengths=cached)  # same pools
      with jax.named_scope("prefill_chunks"):
        hidden, view, workspace = model.hidden_states(tokens, None, view, lengths=lengths,
                                                      attention_impl=attention_impl,
                                                      workspace=workspace)
      last = hidden[jnp.arange(tokens.shape[0]), jnp.maximum(lengths - 1, 0)]  # [lanes, hidden]
      logits.append(model.logits(last))
      cache = dataclasses.replace(cache, key_pages=view.key_pages, value_pages=view.value_pages)
    cache = dataclasses.replace(cache, lengths=decode_cached)
    with jax.named_scope("decode"):
      hidden, cache, workspace = model.hidden_states(
          decode_tokens[:, None], None, cache, lengths=decode_lengths,
          attention_impl=attention_impl, workspace=workspace)
    logits.append(model.logits(hidden[:, 0]))
    seeds, index, temperature, top_k, top_p = sampling
    with jax.named_scope("sample"):
      next_tokens = sample_rows(jnp.concatenate(logits), row_keys(seeds, index), temperature,
                                top_k, top_p)
    return next_tokens, cache, workspace

  jitted = jax.jit(step, static_argnames=("attention_impl",),
                   donate_argnames=("cache", "workspace"))
  return jitted, traces


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
  larger means fewer compilations, more padding). attention_impl: as for models.qwen2.generate.
  """

  def __init__(self, model: Qwen2ForCausalLM, *, max_slots: int = 8, page_size: int = 16,
               num_pages: int | None = None, max_seq_len: int | None = None,
               token_budget: int = 512, prefill_lanes: int = 2, chunked_prefill: bool = True,
               prefix_caching: bool = True, min_chunk: int = MIN_BUCKET,
               attention_impl: str | None = None):
    config = model.config
    for name, value in (("max_slots", max_slots), ("token_budget", token_budget),
                        ("prefill_lanes", prefill_lanes)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(min_chunk, int) or min_chunk < 1 or min_chunk & (min_chunk - 1):
      raise ValueError(f"min_chunk must be a power of two, got {min_chunk!r}")
    self.config = config
    self.max_seq_len = min(max_seq_len or config.max_position_embeddings, config.max_position_embeddings)
    self.max_slots, self.prefill_lanes, self.page_size = max_slots, prefill_lanes, page_size
    self.attention_impl = check_attention_impl(attention_impl)
    self.cache = PagedCache.create(config, max_slots, self.max_seq_len, model.dtype,
                                   page_size=page_size, num_pages=num_pages)
    self.workspace = DecodeWorkspace.create()
    self.max_pages = self.cache.block_table.shape[1]
    self.allocator = PageAllocator(self.cache.num_pages, page_size, max_slots, self.max_pages)
    self.prefix_cache = PrefixCache(self.allocator) if prefix_caching else None
    largest = min(token_budget, self.max_seq_len) if chunked_prefill else self.max_seq_len
    self.scheduler = Scheduler(self.allocator, self.prefix_cache, max_slots=max_slots,
                               token_budget=token_budget, prefill_lanes=prefill_lanes,
                               chunked_prefill=chunked_prefill,
                               buckets=chunk_buckets(largest, min_chunk),
                               max_seq_len=self.max_seq_len)
    graphdef, state = nnx.split(model)
    self.params, treedef = jax.tree.flatten(state)
    self._step, self._traces = step_function(graphdef, treedef)
    self._traces_at_start = self._traces[0]
    self._next_id = 0

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
    return not self.scheduler.has_work()

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
    return {**self.scheduler.stats, "compilations": self.compilations}

  def warm_up(self) -> None:
    """Compiles the step for every chunk bucket (and the decode-only step) now, on inputs
    that write nothing, so that serving never waits for a compilation."""
    slots, lanes, zeros = self.max_slots, self.prefill_lanes, functools.partial(np.zeros, dtype=np.int32)
    for bucket in (0, *self.scheduler.buckets):
      rows = slots + (lanes if bucket else 0)
      prefill = None if not bucket else tuple(jnp.asarray(x) for x in (
          zeros((lanes, bucket)), zeros((lanes,)), zeros((lanes,)), zeros((lanes, self.max_pages))))
      sampling = (jnp.zeros((rows,), jnp.uint32), jnp.zeros((rows,), jnp.int32),
                  jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.int32),
                  jnp.ones((rows,), jnp.float32))
      tokens, self.cache, self.workspace = self._step(
          self.params, self.cache, self.workspace, *(jnp.asarray(zeros((slots,))) for _ in range(3)),
          prefill, sampling, attention_impl=self.attention_impl)
      tokens.block_until_ready()

  # ----------------------------------------------------------------------------- one step

  def step(self) -> bool:
    """Schedules and runs one step; False when there was nothing to run."""
    scheduled = self.scheduler.schedule()
    if scheduled is None:
      return False
    next_tokens = np.asarray(self._run(scheduled))
    lanes = self.prefill_lanes if scheduled.prefills else 0
    self.scheduler.commit(scheduled, next_tokens[:len(scheduled.prefills)],
                          [next_tokens[lanes + s.slot] for s in scheduled.decodes], time.perf_counter())
    return True

  def _run(self, scheduled: ScheduledStep):
    slots, lanes = self.max_slots, self.prefill_lanes
    # One sampling row per logits row: the prefill lanes (when the step has any), then the slots.
    lane_rows = [s for s, _ in scheduled.prefills] + [None] * (lanes - len(scheduled.prefills))
    rows = (lane_rows if scheduled.prefills else []) + list(self.scheduler.slots)
    decode_tokens = np.zeros((slots,), np.int32)
    decode_lengths = np.zeros((slots,), np.int32)
    decode_cached = np.zeros((slots,), np.int32)
    for seq in scheduled.decodes:
      decode_tokens[seq.slot] = seq.tokens[seq.cached]
      decode_lengths[seq.slot] = 1
      decode_cached[seq.slot] = seq.cached
    prefill = None
    if scheduled.prefills:
      tokens = np.zeros((lanes, scheduled.chunk_bucket), np.int32)
      lengths = np.zeros((lanes,), np.int32)
      cached = np.zeros((lanes,), np.int32)
      table = np.zeros((lanes, self.max_pages), np.int32)
      for lane, (seq, chunk) in enumerate(scheduled.prefills):
        tokens[lane, :chunk] = seq.tokens[seq.cached:seq.cached + chunk]
        lengths[lane], cached[lane] = chunk, seq.cached
        table[lane] = self.allocator.block_table[seq.slot]
      prefill = tuple(jnp.asarray(x) for x in (tokens, lengths, cached, table))
    # seed, token index, temperature, top_k, top_p; idle rows: greedy, no cut.
    sampling = [np.full((len(rows),), fill, dtype) for fill, dtype in
                ((0, np.uint32), (0, np.int32), (0, np.float32), (0, np.int32), (1, np.float32))]
    for r, seq in enumerate(rows):
      if seq is not None:
        request = seq.handle.request
        for column, value in zip(sampling, (request.seed, seq.generated, request.temperature,
                                            request.top_k, request.top_p)):
          column[r] = value
    if self.allocator.changed:
      self.cache = dataclasses.replace(self.cache, block_table=jnp.asarray(self.allocator.block_table))
      self.allocator.changed = False
    next_tokens, self.cache, self.workspace = self._step(
        self.params, self.cache, self.workspace, jnp.asarray(decode_tokens), jnp.asarray(decode_lengths),
        jnp.asarray(decode_cached), prefill, tuple(jnp.asarray(x) for x in sampling),
        attention_impl=self.attention_impl)
    return next_tokens
