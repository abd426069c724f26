"""A decode step's SwiGLU feed-forward half of a decoder layer in two kernel launches.

The half is h + down(silu(n @ w_gate) * (n @ w_up)) with n = rms_norm(h). At batch 1 it
reads the layer's largest weights (gate and up 1536 x 8960 each, down 8960 x 1536 in the
1.5B model), and XLA adds four small kernels around the two GEMMs: the RMSNorm's reduction
and multiply, SiLU times up, and the residual add (~5.7 us a layer on the H200, against
~25 for the GEMMs: bench/NOTES.md). Here:

  1. up: the skinny matmul (jaxflash/linear.py) of h * scale by gate and up laid side by
     side, the RMSNorm folded in as in jaxflash/qkv.py (each program also sums h^2 over
     its K chunk), writing fp32 partial products. Given `addend` (the K-chunk partials of
     the product before, the attention's output projection), h = x + their sum is formed
     tile by tile as the programs read x, and stored once for the residual.
  2. down: the skinny matmul whose x tiles are made from those partials as they are read:
     r = rsqrt(sum(h^2) / D + eps), a = silu(r * gate) * (r * up), rounded to the
     weights' dtype. It writes fp32 partials of down's K chunks.

The residual add h + down(a) is left to the consumer: an XLA reduction that fuses into
what follows, or with `return_partials` the next layer's `jaxflash.qkv_projection(...,
addend=...)`, which adds them as it reads its x.

The products run in the weights' dtype with fp32 accumulation; the norm and the gate are
fp32, rounded once (Hugging Face rounds the normalised h, both products and their
product: up to three roundings of bf16 values more).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _checks
from jaxflash._triton import LOG2_E, exp2, load, pl, use_interpret
from jaxflash.linear import (MAX_ROWS, LinearConfig, SumXTiles, XTiles, add_chunks, fetch_chunks,
                             skinny_matmul_partials)

# Measured on the H200 at the 1.5B model's shapes (bench/NOTES.md).
UP_CONFIG = LinearConfig(block_n=64, block_k=64, num_warps=4, num_stages=4)
DOWN_CONFIG = LinearConfig(block_n=64, block_k=64, num_warps=4, num_stages=4)


@dataclasses.dataclass(frozen=True)
class SwiGLUXTiles(XTiles):
  """x = silu(r * gate) * (r * up), from the up kernel's outputs: gate and up partials
  [S, M, F] and the sums of h^2 [S, M], with r = rsqrt(sum / norm_size + eps) per row."""

  norm_size: int
  eps: float
  dtype: str  # what x is rounded to: the down weight's dtype

  def prologue(self, in_refs, row_ok):
    """r [16, 1]: the RMSNorm factor of each row, from the chunks' sums of squares."""
    sum_sq_ref = in_refs[2]
    splits = sum_sq_ref.shape[0]
    splits_p = max(2, pl.next_power_of_2(splits))
    sum_sq = load(sum_sq_ref.at[pl.ds(0, splits_p), pl.ds(0, MAX_ROWS)],
                  mask=(jnp.arange(splits_p) < splits)[:, None] & row_ok[None, :], other=0.0)
    return lax.rsqrt(jnp.sum(sum_sq, axis=0) / self.norm_size + self.eps)[:, None]

  def fetch(self, in_refs, k0, mask, *, block_k: int):
    gate_ref, up_ref, _ = in_refs
    columns = pl.ds(k0, block_k)
    return fetch_chunks(gate_ref, columns, mask), fetch_chunks(up_ref, columns, mask)

  def make(self, fetched, state, out_refs, k0, mask, first, *, block_k: int):
    gate, up = (add_chunks(parts) * state for parts in fetched)
    sigmoid = 1.0 / (1.0 + exp2(-gate * LOG2_E, approx=False))
    return (gate * sigmoid * up).astype(self.dtype)


def _check_inputs(x, norm_scale, w_gate, w_up, w_down, addend):
  for name, a in (("x", x), ("norm_scale", norm_scale), ("w_gate", w_gate), ("w_up", w_up),
                  ("w_down", w_down)):
    _checks.check_float(name, a)
  if x.ndim < 1 or x.shape[-1] == 0:
    raise ValueError(f"x must be [..., D] with D >= 1, got x {tuple(x.shape)}")
  d, rows = x.shape[-1], math.prod(x.shape[:-1])
  if rows > MAX_ROWS:
    raise ValueError(f"gated_mlp takes at most {MAX_ROWS} rows of x, got x {tuple(x.shape)} "
                     f"({rows} rows)")
  if tuple(norm_scale.shape) != (d,):
    raise ValueError(f"norm_scale must be [D] = ({d},), got norm_scale {tuple(norm_scale.shape)}")
  if w_gate.ndim != 2 or w_gate.shape[0] != d or not w_gate.shape[1] or w_up.shape != w_gate.shape:
    raise ValueError(f"w_gate and w_up must both be [D, F] = [{d}, F] with F >= 1, got w_gate "
                     f"{tuple(w_gate.shape)} and w_up {tuple(w_up.shape)}")
  if tuple(w_down.shape) != (w_gate.shape[1], d):
    raise ValueError(f"w_down must be [F, D] = {(w_gate.shape[1], d)}, got w_down {tuple(w_down.shape)}")
  if len({jnp.dtype(w.dtype) for w in (w_gate, w_up, w_down)}) > 1:
    raise TypeError(f"w_gate, w_up and w_down must share a dtype, got "
                    f"{[jnp.dtype(w.dtype).name for w in (w_gate, w_up, w_down)]}")
  _checks.check_addend(addend, x)


@functools.partial(jax.jit, static_argnames=("eps", "return_partials", "up_config", "down_config",
                                             "interpret"))
def gated_mlp(x, norm_scale, w_gate, w_up, w_down, *, eps: float = 1e-6, addend=None,
              return_partials: bool = False, up_config: LinearConfig | None = None,
              down_config: LinearConfig | None = None, interpret: bool | None = None):
  """h + down(silu(n @ w_gate) * (n @ w_up)), n = rms_norm(h) * norm_scale, for a decode
  step in two kernel launches; h = x, or x + addend.sum(0) when `addend` is given.

  x [..., D] with at most 16 rows in all; norm_scale [D] (the RMSNorm weight); w_gate,
  w_up [D, F] and w_down [F, D] of one dtype; addend [S, ..., D] (float, e.g. fp32 K-chunk
  partials of the product before: the attention output, the residual add folded in).
  Returns the layer's output in x's dtype, or with `return_partials` the pair (h, partials):
  h [..., D] in x's dtype and fp32 partials [S', ..., D] with output = h + partials.sum(0)
  (for a following `jaxflash.qkv_projection(..., addend=partials)`).

  up_config / down_config: the two products' tiles and K chunks (defaults tuned on the
  H200); interpret: Pallas interpret mode (default: when no GPU).
  """
  _check_inputs(x, norm_scale, w_gate, w_up, w_down, addend)
  up_config, down_config = up_config or UP_CONFIG, down_config or DOWN_CONFIG
  for name, config in (("up_config", up_config), ("down_config", down_config)):
    if not isinstance(config, LinearConfig):
      raise TypeError(f"{name} must be a jaxflash.LinearConfig, got {type(config).__name__}")
  interpret = use_interpret(interpret)
  lead, d = x.shape[:-1], x.shape[-1]
  rows = math.prod(lead)
  if rows == 0:
    empty = jnp.zeros(x.shape, x.dtype)
    return (empty, jnp.zeros((1, *x.shape), jnp.float32)) if return_partials else empty
  x2 = x.reshape(rows, d)
  if addend is None:
    x_inputs, x_tiles = (x2,), XTiles()
  else:
    x_inputs, x_tiles = (x2, addend.reshape(-1, rows, d).astype(jnp.float32)), SumXTiles()
  (gate, up), sum_sq, x_outs = skinny_matmul_partials(
      x_inputs, (w_gate, w_up), norm_scale, config=up_config, interpret=interpret, x_tiles=x_tiles,
      name="jaxflash_mlp_up")
  h = x_outs[0] if x_outs else x2
  swiglu = SwiGLUXTiles(norm_size=d, eps=float(eps), dtype=jnp.dtype(w_down.dtype).name)
  (parts,), _, _ = skinny_matmul_partials((gate, up, sum_sq), (w_down,), config=down_config,
                                          interpret=interpret, x_tiles=swiglu, name="jaxflash_mlp_down")
  if return_partials:
    return h.reshape(x.shape), parts.reshape(-1, *x.shape)
  return (h.astype(jnp.float32) + parts.sum(axis=0)).astype(x.dtype).reshape(x.shape)


def gated_mlp_reference(x, norm_scale, w_gate, w_up, w_down, *, eps: float = 1e-6, addend=None):
  """Plain JAX, fp32 throughout (HIGHEST-precision products), in x's dtype: for checking."""
  hp = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
  h = x.astype(jnp.float32)
  if addend is not None:
    h = (h + addend.astype(jnp.float32).sum(axis=0)).astype(x.dtype).astype(jnp.float32)
  n = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps) * norm_scale.astype(jnp.float32)
  a = jax.nn.silu(hp(n, w_gate.astype(jnp.float32))) * hp(n, w_up.astype(jnp.float32))
  return (h + hp(a, w_down.astype(jnp.float32))).astype(x.dtype)
