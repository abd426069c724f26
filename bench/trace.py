"""Reading a `jax.profiler` trace: the GPU's kernel events, summed per call and split by case.

Trace format (perfetto_trace.json.gz, Chrome trace-event JSON): metadata events
(ph == "M", name == "process_name") name each pid; the GPU's kernels are complete events
(ph == "X", "dur" in microseconds) in the process named "/device:GPU:0", with args
"hlo_module" / "hlo_op" naming the XLA module and instruction that launched them.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from pathlib import Path
from typing import Iterable

GPU_PROCESS = "/device:GPU:0"


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

