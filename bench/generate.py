"""End-to-end generation: Qwen2.5-1.5B shapes with random bf16 weights, through
models.qwen2's jitted prefill and decode step, with the attention of jaxflash (contiguous
and paged caches), jaxflash's plain-JAX path ("xla") and jax.nn's cuDNN; plus Hugging Face
transformers' generate (torch, sdpa, bf16) on the same shapes when torch sees a GPU.

Rows: batch 1 and 8 x prompts of 1K and 8K tokens, 128 new tokens. Per row: prefill ms
(median of a few runs; the first run compiles), decode ms/step (wall clock of one step
with block_until_ready, median over the steps), the pipelined ms/step (single steps
dispatched back to back, nothing read), the generate loop's ms/step (the Sampler's own
loop: several steps per dispatch, each call's tokens copied and read one call behind),
tokens/s = batch / the loop's ms/step, and the bytes floor of a step: (weights + K/V read
at the mean context) / the HBM read ceiling measured in the same run. Wall clock on purpose:
a user waits for the launch gaps too.

  python -m bench.generate [--quick] [--time-limit-s S] [--out DIR]   # GPU: ~5 min on an H200
  python -m bench.generate --smoke                                     # tiny config on the CPU
  python -m bench.generate --quick --loop-sweep 1,2,4,8,16             # steps per dispatch only
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import hbm_read_ceiling_gbs
from bench.cli import TimeLimit, bench_arguments, log, smoke_out_dir
from bench.environment import env_metadata
from bench.report import RESULTS_DIR, markdown_table, write_results
from bench.timing import error_text, free_memory, has_gpu, profile_trace, try_call
from bench.trace import gpu_kernel_events, summarize_kernels

NEW_TOKENS = 128
PREFILL_RUNS = 3  # the first compiles; the median of the other two is reported
HF_BUDGET_S = 100.0  # the Hugging Face rows stop starting new shapes after this
SYNCED_FRACTION = 0.5  # steps timed one by one; the rest run back to back (pipelined)
PROFILED_STEPS = 8  # the last steps, under the profiler: device time and kernels per step
LOOP_RUNS = 2  # whole generate calls timed after the steps above; the faster one is reported
# (label, attention_impl for models.qwen2 (one of jaxflash.IMPLEMENTATIONS), cache kind)
IMPLS = (("jaxflash paged", None, "paged"), ("jaxflash", None, "contiguous"),
         ("cudnn", "cudnn", "contiguous"), ("xla", "xla", "contiguous"))


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  prompt: int
  new_tokens: int = NEW_TOKENS


def model_bytes(model) -> int:
  from flax import nnx
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def kv_bytes_per_step(config, shape: Shape, itemsize: int) -> float:
  """K and V read by one decode step at the mean context of the run, all layers."""
  context = shape.prompt + shape.new_tokens / 2
  return (config.num_hidden_layers * shape.batch * context * config.num_key_value_heads *
          config.head_dim * 2 * itemsize)


def random_prompts(shape: Shape, vocab: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (shape.batch, shape.prompt), dtype=np.int32)


# ----------------------------------------------------------------------------- jaxflash / XLA / cuDNN

def bench_jax(model, shape: Shape, impl: str, cache_kind: str, page_size: int = 16,
              kv_dtype: str | None = None) -> dict:
  """Prefill and decode through models.qwen2's jitted steps for one (shape, attention, cache);
  kv_dtype "int8" / "float8_e4m3fn" for a quantized KV cache."""
  from models.qwen2 import PageAllocator, Sampler, SamplingParams

  sampler = Sampler(model, cache=cache_kind, page_size=page_size, attention_impl=impl, kv_dtype=kv_dtype)
  prompts = random_prompts(shape, model.config.vocab_size)
  tokens = jnp.asarray(prompts)
  lengths = jnp.full((shape.batch,), shape.prompt, jnp.int32)
  capacity = sampler.capacity(shape.prompt, shape.new_tokens)
  greedy = SamplingParams()
  eos = jnp.asarray([-1], jnp.int32)

  def fresh_cache():
    cache = sampler.make_cache(shape.batch, capacity)
    if cache_kind == "paged":
      allocator = PageAllocator(cache.num_pages, page_size, shape.batch, cache.block_table.shape[1])
      for row in range(shape.batch):
        allocator.reserve(row, shape.prompt + shape.new_tokens)
      cache = dataclasses.replace(cache, block_table=jnp.asarray(allocator.block_table))
    return jax.block_until_ready(cache)

  prefill_ms, compile_s = [], 0.0
  for run in range(PREFILL_RUNS):
    cache = fresh_cache()
    start = time.perf_counter()
    state = jax.block_until_ready(sampler.prefill(tokens, lengths, cache, jax.random.key(0), eos, greedy))
    elapsed = time.perf_counter() - start
    if run == 0:
      compile_s = elapsed
    else:
      prefill_ms.append(elapsed * 1e3)
    if run < PREFILL_RUNS - 1:
      del cache, state

  # Decode: the first step compiles; then steps timed one by one (synced), then the rest
  # dispatched back to back and timed together.
  steps = shape.new_tokens - 1
  synced = max(1, int(steps * SYNCED_FRACTION))
  start = time.perf_counter()
  state = jax.block_until_ready(sampler.decode(state, eos, greedy))
  compile_s += time.perf_counter() - start
  step_ms = []
  for _ in range(2, synced + 1):
    start = time.perf_counter()
    state = jax.block_until_ready(sampler.decode(state, eos, greedy))
    step_ms.append((time.perf_counter() - start) * 1e3)
  profiled = min(PROFILED_STEPS, max(0, steps - synced - 1)) if has_gpu() else 0
  start = time.perf_counter()
  rest = range(synced + 1, steps + 1 - profiled)
  for _ in rest:
    state = sampler.decode(state, eos, greedy)
  jax.block_until_ready(state.tokens)
  pipelined_ms = (time.perf_counter() - start) * 1e3 / max(len(rest), 1)

  # The last few steps under the profiler: the device time of a step (its kernels' durations
  # summed) and its kernel count, against the wall time above: the difference is launch gaps.
  step_device_ms = kernels_per_step = None
  if profiled:
    box = [state]

    def run_profiled():
      for _ in range(profiled):
        box[0] = sampler.decode(box[0], eos, greedy)
      jax.block_until_ready(box[0].tokens)

    trace = profile_trace(run_profiled)
    state = box.pop()
    events = gpu_kernel_events(trace) if trace else []
    if events:
      us, _, kernels_per_step = summarize_kernels(events, profiled)
      step_device_ms = us / 1e3
  lengths_now = np.asarray(state.cache.lengths)
  assert (lengths_now == shape.prompt + steps).all(), lengths_now
  del state
  # The generate loop itself (Sampler.__call__, the shapes above; its multi-step call compiles
  # in a first, untimed call): the sampler's steps_per_call steps a dispatch, plus its own host
  # work (copying and reading each call's tokens, one call behind; the page allocator's
  # bookkeeping). Best of LOOP_RUNS.
  _loop_ms_per_step(sampler, prompts, shape.new_tokens)
  loop_ms = min(_loop_ms_per_step(sampler, prompts, shape.new_tokens) for _ in range(LOOP_RUNS))
  median_step = statistics.median(step_ms) if step_ms else float("nan")
  return dict(prefill_ms=statistics.median(prefill_ms), decode_ms_step=median_step,
              pipelined_ms_step=pipelined_ms if rest else None, loop_ms_step=loop_ms,
              step_device_ms=step_device_ms, kernels_per_step=kernels_per_step,
              tokens_per_s=shape.batch / loop_ms * 1e3, compile_s=compile_s)


def _loop_ms_per_step(sampler, prompts: np.ndarray, new_tokens: int) -> float:
  """Wall ms per decode step of one `sampler(prompts, new_tokens)` call (EOS never stops it)."""
  out = sampler(prompts.tolist(), new_tokens, eos_token_id=())
  return out.decode_seconds * 1e3 / max(out.decode_steps, 1)


def loop_sweep(model, shapes, cases, counts, budget) -> list[dict]:
  """The generate loop's wall ms/step against the decode steps per dispatch (the Sampler's
  steps_per_call), per shape and attention; tokens checked against the first count's."""
  from models.qwen2 import Sampler

  rows = []
  for shape in shapes:
    prompts = random_prompts(shape, model.config.vocab_size)
    for label, impl, cache in cases:
      reference = None
      for count in counts:
        if budget.exhausted():
          break
        sampler = Sampler(model, cache=cache, attention_impl=impl, steps_per_call=count)
        start = time.perf_counter()
        first = sampler(prompts.tolist(), shape.new_tokens, eos_token_id=())  # compiles
        first_call_s = time.perf_counter() - start
        reference = first.tokens if reference is None else reference
        times = [_loop_ms_per_step(sampler, prompts, shape.new_tokens)
                 for _ in range(LOOP_RUNS)]
        rows.append(dict(batch=shape.batch, prompt=shape.prompt, new_tokens=shape.new_tokens,
                         impl=label, cache=cache, steps_per_call=count, loop_ms_step=min(times),
                         first_call_s=first_call_s, same_tokens=first.tokens == reference,
                         case=f"B={shape.batch} prompt {shape.prompt} {label}"))
        log(f"[{budget.elapsed():6.1f}s] {rows[-1]['case']} x{count}: {min(times):.3f} ms/step")
        free_memory()
  return rows


# ----------------------------------------------------------------------------- Hugging Face

def torch_device(smoke: bool):
  """'cuda' when torch sees a GPU ('cpu' in a smoke run), None when torch is missing."""
  try:
    import torch
  except ImportError:
    return None
  return "cuda" if torch.cuda.is_available() else ("cpu" if smoke else None)


def hf_model(config, device: str, dtype_name: str):
  import torch
  from transformers import Qwen2Config, Qwen2ForCausalLM
  hf_config = Qwen2Config(
      vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
      head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
      max_position_embeddings=config.max_position_embeddings,
      tie_word_embeddings=config.tie_word_embeddings, attn_implementation="sdpa")
  dtype = getattr(torch, dtype_name)
  with torch.device(device):
    model = Qwen2ForCausalLM(hf_config).to(dtype).eval()
  return model


def bench_hf(model, shape: Shape, device: str) -> dict:
  """transformers' generate: prefill = one forward over the prompts (last logits only),
  decode ms/step = (generate time - prefill) / (new tokens - 1): its generate loop's step,
  so the same figure fills the blocked, pipelined and generate-loop columns."""
  import torch

  def sync():
    if device == "cuda":
      torch.cuda.synchronize()

  ids = torch.tensor(random_prompts(shape, model.config.vocab_size), device=device)
  mask = torch.ones_like(ids)
  options = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
  with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **options)  # warm-up
    prefill = []
    for _ in range(PREFILL_RUNS - 1):
      sync()
      start = time.perf_counter()
      model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
      sync()
      prefill.append((time.perf_counter() - start) * 1e3)
    sync()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=shape.new_tokens, min_new_tokens=shape.new_tokens,
                         **options)
    sync()
    total_ms = (time.perf_counter() - start) * 1e3
  assert out.shape[1] == shape.prompt + shape.new_tokens
  prefill_ms = statistics.median(prefill)
  step = (total_ms - prefill_ms) / (shape.new_tokens - 1)
  return dict(prefill_ms=prefill_ms, decode_ms_step=step, pipelined_ms_step=step, loop_ms_step=step,
              tokens_per_s=shape.batch / step * 1e3, compile_s=None)


# ----------------------------------------------------------------------------- the run

def plan(args):
  """-> (model config, shapes, dtype name) of this run."""
  from models import qwen2
  if args.smoke:
    return qwen2.Qwen2Config.tiny(), [Shape(1, 32, 8), Shape(2, 64, 8)], "float32"
  shapes = [Shape(b, p) for p in (1024, 8192) for b in (1, 8)]
  if args.quick:
    shapes = [s for s in shapes if s.prompt == 1024]
  if args.shapes:
    wanted = {w.strip() for w in args.shapes.split(",")}
    shapes = [s for s in shapes if f"{s.batch}x{s.prompt}" in wanted]
  return qwen2.Qwen2Config.qwen2_5_1_5b(), shapes, "bfloat16"


def shape_key(shape: Shape) -> str:
  return f"{shape.batch}x{shape.prompt}+{shape.new_tokens}"


def hf_worker(args) -> None:
  """`--hf-worker FILE`: the Hugging Face rows, written to FILE as JSON (a separate process)."""
  config, shapes, dtype = plan(args)
  budget = TimeLimit(args.time_limit_s)
  result: dict = {"rows": {}, "note": None}
  device = torch_device(args.smoke)
  if device is None:
    result["note"] = "Hugging Face row skipped: torch with CUDA is not importable"
  else:
    log(f"transformers on {device}")
    model, err = try_call(hf_model, config, device, dtype)
    if model is None:
      result["note"] = f"Hugging Face model failed: {err}"
    for shape in shapes if model is not None else []:
      if budget.exhausted():
        result["rows"][shape_key(shape)] = {"error": "skipped (time budget)"}
        continue
      got, err = try_call(bench_hf, model, shape, device)
      result["rows"][shape_key(shape)] = got or {"error": err}
      log(f"  HF B={shape.batch} prompt={shape.prompt}: {got or err}")
  Path(args.hf_worker).write_text(json.dumps(result))


def run_hf_worker(args, budget: TimeLimit) -> tuple[dict, str | None]:
  """Runs this script with --hf-worker in a subprocess; -> ({shape key: row}, note)."""
  if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    return {}, "Hugging Face row skipped: torch or transformers is not installed"
  seconds = max(30.0, min(HF_BUDGET_S, args.time_limit_s - budget.elapsed()))
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "hf.json"
    command = [sys.executable, "-m", "bench.generate", "--hf-worker", str(out),
               "--time-limit-s", str(seconds)]
    command += ["--smoke"] if args.smoke else (["--quick"] if args.quick else [])
    log(f"[{budget.elapsed():6.1f}s] Hugging Face transformers (subprocess, {seconds:.0f} s budget)")
    try:
      subprocess.run(command, check=True, timeout=seconds + 180)
      result = json.loads(out.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as e:
      return {}, f"Hugging Face worker failed: {error_text(e)}"
  return result["rows"], result["note"]


def parse_args(argv=None):
  p = bench_arguments(__doc__, smoke="tiny config on the CPU, end to end", time_limit_s=330.0,
                      time_limit_help="no case starts after this many seconds",
                      quick="batch 1 and 8 at 1K only")
  p.add_argument("--impls", default=",".join(label for label, *_ in IMPLS) + ",hf",
                 help="comma-separated subset of: " + ", ".join(l for l, *_ in IMPLS) + ", hf")
  p.add_argument("--shapes", default=None, help="comma-separated BxPROMPT subset, e.g. 1x8192,8x8192")
  p.add_argument("--loop-sweep", default=None, metavar="COUNTS",
                 help="only sweep the generate loop's decode steps per dispatch, e.g. 1,2,4,8,16 "
                      "(writes generate_loop_sweep.*)")
  p.add_argument("--kv-dtype", choices=("int8", "float8_e4m3fn"), default=None,
                 help="keep the jaxflash / xla rows' KV cache quantized (unset: the model's dtype)")
  p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.hf_worker:
    return hf_worker(args)
  budget = TimeLimit(args.time_limit_s)
  from models import qwen2
  from models.qwen2.sampler import STEPS_PER_CALL

  wanted = {s.strip() for s in args.impls.split(",") if s.strip()}
  config, shapes, dtype = plan(args)
  hbm_gib = 1 / 64 if args.smoke else 4.0
  out_dir = smoke_out_dir("generate") if args.smoke else (args.out or RESULTS_DIR)
  rows, notes = [], []

  # Hugging Face first, in a process of its own: torch and JAX never share CUDA libraries
  # (each brings its own cuDNN), and torch is done before JAX takes its share of memory.
  hf_rows: dict = {}
  if "hf" in wanted and not args.loop_sweep:
    hf_rows, note = run_hf_worker(args, budget)
    if note:
      notes.append(note)

  meta = env_metadata()
  log(f"generate benchmark on {meta['device']} ({meta['backend']}), jax {meta['versions'].get('jax')}")
  ceiling, err = try_call(hbm_read_ceiling_gbs, hbm_gib)
  meta["ceilings"] = {"hbm_read_gbs": ceiling, "hbm_read_bytes": hbm_gib * 2**30} if ceiling else {
      "hbm_read_error": err}
  log(f"HBM read ceiling: {ceiling} GB/s")
  model = qwen2.random_model(config, seed=0, dtype=dtype)
  weights = model_bytes(model)
  itemsize = jnp.dtype(model.dtype).itemsize
  if args.kv_dtype:  # one byte a value, and a float32 scale per token and KV head
    itemsize = jnp.dtype(args.kv_dtype).itemsize + 4 / config.head_dim
  log(f"[{budget.elapsed():6.1f}s] model: {weights / 1e9:.2f} GB of {dtype} weights")

  if args.loop_sweep:
    return write_loop_sweep(args, model, shapes, wanted, meta, budget, out_dir)

  for shape in shapes:
    kv = kv_bytes_per_step(config, shape, itemsize)
    floor_ms = (weights + kv) / (ceiling * 1e9) * 1e3 if ceiling else None
    base = dict(batch=shape.batch, prompt=shape.prompt, new_tokens=shape.new_tokens,
                weights_gb=weights / 1e9, kv_read_gb=kv / 1e9, floor_ms=floor_ms)
    cases = [(label, impl, cache) for label, impl, cache in IMPLS if label in wanted]
    if not has_gpu() or args.kv_dtype:  # cuDNN reads no quantized cache
      cases = [c for c in cases if c[1] != "cudnn"]
    for label, impl, cache in cases:
      if budget.exhausted():
        notes.append(f"{label} B={shape.batch} prompt={shape.prompt}: skipped (time budget)")
        continue
      log(f"[{budget.elapsed():6.1f}s] {label} B={shape.batch} prompt={shape.prompt}")
      got, err = try_call(bench_jax, model, shape, impl, cache, kv_dtype=args.kv_dtype)
      free_memory()
      rows.append({**base, "impl": label, "cache": cache, "kv_dtype": args.kv_dtype or dtype,
                   **(got or {"error": err})})
      log(f"  {got or err}")
    if hf_rows.get(shape_key(shape)):
      rows.append({**base, "impl": "HF transformers (sdpa)", "cache": "HF DynamicCache",
                   **hf_rows[shape_key(shape)]})

  meta.update(
      title="End-to-end generation: Qwen2.5-1.5B shapes, random bf16 weights",
      model=dataclasses.asdict(config), dtype=dtype, smoke=args.smoke,
      generate_loop_steps_per_call=STEPS_PER_CALL,
      timing="wall clock (time.perf_counter around block_until_ready)",
      method=("prefill: median of runs 2-3 (run 1 compiles); decode ms/step: median wall clock of "
              "single steps, each blocked; pipelined: steps dispatched back to back / count; "
              "tokens/s: batch / generate loop ms/step; "
              f"generate loop: Sampler.__call__'s decode time / steps, {STEPS_PER_CALL} steps a "
              f"dispatch (best of {LOOP_RUNS} calls after one that compiles); "
              "floor: (weights + K/V read at the mean context) / HBM read ceiling"))
  meta["notes_header"] = [
      "Attention: jaxflash = the Pallas kernels (prefill, split-KV decode, paged decode, pages of 16); "
      "xla = jaxflash's plain-JAX path; cudnn = jax.nn.dot_product_attention(implementation='cudnn').",
      "Everything else (projections, MLP, norms, sampling: greedy) is the same jitted model code.",
  ]
  columns = [("batch", "B"), ("prompt", "prompt"), ("impl", "attention"), ("cache", "cache"),
             ("kv_dtype", "KV dtype"), ("prefill_ms", "prefill ms"),
             ("decode_ms_step", "decode ms/step (median)"),
             ("tokens_per_s", "tokens/s"), ("pipelined_ms_step", "pipelined ms/step"),
             ("loop_ms_step", "generate loop ms/step"),
             ("step_device_ms", "step device ms"), ("kernels_per_step", "kernels/step", "{:.0f}"),
             ("floor_ms", "floor ms/step"), ("floor_pct", "% of floor", "{:.0f}"),
             ("pipelined_over_floor", "pipelined / floor", "{:.2f}"),
             ("loop_over_floor", "loop / floor", "{:.2f}"),
             ("compile_s", "compile s"), ("error", "error")]
  plot = dict(kind="bar", x="case", y="loop_ms_step", logy=True,
              ylabel="generate loop ms/step (wall; log scale)",
              title="Qwen2.5-1.5B shapes, bf16, one H200: decode step time")
  for row in rows:
    if row.get("floor_ms") and row.get("decode_ms_step"):
      row["floor_pct"] = 100 * row["floor_ms"] / row["decode_ms_step"]
    if row.get("floor_ms") and row.get("pipelined_ms_step"):
      row["pipelined_over_floor"] = row["pipelined_ms_step"] / row["floor_ms"]
    if row.get("floor_ms") and row.get("loop_ms_step"):
      row["loop_over_floor"] = row["loop_ms_step"] / row["floor_ms"]
    row["case"] = f"B={row['batch']} prompt {row['prompt']} {row['impl']}"
  paths = write_results("generate", rows, meta, columns, plot=plot, out_dir=out_dir, notes=notes)
  log(markdown_table(rows, columns))
  log(f"wrote {', '.join(str(p) for p in paths.values())} in {budget.elapsed():.0f} s")
  return rows


def write_loop_sweep(args, model, shapes, wanted, meta, budget, out_dir) -> list[dict]:
  """--loop-sweep: runs `loop_sweep` for the jaxflash rows asked for and writes its results."""
  counts = [int(c) for c in args.loop_sweep.split(",")]
  cases = [(label, impl, cache) for label, impl, cache in IMPLS
           if label in wanted and label.startswith("jaxflash")]
  rows = loop_sweep(model, shapes, cases, counts, budget)
  meta.update(
      title="Generate loop vs decode steps per dispatch: Qwen2.5-1.5B shapes, random bf16 weights",
      model=dataclasses.asdict(model.config), smoke=args.smoke,
      timing="wall clock (time.perf_counter around Sampler.__call__'s decode loop)",
      method=(f"per row: one Sampler call that compiles, then the best of {LOOP_RUNS} calls' decode "
              "time / steps; same tokens: equal to the tokens of the sweep's first count"))
  columns = [("batch", "B"), ("prompt", "prompt"), ("impl", "attention"), ("cache", "cache"),
             ("steps_per_call", "steps per call", "{:.0f}"),
             ("loop_ms_step", "generate loop ms/step"), ("first_call_s", "first call s (compiles)"),
             ("same_tokens", "same tokens")]
  plot = dict(x="steps_per_call", y="loop_ms_step", series="case", logx=True,
              xlabel="decode steps per dispatch", ylabel="generate loop ms/step (wall)",
              title="Qwen2.5-1.5B shapes, bf16, one H200: generate loop vs steps per dispatch")
  paths = write_results("generate_loop_sweep", rows, meta, columns, plot=plot,
                        out_dir=out_dir)
  log(markdown_table(rows, columns))
  log(f"wrote {', '.join(str(p) for p in paths.values())} in {budget.elapsed():.0f} s")
  return rows


if __name__ == "__main__":
  main()
