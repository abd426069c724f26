"""models.serving: the continuous-batching engine against `generate` run on each request
alone (greedy, float32, the tiny checkpoint of tests/qwen2_fixtures.py), the model call it
needs (a chunk of new tokens after the cached ones), the allocator's reference counts and
the prefix cache, seeded sampling, and refused requests.

Attention runs on jaxflash's plain-JAX path ("xla") except where the kernels are the point
(they are interpreted on a CPU); decode steps run the model's own StepPlan, as generate's do.
Prompt lengths stay in a few of generate's buckets so its reference compiles stay few.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models.qwen2 as qwen2
from models.qwen2.allocator import OutOfPagesError, PageAllocator
from models.serving import Engine, PrefixCache, page_keys
from models.serving.sampling import row_keys, sample_rows
from models.serving.step import any_sampled, sampling_row
from tests.jaxprs import HOST_SYNCING, primitives_outside_kernels

NEW = 6


@pytest.fixture(scope="module")
def model():
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from tests import qwen2_fixtures
  return qwen2.from_pretrained(qwen2_fixtures.hf_checkpoint(tied=True)[0])


@pytest.fixture(autouse=True)
def _full_precision():
  """On a GPU, XLA's float32 dots default to TF32, enough to flip a greedy token between a
  chunked and a whole prefill; on the CPU this changes nothing. Set globally, not with the
  thread-local context manager, so that an EngineLoop's own thread runs the same precision
  (and the same compiled steps) as the test's thread."""
  previous = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", "highest")
  yield
  jax.config.update("jax_default_matmul_precision", previous)


def _prompts(lengths, seed):
  from tests import qwen2_fixtures
  return qwen2_fixtures.prompts(lengths, seed=seed)


@functools.cache
def _generate_alone(model, prompt: tuple[int, ...], new: int) -> list[int]:
  return qwen2.generate(model, [list(prompt)], new, attention_impl="xla", eos_token_id=(),
                        page_size=8)[0]


def _engine(model, **options):
  options = dict(dict(max_slots=3, page_size=8, max_seq_len=128, token_budget=16, prefill_lanes=2,
                      attention_impl="xla"), **options)
  return Engine(model, **options)


def _check_alone(model, handles, new=NEW):
  for handle in handles:
    assert handle.done
    assert handle.tokens == _generate_alone(model, handle.request.prompt, new), handle


# ----------------------------------------------------------------------------- the model call

@pytest.mark.parametrize("kind, impl", [("paged", None), ("paged", "xla"), ("contiguous", None)])
def test_chunks_after_the_cache_give_the_whole_prompts_logits(model, kind, impl):
  """Rows fed in ragged chunks (T_b new tokens after the cached ones) give the logits of the
  whole sequence in one call without a cache: the paged path runs the paged prefill kernel."""
  ids = np.asarray(_prompts((46,), seed=1)[0]).reshape(2, 23)
  full = np.asarray(model(jnp.asarray(ids), attention_impl="xla"))
  if kind == "paged":
    cache = qwen2.PagedCache.create(model.config, 2, 64, jnp.float32, page_size=8)
    table = np.random.default_rng(0).permutation(16).reshape(2, 8)
    cache = dataclasses.replace(cache, block_table=jnp.asarray(table, jnp.int32))
  else:
    cache = qwen2.ContiguousCache.create(model.config, 2, 64, jnp.float32)
  got, done = [[], []], np.zeros(2, int)
  for chunk in ([10, 1], [12, 16], [1, 6]):
    tokens = np.zeros((2, 16), np.int32)
    for b in range(2):
      tokens[b, :chunk[b]] = ids[b, done[b]:done[b] + chunk[b]]
    logits, cache = model(jnp.asarray(tokens), None, cache, lengths=jnp.asarray(chunk, jnp.int32),
                          attention_impl=impl)
    for b in range(2):
      got[b].append(np.asarray(logits[b, :chunk[b]]))
    done += chunk
  assert np.asarray(cache.lengths).tolist() == [23, 23]
  for b in range(2):
    np.testing.assert_allclose(np.concatenate(got[b]), full[b], atol=2e-4, rtol=2e-4)


# ----------------------------------------------------------------------------- the engine

def test_requests_arriving_at_different_steps_match_generate_alone(model):
  """Mixed prompt lengths (prompts longer than the 32-token budget are chunked), requests
  submitted while others decode, more requests than slots; steps of one and of two prefill
  lanes (the budget holds two 16-token buckets). After `warm_up` (steps compiled together
  on threads) serving compiles nothing: no step, no table update."""
  from models.serving.step import set_rows
  prompts = _prompts((5, 23, 40, 17, 30, 9), seed=3)
  engine = _engine(model, token_budget=32, prefill_lanes=3)
  engine.warm_up(sampling=False)  # greedy requests only
  compiled = engine.compilations, set_rows._cache_size()
  # Steps (lanes, bucket): (1, 16), (2, 16), (1, 32), the decode-only step, the multi-step decode.
  assert engine.compilations <= 5
  handles = [engine.submit(p, NEW, stop_ids=()) for p in prompts[:2]]
  engine.step()
  engine.step()
  handles.append(engine.submit(prompts[2], NEW, stop_ids=()))
  for _ in range(3):
    engine.step()
  handles += [engine.submit(p, NEW, stop_ids=()) for p in prompts[3:]]
  engine.run_until_idle()
  assert engine.idle
  _check_alone(model, handles)
  assert engine.stats["prefill_tokens"] > 0 and engine.stats.get("preemptions", 0) == 0
  assert (engine.compilations, set_rows._cache_size()) == compiled
  assert engine.allocator.available_pages == engine.allocator.num_pages  # every page back


def test_streaming_handle_and_whole_prompts(model):
  """Iterating a handle steps the engine and yields each token as it comes; with
  chunked_prefill off a prompt is fed in one piece (one prefill row of a larger bucket)."""
  prompts = _prompts((23, 17), seed=4)
  engine = _engine(model, chunked_prefill=False, decode_steps=1)
  first, second = (engine.submit(p, NEW, stop_ids=()) for p in prompts)
  streamed = []
  for token in first:
    streamed.append(token)
    assert first.tokens == streamed  # handed over as soon as produced
  assert streamed == first.tokens and first.finish_reason == "length"
  engine.run_until_idle()
  _check_alone(model, [first, second])
  # Each prompt in one piece: the 23-token one alone (over the 16-token budget), the other next.
  assert engine.stats["prefill_tokens"] == 23 + 17 and engine.stats["steps"] == NEW + 1


def test_prefix_sharing_maps_cached_pages_instead_of_recomputing(model):
  """Three requests share a 26-token prefix (three full 8-token pages): once the first has
  computed it, the others map its pages and compute only the rest."""
  shared = _prompts((26,), seed=5)[0]
  tails = _prompts((3, 6, 1), seed=6)
  prompts = [shared + t for t in tails]
  engine = _engine(model)
  first = engine.submit(prompts[0], NEW, stop_ids=())
  first.result()
  later = [engine.submit(p, NEW, stop_ids=()) for p in prompts[1:]]
  engine.run_until_idle()
  _check_alone(model, [first, *later])
  assert first.prefix_hit_tokens == 0
  assert first.computed_tokens == len(prompts[0]) + NEW - 1
  for handle in later:
    assert handle.prefix_hit_tokens == 24
    assert handle.computed_tokens == len(handle.request.prompt) - 24 + NEW - 1
  # A prompt that is all cached pages still computes its last token (for its logits).
  again = engine.submit(shared[:24], NEW, stop_ids=())
  engine.run_until_idle()
  assert again.prefix_hit_tokens == 16 and again.computed_tokens == 8 + NEW - 1
  _check_alone(model, [again])


def test_prefix_caching_off_recomputes(model):
  shared = _prompts((26,), seed=5)[0]
  engine = _engine(model, prefix_caching=False)
  handles = [engine.submit(shared + t, NEW, stop_ids=()) for t in _prompts((3, 6), seed=6)]
  engine.run_until_idle()
  assert [h.prefix_hit_tokens for h in handles] == [0, 0]
  _check_alone(model, handles)


def test_preemption_recomputes_without_changing_outputs(model):
  """A pool of 12 8-token pages for three sequences growing to ~40 tokens each: the newest
  is preempted (its pages freed), then recomputed from its prompt and tokens so far."""
  prompts = _prompts((30, 25, 31, 20), seed=7)
  new = 12
  engine = _engine(model, num_pages=12)
  handles = [engine.submit(p, new, stop_ids=()) for p in prompts]
  engine.run_until_idle()
  assert engine.stats["preemptions"] > 0
  assert any(h.preemptions for h in handles)
  _check_alone(model, handles, new)
  assert engine.allocator.available_pages == 12


SAMPLED_PROMPTS = dict(lengths=(20, 27, 30), seed=8)
SAMPLING = dict(temperature=1.3, top_p=0.95, top_k=50, stop_ids=())


def _sampled(engine, seeds, prompts=None):
  """Each prompt's tokens sampled with its seed, all submitted at once."""
  prompts = prompts or _prompts(**SAMPLED_PROMPTS)
  handles = [engine.submit(p, 10, seed=s, **SAMPLING) for p, s in zip(prompts, seeds)]
  engine.run_until_idle()
  return [h.tokens for h in handles]


def test_sampling_is_reproducible_in_company_and_after_preemption(model):
  """A request's sampled tokens depend on its seed only: the same alone, in company and after
  preemption. Alone and in company on engines of one configuration (the same compiled
  steps), whose small pool preempts only in company."""
  alone_engine = _engine(model, num_pages=10)
  alone = _sampled(alone_engine, [1])[0]
  assert alone_engine.stats.get("preemptions", 0) == 0
  crowded = _engine(model, num_pages=10)
  together = _sampled(crowded, [1, 2, 3])
  assert crowded.stats["preemptions"] > 0
  assert together[0] == alone
  assert _sampled(_engine(model), [1, 2, 3]) == together


@pytest.mark.parametrize("options", [dict(token_budget=32), dict(decode_steps=1)],
                         ids=["token_budget32", "decode_steps1"])
def test_sampling_is_reproducible_across_step_shapes(model, options):
  """Sampled tokens do not depend on how the engine cuts its steps."""
  assert _sampled(_engine(model, **options), [1, 2, 3]) == _sampled(_engine(model), [1, 2, 3])


def test_sampling_seeds_differ_and_top_k_1_is_greedy(model):
  """Two seeds on one prompt give what each gives alone, and differ; top_k=1 is greedy."""
  prompt = _prompts(**SAMPLED_PROMPTS)[:1]
  both = _sampled(_engine(model), [5, 6], prompts=prompt * 2)
  assert both == [_sampled(_engine(model), [s], prompts=prompt)[0] for s in (5, 6)]
  assert len({tuple(t) for t in both}) == 2
  top1 = _engine(model).submit(prompt[0], NEW, temperature=2.0, top_k=1, seed=4, stop_ids=())
  assert top1.result() == _generate_alone(model, tuple(prompt[0]), NEW)


@pytest.mark.parametrize("call, error, message", [
    (dict(prompt=[]), ValueError, "prompt is empty"),
    (dict(prompt=list(range(129))), ValueError, "over the window of 128"),
    (dict(prompt="hello"), TypeError, "prompt must be a sequence of token ids"),
    (dict(prompt=[1, 300]), ValueError, r"token ids must lie in \[0, 256\)"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
    (dict(stop_ids="7"), TypeError, "stop_ids must be None, an int or a sequence of ints"),
    (dict(stop_ids=[1.5]), TypeError, "stop_ids must hold ints"),
    (dict(temperature=-1.0), ValueError, "temperature must be a number >= 0"),
    (dict(top_p=0.0), ValueError, r"top_p must be None or in \(0, 1\]"),
    (dict(max_new_tokens=90), ValueError, "needs more than the pool's 12 pages"),
])
def test_bad_requests_are_refused_without_disturbing_others(model, call, error, message):
  engine = _engine(model, num_pages=12)
  good = engine.submit(_prompts((9,), seed=9)[0], NEW, stop_ids=())
  engine.step()
  args = {"prompt": list(range(1, 41)), "max_new_tokens": NEW, **call}
  with pytest.raises(error, match=message):
    engine.submit(args.pop("prompt"), args.pop("max_new_tokens"), **args)
  engine.run_until_idle()
  _check_alone(model, [good])


def test_stop_ids_and_zero_new_tokens(model):
  prompt = _prompts((9,), seed=9)[0]
  greedy = _generate_alone(model, tuple(prompt), NEW)
  engine = _engine(model)
  stopped = engine.submit(prompt, NEW, stop_ids=greedy[2])
  nothing = engine.submit(prompt, 0)
  assert nothing.done and nothing.tokens == []
  engine.run_until_idle()
  assert stopped.tokens == greedy[:greedy.index(greedy[2]) + 1] and stopped.finish_reason == "stop"


def test_engine_on_the_kernels(model):
  """attention_impl None: the paged prefill kernel for chunks, paged decode for decodes
  (interpreted here), the same tokens as generate."""
  prompts = _prompts((20, 11), seed=10)
  engine = _engine(model, attention_impl=None, max_slots=2)
  handles = [engine.submit(p, 4, stop_ids=()) for p in prompts]
  engine.run_until_idle()
  _check_alone(model, handles, 4)


# ----------------------------------------------------------------------------- host parts

def test_allocator_reference_counts_and_lru_eviction():
  allocator = PageAllocator(num_pages=4, page_size=8, batch=3, max_pages=3)
  evicted = []
  allocator.on_evict = evicted.append
  allocator.reserve(0, 16)  # pages 0, 1
  allocator.keep(0)
  allocator.keep(1)
  allocator.share(1, [0, 1])
  assert allocator.refcount.tolist() == [2, 2, 0, 0] and allocator.block_table[1].tolist() == [0, 1, 0]
  allocator.release(0)
  assert allocator.available_pages == 2 and allocator.refcount.tolist() == [1, 1, 0, 0]
  allocator.release(1)  # kept pages go idle (1 first, then 0: 1 is the least recently idle)
  assert allocator.free_pages == 2 and allocator.available_pages == 4
  allocator.share(2, [0])  # an idle page mapped again leaves the idle list
  allocator.reserve(2, 24)  # pages 2, 3 from the free list
  with pytest.raises(OutOfPagesError):
    allocator.reserve(0, 24)  # takes idle page 1 (evicted), then none is left
  assert evicted == [1]
  with pytest.raises(ValueError, match="already holds"):
    allocator.share(2, [0])
  allocator.release(0)  # page 1, no longer kept, is free
  with pytest.raises(ValueError, match="is free"):
    allocator.share(0, [1])


def test_chunks_fill_one_bucket_within_the_token_budget():
  """The step's prefill rows are [lanes, T] with T the bucket of its longest chunk: the plan
  feeds the most prompt tokens with lanes * T within the budget, oldest sequences first,
  and counts the lanes it uses (an empty lane costs its rows)."""
  from models.serving.request import RequestHandle, make_request
  from models.serving.scheduler import Scheduler, Sequence

  def step_with(pending, decodes=0, lanes=4, budget=512):
    allocator = PageAllocator(num_pages=512, page_size=16, batch=8, max_pages=64)
    scheduler = Scheduler(allocator, None, max_slots=8, token_budget=budget, prefill_lanes=lanes,
                          chunked_prefill=True, buckets=(128, 256, 512), max_seq_len=1024)
    for n in [*pending, *[2] * decodes]:
      request = make_request([1] * n, 4, vocab_size=8, max_seq_len=1024)
      scheduler.add(Sequence(RequestHandle(len(scheduler.waiting), request, None), list(request.prompt)))
    scheduler._admit()
    for seq in scheduler.running[len(pending):]:
      seq.cached = 1  # one token left to feed: a decode
    step = scheduler.schedule()
    return [chunk for _, chunk in step.prefills], step.chunk_bucket

  assert step_with([1000]) == ([512], 512)
  assert step_with([1000], decodes=3) == ([509], 512)  # decodes come out of the budget
  assert step_with([200, 300]) == ([200, 256], 256)  # not [200, 300] in 2 x 512 rows
  assert step_with([100, 90, 120, 80, 70]) == ([100, 90, 120, 80], 128)
  assert step_with([40, 600]) == ([40, 256], 256)
  assert step_with([1000, 1000], lanes=1) == ([512], 512)
  assert step_with([60, 60], budget=100) == ([60], 128)  # a budget under one bucket: one lane


def test_prefix_cache_keys_chain_and_eviction():
  tokens = list(range(20))
  keys = page_keys(tokens, 8)
  assert len(keys) == 2 and keys == page_keys(tokens[:16], 8)
  assert page_keys([0] * 8 + tokens[8:16], 8)[1] != keys[1]  # a key stands for its whole prefix
  assert page_keys(tokens, 8, keys[0], start=1) == keys[1:]
  allocator = PageAllocator(num_pages=2, page_size=8, batch=2, max_pages=2)
  cache = PrefixCache(allocator)
  allocator.reserve(0, 16)
  cache.insert(keys[0], 0)
  cache.insert(keys[1], 1)
  cache.insert(keys[1], 0)  # a second page for a cached key stays private
  assert cache.lookup(keys) == [0, 1] and cache.lookup(keys[1:]) == [1]
  allocator.release(0)
  allocator.reserve(1, 8)  # reclaims the least recently idle page: the cache forgets it
  assert len(cache) == 1


def test_sample_rows_per_row_settings():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
  keys = row_keys(jnp.asarray([1, 1, 2, 3], jnp.uint32), jnp.asarray([0, 0, 0, 5], jnp.int32))
  temperature = jnp.asarray([0.0, 1.0, 1.0, 1.0])
  top_k, top_p = jnp.asarray([0, 1, 0, 3]), jnp.asarray([1.0, 1.0, 1e-6, 1.0])
  out = sample_rows(logits, keys, temperature, top_k, top_p, sampled=True)
  best = np.argmax(np.asarray(logits), axis=-1)
  assert out[0] == best[0] and out[1] == best[1] and out[2] == best[2]  # greedy, top-1, tiny top-p
  assert out[3] in np.argsort(-np.asarray(logits[3]))[:3]
  again = sample_rows(logits, keys, temperature, top_k, top_p, sampled=True)
  np.testing.assert_array_equal(out, again)
  # The greedy trace (sampled False) and a sampled trace of an all-greedy table agree.
  zero = jnp.zeros_like(temperature)
  np.testing.assert_array_equal(sample_rows(logits, keys, zero, top_k, top_p, sampled=False), best)
  np.testing.assert_array_equal(sample_rows(logits, keys, zero, top_k, top_p, sampled=True), best)


def test_any_sampled_reads_the_temperature_column():
  greedy = np.stack([sampling_row(1, 0.0, 5, 0.9, 3), sampling_row(2, 0.0, 0, 1.0, 4)])
  assert not any_sampled(greedy)
  assert any_sampled(np.concatenate([greedy, sampling_row(3, 0.25, 0, 1.0, 1)[None]]))


def test_engine_steps_branch_on_no_device_value(model):
  """XLA:GPU runs a `lax.cond` or a data-dependent while loop by copying its predicate to
  the host and waiting for it, which would make every dispatch synchronous: the steps hold
  neither (the multi-step decode is a scan of a fixed count), and a greedy step traces no
  sampler."""
  engine = _engine(model, decode_steps=3)
  slots, lanes = engine.max_slots, engine.prefill_lanes
  vector = lambda n: jnp.zeros((n,), jnp.int32)
  inputs = (engine.params, engine.cache, engine.workspace, engine._previous_tokens, vector(slots),
            vector(slots))
  prefill = (jnp.zeros((lanes, 16), jnp.int32), vector(lanes), vector(lanes), vector(lanes))
  for sampled in (False, True):
    settings = dict(sampled=sampled, attention_impl=engine.attention_impl)
    step = engine._step.trace(*inputs, vector(slots), vector(slots), prefill, engine._sampling,
                              **settings).jaxpr.jaxpr
    steps = engine._decode_steps.trace(*inputs, vector(slots), vector(slots), engine._sampling,
                                       num_steps=3, **settings).jaxpr.jaxpr
    for names in map(primitives_outside_kernels, (step, steps)):
      assert not names & HOST_SYNCING, names & HOST_SYNCING
      assert ("sort" in names) == sampled


def test_generate_command_serves_a_requests_file(tmp_path, capsys):
  """`python -m models.generate --requests FILE` (random demo model, plain-JAX attention):
  every request runs, a bad one is refused, and the summary is printed."""
  from models import generate as command
  path = tmp_path / "requests.jsonl"
  path.write_text('"Hello"\n{"prompt": "The sky is", "max_new_tokens": 2, "seed": 3}\n'
                  '{"prompt": "x", "max_new_tokens": -1}\n')
  assert command.main(["--requests", str(path), "--max-new-tokens", "3", "--attention", "xla"]) == 0
  captured = capsys.readouterr()
  assert "request 3 refused: max_new_tokens must be >= 0" in captured.err
  out = captured.out
  assert "2 requests, 5 new tokens" in out and "time to first token: p50" in out


# ----------------------------------------------------------------------------- one step ahead

def test_the_host_learns_tokens_one_step_late(model):
  """A step's tokens reach the handle when the next step is dispatched: the first `step`
  after a prompt books nothing; the decode that follows reads its input on the device."""
  prompt = _prompts((9,), seed=10)[0]
  engine = _engine(model, decode_steps=1)
  handle = engine.submit(prompt, NEW, stop_ids=())
  assert engine.step() and handle.tokens == []  # the prompt's step is in flight
  assert engine.step() and len(handle.tokens) == 1  # booked as the first decode was dispatched
  engine.run_until_idle()
  _check_alone(model, [handle])
  assert engine.stats["steps"] == NEW  # one prefill, NEW - 1 decodes: none past max_new_tokens


def test_a_slot_is_given_back_when_its_last_token_is_booked(model):
  """A request ending by length frees its slot as its last token is dispatched, before the
  host knows the token: a waiting request runs in the next step, and both answer as alone."""
  first, second = _prompts((9, 11), seed=15)
  engine = _engine(model, max_slots=1, decode_steps=1)
  handles = [engine.submit(first, 2, stop_ids=()), engine.submit(second, NEW, stop_ids=())]
  engine.step()  # the first prompt: draws its first token
  engine.step()  # its last decode: the slot is free while that token is in flight
  assert engine.scheduler.slots == [None] and not handles[0].done
  engine.step()  # the second prompt, as the first request's last token arrives
  assert handles[0].done and engine.scheduler.slots[0].handle is handles[1]
  engine.run_until_idle()
  assert handles[0].tokens == _generate_alone(model, tuple(first), 2)
  assert handles[1].tokens == _generate_alone(model, tuple(second), NEW)


def test_a_stop_seen_late_wastes_one_step_and_changes_nothing(model):
  """The stop token is known a step late: the row runs one more decode, whose token is
  dropped; the next request in its slot is unaffected."""
  prompts = _prompts((9, 14), seed=11)
  greedy = _generate_alone(model, tuple(prompts[0]), NEW)
  engine = _engine(model, max_slots=1)
  stopped = engine.submit(prompts[0], NEW, stop_ids=greedy[1])
  after = engine.submit(prompts[1], NEW, stop_ids=())
  engine.run_until_idle()
  assert stopped.tokens == greedy[:2] and stopped.finish_reason == "stop"
  _check_alone(model, [after])
  assert engine.allocator.available_pages == engine.allocator.num_pages


def test_multi_step_decode_stops_on_the_device_and_caches_only_what_it_fed(model):
  """Without prefill, one dispatch decodes up to decode_steps tokens per slot; a slot that
  draws a stop id stops feeding there. The stop token closes a page here: its KV was never
  written, so that page must not be offered to the prefix cache; a later prompt running
  through it must still match generate alone."""
  prompt = _prompts((9,), seed=13)[0]
  greedy = _generate_alone(model, tuple(prompt), 12)
  stop_at = next(j for j in range(12) if (len(prompt) + j + 1) % 8 == 0)  # 6: token 15 ends page 1
  assert greedy[stop_at] not in greedy[:stop_at]
  engine = _engine(model, max_slots=1, decode_steps=8)
  stopped = engine.submit(prompt, 12, stop_ids=greedy[stop_at])
  engine.run_until_idle()
  assert stopped.tokens == greedy[:stop_at + 1] and stopped.finish_reason == "stop"
  assert engine.stats["steps"] < 1 + stop_at  # fewer dispatches than decoded tokens
  assert engine.allocator.available_pages == engine.allocator.num_pages
  through = list(prompt) + greedy[:stop_at + 1] + _prompts((3,), seed=14)[0]
  again = engine.submit(through, NEW, stop_ids=())
  engine.run_until_idle()
  assert again.prefix_hit_tokens == 8  # page 0 only: page 1 ends with the unfed stop token
  _check_alone(model, [again])


def test_engine_loop_thread_safe_submit_and_cancel(model):
  """Requests submitted from several threads to the engine's own thread answer as alone; a
  bad request raises in its caller; a cancelled request frees its slot."""
  import concurrent.futures

  from models.serving.loop import EngineLoop
  prompts = _prompts((5, 23, 17, 30, 9), seed=12)
  loop = EngineLoop(_engine(model)).start()
  try:
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
      results = list(pool.map(lambda p: loop.submit(p, NEW, stop_ids=()).result(), prompts))
    assert results == [_generate_alone(model, tuple(p), NEW) for p in prompts]
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
      loop.submit(prompts[0], -1)
    long = loop.submit(prompts[1], 60, stop_ids=())
    first = next(iter(long))
    loop.cancel(long)
    rest = list(long)  # ends once the loop has taken the cancellation
    assert long.finish_reason == "cancelled" and len(rest) < 59 and first is not None
    assert loop.submit(prompts[2], NEW, stop_ids=()).result() == results[2]
    scheduler = loop.engine.scheduler
    assert all(s is None for s in scheduler.slots) and not scheduler.waiting
    assert loop.engine.allocator.available_pages == loop.engine.allocator.num_pages
  finally:
    loop.close()
  assert loop.error is None
