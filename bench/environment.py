"""What a result file records about where it ran: GPU, driver, software versions, date (UTC).

No hostname and nothing about who ran it: a result file names the hardware and software only.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax


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


def _git_commit() -> str | None:
  """The checkout's commit, with "+changes" when tracked files differ from it; BENCH_COMMIT
  overrides it where the tree was copied without its history (a GPU machine's copy)."""
  if os.environ.get("BENCH_COMMIT"):
    return os.environ["BENCH_COMMIT"]
  root = Path(__file__).resolve().parent.parent
  try:
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, timeout=10)
    if head.returncode:
      return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head.stdout.strip() + ("+changes" if dirty else "")


def env_metadata() -> dict:
  """GPU, software versions, commit and date (UTC) for the result files; no hostname."""
  dev = jax.devices()[0]
  smi = _nvidia_smi()
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
      "commit": _git_commit(),
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
