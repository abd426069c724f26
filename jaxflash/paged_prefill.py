"""Paged prefill attention: FlashAttention-2 over a KV cache read through a block table.

A chunk of T_b new query tokens per sequence (a prompt, or one chunk of it in chunked
prefill; T_b = 1 for a decoding sequence in the same batch) attends to every key already in
that sequence's pages plus its own, causally: the new tokens are the sequence's last T_b
positions (bottom-right alignment), so query t sits at key position kv_len_b - T_b + t.

The kernel is jaxflash/prefill.py's (one program per block of query rows of one head of
one sequence, online softmax in exp2, the causal mask as a loop bound: unmasked key blocks
first, then the few that straddle the diagonal, nothing past it; GQA by index) with the key
and value tiles addressed through the block table as the paged decode kernel addresses them
(jaxflash/paged.py; "Efficient Memory Management for Large Language Model Serving with
PagedAttention"): the pool [P, page, K, H] is viewed as rows [P * page, K, H] and token s
of sequence b sits at row block_table[b, s // page] * page + s % page. A tile of block_k
keys is part of one page (page >= block_k: one scalar table load, contiguous rows) or
spans whole pages (page < block_k: one vector table load, gathered rows).
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxflash import _checks, configs
from jaxflash._triton import (APPROX_EXP2, LN_2, LOG2_E, CompilerParams, block_size, dot, exp2,
                              load_masked, mask2d, pl, quiet, store, use_interpret)
from jaxflash._util import dot_precision
from jaxflash._types import Array, ArrayLike, AttentionResult, Lengths
from jaxflash.configs import PrefillConfig
from jaxflash.paged import _paged_tile
from jaxflash.prefill import resolve_config
from jaxflash.decode import load_scales
from jaxflash.quantize import check_scales, dequantize_kv, dequantize_tile
from jaxflash.reference import attention_reference, gather_pages
from jaxflash.sharding import result_struct

__all__ = ["paged_prefill_attention", "paged_prefill_reference"]


def _paged_prefill_kernel(
    q_lengths_ref,  # [B] int32: new (query) tokens per sequence
    kv_lengths_ref,  # [B] int32: keys per sequence, the new ones included
    table_ref,  # [B, max_pages] int32: logical page -> pool page
    q_ref,  # [B, T, N, H]
    k_ref,  # [num_pages * page_size, K, H]: the pool's rows
    v_ref,  # [num_pages * page_size, K, H]
    k_scale_ref,  # [num_pages * page_size, K] float32: a quantized pool's scales; None (float pool)
    v_scale_ref,  # same for v_ref
    o_ref,  # [B, T, N, H]
    lse_ref,  # [B, T, N] float32 natural-log log-sum-exp (None: not requested)
    *,
    tile_index,  # (table_ref, b, h, tok0, key_ok) -> index of one K/V tile [block_k, Hp]
    qk_scale: float,
    is_causal: bool,
    block_q: int,
    block_k: int,
    head_dim: int,
    group: int,
    seq_q: int,
    capacity: int,
    num_q_blocks: int,
    approx_exp2: bool,
):
  """One program: query head n, query block i (walked backwards), sequence b."""
  n, b = pl.program_id(0), pl.program_id(2)
  kv_head = lax.div(n, group)
  head_dim_padded = configs.padded_head_dim(head_dim)
  # Longest blocks first, as in jaxflash/prefill.py.
  q_start = (num_q_blocks - 1 - pl.program_id(1)) * block_q

  # Lengths are clamped, so whatever they hold the kernel reads neither past the query nor
  # past the table's capacity.
  q_valid = jnp.clip(q_lengths_ref[b], 0, seq_q)
  kv_valid = jnp.clip(kv_lengths_ref[b], 0, capacity)
  shift = kv_valid - q_valid  # query t sits at key position t + shift

  rows = q_start + jnp.arange(block_q)  # [block_q] query positions
  row_valid = rows < q_valid
  col_mask = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim
  q_index = (b, pl.ds(q_start, block_q), n, pl.ds(0, head_dim_padded))

  # A quantized pool is dequantized tile by tile into the query's dtype for the matmuls.
  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype) if k_scale_ref is None else q_ref.dtype
  dot_kwargs = dict(precision=dot_precision(compute_dtype))
  q = load_masked(q_ref.at[q_index], mask2d(row_valid, col_mask, (block_q, head_dim_padded)))
  q = q.astype(compute_dtype)

  # Loop bounds in key blocks, as in jaxflash/prefill.py: `kv_end` one past the last key a
  # valid row of this block may see, `full_end` the keys every row of it may see.
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
    kv_start = j * block_k
    keys = kv_start + jnp.arange(block_k)  # [block_k] key positions
    key_ok = keys < kv_valid if masked else None
    # Keys past the sequence's end load as zeros (their page entries are not even read),
    # so garbage in an unwritten slot never reaches the output as 0 * NaN.
    index = tile_index(table_ref, b, kv_head, kv_start, key_ok)
    kv_mask = mask2d(key_ok, col_mask, (block_k, head_dim_padded))
    k = load_masked(k_ref.at[index], kv_mask)
    if k_scale_ref is not None:  # dequantized right after the load, in float32
      k = dequantize_tile(k, load_scales(k_scale_ref, index, key_ok, block_k)[:, None], compute_dtype)
    s = dot(q, k.astype(compute_dtype), trans_b=True, **dot_kwargs) * qk_scale
    if masked:
      if is_causal:
        last_key = jnp.minimum(rows + shift, kv_valid - 1)  # [block_q]
        visible = keys[None, :] <= last_key[:, None]
      else:
        visible = jnp.broadcast_to(key_ok[None, :], (block_q, block_k))
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf: subtract 0 so exp2 never sees -inf - -inf.
    m_new_safe = jnp.where(m_new == -jnp.inf, 0., m_new) if masked else m_new
    alpha = exp2(m_i - m_new_safe, approx=approx_exp2)
    p = exp2(s - m_new_safe[:, None], approx=approx_exp2)  # [block_q, block_k]
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    v = load_masked(v_ref.at[index], kv_mask)
    if v_scale_ref is not None:
      v = dequantize_tile(v, load_scales(v_scale_ref, index, key_ok, block_k)[:, None], compute_dtype)
    v = v.astype(compute_dtype)
    acc = acc * alpha[:, None] + dot(p.astype(compute_dtype), v, **dot_kwargs)
    return acc, m_new, l_i

  carry = (jnp.zeros((block_q, head_dim_padded), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(0, num_unmasked, functools.partial(attend, masked=False), carry)
  acc, m_i, l_i = lax.fori_loop(num_unmasked, num_blocks, functools.partial(attend, masked=True),
                                carry)

  # Divide once (FlashAttention-2, section 3.1.1). Rows that saw no key, and padding rows
  # past q_len, give exact zeros and an LSE of -inf.
  attended = row_valid & (l_i != 0.)  # NaN (a row that saw a NaN) stays NaN, as in jax.nn
  l_safe = jnp.where(attended, l_i, 1.)
  out = jnp.where(attended[:, None], acc * (1. / l_safe)[:, None], 0.)
  in_bounds = rows < seq_q
  store(o_ref.at[q_index], out.astype(o_ref.dtype),
        mask=mask2d(in_bounds, col_mask, (block_q, head_dim_padded)))
  if lse_ref is not None:
    lse = jnp.where(attended, (m_i + jnp.log2(l_safe)) * LN_2, -jnp.inf)
    store(lse_ref.at[b, pl.ds(q_start, block_q), n], lse, mask=in_bounds)


def _without_lse(kernel):
  def kernel_without_lse(*refs):  # the refs up to o_ref; lse_ref None
    kernel(*refs, None)
  return kernel_without_lse


def paged_prefill_attention(query: Array, k_pages: Array, v_pages: Array, key_value_seq_lengths: ArrayLike,
                            block_table: ArrayLike, query_seq_lengths: Lengths = None, *,
                            scale: float | None = None, is_causal: bool = True,
                            return_residual: bool = False, config: PrefillConfig | None = None,
                            interpret: bool | None = None,
                            k_scale: Array | None = None, v_scale: Array | None = None) -> AttentionResult:
  """FlashAttention-2 forward pass for new tokens over a paged KV cache.

  query [B, T, N, H]: T_b = query_seq_lengths[b] new tokens of sequence b (default T; rows
  t >= T_b are padding: zeros out, LSE -inf); k_pages, v_pages [num_pages, page_size, K, H]
  (page_size a power of two from 8; N a multiple of K, query head n reads KV head
  n // (N // K)) holding every key of the sequence, the new tokens' included
  (`jaxflash.paged_kv_write` first); key_value_seq_lengths [B] int32 keys per sequence
  (clamped to [0, max_pages * page_size]); block_table [B, max_pages] int32, logical page j
  of sequence b -> pool page (only the first ceil(kv_len / page_size) entries are read;
  pages may be shared). `is_causal` (default True) aligns the diagonal bottom-right: query
  t sees keys s <= t + kv_len_b - T_b. Lengths and tables are data: they never recompile.

  Concrete lengths and table entries are checked (ValueError); traced ones (under jit)
  cannot be: lengths are then clamped and a table entry outside [0, num_pages) is clamped
  into it (`jaxflash.paged.block_table_is_valid` checks tables under jit). Returns out
  [B, T, N, H] in the query's dtype, and with `return_residual` also the natural-log LSE
  [B, T, N] float32. config: tiles, warps and stages (default
  `jaxflash.prefill_config(H, dtype)`); interpret as for `prefill_attention`.
  A quantized pool (int8 or float8_e4m3fn) comes with k_scale and v_scale
  [num_pages, page_size, K] float32, dequantized tile by tile after the load.
  """
  is_causal = _checks.check_bool("is_causal", is_causal)  # static in the jit: hashed first
  if len(np.shape(block_table)) == 2 and len(np.shape(k_pages)) == 4:  # read before the jit
    num_pages, page_size = np.shape(k_pages)[:2]
    _checks.check_length_values("key_value_seq_lengths", key_value_seq_lengths,
                                np.shape(block_table)[1] * page_size)
    _checks.check_table_values(block_table, key_value_seq_lengths, num_pages=num_pages, page_size=page_size)
    _checks.check_length_values("query_seq_lengths", query_seq_lengths, np.shape(query)[1])
  return _paged_prefill_attention(query, k_pages, v_pages, key_value_seq_lengths, block_table,
                                  query_seq_lengths, scale=scale, is_causal=is_causal,
                                  return_residual=return_residual, config=config, interpret=interpret,
                                  k_scale=k_scale, v_scale=v_scale)


@functools.partial(
    jax.jit, static_argnames=("scale", "is_causal", "return_residual", "config", "interpret"))
def _paged_prefill_attention(query, k_pages, v_pages, key_value_seq_lengths, block_table,
                             query_seq_lengths=None, *, scale=None, is_causal=True,
                             return_residual=False, config: PrefillConfig | None = None,
                             interpret: bool | None = None, k_scale=None, v_scale=None):
  quantized = check_scales(k_pages, v_pages, k_scale, v_scale, key_name="k_pages", value_name="v_pages")
  _checks.check_qkv(query, k_pages, v_pages, key_name="k_pages", value_name="v_pages", quantized=quantized)
  batch, seq_q, num_heads, head_dim = query.shape
  num_pages, page_size, kv_heads, _ = k_pages.shape
  _checks.check_page_size(page_size)
  block_table = _checks.check_block_table(block_table, batch)
  if key_value_seq_lengths is None:
    raise ValueError("paged_prefill_attention needs key_value_seq_lengths [B]: the keys per "
                     "sequence, the new tokens included")
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  is_causal = _checks.check_bool("is_causal", is_causal)
  if q_lengths is None:
    q_lengths = jnp.full((batch,), seq_q, jnp.int32)
  if num_pages == 0:
    raise ValueError(f"the pool needs at least one page, got k_pages {tuple(k_pages.shape)}")
  scale = _checks.default_scale(scale, head_dim)
  compute_dtype = query.dtype if quantized else jnp.promote_types(query.dtype, k_pages.dtype)
  config = resolve_config(config, head_dim, compute_dtype)

  capacity = block_table.shape[1] * page_size
  if 0 in (batch, seq_q, num_heads, head_dim) or capacity == 0:
    out = jnp.zeros(query.shape, query.dtype)
    lse = jnp.full(query.shape[:3], -jnp.inf, jnp.float32)
    return (out, lse) if return_residual else out

  block_q = block_size(config.block_q, seq_q)
  block_k = block_size(config.block_k, capacity)
  head_dim_padded = configs.padded_head_dim(head_dim)
  num_q_blocks = pl.cdiv(seq_q, block_q)
  num_warps = config.num_warps if block_q == config.block_q else min(config.num_warps, 4)

  kernel = functools.partial(
      _paged_prefill_kernel, tile_index=_paged_tile(block_k, page_size, num_pages, head_dim_padded),
      qk_scale=scale * LOG2_E, is_causal=is_causal, block_q=block_q, block_k=block_k,
      head_dim=head_dim, group=num_heads // kv_heads, seq_q=seq_q, capacity=capacity,
      num_q_blocks=num_q_blocks, approx_exp2=APPROX_EXP2 and not use_interpret(interpret))
  if not return_residual:
    kernel = _without_lse(kernel)

  # [P, page, K, H] -> [P * page, K, H]: a bitcast, the pool is read in place.
  k_rows = k_pages.reshape(num_pages * page_size, kv_heads, head_dim)
  v_rows = v_pages.reshape(num_pages * page_size, kv_heads, head_dim)
  k_scale, v_scale = (None if x is None else x.reshape(num_pages * page_size, kv_heads)
                      for x in (k_scale, v_scale))
  inputs = (q_lengths, kv_lengths, block_table, query, k_rows, v_rows, k_scale, v_scale)
  out_shape = [result_struct(query.shape, query.dtype, *inputs)]
  if return_residual:
    out_shape.append(result_struct((batch, seq_q, num_heads), jnp.float32, *inputs))
  # FLOPs of a full chunk over a full table: an upper bound (lengths are data).
  pairs = batch * num_heads * seq_q * capacity
  cost = pl.CostEstimate(flops=int(4 * pairs * head_dim), transcendentals=int(pairs),
                         bytes_accessed=int(2 * query.size * query.dtype.itemsize
                                            + 2 * batch * capacity * kv_heads * head_dim
                                            * k_pages.dtype.itemsize))
  with quiet():
    results = pl.pallas_call(
        kernel,
        # Head fastest, as in jaxflash/prefill.py: the programs resident together share KV heads.
        grid=(num_heads, num_q_blocks, batch),
        out_shape=out_shape,
        compiler_params=CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
        cost_estimate=cost,
        interpret=use_interpret(interpret),
        name="jaxflash_paged_prefill",
    )(*inputs)
  return tuple(results) if return_residual else results[0]


def paged_prefill_reference(query, k_pages, v_pages, key_value_seq_lengths, block_table,
                            query_seq_lengths=None, *, scale=None, is_causal=True,
                            return_residual=False, k_scale=None, v_scale=None):
  """Plain JAX: gather the pages into contiguous caches (dequantized with their scales if
  given), then attend (materialises [B, N, T, S])."""
  if k_scale is not None:
    k_pages = dequantize_kv(k_pages, k_scale, query.dtype)
    v_pages = dequantize_kv(v_pages, v_scale, query.dtype)
  batch, seq_q = query.shape[:2]
  capacity = block_table.shape[1] * k_pages.shape[1]
  kv_lengths = jnp.clip(jnp.asarray(key_value_seq_lengths, jnp.int32), 0, capacity)
  q_lengths = (jnp.full((batch,), seq_q, jnp.int32) if query_seq_lengths is None
               else jnp.clip(jnp.asarray(query_seq_lengths, jnp.int32), 0, seq_q))
  table = jnp.clip(jnp.asarray(block_table, jnp.int32), 0, k_pages.shape[0] - 1)
  out, lse = attention_reference(
      query, gather_pages(k_pages, table), gather_pages(v_pages, table),
      scale=_checks.default_scale(scale, query.shape[-1]), is_causal=is_causal,
      query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths)
  return (out, lse) if return_residual else out
