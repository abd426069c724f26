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
import numpy as np
import pytest

from bench import cli, index, readme_tables, report, suite, timing, trace


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


@pytest.mark.parametrize("script", ["prefill", "decode", "generate", "generate_tp", "accuracy", "windowed",
                                    "paged_prefill", "train", "serve", "studies.profile_step",
                                    "studies.power", "studies.decode_options", "studies.mosaic_sweep",
                                    "studies.quantized_decode_tiles", "studies.backward_error_map",
                                    "studies.rounding_emulation", "studies.dk_emulation",
                                    "studies.prefill_ab"])
def test_scripts_import_as_modules(script):
  """Every benchmark runs as `python -m bench.<script>`, without editing sys.path."""
  import sys
  before = list(sys.path)
  module = importlib.import_module(f"bench.{script}")
  assert callable(module.main) and sys.path == before


def test_backward_error_map_smoke():
  """The study's CPU run: the Triton backward's gradient rows, each error where it was found
  (an index inside the [B, n, heads] grid) and ordered p50 <= p99 <= p99.9 <= max; the Mosaic
  backward, which needs sm_90, loses its rows only."""
  from bench.studies import backward_error_map
  rows = backward_error_map.main(["--smoke"])
  assert [(r["gradient"], r["provider"]) for r in rows] == [
      (g, "triton_backward") for g in ("dq", "dk", "dv")]
  for r in rows:
    assert 0 < r["p50"] <= r["p99"] <= r["p999"] <= r["max"] < 0.05, r
    b, t, h = r["at"]
    assert 0 <= b < 1 and 0 <= t < 128 and 0 <= h < 2, r


def test_rounding_emulation_smoke():
  """The emulation's CPU run: a row per forward policy with the kernels' dS rounding, then the
  Mosaic forward's other dS roundings; errors of bf16's size (a half step of the output's and
  dQ's largest values, below 1e-2 relative), the Triton policy's dQ on its own output equal to
  its dQ on the exact output within a factor 2, and no dQ worse with dS in float16 or float32
  than with dS rounded to bf16."""
  from bench.studies import rounding_emulation as emulation
  rows = emulation.main(["--smoke"])
  assert [(r["policy"], r["ds_rounding"]) for r in rows] == (
      [(p, emulation.KERNELS_DS) for p in emulation.POLICIES]
      + [(emulation.MOSAIC, r) for r in ("bf16, scale folded in", "float16", "none (float32)")])
  for r in rows:
    assert 0 < r["dq_rel"] < 1e-2 and 0 < r["dq_rel_exact_out"] < 1e-2 and 0 < r["out_abs"] < 5e-2, r
    assert r["dq_at"].startswith("row ")
  assert 0.5 < rows[0]["dq_rel"] / rows[0]["dq_rel_exact_out"] < 2.0, rows[0]
  mosaic = {r["ds_rounding"]: r["dq_rel"] for r in rows if r["policy"] == emulation.MOSAIC}
  assert mosaic["none (float32)"] <= mosaic[emulation.KERNELS_DS], mosaic
  assert mosaic["float16"] <= mosaic[emulation.KERNELS_DS], mosaic
  with pytest.raises(SystemExit, match="--starts"):
    emulation.study_case(emulation.accuracy.Case("peaky", 256, 64), 32, starts=[250])


def test_dk_emulation_smoke():
  """The dK emulation's CPU run: a row per (output, dS rounding) and head, errors of bf16's
  size, and with the exact float32 output and dS unrounded only float32's rounding left
  (below 1e-5 of max |dK|, a hundred times under any bf16 variant)."""
  from bench.studies import dk_emulation
  rows = dk_emulation.main(["--smoke"])
  assert [(r["output"], r["ds_rounding"]) for r in rows] == dk_emulation.VARIANTS * 2
  for r in rows:
    assert 0 < r["dk_rel"] < 1e-2 and r["at"].startswith("key "), r
  for head in (0, 1):
    errors = {(r["output"], r["ds_rounding"]): r["dk_rel"] for r in rows if r["head"] == head}
    floor = errors[(dk_emulation.EXACT_F32, "float32")]
    assert floor < 1e-5 and all(100 * floor < e for k, e in errors.items() if k[1] == "bf16"), errors


def test_prefill_ab_imports_a_commit_beside_the_tree():
  """The A/B study's CPU run: jaxflash at HEAD imported as a package of its own, timed beside
  the working tree's in one process, the same function (equal outputs on one input)."""
  import jaxflash
  from bench.studies import prefill_ab
  at_head = prefill_ab.package_at("HEAD")
  assert at_head.__name__ == "jaxflash_at_HEAD" and at_head is not jaxflash
  assert at_head.prefill_attention.__module__.startswith("jaxflash_at_HEAD")
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 4, 64)), jnp.bfloat16)
  k, v = q[:, :, :2], q[:, :, 2:]
  np.testing.assert_array_equal(np.asarray(at_head.prefill_attention(q, k, v, is_causal=True), np.float32),
                                np.asarray(jaxflash.prefill_attention(q, k, v, is_causal=True), np.float32))
  rows = prefill_ab.main(["--smoke"])
  assert rows and rows[0]["tree_over_rev"] > 0 and rows[0]["HEAD_us"] > 0
  rows = prefill_ab.main(["--smoke", "--train"])  # forward + backward through jaxflash.attention
  assert rows and rows[0]["tree_over_rev"] > 0 and rows[0]["HEAD_us"] > 0


def test_train_at_another_head_dim_writes_its_own_table():
  """`bench.train --head-dim 64` times every row at d = 64 into train_d64.* (the d = 128
  tables, the sweep and the model step are not written)."""
  from pathlib import Path

  from bench import train
  before = set(Path("/tmp").glob("jaxflash_train_d64_smoke_*"))
  train.main(["--smoke", "--head-dim", "64"])
  (out,) = set(Path("/tmp").glob("jaxflash_train_d64_smoke_*")) - before
  result = json.loads((out / "train_d64.json").read_text())
  assert result["meta"]["shapes"]["head_dim"] == 64
  assert [(r["batch"], r["n"]) for r in result["rows"]] == [(1, 128), (2, 64)]
  assert all(r["jaxflash_tflops"] > 0 for r in result["rows"])
  assert sorted(p.name for p in out.glob("*.json")) == ["train_d64.json", "train_d64_memory.json"]


def test_prefill_ab_reads_a_commit_from_an_archive(tmp_path):
  """Where the tree's copy has no history, the commit comes as a tar of `git archive`."""
  import subprocess

  from bench.studies import prefill_ab
  tar = tmp_path / "at.tar"
  tar.write_bytes(subprocess.run(["git", "-C", str(prefill_ab.ROOT), "archive", "HEAD", "jaxflash"],
                                 check=True, capture_output=True).stdout)
  package = prefill_ab.package_at("archived", tar)
  assert package.__name__ == "jaxflash_at_archived"
  assert package.prefill_attention.__module__.startswith("jaxflash_at_archived")


def test_mosaic_sweep_configs_parse_from_their_names():
  """Every config the Mosaic sweep names is a valid MosaicPrefillConfig, its flags as named."""
  from bench.studies import mosaic_sweep
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


def test_suite_lists_every_benchmark_once_and_owns_every_result_file():
  """The suite's table names each result file in bench/results/h200 (no file of removed code)."""
  names = [b.name for b in suite.SUITE]
  assert len(names) == len(set(names))
  owned = {stem for b in suite.SUITE for stem in b.results}
  on_disk = {p.stem for p in report.RESULTS_DIR.glob("*.json")}
  assert on_disk <= owned, on_disk - owned
  assert not list(report.RESULTS_DIR.glob("*.log")) and not list(report.RESULTS_DIR.glob("*.txt"))


def test_suite_providers_are_the_scripts_own():
  from bench import prefill, train
  by_name = {b.name: b for b in suite.SUITE}
  assert by_name["prefill"].providers == prefill.IMPLS
  assert by_name["train"].providers == train.IMPLS


def test_peer_providers_join_when_they_import(monkeypatch):
  prefill = suite.select("prefill")[0]
  importable = {"flash_attn3_jax"}
  monkeypatch.setattr(suite.importlib.util, "find_spec", lambda name: object() if name in importable else None)
  assert "fa3" in prefill.available_providers() and "tokamax" not in prefill.available_providers()
  argv = prefill.argv(prefill.shapes[1], quick=True, out="/tmp/r")
  assert argv[:2] == ["--head-dim", "64"] and "--quick" in argv and argv[argv.index("--out") + 1] == "/tmp/r"
  assert argv[argv.index("--impls") + 1:] == list(prefill.available_providers())
  train = suite.select("train")[0]
  listed = train.argv(train.shapes[0])
  assert listed[listed.index("--impls") + 1] == ",".join(train.available_providers())
  assert "--quick" not in suite.select("generate_tp")[0].argv(suite.Shape("x"), quick=True)


def test_suite_selects_by_name():
  assert [b.name for b in suite.select("decode,prefill")] == ["prefill", "decode"]
  assert len(suite.select(None)) == len(suite.SUITE)
  with pytest.raises(ValueError, match="nosuch"):
    suite.select("prefill,nosuch")


def test_suite_dry_run_names_every_command(capsys):
  from bench import __main__ as bench_main
  assert bench_main.main(["--dry-run", "--quick"]) == 0
  printed = capsys.readouterr().out
  for b in suite.SUITE:
    assert f"python -m {b.module}" in printed
  assert printed.count("=== prefill [") == 3


def test_suite_quick_run_on_cpu_writes_results_and_index(tmp_path, monkeypatch):
  """`python -m bench --only accuracy --quick` end to end on the CPU (one tiny case)."""
  from bench import __main__ as bench_main
  from bench import accuracy
  monkeypatch.setattr(accuracy, "quick_cases", lambda: [accuracy.Case("dominant_key", 32, 32, margin=60.0)])
  assert bench_main.main(["--only", "accuracy", "--quick", "--out", str(tmp_path)]) == 0
  data = json.loads((tmp_path / "accuracy.json").read_text())
  assert [r["which"] for r in data["rows"]] == list(accuracy.WHICH)
  assert all(r["jaxflash_err"] is not None and r["cudnn_err"] is None for r in data["rows"])
  assert (tmp_path / "accuracy.md").exists() and (tmp_path / "accuracy.png").exists()
  listing = (tmp_path / "README.md").read_text()
  assert "| accuracy | Attention accuracy on hard inputs" in listing and "[json](accuracy.json)" in listing


def _result(path, commit, rows):
  path.write_text(json.dumps({"name": path.stem, "meta": {"commit": commit, "device": "NVIDIA H200",
                                                          "date": "2026-12-05T08:00:00+00:00"},
                              "rows": rows}))


def _suite_run(tmp_path, commits):
  prefill = {"batch": 1, "n": 4096, "jaxflash_tflops": 600.0, "jaxflash_pct": 74.0, "cudnn_tflops": 400.0,
             "fa3_tflops": 500.0, "tokamax_tflops": None}
  decode = {"batch": 1, "context": 32768, "jaxflash_gbs": 2400.0, "jaxflash_pct": 52.0, "cudnn_gbs": 2000.0}
  generate = [{"batch": 1, "prompt": 1024, "impl": i, "loop_ms_step": ms, "loop_over_floor": 2.0,
               "tokens_per_s": 700.0} for i, ms in (("jaxflash paged", 1.3), ("cudnn", 1.4))]
  accuracy_rows = [{"case": "peaky", "n": 4096, "d": 128, "which": w, "ratio": 1.1, "ratio_triton": 1.0}
                   for w in ("out", "lse", "dq", "dk", "dv")]
  for (name, rows), commit in zip((("prefill", [prefill, {**prefill, "n": 1024}]), ("decode", [decode]),
                                   ("generate", generate), ("accuracy", accuracy_rows)), commits):
    _result(tmp_path / f"{name}.json", commit, rows)


def test_readme_tables_come_from_one_commit(tmp_path):
  _suite_run(tmp_path, ["abc1234"] * 4)
  tables = readme_tables.render(tmp_path)
  assert "| 1 × 4096 | 600 (74%) | – | 400 | 500 | – | – | 1.50 | 1.20 |" in tables["prefill"]
  assert "1 × 1024" not in tables["prefill"]  # from 2K keys on
  assert "| 1 × 32K | 2400 (52%) | – | 2000 | – | 1.20 |" in tables["decode"]
  assert "| 1 × 1K | 1.30 | 1.40 | – | – | 2.00 | 700 |" in tables["generate"]
  assert "commit abc1234" in tables["accuracy"]
  readme = "a\n<!-- table:prefill -->\nold\n<!-- /table:prefill -->\nb\n"
  filled = readme_tables.fill(readme, {"prefill": tables["prefill"]})
  assert "old" not in filled and filled.startswith("a\n<!-- table:prefill -->\n| B × n |")
  assert filled.endswith("<!-- /table:prefill -->\nb\n")
  with pytest.raises(ValueError, match="decode"):
    readme_tables.fill(readme, {"decode": "x"})


@pytest.mark.parametrize("commits", [["abc1234", "abc1234", "def5678", "abc1234"],
                                     ["abc1234", None, "abc1234", "abc1234"],
                                     ["abc1234+changes"] * 4])
def test_readme_tables_refuse_mixed_commits(tmp_path, commits):
  _suite_run(tmp_path, commits)
  with pytest.raises(readme_tables.NotOneRun, match="one commit"):
    readme_tables.render(tmp_path)
  readme = tmp_path / "README.md"
  readme.write_text("<!-- table:prefill -->\nold\n<!-- /table:prefill -->\n")
  assert readme_tables.main(["--results", str(tmp_path), "--readme", str(readme)]) == 2
  assert "old" in readme.read_text()  # nothing written


def test_readme_has_a_marker_pair_for_every_generated_table():
  text = readme_tables.README.read_text()
  for table in readme_tables.TABLES:
    assert f"<!-- table:{table.name} -->" in text and f"<!-- /table:{table.name} -->" in text


def test_index_lists_every_result(tmp_path):
  _suite_run(tmp_path, ["abc1234"] * 4)
  (tmp_path / "decode.md").write_text("x")
  listing = index.write_index(tmp_path).read_text()
  assert listing.count("| abc1234 |") == 4 and "[md](decode.md)" in listing and "Commits: abc1234." in listing


def test_runner_runs_a_benchmark_from_its_declaration(tmp_path):
  """A benchmark declares what it measures; the runner parses, limits, saves as it goes, writes."""
  from bench import runner
  saved = []

  def collect(args, run):
    rows = [{"n": n, "ms": n / 10} for n in (args.n, 2 * args.n)]
    saved.append(run.save(rows[:1])["json"].exists())  # a partial save, as a long run makes
    run.meta["shapes"] = {"n": args.n}
    return rows, ["a note"] + (["limit"] if run.limit.exhausted() else [])

  toy = runner.Benchmark(name="toy", doc="A toy benchmark.\n\nMore.", collect=collect,
                         columns=[("n", "n"), ("ms", "ms")], time_limit_s=60.0, smoke="tiny",
                         ceilings=False, arguments=lambda p: p.add_argument("--n", type=int, default=4),
                         plot={"x": "n", "y": "ms"})
  paths = runner.main(toy, ["--n", "8", "--out", str(tmp_path)])
  data = json.loads(paths["json"].read_text())
  assert saved == [True] and [r["n"] for r in data["rows"]] == [8, 16]
  assert data["meta"]["title"] == "A toy benchmark" and data["meta"]["shapes"] == {"n": 8}
  assert data["notes"] == ["a note"] and data["meta"]["commit"]
  assert (tmp_path / "toy.md").read_text().startswith("# A toy benchmark")
  with pytest.raises(SystemExit):
    runner.main(toy, ["--no-such-option"])


@pytest.mark.parametrize("script", ["accuracy", "prefill", "windowed", "paged_prefill"])
def test_scripts_on_the_runner_declare_their_benchmark(script):
  module = importlib.import_module(f"bench.{script}")
  assert module.BENCHMARK.name == script and module.BENCHMARK.name in {
      stem for b in suite.SUITE for stem in b.results}


def test_prefill_options_choose_its_result_stem():
  from bench import prefill, runner
  args = runner.parse(prefill.BENCHMARK, ["--head-dim", "64", "--no-sweep", "--impls", "jaxflash", "cudnn"])
  assert prefill.BENCHMARK.stem(args) == "prefill_d64" and not args.sweep and args.impls == ["jaxflash", "cudnn"]
  assert prefill.BENCHMARK.stem(runner.parse(prefill.BENCHMARK, [])) == "prefill"


def test_http_client_counts_every_token_of_a_chunk():
  """bench.serve's HTTP client: a streamed chunk of a multi-step dispatch carries several
  tokens ("<id> " each, bench.serve.IdTokenizer), and each is counted, at the chunk's time."""
  import http.server
  import json
  import threading

  from bench import serve as serve_bench

  chunks = ["<5> <6> <7> ", "<8> ", ""]

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.end_headers()
      if body.get("stream"):
        for text in chunks:
          self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
      else:
        self.wfile.write(b"{}")

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    results = serve_bench._stream_requests(url, [(0.0, [1, 2], 4), (0.01, [3], 4)])
  finally:
    server.shutdown()
  assert [len(times) for _, times in results] == [4, 4]
  for arrival, times in results:
    assert times[0] == times[1] == times[2] <= times[3] and arrival <= times[0]


def test_serve_runs_split_over_calls_merge_into_one_file():
  """bench.serve --merge: the earlier rows of cells this run did not run come first, a cell run
  again takes this run's row, and notes saying a cell that has a row was skipped go; notes both
  calls wrote are kept once. The load plots cover every (trace, slots) the rows hold."""
  from bench import serve as serve_bench
  row = lambda trace, slots, system, tok_s: dict(trace=trace, slots=slots, rate=256.0,  # noqa: E731
                                                 system=system, output_tok_s=tok_s)
  earlier = [row("sharegpt", 32, "engine", 1.0), row("sharegpt", 32, "static", 2.0)]
  earlier_notes = ["compiles: ...", "sharegpt 256.0/s 256 slots engine: skipped (time budget)"]
  rows = [row("sharegpt", 256, "engine", 3.0), row("sharegpt", 32, "static", 4.0)]
  notes = ["compiles: ...", "sharegpt 256.0/s 128 slots static: skipped (time budget)"]
  merged_rows, merged_notes = serve_bench.merged(earlier, earlier_notes, rows, notes)
  assert [(r["slots"], r["system"], r["output_tok_s"]) for r in merged_rows] == [
      (32, "engine", 1.0), (256, "engine", 3.0), (32, "static", 4.0)]
  assert merged_notes == ["compiles: ...", "sharegpt 256.0/s 128 slots static: skipped (time budget)"]
  suffixes = {spec["suffix"] for spec in serve_bench.plots(merged_rows)}
  assert suffixes == {f"_sharegpt_{n}_{m}" for n in (32, 256)
                      for m in ("ttft_p99_ms", "itl_p50_ms", "output_tok_s")}
