"""Time per call of a jitted function: device time from the profiler, wall time for whole steps.

Why device time: a wall-clock loop over a jitted function also measures JAX's host-side
launch gaps; for a 40 us decode kernel the wall clock read twice the device time on the
H200. So a kernel is timed as the sum of the durations of every GPU kernel one call
launches (transposes, memsets and split-KV combines included), read from a `jax.profiler`
trace (bench/trace.py). Wall time is kept for whole generate steps, where launch gaps are
part of what a user waits for. Without a GPU every timing falls back to the wall clock and
says so in its `method`.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Sequence

import jax

from bench import trace as trace_events

MAX_ITERS = 50
DEVICE = "device (profiler: sum of GPU kernel durations)"
WALL_NO_GPU = "wall (no GPU)"
RETIMED_ALONE = "; re-timed alone (kernels not attributable by module)"


@dataclasses.dataclass
class Timing:
  """One case's time per call. `us` is device time (sum of its GPU kernels' durations)
  unless `method` says wall clock; `kernels` maps kernel name -> us per call."""

  us: float
  kernels: dict = dataclasses.field(default_factory=dict)
  launches: float = 0.0  # kernels per call
  iters: int = 0
  method: str = DEVICE
  wall_us: float | None = None  # median wall clock per call, for comparison
  temp_bytes: int | None = None  # XLA scratch of the compiled call (memory_analysis)
  output: Any = dataclasses.field(default=None, repr=False)  # first call's result (keep_output)

  def kernel_us(self, *patterns: str) -> float:
    """Sum of the kernels whose name contains any of `patterns` (case-insensitive)."""
    pats = [p.lower() for p in patterns]
    return sum(us for name, us in self.kernels.items() if any(p in name.lower() for p in pats))

  def as_dict(self, top: int = 8) -> dict:
    kernels = dict(list(self.kernels.items())[:top])
    return {"us": self.us, "method": self.method, "iters": self.iters, "launches": self.launches,
            "wall_us": self.wall_us, "temp_bytes": self.temp_bytes, "kernels": kernels}


def has_gpu() -> bool:
  return jax.default_backend() == "gpu"


class ArgSets:
  """Several argument tuples of the same shapes for one case: call i uses set i % len.

  A decode benchmark wants every cache read cold from DRAM (>= 512 MiB of caches, far past
  the 60 MB L2) yet a compiled function of bounded size: it can hold fewer layers and rotate
  between sets of caches; between two reads of one cache all the others are read."""

  def __init__(self, sets: Sequence[tuple]):
    if not sets:
      raise ValueError("ArgSets needs at least one argument tuple")
    self.sets = [tuple(s) for s in sets]

  def __len__(self):
    return len(self.sets)


def _arg_sets(args) -> list[tuple]:
  return args.sets if isinstance(args, ArgSets) else [tuple(args)]


def _run_calls(fn, args, iters: int) -> list[float]:
  """Runs `iters` calls (rotating through ArgSets), each blocked; returns wall us per call."""
  sets, samples = _arg_sets(args), []
  for i in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*sets[i % len(sets)]))
    samples.append((time.perf_counter() - t0) * 1e6)
  return samples


def choose_iters(wall_us: float, sets: int = 1, target_s: float = 0.15, min_iters: int = 3,
                 max_iters: int = MAX_ITERS) -> int:
  """Enough calls to fill ~target_s of timed work, within [min_iters, max_iters], rounded up
  to a whole number of rotations through `sets` argument sets."""
  n = min_iters if not wall_us or not math.isfinite(wall_us) else int(
      min(max_iters, max(min_iters, round(target_s * 1e6 / wall_us))))
  return -(-n // sets) * sets


def warm_up(fn, args, warmup: int = 2):
  """Runs `fn` `warmup` times, at least once per argument set (the first call compiles);
  returns (the first call's result, on the first set; median wall us of the later calls)."""
  sets, first, samples = _arg_sets(args), None, []
  for i in range(max(warmup, len(sets), 1)):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*sets[i % len(sets)]))
    samples.append((time.perf_counter() - t0) * 1e6)
    if i == 0:
      first = out
    del out
  return first, statistics.median(samples[1:] or samples)


def _case_tag(i: int) -> str:
  return f"bcase{i:03d}x"  # no tag is a substring of another: "bcase001x" vs "bcase010x"


def compile_named(fn, args, name: str):
  """`fn` jitted under the name `name` and compiled for `args` (the first set of ArgSets):
  its kernels then carry hlo_module "jit_<name>" in the trace, and the executable reports
  its scratch memory."""
  def wrapper(*a):
    return fn(*a)
  wrapper.__name__ = wrapper.__qualname__ = name
  return jax.jit(wrapper).lower(*_arg_sets(args)[0]).compile()


def profile_trace(run: Callable[[], None]) -> dict | None:
  """Runs `run` under jax.profiler.trace in a /tmp dir; returns the parsed trace (or None)."""
  trace_dir = tempfile.mkdtemp(prefix="jaxflash_trace_", dir="/tmp")
  try:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      run()
    path = trace_events.find_perfetto_trace(trace_dir)
    return trace_events.load_trace(path) if path else None
  finally:
    shutil.rmtree(trace_dir, ignore_errors=True)


def _temp_bytes(compiled) -> int | None:
  try:
    stats = compiled.memory_analysis()
    return None if stats is None else int(stats.temp_size_in_bytes)
  except Exception:  # noqa: BLE001 -- not every backend reports it
    return None


def device_time_us(fn, *args, warmup: int = 2, iters: int | None = None) -> Timing:
  """Device time of one call of `fn(*args)`: every GPU kernel one call launches, summed,
  from a profiler trace of `iters` calls (None: enough for ~0.15 s). Returns a Timing
  (`.us`, `.kernels` breakdown). Without a GPU: the median wall clock, method "wall (no GPU)".
  A single ArgSets argument rotates the calls through its sets."""
  if len(args) == 1 and isinstance(args[0], ArgSets):
    args = args[0]
  nsets = len(_arg_sets(args))
  _, wall = warm_up(fn, args, warmup)
  iters = -(-iters // nsets) * nsets if iters else choose_iters(wall, nsets)
  if not has_gpu():
    med = statistics.median(_run_calls(fn, args, iters))
    return Timing(med, {}, 0.0, iters, WALL_NO_GPU, med)
  trace = profile_trace(lambda: _run_calls(fn, args, iters))
  events = trace_events.gpu_kernel_events(trace) if trace else []
  if not events:
    med = statistics.median(_run_calls(fn, args, iters))
    return Timing(med, {}, 0.0, iters, "wall (no GPU events in the profiler trace)", med)
  us, kernels, launches = trace_events.summarize_kernels(events, iters)
  return Timing(us, kernels, launches, iters, DEVICE, wall)


def device_times_us(cases: dict, *, warmup: int = 2, iters: int | None = None,
                    max_iters: int = MAX_ITERS, keep_output: bool = False,
                    log: Callable[[str], None] | None = None) -> dict:
  """Times several cases in ONE profiler trace, their calls interleaved: {name: (fn, args)}
  -> {name: Timing or {"error": text}}; args is a tuple, or an ArgSets to rotate through.

  `fn` must be traceable (a Python function or a jax.jit one). Each case is compiled as its
  own module with a unique name (Timing.temp_bytes gets its scratch memory); a kernel event
  is assigned to the case whose module name its "hlo_module" arg carries. If any GPU event
  cannot be assigned that way (no hlo_module, or an unknown one), the attribution is not
  trusted and every case is re-timed in a profiler trace of its own (`device_time_us`; its
  method then says so).
  max_iters bounds the calls per case (a call that runs many layers needs few, and keeps the
  trace small); keep_output stores the first call's result (first argument set) in
  Timing.output, for checking the answer without compiling again.
  """
  log = log or (lambda s: None)
  outputs = {}
  prepared, results = {}, {}
  for i, (name, (fn, args)) in enumerate(cases.items()):
    tag = _case_tag(i)
    try:
      compiled = compile_named(fn, args, tag)
      first, wall = warm_up(compiled, args, warmup)
      if keep_output:
        outputs[name] = first
      del first
      nsets = len(_arg_sets(args))
      n = -(-iters // nsets) * nsets if iters else choose_iters(wall, nsets, max_iters=max_iters)
      prepared[name] = (tag, compiled, args, n, wall)
    except Exception as e:  # noqa: BLE001 -- one failing peer must not lose the run
      results[name] = {"error": error_text(e)}
      log(f"  {name}: ERROR {error_text(e)[:300]}")
  if not prepared:
    return results
  results = _time_prepared(prepared, results, log)
  for name, out in outputs.items():
    if isinstance(results.get(name), Timing):
      results[name].output = out
  return results


def _time_prepared(prepared: dict, results: dict, log: Callable[[str], None]) -> dict:
  if not has_gpu():
    for name, (tag, compiled, args, n, wall) in prepared.items():
      med = statistics.median(_run_calls(compiled, args, n))
      results[name] = Timing(med, {}, 0.0, n, WALL_NO_GPU, med, _temp_bytes(compiled))
    return results

  failed: dict[str, str] = {}

  def run():
    # The cases' calls interleave, one of each in turn until each has made its count, so
    # that clocks or temperature drifting during the trace weigh on every case alike.
    calls = {name: (compiled, _arg_sets(args), n)
             for name, (_, compiled, args, n, _) in prepared.items()}
    done = {name: 0 for name in prepared}
    while done:
      for name in list(done):
        compiled, sets, n = calls[name]
        try:
          jax.block_until_ready(compiled(*sets[done[name] % len(sets)]))
        except Exception as e:  # noqa: BLE001
          failed[name] = error_text(e)
          del done[name]
          continue
        done[name] += 1
        if done[name] >= n:
          del done[name]

  trace = profile_trace(run)
  events = trace_events.gpu_kernel_events(trace) if trace else []
  by_case, unassigned = trace_events.attribute_events(events, {name: p[0] for name, p in prepared.items()})
  trusted = bool(events) and unassigned == 0 and all(by_case[n] for n in prepared if n not in failed)
  if not trusted:
    log(f"  {unassigned} of {len(events)} GPU events carry no known hlo_module: each case re-timed alone")
  for name, (tag, compiled, args, n, wall) in prepared.items():
    if name in failed:
      results[name] = {"error": failed[name]}
      log(f"  {name}: ERROR {failed[name][:300]}")
      continue
    if trusted:
      us, kernels, launches = trace_events.summarize_kernels(by_case[name], n)
      results[name] = Timing(us, kernels, launches, n, DEVICE, wall, _temp_bytes(compiled))
    else:
      try:
        results[name] = device_time_us(compiled, args if isinstance(args, ArgSets) else ArgSets([args]),
                                       warmup=1, iters=n)
        results[name].temp_bytes = _temp_bytes(compiled)
        results[name].method += RETIMED_ALONE
      except Exception as e:  # noqa: BLE001
        results[name] = {"error": error_text(e)}
  return results


def error_text(e: BaseException, limit: int = 600) -> str:
  """The exception's type and message on one line (the tail, where XLA puts the cause)."""
  text = f"{type(e).__name__}: {e}".replace("\n", " | ")
  return text if len(text) <= limit else text[:200] + " ... " + text[-(limit - 205):]


def try_call(fn, *args, **kwargs):
  """(result, None) or (None, error text): every benchmark cell goes through this, so that
  one failing cell is recorded and the run goes on."""
  try:
    return fn(*args, **kwargs), None
  except Exception as e:  # noqa: BLE001
    return None, error_text(e)


def free_memory():
  """Drops Python garbage so freed buffers return to JAX's allocator before the next case."""
  gc.collect()


def record_rates(row: dict, timings: dict, names, flops: float, ceiling: float | None) -> None:
  """Into `row`, for each contender of `names` timed in `timings`: its device time
  (`{name}_us`), TFLOP/s of `flops` (`{name}_tflops`, None where it did not run), percent of
  `ceiling`, scratch MiB, kernels and the timing method; a failure's text in row["errors"]."""
  for name in names:
    t = timings.get(name)
    if isinstance(t, dict):
      row["errors"][name] = t["error"]
    if not isinstance(t, Timing):
      row[f"{name}_tflops"] = None
      continue
    row[f"{name}_us"] = t.us
    row[f"{name}_tflops"] = flops / (t.us * 1e-6) / 1e12
    row[f"{name}_pct"] = 100 * row[f"{name}_tflops"] / ceiling if ceiling else None
    row[f"{name}_temp_mib"] = None if t.temp_bytes is None else t.temp_bytes / 2**20
    row["kernels"][name] = t.as_dict()
    t.output = None
    row["method"] = t.method
