"""FlashAttention-2 prefill: the kernel, its jitted wrapper and the plain reference.

One program owns one block of query rows of one head of one sequence (FlashAttention-2,
section 3.2: parallelism over query blocks). It loads its Q tile once, streams K and V
tiles past it and keeps the online softmax's running max, sum and output in float32
registers; the output is divided by the running sum once, after the loop (section 3.1.1).

Causal attention is a loop bound, not a mask (the article, "The causal mask as a loop
bound"): the key blocks every row of the query block may see run first with masking
compiled out, then the few blocks that straddle the diagonal (or the end of the keys)
run with masking on, and the blocks past the diagonal are never loaded. The bounds are
computed inside the kernel from the per-sequence lengths, so lengths are data: changing
them never recompiles.

Layout everywhere: query [B, T, N, H], key/value [B, S, K, H], N a multiple of K. Query
head n reads KV head n // (N // K) by index; K and V are never repeated.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from jaxflash import _checks, configs
from jaxflash._triton import (LN_2, LOG2_E, CompilerParams, dot, exp2, load_masked, mask2d, pl, quiet,
                              store, use_interpret)
from jaxflash.configs import PrefillConfig
from jaxflash.reference import attention_reference

MIN_BLOCK = 16  # tl.dot needs tiles of at least 16 x 16
APPROX_EXP2 = True  # compiled kernels use ex2.approx (see jaxflash._triton.exp2)


def _prefill_kernel(
    q_lengths_ref,  # [] int32: this sequence's query count (None: all T rows are queries)
    kv_lengths_ref,  # [] int32: this sequence's key count (None: all S keys are valid)
    q_ref,  # [block_q, head_dim_padded]: rows of query head n of sequence b
    k_ref,  # [seq_kv, head_dim_padded]: all keys of KV head n // group of sequence b
    v_ref,  # [seq_kv, head_dim_padded]
    o_ref,  # [block_q, head_dim_padded]
    lse_ref,  # [block_q] float32 natural-log log-sum-exp (None: not requested)
    *,
    qk_scale: float,
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
  # The grid walks query blocks backwards: with a causal mask the last block has the
  # most keys to visit, so the longest programs start first and the short ones fill
  # the gaps at the end (the article: +2-4%).
  q_start = (num_q_blocks - 1 - pl.program_id(1)) * block_q

  # Per-sequence lengths. Query t of this sequence sits at key position t + shift
  # (bottom-right causal alignment, as FlashAttention), shift = kv_len - q_len.
  q_len = jnp.int32(seq_q) if q_lengths_ref is None else q_lengths_ref[...]
  kv_len = jnp.int32(seq_kv) if kv_lengths_ref is None else kv_lengths_ref[...]
  shift = kv_len - q_len
  q_valid = jnp.clip(q_len, 0, seq_q)
  kv_valid = jnp.clip(kv_len, 0, seq_kv)

  rows = q_start + jnp.arange(block_q)  # [block_q] query positions
  row_valid = rows < q_valid
  # Head dims 80 and 96 run on a 128-wide tile; the padding columns load as zeros so
  # they add nothing to q.k, and they are never stored.
  col_mask = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim

  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  # float32 inputs get IEEE dots (not TF32) so they stay exact to ~1e-6.
  dot_kwargs = dict(allow_tf32=False) if compute_dtype == jnp.float32 else {}
  q = load_masked(q_ref, mask2d(row_valid, col_mask, (block_q, head_dim_padded)))
  q = q.astype(compute_dtype)

  # Loop bounds, in key blocks. `kv_end`: one past the last key any valid row of this
  # block may see. `full_end`: keys that *every* row of the block may see (the first
  # row has the fewest under the causal mask); blocks below it need no mask at all.
  rows_end = jnp.minimum(q_start + block_q, q_valid)
  if is_causal:
    kv_end = jnp.minimum(kv_valid, rows_end + shift)
    full_end = jnp.minimum(kv_valid, q_start + shift + 1)
  else:
    kv_end = kv_valid
    full_end = kv_valid
  kv_end = jnp.where(rows_end > q_start, jnp.maximum(kv_end, 0), 0)  # no valid row: no work
  num_blocks = lax.div(kv_end + (block_k - 1), block_k)
  num_unmasked = jnp.minimum(lax.div(jnp.maximum(full_end, 0), block_k), num_blocks)

  def attend(j, carry, *, masked: bool):
    acc, m_i, l_i = carry  # [block_q, head_dim_padded], [block_q], [block_q] float32
    kv_start = pl.multiple_of(j * block_k, block_k)
    keys = kv_start + jnp.arange(block_k)  # [block_k] key positions
    # Masked blocks may reach past the valid keys (a cache's unwritten tail, or past S):
    # those rows load as zeros, so garbage there can never reach the output as 0 * NaN.
    kv_mask = mask2d(keys < kv_valid if masked else None, col_mask, (block_k, head_dim_padded))
    k = load_masked(k_ref.at[pl.ds(kv_start, block_k), :], kv_mask)
    # Scores in float32, scaled by log2(e) * scale so the exponentials are exp2 (the
    # article; scaling the float32 scores, not a bf16 Q, keeps the error down).
    s = dot(q, k.astype(compute_dtype), trans_b=True, **dot_kwargs) * qk_scale
    if masked:
      if is_causal:
        # One compare per score: key <= min(row + shift, kv_valid - 1).
        last_key = jnp.minimum(rows + shift, kv_valid - 1)  # [block_q]
        visible = keys[None, :] <= last_key[:, None]
      else:
        visible = jnp.broadcast_to((keys < kv_valid)[None, :], (block_q, block_k))
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # running max
    if masked:
      # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 never
      # sees -inf - -inf (NaN). Its p and alpha come out as exact zeros.
      m_new_safe = jnp.where(m_new == -jnp.inf, 0., m_new)
    else:
      m_new_safe = m_new  # every score here is finite, so the max is too
    alpha = exp2(m_i - m_new_safe, approx=approx_exp2)  # rescales the old state to the new max
    p = exp2(s - m_new_safe[:, None], approx=approx_exp2)  # [block_q, block_k]
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    v = load_masked(v_ref.at[pl.ds(kv_start, block_k), :], kv_mask)
    v = v.astype(compute_dtype)
    acc = acc * alpha[:, None] + dot(p.astype(compute_dtype), v, **dot_kwargs)
    return acc, m_new, l_i

  carry = (jnp.zeros((block_q, head_dim_padded), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(0, num_unmasked, functools.partial(attend, masked=False), carry)
  if is_causal or kv_lengths_ref is not None or seq_kv % block_k:
    # Otherwise every key block is full and unmasked: the masked loop is not even compiled.
    carry = lax.fori_loop(num_unmasked, num_blocks, functools.partial(attend, masked=True), carry)
  acc, m_i, l_i = carry

  # FlashAttention-2 divides once, here. Rows that saw no key (zero keys, or padding
  # rows past q_len) give exact zeros and an LSE of -inf.
  attended = row_valid & (l_i > 0.)
  l_safe = jnp.where(attended, l_i, 1.)
  out = jnp.where(attended[:, None], acc * (1. / l_safe)[:, None], 0.)
  in_bounds = None if seq_q % block_q == 0 else rows < seq_q
  store(o_ref, out.astype(o_ref.dtype),
        mask=mask2d(in_bounds, col_mask, (block_q, head_dim_padded)))
  if lse_ref is not None:
    # m and log2(l) are in base 2 (scores were scaled by log2 e): ln 2 converts back.
    lse = jnp.where(attended, (m_i + jnp.log2(l_safe)) * LN_2, -jnp.inf)
    store(lse_ref, lse, mask=in_bounds)


def _check_config(config) -> None:
  if not isinstance(config, PrefillConfig):
    raise TypeError(f"config must be a jaxflash.PrefillConfig, got {type(config).__name__}")
  for name in ("block_q", "block_k"):
    size = getattr(config, name)
    if size < MIN_BLOCK or size & (size - 1):
      raise ValueError(f"config.{name} must be a power of two >= {MIN_BLOCK}, got {config}")
  if config.num_warps < 1 or config.num_stages < 1:
    raise ValueError(f"config needs num_warps >= 1 and num_stages >= 1, got {config}")


def _block_size(limit: int, length: int) -> int:
  """`limit`, or less for short sequences: a power of two >= 16 covering `length`."""
  return min(limit, max(MIN_BLOCK, 1 << (max(length, 1) - 1).bit_length()))


@functools.partial(
    jax.jit, static_argnames=("scale", "is_causal", "return_residual", "config", "interpret"))
def prefill_forward(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
                    scale=None, is_causal=False, return_residual=False,
                    config: PrefillConfig | None = None, interpret: bool | None = None):
  """FlashAttention-2 forward pass (`prefill_attention` is this, differentiable).

  query [B, T, N, H]; key, value [B, S, K, H] with N a multiple of K (query head n reads
  KV head n // (N // K)); query_seq_lengths, key_value_seq_lengths: optional int [B].
  Rows t >= query_seq_lengths[b] are padding (zeros out, LSE -inf), keys
  s >= key_value_seq_lengths[b] are ignored; `is_causal` aligns the diagonal bottom-right
  (query t sees keys s <= t + kv_len_b - q_len_b). Returns out [B, T, N, H] in the query's
  dtype, and with `return_residual` also the natural-log LSE [B, T, N] float32.

  config: tiles, warps and stages (default: `jaxflash.prefill_config(H, dtype)`).
  interpret: run the kernel in Pallas interpret mode (default: when there is no GPU).
  """
  _checks.check_qkv(query, key, value)
  batch, seq_q, num_heads, head_dim = query.shape
  seq_kv, num_kv_heads = key.shape[1], key.shape[2]
  _checks.check_same_batch(query, key)
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  scale = _checks.default_scale(scale, head_dim)
  tile_dtype = jnp.promote_types(query.dtype, key.dtype)
  if config is None:
    config = configs.prefill_config(head_dim, tile_dtype)
  else:
    _check_config(config)
    configs.check_fits(config, head_dim, tile_dtype)

  if 0 in (batch, seq_q, num_heads, head_dim) or seq_kv == 0:
    # Nothing to launch: every row has zero keys (or there are no rows).
    out = jnp.zeros(query.shape, query.dtype)
    lse = jnp.full(query.shape[:3], -jnp.inf, jnp.float32)
    return (out, lse) if return_residual else out

  block_q = _block_size(config.block_q, seq_q)
  block_k = _block_size(config.block_k, seq_kv)
  head_dim_padded = configs.padded_head_dim(head_dim)
  num_q_blocks = pl.cdiv(seq_q, block_q)
  # A query tile shrunk for a short sequence has too few rows to share among 8 warps.
  num_warps = config.num_warps if block_q == config.block_q else min(config.num_warps, 4)
  group = num_heads // num_kv_heads

  kernel = functools.partial(
      _prefill_kernel, qk_scale=scale * LOG2_E, is_causal=is_causal, block_q=block_q,
      block_k=block_k, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv, num_q_blocks=num_q_blocks,
      approx_exp2=APPROX_EXP2 and not use_interpret(interpret))

  def kernel_with_optional_refs(*refs):
    refs = list(refs)
    q_len_ref = refs.pop(0) if q_lengths is not None else None
    kv_len_ref = refs.pop(0) if kv_lengths is not None else None
    q_ref, k_ref, v_ref, o_ref, *lse_ref = refs
    kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref[0] if lse_ref else None)

  # Grid (head, query block, sequence): the head varies fastest, so the programs resident
  # together share KV heads (GQA tiles hit in L2), and all heads' longest blocks go first.
  grid = (num_heads, num_q_blocks, batch)

  def q_block_index(n, i, b):
    return b, num_q_blocks - 1 - i, n, 0

  def kv_index(n, i, b):
    del i
    return b, 0, lax.div(n, group), 0

  length_spec = pl.BlockSpec((None,), lambda n, i, b: (b,))
  in_specs = [length_spec] * ((q_lengths is not None) + (kv_lengths is not None)) + [
      pl.BlockSpec((None, block_q, None, head_dim_padded), q_block_index),
      pl.BlockSpec((None, seq_kv, None, head_dim_padded), kv_index),
      pl.BlockSpec((None, seq_kv, None, head_dim_padded), kv_index),
  ]
  out_shape = [jax.ShapeDtypeStruct(query.shape, query.dtype)]
  out_specs = [pl.BlockSpec((None, block_q, None, head_dim_padded), q_block_index)]
  if return_residual:
    out_shape.append(jax.ShapeDtypeStruct((batch, seq_q, num_heads), jnp.float32))
    out_specs.append(pl.BlockSpec((None, block_q, None), lambda n, i, b: (b, num_q_blocks - 1 - i, n)))

  pairs = batch * num_heads * seq_q * seq_kv * (0.5 if is_causal else 1.)
  cost = pl.CostEstimate(
      flops=int(4 * pairs * head_dim), transcendentals=int(pairs),
      bytes_accessed=int(2 * query.size * query.dtype.itemsize
                         + 2 * key.size * key.dtype.itemsize))
  lengths = [x for x in (q_lengths, kv_lengths) if x is not None]
  with quiet():
    results = pl.pallas_call(
        kernel_with_optional_refs,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
        cost_estimate=cost,
        interpret=use_interpret(interpret),
        name="jaxflash_prefill",
    )(*lengths, query, key, value)
  return tuple(results) if return_residual else results[0]


def prefill_reference(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
                      scale=None, is_causal=False, return_residual=False):
  """Plain-JAX attention with `prefill_attention`'s semantics (materialises [B, N, T, S])."""
  out, lse = attention_reference(
      query, key, value, scale=_checks.default_scale(scale, query.shape[-1]), is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
  return (out, lse) if return_residual else out


# The public entry point: the forward above with its FlashAttention-2 backward pass, a
# jax.custom_vjp (jaxflash/prefill_backward.py, which imports this module's helpers).
from jaxflash.prefill_backward import prefill_attention  # noqa: E402
