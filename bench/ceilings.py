"""The two ceilings every kernel is judged against, measured in the same run as the kernels.

- HBM read: GB/s (1e9) that an XLA reduction reaches over a few GiB of random bf16; the
  decode kernels (memory-bound) are reported as a % of it.
- bf16 matmul: TFLOP/s (1e12) of an n x n x n XLA matmul on random data; the prefill kernels
  (compute-bound) are reported as a % of it.
"""
from __future__ import annotations

import gc
from typing import Any

import jax
import jax.numpy as jnp

from bench.timing import device_time_us, has_gpu, try_call


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


def measure(matmul_n: int = 8192, hbm_gib: float = 4.0) -> dict:
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

