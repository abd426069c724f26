"""The benchmark harness without a GPU: trace parsing on a synthetic perfetto trace,
attribution of kernels to cases, the CPU wall-clock fallback, the result files and the
shared command-line options."""
from __future__ import annotations

import gzip
import importlib
import json
import math

import jax
import jax.numpy as jnp
import pytest

from bench import cli, report, timing, trace


def _synthetic_trace() -> dict:
  """What jax.profiler writes on a GPU, reduced: a host process, the GPU process (kernels on
  a stream thread, with hlo_module/hlo_op args) and a second GPU that must be ignored."""
  meta = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 8, "name": "process_name", "args": {"name": "/device:GPU:01"}},
      {"ph": "M", "pid": 7, "tid": 14, "name": "thread_name",
       "args": {"name": "Stream #14(Memset,Compute)"}},
      {"ph": "M", "pid": 7, "tid": 90, "name": "thread_name", "args": {"name": "XLA Ops"}},
  ]
  kernels = []
  for call in range(2):  # two timed calls of case A, one of case B
    t0 = 1000.0 * call
    kernels += [
        {"ph": "X", "pid": 7, "tid": 14, "ts": t0 + 10, "dur": 30.0, "name": "jaxflash_decode",
         "args": {"hlo_module": "jit_bcase000x", "hlo_op": "custom-call.1"}},
        {"ph": "X", "pid": 7, "tid": 14, "ts": t0 + 45, "dur": 5.0, "name": "jaxflash_decode_combine",
         "args": {"hlo_module": "jit_bcase000x", "hlo_op": "custom-call.2"}},
        {"ph": "X", "pid": 7, "tid": 14, "ts": t0 + 5, "dur": 1.0, "name": "Memset",
         "args": {"hlo_module": "jit_bcase000x"}},
    ]
  kernels.append({"ph": "X", "pid": 7, "tid": 14, "ts": 5000.0, "dur": 12.5,
                  "name": "nvjet_sm90_tst_128x256", "args": {"hlo_module": "jit_bcase001x"}})
  others = [
      {"ph": "X", "pid": 1, "tid": 3, "ts": 0.0, "dur": 9000.0, "name": "PjitFunction(bcase000x)"},
      {"ph": "X", "pid": 8, "tid": 2, "ts": 0.0, "dur": 777.0, "name": "other_gpu_kernel"},
      {"ph": "i", "pid": 7, "tid": 14, "ts": 3.0, "name": "instant event"},
      # A derived line repeating the kernels' span: must not be counted twice.
      {"ph": "X", "pid": 7, "tid": 90, "ts": 10.0, "dur": 40.0, "name": "custom-call.1",
       "args": {"hlo_module": "jit_bcase000x"}},
  ]
  return {"displayTimeUnit": "ns", "traceEvents": meta + kernels + others}


@pytest.fixture
def trace_dir(tmp_path):
  profile = tmp_path / "plugins" / "profile" / "2026_11_29_12_00_00"
  profile.mkdir(parents=True)
  with gzip.open(profile / "perfetto_trace.json.gz", "wt") as f:
    json.dump(_synthetic_trace(), f)
  return tmp_path


def test_trace_parser_sums_gpu_kernels(trace_dir):
  path = trace.find_perfetto_trace(trace_dir)
  assert path is not None and path.name == "perfetto_trace.json.gz"
  data = trace.load_trace(path)
  assert trace.process_names(data)[7] == "/device:GPU:0"
  events = trace.gpu_kernel_events(data)
  assert len(events) == 7  # host events, the other GPU, derived lines and instant events are left out
  assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)

  by_case, unassigned = trace.attribute_events(events, {"A": "bcase000x", "B": "bcase001x"})
  assert unassigned == 0 and len(by_case["A"]) == 6 and len(by_case["B"]) == 1
  us, kernels, launches = trace.summarize_kernels(by_case["A"], iters=2)
  assert us == pytest.approx(36.0) and launches == 3
  assert kernels == {"jaxflash_decode": 30.0, "jaxflash_decode_combine": 5.0, "Memset": 1.0}
  assert list(kernels)[0] == "jaxflash_decode"  # largest first
  t = timing.Timing(us, kernels)
  assert t.kernel_us("combine", "memset") == pytest.approx(6.0)

  _, unassigned = trace.attribute_events(events, {"A": "bcase000x"})
  assert unassigned == 1  # an event no case claims makes the grouped timing untrusted


def test_trace_without_thread_names_counts_every_gpu_event():
  data = _synthetic_trace()
  data["traceEvents"] = [e for e in data["traceEvents"] if e.get("name") != "thread_name"]
  assert len(trace.gpu_kernel_events(data)) == 8  # nothing tells the stream lines apart


def test_trace_parser_without_gpu_process(tmp_path):
  data = {"traceEvents": [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
                          {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5, "name": "host"}]}
  assert trace.gpu_kernel_events(data) == []
  assert trace.find_perfetto_trace(tmp_path) is None


def test_timing_method_matches_the_backend():
  """Device time from the profiler on a GPU; the wall clock, said so, without one."""
  x = jnp.ones((64, 64), jnp.float32)
  t = timing.device_time_us(jax.jit(lambda a: a @ a), x, iters=3)
  assert t.method == (timing.DEVICE if timing.has_gpu() else timing.WALL_NO_GPU)
  assert t.us > 0 and t.iters == 3

  def boom(a):
    raise ValueError("no such kernel")
  sets = timing.ArgSets([(x,), (x + 1,)])
  got = timing.device_times_us({"ok": (lambda a: a * 2, sets), "bad": (boom, (x,))},
                               iters=3, keep_output=True)
  assert "no such kernel" in got["bad"]["error"]
  assert isinstance(got["ok"], timing.Timing) and got["ok"].iters == 4  # whole rotations
  assert float(got["ok"].output[0, 0]) == 2.0  # first call, first argument set
  assert got["ok"].temp_bytes is not None  # the compiled call's scratch (memory_analysis)


def test_choose_iters_bounds():
  assert timing.choose_iters(1e9) == 3
  assert timing.choose_iters(1.0) == timing.MAX_ITERS
  assert timing.choose_iters(float("nan")) == 3
  assert timing.choose_iters(1e9, sets=4) == 4


def test_write_results(tmp_path):
  rows = [{"n": 1024, "jaxflash_tflops": 123.456, "cudnn_tflops": None, "ratio": float("nan"),
           "kernels": {"x": 1.0}},
          {"n": 2048, "jaxflash_tflops": 0.00123, "cudnn_tflops": 401.0, "ratio": 0.5}]
  meta = {"device": "NVIDIA H200", "backend": "gpu", "sm_count": 132, "compute_capability": "9.0",
          "driver": "570.00", "versions": {"jax": "0.11.2", "jaxlib": "0.11.2"},
          "date": "2026-11-29T12:00:00+00:00", "commit": "7716da6", "timing": "device",
          "ceilings": {"matmul_tflops": 813.0, "matmul_n": 8192, "hbm_read_gbs": 4600.0,
                       "hbm_read_bytes": 4 * 2**30}}
  plot = {"x": "n", "y": ["jaxflash_tflops", "cudnn_tflops"], "logx": True, "hline": (813.0, "ceiling")}
  paths = report.write_results("unit", rows, meta,
                               [("n", "n"), ("jaxflash_tflops", "jaxflash"), ("cudnn_tflops", "cuDNN"),
                                ("ratio", "jf/cudnn", "{:.2f}")],
                               plot=plot, out_dir=tmp_path, notes=["a note"], extra={"sweep": [{"a": 1}]})
  data = json.loads((tmp_path / "unit.json").read_text())  # strict JSON: NaN became null
  assert data["rows"][0]["ratio"] is None and data["rows"][0]["cudnn_tflops"] is None
  assert data["meta"]["device"] == "NVIDIA H200" and data["sweep"] == [{"a": 1}]
  assert set(data) == {"name", "meta", "rows", "notes", "sweep"}
  assert data["meta"] == json.loads(json.dumps(meta))  # the metadata as given, nothing added
  md = (tmp_path / "unit.md").read_text()
  assert "- GPU: NVIDIA H200" in md and "jax 0.11.2" in md and "2026-11-29" in md
  assert "commit 7716da6" in md
  assert "bf16 matmul 813 TFLOP/s" in md and "HBM read 4600 GB/s" in md
  assert "| n | jaxflash | cuDNN | jf/cudnn |" in md
  assert "| 1024 | 123 | – | – |" in md and "| 2048 | 1.23e-03 | 401 | 0.50 |" in md
  assert md.rstrip().endswith("- a note")
  pytest.importorskip("matplotlib")
  assert (tmp_path / "unit.png").stat().st_size > 1000 and paths["png"]


def test_format_value():
  assert report.format_value(None) == "–"
  assert report.format_value(math.inf) == "–"
  assert report.format_value(3) == "3"
  assert report.format_value(12.345) == "12.3"
  assert report.format_value(0.5, "{:.3f}") == "0.500"


def test_grouped_timing_attributes_kernels_by_module(monkeypatch):
  """The GPU path of device_times_us on CPU: a profiler trace that returns the synthetic
  trace, whose kernels carry the modules of cases 0 (A) and 1 (B)."""
  monkeypatch.setattr(timing, "has_gpu", lambda: True)
  ran = []
  monkeypatch.setattr(timing, "profile_trace", lambda run: (run(), ran.append(1), _synthetic_trace())[-1])
  x = jnp.ones((8,), jnp.float32)
  got = timing.device_times_us({"A": (lambda a: a + 1, (x,)), "B": (lambda a: a * 2, (x,))}, iters=2)
  assert ran == [1]  # one profiler trace for both cases
  assert got["A"].us == pytest.approx(36.0) and got["A"].launches == 3
  assert got["B"].us == pytest.approx(6.25) and list(got["B"].kernels) == ["nvjet_sm90_tst_128x256"]
  assert got["A"].method == timing.DEVICE


def test_grouped_timing_without_gpu_events_falls_back(monkeypatch):
  """A GPU backend whose trace holds no GPU events (here: the real profiler on CPU) ends in
  per-case traces and then the wall clock, and says so."""
  monkeypatch.setattr(timing, "has_gpu", lambda: True)
  x = jnp.ones((8,), jnp.float32)
  got = timing.device_times_us({"A": (lambda a: a + 1, (x,))}, iters=2)
  assert got["A"].method.startswith("wall (no GPU events")
  assert got["A"].method.endswith(timing.RETIMED_ALONE)


def test_shared_options_and_time_limit():
  parser = cli.bench_arguments("Doc line.\nMore.", smoke="tiny run", time_limit_s=12.0, quick="fewer",
                               sweep=True)
  args = parser.parse_args([])
  assert (args.smoke, args.quick, args.sweep, args.time_limit_s, args.out) == (False, False, True, 12.0, None)
  args = parser.parse_args(["--smoke", "--no-sweep", "--time-limit-s", "3", "--out", "/tmp/x"])
  assert (args.smoke, args.sweep, args.time_limit_s, args.out) == (True, False, 3.0, "/tmp/x")
  assert not cli.TimeLimit(60.0).exhausted() and cli.TimeLimit(-1.0).exhausted()


@pytest.mark.parametrize("script", ["prefill", "decode", "generate", "generate_tp", "profile_step", "power"])
def test_scripts_import_as_modules(script):
  """Every benchmark runs as `python -m bench.<script>`, without editing sys.path."""
  import sys
  before = list(sys.path)
  module = importlib.import_module(f"bench.{script}")
  assert callable(module.main) and sys.path == before


def test_mosaic_sweep_configs_parse_from_their_names():
  """Every config the Mosaic sweep names is a valid MosaicPrefillConfig, its flags as named."""
  from bench import mosaic_sweep
  from jaxflash.mosaic import MosaicPrefillConfig
  config = mosaic_sweep.parse_config("64x128x2oswr")
  assert config == MosaicPrefillConfig(64, 128, 2, overlap_softmax=True, separate_output=True,
                                       num_consumers=3, tensor_core_row_sums=True)
  assert mosaic_sweep.parse_config("64x64x2") == MosaicPrefillConfig(64, 64, 2)
  assert mosaic_sweep.parse_config("64x64x2ocf") == MosaicPrefillConfig(
      64, 64, 2, overlap_softmax=True, conditional_rescale=True, fixed_reference=True)
  with pytest.raises(ValueError, match="unknown flags"):
    mosaic_sweep.parse_config("64x64x2a")
  names = list(mosaic_sweep.SWEEP_CONFIGS) + [c for cs in mosaic_sweep.HEAD_DIM_SWEEP.values() for c in cs]
  for name in names:
    assert isinstance(mosaic_sweep.parse_config(name), MosaicPrefillConfig), name
