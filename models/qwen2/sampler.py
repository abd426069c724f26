"""Text generation: a jitted prefill, ONE jitted decode step, and a host loop around them.

Shapes stay few so compilations stay few: prompts are right-padded to a power-of-two
bucket (>= 16 tokens), the cache holds that bucket plus the new tokens rounded up to 64, and
the decode step is a pure function of `nnx.split(model)`'s state with the cache donated
(updated in place). The paged cache's block table is int32 *data*, so growing a sequence
by a page never recompiles.

One decode call runs `steps_per_call` steps on the device (a `lax.fori_loop` over the
one-step function): dispatching a call of a 28-layer model costs ~0.8 ms of host time on
the H200, more than half of a batch-1 step's GPU time, so one step per call would leave the
loop host-bound. The host loop runs one call behind the device: it dispatches call c, then
reads the tokens of call c - 1 while call c runs, so reading tokens (for EOS, streaming, and
the page allocator) does not stall the GPU. A sequence that hits EOS is marked done on the
device in the same step; later steps neither write its cache nor emit tokens for it.

EOS handling: the returned tokens of a sequence end with its EOS token when it produced
one (EOS included, as Hugging Face's `generate` returns it).

Sliding windows: when every layer of the model has one (`Qwen2Config.layer_window`), the
paged cache gives back the pages that have fallen out of the widest window before each
decode call, so a sequence holds about window / page_size + 1 pages however long it grows.
Their block-table entries stay as they were: the decode kernels never read the entries of
pages wholly before a window (jaxflash/paged.py), and the device runs calls in order, so a
page handed to another sequence is written only after the last call that could read it.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxflash
from jaxflash._util import next_power_of_2
from models.qwen2.allocator import PageAllocator
from models.qwen2.cache import ContiguousCache, KVCache, PagedCache, cache_dtype
from models.qwen2.model import Qwen2ForCausalLM
from models.qwen2.plan import DecodeWorkspace, StepPlan
from models.qwen2.sampling import SamplingParams, sample_logits

MIN_PROMPT_BUCKET = 16
CAPACITY_MULTIPLE = 64
STEPS_PER_CALL = 8  # decode steps per dispatch in the generate loop (Sampler)
CACHE_KINDS = ("paged", "contiguous")


def prompt_bucket(length: int) -> int:
  """The padded prompt length: the next power of two, at least MIN_PROMPT_BUCKET."""
  return max(MIN_PROMPT_BUCKET, next_power_of_2(length))


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def check_attention_impl(impl) -> str | None:
  """`impl` when it is one of jaxflash.IMPLEMENTATIONS, else a ValueError."""
  if impl not in jaxflash.IMPLEMENTATIONS:
    raise ValueError(f"attention_impl must be one of {jaxflash.IMPLEMENTATIONS}, got {impl!r}")
  return impl


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """What one decode step hands the next, all on the device (and all donated to it)."""

  tokens: jax.Array  # [B] int32: each sequence's last sampled token, the next step's input
  done: jax.Array  # [B] bool: finished sequences (EOS seen); they write and emit nothing more
  cache: KVCache  # the KV cache, lengths [B] counting the tokens written
  workspace: DecodeWorkspace  # the decode kernels' scratch (models/qwen2/plan.py)
  key: jax.Array  # the PRNG key of the next draw


def _prefill(model, tokens, lengths, cache, key, eos_ids, sampling: SamplingParams,
             attention_impl) -> LoopState:
  """Runs the prompts and samples each one's first new token.

  tokens [B, T] int32 right-padded prompts; lengths [B] int32 their lengths; cache empty.
  Returns the decode loop's first state.
  """
  with jax.named_scope("prefill"):
    hidden, cache, _ = model.hidden_states(tokens, None, cache, lengths=lengths,
                                           attention_impl=attention_impl)
  batch = tokens.shape[0]
  last = hidden[jnp.arange(batch), lengths - 1]  # [B, hidden]: the LM head sees one row each
  logits = model.logits(last)  # [B, vocab]
  with jax.named_scope("sample"):
    key, draw = jax.random.split(key)
    next_tokens = sample_logits(logits, draw, sampling)
  return LoopState(next_tokens, jnp.isin(next_tokens, eos_ids), cache, DecodeWorkspace.create(model.tensor_parallel), key)


def _decode(model, state: LoopState, eos_ids, sampling: SamplingParams, attention_impl,
            plan: StepPlan | None) -> LoopState:
  """One token per sequence: writes the last tokens' keys/values (not for done rows) and
  samples the next ones. The PRNG key rides along on the device, so a step needs no new
  data from the host."""
  active = (~state.done).astype(jnp.int32)  # finished rows write nothing
  with jax.named_scope("decode"):
    hidden, cache, workspace = model.hidden_states(
        state.tokens[:, None], None, state.cache, lengths=active, attention_impl=attention_impl,
        plan=plan, workspace=state.workspace)
  logits = model.logits(hidden[:, 0])  # [B, vocab]
  with jax.named_scope("sample"):
    key, draw = jax.random.split(state.key)
    next_tokens = sample_logits(logits, draw, sampling)
  next_tokens = jnp.where(state.done, 0, next_tokens)
  return LoopState(next_tokens, state.done | jnp.isin(next_tokens, eos_ids), cache, workspace, key)


def _decode_steps(model, state: LoopState, history, steps, eos_ids, sampling: SamplingParams,
                  attention_impl, plan: StepPlan | None) -> tuple[LoopState, jax.Array]:
  """Up to K = history.shape[0] decode steps in one call: the first `steps` (an int32
  scalar, at most K) run as `_decode`; the rest leave the state as it is. history [K, B]
  int32 receives each step's tokens (rows past `steps`: 0). Returns (state, history)."""

  def one_step(j, carry):
    state, history = carry
    live = j < steps
    stepped = _decode(model, dataclasses.replace(state, done=state.done | ~live), eos_ids,
                      sampling, attention_impl, plan)
    state = LoopState(jnp.where(live, stepped.tokens, state.tokens),
                      jnp.where(live, stepped.done, state.done), stepped.cache, stepped.workspace,
                      jnp.where(live, stepped.key, state.key))
    return state, history.at[j].set(stepped.tokens)

  return jax.lax.fori_loop(0, history.shape[0], one_step, (state, history))


@jax.jit
def snapshot(x: jax.Array) -> jax.Array:
  """A copy of x in a buffer of its own, made on the device in stream order (a few
  microseconds): it stays readable after x is donated to the next step."""
  return jnp.copy(x)


class StepFunctions(NamedTuple):
  """The jitted prefill, decode step and multi-step decode of one model structure. All
  take the weights as a flat list of arrays first, the keyword `sampling` (a SamplingParams:
  its values are data, so new values never recompile; its mode is static) and the static
  keyword `attention_impl` (decode and decode_steps also `plan`: None for the default
  StepPlan). prefill donates the cache; decode and decode_steps the LoopState (and
  the history) they return: read tokens through `snapshot` before the next call.

    prefill(params, tokens [B, T], lengths [B], cache, key, eos_ids) -> LoopState
    decode(params, state, eos_ids) -> LoopState
    decode_steps(params, state, history [K, B], steps, eos_ids) -> (LoopState, history)
  """

  prefill: Callable
  decode: Callable
  decode_steps: Callable


@functools.lru_cache(maxsize=32)
def step_functions(graphdef, treedef) -> StepFunctions:
  """Jitted steps for models of this structure (`nnx.split`'s graphdef, and the treedef of
  its state). The structure is bound here, once, not passed per call: hashing a 28-layer
  graphdef as a static argument, and flattening an nnx.State, cost milliseconds of host
  time per call, more than a whole decode step takes on the GPU; a list of arrays is cheap."""

  def merge(params):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, params))

  @functools.partial(jax.jit, static_argnames=("attention_impl",),
                     donate_argnames=("cache",))
  def prefill(params, tokens, lengths, cache, key, eos_ids, *, sampling, attention_impl):
    return _prefill(merge(params), tokens, lengths, cache, key, eos_ids, sampling, attention_impl)

  jit = functools.partial(jax.jit, static_argnames=("attention_impl", "plan"))

  # Everything a step returns is donated back to the next step, so every buffer of the step
  # keeps its address and XLA relaunches its recorded CUDA graph as it is; one fresh output
  # (the new tokens, the done flags or the key) makes it update the graph's ~600 kernel
  # nodes on the host, which cost ~2 ms a step on the H200, more than the step's GPU time.
  @functools.partial(jit, donate_argnames=("state",))
  def decode(params, state, eos_ids, *, sampling, attention_impl, plan=None):
    return _decode(merge(params), state, eos_ids, sampling, attention_impl, plan)

  @functools.partial(jit, donate_argnames=("state", "history"))
  def decode_steps(params, state, history, steps, eos_ids, *, sampling, attention_impl, plan=None):
    return _decode_steps(merge(params), state, history, steps, eos_ids, sampling, attention_impl, plan)

  return StepFunctions(prefill, decode, decode_steps)


@dataclasses.dataclass
class GenerationOutput:
  """New tokens per prompt and wall-clock timings (the first call includes compilation)."""

  tokens: list[list[int]]
  prefill_seconds: float  # prompts in -> first tokens on the host
  decode_seconds: float  # first tokens -> last tokens on the host
  decode_steps: int  # steps run on the device (a sequence may stop before the last)

  @property
  def decode_tokens(self) -> int:
    return sum(max(len(t) - 1, 0) for t in self.tokens)

  @property
  def decode_tokens_per_second(self) -> float:
    return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class Sampler:
  """Generates with `model` through a contiguous or paged KV cache.

  cache: "paged" (page pools + block tables, pages handed out as sequences grow and
  returned when they finish) or "contiguous" ([B, S, K, H] per layer). attention_impl:
  `jaxflash.attention`'s implementation, one of jaxflash.IMPLEMENTATIONS (None: the best
  kernel). steps_per_call: decode steps per dispatch (tokens reach `stream` in groups of
  this many). plan: the StepPlan of the decode steps (None: `StepPlan.build` for the batch;
  benchmarks pass another one for A/B runs). kv_dtype: "int8" or "float8_e4m3fn" for a
  quantized KV cache (None: the model's dtype).
  """

  def __init__(self, model: Qwen2ForCausalLM, *, cache: str = "paged", page_size: int = 16,
               num_pages: int | None = None, attention_impl: str | None = None,
               steps_per_call: int = STEPS_PER_CALL, plan: StepPlan | None = None,
               kv_dtype: str | None = None):
    if cache not in CACHE_KINDS:
      raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
    if not isinstance(steps_per_call, int) or steps_per_call < 1:
      raise ValueError(f"steps_per_call must be a positive int, got {steps_per_call!r}")
    if plan is not None and plan.attention_impl != attention_impl:
      raise ValueError(f"plan.attention_impl ({plan.attention_impl!r}) differs from attention_impl "
                       f"({attention_impl!r})")
    self.steps_per_call = steps_per_call
    self._step_counts: dict[int, jax.Array] = {}  # device scalars, one buffer per count
    self.config = model.config
    self.cache_dtype = model.dtype
    self.kv_dtype = kv_dtype
    cache_dtype(model.dtype, kv_dtype)  # a bad kv_dtype fails here, not at the first call
    graphdef, state = nnx.split(model)
    self.params, treedef = jax.tree.flatten(state)  # weights as a flat list of arrays
    self.steps = step_functions(graphdef, treedef)
    self.cache_kind = cache
    self.page_size = page_size
    self.num_pages = num_pages
    self.attention_impl = check_attention_impl(attention_impl)
    self.plan = plan
    self.tensor_parallel = model.tensor_parallel  # None unless split by shard_model
    self.allocator: PageAllocator | None = None  # the last call's (for inspection)
    # The widest window: no layer reads a key older than the last kept_window tokens again
    # (None: some layer sees every token, so no page goes back before the sequence ends).
    windows = self.config.layer_windows
    self.kept_window = None if None in windows else max(windows)

  def capacity(self, longest_prompt: int, max_new_tokens: int) -> int:
    """Cache tokens per sequence: the longest prompt's bucket plus the new tokens, rounded
    up (from the bucket, not the length, so prompts of one bucket share one compilation)."""
    multiple = max(CAPACITY_MULTIPLE, self.page_size if self.cache_kind == "paged" else 1)
    return _round_up(prompt_bucket(longest_prompt) + max_new_tokens, multiple)

  def prefill(self, tokens: jax.Array, lengths: jax.Array, cache: KVCache, key: jax.Array,
              eos_ids: jax.Array, sampling: SamplingParams) -> LoopState:
    """The jitted prefill (see `_prefill`) with this sampler's weights and attention; the
    cache is donated."""
    return self.steps.prefill(self.params, tokens, lengths, cache, key, eos_ids,
                              sampling=sampling, attention_impl=self.attention_impl)

  def decode(self, state: LoopState, eos_ids: jax.Array, sampling: SamplingParams) -> LoopState:
    """One jitted decode step (see `_decode`); the state is donated."""
    return self.steps.decode(self.params, state, eos_ids, sampling=sampling,
                             attention_impl=self.attention_impl, plan=self.plan)

  def decode_steps(self, state: LoopState, history: jax.Array, steps: int, eos_ids: jax.Array,
                   sampling: SamplingParams) -> tuple[LoopState, jax.Array]:
    """`steps` (<= history.shape[0]) jitted decode steps in one call (see `_decode_steps`);
    the state and history are donated."""
    if steps not in self._step_counts:  # the same buffer every call: the CUDA graph keeps it
      self._step_counts[steps] = jnp.asarray(steps, jnp.int32)
    return self.steps.decode_steps(self.params, state, history, self._step_counts[steps], eos_ids,
                                   sampling=sampling, attention_impl=self.attention_impl,
                                   plan=self.plan)

  def make_cache(self, batch: int, capacity: int):
    """An empty cache; split over the model's mesh as its heads are, when it is sharded."""
    if self.cache_kind == "paged":
      return PagedCache.create(self.config, batch, capacity, self.cache_dtype,
                               page_size=self.page_size, num_pages=self.num_pages,
                               sharding=self.tensor_parallel, kv_dtype=self.kv_dtype)
    return ContiguousCache.create(self.config, batch, capacity, self.cache_dtype,
                                  sharding=self.tensor_parallel, kv_dtype=self.kv_dtype)

  def to_device(self, rows) -> jax.Array:
    """A host array with a leading batch dimension (tokens, lengths, a block table) on
    the device; on a sharded model's mesh, split over its data axis (if any)."""
    if self.tensor_parallel is None:
      return jnp.asarray(rows)
    return self.tensor_parallel.to_device(rows, len(rows))

  def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               eos_token_id=None, seed: int = 0,
               stream: Callable[[list[int | None]], bool | None] | None = None) -> GenerationOutput:
    """See `generate`; returns the tokens with timings."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab = self.config.vocab_size
    if any(not 0 <= t < vocab for p in prompts for t in p):
      raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    longest = max(map(len, prompts))
    if longest + max_new_tokens > self.config.max_position_embeddings:
      raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"max_position_embeddings ({self.config.max_position_embeddings})")
    sampling = SamplingParams(temperature, top_k, top_p).as_arrays()  # values: data; mode: static
    if eos_token_id is None:
      eos = self.config.eos_token_ids
    else:
      eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    eos_set = set(eos)
    eos_ids = jnp.asarray(eos or (-1,), jnp.int32)
    if max_new_tokens == 0:
      return GenerationOutput([[] for _ in prompts], 0.0, 0.0, 0)

    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((batch, prompt_bucket(longest)), np.int32)
    for row, prompt in enumerate(prompts):
      tokens[row, :len(prompt)] = prompt
    capacity = self.capacity(longest, max_new_tokens)
    cache = self.make_cache(batch, capacity)
    allocator = None
    if self.cache_kind == "paged":
      allocator = PageAllocator(cache.num_pages, self.page_size, batch,
                                cache.block_table.shape[1])
      for row in range(batch):
        allocator.reserve(row, int(lengths[row]))
      cache = dataclasses.replace(cache, block_table=self.to_device(allocator.block_table))
      allocator.changed = False
    self.allocator = allocator
    key = jax.random.key(seed)

    outputs: list[list[int]] = [[] for _ in prompts]
    finished = np.zeros((batch,), bool)

    def finish(row: int) -> None:
      finished[row] = True
      if allocator is not None:
        allocator.release(row)

    def consume(step_tokens) -> None:
      """Books one step's tokens [B] (host values)."""
      emitted: list[int | None] = [None] * batch
      for row in np.flatnonzero(~finished):
        token = int(step_tokens[row])
        outputs[row].append(token)
        emitted[row] = token
        if token in eos_set or len(outputs[row]) >= max_new_tokens:
          finish(row)
      if stream is not None and stream(emitted) is True:  # exactly True: see `generate`
        for row in np.flatnonzero(~finished):
          finish(row)

    def consume_call(history, count: int) -> None:
      """Reads one call's tokens (a host sync) and books its first `count` steps."""
      values = np.asarray(history)
      for step_tokens in values[:count]:
        if finished.all():
          break
        consume(step_tokens)

    start = time.perf_counter()
    state = self.prefill(self.to_device(tokens), self.to_device(lengths), cache, key, eos_ids,
                         sampling)
    consume(np.asarray(state.tokens))
    prefill_seconds = time.perf_counter() - start

    # Every call has the same shape (one compilation); the last may run fewer live steps.
    history = jnp.zeros((self.steps_per_call, batch), jnp.int32)  # each call's tokens, donated
    positions = lengths.copy()  # where each sequence's next fed token is written
    pending = None  # (tokens, step count) of the dispatched call not read yet
    steps = 0
    decode_start = time.perf_counter()
    while steps < max_new_tokens - 1 and not finished.all():
      count = min(self.steps_per_call, max_new_tokens - 1 - steps)
      if allocator is not None:
        for row in np.flatnonzero(~finished):
          if self.kept_window is not None:
            # The call's first query, at positions[row], sees keys from
            # positions[row] - window + 1 on, and later queries fewer old ones.
            allocator.release_before(row, int(positions[row]) - self.kept_window + 1)
          allocator.reserve(row, int(positions[row]) + count)
        if allocator.changed:
          table = self.to_device(allocator.block_table)
          state = dataclasses.replace(state, cache=dataclasses.replace(state.cache, block_table=table))
          allocator.changed = False
      state, history = self.decode_steps(state, history, count, eos_ids, sampling)
      readable = snapshot(history)  # the next call donates history: read a copy
      positions += count
      steps += count
      if pending is not None:
        consume_call(*pending)
      pending = (readable, count)
    if pending is not None:
      consume_call(*pending)
    decode_seconds = time.perf_counter() - decode_start if steps else 0.0
    return GenerationOutput(outputs, prefill_seconds, decode_seconds, steps)


def generate(model: Qwen2ForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, cache: str = "paged",
             page_size: int = 16, num_pages: int | None = None, seed: int = 0,
             stream: Callable[[list[int | None]], bool | None] | None = None,
             attention_impl: str | None = None,
             steps_per_call: int = STEPS_PER_CALL, kv_dtype: str | None = None) -> list[list[int]]:
  """Continues each prompt (a list of token ids; lengths may differ) by up to
  `max_new_tokens` tokens and returns the new tokens per prompt.

  Greedy when temperature == 0, else sampled with temperature and optional top-k / top-p
  from `jax.random.key(seed)`; the three are data to the compiled steps, so new values
  never recompile (one compilation per prompt bucket and sampling mode: greedy, plain,
  top-k / top-p). A sequence stops after its EOS
  token, which is included in its output; eos_token_id None means the config's EOS ids
  (pass () to never stop early).
  cache: "paged" (page_size tokens a page; num_pages default: enough for every sequence)
  or "contiguous". stream(step_tokens) is called as tokens arrive with one entry per
  prompt (None once that prompt has finished); returning exactly `True` (checked with `is
  True`: any other value, truthy or not, such as tqdm's `update()` result, goes on) stops
  generation at once: no later token is emitted or returned, and no further decode call is
  dispatched (the one already running on the device, at most `steps_per_call` steps,
  finishes and its tokens are dropped). attention_impl: one of jaxflash.IMPLEMENTATIONS
  (None: the best kernel; "xla": jaxflash's plain-JAX path). steps_per_call: decode steps the device runs per
  dispatch (the last call may compute a few steps whose results are dropped).
  max_new_tokens 0 returns empty lists. kv_dtype: "int8" or "float8_e4m3fn" keeps the KV
  cache quantized (one float32 scale per token and KV head, about half of bf16's bytes);
  None keeps it in the model's dtype.
  """
  sampler = Sampler(model, cache=cache, page_size=page_size, num_pages=num_pages,
                    attention_impl=attention_impl, steps_per_call=steps_per_call, kv_dtype=kv_dtype)
  return sampler(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                 eos_token_id=eos_token_id, seed=seed, stream=stream).tokens
