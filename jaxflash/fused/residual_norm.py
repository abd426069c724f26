"""A residual add and the RMSNorm after it, in one kernel.

In a pre-norm decoder layer the attention's output projection o is added to the residual
stream x and the sum normalised for the MLP: h = x + o, then rms_norm(h) * scale. In a
decode step these are rows of a few KB, and XLA runs them as two kernels (the add with the
norm's reduction, then the scaling) of 1-2 us each, nearly all of it launch and latency
(bench/PERFORMANCE.md). Here one program per row does both, and it also adds up the K-chunk
partial sums of the product that made o (`jaxflash.skinny_matmul(..., return_partials=True)`),
so the product needs no reduction kernel of its own either.

The rounding follows Hugging Face's Qwen2/Llama in x's dtype: o = round(sum of the
partials), h = round(x + o), n = round(h * rsqrt(mean(h^2) + eps)), out = round(n * scale);
the arithmetic in between is fp32.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _checks
from jaxflash._triton import CompilerParams, load_masked, pl, quiet, store, use_interpret
from jaxflash._util import next_power_of_2


def _add_rms_norm_kernel(x_ref, deltas_ref, scale_ref, h_ref, out_ref, *, splits: int, size: int,
                         eps: float):
  """Program i: row i. x_ref [M, D]; deltas_ref [S, M, D]; scale_ref [D]; h_ref, out_ref [M, D]."""
  i = pl.program_id(0)
  size_p = next_power_of_2(size)
  in_row = None if size_p == size else jnp.arange(size_p) < size  # static: no mask when D is 2^k
  cols = pl.ds(0, size_p)
  delta = jnp.zeros((size_p,), jnp.float32)
  for s in range(splits):  # static: independent loads, all in flight at once
    delta = delta + load_masked(deltas_ref.at[jnp.int32(s), i, cols], in_row).astype(jnp.float32)
  delta = delta.astype(h_ref.dtype).astype(jnp.float32)  # the product's output, rounded as it would be
  x = load_masked(x_ref.at[i, cols], in_row).astype(jnp.float32)
  h = (x + delta).astype(h_ref.dtype)
  h32 = h.astype(jnp.float32)  # padding lanes are 0 and add nothing to the sum below
  normed = (h32 * lax.rsqrt(jnp.sum(h32 * h32) / size + eps)).astype(out_ref.dtype)
  scale = load_masked(scale_ref.at[cols], in_row).astype(out_ref.dtype)
  store(h_ref.at[i, cols], h, mask=in_row)
  store(out_ref.at[i, cols], (normed.astype(jnp.float32) * scale.astype(jnp.float32)).astype(out_ref.dtype),
        mask=in_row)


def _check(x, deltas, scale):
  for name, a in (("x", x), ("deltas", deltas), ("scale", scale)):
    _checks.check_float(name, a)
  if x.ndim < 1 or deltas.ndim not in (x.ndim, x.ndim + 1) or deltas.shape[-x.ndim:] != x.shape:
    raise ValueError(f"add_rms_norm takes x [..., D] and deltas of x's shape or [S, ..., D] "
                     f"(S partial sums), got x {tuple(x.shape)} and deltas {tuple(deltas.shape)}")
  if scale.shape != x.shape[-1:]:
    raise ValueError(f"scale must be [D] = ({x.shape[-1]},) for x {tuple(x.shape)}, got scale "
                     f"{tuple(scale.shape)}")


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x: jax.Array, deltas: jax.Array, scale: jax.Array, *, eps: float = 1e-6,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """(h, rms_norm(h) * scale) with h = x + deltas, in one kernel.

  x [..., D] the residual stream; deltas of x's shape, or [S, ..., D]: S partial sums (a
  product's K chunks, `jaxflash.skinny_matmul(..., return_partials=True)`) whose total is
  the update; scale [D] the RMSNorm's weight. The update is rounded to x's dtype before the
  add, then h and the normalised h are rounded as Hugging Face's Qwen2 rounds them; both
  come back in x's dtype. One program per row of D: meant for decode steps' few rows.
  """
  _check(x, deltas, scale)
  if deltas.ndim == x.ndim:
    deltas = deltas[None]
  size = x.shape[-1]
  rows = math.prod(x.shape[:-1])
  if rows == 0 or size == 0:
    return x, x
  x2 = x.reshape(rows, size)
  deltas = deltas.reshape(deltas.shape[0], rows, size)
  size_p = next_power_of_2(size)
  with quiet():
    h, out = pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, splits=deltas.shape[0], size=size, eps=float(eps)),
        grid=(rows,),
        out_shape=[jax.ShapeDtypeStruct((rows, size), x.dtype)] * 2,
        # One row's loads in flight at once: ~8 values a thread.
        compiler_params=CompilerParams(num_warps=min(16, max(4, size_p // 256)), num_stages=1),
        interpret=use_interpret(interpret),
        name="jaxflash_add_rms_norm",
    )(x2, deltas, scale)
  return h.reshape(x.shape), out.reshape(x.shape)


def add_rms_norm_reference(x, deltas, scale, *, eps: float = 1e-6):
  """Plain-JAX add_rms_norm with the same roundings: for checking."""
  if deltas.ndim == x.ndim:
    deltas = deltas[None]
  update = jnp.sum(deltas.astype(jnp.float32), axis=0).astype(x.dtype)
  h = (x.astype(jnp.float32) + update.astype(jnp.float32)).astype(x.dtype)
  h32 = h.astype(jnp.float32)
  normed = (h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return h, (normed.astype(jnp.float32) * scale.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
