"""The one place that imports Pallas' Triton backend.

JAX 0.11 marks the Pallas-Triton lowering deprecated (the warning is expected: it is
still the lowering that runs on every NVIDIA generation from Ampere on), so its
warning is filtered here, around the import, and around each kernel's lowering
through `quiet`.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import jax
import jax.numpy as jnp

from jaxflash import configs

_TRITON_WARNING = r"(?s).*[Tt]riton.*"


@contextlib.contextmanager
def quiet():
  """Silences the Pallas-Triton deprecation warning (and only it)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_TRITON_WARNING, category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=_TRITON_WARNING, category=FutureWarning)
    yield


with quiet():
  from jax.experimental import pallas as pl  # noqa: E402
  from jax.experimental.pallas import triton as plgpu  # noqa: E402

dot = plgpu.dot  # `pl.dot` is gone in JAX 0.11; this one works in 0.10 and 0.11.
load = plgpu.load
store = plgpu.store
atomic_add = plgpu.atomic_add  # acq_rel at GPU scope; returns the old value
block_barrier = plgpu.debug_barrier  # bar.sync: the program's threads wait for each other (compiled only)
CompilerParams = plgpu.CompilerParams


LOG2_E = math.log2(math.e)  # scores times log2(e): softmax in exp2, the GPU's native exponential
LN_2 = math.log(2.0)  # log2-sum-exp times ln(2): the natural-log LSE the API returns


def mask2d(row_ok, col_ok, shape=None):
  """row_ok [R] and col_ok [C] boolean vectors (either may be None) -> their AND as a mask
  broadcastable to [R, C] (broadcast to `shape` when given), or None when neither is
  given: a load or store with no mask at all, the fast path."""
  if row_ok is None and col_ok is None:
    return None
  if col_ok is None:
    mask = row_ok[:, None]
  elif row_ok is None:
    mask = col_ok[None, :]
  else:
    mask = row_ok[:, None] & col_ok[None, :]
  return mask if shape is None else jnp.broadcast_to(mask, shape)


def load_masked(ref, mask):
  """load(ref), with zeros where `mask` (None: load everything, no mask) is False. Triton
  takes no `other` without a mask, hence the one helper."""
  return load(ref) if mask is None else load(ref, mask=mask, other=0.0)


def exp2(x, *, approx: bool):
  """2**x for float32 `x`. With `approx` (compiled kernels only: interpret mode has no PTX)
  it is one `ex2.approx.ftz.f32`, the GPU's special-function instruction, as Triton's own
  `tl.exp2` emits; Pallas' `jnp.exp2` calls libdevice's `__nv_exp2f`, which adds denormal
  handling around it. exp2(-inf) is still exactly 0."""
  if not approx:
    return jnp.exp2(x)
  [y] = plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


APPROX_EXP2 = True  # compiled kernels use ex2.approx (see `exp2`)


def block_size(limit: int, length: int) -> int:
  """`limit`, or less for short sequences: a power of two >= 16 covering `length`."""
  return min(limit, max(configs.MIN_BLOCK, 1 << (max(length, 1) - 1).bit_length()))


def load_tile(ref, layout: tuple[bool, bool], kv_start, block_k: int, row_ok, key_ok):
  """This step's tile of a bias or mask operand, broadcastable to [block_q, block_k].

  layout: (rows, keys), whether the operand varies along T and S; an axis it is broadcast
  along was squeezed out of its block (stride 0), so `ref` is [block_q, seq_kv], [block_q],
  [seq_kv] or []. row_ok [block_q], key_ok [block_k]: loads to make (None: all).
  """
  rows, keys = layout
  other = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.
  if rows and keys:
    mask = mask2d(row_ok, key_ok, (ref.shape[0], block_k))
    tile = ref.at[:, pl.ds(kv_start, block_k)]
    return load(tile) if mask is None else load(tile, mask=mask, other=other)
  if rows:
    return (load(ref) if row_ok is None else load(ref, mask=row_ok, other=other))[:, None]
  if keys:
    tile = ref.at[pl.ds(kv_start, block_k)]
    return (load(tile) if key_ok is None else load(tile, mask=key_ok, other=other))[None, :]
  return ref[...]


def operand_spec(x, block_q: int, num_q_blocks: int):
  """BlockSpec and (rows, keys) layout of a [Bb, Nb, Tb, Sb] bias or mask on a (head, query
  block, sequence) grid whose query blocks run backwards: an axis of size 1 is squeezed and
  its block index pinned to 0 (read with stride 0, never expanded)."""
  bb, nb, tb, sb = x.shape
  block = (None, None, block_q if tb > 1 else None, sb if sb > 1 else None)

  def index(n, i, b):
    return (b if bb > 1 else 0, n if nb > 1 else 0, num_q_blocks - 1 - i if tb > 1 else 0, 0)

  return pl.BlockSpec(block, index), (tb > 1, sb > 1)


def use_interpret(interpret: bool | None = None) -> bool:
  """`interpret` if given, else True exactly when JAX's default backend is not a GPU."""
  if interpret is not None:
    return bool(interpret)
  return jax.default_backend() != "gpu"


__all__ = ["pl", "plgpu", "dot", "load", "load_masked", "store", "atomic_add", "block_barrier", "exp2",
           "mask2d", "LOG2_E", "LN_2", "CompilerParams", "quiet", "use_interpret", "APPROX_EXP2",
           "block_size", "load_tile", "operand_spec"]
