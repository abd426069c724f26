"""`jaxflash.attention` under `jax.jit` with sharded inputs (jaxflash/sharding.py).

Each kernel runs on a 4-device mesh split over heads, over batch, over both (2 x 2), and
replicated; its outputs must equal the single-device run, keep the inputs' batch and head
splits, and the compiled program must hold no collective (no all-gather of the inputs).
CPU: four forced host devices, which must be set before JAX starts, so the cases run in a
subprocess (tests/sharding_cases.py), one per kernel. GPU: in-process, compiled kernels,
on however many GPUs the host has (2 or more).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from tests.conftest import run_on_forced_cpu_devices

KERNELS = ("prefill", "decode", "paged", "paged_prefill")
TOLERANCE = 2e-5  # float32; the kernels see other shapes per shard (other KV splits)


def _check(results):
  assert results, "no layout ran"
  for r in results:
    where = f"{r['layout']}: "
    if r["layout"] != "heads_indivisible":  # there the results' split is XLA's choice
      assert r["out_spec"] == r["want_out_spec"], where + f"out sharding {r['out_spec']}"
      assert r["lse_spec"] == r["want_lse_spec"], where + f"lse sharding {r['lse_spec']}"
    assert not r["out_nan"], where + "output has NaN"
    assert r["lse_inf_same"], where + "-inf pattern of the LSE differs from one device's"
    assert r["out_err"] <= TOLERANCE, where + f"output differs from one device's by {r['out_err']}"
    assert r["lse_err"] <= TOLERANCE, where + f"LSE differs from one device's by {r['lse_err']}"
    if r["layout"] == "heads_indivisible":
      assert any("cannot be split" in w for w in r["warnings"]), where + "no warning"
    else:
      assert r["collectives"] == [], where + f"compiled program has {r['collectives']}"
      assert r["warnings"] == [], where + f"{r['warnings']}"


@pytest.mark.parametrize("kernel", KERNELS)
def test_sharded_cpu_mesh(kernel):
  results = run_on_forced_cpu_devices("tests.sharding_cases", kernel)
  assert {r["layout"] for r in results["layouts"]} >= {"heads", "batch", "both", "replicated"}
  _check(results["layouts"])
  if kernel == "decode":  # jax.vmap still works where the call is custom-partitioned
    assert results["vmap_error"] <= TOLERANCE, results["vmap_error"]
  if kernel == "prefill":  # keys split across a KV head (sub-axis): resharded, not an error
    projected = results["projected_kv"]
    assert projected["out_spec"] == [None, None, "model", None], projected
    assert projected["out_err"] <= TOLERANCE, projected
    options = results["options"]  # bias, mask, sinks, window, soft-cap, traced scale
    assert options["out_spec"] == ["data", None, "model", None], options
    assert options["collectives"] == [], options
    assert options["out_err"] <= TOLERANCE and options["lse_err"] <= TOLERANCE, options
  # Inside jax.shard_map (check_vma on): the kernel runs per device.
  assert results["shard_map"]["out_err"] <= TOLERANCE, results["shard_map"]
  assert results["shard_map"]["lse_err"] <= TOLERANCE, results["shard_map"]


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_sharded_gpu_mesh(kernel):
  from tests import sharding_cases
  devices = jax.devices()[:4] if jax.device_count() >= 4 else jax.devices()[:2]
  _check(sharding_cases.run(kernel, devices))
  # Every kernel's results carry their inputs' varying axes (sharding.result_struct).
  shard_map = sharding_cases.shard_map_case(kernel, devices)  # compiled, per device
  assert shard_map["out_err"] <= TOLERANCE and shard_map["lse_err"] <= TOLERANCE, shard_map
  if kernel == "prefill":
    options = sharding_cases.options_case(devices)
    assert options["collectives"] == [], options
    assert options["out_err"] <= TOLERANCE and options["lse_err"] <= TOLERANCE, options


@pytest.mark.single_device
def test_single_device_calls_the_kernel_directly():
  """On one device the wrapper adds nothing: the program holds no custom_partitioning."""
  q = jnp.zeros((1, 4, 4, 16), jnp.float32)
  kv = jnp.zeros((1, 8, 2, 16), jnp.float32)
  for query in (q, q[:, :1]):
    jaxpr = str(jax.make_jaxpr(jaxflash.attention)(query, kv, kv))
    assert "pallas_call" in jaxpr
    assert "custom_partitioning" not in jaxpr and "custom_vmap" not in jaxpr
