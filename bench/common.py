"""Benchmark harness: device time from the profiler, ceilings, metadata and result files.

Why device time: a wall-clock loop over a jitted function also measures JAX's host-side
launch gaps; for a 40 us decode kernel the wall clock read twice the device time on the
H200 (shared/anchors). So a kernel is timed as the sum of the durations of every GPU kernel
one call launches (transposes, memsets and split-KV combines included), read from a
`jax.profiler` trace. Wall time is kept for whole generate steps, where launch gaps are part
of what a user waits for.

Trace format (perfetto_trace.json.gz, Chrome trace-event JSON): metadata events
(ph == "M", name == "process_name") name each pid; the GPU's kernels are complete events
(ph == "X", "dur" in microseconds) in the process named "/device:GPU:0", with args
"hlo_module" / "hlo_op" naming the XLA module and instruction that launched them.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import glob
import gzip
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "h200"
GPU_PROCESS = "/device:GPU:0"
WALL_NO_GPU = "wall (no GPU)"
MAX_ITERS = 50
DEVICE = "device (profiler: sum of GPU kernel durations)"

# Per-session facts the result files report (how timings were attributed, profiler cost).
SESSION: dict[str, Any] = {"profiler_sessions": 0, "profiler_seconds": 0.0, "attribution": None}


# ----------------------------------------------------------------------------- trace parsing

def load_trace(path) -> dict:
  """Reads a (gzipped) Chrome/perfetto trace-event JSON file."""
  path = str(path)
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  return data if isinstance(data, dict) else {"traceEvents": data}


def process_names(trace: dict) -> dict:
  """pid -> process name, from the ph == "M" / name == "process_name" metadata events."""
  return {e.get("pid"): e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
          if e.get("ph") == "M" and e.get("name") == "process_name"}


def _is_gpu_process(name: str, device: str) -> bool:
  # "/device:GPU:0" exactly, or followed by a qualifier ("/device:GPU:0 (stream ...)"), never GPU:01.
  return name == device or (name.startswith(device) and not name[len(device)].isdigit())


def thread_names(trace: dict) -> dict:
  """(pid, tid) -> thread name, from the ph == "M" / name == "thread_name" metadata events."""
  return {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
          for e in trace.get("traceEvents", []) if e.get("ph") == "M" and e.get("name") == "thread_name"}


def gpu_kernel_events(trace: dict, device: str = GPU_PROCESS) -> list[dict]:
  """The complete events (kernels, memsets, copies) of the GPU process, sorted by start time.

  The profiler can add derived lines to the device ("XLA Ops", "XLA Modules", "Steps"),
  whose events span the same kernels again: when the process has "Stream #..." threads,
  only their events count."""
  pids = {pid for pid, name in process_names(trace).items() if _is_gpu_process(name, device)}
  events = [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]
  threads = thread_names(trace)
  streams = {key for key, name in threads.items() if key[0] in pids and name.startswith("Stream")}
  if streams:
    events = [e for e in events if (e.get("pid"), e.get("tid")) in streams]
  return sorted(events, key=lambda e: float(e.get("ts", 0.0)))


def summarize_kernels(events: Iterable[dict], iters: int) -> tuple[float, dict, float]:
  """(device us per call, {kernel name: us per call}, kernels launched per call)."""
  per_name: dict[str, float] = {}
  count = 0
  for e in events:
    per_name[e["name"]] = per_name.get(e["name"], 0.0) + float(e["dur"])
    count += 1
  total = sum(per_name.values()) / iters
  breakdown = dict(sorted(((k, v / iters) for k, v in per_name.items()), key=lambda kv: -kv[1]))
  return total, breakdown, count / iters


def attribute_events(events: Iterable[dict], tags: dict) -> tuple[dict, int]:
  """Splits kernel events between cases by their "hlo_module" arg: {case: tag} ->
  ({case: [events whose module name contains its tag]}, number of events matching none)."""
  by_case: dict[str, list] = {name: [] for name in tags}
  unassigned = 0
  for e in events:
    module = str(e.get("args", {}).get("hlo_module", ""))
    owner = next((name for name, tag in tags.items() if tag and tag in module), None)
    if owner is None:
      unassigned += 1
    else:
      by_case[owner].append(e)
  return by_case, unassigned


def find_perfetto_trace(trace_dir) -> Path | None:
  """The newest plugins/profile/<timestamp>/perfetto_trace.json.gz under `trace_dir`."""
  found = glob.glob(os.path.join(str(trace_dir), "**", "perfetto_trace.json.gz"), recursive=True)
  return Path(max(found, key=os.path.getmtime)) if found else None


# ----------------------------------------------------------------------------- timing

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


def block(x):
  return jax.block_until_ready(x)


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
    block(fn(*sets[i % len(sets)]))
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
    out = block(fn(*sets[i % len(sets)]))
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


def _profile(run: Callable[[], None]) -> dict | None:
  """Runs `run` under jax.profiler.trace in a /tmp dir; returns the parsed trace (or None)."""
  trace_dir = tempfile.mkdtemp(prefix="jaxflash_trace_", dir="/tmp")
  t0 = time.perf_counter()
  try:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      run()
    path = find_perfetto_trace(trace_dir)
    return load_trace(path) if path else None
  finally:
    SESSION["profiler_sessions"] += 1
    SESSION["profiler_seconds"] += time.perf_counter() - t0
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
  trace = _profile(lambda: _run_calls(fn, args, iters))
  events = gpu_kernel_events(trace) if trace else []
  if not events:
    med = statistics.median(_run_calls(fn, args, iters))
    return Timing(med, {}, 0.0, iters, "wall (no GPU events in the profiler trace)", med)
  us, kernels, launches = summarize_kernels(events, iters)
  return Timing(us, kernels, launches, iters, DEVICE, wall)


def device_times_us(cases: dict, *, warmup: int = 2, iters: int | None = None,
                    max_iters: int = MAX_ITERS, keep_output: bool = False,
                    log: Callable[[str], None] | None = None) -> dict:
  """Times several cases in ONE profiler session: {name: (fn, args)} -> {name: Timing or
  {"error": text}}; args is a tuple, or an ArgSets to rotate through.

  `fn` must be traceable (a Python function or a jax.jit one). Each case is compiled as its
  own module with a unique name (Timing.temp_bytes gets its scratch memory); a kernel event
  is assigned to the case whose module name its "hlo_module" arg carries. If any GPU event
  cannot be assigned that way (no hlo_module, or an unknown one), the attribution is not
  trusted and every case is re-timed in a profiler session of its own (`device_time_us`).
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
    SESSION["attribution"] = SESSION["attribution"] or "none (wall clock, no GPU)"
    return results

  failed: dict[str, str] = {}

  def run():
    for name, (tag, compiled, args, n, _) in prepared.items():
      try:
        _run_calls(compiled, args, n)
      except Exception as e:  # noqa: BLE001
        failed[name] = error_text(e)

  trace = _profile(run)
  events = gpu_kernel_events(trace) if trace else []
  by_case, unassigned = attribute_events(events, {name: p[0] for name, p in prepared.items()})
  trusted = bool(events) and unassigned == 0 and all(by_case[n] for n in prepared if n not in failed)
  if trusted:
    SESSION["attribution"] = SESSION["attribution"] or "hlo_module (one profiler session per group)"
  else:
    SESSION["attribution"] = (f"one profiler session per case ({unassigned} of {len(events)} "
                              "events carried no known hlo_module)")
  for name, (tag, compiled, args, n, wall) in prepared.items():
    if name in failed:
      results[name] = {"error": failed[name]}
      log(f"  {name}: ERROR {failed[name][:300]}")
      continue
    if trusted:
      us, kernels, launches = summarize_kernels(by_case[name], n)
      results[name] = Timing(us, kernels, launches, n, DEVICE, wall, _temp_bytes(compiled))
    else:
      try:
        results[name] = device_time_us(compiled, args if isinstance(args, ArgSets) else ArgSets([args]),
                                       warmup=1, iters=n)
        results[name].temp_bytes = _temp_bytes(compiled)
      except Exception as e:  # noqa: BLE001
        results[name] = {"error": error_text(e)}
  return results


def wall_time_ms(fn, *args, warmup: int = 3, iters: int = 20) -> float:
  """Median wall-clock milliseconds of `fn(*args)` with block_until_ready (for whole
  generate steps, where the host's launch gaps are part of the cost)."""
  warm_up(fn, args, warmup)
  return statistics.median(_run_calls(fn, args, iters)) / 1e3


# ----------------------------------------------------------------------------- ceilings

def hbm_read_ceiling_gbs(gib: float = 4.0, *, detail: bool = False):
  """HBM read bandwidth an XLA reduction reaches: sum over `gib` GiB of random bf16, bytes
  read / device time, in GB/s (1e9). The decode kernels are judged against this number."""
  cols = 4096
  rows = max(1, int(gib * 2**30) // (2 * cols))
  n = rows * cols
  x = jax.jit(lambda key: jax.random.uniform(key, (rows, cols), jnp.bfloat16))(jax.random.key(0))
  total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  t = device_time_us(total, x, warmup=2, iters=None if has_gpu() else 3)
  nbytes = n * 2
  del x
  gc.collect()
  gbs = nbytes / (t.us * 1e-6) / 1e9
  return {"gbs": gbs, "bytes": nbytes, "us": t.us, "method": t.method} if detail else gbs


def matmul_ceiling_tflops(n: int = 8192, *, detail: bool = False):
  """bf16 n x n x n matmul on random data: 2 n^3 / device time, in TFLOP/s (1e12). The
  prefill kernels are judged against this number."""
  ka, kb = jax.random.split(jax.random.key(1))
  make = jax.jit(lambda k: jax.random.normal(k, (n, n), jnp.bfloat16))
  a, b = make(ka), make(kb)
  t = device_time_us(jax.jit(jnp.matmul), a, b, warmup=2, iters=None if has_gpu() else 3)
  del a, b
  gc.collect()
  tflops = 2 * n**3 / (t.us * 1e-6) / 1e12
  return {"tflops": tflops, "n": n, "us": t.us, "method": t.method} if detail else tflops


def peak_temp_memory_bytes(jitted_fn, *args) -> int | None:
  """Scratch XLA allocates for one call (arguments and outputs excluded), from the compiled
  executable's memory analysis; None where the backend does not report it."""
  compiled = jitted_fn if hasattr(jitted_fn, "memory_analysis") else jax.jit(jitted_fn).lower(*args).compile()
  return _temp_bytes(compiled)


# ----------------------------------------------------------------------------- metadata

def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _nvidia_smi() -> dict:
  fields = ["name", "driver_version", "memory.total", "clocks.sm", "clocks.mem", "clocks.max.sm",
            "clocks.max.mem", "power.draw", "power.limit", "temperature.gpu"]
  if not shutil.which("nvidia-smi"):
    return {}
  try:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
  except (OSError, subprocess.SubprocessError):
    return {}
  if not out:
    return {}
  return dict(zip(fields, (v.strip() for v in out[0].split(","))))


def env_metadata() -> dict:
  """GPU, software versions and date (UTC) for the result files; no hostname."""
  dev = jax.devices()[0]
  smi = _nvidia_smi()
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
      "backend": jax.default_backend(),
      "device": getattr(dev, "device_kind", str(dev)),
      "device_count": jax.device_count(),
      "sm_count": getattr(dev, "core_count", None),
      "compute_capability": getattr(dev, "compute_capability", None),
      "driver": smi.get("driver_version"),
      "nvidia_smi": smi or None,
      "python": platform.python_version(),
      "versions": {p: _version(p) for p in (
          "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt",
          "jax-cuda13-pjrt", "triton", "torch", "flax", "numpy")},
      "xla_flags": os.environ.get("XLA_FLAGS"),
      "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "default (0.75)"),
  }
  meta["versions"] = {k: v for k, v in meta["versions"].items() if v is not None}
  try:
    stats = dev.memory_stats() or {}
    meta["device_memory_limit_bytes"] = stats.get("bytes_limit")
  except Exception:  # noqa: BLE001 -- CPU devices may not report
    pass
  try:
    from jax._src.lib import cuda_versions  # only in CUDA builds
    if cuda_versions is not None:
      meta["cudnn"] = cuda_versions.cudnn_get_version()
  except Exception:  # noqa: BLE001
    pass
  return meta


# ----------------------------------------------------------------------------- results

def error_text(e: BaseException, limit: int = 600) -> str:
  """The exception's type and message on one line (the tail, where XLA puts the cause)."""
  text = f"{type(e).__name__}: {e}".replace("\n", " | ")
  return text if len(text) <= limit else text[:200] + " ... " + text[-(limit - 205):]


def free_memory():
  """Drops Python garbage so freed buffers return to JAX's allocator before the next row."""
  gc.collect()


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, Timing):
    return _jsonable(x.as_dict())
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(float(x)) else None
  if isinstance(x, np.ndarray):
    return _jsonable(x.tolist())
  if isinstance(x, (str, int, bool)) or x is None:
    return x
  return str(x)


def format_value(v, fmt=None) -> str:
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return "–"
  if fmt is not None:
    return fmt(v) if callable(fmt) else fmt.format(v)
  if isinstance(v, bool):
    return str(v)
  if isinstance(v, (int, np.integer)):
    return str(int(v))
  if isinstance(v, (float, np.floating)):
    a = abs(float(v))
    if a == 0:
      return "0"
    if a >= 100:
      return f"{v:.0f}"
    if a >= 10:
      return f"{v:.1f}"
    if a >= 0.01:
      return f"{v:.2f}"
    return f"{v:.2e}"
  return str(v)


def value_with_pct(row: dict, key: str, pct_key: str) -> str | None:
  """A cell such as "2183 (47%)": the value and its share of the ceiling."""
  value = row.get(key)
  if value is None:
    return None
  pct = row.get(pct_key)
  return format_value(value) + (f" ({pct:.0f}%)" if pct is not None else "")


def _normalize_columns(rows, columns):
  if columns is None:
    keys = []
    for r in rows:
      keys += [k for k, v in r.items() if k not in keys and not isinstance(v, (dict, list))]
    columns = keys
  out = []
  for c in columns:
    if isinstance(c, str):
      out.append((c, c, None))
    else:
      key, header, *fmt = c
      out.append((key, header, fmt[0] if fmt else None))
  return out


def markdown_table(rows: Sequence[dict], columns=None) -> str:
  """A Markdown table; columns: keys, or (key, header[, format string or callable]) where
  key may also be a callable of the row (a derived cell)."""
  cols = _normalize_columns(rows, columns)
  lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(format_value(k(r) if callable(k) else r.get(k), f)
                                   for k, _, f in cols) + " |")
  return "\n".join(lines)


def meta_lines(meta: dict) -> list[str]:
  """The header lines of a result file: GPU, versions, date, ceilings, timing method."""
  v = meta.get("versions", {})
  lines = [f"- GPU: {meta.get('device')} (backend {meta.get('backend')}, {meta.get('sm_count')} SMs, "
           f"compute capability {meta.get('compute_capability')}, driver {meta.get('driver')})",
           "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
           f"- Date (UTC): {meta.get('date')}"]
  ceil = meta.get("ceilings") or {}
  if ceil:
    parts = []
    if "hbm_read_gbs" in ceil:
      parts.append(f"HBM read {format_value(ceil['hbm_read_gbs'])} GB/s (XLA sum over "
                   f"{format_value(ceil.get('hbm_read_bytes', 0) / 2**30)} GiB)")
    if "matmul_tflops" in ceil:
      parts.append(f"bf16 matmul {format_value(ceil['matmul_tflops'])} TFLOP/s "
                   f"({ceil.get('matmul_n')}³)")
    lines.append("- Ceilings measured in this run: " + "; ".join(parts))
  if meta.get("timing"):
    lines.append(f"- Timing: {meta['timing']}")
  for extra in meta.get("notes_header", []):
    lines.append(f"- {extra}")
  return lines


def _plot(path: Path, rows: Sequence[dict], spec: dict) -> None:
  """spec: x (key), y (key or list of keys), optional series (key: one line per value of it),
  labels {key or series value: label}, title, xlabel, ylabel, logx, logy, hline (value, label)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in rows if spec.get("where", lambda r: True)(r)]
  fig, ax = plt.subplots(figsize=spec.get("figsize", (7.5, 4.5)))
  labels = spec.get("labels", {})
  x = spec["x"]
  ys = spec["y"] if isinstance(spec["y"], (list, tuple)) else [spec["y"]]
  if spec.get("kind") == "bar":  # one bar per row: x is the row's label
    bars = [(str(r.get(x)), r.get(ys[0])) for r in rows if isinstance(r.get(ys[0]), (int, float))]
    if bars:
      ax.bar(range(len(bars)), [b for _, b in bars], color="tab:blue")
      ax.set_xticks(range(len(bars)), [a for a, _ in bars], rotation=90, fontsize=6)
    spec = {**spec, "logx": False}
  lines = []
  if spec.get("kind") == "bar":
    pass
  elif spec.get("series"):
    groups: dict = {}
    for r in rows:
      groups.setdefault(r.get(spec["series"]), []).append(r)
    for value, group in groups.items():
      lines.append((labels.get(value, str(value)), group, ys[0]))
  else:
    lines = [(labels.get(y, y), rows, y) for y in ys]
  for label, group, y in lines:
    pts = [(r.get(x), r.get(y)) for r in group]
    pts = [(a, b) for a, b in pts if isinstance(a, (int, float)) and isinstance(b, (int, float))
           and math.isfinite(b)]
    if pts:
      ax.plot(*zip(*pts), marker="o", label=label)
  if spec.get("hline"):
    value, label = spec["hline"]
    if value:
      ax.axhline(value, color="gray", linestyle="--", linewidth=1, label=label)
  if spec.get("logx"):
    ax.set_xscale("log", base=2)
  if spec.get("logy"):
    ax.set_yscale("log")
  ax.set_xlabel(spec.get("xlabel", "" if spec.get("kind") == "bar" else x))
  ax.set_ylabel(spec.get("ylabel", ys[0] if len(ys) == 1 else ""))
  ax.set_title(spec.get("title", ""), fontsize=10)
  ax.grid(True, alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_results(name: str, rows: Sequence[dict], meta: dict, columns=None, plot=None, *,
                  out_dir=None, notes: Sequence[str] = (), extra: dict | None = None) -> dict:
  """Writes <out_dir>/<name>.json (meta, rows, extra), <name>.md (metadata header lines and
  a Markdown table of `columns`, then `notes`) and, with `plot` (a spec dict, see `_plot`, or
  a list of them, each with an optional "suffix"), <name>[suffix].png. Returns the paths."""
  out = Path(out_dir) if out_dir is not None else DEFAULT_OUT
  out.mkdir(parents=True, exist_ok=True)
  meta = {**meta, "session": dict(SESSION)}
  paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
  payload = {"name": name, "meta": meta, "rows": list(rows), "notes": list(notes)}
  if extra:
    payload.update(extra)
  paths["json"].write_text(json.dumps(_jsonable(payload), indent=1) + "\n")
  md = [f"# {meta.get('title', name)}", "", *meta_lines(meta), "", markdown_table(rows, columns)]
  if notes:
    md += ["", *[f"- {n}" for n in notes]]
  paths["md"].write_text("\n".join(md) + "\n")
  specs = plot if isinstance(plot, (list, tuple)) else ([plot] if plot else [])
  for spec in specs:
    png = out / f"{name}{spec.get('suffix', '')}.png"
    try:
      _plot(png, rows, spec)
      paths.setdefault("png", []).append(png)
    except Exception as e:  # noqa: BLE001 -- a plot must never lose the numbers
      print(f"plot {png.name} failed: {error_text(e)}", file=sys.stderr, flush=True)
  return paths


def merge_earlier_rows(earlier: dict | None, rows: list, key: Callable[[dict], tuple], meta: dict,
                       what: Callable[[list], str] = lambda kept: f"{len(kept)} rows") -> tuple[list, str | None]:
  """`rows` of this run plus the rows of an earlier run's saved JSON (`earlier`) that this run
  did not measure (same `key`), each dated by its run (`run` field). Returns (rows, a note
  saying which rows came from where, or None when none were kept)."""
  earlier = earlier or {}
  measured = {key(r) for r in rows}
  date = earlier.get("meta", {}).get("date")
  kept = [dict(r, run=r.get("run") or date) for r in earlier.get("rows", []) if key(r) not in measured]
  rows = [dict(r, run=meta.get("date")) for r in rows]
  if not kept:
    return rows, None
  runs = sorted({str(r["run"]) for r in kept})
  return kept + rows, (f"{what(kept)} come from the run(s) of {', '.join(runs)} (same script, on an "
                       f"H200 too, with their own ceilings); the other {len(rows)} from this run of "
                       f"{meta.get('date')}. The JSON's `run` field dates each row.")


def read_json(path) -> dict | None:
  """A results JSON, or None when there is none."""
  path = Path(path)
  return json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------------- script helpers

def bench_arguments(doc: str, *, smoke: str, budget_s: float, budget_help: str | None = None,
                    quick: str | None = None, sweep: bool = False) -> argparse.ArgumentParser:
  """The options the benchmark scripts share: --smoke (what it runs), --budget-s, --out, and
  --quick (when `quick` says what it keeps) and --sweep/--no-sweep (when `sweep`); a script
  adds its own options to the parser returned. `doc`: the script's docstring."""
  p = argparse.ArgumentParser(description=doc.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help=smoke)
  if quick is not None:
    p.add_argument("--quick", action="store_true", help=quick)
  if sweep:
    p.add_argument("--sweep", dest="sweep", action="store_true", default=True)
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
  p.add_argument("--budget-s", type=float, default=budget_s,
                 help=budget_help or "skip the cells left after this many seconds (results are still written)")
  p.add_argument("--out", default=None, help=f"results folder (default {DEFAULT_OUT})")
  return p


def log(msg: str) -> None:
  print(msg, flush=True)


def try_call(fn, *args, **kwargs):
  """(result, None) or (None, error text): every benchmark cell goes through this."""
  try:
    return fn(*args, **kwargs), None
  except Exception as e:  # noqa: BLE001
    return None, error_text(e)


def ceilings(matmul_n: int = 8192, hbm_gib: float = 4.0) -> dict:
  """Both ceilings, measured now (each in try/except: a failure is recorded, not raised)."""
  out: dict[str, Any] = {}
  got, err = try_call(hbm_read_ceiling_gbs, hbm_gib, detail=True)
  if got:
    out.update(hbm_read_gbs=got["gbs"], hbm_read_bytes=got["bytes"], hbm_read_us=got["us"])
  else:
    out["hbm_read_error"] = err
  got, err = try_call(matmul_ceiling_tflops, matmul_n, detail=True)
  if got:
    out.update(matmul_tflops=got["tflops"], matmul_n=got["n"], matmul_us=got["us"])
  else:
    out["matmul_error"] = err
  return out


def begin_run(name: str, args, *, matmul_n: int, hbm_gib: float) -> tuple[dict, Path]:
  """The start every kernel benchmark shares: its metadata (GPU, versions, date, the
  ceilings measured now, the timing method) and its output folder (a fresh /tmp folder for
  a --smoke run)."""
  out_dir = smoke_out_dir(name) if args.smoke else Path(args.out or DEFAULT_OUT)
  meta = env_metadata()
  log(f"{name} benchmark on {meta['device']} ({meta['backend']}), jax {meta['versions'].get('jax')}")
  meta["ceilings"] = ceilings(matmul_n=matmul_n, hbm_gib=hbm_gib)
  log(f"ceilings: {meta['ceilings']}")
  meta.update(timing=("device time: sum of the GPU kernels one call launches (jax.profiler trace)"
                      if has_gpu() else WALL_NO_GPU),
              smoke=args.smoke, quick=args.quick)
  return meta, out_dir


def highest_precision():
  """Context for full-precision float32 matmuls (references): XLA otherwise may use TF32."""
  ctx = getattr(jax, "default_matmul_precision", None)
  return ctx("highest") if ctx is not None else contextlib.nullcontext()


class Budget:
  """A script's time budget: cells past it are skipped (and say so), so that results are
  always written within the one device call that runs the script."""

  def __init__(self, seconds: float):
    self.start, self.seconds = time.perf_counter(), seconds

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def exhausted(self) -> bool:
    return self.elapsed() > self.seconds


def smoke_out_dir(prefix: str) -> Path:
  return Path(tempfile.mkdtemp(prefix=f"jaxflash_{prefix}_smoke_", dir="/tmp"))
