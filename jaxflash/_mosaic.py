"""The one place that imports Pallas' Mosaic GPU backend.

Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`) is the Pallas lowering that exposes
Hopper's TMA copies, wgmma and warp specialisation; the kernels here run on Hopper (sm_90)
only. Its import is guarded: a JAX without it (or with a broken one) still imports jaxflash,
and `AVAILABLE` is False with `IMPORT_ERROR` saying why, so the dispatch can fall back to the
Pallas-Triton kernels and say so.

GPU interpret mode (JAX >= 0.10.2): `InterpretGPUParams` simulates a Mosaic GPU kernel's
warpgroups, shared memory, barriers, TMA copies and wgmma on the CPU. It is not exported
under `jax.experimental.pallas` in 0.10.2; the private path is the same in 0.10.2 and 0.11.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

AVAILABLE = False
IMPORT_ERROR: str | None = None
pl = plgpu = InterpretGPUParams = None

try:
  from jax.experimental import pallas as pl  # noqa: F811
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: F811
  for _name in ("kernel", "wgmma", "copy_gmem_to_smem", "copy_smem_to_gmem", "barrier_wait",
                "barrier_arrive", "set_max_registers", "layout_cast", "broadcasted_iota"):
    if not hasattr(plgpu, _name):
      raise ImportError(f"jax.experimental.pallas.mosaic_gpu has no {_name}")
  AVAILABLE = True
except Exception as e:  # noqa: BLE001 -- any failure means "no Mosaic GPU here"
  IMPORT_ERROR = f"{type(e).__name__}: {e}"

try:
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm
except Exception:  # noqa: BLE001 -- only the named barriers need them
  ir = llvm = None

try:
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F811
except Exception:  # noqa: BLE001 -- interpret mode is optional
  InterpretGPUParams = None

LOG2_E = math.log2(math.e)  # scores times log2(e): softmax in exp2, the GPU's native exponential
LN_2 = math.log(2.0)  # log2-sum-exp times ln(2): the natural-log LSE the API returns
# What JAX 0.10.2's Mosaic GPU interpreter lacks for a FlashAttention-3 style kernel, found
# running jaxflash.mosaic.prefill on the CPU (2026-12-01): each is an error at trace or run time.
INTERPRET_GAPS = (
    "JAX's Mosaic GPU interpret mode (0.10.2) cannot run the Mosaic prefill: it has no rule for "
    "run_state on a wgmma accumulator (O += P V in place), accumulator refs cannot be stored to, "
    "layout_cast has no CPU lowering, and a transposed SMEM operand (K^T) in wgmma fails "
    "('TransposeTransform' object has no attribute 'indices'). Use jaxflash.prefill_attention "
    "(Pallas-Triton, interpretable) off the GPU.")
# wgmma is an sm_90a instruction: Hopper has it, Blackwell (sm_100 and up) does not (its tensor
# cores take tcgen05 instructions), so the Mosaic kernels here serve compute capability 9.x.
CAPABILITY_MAJOR = 9


def named_barrier(operation: str, barrier_id, num_threads: int) -> None:
  """PTX `bar.sync` / `bar.arrive` on hardware barrier `barrier_id` (an int32 scalar, may
  differ between warpgroups) counting `num_threads` threads. Cheaper than an mbarrier
  round trip through shared memory; Mosaic GPU keeps the low IDs for itself, so callers
  use 8 and up."""
  if operation not in ("sync", "arrive"):
    raise ValueError(f"operation must be 'sync' or 'arrive', got {operation!r}")

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def bar(_, index):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [index.registers[()]],
                    f"bar.{operation} $0, {num_threads};", "r", has_side_effects=True)

  bar(jnp.asarray(barrier_id, jnp.int32))


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def interpret_params(interpret):
  """`interpret` (None: on when there is no GPU) -> what `plgpu.kernel(interpret=)` takes."""
  use = (not on_gpu()) if interpret is None else bool(interpret)
  if not use:
    return None
  if InterpretGPUParams is None:
    raise NotImplementedError("this JAX has no Mosaic GPU interpret mode (InterpretGPUParams)")
  return InterpretGPUParams()


__all__ = ["AVAILABLE", "IMPORT_ERROR", "pl", "plgpu", "InterpretGPUParams", "LOG2_E", "LN_2",
           "CAPABILITY_MAJOR", "INTERPRET_GAPS", "named_barrier", "on_gpu", "interpret_params"]
