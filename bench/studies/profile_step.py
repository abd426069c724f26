"""Where a decode step's time goes: one Qwen2.5 decode step under the profiler, its GPU
kernels grouped by what launched them (the model's named scopes), next to the wall time.

Also measures the GEMV rate of XLA's matmuls at the model's projection shapes (batch 1,
bf16, every weight read cold), the ceiling a batch-1 decode step is made of.

  python -m bench.studies.profile_step [--model 1.5b] [--batch 1] [--prompt 1024] [--out DIR]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.cli import log
from bench.environment import env_metadata
from bench.timing import Timing, device_times_us, free_memory, has_gpu, profile_trace
from bench.trace import gpu_kernel_events

# What `--off` may turn off in the decode step's StepPlan (models/qwen2/plan.py) for an A/B run,
# and what else goes with it (a plan refuses a fusion whose prerequisite is off).
PLAN_SWITCHES = {
    "skinny": dict(skinny=False, fused_qkv=False, residual_norm=False, split_kv=False),
    "fused_qkv": dict(fused_qkv=False),
    "cache_write_kernel": dict(cache_write="scatter"),
    "residual_norm": dict(residual_norm=False, split_kv=False),
    "split_kv": dict(split_kv=False),
}


def plan_without(plan, switches):
  """`plan` with the PLAN_SWITCHES named in `switches` turned off."""
  changes = {}
  for switch in switches:
    changes.update(PLAN_SWITCHES[switch])
  cache_write = changes.get("cache_write", plan.cache_write)
  if cache_write == "qkv" and not changes.get("fused_qkv", plan.fused_qkv):
    cache_write = "kernel"  # the q/k/v kernel no longer writes the cache: the write kernel does
  changes.update(cache_write=cache_write, qkv_counters=plan.qkv_counters and cache_write == "qkv")
  return dataclasses.replace(plan, **changes)
_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"')


def op_scopes(hlo_text: str) -> dict:
  """HLO instruction name -> its op_name metadata (the JAX named-scope path)."""
  scopes = {}
  for line in hlo_text.splitlines():
    m = _OP_NAME.match(line)
    if m:
      scopes[m.group(1)] = m.group(2)
  return scopes


def scope_of(op_name: str) -> str:
  """'jit(decode)/decode/layer_3/attention/qkv_projection/dot_general' -> 'attention/qkv_projection'
  (a serving step's prefill chunks: 'prefill/attention/...')."""
  wrappers = ("jit(", "pjit", "decode", "while", "body", "cond", "branch", "checkpoint")
  parts = [p for p in op_name.split("/") if not p.startswith(wrappers)]
  prefix = "prefill/" if "prefill_chunks" in parts else ""
  parts = [p for p in parts if p != "prefill_chunks"]
  for i, part in enumerate(parts):
    if re.fullmatch(r"layer_\d+", part):
      return prefix + "/".join(parts[i + 1:i + 3])
  return prefix + "/".join(parts[:2]) or "?"


def group_kernels(events: list[dict], scopes: dict, calls: int, top: int = 60) -> dict:
  """A profile's GPU kernel events over `calls` calls, per call: total busy time and span,
  and time and count by named scope (`scopes`: op_scopes of the calls' HLO) and by kernel."""
  by_scope = collections.defaultdict(lambda: [0.0, 0.0])
  by_kernel = collections.defaultdict(lambda: [0.0, 0.0])
  for e in events:
    op = str(e.get("args", {}).get("hlo_op", ""))
    for table, key in ((by_scope, scope_of(scopes.get(op, op))), (by_kernel, e["name"][:90])):
      table[key][0] += float(e["dur"]) / calls
      table[key][1] += 1 / calls
  span = ((float(events[-1]["ts"]) + float(events[-1]["dur"]) - float(events[0]["ts"])) / calls / 1e3
          if events else None)
  ranked = lambda table, n: {k: {"us": v[0], "kernels": v[1]}
                             for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])[:n]}
  return dict(device_busy_ms=sum(v[0] for v in by_scope.values()) / 1e3, device_span_ms=span,
              by_scope=ranked(by_scope, len(by_scope)), by_kernel=ranked(by_kernel, top))


def gemv_rates(hidden: int, intermediate: int, q_out: int, kv_out: int, copies: int,
               rows: int = 1) -> list[dict]:
  """Batch-1 x @ W for the model's weight shapes, `copies` distinct weights per call (cold)."""
  shapes = {"q": (hidden, q_out), "k or v": (hidden, kv_out), "qkv fused": (hidden, q_out + 2 * kv_out),
            "o": (q_out, hidden), "gate or up": (hidden, intermediate),
            "gate+up fused": (hidden, 2 * intermediate), "down": (intermediate, hidden)}
  cases, nbytes = {}, {}
  for name, (k, n) in shapes.items():
    ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) for i in range(copies)]
    x = jnp.ones((rows, k), jnp.bfloat16)
    cases[name] = (lambda x, ws: [x @ w for w in ws], (x, ws))
    nbytes[name] = k * n * 2
  timings = device_times_us(cases, max_iters=20, log=log)
  out = []
  for name, t in timings.items():
    if isinstance(t, Timing):
      us = t.us / copies
      out.append(dict(weight=name, rows=rows, shape=shapes[name], us=us,
                      gbs=nbytes[name] / us / 1e3, kernels=list(t.kernels)[:3]))
    else:
      out.append(dict(weight=name, rows=rows, error=t["error"]))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="1.5b", choices=("0.5b", "1.5b", "7b", "tiny"))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--prompt", type=int, default=1024)
  parser.add_argument("--impl", default="jaxflash", help="jaxflash (the default kernels) or one of "
                      "jaxflash.IMPLEMENTATIONS")
  parser.add_argument("--cache", default="contiguous")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--gemv-rows", default="1", help="comma-separated batch rows for the GEMV rates")
  parser.add_argument("--no-gemv", action="store_true")
  parser.add_argument("--off", default="", help="comma-separated parts of the decode step's plan to "
                      "turn off for an A/B run: " + ", ".join(PLAN_SWITCHES))
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args(argv)
  from models import qwen2
  from models.qwen2 import Sampler, SamplingParams

  config = {"0.5b": qwen2.Qwen2Config.qwen2_5_0_5b, "1.5b": qwen2.Qwen2Config.qwen2_5_1_5b,
            "7b": qwen2.Qwen2Config.qwen2_5_7b, "tiny": qwen2.Qwen2Config.tiny}[args.model]()
  report = {"meta": env_metadata(), "args": vars(args) | {"out": str(args.out)}}
  if not args.no_gemv:
    rows = [r for m in args.gemv_rows.split(",") for r in gemv_rates(
        config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim, config.num_hidden_layers, rows=int(m))]
    report["gemv"] = rows
    for r in rows:
      log(f"gemv M={r['rows']} {r['weight']:14s} {r.get('us', 0):7.2f} us {r.get('gbs', 0):7.0f} GB/s "
          f"{r.get('kernels', r.get('error'))}")
    free_memory()

  dtype = "bfloat16" if has_gpu() else "float32"
  model = qwen2.random_model(config, seed=0, dtype=dtype)
  off = [flag for flag in args.off.split(",") if flag]
  for flag in off:
    if flag not in PLAN_SWITCHES:
      parser.error(f"--off takes parts of the plan ({', '.join(PLAN_SWITCHES)}), got {flag!r}")
  impl = None if args.impl == "jaxflash" else args.impl
  probe = Sampler(model, cache=args.cache, attention_impl=impl)
  capacity = probe.capacity(args.prompt, args.steps + 16)
  plan = None
  if off:
    plan = plan_without(qwen2.StepPlan.build(model, (args.batch, 1), probe.make_cache(args.batch, 16),
                                             impl), off)
    log(f"plan: {plan}")
  sampler = Sampler(model, cache=args.cache, attention_impl=impl, plan=plan)
  prompts = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.prompt), np.int32)
  cache = sampler.make_cache(args.batch, capacity)
  if args.cache == "paged":
    from models.qwen2 import PageAllocator
    allocator = PageAllocator(cache.num_pages, sampler.page_size, args.batch, cache.block_table.shape[1])
    for row in range(args.batch):
      allocator.reserve(row, args.prompt + args.steps + 16)
    cache = dataclasses.replace(cache, block_table=jnp.asarray(allocator.block_table))
  greedy, eos = SamplingParams(), jnp.asarray([-1], jnp.int32)
  lengths = jnp.full((args.batch,), args.prompt, jnp.int32)
  box = [sampler.prefill(jnp.asarray(prompts), lengths, cache, jax.random.key(0), eos, greedy)]
  jax.block_until_ready(box[0])

  def step():
    box[0] = sampler.decode(box[0], eos, greedy)

  step()
  jax.block_until_ready(box[0])
  blocked = []
  for _ in range(10):
    t0 = time.perf_counter()
    step()
    jax.block_until_ready(box[0].tokens)
    blocked.append((time.perf_counter() - t0) * 1e3)
  n = args.steps // 2
  t0 = time.perf_counter()
  for _ in range(n):
    step()
  jax.block_until_ready(box[0].tokens)
  pipelined = (time.perf_counter() - t0) * 1e3 / n
  t0 = time.perf_counter()
  for _ in range(n):
    step()
  dispatch = (time.perf_counter() - t0) * 1e3 / n  # host time to enqueue (if not throttled)
  jax.block_until_ready(box[0].tokens)

  profiled = 5
  trace = profile_trace(lambda: [step() for _ in range(profiled)] and jax.block_until_ready(box[0].tokens))
  events = gpu_kernel_events(trace) if trace else []
  hlo = sampler.steps.decode.lower(sampler.params, box[0], eos, sampling=greedy,
                                   attention_impl=sampler.attention_impl,
                                   plan=sampler.plan).compile().as_text()
  grouped = group_kernels(events, op_scopes(hlo), profiled)
  summary = dict(blocked_ms=float(np.median(blocked)), pipelined_ms=pipelined, dispatch_ms=dispatch,
                 device_ms=grouped["device_busy_ms"], span_ms=grouped["device_span_ms"],
                 kernels=sum(v["kernels"] for v in grouped["by_scope"].values()))
  # The host cost of dispatching a jitted call with as many arguments, doing nothing.
  trivial = jax.jit(lambda *a: a[0] + 1)
  many = [jnp.ones((4,), jnp.float32) for _ in range(len(sampler.params) + 64)]
  trivial(*many).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(50):
    trivial(*many)
  summary["trivial_dispatch_ms"] = (time.perf_counter() - t0) * 1e3 / 50
  report["step"] = summary
  report["by_scope"], report["by_kernel"] = grouped["by_scope"], grouped["by_kernel"]
  if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    off = "".join(f"_no_{flag}" for flag in off)
    (args.out / f"profile_step_{args.model}_b{args.batch}_{args.prompt}_{args.impl}_{args.cache}{off}.json"
     ).write_text(json.dumps(report, indent=1, default=str))
    (args.out / "decode_step.hlo.txt").write_text(hlo)
  log(f"step: {summary}")
  log(f"{'scope':50s} {'us/step':>9s} {'kernels':>8s}")
  for k, v in list(report["by_scope"].items())[:25]:
    log(f"{k[:50]:50s} {v['us']:9.1f} {v['kernels']:8.1f}")
  log(f"{'kernel':90s} {'us/step':>9s} {'n':>5s}")
  for k, v in list(report["by_kernel"].items())[:25]:
    log(f"{k:90s} {v['us']:9.1f} {v['kernels']:5.1f}")


if __name__ == "__main__":
  main()
