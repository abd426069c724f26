"""FlashAttention-2 prefill: the kernel, its jitted wrapper and the plain reference.

One program owns one block of query rows of one head of one sequence (FlashAttention-2,
section 3.2: parallelism over query blocks). It loads its Q tile once, streams K and V
tiles past it and keeps the online softmax's running max, sum and output in float32
registers; the output is divided by the running sum once, after the loop (section 3.1.1).

Causal attention and sliding windows are loop bounds, not masks (Writing an Attention
Kernel: FlashAttention and Decode in Triton, "The causal mask as a loop bound"): each
program computes, from the per-sequence lengths, the band of key blocks its rows may see;
the blocks every row sees whole run with masking compiled out, the few that straddle the
diagonal, a window edge or the end of the keys run masked, and the rest are never loaded,
so a window w costs O(n w), not O(n^2). Lengths are data: changing them never recompiles.

Options (jaxflash/score_mods.py, written once for the forward and backward kernels): bias
and mask tiles are read beside each K tile from operands that keep their broadcast axes
(stride 0), a logit soft-cap and per-head sink logits change the scores and the softmax's
start, and the scale is an operand, so a new value never recompiles.

Layout everywhere: query [B, T, N, H], key/value [B, S, K, H], N a multiple of K. Query
head n reads KV head n // (N // K) by index; K and V are never repeated.

K and V tiles are found by a tile addresser, the one thing that differs between caches: a
contiguous cache's tile is a slice of its rows; a page pool's (jaxflash/paged_prefill.py)
is looked up in the sequence's block table ("Efficient Memory Management for Large Language
Model Serving with PagedAttention"). A one-byte cache (int8, float8_e4m3fn) is dequantized
tile by tile after the load. Every option above works over either.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from jaxflash import _checks, configs, score_mods, segments, vjp
from jaxflash._triton import (APPROX_EXP2, LN_2, LOG2_E, CompilerParams, block_size, dot, exp2, load_masked,
                              load_tile, mask2d, operand_spec, pl, quiet, store, use_interpret)
from jaxflash._util import dot_precision
from jaxflash.configs import PrefillConfig
from jaxflash.decode import load_scales
from jaxflash.paged import paged_head_tile
from jaxflash.quantize import dequantize_kv, dequantize_tile
from jaxflash.reference import attention_reference, gather_pages
from jaxflash.score_mods import ScoreMods, key_blocks, window_size
from jaxflash.sharding import manual_axes, result_struct

def _prefill_kernel(
    q_lengths_ref,  # [] int32: this sequence's query count (None: all T rows are queries)
    kv_lengths_ref,  # [] int32: this sequence's key count (None: all S keys are valid)
    scale_ref,  # [] float32: the factor of q.k (score_mods.score_scale)
    sinks_ref,  # [] float32: this query head's sink logit, natural units (None: no sink)
    bias_ref,  # [block_q, seq_kv] of bias[b, n] or, along broadcast axes, less (None: no bias)
    mask_ref,  # the same for the mask, int8, nonzero = attend (None: no mask)
    q_segment_ref,  # [block_q] int32: these rows' document ids (None: no segments)
    kv_segment_ref,  # [seq_kv] int32: every key's document id
    span_ref,  # [2] int32: the key blocks whose ids may meet these rows' (segments.block_spans)
    q_ref,  # [block_q, head_dim_padded]: rows of query head n of sequence b
    table_ref,  # [max_pages] int32: sequence b's block table row (None: a contiguous cache)
    k_ref,  # [kv_rows, head_dim_padded]: KV head n // group's rows: sequence b's S keys, or the pool's
    v_ref,  # [kv_rows, head_dim_padded]
    k_scale_ref,  # [kv_rows] float32: a one-byte cache's per-token scales (None: a float cache)
    v_scale_ref,  # [kv_rows] float32
    o_ref,  # [block_q, head_dim_padded]
    lse_ref,  # [block_q] float32 natural-log log-sum-exp (None: not requested)
    *,
    tile_index,  # (table_ref, kv_start, key_ok) -> the index of a [block_k, Hp] tile of k_ref / v_ref
    mods: ScoreMods,
    bias_layout: tuple[bool, bool],
    mask_layout: tuple[bool, bool],
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
  # the gaps at the end (Writing an Attention Kernel: FlashAttention and Decode in
  # Triton: +2-4%).
  q_start = (num_q_blocks - 1 - pl.program_id(1)) * block_q

  # Per-sequence lengths. Query t sits at key position t + shift (score_mods).
  q_len = jnp.int32(seq_q) if q_lengths_ref is None else q_lengths_ref[...]
  kv_len = jnp.int32(seq_kv) if kv_lengths_ref is None else kv_lengths_ref[...]
  shift = mods.shift(q_len, kv_len)
  q_valid = jnp.clip(q_len, 0, seq_q)
  kv_valid = jnp.clip(kv_len, 0, seq_kv)
  qk_scale = scale_ref[...]

  rows = q_start + jnp.arange(block_q)  # [block_q] query positions
  row_valid = rows < q_valid
  in_rows = None if seq_q % block_q == 0 else rows < seq_q  # bias/mask rows to load
  # Head dims 80 and 96 run on a 128-wide tile; the padding columns load as zeros so
  # they add nothing to q.k, and they are never stored.
  col_mask = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim

  # A one-byte cache is dequantized tile by tile into the query's dtype for the matmuls.
  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype) if k_scale_ref is None else q_ref.dtype
  # float32 inputs get IEEE dots (not TF32) unless jax.default_matmul_precision asks less.
  dot_kwargs = dict(precision=dot_precision(compute_dtype))
  q = load_masked(q_ref, mask2d(row_valid, col_mask, (block_q, head_dim_padded)))
  q = q.astype(compute_dtype)

  # Loop bounds, in key blocks (score_mods.key_blocks): the causal diagonal and the
  # window's edges are loop bounds, not masks (Writing an Attention Kernel: "The causal
  # mask as a loop bound"). Blocks [lo, full_lo) and [full_hi, hi) straddle an edge and
  # run masked; the blocks between are seen whole by every row; the rest are never loaded.
  rows_end = jnp.minimum(q_start + block_q, q_valid)
  bounds = key_blocks(mods, q_start, rows_end - 1, shift, kv_valid, block_k)
  lo, full_lo, full_hi, hi = (jnp.where(rows_end > q_start, x, 0) for x in bounds)  # no row: no work
  q_ids = None
  if q_segment_ref is not None:
    # Packed documents: the key blocks outside the rows' id span are left out of the loops;
    # inside it, every tile (whole or edge) is masked by id equality.
    lo, full_lo, full_hi, hi = segments.clamp_bounds((lo, full_lo, full_hi, hi), span_ref)
    q_ids = load_tile(q_segment_ref, (True, False), 0, block_k, in_rows, None)  # [block_q, 1]

  def attend(j, carry, *, edge: bool):
    acc, m_i, l_i = carry  # [block_q, head_dim_padded], [block_q], [block_q] float32
    kv_start = pl.multiple_of(j * block_k, block_k)
    keys = kv_start + jnp.arange(block_k)  # [block_k] key positions
    # Edge blocks may reach past the valid keys (a cache's unwritten tail, or past S):
    # those rows load as zeros, so garbage there can never reach the output as 0 * NaN.
    key_ok = keys < kv_valid if edge else None
    kv_mask = mask2d(key_ok, col_mask, (block_k, head_dim_padded))
    index = tile_index(table_ref, kv_start, key_ok)  # keys kv_start.. in k_ref and v_ref
    k = load_masked(k_ref.at[index], kv_mask)
    if k_scale_ref is not None:  # dequantized right after the load, in float32
      k = dequantize_tile(k, load_scales(k_scale_ref, index, key_ok, block_k)[:, None], compute_dtype)
    qk = dot(q, k.astype(compute_dtype), trans_b=True, **dot_kwargs)
    # Scores in float32 and base 2 (scaled by log2 e) so the exponentials are exp2;
    # scaling the float32 scores, not a bf16 Q, keeps the error down.
    bias = None
    if bias_ref is not None:
      bias = load_tile(bias_ref, bias_layout, kv_start, block_k, in_rows, key_ok).astype(jnp.float32)
    s = score_mods.scores(mods, qk, qk_scale, bias)  # [block_q, block_k]
    ok = score_mods.visible(mods, rows, keys, shift, kv_valid) if edge else None
    if mask_ref is not None:
      allowed = load_tile(mask_ref, mask_layout, kv_start, block_k, in_rows, key_ok) != 0
      ok = allowed if ok is None else ok & allowed
    if q_ids is not None:
      same = q_ids == load_tile(kv_segment_ref, (False, True), kv_start, block_k, None, key_ok)
      ok = same if ok is None else ok & same
    if ok is not None:
      s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # running max
    if ok is not None or bias is not None:
      # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 never
      # sees -inf - -inf (NaN). Its p and alpha come out as exact zeros.
      m_new_safe = jnp.where(m_new == -jnp.inf, 0., m_new)
    else:
      m_new_safe = m_new  # every score here is finite, so the max is too
    alpha = exp2(m_i - m_new_safe, approx=approx_exp2)  # rescales the old state to the new max
    p = exp2(s - m_new_safe[:, None], approx=approx_exp2)  # [block_q, block_k]
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    v = load_masked(v_ref.at[index], kv_mask)
    if v_scale_ref is not None:
      v = dequantize_tile(v, load_scales(v_scale_ref, index, key_ok, block_k)[:, None], compute_dtype)
    v = v.astype(compute_dtype)
    acc = acc * alpha[:, None] + dot(p.astype(compute_dtype), v, **dot_kwargs)
    return acc, m_new, l_i

  # A sink is one more logit in the denominator (gpt-oss's attention sink): the online
  # softmax starts from it (m = sink, l = exp2(sink - m) = 1) instead of from nothing,
  # so a row that sees no key ends with out 0 and lse = sink.
  if sinks_ref is None:
    m_0, l_0 = jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32)
  else:
    m_0 = jnp.full((block_q,), sinks_ref[...].astype(jnp.float32) * LOG2_E, jnp.float32)
    l_0 = jnp.ones((block_q,), jnp.float32)
  carry = (jnp.zeros((block_q, head_dim_padded), jnp.float32), m_0, l_0)
  if mods.left is not None:  # the window's left edge
    carry = lax.fori_loop(lo, full_lo, functools.partial(attend, edge=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(attend, edge=False), carry)
  if mods.right is not None or kv_lengths_ref is not None or seq_kv % block_k:
    # Otherwise full_hi == hi: every key block to the end is whole and visible, and
    # the masked loop is not even compiled.
    carry = lax.fori_loop(full_hi, hi, functools.partial(attend, edge=True), carry)
  acc, m_i, l_i = carry

  # FlashAttention-2 divides once, here. Rows that saw no key (zero keys, or padding
  # rows past q_len) give exact zeros and an LSE of -inf (the sink with a sink). A row
  # that saw a NaN has l = NaN, which `!= 0` keeps: NaN out, as jax.nn gives.
  attended = row_valid & (l_i != 0.)
  l_safe = jnp.where(attended, l_i, 1.)
  out = jnp.where(attended[:, None], acc * (1. / l_safe)[:, None], 0.)
  in_bounds = None if seq_q % block_q == 0 else rows < seq_q
  store(o_ref, out.astype(o_ref.dtype),
        mask=mask2d(in_bounds, col_mask, (block_q, head_dim_padded)))
  if lse_ref is not None:
    # m and log2(l) are in base 2 (scores were scaled by log2 e): ln 2 converts back.
    lse = jnp.where(attended, (m_i + jnp.log2(l_safe)) * LN_2, -jnp.inf)
    store(lse_ref, lse, mask=in_bounds)


def resolve_config(config, head_dim: int, dtype) -> PrefillConfig:
  """config checked, or the tuned default for this head dim and dtype."""
  return configs.resolve(config, PrefillConfig, configs.prefill_config, head_dim, dtype)


@functools.partial(
    jax.jit, static_argnames=("is_causal", "local_window_size", "logits_soft_cap", "causal_alignment",
                              "return_residual", "config", "backward_config", "backward_implementation",
                              "interpret"))
def prefill_attention(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
                      bias=None, mask=None, scale=None, is_causal=False, local_window_size=None,
                      logits_soft_cap=None, sinks=None, causal_alignment="bottom_right",
                      segment_ids=None, kv_segment_ids=None,
                      return_residual=False, config: PrefillConfig | None = None,
                      backward_config=None, backward_implementation=None,
                      interpret: bool | None = None):
  """FlashAttention-2 forward pass.

  query [B, T, N, H]; key, value [B, S, K, H] with N a multiple of K (query head n reads
  KV head n // (N // K)); query_seq_lengths, key_value_seq_lengths: optional int [B].
  Rows t >= query_seq_lengths[b] are padding (zeros out, LSE -inf), keys
  s >= key_value_seq_lengths[b] are ignored. Query t sits at key position
  p = t + kv_len_b - q_len_b (`causal_alignment="bottom_right"`, FlashAttention's) or p = t
  ("top_left", jax.nn's); `is_causal` keeps keys s <= p.

  Options (semantics: jaxflash/reference.py): bias (float) and mask (bool, True = attend)
  broadcastable to [B, N, T, S], read tile by tile (broadcast axes are never expanded);
  scale: a float or a traced scalar (default H ** -0.5); local_window_size: w or
  (left, right), keys p - left <= s <= p + right, the blocks outside never loaded;
  logits_soft_cap: cap * tanh(s / cap) after the bias; sinks [N]: per-head logits in the
  softmax's denominator; segment_ids int [B, T] and kv_segment_ids int [B, S] (packed
  documents; kv_segment_ids defaults to segment_ids when T == S): query t sees key s only
  where the ids are equal, read tile by tile, with key blocks whose id range cannot meet
  the rows' never loaded (jaxflash/segments.py). Returns out [B, T, N, H] in the query's dtype, and with
  `return_residual` also the natural-log LSE [B, T, N] float32 (including the sink).

  Differentiable (jax.grad, jax.vjp, under jit, vmap, checkpoint and scan): the
  FlashAttention-2 backward (jaxflash/prefill_backward.py) gives the gradients of query,
  key, value, bias, sinks and scale, for every option; not differentiated, only this
  forward runs.

  config: tiles, warps and stages (default: `jaxflash.prefill_config(H, dtype)`).
  backward_config: the backward's (default: `jaxflash.backward_config(H, dtype)`).
  backward_implementation: the backward's kernel (`jaxflash.vjp.BACKWARD_IMPLEMENTATIONS`;
  None: the Pallas-Triton one).
  interpret: run the kernel in Pallas interpret mode (default: when there is no GPU).
  """
  _checks.check_qkv(query, key, value)
  batch, seq_q, num_heads, head_dim = query.shape
  seq_kv = key.shape[1]
  _checks.check_same_batch(query, key)
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch, seq_q)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch, seq_kv)
  segment_ids, kv_segment_ids = segments.check_segment_ids(segment_ids, kv_segment_ids, batch, seq_q,
                                                           seq_kv)
  mods = ScoreMods.from_options(is_causal=is_causal, causal_alignment=causal_alignment,
                                local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
  static_scale = head_dim ** -0.5 if scale is None else _checks.split_scale(scale)[0]
  tile_dtype = jnp.promote_types(query.dtype, key.dtype)
  config = resolve_config(config, head_dim, tile_dtype)
  options = vjp.Options(q_lengths, kv_lengths, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                        **score_operands(query, seq_kv, bias=bias, mask=mask, sinks=sinks, scale=scale))
  # The Pallas-Triton forward keeps the Triton backward unless "mosaic" is asked.
  backward = vjp.choose_backward(backward_implementation or "triton", query, key, value, options,
                                 mods=mods, static_scale=static_scale, config=backward_config,
                                 interpret=interpret)

  def forward(q, k, v, options: vjp.Options, with_lse):
    return prefill_forward(q, k, v, options.q_lengths, options.kv_lengths, **options.arrays(),
                           mods=mods, return_residual=with_lse, config=config, interpret=interpret)

  return vjp.with_backward(forward, query, key, value, options, backward=backward,
                           return_residual=return_residual)


def score_operands(query, seq_kv: int, *, bias, mask, sinks, scale) -> dict:
  """bias, mask, sinks and scale checked against the scores [B, N, T, S] (ValueError or
  TypeError naming the argument) and made the operands `prefill_forward` takes."""
  batch, seq_q, num_heads, head_dim = query.shape
  scores_shape = (batch, num_heads, seq_q, seq_kv)
  return dict(bias=_checks.check_bias(bias, scores_shape), mask=_checks.check_mask(mask, scores_shape),
              sinks=_checks.check_sinks(sinks, num_heads), scale=_checks.scale_operand(scale, head_dim))


def prefill_forward(query, key, value, q_lengths, kv_lengths, *, bias, mask, scale, sinks,
                    segment_ids=None, kv_segment_ids=None, block_table=None, k_scale=None, v_scale=None,
                    mods: ScoreMods, return_residual: bool, config: PrefillConfig, interpret):
  """The kernel launch, on checked arguments (`prefill_attention` and
  `paged_prefill_attention` check them).

  key, value: caches [B, S, K, H], or with block_table [B, max_pages] int32 page pools
  [num_pages, page_size, K, H] holding sequence b's logical page j at pool page
  block_table[b, j] (S = max_pages * page_size); k_scale, v_scale: a one-byte cache's
  float32 scales, its shape without H, or None. q_lengths, kv_lengths: int32 [B] or None;
  bias float / mask bool [Bb, Nb, Tb, Sb] (rank 4, each axis 1 or full) or None; scale:
  float32 []; sinks: float32 [N] or None; segment_ids int32 [B, T] and kv_segment_ids int32
  [B, S], both or neither. Returns (out, lse) with `return_residual`, else out.
  """
  batch, seq_q, num_heads, head_dim = query.shape
  num_kv_heads = key.shape[2]
  seq_kv = key.shape[1] if block_table is None else block_table.shape[1] * key.shape[1]
  if 0 in (batch, seq_q, num_heads, head_dim) or seq_kv == 0:
    # Nothing to launch: every row has zero keys (or there are no rows).
    out = jnp.zeros(query.shape, query.dtype)
    q_len = seq_q if q_lengths is None else q_lengths[:, None, None]
    valid_rows = jnp.arange(seq_q)[None, :, None] < q_len  # [B or 1, T, 1]
    empty = jnp.full((1, 1, num_heads), -jnp.inf) if sinks is None else sinks[None, None, :]
    lse = jnp.where(valid_rows, empty, -jnp.inf).astype(jnp.float32)
    lse = jnp.broadcast_to(lse, query.shape[:3])
    return (out, lse) if return_residual else out

  if use_interpret(interpret) and manual_axes():
    # Inside jax.shard_map with check_vma on, JAX's Pallas interpreter (jax 0.10) pads refs
    # with constants that vary over no mesh axis and the check refuses them ("Primitive pad
    # requires varying manual axes to match"). Interpreted there, the plain-JAX reference
    # stands in (on the pages gathered into caches); compiled kernels run as everywhere else.
    if k_scale is not None:
      key, value = dequantize_kv(key, k_scale, query.dtype), dequantize_kv(value, v_scale, query.dtype)
    if block_table is not None:
      key, value = gather_pages(key, block_table), gather_pages(value, block_table)
    out, lse = attention_reference(
        query, key, value, bias, mask, scale=scale, is_causal=mods.is_causal,
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, local_window_size=mods.window,
        logits_soft_cap=mods.logits_soft_cap, sinks=sinks, causal_alignment=mods.causal_alignment,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    return (out, lse) if return_residual else out

  block_q = block_size(config.block_q, seq_q)
  block_k = block_size(config.block_k, seq_kv)
  head_dim_padded = configs.padded_head_dim(head_dim)
  num_q_blocks = pl.cdiv(seq_q, block_q)
  # A query tile shrunk for a short sequence has too few rows to share among 8 warps.
  num_warps = config.num_warps if block_q == config.block_q else min(config.num_warps, 4)
  group = num_heads // num_kv_heads

  # Grid (head, query block, sequence): the head varies fastest, so the programs resident
  # together share KV heads (GQA tiles hit in L2), and all heads' longest blocks go first.
  grid = (num_heads, num_q_blocks, batch)

  def q_block_index(n, i, b):
    return b, num_q_blocks - 1 - i, n, 0

  # Optional operands (None) get no BlockSpec and reach the kernel as None refs.
  length_spec = pl.BlockSpec((None,), lambda n, i, b: (b,))
  bias_spec, bias_layout = (None, None) if bias is None else operand_spec(bias, block_q, num_q_blocks)
  mask_spec, mask_layout = (None, None) if mask is None else operand_spec(mask, block_q, num_q_blocks)
  if mask is not None:
    mask = mask.astype(jnp.int8)  # a byte a flag, as bool; Triton loads bytes, not i1
  kv_operands, tile_index = _kv_operands(key, value, block_table, k_scale, v_scale, block_k=block_k,
                                         group=group, head_dim_padded=head_dim_padded)
  spans = None
  if segment_ids is not None:
    spans = segments.block_spans(segment_ids, kv_segment_ids, block_q, block_k)  # [B, nq, 2]
  operands = dict(
      q_lengths=(q_lengths, length_spec),
      kv_lengths=(kv_lengths, length_spec),
      scale=(score_mods.score_scale(mods, scale).reshape(1), pl.BlockSpec((None,), lambda n, i, b: (0,))),
      sinks=(sinks, pl.BlockSpec((None,), lambda n, i, b: (n,))),
      bias=(bias, bias_spec),
      mask=(mask, mask_spec),
      segment_ids=(segment_ids, pl.BlockSpec((None, block_q), lambda n, i, b: (b, num_q_blocks - 1 - i))),
      kv_segment_ids=(kv_segment_ids, pl.BlockSpec((None, seq_kv), lambda n, i, b: (b, 0))),
      segment_spans=(spans, pl.BlockSpec((None, None, 2), lambda n, i, b: (b, num_q_blocks - 1 - i, 0))),
      query=(query, pl.BlockSpec((None, block_q, None, head_dim_padded), q_block_index)),
      **kv_operands,
  )
  names = [name for name, (x, _) in operands.items() if x is not None]
  kernel = functools.partial(
      _prefill_kernel, tile_index=tile_index, mods=mods, bias_layout=bias_layout, mask_layout=mask_layout,
      block_q=block_q, block_k=block_k, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv,
      num_q_blocks=num_q_blocks, approx_exp2=APPROX_EXP2 and not use_interpret(interpret))

  def kernel_with_optional_refs(*refs):
    given = dict(zip(names, refs))
    o_ref, *lse_ref = refs[len(names):]
    kernel(*(given.get(name) for name in operands), o_ref, lse_ref[0] if lse_ref else None)

  inputs = [operands[name][0] for name in names]
  out_shape = [result_struct(query.shape, query.dtype, *inputs)]
  out_specs = [pl.BlockSpec((None, block_q, None, head_dim_padded), q_block_index)]
  if return_residual:
    out_shape.append(result_struct((batch, seq_q, num_heads), jnp.float32, *inputs))
    out_specs.append(pl.BlockSpec((None, block_q, None), lambda n, i, b: (b, num_q_blocks - 1 - i, n)))

  # Work: the key blocks the loop bounds visit at full lengths (O(n w) with a window).
  pairs = batch * num_heads * count_key_blocks(mods, seq_q, seq_kv, block_q, block_k) * block_q * block_k
  optional_bytes = sum(x.size * x.dtype.itemsize for x in (bias, mask, k_scale, v_scale) if x is not None)
  kv_bytes = 2 * batch * seq_kv * num_kv_heads * head_dim * key.dtype.itemsize  # a table's full capacity
  cost = pl.CostEstimate(
      flops=int(4 * pairs * head_dim), transcendentals=int(pairs),
      bytes_accessed=int(2 * query.size * query.dtype.itemsize + kv_bytes + optional_bytes))
  with quiet():
    call = pl.pallas_call(
        kernel_with_optional_refs,
        grid=grid,
        in_specs=[operands[name][1] for name in names],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
        cost_estimate=cost,
        interpret=use_interpret(interpret),
        name="jaxflash_prefill" if block_table is None else "jaxflash_paged_prefill",
    )
    results = call(*inputs)
  return tuple(results) if return_residual else results[0]


def _contiguous_head_tile(block_k: int):
  """Tile addresser over one (sequence, KV head)'s keys [S, Hp], as its BlockSpec selects
  them: keys kv_start.. are rows kv_start.., a plain slice read in place."""
  def tile_index(table_ref, kv_start, key_ok):
    del table_ref, key_ok
    return pl.ds(kv_start, block_k), slice(None)
  return tile_index


def _kv_operands(key, value, block_table, k_scale, v_scale, *, block_k: int, group: int,
                 head_dim_padded: int):
  """The K/V operands (with the block table and the scales) as (array or None, BlockSpec)
  pairs, and the addresser of their tiles.

  Each program sees the rows [kv_rows, Hp] of its KV head n // group. A contiguous cache
  gives sequence b's S keys, and tile j is rows j * block_k.. of them. A page pool
  [P, page, K, H] is viewed as rows [P * page, K, H] (a bitcast: read in place) and the
  program also gets sequence b's table row: key s sits at row
  table[s // page] * page + s % page ("Efficient Memory Management for Large Language Model
  Serving with PagedAttention"), looked up per tile (`paged_head_tile`).
  """
  if block_table is None:
    seq_kv = key.shape[1]
    kv_spec = pl.BlockSpec((None, seq_kv, None, head_dim_padded),
                           lambda n, i, b: (b, 0, lax.div(n, group), 0))
    scale_spec = pl.BlockSpec((None, seq_kv, None), lambda n, i, b: (b, 0, lax.div(n, group)))
    table_spec, tile_index = None, _contiguous_head_tile(block_k)
  else:
    num_pages, page_size, num_kv_heads, head_dim = key.shape
    kv_rows = num_pages * page_size
    key, value = (x.reshape(kv_rows, num_kv_heads, head_dim) for x in (key, value))
    k_scale, v_scale = (None if x is None else x.reshape(kv_rows, num_kv_heads) for x in (k_scale, v_scale))
    kv_spec = pl.BlockSpec((kv_rows, None, head_dim_padded), lambda n, i, b: (0, lax.div(n, group), 0))
    scale_spec = pl.BlockSpec((kv_rows, None), lambda n, i, b: (0, lax.div(n, group)))
    table_spec = pl.BlockSpec((None, block_table.shape[1]), lambda n, i, b: (b, 0))
    tile_index = paged_head_tile(block_k, page_size, num_pages, head_dim_padded)
  return dict(block_table=(block_table, table_spec), key=(key, kv_spec), value=(value, kv_spec),
              k_scale=(k_scale, scale_spec), v_scale=(v_scale, scale_spec)), tile_index


def count_key_blocks(mods: ScoreMods, seq_q: int, seq_kv: int, block_q: int, block_k: int) -> int:
  """Key blocks the kernel's loops visit for one sequence and head at full lengths, summed
  over its query blocks: the bounds of `score_mods.key_blocks`, evaluated at trace time.
  A sliding window (w, 0) makes it about (seq_q / block_q) * ((w + block_q) / block_k + 1)."""
  with jax.ensure_compile_time_eval():
    q_len, kv_len = jnp.int32(seq_q), jnp.int32(seq_kv)
    starts = jnp.arange(0, seq_q, block_q, dtype=jnp.int32)  # [num_q_blocks]
    last = jnp.minimum(starts + block_q, seq_q) - 1
    lo, _, _, hi = key_blocks(mods, starts, last, mods.shift(q_len, kv_len), kv_len, block_k)
    return int(jnp.sum(hi - lo))


def prefill_reference(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
                      bias=None, mask=None, scale=None, is_causal=False, local_window_size=None,
                      logits_soft_cap=None, sinks=None, causal_alignment="bottom_right",
                      segment_ids=None, kv_segment_ids=None, return_residual=False):
  """Plain-JAX attention with `prefill_attention`'s semantics (materialises [B, N, T, S])."""
  segment_ids, kv_segment_ids = segments.check_segment_ids(
      segment_ids, kv_segment_ids, query.shape[0], query.shape[1], key.shape[1])
  out, lse = attention_reference(
      query, key, value, bias, mask, scale=_checks.default_scale(scale, query.shape[-1]),
      is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=window_size(local_window_size),
      logits_soft_cap=logits_soft_cap, sinks=sinks, causal_alignment=causal_alignment,
      segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  return (out, lse) if return_residual else out
