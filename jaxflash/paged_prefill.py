"""Paged prefill attention: FlashAttention-2 over a KV cache read through a block table.

A chunk of T_b new query tokens per sequence (a prompt, or one chunk of it in chunked
prefill; T_b = 1 for a decoding sequence in the same batch) attends to every key already in
that sequence's pages plus its own, causally: the new tokens are the sequence's last T_b
positions (bottom-right alignment), so query t sits at key position kv_len_b - T_b + t.

The kernel is jaxflash/prefill.py's, with every option it has (sliding window, soft-cap,
bias, mask, sinks, a traced scale), reading its key and value tiles through the block table
as the paged decode kernel does (jaxflash/paged.py; "Efficient Memory Management for Large
Language Model Serving with PagedAttention"): the pool [P, page, K, H] is viewed as rows
[P * page, K, H] and token s of sequence b sits at row
block_table[b, s // page] * page + s % page. A tile of block_k keys is part of one page
(page >= block_k: one scalar table load, contiguous rows) or spans whole pages
(page < block_k: one vector table load, gathered rows). The pool is never copied.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _checks
from jaxflash._types import Array, ArrayLike, AttentionResult, Lengths, Scale, Window
from jaxflash.configs import PrefillConfig
from jaxflash.prefill import prefill_forward, resolve_config, score_operands
from jaxflash.quantize import check_scales, dequantize_kv
from jaxflash.reference import attention_reference, gather_pages
from jaxflash.score_mods import ScoreMods, window_size

__all__ = ["paged_prefill_attention", "paged_prefill_reference"]


def paged_prefill_attention(query: Array, k_pages: Array, v_pages: Array, key_value_seq_lengths: ArrayLike,
                            block_table: ArrayLike, query_seq_lengths: Lengths = None, *,
                            bias: Array | None = None, mask: Array | None = None, scale: Scale = None,
                            is_causal: bool = True, local_window_size: Window = None,
                            logits_soft_cap: float | None = None, sinks: Array | None = None,
                            causal_alignment: str = "bottom_right", return_residual: bool = False,
                            config: PrefillConfig | None = None, interpret: bool | None = None,
                            k_scale: Array | None = None, v_scale: Array | None = None) -> AttentionResult:
  """FlashAttention-2 forward pass for new tokens over a paged KV cache.

  query [B, T, N, H]: T_b = query_seq_lengths[b] new tokens of sequence b (default T; rows
  t >= T_b are padding: zeros out, LSE -inf); k_pages, v_pages [num_pages, page_size, K, H]
  (page_size a power of two from 8; N a multiple of K, query head n reads KV head
  n // (N // K)) holding every key of the sequence, the new tokens' included
  (`jaxflash.paged_kv_write` first); key_value_seq_lengths [B] int32 keys per sequence
  (clamped to [0, S], S = max_pages * page_size); block_table [B, max_pages] int32, logical
  page j of sequence b -> pool page (only the entries of pages holding a key some query sees
  are read; pages may be shared). Query t sits at key position p = t + kv_len_b - T_b
  (`causal_alignment="bottom_right"`, the default) or p = t ("top_left"); `is_causal`
  (default True) keeps keys s <= p. Lengths and tables are data: they never recompile.

  Options as `jaxflash.prefill_attention`'s, with S = max_pages * page_size and key positions
  logical (position s of sequence b, wherever its page lives): bias (float) and mask (bool,
  True = attend) broadcastable to [B, N, T, S]; scale a float or a traced scalar (default
  H ** -0.5); local_window_size w or (left, right) (keys p - left <= s <= p + right, the
  pages outside never read); logits_soft_cap; sinks [N]. Not differentiable.

  Concrete lengths and table entries are checked (ValueError); traced ones (under jit)
  cannot be: lengths are then clamped and a table entry outside [0, num_pages) is clamped
  into it (`jaxflash.paged.block_table_is_valid` checks tables under jit). Returns out
  [B, T, N, H] in the query's dtype, and with `return_residual` also the natural-log LSE
  [B, T, N] float32 (sink included). config: tiles, warps and stages (default
  `jaxflash.prefill_config(H, dtype)`); interpret as for `prefill_attention`.
  A quantized pool (int8 or float8_e4m3fn) comes with k_scale and v_scale
  [num_pages, page_size, K] float32, dequantized tile by tile after the load.
  """
  # Static in the jit: checked (and hashed) first.
  mods = ScoreMods.from_options(is_causal=is_causal, causal_alignment=causal_alignment,
                                local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
  if len(np.shape(block_table)) == 2 and len(np.shape(k_pages)) == 4:  # read before the jit
    num_pages, page_size = np.shape(k_pages)[:2]
    _checks.check_length_values("key_value_seq_lengths", key_value_seq_lengths,
                                np.shape(block_table)[1] * page_size)
    _checks.check_table_values(block_table, key_value_seq_lengths, num_pages=num_pages, page_size=page_size)
    _checks.check_length_values("query_seq_lengths", query_seq_lengths, np.shape(query)[1])
  return _paged_prefill_attention(query, k_pages, v_pages, key_value_seq_lengths, block_table,
                                  query_seq_lengths, bias, mask, scale, sinks, k_scale, v_scale, mods=mods,
                                  return_residual=return_residual, config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("mods", "return_residual", "config", "interpret"))
def _paged_prefill_attention(query, k_pages, v_pages, key_value_seq_lengths, block_table, query_seq_lengths,
                             bias, mask, scale, sinks, k_scale, v_scale, *, mods: ScoreMods,
                             return_residual: bool, config: PrefillConfig | None, interpret: bool | None):
  quantized = check_scales(k_pages, v_pages, k_scale, v_scale, key_name="k_pages", value_name="v_pages")
  _checks.check_qkv(query, k_pages, v_pages, key_name="k_pages", value_name="v_pages", quantized=quantized)
  block_table, capacity = _checks.check_pages(k_pages, block_table, key_value_seq_lengths, query.shape[0],
                                              caller="paged_prefill_attention")
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, query.shape[0])
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, query.shape[0])
  options = score_operands(query, capacity, bias=bias, mask=mask, sinks=sinks, scale=scale)
  compute_dtype = query.dtype if quantized else jnp.promote_types(query.dtype, k_pages.dtype)
  return prefill_forward(query, k_pages, v_pages, q_lengths, kv_lengths, **options, block_table=block_table,
                         k_scale=k_scale, v_scale=v_scale, mods=mods, return_residual=return_residual,
                         config=resolve_config(config, query.shape[-1], compute_dtype), interpret=interpret)


def paged_prefill_reference(query, k_pages, v_pages, key_value_seq_lengths, block_table,
                            query_seq_lengths=None, *, bias=None, mask=None, scale=None, is_causal=True,
                            local_window_size=None, logits_soft_cap=None, sinks=None,
                            causal_alignment="bottom_right", return_residual=False, k_scale=None,
                            v_scale=None):
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
      query, gather_pages(k_pages, table), gather_pages(v_pages, table), bias, mask,
      scale=_checks.default_scale(scale, query.shape[-1]), is_causal=is_causal,
      query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
      local_window_size=window_size(local_window_size), logits_soft_cap=logits_soft_cap, sinks=sinks,
      causal_alignment=causal_alignment)
  return (out, lse) if return_residual else out
