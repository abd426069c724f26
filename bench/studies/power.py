"""Power and clocks under load: the SM clock each workload sustains, and the peak it allows.

Each workload runs its call back to back for a few seconds while nvidia-smi samples the SM
clock, the power draw and the active clock-event reasons every 0.1 s (the first samples,
before the clock settles, are dropped). Its TFLOP/s come from device time in the same
process, measured just before the loop (bench/timing.py), and the dense bf16 peak at the
median clock is SMs x FLOP per SM per cycle x clock (4096 on sm_90: wgmma's dense bf16
rate), so `fraction of clock peak` says how busy the tensor cores are at the clock the power
cap leaves.

Workloads: the bf16 matmul 8192^3 (the ceiling the other tables quote), and causal prefill
(Qwen2.5-1.5B attention: 12 query heads, 2 KV heads, d = 128, bf16) at n = 16384 and 32768
for jaxflash's default path, tokamax's Mosaic kernel and FlashAttention-3 when importable.

  python -m bench.studies.power [--seconds 8] [--out DIR]     # GPU, about a minute
  python -m bench.studies.power --smoke                       # tiny CPU run (no samples, no clock)
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

import jax
import jax.numpy as jnp

from bench import peers
from bench.cli import TimeLimit, begin_run, bench_arguments, log
from bench.report import STUDIES_DIR
from bench.prefill import causal_flops, make_inputs
from bench.report import write_results
from bench.timing import device_times_us, free_memory, try_call

FLOP_PER_SM_CYCLE = {9: 4096}  # dense bf16 per SM per cycle, by compute capability major
SAMPLE_S, SETTLE_SAMPLES = 0.1, 5
FIELDS = ("clocks.sm", "power.draw", "power.limit", "clocks_event_reasons.active", "temperature.gpu")


def sample_gpu(stop: threading.Event, samples: list) -> None:
  """Appends one nvidia-smi reading (FIELDS) every SAMPLE_S seconds until `stop` is set."""
  while not stop.is_set():
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
      samples.append([v.strip() for v in out.stdout.strip().splitlines()[0].split(",")])
    time.sleep(SAMPLE_S)


def under_load(fn, args, seconds: float) -> dict:
  """Loops fn(*args) for `seconds` while sampling the GPU: medians of the samples."""
  jax.block_until_ready(fn(*args))
  samples, stop = [], threading.Event()
  sampler = threading.Thread(target=sample_gpu, args=(stop, samples))
  if shutil.which("nvidia-smi"):
    sampler.start()
  start, calls = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    for _ in range(4):
      out = fn(*args)
    jax.block_until_ready(out)
    calls += 4
  stop.set()
  if sampler.is_alive():
    sampler.join()
  samples = samples[SETTLE_SAMPLES:]
  row = {"calls": calls, "samples": len(samples)}
  if samples:
    clock, power = [float(s[0]) for s in samples], [float(s[1]) for s in samples]
    row.update(sm_clock_mhz=statistics.median(clock), sm_clock_min_mhz=min(clock),
               power_w=statistics.median(power), power_limit_w=float(samples[0][2]),
               reasons=" ".join(sorted({s[3] for s in samples})), temperature_c=float(samples[-1][4]))
  return row


def jaxflash_prefill(q, k, v):
  import jaxflash  # here: an import error is one row's error
  return jaxflash.attention(q, k, v, is_causal=True)


def workloads(smoke: bool, quick: bool):
  """name -> (jitted fn, args, FLOPs per call)."""
  m = 256 if smoke else 8192
  a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
  cases = {"matmul": (jax.jit(lambda a: a @ a), (a,), 2.0 * m ** 3)}
  contenders = {"jaxflash": jaxflash_prefill, "tokamax": peers.tokamax_attention,
                "fa3": peers.fa3_attention}
  for n in ((128,) if smoke else (16384,) if quick else (16384, 32768)):
    args = make_inputs(1, n)
    for name, fn in contenders.items():
      cases[f"{name} n={n}"] = (jax.jit(fn), args, causal_flops(1, n))
  return cases


def main(argv=None):
  p = bench_arguments(__doc__, smoke="tiny CPU run", time_limit_s=240.0, quick="n = 16384 only")
  p.add_argument("--seconds", type=float, default=8.0, help="seconds of back-to-back calls a workload")
  p.set_defaults(out=str(STUDIES_DIR))  # a study's results stay out of the benchmark index
  args = p.parse_args(argv)
  limit = TimeLimit(args.time_limit_s)
  seconds = 0.2 if args.smoke else args.seconds
  meta, out_dir = begin_run("power", args, matmul_n=256 if args.smoke else 8192,
                            hbm_gib=1 / 64 if args.smoke else 1.0)
  meta.update(title="Power and SM clock under load",
              flops="matmul 2 m^3; prefill 4 n^2 d per head, halved for causal (FlashAttention-2)")
  major = (meta.get("compute_capability") or "0").split(".")[0]
  per_cycle = FLOP_PER_SM_CYCLE.get(int(major) if major.isdigit() else 0)
  rows, notes = [], []
  for name, (fn, fn_args, flops) in workloads(args.smoke, args.quick).items():
    if limit.exhausted():
      notes.append(f"{name}: skipped (time limit)")
      continue
    log(f"{name}")
    timed = device_times_us({name: (fn, fn_args)})[name]
    row, err = try_call(under_load, fn, fn_args, seconds)
    row = {"workload": name, **(row or {"error": err})}
    if hasattr(timed, "us"):
      row["tflops"] = flops / (timed.us * 1e-6) / 1e12
    else:
      row["error"] = (timed or {}).get("error")
    if per_cycle and row.get("sm_clock_mhz") and meta.get("sm_count"):
      row["clock_peak_tflops"] = meta["sm_count"] * per_cycle * row["sm_clock_mhz"] * 1e6 / 1e12
      if row.get("tflops"):
        row["fraction_of_clock_peak"] = row["tflops"] / row["clock_peak_tflops"]
    log(f"  {row}")
    rows.append(row)
    free_memory()
  columns = [("workload", "workload"), ("tflops", "TFLOP/s (device time)"),
             ("sm_clock_mhz", "SM clock, median (MHz)"), ("sm_clock_min_mhz", "min"),
             ("power_w", "power, median (W)"), ("power_limit_w", "limit (W)"),
             ("reasons", "clock-event reasons"), ("clock_peak_tflops", "bf16 peak at that clock"),
             ("fraction_of_clock_peak", "fraction of it", "{:.2f}"), ("error", "error")]
  notes += [f"{seconds:g} s of back-to-back calls a workload, nvidia-smi every {SAMPLE_S} s, the first "
           f"{SETTLE_SAMPLES} samples dropped. Reason 0x4 is the software power cap."]
  write_results("power", rows, meta, columns, out_dir=out_dir, notes=notes)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
