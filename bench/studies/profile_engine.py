"""Where the serving engine's step time goes: the engine (models/serving) with every slot
decoding, its dispatches under the profiler, GPU kernels grouped by the model's named
scopes, next to the wall time per dispatch and the host's share of it (scheduling and
dispatch before the wait for the step in flight).

Two kinds of dispatch are measured: decode-only (up to `decode_steps` decode steps in one
call) and mixed (one prefill chunk beside every slot's decode token: a running request is
cancelled and a new one submitted before each).

  python -m bench.studies.profile_engine [--model 1.5b] [--slots 32] [--context 256] [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import jax
import numpy as np

from bench.cli import log
from bench.environment import env_metadata
from bench.studies.profile_step import group_kernels, op_scopes
from bench.timing import has_gpu, profile_trace
from bench.trace import gpu_kernel_events
from models.serving.engine import _InFlight


def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
                      tree)


class _Recorder:
  """Wraps a jitted engine function: keeps the argument shapes of its first call since
  `reset` (to lower it for the op -> scope table; taken once, since walking the ~400
  arguments costs milliseconds of host time) and the host seconds spent dispatching it."""

  def __init__(self, fn):
    self.fn, self.last, self.seconds = fn, None, 0.0

  def reset(self):
    self.last, self.seconds = None, 0.0

  def __call__(self, *args, **kwargs):
    if self.last is None:
      self.last = (_shapes(args), kwargs)
    t0 = time.perf_counter()
    out = self.fn(*args, **kwargs)
    self.seconds += time.perf_counter() - t0
    return out

  def hlo(self) -> str:
    args, kwargs = self.last
    return self.fn.lower(*args, **kwargs).compile().as_text()


def _timed_values(waits: list):
  """_InFlight.values, adding the seconds its first call waits for the device to `waits`."""
  values = _InFlight.values

  def timed(self):
    t0 = time.perf_counter()
    out = values(self)
    waits.append(time.perf_counter() - t0)
    return out
  return timed


def _profile(engine, run_dispatch, count: int, recorders) -> dict:
  """Wall time per dispatch over `count` dispatches and the host's share of it (all but the
  wait for the step in flight), then the same under the profiler, kernels grouped by scope."""
  for _ in range(2):  # any small update's first size compiles here
    run_dispatch()
  for r in recorders:
    r.reset()
  waits = []
  _InFlight.values, plain = _timed_values(waits), _InFlight.values
  try:
    t0 = time.perf_counter()
    for _ in range(count):
      run_dispatch()
    wall = (time.perf_counter() - t0) / count
  finally:
    _InFlight.values = plain
  host = wall - sum(waits) / count
  dispatch = sum(r.seconds for r in recorders) / count
  host_functions = _host_functions(run_dispatch, count)
  trace = profile_trace(lambda: [run_dispatch() for _ in range(count)])
  events = gpu_kernel_events(trace) if trace else []
  scopes = {}
  for r in recorders:
    if r.last is not None:
      scopes.update(op_scopes(r.hlo()))
  return dict(wall_ms=wall * 1e3, host_ms=host * 1e3, jit_dispatch_ms=dispatch * 1e3,
              **group_kernels(events, scopes, count, top=40), host_functions=host_functions)


def _host_functions(run_dispatch, count: int, top: int = 25) -> dict:
  """The host's Python functions over `count` dispatches under cProfile: ms per dispatch
  in each (own time) and under it (cumulative), the `top` by own time."""
  profiler = cProfile.Profile()
  profiler.runcall(lambda: [run_dispatch() for _ in range(count)])
  rows = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, _, own s, cumulative s, _)
  ranked = sorted(rows.items(), key=lambda item: -item[1][2])[:top]
  return {f"{name} ({Path(file).name}:{line})": dict(own_ms=own * 1e3 / count, cumulative_ms=cum * 1e3 / count,
                                                      calls=calls / count)
          for (file, line, name), (calls, _, own, cum, _) in ranked}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="1.5b", choices=("0.5b", "1.5b", "7b", "tiny"))
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--context", type=int, default=256, help="prompt tokens of the running requests")
  parser.add_argument("--chunk", type=int, default=512, help="the mixed dispatch's prompt (and budget)")
  parser.add_argument("--decode-steps", type=int, default=4)
  parser.add_argument("--dispatches", type=int, default=8)
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args(argv)
  from models import qwen2
  from models.serving import Engine

  config = {"0.5b": qwen2.Qwen2Config.qwen2_5_0_5b, "1.5b": qwen2.Qwen2Config.qwen2_5_1_5b,
            "7b": qwen2.Qwen2Config.qwen2_5_7b, "tiny": qwen2.Qwen2Config.tiny}[args.model]()
  model = qwen2.random_model(config, seed=0, dtype="bfloat16" if has_gpu() else "float32")
  max_seq_len = 4 * (args.context + args.chunk)
  engine = Engine(model, max_slots=args.slots, max_seq_len=max_seq_len, token_budget=args.chunk,
                  min_chunk=min(128, args.chunk), decode_steps=args.decode_steps)
  t0 = time.perf_counter()
  engine.warm_up(sampling=False)  # its requests are greedy
  log(f"warm-up {time.perf_counter() - t0:.1f} s")
  step, decode_steps = _Recorder(engine._step), _Recorder(engine._decode_steps)
  engine._step, engine._decode_steps = step, decode_steps
  rng = np.random.default_rng(0)
  prompt = lambda n: rng.integers(0, config.vocab_size, n).tolist()
  long_output = max_seq_len - args.context - args.chunk - 8
  handles = [engine.submit(prompt(args.context), long_output, stop_ids=()) for _ in range(args.slots)]
  while engine.scheduler.waiting or any(s is not None and s.pending > 1 for s in engine.scheduler.slots):
    engine.step()
  report = {"meta": env_metadata(), "args": vars(args) | {"out": str(args.out)}}
  report["decode_dispatch"] = _profile(engine, engine.step, args.dispatches, [decode_steps])
  log(f"decode dispatch ({args.decode_steps} steps): " + ", ".join(
      f"{k} {v:.2f}" for k, v in report["decode_dispatch"].items() if isinstance(v, float)))

  def mixed():
    victim = handles.pop(0)
    engine.cancel(victim)
    handles.append(engine.submit(prompt(args.chunk), long_output, stop_ids=()))
    engine.step()

  report["mixed_dispatch"] = _profile(engine, mixed, args.dispatches, [step])
  log("mixed dispatch: " + ", ".join(f"{k} {v:.2f}" for k, v in report["mixed_dispatch"].items()
                                     if isinstance(v, float)))
  report["stats"] = dict(engine.stats)
  for kind in ("decode_dispatch", "mixed_dispatch"):
    log(f"{kind}: {'scope':44s} {'us':>9s} {'kernels':>8s}")
    for k, v in list(report[kind]["by_scope"].items())[:16]:
      log(f"  {k[:58]:58s} {v['us']:9.1f} {v['kernels']:8.1f}")
    for k, v in list(report[kind]["by_kernel"].items())[:12]:
      log(f"  {k[:80]:80s} {v['us']:9.1f} {v['kernels']:6.1f}")
    log(f"{kind}: host functions (ms per dispatch: own, cumulative; calls)")
    for k, v in list(report[kind]["host_functions"].items())[:15]:
      log(f"  {k[:80]:80s} {v['own_ms']:8.2f} {v['cumulative_ms']:8.2f} {v['calls']:6.1f}")
  if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_engine_{args.model}_s{args.slots}_c{args.context}.json").write_text(
        json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
  main()
