"""The gradients of the array options (bias, sinks, scale) from a backward's dQ and dS, in
XLA: the same for every backward kernel that keeps the protocol of jaxflash/vjp.py.

The bias's is dS' summed over the bias's broadcast axes; a sink's is -sum_rows P_sink *
delta with P_sink = exp(sink - LSE) (the sink only moves the denominator); the scale's is
sum(dQ * Q) / scale (dQ = scale dS' K, so sum(dQ * Q) = scale * sum(dS' * QK^T)).
"""
from __future__ import annotations

import jax.numpy as jnp


def option_grads(query, dq, lse, delta_parts, *, bias, sinks, scale, ds):
  """The array options' gradients from the kernels' results, in XLA (module docstring):
  (d_bias in the bias's shape and dtype, d_sinks [N] float32, d_scale [] float32), None
  for an option not given. delta_parts: (out, d_out, d_lse or None) to rebuild delta."""
  d_bias = d_sinks = None
  if bias is not None:
    axes = tuple(i for i, size in enumerate(bias.shape) if size == 1)
    d_bias = jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype)
  if sinks is not None:
    out, d_out, d_lse = delta_parts
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
    if d_lse is not None:
      delta = delta - d_lse.astype(jnp.float32)
    finite = lse != -jnp.inf  # padded rows (-inf) have no sink term; NaN stays NaN
    p_sink = jnp.where(finite, jnp.exp(sinks[None, None, :] - jnp.where(finite, lse, 0.)), 0.)
    d_sinks = -jnp.sum(p_sink * delta, axis=(0, 1))
  scale = jnp.asarray(scale, jnp.float32)
  d_scale = jnp.sum(dq.astype(jnp.float32) * query.astype(jnp.float32))
  # dQ = scale * dS' K: a scale of exactly 0 leaves no trace of dS' in dQ (documented).
  d_scale = jnp.where(scale != 0, d_scale / jnp.where(scale != 0, scale, 1.), 0.)
  return d_bias, d_sinks, d_scale
