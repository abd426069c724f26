"""Shared fixtures: every kernel test runs interpreted (any machine) and compiled (GPU only).

`pytest` on a machine without a GPU deselects the compiled half (marker `gpu`);
`pytest -m gpu` on a GPU runs only the compiled half.

On the CPU the suite is mostly XLA compilation (the interpreted kernels make large
programs), so two things keep a compilation from being paid twice:
- a JAX persistent compilation cache for the whole pytest run (a temporary directory that
  every pytest-xdist worker shares, removed at the end; JAXFLASH_TEST_COMPILATION_CACHE names
  another directory to keep, or set empty turns it off);
- under `pytest -n N` (pytest-xdist's `load` scheduling) the tests of each module in
  SHARED_STATE_MODULES go to one worker together: their module-scoped models, checkpoints
  and jitted steps are built once, not once per worker. Other tests are handed out one by
  one, as `load` does.
"""
from __future__ import annotations

import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HAS_GPU = jax.default_backend() == "gpu"
NUM_DEVICES = jax.device_count()


def _mosaic_prefill_runs() -> bool:
  from jaxflash.mosaic import supports
  shape = jax.ShapeDtypeStruct((1, 8, 1, 64), jnp.bfloat16)
  return supports(shape, shape, shape) is None


# Tests of the Mosaic GPU prefill's compiled kernel: on a GPU without it (before sm_90),
# skipped with the reason.
SM90_ONLY = pytest.mark.skipif(HAS_GPU and not _mosaic_prefill_runs(),
                               reason="the Mosaic prefill needs an sm_90 GPU")


COMPILATION_CACHE_ENV = "JAXFLASH_TEST_COMPILATION_CACHE"
# Compilations that take at least this long go to the persistent cache (shorter ones are
# cheaper to redo than to hash, write and read back).
MIN_CACHED_COMPILE_SECONDS = 0.5
_CREATED_CACHE = pytest.StashKey[str]()

# Modules whose tests share state that is costly to build (models, checkpoints, jitted
# steps, a subprocess's results): under pytest-xdist each runs on one worker.
SHARED_STATE_MODULES = ("test_qwen2_model.py", "test_qwen2_parity.py", "test_qwen2_tp.py",
                        "test_qwen2_window.py", "test_serving.py", "test_serve.py")


def pytest_configure(config):
  """The persistent compilation cache (CPU only): made by the main process (xdist's
  controller, or the only one), whose environment the xdist workers inherit."""
  if not hasattr(config, "workerinput"):
    if not HAS_GPU and COMPILATION_CACHE_ENV not in os.environ:
      directory = tempfile.mkdtemp(prefix="jaxflash_compilation_cache_")
      config.stash[_CREATED_CACHE] = directory
      os.environ[COMPILATION_CACHE_ENV] = directory  # inherited by the xdist workers
  directory = os.environ.get(COMPILATION_CACHE_ENV)
  if not HAS_GPU and directory and jax.config.jax_compilation_cache_dir is None:
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_SECONDS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """pytest-xdist's `load` scheduling (the default of -n), except that each module of
  SHARED_STATE_MODULES is one unit of work. (Its `loadgroup` mode would do this with
  `xdist_group` marks, but it renames test ids, which pytest 9 no longer allows.)"""
  if config.getoption("dist") != "load":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class SharedStateModules(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      module = nodeid.split("::", 1)[0]
      return module if os.path.basename(module) in SHARED_STATE_MODULES else nodeid

  return SharedStateModules(config, log)


def pytest_unconfigure(config):
  directory = config.stash.get(_CREATED_CACHE, None)
  if directory is not None:
    shutil.rmtree(directory, ignore_errors=True)
    os.environ.pop(COMPILATION_CACHE_ENV, None)


def _runs_here(item) -> bool:
  if item.get_closest_marker("gpu") and not HAS_GPU:
    return False
  if item.get_closest_marker("multi_gpu") and not (HAS_GPU and NUM_DEVICES >= 2):
    return False
  if item.get_closest_marker("single_device") and NUM_DEVICES != 1:
    return False
  return True


def pytest_collection_modifyitems(config, items):
  """Tests that cannot run on this machine are deselected (not skipped): `gpu` without a GPU,
  `multi_gpu` with fewer than two, `single_device` with more than one device."""
  keep, drop = [], []
  for item in items:
    (keep if _runs_here(item) else drop).append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


ROOT = pathlib.Path(__file__).resolve().parents[1]
FORCED_CPU_DEVICES = 4


def run_on_forced_cpu_devices(module: str, *args: str):
  """`python -m module args` on FORCED_CPU_DEVICES host devices (a CPU process gets more than
  one device only from a flag read when JAX starts, hence the subprocess); its last line of
  output, parsed as JSON."""
  flags = (os.environ.get("XLA_FLAGS", "")
           + f" --xla_force_host_platform_device_count={FORCED_CPU_DEVICES}")
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


MAX_MEMORY_MAPS = 20_000  # Linux refuses more than vm.max_map_count (65530 by default)


def _memory_maps() -> int:
  try:
    with open("/proc/self/maps") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux: no such limit to keep under
    return 0


@pytest.fixture(autouse=True)
def release_compiled_code():
  """Drops JAX's compiled executables once they hold many memory maps. XLA:CPU maps each
  executable's code while its cache entry lives; over the whole suite a worker would pass
  the kernel's limit on maps per process, and LLVM then fails ("Cannot allocate memory")
  or the worker dies. Clearing only past a threshold keeps the recompiles rare."""
  yield
  if _memory_maps() > MAX_MEMORY_MAPS:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(params=[pytest.param(True, id="interpret"),
                        pytest.param(False, id="compiled", marks=pytest.mark.gpu)])
def interpret(request):
  """True: Pallas interpret mode; False: compiled Triton kernels (GPU only)."""
  return request.param


@pytest.fixture
def rng(request):
  """A fresh generator per test; its seed is printed so a failure can be replayed."""
  seed = int(os.environ.get("JAXFLASH_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
  print(f"{request.node.nodeid}: JAXFLASH_TEST_SEED={seed}")
  return np.random.default_rng(seed)


def poison_allocator(*shape_dtypes) -> None:
  """Fills device memory of the outputs' sizes with NaN and frees it, so the allocator hands
  poisoned bytes to the next call's outputs: an element a kernel forgets to write reads NaN.
  (Interpret mode needs no help: Pallas starts its outputs as NaN there.)"""
  poison = [jnp.full(s.shape, jnp.nan, s.dtype).block_until_ready() for s in shape_dtypes]
  del poison


def random_array(rng, shape, dtype, scale=1.0):
  return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32), dtype=dtype)


def d_scale_limit(q, dq, dq_ref, scale) -> float:
  """Tolerance of d_scale = sum(q * dq) / scale, checked beside dq (elementwise): the error
  dq already has, projected on q, plus the sum's float32 rounding. The rounding scales with
  the terms' magnitude (about 8 float32 ulps of it here), not with the sum, which may be near
  zero; dq's own error can dominate where dS = P (dP - D) cancels to ~0 (a row that sees one
  key), and it carries into d_scale by the identity above."""
  q, dq, dq_ref = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, dq, dq_ref))
  rounding = 1e-6 * float(np.abs(q * dq_ref).sum())
  carried = abs(float((q * (dq - dq_ref)).sum()))
  return (rounding + carried) / abs(float(scale))


def assert_close(actual, expected, dtype, *, what="output"):
  """Relative-norm and elementwise checks against a float64 reference, by input dtype."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  assert not np.isnan(actual).any(), f"{what} has NaN (unwritten or masked rows)"
  tol = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.bfloat16): 1.6e-2}
  atol = tol[jnp.dtype(dtype)]
  finite = np.isfinite(expected)
  np.testing.assert_array_equal(np.isfinite(actual), finite, err_msg=f"{what}: inf pattern differs")
  err = np.abs(actual[finite] - expected[finite])
  assert err.size == 0 or err.max() <= atol * max(1.0, np.abs(expected[finite]).max()), (
      f"{what}: max error {err.max():.3g} over tolerance {atol} for {jnp.dtype(dtype).name}")
