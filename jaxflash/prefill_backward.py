"""FlashAttention-2 backward pass: the kernels, their jitted wrapper, the custom VJP and the
plain reference.

The structure is Algorithm 2 of FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning (Dao, 2023), split into two kernels so that nothing is accumulated
across programs (no atomics, so results are the same run to run):

  * a pre-pass, delta_i = rowsum(dO_i * O_i) - dLSE_i (O(n d), left to XLA: it fuses with
    the transpose to [B, N, T] and with the LSE's conversion to base 2, and a kernel would
    add a launch to save nothing);
  * the dK/dV kernel: one program per (KV block, KV head, sequence). It keeps its K and V
    tiles and the dK and dV accumulators on chip and streams the query blocks past them,
    for *every query head of the KV head's GQA group*, so a KV head's gradient is summed
    inside the kernel (never a repeated-K/V gradient reduced afterwards);
  * the dQ kernel: one program per (query block, query head, sequence), streaming K and V
    like the forward.

Both recompute the scores in float32 from Q, K and the forward's log-sum-exp, with exp2 and
the forward's scaling (scores times scale * log2 e, so P = exp2(S2 - LSE * log2 e)):

    P = exp(scale Q K^T - LSE)       dV = P^T dO          dP = dO V^T
    dS = P * (dP - delta)            dQ = scale dS K      dK = scale dS^T Q

Causal attention is a loop bound in both, as in the forward (bottom-right alignment per
sequence: query t sees keys s <= t + kv_len - q_len): the dK/dV kernel starts at the first
query block that sees its keys, the dQ kernel stops at the last key block its rows see,
only the blocks that straddle the diagonal are masked, and blocks past it are never loaded.
Rows and sequences with nothing to attend (LSE -inf) get an LSE of +inf here, so their P is
exactly 0 and their gradients are zeros, never NaN.

Layout everywhere: query [B, T, N, H], key/value [B, S, K, H], N a multiple of K.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from jaxflash import _checks, configs
from jaxflash._triton import (LOG2_E, CompilerParams, dot, exp2, load_masked, mask2d, pl, quiet, store,
                              use_interpret)
from jaxflash.configs import BackwardConfig
from jaxflash.prefill import APPROX_EXP2, MIN_BLOCK, _block_size, prefill_forward
from jaxflash.reference import attention_reference


def _lengths(q_lengths_ref, kv_lengths_ref, seq_q: int, seq_kv: int):
  """(q_valid, kv_valid, shift): the sequence's rows and keys, and query t's key position
  offset (bottom-right alignment: t + shift, shift = kv_len - q_len), as the forward."""
  q_len = jnp.int32(seq_q) if q_lengths_ref is None else q_lengths_ref[...]
  kv_len = jnp.int32(seq_kv) if kv_lengths_ref is None else kv_lengths_ref[...]
  return jnp.clip(q_len, 0, seq_q), jnp.clip(kv_len, 0, seq_kv), kv_len - q_len


def _dkdv_kernel(
    q_lengths_ref,  # [] int32: this sequence's query count (None: all T rows are queries)
    kv_lengths_ref,  # [] int32: this sequence's key count (None: all S keys are valid)
    q_ref,  # [seq_q, group, head_dim_padded]: every query head of KV head k's group
    do_ref,  # [seq_q, group, head_dim_padded]: dO of those heads
    lse_ref,  # [group, seq_q] float32 base-2 LSE (+inf: rows with nothing to attend)
    delta_ref,  # [group, seq_q] float32 rowsum(dO * O) - dLSE
    k_ref,  # [block_k, head_dim_padded]: this program's keys of KV head k
    v_ref,  # [block_k, head_dim_padded]
    dk_ref,  # [block_k, head_dim_padded]
    dv_ref,  # [block_k, head_dim_padded]
    *,
    qk_scale: float,
    scale: float,
    is_causal: bool,
    block_q: int,
    block_k: int,
    head_dim: int,
    seq_q: int,
    seq_kv: int,
    group: int,
    approx_exp2: bool,
):
  head_dim_padded = q_ref.shape[-1]
  k_start = pl.program_id(0) * block_k
  q_valid, kv_valid, shift = _lengths(q_lengths_ref, kv_lengths_ref, seq_q, seq_kv)
  keys = k_start + jnp.arange(block_k)  # [block_k] key positions
  key_valid = keys < kv_valid
  col_mask = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim
  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  dot_kwargs = dict(allow_tf32=False) if compute_dtype == jnp.float32 else {}

  # Keys past the valid ones load as zeros; their dK/dV rows are computed like any other
  # (each key's gradient depends on its own column of P only) and stored as zeros.
  ragged_keys = kv_lengths_ref is not None or seq_kv % block_k != 0
  kv_mask = mask2d(key_valid if ragged_keys else None, col_mask, (block_k, head_dim_padded))
  k = load_masked(k_ref, kv_mask).astype(compute_dtype)
  v = load_masked(v_ref, kv_mask).astype(compute_dtype)

  # Loop bounds, in query blocks. Rows past q_valid have an LSE of +inf (P = 0), so only
  # the causal diagonal needs a mask; rows past T (and padded rows, whose Q and dO may
  # hold anything) load as zeros.
  ragged_rows = q_lengths_ref is not None or seq_q % block_q != 0
  num_q_blocks = jnp.where(k_start < kv_valid, lax.div(q_valid + (block_q - 1), block_q), 0)
  if is_causal:
    # Row t sees key s when s <= t + shift: the first row to see key k_start is
    # k_start - shift, and every row from k_start + block_k - 1 - shift on sees them all.
    first = jnp.minimum(lax.div(jnp.maximum(k_start - shift, 0), block_q), num_q_blocks)
    full = lax.div(jnp.maximum(k_start + block_k - 1 - shift, 0) + (block_q - 1), block_q)
    full = jnp.clip(full, first, num_q_blocks)
  else:
    first = full = jnp.int32(0)

  def step(index, carry, *, start, count, masked: bool):
    dk, dv = carry  # [block_k, head_dim_padded] float32 each
    # One flat loop over (query head of the group, query block): the group's heads all
    # add into this program's dK and dV: the sum over the heads that share K and V, which
    # FlashAttention-2 takes across its per-head gradients, is done here, inside the kernel.
    g = lax.div(index, count)
    q_start = pl.multiple_of((start + index - g * count) * block_q, block_q)
    rows = q_start + jnp.arange(block_q)  # [block_q] query positions
    row_mask = mask2d(rows < q_valid if ragged_rows else None, col_mask, (block_q, head_dim_padded))
    q = load_masked(q_ref.at[pl.ds(q_start, block_q), g, :], row_mask).astype(compute_dtype)
    do = load_masked(do_ref.at[pl.ds(q_start, block_q), g, :], row_mask).astype(compute_dtype)
    in_bounds = rows < seq_q if seq_q % block_q else None
    if in_bounds is None:
      lse = lse_ref[g, pl.ds(q_start, block_q)]
      delta = delta_ref[g, pl.ds(q_start, block_q)]
    else:
      lse = load_masked(lse_ref.at[g, pl.ds(q_start, block_q)], in_bounds)
      lse = jnp.where(in_bounds, lse, jnp.inf)
      delta = load_masked(delta_ref.at[g, pl.ds(q_start, block_q)], in_bounds)
    # Transposed scores S^T [block_k, block_q]: dV and dK then come out of plain products.
    s_t = dot(k, q, trans_b=True, **dot_kwargs) * qk_scale
    p_t = exp2(s_t - lse[None, :], approx=approx_exp2)
    if masked:
      p_t = jnp.where(keys[:, None] <= rows[None, :] + shift, p_t, 0.)
    dv = dv + dot(p_t.astype(compute_dtype), do, **dot_kwargs)
    dp_t = dot(v, do, trans_b=True, **dot_kwargs)  # [block_k, block_q]
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + dot(ds_t.astype(compute_dtype), q, **dot_kwargs)
    return dk, dv

  carry = (jnp.zeros((block_k, head_dim_padded), jnp.float32),
           jnp.zeros((block_k, head_dim_padded), jnp.float32))
  if is_causal:
    # The diagonal blocks first (masked), then the blocks every row of which sees every key.
    count = full - first
    carry = lax.fori_loop(0, group * count, functools.partial(
        step, start=first, count=count, masked=True), carry)
  count = num_q_blocks - full
  carry = lax.fori_loop(0, group * count, functools.partial(
      step, start=full, count=count, masked=False), carry)
  dk, dv = carry

  store_mask = mask2d(keys < seq_kv if seq_kv % block_k else None, col_mask,
                      (block_k, head_dim_padded))
  keep = key_valid[:, None]
  store(dk_ref, jnp.where(keep, dk * scale, 0.).astype(dk_ref.dtype), mask=store_mask)
  store(dv_ref, jnp.where(keep, dv, 0.).astype(dv_ref.dtype), mask=store_mask)


def _dq_kernel(
    q_lengths_ref,  # [] int32 (None: all T rows are queries)
    kv_lengths_ref,  # [] int32 (None: all S keys are valid)
    q_ref,  # [block_q, head_dim_padded]: rows of query head n of sequence b
    do_ref,  # [block_q, head_dim_padded]
    lse_ref,  # [block_q] float32 base-2 LSE (+inf: rows with nothing to attend)
    delta_ref,  # [block_q] float32
    k_ref,  # [seq_kv, head_dim_padded]: all keys of KV head n // group of sequence b
    v_ref,  # [seq_kv, head_dim_padded]
    dq_ref,  # [block_q, head_dim_padded]
    *,
    qk_scale: float,
    scale: float,
    is_causal: bool,
    block_q: int,
    block_k: int,
    head_dim: int,
    seq_q: int,
    seq_kv: int,
    num_q_blocks: int,
    approx_exp2: bool,
):
  head_dim_padded = q_ref.shape[-1]
  # Backwards, as the forward: under a causal mask the last query block has the most keys.
  q_start = (num_q_blocks - 1 - pl.program_id(1)) * block_q
  q_valid, kv_valid, shift = _lengths(q_lengths_ref, kv_lengths_ref, seq_q, seq_kv)
  rows = q_start + jnp.arange(block_q)
  row_valid = rows < q_valid
  col_mask = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim
  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  dot_kwargs = dict(allow_tf32=False) if compute_dtype == jnp.float32 else {}

  row_mask = mask2d(row_valid, col_mask, (block_q, head_dim_padded))
  q = load_masked(q_ref, row_mask).astype(compute_dtype)
  do = load_masked(do_ref, row_mask).astype(compute_dtype)
  in_bounds = rows < seq_q if seq_q % block_q else None
  lse = lse_ref[...] if in_bounds is None else load_masked(lse_ref, in_bounds)
  lse = jnp.where(row_valid, lse, jnp.inf)
  delta = delta_ref[...] if in_bounds is None else load_masked(delta_ref, in_bounds)

  # The forward's bounds, in key blocks: `kv_end` one past the last key a valid row sees,
  # `full_end` the keys every row sees (no mask below it).
  rows_end = jnp.minimum(q_start + block_q, q_valid)
  if is_causal:
    kv_end = jnp.minimum(kv_valid, rows_end + shift)
    full_end = jnp.minimum(kv_valid, q_start + shift + 1)
  else:
    kv_end = full_end = kv_valid
  kv_end = jnp.where(rows_end > q_start, jnp.maximum(kv_end, 0), 0)
  num_blocks = lax.div(kv_end + (block_k - 1), block_k)
  num_unmasked = jnp.minimum(lax.div(jnp.maximum(full_end, 0), block_k), num_blocks)

  def step(j, dq, *, masked: bool):
    kv_start = pl.multiple_of(j * block_k, block_k)
    keys = kv_start + jnp.arange(block_k)
    kv_mask = mask2d(keys < kv_valid if masked else None, col_mask, (block_k, head_dim_padded))
    k = load_masked(k_ref.at[pl.ds(kv_start, block_k), :], kv_mask).astype(compute_dtype)
    v = load_masked(v_ref.at[pl.ds(kv_start, block_k), :], kv_mask).astype(compute_dtype)
    s = dot(q, k, trans_b=True, **dot_kwargs) * qk_scale  # [block_q, block_k]
    p = exp2(s - lse[:, None], approx=approx_exp2)
    if masked:
      if is_causal:
        last_key = jnp.minimum(rows + shift, kv_valid - 1)
        visible = keys[None, :] <= last_key[:, None]
      else:
        visible = jnp.broadcast_to((keys < kv_valid)[None, :], (block_q, block_k))
      p = jnp.where(visible, p, 0.)
    dp = dot(do, v, trans_b=True, **dot_kwargs)  # [block_q, block_k]
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.astype(compute_dtype), k, **dot_kwargs)

  dq = jnp.zeros((block_q, head_dim_padded), jnp.float32)
  dq = lax.fori_loop(0, num_unmasked, functools.partial(step, masked=False), dq)
  if is_causal or kv_lengths_ref is not None or seq_kv % block_k:
    dq = lax.fori_loop(num_unmasked, num_blocks, functools.partial(step, masked=True), dq)
  dq = jnp.where(row_valid[:, None], dq * scale, 0.)
  store(dq_ref, dq.astype(dq_ref.dtype),
        mask=mask2d(in_bounds, col_mask, (block_q, head_dim_padded)))


def _check_config(config) -> None:
  if not isinstance(config, BackwardConfig):
    raise TypeError(f"backward_config must be a jaxflash.BackwardConfig, got {type(config).__name__}")
  for name in ("block_q", "block_k", "dq_block_q", "dq_block_k"):
    size = getattr(config, name)
    if size is not None and (size < MIN_BLOCK or size & (size - 1)):
      raise ValueError(f"backward_config.{name} must be a power of two >= {MIN_BLOCK}, got {config}")
  if config.num_warps < 1 or config.num_stages < 1:
    raise ValueError(f"backward_config needs num_warps >= 1 and num_stages >= 1, got {config}")


def _with_lengths(kernel, has_q_lengths: bool, has_kv_lengths: bool):
  """The kernel called with None for the length refs that are not passed."""
  def call(*refs):
    refs = list(refs)
    q_len_ref = refs.pop(0) if has_q_lengths else None
    kv_len_ref = refs.pop(0) if has_kv_lengths else None
    kernel(q_len_ref, kv_len_ref, *refs)
  return call


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "config", "interpret"))
def prefill_backward(query, key, value, out, lse, d_out, d_lse=None, query_seq_lengths=None,
                     key_value_seq_lengths=None, *, scale=None, is_causal=False,
                     config: BackwardConfig | None = None, interpret: bool | None = None):
  """Gradients of `prefill_attention` (FlashAttention-2, Algorithm 2).

  query [B, T, N, H]; key, value [B, S, K, H]; out [B, T, N, H] and lse [B, T, N] (natural
  log, float32) from the forward; d_out [B, T, N, H]; d_lse [B, T, N] or None (the LSE's
  cotangent: it adds -d_lse to delta); lengths int [B] or None. Returns (dq [B, T, N, H],
  dk [B, S, K, H], dv [B, S, K, H]) in the inputs' dtypes.

  config: tiles, warps and stages (default: `jaxflash.backward_config(H, dtype)`).
  """
  _checks.check_qkv(query, key, value)
  batch, seq_q, num_heads, head_dim = query.shape
  seq_kv, num_kv_heads = key.shape[1], key.shape[2]
  _checks.check_same_batch(query, key)
  for name, x, shape in (("out", out, query.shape), ("d_out", d_out, query.shape),
                         ("lse", lse, query.shape[:3]), ("d_lse", d_lse, query.shape[:3])):
    if x is not None and tuple(x.shape) != tuple(shape):
      raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  scale = _checks.default_scale(scale, head_dim)
  tile_dtype = jnp.promote_types(query.dtype, key.dtype)
  if config is None:
    config = configs.backward_config(head_dim, tile_dtype)
  else:
    _check_config(config)
    configs.check_fits(config, head_dim, tile_dtype)

  if 0 in (batch, seq_q, num_heads, head_dim) or seq_kv == 0:
    return jnp.zeros_like(query), jnp.zeros_like(key), jnp.zeros_like(value)

  # The pre-pass (XLA, fused): delta and the base-2 LSE, transposed to [B, N, T] so each
  # program's rows are contiguous. An LSE of -inf (nothing to attend) becomes +inf: P = 0.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  # The barrier keeps the row reduction apart from the transpose: fused, XLA reads d_out and
  # O in the transposed order (60 us at n = 4096 on the H200, the whole pass's time).
  delta = lax.optimization_barrier(delta).transpose(0, 2, 1)
  lse2 = lse.astype(jnp.float32).transpose(0, 2, 1)
  attended = jnp.isfinite(lse2)
  lse2 = jnp.where(attended, lse2 * LOG2_E, jnp.inf)
  delta = jnp.where(attended, delta, 0.)  # whatever d_out holds on rows that attend to nothing

  group = num_heads // num_kv_heads
  head_dim_padded = configs.padded_head_dim(head_dim)
  approx = APPROX_EXP2 and not use_interpret(interpret)
  common = dict(qk_scale=scale * LOG2_E, scale=scale, is_causal=is_causal, head_dim=head_dim,
                seq_q=seq_q, seq_kv=seq_kv, approx_exp2=approx)
  lengths = [x for x in (q_lengths, kv_lengths) if x is not None]
  length_specs = lambda index: [pl.BlockSpec((None,), index)] * len(lengths)  # noqa: E731
  params = CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  pairs = batch * num_heads * seq_q * seq_kv * (0.5 if is_causal else 1.)

  # dK/dV: block_k keys resident, block_q query rows streamed, grid (KV block, KV head,
  # sequence). Under a causal mask the first key blocks have the most rows to see: they
  # start first.
  block_k = _block_size(config.block_k, seq_kv)
  block_q = _block_size(config.block_q, seq_q)
  num_kv_blocks = pl.cdiv(seq_kv, block_k)
  group_spec = pl.BlockSpec((None, seq_q, group, head_dim_padded), lambda j, h, b: (b, 0, h, 0))
  row_spec = pl.BlockSpec((None, group, seq_q), lambda j, h, b: (b, h, 0))
  key_spec = pl.BlockSpec((None, block_k, None, head_dim_padded), lambda j, h, b: (b, j, h, 0))
  with quiet():
    dk, dv = pl.pallas_call(
        _with_lengths(functools.partial(_dkdv_kernel, block_q=block_q, block_k=block_k,
                                        group=group, **common),
                      q_lengths is not None, kv_lengths is not None),
        grid=(num_kv_blocks, num_kv_heads, batch),
        in_specs=[*length_specs(lambda j, h, b: (b,)), group_spec, group_spec, row_spec, row_spec,
                  key_spec, key_spec],
        out_specs=[key_spec, key_spec],
        out_shape=[jax.ShapeDtypeStruct(key.shape, key.dtype),
                   jax.ShapeDtypeStruct(value.shape, value.dtype)],
        compiler_params=params,
        cost_estimate=pl.CostEstimate(flops=int(8 * pairs * head_dim), transcendentals=int(pairs),
                                      bytes_accessed=int(2 * query.nbytes + 4 * key.nbytes)),
        interpret=use_interpret(interpret),
        name="jaxflash_prefill_dkdv",
    )(*lengths, query, d_out, lse2, delta, key, value)

  # dQ: config.dq_tiles (default: the dK/dV tiles swapped, block_k rows, block_q keys).
  dq_rows, dq_keys = config.dq_tiles
  dq_block_q = _block_size(dq_rows, seq_q)
  dq_block_k = _block_size(dq_keys, seq_kv)
  num_q_blocks = pl.cdiv(seq_q, dq_block_q)
  # A query tile shrunk for a short sequence has too few rows to share among 8 warps.
  dq_warps = config.num_warps if dq_block_q == dq_rows else min(config.num_warps, 4)

  def q_index(n, i, b):
    return b, num_q_blocks - 1 - i, n, 0

  def kv_index(n, i, b):
    del i
    return b, 0, lax.div(n, group), 0

  q_spec = pl.BlockSpec((None, dq_block_q, None, head_dim_padded), q_index)
  vec_spec = pl.BlockSpec((None, None, dq_block_q), lambda n, i, b: (b, n, num_q_blocks - 1 - i))
  kv_spec = pl.BlockSpec((None, seq_kv, None, head_dim_padded), kv_index)
  with quiet():
    dq = pl.pallas_call(
        _with_lengths(functools.partial(_dq_kernel, block_q=dq_block_q, block_k=dq_block_k,
                                        num_q_blocks=num_q_blocks, **common),
                      q_lengths is not None, kv_lengths is not None),
        grid=(num_heads, num_q_blocks, batch),
        in_specs=[*length_specs(lambda n, i, b: (b,)), q_spec, q_spec, vec_spec, vec_spec, kv_spec,
                  kv_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
        compiler_params=CompilerParams(num_warps=dq_warps, num_stages=config.num_stages),
        cost_estimate=pl.CostEstimate(flops=int(6 * pairs * head_dim), transcendentals=int(pairs),
                                      bytes_accessed=int(3 * query.nbytes + 2 * key.nbytes)),
        interpret=use_interpret(interpret),
        name="jaxflash_prefill_dq",
    )(*lengths, query, d_out, lse2, delta, key, value)
  return dq, dk, dv


def prefill_backward_reference(query, key, value, d_out, query_seq_lengths=None,
                               key_value_seq_lengths=None, *, scale=None, is_causal=False):
  """`prefill_backward`'s (dq, dk, dv) by differentiating the plain-JAX reference."""
  scale = _checks.default_scale(scale, query.shape[-1])

  def forward(q, k, v):
    return attention_reference(q, k, v, scale=scale, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths)[0]

  _, vjp = jax.vjp(forward, query, key, value)
  return vjp(d_out.astype(query.dtype))


# ----------------------------------------------------------------------------- the custom VJP

class ScoreMods(NamedTuple):
  """The forward's options that change the scores (mask, bias, window, soft-cap, sinks,
  alignment): every one the backward does not cover yet makes a gradient raise
  NotImplementedError naming it, never a silently zero gradient. DEFAULTS holds the values
  under which an option changes nothing. (An array option whose gradient the backward
  comes to cover becomes a primal argument of `differentiable`'s custom VJP.)"""

  options: tuple[tuple[str, object], ...] = ()  # (name, value) pairs, as passed

  DEFAULTS = {"causal_alignment": "bottom_right"}

  def unsupported(self) -> list[str]:
    return [name for name, value in self.options if value is not None
            and not (isinstance(value, str) and value == self.DEFAULTS.get(name))]


def _first_order(backward: Callable) -> Callable:
  """backward, with a clear error where JAX would differentiate it (second derivatives)."""
  wrapped = jax.custom_jvp(backward)

  def no_jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        "jaxflash attention: second derivatives (differentiating the backward pass, as in "
        "jax.hessian or grad of grad) are not implemented; differentiate once, or use "
        "implementation='xla'")

  wrapped.defjvp(no_jvp)
  return wrapped


def differentiable(forward: Callable, backward: Callable, query, key, value, q_lengths, kv_lengths,
                   *, return_residual: bool, score_mods: ScoreMods = ScoreMods(),
                   what: str = "jaxflash.prefill_attention"):
  """Attention through `forward`, differentiated through `backward` (a `jax.custom_vjp`).

  forward(q, k, v, q_lengths, kv_lengths, with_lse) -> out, or (out, lse) when with_lse;
  backward(q, k, v, q_lengths, kv_lengths, out, lse, d_out, d_lse) -> (dq, dk, dv).
  Not differentiated, only forward(..., return_residual) runs: the forward is exactly as
  fast as without the VJP. Differentiated, the residuals are q, k, v, out and the LSE
  (O(n) memory; the scores are recomputed), and the LSE's cotangent (return_residual=True)
  is supported: it enters delta as delta - dLSE. Forward-mode (jax.jvp) raises JAX's
  custom_vjp error; second derivatives raise NotImplementedError.
  """
  backward = _first_order(backward)
  # The forward as the VJP's forward rule runs it: differentiating that (a second
  # derivative) would differentiate the kernel itself.
  forward_for_vjp = _first_order(lambda q, k, v, q_len, kv_len: forward(q, k, v, q_len, kv_len, True))

  @jax.custom_vjp
  def attend(q, k, v, q_len, kv_len):
    return forward(q, k, v, q_len, kv_len, return_residual)

  def attend_fwd(q, k, v, q_len, kv_len):
    out, lse = forward_for_vjp(q, k, v, q_len, kv_len)
    return (out, lse) if return_residual else out, (q, k, v, q_len, kv_len, out, lse)

  def attend_bwd(residuals, cotangent):
    unsupported = score_mods.unsupported()
    if unsupported:
      raise NotImplementedError(
          f"{what}: the gradient with {', '.join(unsupported)} is not implemented yet "
          "(use implementation='xla' to differentiate through these options)")
    q, k, v, q_len, kv_len, out, lse = residuals
    d_out, d_lse = cotangent if return_residual else (cotangent, None)
    dq, dk, dv = backward(q, k, v, q_len, kv_len, out, lse, d_out, d_lse)
    return dq, dk, dv, None, None

  attend.defvjp(attend_fwd, attend_bwd)
  return attend(query, key, value, q_lengths, kv_lengths)


# Options of the forward that are Python values (jit-static); array options are traced.
STATIC_SCORE_MODS = ("local_window_size", "logits_soft_cap", "causal_alignment")


@functools.partial(jax.jit, static_argnames=(
    "scale", "is_causal", "return_residual", "config", "backward_config", "interpret",
    *STATIC_SCORE_MODS))
def prefill_attention(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
                      scale=None, is_causal=False, return_residual=False, config=None,
                      backward_config: BackwardConfig | None = None, interpret=None, **score_mods):
  """FlashAttention-2 (`jaxflash.prefill.prefill_forward`, whose docstring gives the shapes),
  differentiable: jax.grad, jax.vjp and jax.value_and_grad run `prefill_backward`.

  backward_config: the backward's tiles (default: `jaxflash.backward_config(H, dtype)`).
  Every other argument is the forward's; options the backward does not cover (score_mods)
  are passed to the forward and make a gradient raise NotImplementedError.
  """
  forward_options = dict(scale=scale, is_causal=is_causal, config=config, interpret=interpret,
                         **score_mods)

  def forward(q, k, v, q_len, kv_len, with_lse):
    return prefill_forward(q, k, v, q_len, kv_len, return_residual=with_lse, **forward_options)

  def backward(q, k, v, q_len, kv_len, out, lse, d_out, d_lse):
    return prefill_backward(q, k, v, out, lse, d_out, d_lse, q_len, kv_len, scale=scale,
                            is_causal=is_causal, config=backward_config, interpret=interpret)

  return differentiable(forward, backward, query, key, value, query_seq_lengths,
                        key_value_seq_lengths, return_residual=return_residual,
                        score_mods=ScoreMods(tuple(sorted(score_mods.items()))))
