"""Serving a request trace: the asynchronous continuous-batching engine (models/serving), in
Python and through its OpenAI-compatible HTTP server, against static batching with
models.qwen2's `generate`, on Qwen2.5-1.5B shapes with random bf16 weights.

The trace (fixed seed): Poisson arrivals at rates from light load to past saturation;
prompt and output lengths drawn from log-normal distributions with ShareGPT-like long tails
(medians ~220 and ~100 tokens, clipped to [64, 1024] and [8, 256]). A second trace puts one
2048-token system prompt in front of 80% of the prompts. Every run replays the trace in real
time: a request is submitted when its arrival time comes, and each token's time is when the
host (or the HTTP client) holds it. Each slot count (32, 128, 256) runs the sharegpt trace at
its saturating rate; the load curve (lower rates), the shared prompt and the ablations run at
32 slots, where fewer requests fill the slots.

  * engine: chunked prefill (2048-token step budget, chunks of 128 to 2048 tokens in up to 4
    lanes) + prefix caching, up to 4 decode steps a dispatch while no prompt is fed, stepped
    from the benchmark's thread;
  * engine_http: the same engine behind `python -m models.serve`'s app on a loopback port
    (engine thread, Starlette + uvicorn, streamed server-sent events), requests sent by an
    asyncio httpx client: the server's own cost is the gap to `engine`;
  * engine, no prefix cache (shared prompt); engine, no chunked prefill (whole prompts in
    one step); engine, one decode step a dispatch (what the multi-step dispatch gains);
  * static: `generate` on the requests arrived when the previous batch finished (up to the
    slot count; the batch is filled up with one-token prompts so that its shape is fixed),
    run until the batch's longest output (one decode step a call, so tokens stream one by
    one as the engine's do). The model's position limit is twice the engine's window, so
    that generate's power-of-two prompt bucket (4096 for the shared trace) plus 256 new
    tokens fits;
  * generate_step: the generate loop's decode step at the same batch (its ITL column),
    for reference: what a token costs without any serving.
Reported: output tokens/s and requests/s (first arrival to last token), TTFT (arrival to
first token) mean / p50 / p99, ITL (gaps between a request's tokens) p50 / p99, TPOT (a
request's time per output token after its first) p50 / p99, preemptions,
prefix-cache hits, and the engine's compilations (done in a warm-up before the clock starts;
static batching's prompt buckets are compiled the same way).

The bytes-and-FLOPs limit (`throughput_limit`, in the results' notes): with P parameters of
b bytes (bf16: 2), a decode step at batch B over a mean context of L tokens, layers n,
KV heads h_kv, head dim d, query heads h, and r prompt tokens per output token (each costs
a forward pass once), one step takes at least

  t = max( (b * P + B * L * n * 2 * h_kv * d * b) / HBM bandwidth,
           B * (2 * P * (1 + r) + 4 * L * n * h * d) / peak FLOP/s )

and the engine at most B / t output tokens/s (H200: 4.8 TB/s, 989 TFLOP/s dense bf16).

  python -m bench.serve [--quick] [--out DIR]     # GPU
  python -m bench.serve --slots 256 --merge       # a run split over calls: one serve.json
  python -m bench.serve --smoke                   # tiny model on the CPU, a few requests
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from bench import timing
from bench.cli import TimeLimit, bench_arguments, log, smoke_out_dir
from bench.environment import env_metadata
from bench.report import RESULTS_DIR, earlier_rows, format_value, write_results

SEED = 2026_12_01
SYSTEM_PROMPT = 2048
SHARED_FRACTION = 0.8


@dataclasses.dataclass(frozen=True)
class Shape:
  """What a run is made of (full H200 run, or the CPU smoke run)."""

  requests: int
  rates: tuple[float, ...]  # requests per second (Poisson)
  shared_rates: tuple[float, ...]  # rates of the shared-system-prompt trace
  prompt_median: float
  prompt_clip: tuple[int, int]
  output_median: float
  output_clip: tuple[int, int]
  system_prompt: int
  slots: tuple[int, ...]  # slot counts (the static batch) to run the sharegpt trace at
  token_budget: int
  prefill_lanes: int
  min_chunk: int
  max_seq_len: int


FULL = Shape(requests=512, rates=(16.0, 64.0, 256.0), shared_rates=(16.0, 64.0),
             prompt_median=220, prompt_clip=(64, 1024), output_median=100, output_clip=(8, 256),
             system_prompt=SYSTEM_PROMPT, slots=(32, 128, 256), token_budget=2048, prefill_lanes=4,
             min_chunk=128, max_seq_len=4096)
QUICK = dataclasses.replace(FULL, rates=(16.0, 256.0), shared_rates=(64.0,), slots=(32, 256))
SMOKE = Shape(requests=8, rates=(50.0,), shared_rates=(50.0,), prompt_median=20, prompt_clip=(4, 40),
              output_median=4, output_clip=(2, 6), system_prompt=24, slots=(4,), token_budget=32,
              prefill_lanes=2, min_chunk=16, max_seq_len=128)

H200_HBM_BYTES_S = 4.8e12
H200_BF16_FLOPS = 989e12


def throughput_limit(config, batch: int, context: float, prompt_per_output: float, *,
                     hbm_bytes_s: float = H200_HBM_BYTES_S, flops_s: float = H200_BF16_FLOPS,
                     bytes_per_value: int = 2) -> dict:
  """The module docstring's bytes-and-FLOPs bound on output tokens/s at `batch` slots."""
  c = config
  params = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * (
      c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
      + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
  kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * bytes_per_value
  step_bytes = bytes_per_value * params + batch * context * kv_per_token
  step_flops = batch * (2 * params * (1 + prompt_per_output)
                        + 4 * context * c.num_hidden_layers * c.num_attention_heads * c.head_dim)
  step_s = max(step_bytes / hbm_bytes_s, step_flops / flops_s)
  return dict(params=params, step_bytes=step_bytes, step_flops=step_flops, step_ms=step_s * 1e3,
              bound="bytes" if step_bytes / hbm_bytes_s >= step_flops / flops_s else "FLOPs",
              output_tok_s=batch / step_s)


@dataclasses.dataclass(frozen=True)
class TraceRequest:
  arrival: float  # seconds after the trace's start
  prompt: tuple[int, ...]
  output_len: int


def make_trace(shape: Shape, rate: float, vocab: int, *, shared: bool) -> list[TraceRequest]:
  """The same lengths and tokens for every rate of a trace kind (only arrivals scale)."""
  rng = np.random.default_rng(SEED + shared)
  n = shape.requests
  gaps = rng.exponential(1.0, n)
  arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
  prompt_lens = np.clip(rng.lognormal(np.log(shape.prompt_median), 0.9, n), *shape.prompt_clip).astype(int)
  output_lens = np.clip(rng.lognormal(np.log(shape.output_median), 0.8, n), *shape.output_clip).astype(int)
  system = rng.integers(0, vocab, shape.system_prompt).tolist()
  with_system = rng.random(n) < SHARED_FRACTION
  trace = []
  for i in range(n):
    prompt = rng.integers(0, vocab, prompt_lens[i]).tolist()
    if shared and with_system[i]:
      prompt = system + prompt
    trace.append(TraceRequest(float(arrivals[i] / rate), tuple(prompt), int(output_lens[i])))
  return trace


# ----------------------------------------------------------------------------- replaying

def replay_engine(engine, trace):
  """Submits each request at its arrival time and steps the engine meanwhile.
  -> per request (arrival, token times) in perf_counter seconds."""
  start = time.perf_counter()
  pending, handles = list(trace), []
  while pending or not engine.idle:
    now = time.perf_counter() - start
    while pending and pending[0].arrival <= now:
      r = pending.pop(0)
      handles.append(engine.submit(r.prompt, r.output_len, stop_ids=(), arrival=start + r.arrival))
    if not engine.step() and pending:
      time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - start)))
  return [(h.arrival, h.token_times) for h in handles]


def replay_static(sampler, trace, batch: int, max_new: int):
  """Static batching: the requests waiting when the previous batch ends (at most `batch`)
  form the next one, run by `generate` until its longest output is done."""
  start = time.perf_counter()
  results, i = [], 0
  while i < len(trace):
    wait = trace[i].arrival - (time.perf_counter() - start)
    if wait > 0:
      time.sleep(wait)
    now = time.perf_counter() - start
    group = [r for r in trace[i:i + batch] if r.arrival <= now]
    i += len(group)
    times: list[float] = []
    longest = max(r.output_len for r in group)

    def stream(_step_tokens):
      times.append(time.perf_counter())
      return len(times) >= longest  # True stops the batch

    # Always `batch` rows (one-token fillers): one compilation per prompt bucket, not per size.
    prompts = [list(r.prompt) for r in group] + [[0]] * (batch - len(group))
    sampler(prompts, max_new, eos_token_id=(), stream=stream)
    results += [(start + r.arrival, times[:r.output_len]) for r in group]
  return results


class IdTokenizer:
  """Token ids as text ("<id> "), for a model without a tokenizer behind the HTTP server: a
  streamed chunk holds as many tokens as it has "<" (a multi-step dispatch sends several)."""

  def encode(self, text: str):
    raise NotImplementedError("the benchmark sends token ids")

  def decode(self, ids) -> str:
    return "".join(f"<{i}> " for i in ids)

  def token_to_id(self, token: str):
    return None


def _stream_requests(url: str, requests) -> list:
  """An asyncio httpx client streaming each (arrival, prompt, max_tokens) request from its
  arrival time -> per request (arrival, token times), on time.perf_counter (CLOCK_MONOTONIC,
  one clock for every process of the host). Runs in a process of its own, so that the
  client does not share the server's interpreter lock."""
  import asyncio
  import json

  import httpx

  async def one(client, start, arrival, prompt, max_tokens):
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    times = []
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    async with client.stream("POST", url, json=body) as reply:
      async for line in reply.aiter_lines():
        if line.startswith("data: {"):
          text = json.loads(line[6:])["choices"][0]["text"]
          times += [time.perf_counter()] * text.count("<")  # IdTokenizer: "<id> " a token
    return start + arrival, times

  async def run_all():
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
      # One request first, outside the clock: the first trip through the stack is slow.
      await client.post(url, json=dict(prompt=[1, 2, 3], max_tokens=2, temperature=0))
      start = time.perf_counter()
      return await asyncio.gather(*(one(client, start, *r) for r in requests))

  return list(asyncio.run(run_all()))


def replay_http(engine, trace):
  """The trace through the OpenAI-compatible server (engine in its thread, uvicorn on a
  loopback port), streamed by a client in another process (`_stream_requests`).
  -> per request (arrival, token times)."""
  import concurrent.futures
  import multiprocessing
  import threading

  from models import serve
  from models.serving.chat import ChatTemplate
  from models.serving.loop import EngineLoop
  from models.serving.openai_api import OpenAIServer

  loop = EngineLoop(engine).start()
  server = OpenAIServer(loop, IdTokenizer(), model_name="bench", stop_ids=(), chat_template=ChatTemplate())
  sock = serve.listening_socket("127.0.0.1", 0)
  web = serve.uvicorn_server(server, sock)
  thread = threading.Thread(target=web.run, kwargs=dict(sockets=[sock]), daemon=True)
  thread.start()
  while not web.started:
    time.sleep(0.01)
  url = serve.url_of(sock) + "/v1/completions"
  requests = [(r.arrival, [int(t) for t in r.prompt], int(r.output_len)) for r in trace]
  try:
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
      return pool.submit(_stream_requests, url, requests).result()
  finally:
    web.should_exit = True
    thread.join(10)
    loop.close()


def metrics(results) -> dict:
  arrivals = [a for a, _ in results]
  ends = [t[-1] for _, t in results if t]
  ttft = np.array([t[0] - a for a, t in results if t])
  itl = np.concatenate([np.diff(t) for _, t in results if len(t) > 1] or [np.zeros(0)])
  # Time per output token after the first, per request: unlike ITL, blind to tokens that
  # arrive in bursts (a multi-step dispatch hands the host several at once).
  tpot = np.array([(t[-1] - t[0]) / (len(t) - 1) for _, t in results if len(t) > 1])
  tokens = sum(len(t) for _, t in results)
  span = max(ends) - min(arrivals)
  pct = lambda x, q: float(np.percentile(x, q) * 1e3) if len(x) else None
  return dict(output_tok_s=tokens / span, requests_s=len(results) / span, span_s=span,
              ttft_mean_ms=float(ttft.mean() * 1e3), ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99),
              itl_p50_ms=pct(itl, 50), itl_p99_ms=pct(itl, 99), tpot_p50_ms=pct(tpot, 50),
              tpot_p99_ms=pct(tpot, 99), output_tokens=tokens)


# ----------------------------------------------------------------------------- the systems

ENGINES = {  # label -> Engine options
    "engine": dict(chunked_prefill=True, prefix_caching=True),
    "engine_http": dict(chunked_prefill=True, prefix_caching=True),
    "engine_no_prefix": dict(chunked_prefill=True, prefix_caching=False),
    "engine_no_chunking": dict(chunked_prefill=False, prefix_caching=True),
    "engine_single_step": dict(chunked_prefill=True, prefix_caching=True, decode_steps=1),
}
LABELS = {"engine": "engine (chunked + prefix cache)", "engine_http": "engine through HTTP",
          "engine_no_prefix": "engine, no prefix cache", "engine_no_chunking": "engine, no chunked prefill",
          "engine_single_step": "engine, one decode step a dispatch",
          "static": "static batching (generate)", "generate_step": "generate loop's decode step"}


def build(args, shape: Shape):
  import jax.numpy as jnp

  from models import qwen2
  if args.smoke:
    config = qwen2.Qwen2Config.tiny(max_position_embeddings=2 * shape.max_seq_len)
    return qwen2.random_model(config, seed=0, dtype="float32"), "xla"
  config = qwen2.Qwen2Config.qwen2_5_1_5b(max_position_embeddings=2 * shape.max_seq_len)
  model = qwen2.random_model(config, seed=0, dtype=jnp.bfloat16)
  return model, None


def run_engine(label, model, impl, shape, trace, slots):
  from models.serving import Engine
  engine = Engine(model, max_slots=slots, page_size=16, max_seq_len=shape.max_seq_len,
                  token_budget=shape.token_budget, prefill_lanes=shape.prefill_lanes,
                  min_chunk=shape.min_chunk, attention_impl=impl, **ENGINES[label])
  start = time.perf_counter()
  engine.warm_up(sampling=False)  # the traces' requests are greedy
  # A few requests first (a prompt per chunk bucket, tokens the traces never use): the
  # first real run of each step is slow (~80 ms on the CPU) even once compiled; not in the clock.
  vocab = model.config.vocab_size
  for bucket in engine.scheduler.buckets:
    length = min(bucket, shape.max_seq_len - 2)
    engine.submit([(7 * i + 1) % vocab for i in range(length)], 2, stop_ids=())
  engine.run_until_idle()
  engine.scheduler.stats.clear()
  warm_s = time.perf_counter() - start
  row = metrics(replay_http(engine, trace) if label == "engine_http" else replay_engine(engine, trace))
  stats = engine.stats
  row.update(preemptions=stats.get("preemptions", 0), prefix_hit_tokens=stats.get("prefix_hit_tokens", 0),
             prefill_tokens=stats.get("prefill_tokens", 0), steps=stats.get("steps", 0),
             compilations=engine.compilations, warm_up_s=warm_s)
  return row


def run_static(model, impl, shape, trace, slots):
  from models.qwen2 import Sampler
  from models.qwen2.sampler import prompt_bucket
  max_new = shape.output_clip[1]
  sampler = Sampler(model, cache="paged", attention_impl=impl, steps_per_call=1)
  start = time.perf_counter()
  # A batch's prompts are padded to the bucket of its longest: compile every bucket the
  # trace can produce (a two-step run each), outside the clock.
  buckets = sorted({prompt_bucket(len(r.prompt)) for r in trace})
  for bucket in buckets:
    steps = iter([False])
    sampler([[0] * bucket] + [[0]] * (slots - 1), max_new, eos_token_id=(),
            stream=lambda _: next(steps, True))
  warm_s = time.perf_counter() - start
  row = metrics(replay_static(sampler, trace, slots, max_new))
  row.update(compilations=2 * len(buckets), warm_up_s=warm_s)
  return row


def run_generate_step(model, impl, shape, trace, slots):
  """The generate loop's decode step at batch `slots`, prompts of the trace's median length."""
  from models.qwen2 import Sampler
  length = int(np.median([len(r.prompt) for r in trace]))
  new = min(64, shape.output_clip[1])
  sampler = Sampler(model, cache="paged", attention_impl=impl)
  prompts = [[(7 * i + j) % model.config.vocab_size for j in range(length)] for i in range(slots)]
  sampler(prompts, new, eos_token_id=())  # compiles
  result = sampler(prompts, new, eos_token_id=())
  step_ms = result.decode_seconds / max(result.decode_steps, 1) * 1e3
  return dict(output_tok_s=slots / step_ms * 1e3, itl_p50_ms=step_ms, output_tokens=slots * new)


def columns():
  return [("trace", "trace"), ("slots", "slots"), ("rate", "rate (req/s)"),
          ("system", "system", lambda s: LABELS[s]),
          ("output_tok_s", "output tok/s", "{:.0f}"), ("requests_s", "req/s", "{:.2f}"),
          ("ttft_mean_ms", "TTFT mean ms", "{:.0f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
          ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
          ("itl_p99_ms", "ITL p99 ms", "{:.1f}"), ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
          ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"), ("preemptions", "preempted"),
          ("prefix_hit_tokens", "prefix-hit tokens"), ("compilations", "compiles")]


def _cell(row) -> tuple:
  return row["trace"], row["slots"], row["rate"], row["system"]


def merged(earlier: list[dict], earlier_notes: list[str], rows: list[dict], notes: list[str]):
  """(rows, notes) of a run split over several calls: the earlier rows of cells this run did
  not run, then this run's; notes once each, less those saying a cell that now has a row was
  skipped or failed."""
  ran = {_cell(r) for r in rows}
  rows = [r for r in earlier if _cell(r) not in ran] + rows
  done = tuple(f"{trace} {rate}/s {slots} slots {system}:"
               for trace, slots, rate, system in map(_cell, rows))
  notes = [n for n in dict.fromkeys([*earlier_notes, *notes]) if not n.startswith(done)]
  return rows, notes


def plots(rows) -> list[dict]:
  """The load plots (TTFT p99, ITL p50, output tokens/s against the arrival rate) of each
  trace and slot count the rows hold."""
  return [{"suffix": f"_{kind}_{slots}_{metric}", "x": "rate", "y": metric, "series": "system",
           "logx": True, "labels": LABELS, "xlabel": "arrival rate (req/s)", "ylabel": label,
           "where": lambda r, k=kind, n=slots: r["trace"] == k and r["slots"] == n
           and r["system"] != "generate_step",
           "title": f"{label} against load ({kind} trace, {slots} slots)"}
          for kind, slots in dict.fromkeys((r["trace"], r["slots"]) for r in rows
                                           if r["system"] != "generate_step")
          for metric, label in (("ttft_p99_ms", "TTFT p99 (ms)"), ("itl_p50_ms", "ITL p50 (ms)"),
                                ("output_tok_s", "output tokens/s"))]


def main(argv=None):
  p = bench_arguments(__doc__, smoke="tiny model on the CPU, a few requests", time_limit_s=1500.0,
                      quick="two rates (light and past saturation), 32 and 256 slots")
  p.add_argument("--systems", default=None, help="comma-separated systems to run (default all): "
                 + ", ".join(LABELS))
  p.add_argument("--slots", default=None, help="comma-separated slot counts (default the shape's)")
  p.add_argument("--token-budget", type=int, default=None,
                 help="the engine's step budget (default the shape's)")
  p.add_argument("--merge", action="store_true",
                 help="keep the rows of <out>/serve.json (this commit's) whose cells this run does "
                      "not run: a run split over several calls")
  args = p.parse_args(argv)
  budget = TimeLimit(args.time_limit_s)
  shape = SMOKE if args.smoke else (QUICK if args.quick else FULL)
  if args.slots:
    shape = dataclasses.replace(shape, slots=tuple(int(n) for n in args.slots.split(",")))
  if args.token_budget:
    shape = dataclasses.replace(shape, token_budget=args.token_budget)
  systems = set(args.systems.split(",")) if args.systems else set(LABELS)
  if systems - set(LABELS):
    p.error(f"--systems takes {', '.join(LABELS)}, got {', '.join(sorted(systems - set(LABELS)))}")
  out_dir = smoke_out_dir("serve") if args.smoke else Path(args.out or RESULTS_DIR)
  meta = env_metadata()
  earlier = earlier_rows(out_dir / "serve.json", meta.get("commit")) if args.merge else ([], [])
  merge_note = ["--merge: the rows of cells this call did not run come from an earlier call of "
                "this commit (the metadata is this call's)"] if earlier[0] else []
  log(f"serve benchmark on {meta['device']} ({meta['backend']})")
  model, impl = build(args, shape)
  meta.update(title="Serving a Poisson request trace: continuous batching vs static batching",
              model="Qwen2.5-1.5B shapes, random bf16 weights" if not args.smoke else "tiny, float32",
              shape=dataclasses.asdict(shape), smoke=args.smoke, seed=SEED,
              timing="wall clock on the host: a token counts when the host holds it")
  # Most telling first, so that a run cut short by its budget still has them.
  top = max(shape.rates)
  cells = [("sharegpt", top, slots, system) for slots in shape.slots
           for system in ("engine", "static", "engine_http", "generate_step", "engine_single_step")]
  cells += [("shared_system_prompt", rate, shape.slots[0], system)
            for rate in sorted(shape.shared_rates, reverse=True)
            for system in ("engine", "engine_no_prefix", "static")]
  # Below saturation the slot count hardly matters: the load curve runs at the first one.
  cells += [("sharegpt", rate, shape.slots[0], system)
            for rate in sorted(shape.rates, reverse=True) if rate != top
            for system in ("engine", "static", "engine_http")]
  cells += [("sharegpt", top, shape.slots[0], "engine_no_chunking")]
  cells = [cell for cell in cells if cell[3] in systems]
  rows = []
  notes = ["compiles: the compilations a run's warm-up added (engines and samplers of one model "
           "share their compiled steps, so later runs reuse the earlier ones: 0)",
           "static batching fills each batch up to the slot count with one-token prompts and runs "
           "it to its longest output, one decode step a call",
           "the engine decodes up to 4 tokens a dispatch while no prompt is fed; they reach the host "
           "together, so its ITL p50 is a gap inside such a burst: TPOT (a request's time per output "
           "token after its first) compares the systems", *merge_note]
  vocab = model.config.vocab_size
  sharegpt = make_trace(shape, 1.0, vocab, shared=False)
  prompt_per_output = np.mean([len(r.prompt) for r in sharegpt]) / np.mean([r.output_len for r in sharegpt])
  context = np.mean([len(r.prompt) + r.output_len / 2 for r in sharegpt])
  for slots in shape.slots:
    limit = throughput_limit(model.config, slots, context, prompt_per_output)
    notes.append(f"bytes-and-FLOPs limit on the H200 at {slots} slots (sharegpt: mean context {context:.0f}, "
                 f"{prompt_per_output:.2f} prompt tokens per output token): {limit['step_ms']:.2f} ms a step "
                 f"({limit['bound']}-bound) = {limit['output_tok_s']:.0f} output tok/s")
  for trace_kind, rate, slots, system in cells:
    if budget.exhausted():
      notes.append(f"{trace_kind} {rate}/s {slots} slots {system}: skipped (time budget)")
      continue
    trace = make_trace(shape, rate, vocab, shared=trace_kind != "sharegpt")
    log(f"[{budget.elapsed():6.1f}s] {trace_kind} at {rate}/s, {slots} slots: {LABELS[system]}")
    run = {"static": run_static, "generate_step": run_generate_step}.get(system)
    if run is not None:
      row, err = timing.try_call(run, model, impl, shape, trace, slots)
    else:
      row, err = timing.try_call(run_engine, system, model, impl, shape, trace, slots)
    if err:
      notes.append(f"{trace_kind} {rate}/s {slots} slots {system}: failed: {err[:300]}")
      log(f"  failed: {err}")
      continue
    rows.append(dict(trace=trace_kind, slots=slots, rate=rate, system=system, **row))
    log("  " + ", ".join(f"{k} {format_value(v)}" for k, v in row.items()))
    so_far, so_far_notes = merged(*earlier, rows, notes)
    write_results("serve", so_far, meta, columns(), out_dir=out_dir, notes=so_far_notes)
  rows, notes = merged(*earlier, rows, notes)
  paths = write_results("serve", rows, meta, columns(), out_dir=out_dir, notes=notes, plot=plots(rows))
  log(f"wrote {paths['md']}")
  return 0


if __name__ == "__main__":
  main()
