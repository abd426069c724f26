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
  import numpy as np
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, scf, vector
  from jax.experimental.mosaic import gpu as mgpu
except Exception:  # noqa: BLE001 -- only the inline Mosaic GPU helpers need them
  ir = llvm = arith = scf = vector = mgpu = None

try:
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F811
except Exception:  # noqa: BLE001 -- interpret mode is optional
  InterpretGPUParams = None

LOG2_E = math.log2(math.e)  # scores times log2(e): softmax in exp2, the GPU's native exponential
LN_2 = math.log(2.0)  # log2-sum-exp times ln(2): the natural-log LSE the API returns
# What JAX 0.10.2's Mosaic GPU interpreter lacks for a FlashAttention-3 style kernel, found
# running the Mosaic prefill (jaxflash.mosaic.forward) on the CPU: each is an error at trace or run time.
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


def scale_rows_if_any(x, row_scale):
  """x * row_scale[:, None] for x [rows, cols] float32 in the wgmma layout and row_scale
  [rows] in its row layout, with the multiply skipped by every warp whose rows all have
  scale 1 (a warp vote, then a branch the warp takes together). The online softmax's
  rescale of the accumulator is such a multiply: once the running max is kept unless it
  grows by a threshold, almost every step's scale is 1 (FlashAttention-4's conditional
  rescaling)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=plgpu.Layout.WGMMA))
  def scale(_, acc, row):
    one = arith.constant(ir.F32Type.get(), 1.0)
    i32 = ir.IntegerType.get_signless(32)
    needed = None
    for reg in row.registers.flat:  # this thread's rows: vector<1xf32> each
      for i in range(ir.VectorType(reg.type).shape[0]):
        elem = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
        ne = arith.cmpf(arith.CmpFPredicate.UNE, elem, one)  # NaN scales multiply too
        needed = ne if needed is None else arith.ori(needed, ne)
    # vote.sync.any: the warp branches together (its 16 rows decide as one).
    any_needed = llvm.inline_asm(
        i32, [arith.extui(i32, needed)],
        "{ .reg .pred p; setp.ne.b32 p, $1, 0; vote.sync.any.pred p, p, 0xffffffff; "
        "selp.b32 $0, 1, 0, p; }", "=r,r", has_side_effects=True)
    flat = list(acc.registers.flat)
    branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ne, any_needed, arith.constant(i32, 0)),
                      [r.type for r in flat], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scaled = acc * row.broadcast_in_dim(acc.shape, (0,), acc.layout)
      scf.YieldOp(list(scaled.registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.YieldOp(flat)
    registers = np.empty(acc.registers.shape, dtype=object)
    registers.flat[:] = list(branch.results)
    return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)

  return scale(x, row_scale)


def with_extra_refs(kernel, inputs: int, count: int, to_keywords):
  """`kernel` for `plgpu.kernel`, given `count` more input refs after its first `inputs`
  (segment ids, a block table: operands only some calls have); they reach the kernel as the
  keywords `to_keywords(refs)` names, and the outputs and scratch refs follow the inputs as
  the kernel expects. The kernel's own name is kept (profiles show it)."""
  if count == 0:
    return kernel

  def with_refs(*refs):
    extra = refs[inputs:inputs + count]
    kernel(*refs[:inputs], *refs[inputs + count:], **to_keywords(extra))

  with_refs.__name__ = kernel.__name__
  return with_refs


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
           "CAPABILITY_MAJOR", "INTERPRET_GAPS", "named_barrier", "on_gpu", "interpret_params",
           "with_extra_refs"]
