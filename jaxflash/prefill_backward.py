"""FlashAttention-2 backward pass: the kernels, their wrapper and the plain reference (the
custom VJP that runs them is jaxflash/vjp.py).

The structure is Algorithm 2 of FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning (Dao, 2023), split into two kernels so that nothing is accumulated
across programs (no atomics, so results are the same run to run):

  * a pre-pass, delta_i = rowsum(dO_i * O_i) - dLSE_i (O(n d), left to XLA: it fuses with
    the transpose to [B, N, T] and with the LSE's conversion to base 2, and a kernel would
    add a launch to save nothing);
  * the dK/dV kernel: one program per (KV block, KV head, sequence). It keeps its K and V
    tiles and the dK and dV accumulators on chip and streams the query blocks past them,
    for *every query head of the KV head's GQA group*, so a KV head's gradient is summed
    inside the kernel (never a repeated-K/V gradient reduced afterwards). Where that grid
    of B * K * S / block_k programs is too small for the GPU (BackwardConfig.q_splits),
    each key block's query range is split over a few programs whose float32 partial dK/dV
    XLA sums in a fixed order (deterministic, a [q_splits, B, S, K, H] buffer);
  * the dQ kernel: one program per (query block, query head, sequence), streaming K and V
    like the forward; with a bias it also writes dS, the bias's gradient, tile by tile.

Both recompute the scores in float32 from Q, K and the forward's log-sum-exp, with exp2 and
the forward's scaling and options (jaxflash/score_mods.py: the same helpers, so both passes
see the same keys and scores):

    P = exp(S - LSE)        dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)
    dS' = dS * (1 - tanh^2) with a soft-cap (else dS)      dQ = scale dS' K      dK = scale dS'^T Q

Causal attention and sliding windows are loop bounds in both, as in the forward: the dK/dV
kernel visits only the query blocks that see its keys (`score_mods.query_blocks`), the dQ
kernel only the key blocks its rows see (`score_mods.key_blocks`); only the blocks at an
edge are masked. Rows and sequences with nothing to attend (LSE -inf) get an LSE of +inf
here, so their P is exactly 0 and their gradients are zeros, never NaN.

The gradients of the array options come out of the same quantities, in XLA
(jaxflash/option_grads.py).

Layout everywhere: query [B, T, N, H], key/value [B, S, K, H], N a multiple of K.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from jaxflash import _checks, configs, score_mods, segments
from jaxflash._triton import (APPROX_EXP2, LOG2_E, CompilerParams, block_size, dot, exp2, load,
                              load_masked, load_tile, mask2d, operand_spec, pl, quiet, store,
                              use_interpret)
from jaxflash._util import dot_precision
from jaxflash.configs import BackwardConfig
from jaxflash.option_grads import option_grads
from jaxflash.reference import attention_reference
from jaxflash.score_mods import ScoreMods, window_size
from jaxflash.sharding import manual_axes, result_struct


def _lengths(mods: ScoreMods, q_lengths_ref, kv_lengths_ref, seq_q: int, seq_kv: int):
  """(q_valid, kv_valid, shift): the sequence's rows and keys, and query t's key position
  offset (t + shift is its position), as the forward."""
  q_len = jnp.int32(seq_q) if q_lengths_ref is None else q_lengths_ref[...]
  kv_len = jnp.int32(seq_kv) if kv_lengths_ref is None else kv_lengths_ref[...]
  return jnp.clip(q_len, 0, seq_q), jnp.clip(kv_len, 0, seq_kv), mods.shift(q_len, kv_len)


def _load_tile_t(ref, layout: tuple[bool, bool, bool], g, q_start, block_q: int, row_ok, key_ok):
  """The dK/dV kernel's tile of a bias or mask, transposed: broadcastable to [block_k, block_q].

  layout: (heads, rows, keys), whether the operand varies along the group's heads, T and S
  (a broadcast axis is squeezed: stride 0). ref is [group?, seq_q?, block_k?]; g the head
  in the group; row_ok [block_q], key_ok [block_k]: loads to make (None: all).
  """
  heads, rows, keys = layout
  other = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.
  index = (g,) if heads else ()
  if rows:
    index += (pl.ds(q_start, block_q),)
  if rows and keys:
    mask = mask2d(row_ok, key_ok, (block_q, ref.shape[-1]))
    tile = ref.at[index + (slice(None),)]
    tile = load(tile) if mask is None else load(tile, mask=mask, other=other)
    return tile.T
  if rows:
    tile = ref.at[index]
    return (load(tile) if row_ok is None else load(tile, mask=row_ok, other=other))[None, :]
  if keys:
    tile = ref.at[index + (slice(None),)] if index else ref
    return (load(tile) if key_ok is None else load(tile, mask=key_ok, other=other))[:, None]
  return ref[index] if index else ref[...]


def _dkdv_kernel(
    q_lengths_ref,  # [] int32: this sequence's query count (None: all T rows are queries)
    kv_lengths_ref,  # [] int32: this sequence's key count (None: all S keys are valid)
    scale_ref,  # [2] float32: (score_mods.score_scale, the softmax scale)
    bias_ref,  # [group?, seq_q?, block_k?] of bias[b, heads of KV head k] (None: no bias)
    mask_ref,  # the same for the mask, int8, nonzero = attend (None: no mask)
    q_segment_ref,  # [seq_q] int32: every row's document id (None: no segments)
    kv_segment_ref,  # [block_k] int32: these keys' document ids
    span_ref,  # [2] int32: the query blocks whose ids may meet these keys' (segments.block_spans)
    q_ref,  # [seq_q, group, head_dim_padded]: every query head of KV head k's group
    do_ref,  # [seq_q, group, head_dim_padded]: dO of those heads
    lse_ref,  # [group, seq_q] float32 base-2 LSE (+inf: rows with nothing to attend)
    delta_ref,  # [group, seq_q] float32 rowsum(dO * O) - dLSE
    k_ref,  # [block_k, head_dim_padded]: this program's keys of KV head k
    v_ref,  # [block_k, head_dim_padded]
    dk_ref,  # [block_k, head_dim_padded] (float32 partial sums with q_splits > 1)
    dv_ref,  # [block_k, head_dim_padded] (likewise)
    *,
    mods: ScoreMods,
    bias_layout,
    mask_layout,
    block_q: int,
    block_k: int,
    head_dim: int,
    seq_q: int,
    seq_kv: int,
    group: int,
    q_splits: int,
    approx_exp2: bool,
):
  head_dim_padded = q_ref.shape[-1]
  num_q_blocks = pl.cdiv(seq_q, block_q)
  # Grid axis 0 is (key block, split): with q_splits > 1 each program of a key block takes
  # one contiguous share of every loop below and writes partial dK/dV.
  k_start = lax.div(pl.program_id(0), q_splits) * block_k
  split = lax.rem(pl.program_id(0), q_splits)
  q_valid, kv_valid, shift = _lengths(mods, q_lengths_ref, kv_lengths_ref, seq_q, seq_kv)
  qk_scale, scale = scale_ref[0], scale_ref[1]
  keys = k_start + jnp.arange(block_k)  # [block_k] key positions
  key_valid = keys < kv_valid
  in_keys = keys < seq_kv if seq_kv % block_k else None  # bias/mask keys to load
  col_mask = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim
  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  dot_kwargs = dict(precision=dot_precision(compute_dtype))

  # Keys past the valid ones load as zeros; their dK/dV rows are computed like any other
  # (each key's gradient depends on its own column of P only) and stored as zeros.
  ragged_keys = kv_lengths_ref is not None or seq_kv % block_k != 0
  kv_mask = mask2d(key_valid if ragged_keys else None, col_mask, (block_k, head_dim_padded))
  k = load_masked(k_ref, kv_mask).astype(compute_dtype)
  v = load_masked(v_ref, kv_mask).astype(compute_dtype)

  # Loop bounds, in query blocks (score_mods.query_blocks): the rows that see these keys.
  # Rows past q_valid have an LSE of +inf (P = 0), so only the edges of the causal band or
  # window need a mask; rows past T (and padded rows, whose Q and dO may hold anything)
  # load as zeros.
  ragged_rows = q_lengths_ref is not None or seq_q % block_q != 0
  last_key = jnp.minimum(k_start + block_k, kv_valid) - 1
  bounds = score_mods.query_blocks(mods, k_start, last_key, shift, q_valid, block_q)
  lo, full_lo, full_hi, hi = (jnp.where(k_start < kv_valid, x, 0) for x in bounds)  # no key: no work
  kv_ids = None
  if kv_segment_ref is not None:  # packed documents: only the query blocks the ids let meet
    lo, full_lo, full_hi, hi = segments.clamp_bounds((lo, full_lo, full_hi, hi), span_ref)
    kv_ids = load_tile(kv_segment_ref, (True, False), 0, block_q, in_keys, None)  # [block_k, 1]

  def step(index, carry, *, start, count, edge: bool):
    dk, dv = carry  # [block_k, head_dim_padded] float32 each
    # One flat loop over (query head of the group, query block): the group's heads all
    # add into this program's dK and dV: the sum over the heads that share K and V, which
    # FlashAttention-2 takes across its per-head gradients, is done here, inside the kernel.
    # Both clamps change no iteration that runs (there 0 <= g < group and the block lies
    # in [start, end)); they keep every address inside the operands whatever the index,
    # an empty loop's (count = 0) included: the compiled kernel read Q far out of bounds
    # without them (compute-sanitizer; q_splits > 1 and a window, T = 24, S = 31).
    g = jnp.clip(lax.div(index, jnp.maximum(count, 1)), 0, group - 1)
    q_block = jnp.clip(start + index - g * count, 0, num_q_blocks - 1)
    q_start = pl.multiple_of(q_block * block_q, block_q)
    rows = q_start + jnp.arange(block_q)  # [block_q] query positions
    row_mask = mask2d(rows < q_valid if ragged_rows else None, col_mask, (block_q, head_dim_padded))
    q = load_masked(q_ref.at[pl.ds(q_start, block_q), g, :], row_mask).astype(compute_dtype)
    do = load_masked(do_ref.at[pl.ds(q_start, block_q), g, :], row_mask).astype(compute_dtype)
    in_rows = rows < seq_q if seq_q % block_q else None
    if in_rows is None:
      lse = lse_ref[g, pl.ds(q_start, block_q)]
      delta = delta_ref[g, pl.ds(q_start, block_q)]
    else:
      lse = load_masked(lse_ref.at[g, pl.ds(q_start, block_q)], in_rows)
      lse = jnp.where(in_rows, lse, jnp.inf)
      delta = load_masked(delta_ref.at[g, pl.ds(q_start, block_q)], in_rows)
    # Transposed scores S^T [block_k, block_q]: dV and dK then come out of plain products.
    qk_t = dot(k, q, trans_b=True, **dot_kwargs)
    bias = None
    if bias_ref is not None:
      bias = _load_tile_t(bias_ref, bias_layout, g, q_start, block_q, in_rows, in_keys)
      bias = bias.astype(jnp.float32)
    s_t = score_mods.scores(mods, qk_t, qk_scale, bias)
    p_t = exp2(s_t - lse[None, :], approx=approx_exp2)
    ok = score_mods.visible(mods, rows, keys, shift, kv_valid, transposed=True) if edge else None
    if mask_ref is not None:
      allowed = _load_tile_t(mask_ref, mask_layout, g, q_start, block_q, in_rows, in_keys) != 0
      ok = allowed if ok is None else ok & allowed
    if kv_ids is not None:
      same = kv_ids == load_tile(q_segment_ref, (False, True), q_start, block_q, None, in_rows)
      ok = same if ok is None else ok & same
    if ok is not None:
      p_t = jnp.where(ok, p_t, 0.)
    dv = dv + dot(p_t.astype(compute_dtype), do, **dot_kwargs)
    dp_t = dot(v, do, trans_b=True, **dot_kwargs)  # [block_k, block_q]
    ds_t = score_mods.scores_grad(mods, p_t * (dp_t - delta[None, :]), s_t)
    if ok is not None:  # a NaN row's delta would reach hidden keys as 0 * NaN; jax.nn's do not
      ds_t = jnp.where(ok, ds_t, 0.)
    dk = dk + dot(ds_t.astype(compute_dtype), q, **dot_kwargs)
    return dk, dv

  def run(start, end, carry, *, edge: bool):
    count = end - start
    body = functools.partial(step, start=start, count=count, edge=edge)
    if q_splits == 1:
      return lax.fori_loop(0, group * count, body, carry)
    # This split's contiguous share, counted from 0 (the index offset inside). A split's
    # share of a run may be empty, and Triton's software pipeliner (num_stages >= 2)
    # issues the first iteration's loads of such a loop anyway, from an address that is
    # never computed: on the H200 the compiled kernel read address 0x80 (compute-sanitizer;
    # windows (0, 0), (5, 0) and (40, 0) at T = 24, S = 31, q_splits = 2). The loop runs
    # only where it has trips; with num_stages = 1, or the guard, no shape faulted.
    share = lax.div(group * count + (q_splits - 1), q_splits)
    first = jnp.minimum(split * share, group * count)
    trips = jnp.minimum(share, group * count - first)
    loop = lambda carry: lax.fori_loop(0, trips, lambda i, carry: body(first + i, carry), carry)
    return lax.cond(trips > 0, loop, lambda carry: carry, carry)

  carry = (jnp.zeros((block_k, head_dim_padded), jnp.float32),
           jnp.zeros((block_k, head_dim_padded), jnp.float32))
  if mods.right is not None:  # rows before the band's full part: the causal diagonal
    carry = run(lo, full_lo, carry, edge=True)
  carry = run(full_lo, full_hi, carry, edge=False)
  if mods.left is not None:  # rows past it: the window's left edge
    carry = run(full_hi, hi, carry, edge=True)
  dk, dv = carry

  store_mask = mask2d(in_keys, col_mask, (block_k, head_dim_padded))
  keep = key_valid[:, None]
  store(dk_ref, jnp.where(keep, dk * scale, 0.).astype(dk_ref.dtype), mask=store_mask)
  store(dv_ref, jnp.where(keep, dv, 0.).astype(dv_ref.dtype), mask=store_mask)


def _dq_kernel(
    q_lengths_ref,  # [] int32 (None: all T rows are queries)
    kv_lengths_ref,  # [] int32 (None: all S keys are valid)
    scale_ref,  # [2] float32: (score_mods.score_scale, the softmax scale)
    bias_ref,  # [block_q?, seq_kv?] of bias[b, n] (None: no bias), as the forward's
    mask_ref,  # the same for the mask, int8 (None: no mask)
    q_segment_ref,  # [block_q] int32: these rows' document ids (None: no segments)
    kv_segment_ref,  # [seq_kv] int32: every key's document id
    span_ref,  # [2] int32: the key blocks whose ids may meet these rows' (segments.block_spans)
    q_ref,  # [block_q, head_dim_padded]: rows of query head n of sequence b
    do_ref,  # [block_q, head_dim_padded]
    lse_ref,  # [block_q] float32 base-2 LSE (+inf: rows with nothing to attend)
    delta_ref,  # [block_q] float32
    k_ref,  # [seq_kv, head_dim_padded]: all keys of KV head n // group of sequence b
    v_ref,  # [seq_kv, head_dim_padded]
    dq_ref,  # [block_q, head_dim_padded]
    ds_ref,  # [block_q, seq_kv] float32 dS of bias[b, n] (None: no bias)
    *,
    mods: ScoreMods,
    bias_layout,
    mask_layout,
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
  q_valid, kv_valid, shift = _lengths(mods, q_lengths_ref, kv_lengths_ref, seq_q, seq_kv)
  qk_scale, scale = scale_ref[0], scale_ref[1]
  rows = q_start + jnp.arange(block_q)
  row_valid = rows < q_valid
  in_rows = rows < seq_q if seq_q % block_q else None
  col_mask = None if head_dim == head_dim_padded else jnp.arange(head_dim_padded) < head_dim
  compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  dot_kwargs = dict(precision=dot_precision(compute_dtype))

  row_mask = mask2d(row_valid, col_mask, (block_q, head_dim_padded))
  q = load_masked(q_ref, row_mask).astype(compute_dtype)
  do = load_masked(do_ref, row_mask).astype(compute_dtype)
  lse = lse_ref[...] if in_rows is None else load_masked(lse_ref, in_rows)
  lse = jnp.where(row_valid, lse, jnp.inf)
  delta = delta_ref[...] if in_rows is None else load_masked(delta_ref, in_rows)

  # The forward's bounds (score_mods.key_blocks): blocks [lo, full_lo) and [full_hi, hi)
  # run masked, the ones between are seen whole, the rest are never loaded.
  rows_end = jnp.minimum(q_start + block_q, q_valid)
  bounds = score_mods.key_blocks(mods, q_start, rows_end - 1, shift, kv_valid, block_k)
  lo, full_lo, full_hi, hi = (jnp.where(rows_end > q_start, x, 0) for x in bounds)  # no row: no work
  q_ids = None
  if q_segment_ref is not None:  # packed documents, as the forward
    lo, full_lo, full_hi, hi = segments.clamp_bounds((lo, full_lo, full_hi, hi), span_ref)
    q_ids = load_tile(q_segment_ref, (True, False), 0, block_k, in_rows, None)  # [block_q, 1]

  def step(j, dq, *, edge: bool):
    kv_start = pl.multiple_of(j * block_k, block_k)
    keys = kv_start + jnp.arange(block_k)
    key_ok = keys < kv_valid if edge else None
    kv_mask = mask2d(key_ok, col_mask, (block_k, head_dim_padded))
    k = load_masked(k_ref.at[pl.ds(kv_start, block_k), :], kv_mask).astype(compute_dtype)
    v = load_masked(v_ref.at[pl.ds(kv_start, block_k), :], kv_mask).astype(compute_dtype)
    qk = dot(q, k, trans_b=True, **dot_kwargs)  # [block_q, block_k]
    bias = None
    if bias_ref is not None:
      bias = load_tile(bias_ref, bias_layout, kv_start, block_k, in_rows, key_ok).astype(jnp.float32)
    s = score_mods.scores(mods, qk, qk_scale, bias)
    p = exp2(s - lse[:, None], approx=approx_exp2)
    ok = score_mods.visible(mods, rows, keys, shift, kv_valid) if edge else None
    if mask_ref is not None:
      allowed = load_tile(mask_ref, mask_layout, kv_start, block_k, in_rows, key_ok) != 0
      ok = allowed if ok is None else ok & allowed
    if q_ids is not None:
      same = q_ids == load_tile(kv_segment_ref, (False, True), kv_start, block_k, None, key_ok)
      ok = same if ok is None else ok & same
    if ok is not None:
      p = jnp.where(ok, p, 0.)
    dp = dot(do, v, trans_b=True, **dot_kwargs)  # [block_q, block_k]
    ds = score_mods.scores_grad(mods, p * (dp - delta[:, None]), s)
    if ok is not None:  # a NaN row's delta would reach hidden keys as 0 * NaN; jax.nn's do not
      ds = jnp.where(ok, ds, 0.)
    if ds_ref is not None:
      _store_ds(ds_ref, ds, kv_start, block_k, in_rows, seq_kv)
    return dq + dot(ds.astype(compute_dtype), k, **dot_kwargs)

  dq = jnp.zeros((block_q, head_dim_padded), jnp.float32)
  if mods.left is not None:  # the window's left edge
    dq = lax.fori_loop(lo, full_lo, functools.partial(step, edge=True), dq)
  dq = lax.fori_loop(full_lo, full_hi, functools.partial(step, edge=False), dq)
  if mods.right is not None or kv_lengths_ref is not None or seq_kv % block_k:
    dq = lax.fori_loop(full_hi, hi, functools.partial(step, edge=True), dq)
  dq = jnp.where(row_valid[:, None], dq * scale, 0.)
  store(dq_ref, dq.astype(dq_ref.dtype), mask=mask2d(in_rows, col_mask, (block_q, head_dim_padded)))

  if ds_ref is not None:
    # dS is zero on the key blocks the loops never visit (outside the band).
    zeros = jnp.zeros((block_q, block_k), jnp.float32)

    def clear(j, carry):
      _store_ds(ds_ref, zeros, pl.multiple_of(j * block_k, block_k), block_k, in_rows, seq_kv)
      return carry  # no loop state (a literal carry has no value in Triton's scf.yield)

    lax.fori_loop(0, lo, clear, None)
    lax.fori_loop(hi, pl.cdiv(seq_kv, block_k), clear, None)


def _store_ds(ds_ref, ds, kv_start, block_k: int, in_rows, seq_kv: int):
  """One [block_q, block_k] tile of dS into the [block_q, seq_kv] row block."""
  in_keys = kv_start + jnp.arange(block_k) < seq_kv if seq_kv % block_k else None
  store(ds_ref.at[:, pl.ds(kv_start, block_k)], ds, mask=mask2d(in_rows, in_keys, ds.shape))


def resolve_config(config, head_dim: int, dtype) -> BackwardConfig:
  """config checked, or the tuned default for this head dim and dtype."""
  return configs.resolve(config, BackwardConfig, configs.backward_config, head_dim, dtype,
                         argument="backward_config")


def _grouped_spec(x, group: int, q_splits: int):
  """BlockSpec and (heads, rows, keys) layout of a [Bb, Nb, Tb, Sb] bias or mask for the
  dK/dV grid (KV block and split p, KV head h, sequence b): the group's heads, every row,
  block_k keys; broadcast axes squeezed and pinned to 0 (stride 0)."""
  bb, nb, tb, sb = x.shape

  def spec(block_k):
    block = (None, group if nb > 1 else None, tb if tb > 1 else None, block_k if sb > 1 else None)

    def index(p, h, b):
      return b if bb > 1 else 0, h if nb > 1 else 0, 0, lax.div(p, q_splits) if sb > 1 else 0

    return pl.BlockSpec(block, index)

  return spec, (nb > 1, tb > 1, sb > 1)


def backward_kernels(query, key, value, q_lengths, kv_lengths, out, lse, d_out, d_lse, *, bias,
                     mask, scale, mods: ScoreMods, config: BackwardConfig, interpret, sinks=None,
                     segment_ids=None, kv_segment_ids=None):
  """The launches, on checked arguments (shapes as `prefill_backward`; bias/mask rank 4,
  scale float32 []). Returns (dq, dk, dv, ds): ds the float32 [B, N, T, S] gradient of the
  scores before the bias is added (None without a bias). The kernels read the sinks
  through the LSE only; `sinks` is for the plain-JAX stand-in inside jax.shard_map."""
  batch, seq_q, num_heads, head_dim = query.shape
  seq_kv, num_kv_heads = key.shape[1], key.shape[2]
  if 0 in (batch, seq_q, num_heads, head_dim) or seq_kv == 0:
    ds = None if bias is None else jnp.zeros((batch, num_heads, seq_q, seq_kv), jnp.float32)
    return jnp.zeros_like(query), jnp.zeros_like(key), jnp.zeros_like(value), ds

  if use_interpret(interpret) and manual_axes():
    # Interpreted inside jax.shard_map with check_vma on, as the forward (jaxflash/prefill.py):
    # the plain-JAX reference's gradients stand in for the kernels'.
    return _reference_grads(query, key, value, q_lengths, kv_lengths, d_out, d_lse, bias=bias,
                            mask=mask, sinks=sinks, scale=scale, mods=mods, segment_ids=segment_ids,
                            kv_segment_ids=kv_segment_ids)

  # The pre-pass (XLA, fused): delta and the base-2 LSE, transposed to [B, N, T] so each
  # program's rows are contiguous. An LSE of -inf (nothing to attend) becomes +inf: P = 0.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  # The barrier keeps the row reduction apart from the transpose: fused, XLA reads d_out and
  # O in the transposed order (60 us at n = 4096 on the H200, the whole pass's time).
  delta = lax.optimization_barrier(delta).transpose(0, 2, 1)
  lse2 = lse.astype(jnp.float32).transpose(0, 2, 1)
  attended = lse2 != -jnp.inf  # NaN (a row that saw a NaN) stays NaN: NaN gradients, as jax.nn's
  lse2 = jnp.where(attended, lse2 * LOG2_E, jnp.inf)
  delta = jnp.where(attended, delta, 0.)  # whatever d_out holds on rows that attend to nothing

  group = num_heads // num_kv_heads
  head_dim_padded = configs.padded_head_dim(head_dim)
  approx = APPROX_EXP2 and not use_interpret(interpret)
  scales = jnp.stack([score_mods.score_scale(mods, scale), jnp.asarray(scale, jnp.float32)])
  if mask is not None:
    mask = mask.astype(jnp.int8)  # a byte a flag, as the forward
  common = dict(mods=mods, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv, approx_exp2=approx)
  # Work: the forward's count of visited blocks is an upper bound here too.
  pairs = batch * num_heads * seq_q * seq_kv * (0.5 if mods.is_causal else 1.)

  def launch(kernel, grid, operands, out_shape, out_specs, *, num_warps, flops, nbytes, name):
    names = [n for n, (x, _) in operands.items() if x is not None]

    def with_optional_refs(*refs):
      given = dict(zip(names, refs))
      results = list(refs[len(names):])
      results += [None] * (len(out_shape) - len(results))
      kernel(*(given.get(n) for n in operands), *results)

    inputs = [operands[n][0] for n in names]
    present = [i for i, s in enumerate(out_shape) if s is not None]
    with quiet():
      results = pl.pallas_call(
          with_optional_refs,
          grid=grid,
          in_specs=[operands[n][1] for n in names],
          out_specs=[out_specs[i] for i in present],
          out_shape=[result_struct(*out_shape[i], *inputs) for i in present],
          compiler_params=CompilerParams(num_warps=num_warps, num_stages=config.num_stages),
          cost_estimate=pl.CostEstimate(flops=int(flops * pairs * head_dim),
                                        transcendentals=int(pairs), bytes_accessed=int(nbytes)),
          interpret=use_interpret(interpret),
          name=name,
      )(*inputs)
    full = [None] * len(out_shape)
    for i, r in zip(present, results):
      full[i] = r
    return full

  # dK/dV: block_k keys resident, block_q query rows streamed, grid (KV block, KV head,
  # sequence). Under a causal mask the first key blocks have the most rows to see: they
  # start first.
  block_k = block_size(config.block_k, seq_kv)
  block_q = block_size(config.block_q, seq_q)
  num_kv_blocks = pl.cdiv(seq_kv, block_k)
  # The dK/dV grid has only B * K * S / block_k programs (the GQA group is summed inside):
  # where that leaves SMs idle, each key block's query range is split over q_splits
  # programs whose float32 partial dK/dV are summed below, in a fixed order.
  q_splits = configs.backward_q_splits(config, batch * num_kv_heads * num_kv_blocks,
                                       pl.cdiv(seq_q, block_q))
  length_spec = pl.BlockSpec((None,), lambda p, h, b: (b,))
  bias_spec, bias_layout = (None, None) if bias is None else _grouped_spec(bias, group, q_splits)
  mask_spec, mask_layout = (None, None) if mask is None else _grouped_spec(mask, group, q_splits)
  group_spec = pl.BlockSpec((None, seq_q, group, head_dim_padded), lambda p, h, b: (b, 0, h, 0))
  row_spec = pl.BlockSpec((None, group, seq_q), lambda p, h, b: (b, h, 0))
  key_spec = pl.BlockSpec((None, block_k, None, head_dim_padded),
                          lambda p, h, b: (b, lax.div(p, q_splits), h, 0))
  if q_splits == 1:
    grad_shapes = [(key.shape, key.dtype), (value.shape, value.dtype)]
    grad_spec = key_spec
  else:
    grad_shapes = [((q_splits, *key.shape), jnp.float32)] * 2
    grad_spec = pl.BlockSpec((None, None, block_k, None, head_dim_padded),
                             lambda p, h, b: (lax.rem(p, q_splits), b, lax.div(p, q_splits), h, 0))
  dk, dv = launch(
      functools.partial(_dkdv_kernel, bias_layout=bias_layout, mask_layout=mask_layout,
                        block_q=block_q, block_k=block_k, group=group, q_splits=q_splits, **common),
      (num_kv_blocks * q_splits, num_kv_heads, batch),
      dict(q_lengths=(q_lengths, length_spec), kv_lengths=(kv_lengths, length_spec),
           scale=(scales, pl.BlockSpec((2,), lambda p, h, b: (0,))),
           bias=(bias, bias_spec and bias_spec(block_k)), mask=(mask, mask_spec and mask_spec(block_k)),
           segment_ids=(segment_ids, pl.BlockSpec((None, seq_q), lambda p, h, b: (b, 0))),
           kv_segment_ids=(kv_segment_ids, pl.BlockSpec((None, block_k),
                                                        lambda p, h, b: (b, lax.div(p, q_splits)))),
           segment_spans=(None if segment_ids is None
                          else segments.block_spans(kv_segment_ids, segment_ids, block_k, block_q),
                          pl.BlockSpec((None, None, 2), lambda p, h, b: (b, lax.div(p, q_splits), 0))),
           query=(query, group_spec), d_out=(d_out, group_spec), lse=(lse2, row_spec),
           delta=(delta, row_spec), key=(key, key_spec), value=(value, key_spec)),
      grad_shapes, [grad_spec, grad_spec],
      num_warps=config.num_warps, flops=8, nbytes=2 * query.nbytes + 4 * key.nbytes,
      name="jaxflash_prefill_dkdv")
  if q_splits > 1:
    dk, dv = jnp.sum(dk, axis=0).astype(key.dtype), jnp.sum(dv, axis=0).astype(value.dtype)

  # dQ: config.dq_tiles (default: the dK/dV tiles swapped, block_k rows, block_q keys).
  dq_rows, dq_keys = config.dq_tiles
  dq_block_q = block_size(dq_rows, seq_q)
  dq_block_k = block_size(dq_keys, seq_kv)
  num_q_blocks = pl.cdiv(seq_q, dq_block_q)
  # A query tile shrunk for a short sequence has too few rows to share among 8 warps.
  dq_warps = config.num_warps if dq_block_q == dq_rows else min(config.num_warps, 4)

  def q_index(n, i, b):
    return b, num_q_blocks - 1 - i, n, 0

  def kv_index(n, i, b):
    del i
    return b, 0, lax.div(n, group), 0

  length_spec = pl.BlockSpec((None,), lambda n, i, b: (b,))
  q_spec = pl.BlockSpec((None, dq_block_q, None, head_dim_padded), q_index)
  vec_spec = pl.BlockSpec((None, None, dq_block_q), lambda n, i, b: (b, n, num_q_blocks - 1 - i))
  kv_spec = pl.BlockSpec((None, seq_kv, None, head_dim_padded), kv_index)
  ds_spec = pl.BlockSpec((None, None, dq_block_q, seq_kv), lambda n, i, b: (b, n, num_q_blocks - 1 - i, 0))
  bias_spec, bias_layout = (None, None) if bias is None else operand_spec(bias, dq_block_q, num_q_blocks)
  mask_spec, mask_layout = (None, None) if mask is None else operand_spec(mask, dq_block_q, num_q_blocks)
  ds_shape = None if bias is None else ((batch, num_heads, seq_q, seq_kv), jnp.float32)
  dq, ds = launch(
      functools.partial(_dq_kernel, bias_layout=bias_layout, mask_layout=mask_layout,
                        block_q=dq_block_q, block_k=dq_block_k, num_q_blocks=num_q_blocks, **common),
      (num_heads, num_q_blocks, batch),
      dict(q_lengths=(q_lengths, length_spec), kv_lengths=(kv_lengths, length_spec),
           scale=(scales, pl.BlockSpec((2,), lambda n, i, b: (0,))),
           bias=(bias, bias_spec), mask=(mask, mask_spec),
           segment_ids=(segment_ids, pl.BlockSpec((None, dq_block_q),
                                                  lambda n, i, b: (b, num_q_blocks - 1 - i))),
           kv_segment_ids=(kv_segment_ids, pl.BlockSpec((None, seq_kv), lambda n, i, b: (b, 0))),
           segment_spans=(None if segment_ids is None
                          else segments.block_spans(segment_ids, kv_segment_ids, dq_block_q, dq_block_k),
                          pl.BlockSpec((None, None, 2), lambda n, i, b: (b, num_q_blocks - 1 - i, 0))),
           query=(query, q_spec), d_out=(d_out, q_spec), lse=(lse2, vec_spec),
           delta=(delta, vec_spec), key=(key, kv_spec), value=(value, kv_spec)),
      [(query.shape, query.dtype), ds_shape], [q_spec, ds_spec],
      num_warps=dq_warps, flops=6, nbytes=3 * query.nbytes + 2 * key.nbytes,
      name="jaxflash_prefill_dq")
  return dq, dk, dv, ds


def _reference_grads(query, key, value, q_lengths, kv_lengths, d_out, d_lse, *, bias, mask, sinks,
                     scale, mods: ScoreMods, segment_ids=None, kv_segment_ids=None):
  """backward_kernels' results by differentiating the plain-JAX reference (the bias taken
  at full size [B, N, T, S], so its gradient is ds itself)."""
  scores_shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
  full_bias = None if bias is None else jnp.broadcast_to(bias.astype(jnp.float32), scores_shape)

  def forward(q, k, v, bias):
    return attention_reference(
        q, k, v, bias, mask, scale=scale, is_causal=mods.is_causal, query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths, local_window_size=mods.window,
        logits_soft_cap=mods.logits_soft_cap, sinks=sinks, causal_alignment=mods.causal_alignment,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)

  (out, lse), vjp = jax.vjp(forward, query, key, value, full_bias)
  d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse.astype(lse.dtype)
  return vjp((d_out.astype(out.dtype), d_lse))


@functools.partial(jax.jit, static_argnames=("is_causal", "local_window_size", "logits_soft_cap",
                                             "causal_alignment", "config", "interpret"))
def prefill_backward(query, key, value, out, lse, d_out, d_lse=None, query_seq_lengths=None,
                     key_value_seq_lengths=None, *, bias=None, mask=None, sinks=None, scale=None,
                     is_causal=False, local_window_size=None, logits_soft_cap=None,
                     causal_alignment="bottom_right", segment_ids=None, kv_segment_ids=None,
                     config: BackwardConfig | None = None, interpret: bool | None = None):
  """Gradients of `prefill_attention` (FlashAttention-2, Algorithm 2), the same options.

  query [B, T, N, H]; key, value [B, S, K, H]; out [B, T, N, H] and lse [B, T, N] (natural
  log, float32) from the forward; d_out [B, T, N, H]; d_lse [B, T, N] or None (the LSE's
  cotangent: it adds -d_lse to delta); lengths int [B] or None. Returns a dict with dq
  [B, T, N, H], dk and dv [B, S, K, H] in the inputs' dtypes, and d_bias (the bias's
  shape), d_sinks [N] and d_scale [] where those options are given.

  config: tiles, warps and stages (default: `jaxflash.backward_config(H, dtype)`).
  """
  _checks.check_qkv(query, key, value)
  batch, seq_q, num_heads, head_dim = query.shape
  _checks.check_same_batch(query, key)
  for name, x, shape in (("out", out, query.shape), ("d_out", d_out, query.shape),
                         ("lse", lse, query.shape[:3]), ("d_lse", d_lse, query.shape[:3])):
    if x is not None and tuple(x.shape) != tuple(shape):
      raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  scores_shape = (batch, num_heads, seq_q, key.shape[1])
  user_bias = bias
  bias = _checks.check_bias(bias, scores_shape)
  mask = _checks.check_mask(mask, scores_shape)
  sinks = _checks.check_sinks(sinks, num_heads)
  segment_ids, kv_segment_ids = segments.check_segment_ids(segment_ids, kv_segment_ids, batch, seq_q,
                                                           key.shape[1])
  mods = ScoreMods.from_options(is_causal=is_causal, causal_alignment=causal_alignment,
                                local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
  scale = _checks.scale_operand(scale, head_dim)
  config = resolve_config(config, head_dim, jnp.promote_types(query.dtype, key.dtype))
  dq, dk, dv, ds = backward_kernels(query, key, value, q_lengths, kv_lengths, out, lse, d_out, d_lse,
                                    bias=bias, mask=mask, scale=scale, mods=mods, config=config,
                                    interpret=interpret, sinks=sinks, segment_ids=segment_ids,
                                    kv_segment_ids=kv_segment_ids)
  d_bias, d_sinks, d_scale = option_grads(query, dq, lse, (out, d_out, d_lse), bias=bias,
                                          sinks=sinks, scale=scale, ds=ds)
  grads = dict(dq=dq, dk=dk, dv=dv, d_scale=d_scale)
  if bias is not None:
    grads["d_bias"] = d_bias.reshape(user_bias.shape)
  if sinks is not None:
    grads["d_sinks"] = d_sinks
  return grads


def prefill_backward_reference(query, key, value, d_out, query_seq_lengths=None,
                               key_value_seq_lengths=None, *, bias=None, mask=None, sinks=None,
                               scale=None, is_causal=False, local_window_size=None,
                               logits_soft_cap=None, causal_alignment="bottom_right"):
  """`prefill_backward`'s (dq, dk, dv) by differentiating the plain-JAX reference."""
  scale = _checks.default_scale(scale, query.shape[-1])

  def forward(q, k, v):
    return attention_reference(q, k, v, bias, mask, scale=scale, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               local_window_size=window_size(local_window_size),
                               logits_soft_cap=logits_soft_cap, sinks=sinks,
                               causal_alignment=causal_alignment)[0]

  _, vjp = jax.vjp(forward, query, key, value)
  return vjp(d_out.astype(query.dtype))
