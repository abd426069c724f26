"""FlashAttention backward for Hopper (sm_90), in Pallas Mosaic GPU.

The gradients of the Mosaic prefill (jaxflash/mosaic/forward.py), from its residuals: the
output O and the natural-log LSE. With P = exp(scale * Q K^T - LSE) and delta = rowsum(dO * O)
(FlashAttention-2, Dao 2023, section 3.2; Algorithm 2):

    dV = P^T dO      dP = dO V^T      dS = P * (dP - delta)
    dK = scale dS^T Q                 dQ = scale dS K

Three launches, as FlashAttention-3 (Shah et al., 2024, arXiv 2407.08608) builds its sm_90
backward, except that dQ has a kernel of its own instead of float32 atomics:

* the preprocess (plain XLA, fused): delta in float32 and the LSE in base 2, both
  transposed to [B, N, T] so a tile's rows are one contiguous TMA copy. Rows with nothing to
  attend (LSE -inf) and padding rows get an LSE of +inf, so their P is exactly 0 without a
  mask in the kernels;
* dK/dV: one CTA per (block of keys, part of a KV head's group of query heads, sequence).
  Each of two consumer warpgroups owns `block_kv` keys (H = 256: below) and keeps its dK and
  dV in float32 registers for the whole loop, as FlashAttention-2's Algorithm 2 keeps them on
  chip; a producer warpgroup streams the query blocks (Q, dO, LSE, delta) through a
  `num_stages` ring of shared memory with TMA, for every query head of its part in turn, so
  GQA's sum over the part happens in the registers. Written transposed:
  S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T, dK += dS^T Q, all wgmma with P^T and
  dS^T straight from registers. The parts (`head_splits`) write float32 partial sums that
  XLA adds in a fixed order: with few key blocks (B = 1, S = 4K: 32 blocks x 2 KV heads for
  132 SMs) or a causal mask (the first key block sees every query, the last one 128) one part
  per group would leave SMs idle, as FlashAttention-2 (Dao 2023, section 3.2) splits work
  over the sequence for the same reason;
* dQ: one CTA per (block of queries, query head, sequence), two consumer warpgroups of
  `block_q` rows each, the producer streaming K and V: S = Q K^T, P, dP = dO V^T, dS,
  dQ += dS K. dS enters that product in float16 (11 significant bits to bfloat16's 8), Q, K
  and dS scaled by powers of two into float16's range (`mosaic.float16_dq`): on rows where one
  key dominates, dS's bfloat16 rounding set dQ's largest error.

This recomputes S and dP once more than a single kernel that adds dQ into float32 global
memory with atomics (seven matrix products a block instead of five; Tri Dao on the 5-GEMM and
7-GEMM forms, flash-attention issue #1172), and in exchange is deterministic: every element is
summed in one fixed order, so repeated calls give bitwise-equal gradients. The five-product
form has measured slower than these two kernels here (bench/PERFORMANCE.md, Mosaic backward).

Causal attention and sliding windows are loop bounds (`score_mods.query_blocks` and
`key_blocks`, the forward's rule seen from either side): a key block's CTA runs only the query
blocks with a row that sees one of its keys, a query block's CTA only the key blocks one of its
rows sees, and only the blocks that straddle the diagonal, a window edge or the end of the keys
run the mask. The bounds come from the per-sequence lengths in the kernel (data: no
recompiles). Query t sits at key position t + kv_len - q_len (bottom-right), as in the
forward. Packed documents (segment ids) narrow both kernels' loops the same way, by each
block's id range (`mosaic.segments.block_ranges`, per query block for dQ and per key block
for dK/dV), and compare ids only in the blocks that run the mask.

At H = 256 the dK/dV kernel's layout changes (`shares_keys`). dK and dV of 64 keys in
float32 are 64 x H x 2 x 4 bytes over a warpgroup's 128 threads, H registers a thread, and a
consumer gets 232 beside the producer; with its two 64 x 64 score tiles (32 each) that is 192
at H = 128 but 320 at H = 256. So there both consumers of a CTA work on the same 64 keys,
each keeping half of dK's and dV's columns (128 registers for the two halves, as at
H = 128). Each computes the whole S^T and dP^T itself, since they contract over every
column, then dV += P^T dO and dK += dS^T Q for its half from column slices of the shared
tiles: six products a block instead of four, and each consumer's loop stays the one above
(splitting S^T and dP^T between the consumers would do no product twice, but trade P^T and
dS^T through shared memory). Shared memory then holds K and V (64 KB), two Q/dO ring slots
(128 KB), the float32 staging tiles of the way out (32 columns a copy: 16 KB) and the LSE and
delta: 210 KB of the 227 KB. The dQ kernel keeps its layout (dQ [64, 256] in float32 is 128
registers), but its two consumers' own Q and dO rows take 128 KB, which leaves room for one
K/V ring slot (`MosaicBackwardConfig.dq_stages`): the producer loads a key block once both
consumers are done with the one before.

Layout: query [B, T, N, H], key/value [B, S, K, H]; H = 64, 128 or 256; bf16 or fp16. T and
S are padded with zeros outside the kernels to whole tiles; with lengths, rows and keys past
each sequence's lengths are zeroed first (TMA copies whole tiles, and 0 * NaN is NaN).
"""
from __future__ import annotations

import functools
import inspect

import jax
from jax import lax
import jax.numpy as jnp

from jaxflash import _checks, _mosaic
from jaxflash._mosaic import LOG2_E, pl, plgpu
from jaxflash.device import device_info
# Shared with the forward (the register split between producer and consumers, the tile
# swizzle, the dtypes).
from jaxflash.mosaic.backward_config import (HEAD_DIMS, NUM_CONSUMERS, MosaicBackwardConfig,
                                              cta_key_tiles, cta_keys, head_splits,
                                              mosaic_backward_config, out_columns, shares_keys)
from jaxflash.mosaic.config import DTYPES, SWIZZLE_BYTES, registers, round_up
from jaxflash.mosaic.float16_dq import float16_dq_operands
from jaxflash.mosaic.mask import KeyMask, iota
from jaxflash.mosaic.pipeline import KeyBlocks, QueryBlocks
from jaxflash.mosaic.segments import Segments, block_ranges, check_segment_ids, pad_ids
from jaxflash.score_mods import ScoreMods, window_size

def _swizzled(itemsize: int = 2):
  return dict(transforms=(plgpu.TilingTransform((8, SWIZZLE_BYTES // itemsize)),
                          plgpu.SwizzleTransform(SWIZZLE_BYTES)))


def _load_rows(ref, layout):
  """A [rows] float32 SMEM vector into registers in `layout`. JAX 0.10 spells the load
  `load(ref, idx, layout=)`, later versions `load(ref, layout=)`."""
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _dkdv_kernel(
    q_len_ref,  # [B] int32 GMEM
    kv_len_ref,  # [B] int32 GMEM
    q_ref,  # [B, T_pad, N, H] GMEM
    k_ref,  # [B, S_pad, K, H] GMEM
    v_ref,  # [B, S_pad, K, H] GMEM
    do_ref,  # [B, T_pad, N, H] GMEM
    lse_ref,  # [B, N, T_pad] float32 GMEM: base-2 LSE, +inf on rows that attend nothing
    delta_ref,  # [B, N, T_pad] float32 GMEM
    dk_ref,  # [splits * B, S_pad, K, H] float32 GMEM: each part's partial sum
    dv_ref,  # [splits * B, S_pad, K, H] float32 GMEM
    k_smem, v_smem,  # [tiles * block_kv, H] SMEM: each consumer's own keys and values, or
                     # (one tile, H > 128) the keys both consumers share
    q_smem, do_smem,  # [stages, block_q, H] SMEM ring
    lse_smem, delta_smem,  # [stages, block_q] float32 SMEM ring
    out_smem,  # [2, block_kv, C] float32 SMEM: each consumer's dK and dV on their way out
    k_loaded, v_loaded,  # [tiles] barriers: a K / V tile landed
    q_ready, do_ready, lse_ready, delta_ready,  # [stages] barriers: a slot's TMA landed
    slot_free,  # [stages] barriers, 2 arrivals: both consumers are done with a slot
    *, segment_refs=None,  # packed documents: (q_ids [B, T_pad], kv_ids [B, S_pad], the
                           # dQ kernel's ranges, this kernel's [B, S_pad // block_kv, 4]) int32
    qk_scale: float, scale: float, mods: ScoreMods, block_q: int, block_kv: int,
    num_stages: int, seq_q: int, seq_kv: int, group: int, splits: int,
):
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]
  shared_keys, key_tiles = shares_keys(head_dim), cta_key_tiles(head_dim)
  wg = lax.axis_index("wg")
  part, kv_tile, batch = (lax.axis_index(n) for n in ("part", "kv_tile", "batch"))
  kv_head, split = lax.div(part, splits), lax.rem(part, splits)
  heads = group // splits  # query heads of this part: kv_head * group + split * heads + [0, heads)
  first_head = kv_head * group + split * heads
  cta_base = kv_tile * (key_tiles * block_kv)
  # The keys' view of the segment ids: its "rows" are keys, its "keys" query rows.
  segments = None if segment_refs is None else Segments(
      segment_refs[1], segment_refs[0], segment_refs[3], block_kv, block_q)
  blocks = QueryBlocks(q_len_ref, kv_len_ref, mods, block_q, block_kv, seq_q, seq_kv,
                       key_tiles, segments)
  _, kv_valid, shift = blocks.lengths(batch)
  # Query blocks [lo, hi) hold a row that sees one of this CTA's valid keys (the causal
  # diagonal, a window and the documents bound them).
  lo, hi = blocks.of_tile(batch, kv_tile)
  count = hi - lo  # query blocks per query head of the group
  consumer_registers, producer_registers = registers(NUM_CONSUMERS)

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    if shared_keys:  # both consumers on the CTA's one tile, each with half of the columns
      tile, k_base, k_tile, v_tile = 0, cta_base, k_smem, v_smem
      columns = head_dim // NUM_CONSUMERS
      first_column = wg * columns
      own_columns = lambda ref: ref.at[:, pl.ds(first_column, columns)]
    else:
      own = pl.ds(wg * block_kv, block_kv)
      tile, k_base, k_tile, v_tile = wg, cta_base + wg * block_kv, k_smem.at[own], v_smem.at[own]
      columns, first_column, own_columns = head_dim, 0, lambda ref: ref
    keys = (batch, pl.ds(k_base, block_kv), kv_head)

    def load_keys():
      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_tile, k_loaded.at[tile])
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_tile, v_loaded.at[tile])

    if shared_keys:
      pl.when(wg == 0)(load_keys)  # one copy of each, both consumers wait for it
    else:
      load_keys()
    # Every row of the query blocks [full_lo, full_hi) sees all of this consumer's keys: no
    # mask there. The rest of the CTA's [lo, hi) runs masked: both consumers take every slot
    # the producer fills.
    _, full_lo, full_hi, _ = blocks.of_keys(batch, k_base)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    key_ids = None if segments is None else segments.row_ids(batch, k_base)  # [block_kv]

    def visible_t(i):
      """[block_kv, block_q] bool: key k_base + r seen by row i * block_q + c (`KeyMask`
      transposed: p - left <= s <= p + right and s < kv_valid, p = t + shift, and with
      segments the same document)."""
      shape = (block_kv, block_q)
      keys = iota(shape, 0) + k_base
      positions = iota(shape, 1) + (i * block_q + shift)
      ok = keys < kv_valid
      if mods.right is not None:
        ok &= keys <= positions + mods.right
      if mods.left is not None:
        ok &= keys >= positions - mods.left
      if segments is not None:
        ok &= (lax.broadcast_in_dim(key_ids, shape, [0])
               == lax.broadcast_in_dim(segments.key_ids(batch, i), shape, [1]))
      return ok

    zero_scores = plgpu.layout_cast(jnp.zeros((block_kv, block_q), jnp.float32), plgpu.Layout.WGMMA)

    def step(i, carry, *, head_step, masked: bool):
      dk, dv = carry  # [block_kv, columns] float32 each
      slot = lax.rem(head_step * count + i - lo, num_stages)
      q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
      for ready in (q_ready, do_ready, lse_ready, delta_ready):
        plgpu.barrier_wait(ready.at[slot])

      def body(refs):
        s_ref, dp_ref, dv_ref_, dk_ref_ = refs
        # S^T and dP^T contract over every column: with shared keys both consumers compute
        # the same ones (six products a block instead of four).
        plgpu.wgmma(s_ref, k_tile, q_tile.T)  # S^T = K Q^T
        # dP^T needs no P: it runs on the tensor cores while the exponentials below do, as
        # FlashAttention-3 overlaps its softmax with the next product.
        plgpu.wgmma(dp_ref, v_tile, do_tile.T)  # dP^T = V dO^T
        s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S^T landed, dP^T may still run
        lse = _load_rows(lse_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
        p_t = jnp.exp2(s_t * qk_scale - lax.broadcast_in_dim(lse, s_t.shape, [1]))
        if masked:
          p_t = jnp.where(visible_t(i), p_t, 0.0)
        p_t = lax.optimization_barrier(p_t)  # the exponentials stay ahead of the wait for dP^T
        dp_t = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)
        delta = _load_rows(delta_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
        ds_t = (p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))).astype(dtype)
        # Both products read their left operand from registers, so nothing is written to
        # registers until they complete (the end of this scope waits for them).
        plgpu.wgmma(dv_ref_, p_t.astype(dtype), own_columns(do_tile))  # dV += P^T dO
        plgpu.wgmma(dk_ref_, ds_t, own_columns(q_tile))  # dK += dS^T Q

      _, _, dv, dk = pl.run_state(body)(
          (plgpu.ACC.init(zero_scores), plgpu.ACC.init(zero_scores), plgpu.ACC.init(dv),
           plgpu.ACC.init(dk)))
      plgpu.barrier_arrive(slot_free.at[slot])
      return dk, dv

    def head_loop(head_step, carry):
      masked = functools.partial(step, head_step=head_step, masked=True)
      whole = functools.partial(step, head_step=head_step, masked=False)
      carry = lax.fori_loop(lo, full_lo, masked, carry)
      carry = lax.fori_loop(full_lo, full_hi, whole, carry)
      return lax.fori_loop(full_hi, hi, masked, carry)

    zeros = plgpu.layout_cast(jnp.zeros((block_kv, columns), jnp.float32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(k_loaded.at[tile])
    plgpu.barrier_wait(v_loaded.at[tile])
    dk, dv = lax.fori_loop(0, heads, head_loop, (zeros, zeros))
    partial = (split * q_ref.shape[0] + batch, pl.ds(k_base, block_kv), kv_head)
    width = out_smem.shape[-1]
    for result, result_ref in ((dk * scale, dk_ref), (dv, dv_ref)):
      for c in range(columns // width):  # `width` columns a copy, through the staging tile
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile's last copy has read it
        out_smem[wg] = result[:, c * width:(c + 1) * width]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                result_ref.at[(*partial, pl.ds(first_column + c * width, width))])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")

    @pl.loop(0, heads)
    def _(head_step):
      head = first_head + head_step

      @pl.loop(0, count)
      def _(j):
        load = head_step * count + j
        slot = lax.rem(load, num_stages)
        rows = pl.ds((lo + j) * block_q, block_q)
        pl.when(load >= num_stages)(lambda: plgpu.barrier_wait(slot_free.at[slot]))
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[slot], q_ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem.at[slot],
                                lse_ready.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[slot], do_ready.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_smem.at[slot],
                                delta_ready.at[slot])


def _dq_kernel(
    q_len_ref,  # [B] int32 GMEM
    kv_len_ref,  # [B] int32 GMEM
    q_ref,  # [B, T_pad, N, H] float16 GMEM: Q 2^-a (mosaic.float16_dq, as are k, lse, scales)
    k_ref,  # [B, S_pad, K, H] float16 GMEM: K 2^-e
    v_ref,  # [B, S_pad, K, H] GMEM
    do_ref,  # [B, T_pad, N, H] GMEM
    lse_ref,  # [B, N, T_pad] float32 GMEM: base-2 LSE - r, +inf on rows that attend nothing
    delta_ref,  # [B, N, T_pad] float32 GMEM
    score_scale_ref,  # [B, N, T_pad] float32 GMEM: what turns Q16 K16^T into base-2 scores
    out_scale_ref,  # [B, N, T_pad] float32 GMEM: what turns the sums of dS 2^r K16 into dQ
    dq_ref,  # [B, T_pad, N, H] GMEM, dO's dtype
    q_smem, do_smem,  # [2, block_q, H] SMEM: each consumer's own rows
    lse_smem, delta_smem, score_scale_smem, out_scale_smem,  # [2, block_q] float32 SMEM
    k_smem, v_smem,  # [stages, block_kv, H] SMEM ring
    rows_loaded,  # [6 * 2] barriers: a consumer's Q, dO and four row vectors landed
    k_ready, v_ready,  # [stages] barriers
    slot_free,  # [stages] barriers, 2 arrivals
    *, segment_refs=None,  # as the dK/dV kernel's
    mods: ScoreMods, block_q: int, block_kv: int, num_stages: int, seq_q: int, seq_kv: int,
    group: int, num_q_tiles: int,
):
  dtype = do_ref.dtype
  head_dim = q_ref.shape[-1]
  wg = lax.axis_index("wg")
  # The longest rows (the last, under the causal mask) launch first.
  tile = num_q_tiles - 1 - lax.axis_index("q_tile")
  head, batch = lax.axis_index("head"), lax.axis_index("batch")
  kv_head = lax.div(head, group)
  cta_base = tile * (NUM_CONSUMERS * block_q)
  segments = None if segment_refs is None else Segments(*segment_refs[:3], block_q, block_kv)
  blocks = KeyBlocks(q_len_ref, kv_len_ref, mods, block_q, block_kv, seq_q, seq_kv, NUM_CONSUMERS,
                     segments)
  # Key blocks [lo, hi) hold a key one of this CTA's valid rows sees (the forward's bounds).
  lo, hi = blocks.of_tile(batch, tile)
  consumer_registers, producer_registers = registers(NUM_CONSUMERS)

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    q_base = cta_base + wg * block_q
    rows = (batch, pl.ds(q_base, block_q), head)
    stats = (batch, head, pl.ds(q_base, block_q))
    q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
    row_vectors = ((lse_ref, lse_smem), (delta_ref, delta_smem),
                   (score_scale_ref, score_scale_smem), (out_scale_ref, out_scale_smem))
    loaded = [rows_loaded.at[NUM_CONSUMERS * n + wg] for n in range(2 + len(row_vectors))]
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_tile, loaded[0])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_tile, loaded[1])
    for (gmem, smem), barrier in zip(row_vectors, loaded[2:]):
      plgpu.copy_gmem_to_smem(gmem.at[stats], smem.at[wg], barrier)
    # Key blocks [full_lo, full_hi) are seen whole by every row of this consumer; the rest
    # of the CTA's [lo, hi) runs masked.
    (_, full_lo, full_hi, _), (_, shift, kv_valid) = blocks.of_rows(batch, q_base)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    mask = KeyMask(mods, block_q, block_kv, segments)
    row_ids = None if segments is None else segments.row_ids(batch, q_base)  # [block_q]

    zero_scores = plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32), plgpu.Layout.WGMMA)

    for barrier in loaded:
      plgpu.barrier_wait(barrier)
    lse, delta, score_scale, out_scale = (_load_rows(smem.at[wg], plgpu.Layout.WGMMA.reduce(1))
                                          for _, smem in row_vectors)

    def step(j, dq, *, masked: bool):
      slot = lax.rem(j - lo, num_stages)
      k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])

      def body(refs):
        s_ref, dp_ref_, dq_ref_ = refs
        plgpu.wgmma(s_ref, q_tile, k_tile.T)  # S 2^-(a+e) = Q16 K16^T
        plgpu.wgmma(dp_ref_, do_tile, v_tile.T)  # dP = dO V^T, beside the exponentials
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
        if masked:  # -inf scores: P = 0 (exp2(-inf - LSE), the LSE finite or +inf)
          s = mask.apply(s, j, q_base, shift, kv_valid, batch, row_ids)
        rows_of = lambda x: lax.broadcast_in_dim(x, s.shape, [0])
        p = jnp.exp2(s * rows_of(score_scale) - rows_of(lse))  # P 2^r
        p = lax.optimization_barrier(p)  # the exponentials stay ahead of the wait for dP
        dp = plgpu.wgmma_accumulator_load(dp_ref_, wait_n=0)
        ds = p * (dp - rows_of(delta))  # dS 2^r, below 2^15
        plgpu.wgmma(dq_ref_, ds.astype(jnp.float16), k_tile)  # dQ 2^(r-e) += dS 2^r K16

      _, _, dq = pl.run_state(body)((plgpu.ACC.init(zero_scores), plgpu.ACC.init(zero_scores),
                                     plgpu.ACC.init(dq)))
      plgpu.barrier_arrive(slot_free.at[slot])
      return dq

    dq = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    masked, whole = (functools.partial(step, masked=m) for m in (True, False))
    dq = lax.fori_loop(lo, full_lo, masked, dq)
    dq = lax.fori_loop(full_lo, full_hi, whole, dq)
    dq = lax.fori_loop(full_hi, hi, masked, dq)
    # dO's tile holds dQ on its way out (the last wgmma reading it has completed).
    do_tile[...] = (dq * lax.broadcast_in_dim(out_scale, dq.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(do_tile, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")

    @pl.loop(lo, hi)
    def _(j):
      slot = lax.rem(j - lo, num_stages)
      keys = (batch, pl.ds(j * block_kv, block_kv), kv_head)
      pl.when(j - lo >= num_stages)(lambda: plgpu.barrier_wait(slot_free.at[slot]))
      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])


def _check_args(query, key, value, out, lse, d_out):
  _checks.check_qkv(query, key, value)
  _checks.check_same_batch(query, key)
  for name, x in (("query", query), ("key", key), ("value", value)):
    if jnp.dtype(x.dtype) not in DTYPES:
      raise TypeError(f"{name} must be bfloat16 or float16 for the Mosaic backward, got "
                      f"{jnp.dtype(x.dtype).name} {tuple(x.shape)}")
  if not query.dtype == key.dtype == value.dtype:
    raise TypeError(f"query, key and value must share one dtype for the Mosaic backward, got "
                    f"{query.dtype}, {key.dtype} and {value.dtype}")
  if query.shape[-1] not in HEAD_DIMS:
    raise ValueError(f"the Mosaic backward takes head dims {HEAD_DIMS}, got query "
                     f"{tuple(query.shape)}")
  if out.shape != query.shape:
    raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")
  if d_out.shape != query.shape:
    raise ValueError(f"d_out must have the query's shape {tuple(query.shape)}, got "
                     f"{tuple(d_out.shape)}")
  if lse.shape != query.shape[:3]:
    raise ValueError(f"lse must be [B, T, N] = {tuple(query.shape[:3])}, got {tuple(lse.shape)}")


def _launch(q_len, kv_len, q, k, v, do, lse2, delta, *segment_arrays,
            config: MosaicBackwardConfig, scale: float, mods: ScoreMods, seq_q: int, seq_kv: int,
            sm_count: int):
  """The two kernels on padded operands (shapes as in `_dkdv_kernel`; segment_arrays: none,
  or its `segment_refs`' arrays) -> padded (dq, dk, dv)."""
  batch, seq_q_pad, num_heads, head_dim = q.shape
  seq_kv_pad, num_kv_heads = k.shape[1], k.shape[2]
  block_q, block_kv = config.block_q, config.block_kv
  swizzled = _swizzled()
  dtype = q.dtype
  group = num_heads // num_kv_heads
  common = dict(qk_scale=scale * LOG2_E, scale=scale, mods=mods, block_q=block_q,
                block_kv=block_kv, seq_q=seq_q, seq_kv=seq_kv, group=group)
  # The segment arrays' refs follow the eight inputs; the kernels take them as `segment_refs`.
  with_segments = functools.partial(_mosaic.with_extra_refs, inputs=8, count=len(segment_arrays),
                                    to_keywords=lambda refs: dict(segment_refs=tuple(refs)))
  params = plgpu.CompilerParams(approx_math=True)
  threads = dict(num_threads=NUM_CONSUMERS + 1, thread_name="wg")
  operands = (q_len, kv_len, q, k, v, do, lse2, delta, *segment_arrays)

  splits = head_splits(k.shape, group, config, causal=mods.is_causal, sm_count=sm_count)
  key_tiles = cta_key_tiles(head_dim)
  owned = plgpu.SMEM((key_tiles * block_kv, head_dim), dtype, **swizzled)
  ring = plgpu.SMEM((config.num_stages, block_q, head_dim), dtype, **swizzled)
  stats_ring = plgpu.SMEM((config.num_stages, block_q), jnp.float32)
  partials_out = plgpu.SMEM((NUM_CONSUMERS, block_kv, out_columns(head_dim)), jnp.float32,
                            **_swizzled(4))
  partials = jax.ShapeDtypeStruct((splits * batch, *k.shape[1:]), jnp.float32)
  scratch = [owned, owned, ring, ring, stats_ring, stats_ring, partials_out,
             plgpu.Barrier(num_barriers=key_tiles),
             plgpu.Barrier(num_barriers=key_tiles),
             *[plgpu.Barrier(num_barriers=config.num_stages)] * 4,
             plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=config.num_stages)]
  dkdv = functools.partial(_dkdv_kernel, splits=splits, num_stages=config.num_stages, **common)
  # Parts vary fastest: the first key blocks, which carry the most queries under the causal
  # mask, launch first.
  grid = dict(grid=(num_kv_heads * splits, seq_kv_pad // cta_keys(head_dim, config), batch),
              grid_names=("part", "kv_tile", "batch"))
  dkdv.__name__ = "mosaic_backward_dkdv"  # the name profiles show
  dk, dv = plgpu.kernel(with_segments(dkdv), out_type=(partials, partials),
                        scratch_types=scratch, compiler_params=params, **grid,
                        **threads)(*operands)
  # The parts' float32 partial sums, added in a fixed order.
  dk, dv = (x.reshape(splits, *k.shape).sum(axis=0).astype(dtype) for x in (dk, dv))

  num_q_tiles = seq_q_pad // (NUM_CONSUMERS * block_q)
  dq_kernel = functools.partial(_dq_kernel, num_q_tiles=num_q_tiles, num_stages=config.dq_stages,
                                **{k: v for k, v in common.items() if "scale" not in k})
  dq_kernel.__name__ = "mosaic_backward_dq"
  # dQ's product takes dS in float16, its operands scaled by powers of two (mosaic.float16_dq).
  f16 = float16_dq_operands(q, k, v, do, lse2, delta, scale=scale)
  f16_ring = plgpu.SMEM((config.dq_stages, block_kv, head_dim), jnp.float16, **swizzled)
  kv_ring = plgpu.SMEM((config.dq_stages, block_kv, head_dim), dtype, **swizzled)
  stats_owned = plgpu.SMEM((NUM_CONSUMERS, block_q), jnp.float32)
  dq_with_segments = functools.partial(_mosaic.with_extra_refs, inputs=10,
                                       count=len(segment_arrays),
                                       to_keywords=lambda refs: dict(segment_refs=tuple(refs)))
  dq = plgpu.kernel(
      dq_with_segments(dq_kernel), out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=[plgpu.SMEM((NUM_CONSUMERS, block_q, head_dim), jnp.float16, **swizzled),
                     plgpu.SMEM((NUM_CONSUMERS, block_q, head_dim), dtype, **swizzled),
                     *[stats_owned] * 4, f16_ring, kv_ring,
                     plgpu.Barrier(num_barriers=6 * NUM_CONSUMERS),
                     plgpu.Barrier(num_barriers=config.dq_stages),
                     plgpu.Barrier(num_barriers=config.dq_stages),
                     plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=config.dq_stages)],
      compiler_params=params, grid=(num_q_tiles, num_heads, batch),
      grid_names=("q_tile", "head", "batch"), **threads)(
          q_len, kv_len, f16.q, f16.k, v, do, f16.lse2, delta, f16.score_scale, f16.out_scale,
          *segment_arrays)
  return dq, dk, dv


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "config"))
def mosaic_backward(query, key, value, out, lse, d_out, q_lengths=None, kv_lengths=None, *,
                    scale=None, causal: bool = False, window=None, segment_ids=None,
                    kv_segment_ids=None, d_lse=None, config: MosaicBackwardConfig | None = None):
  """Gradients (dq [B, T, N, H], dk, dv [B, S, K, H], in the inputs' dtype) of
  `jaxflash.mosaic.prefill_attention` on sm_90.

  query [B, T, N, H], key/value [B, S, K, H] (N a multiple of K; H 64, 128 or 256; bf16 or
  fp16);
  out [B, T, N, H] and lse [B, T, N] (natural log) the forward's residuals; d_out the
  output's cotangent, d_lse (optional, [B, T, N]) the LSE's. q_lengths, kv_lengths: optional
  int [B], bottom-right alignment as in the forward. dK/dV are summed over each KV head's
  group of query heads inside the kernel. Deterministic (no atomics).

  window: the forward's `local_window_size` (w or (left, right)), as there: row t at key
  position p sees keys p - left ... p + right. segment_ids [B, T] and kv_segment_ids [B, S]
  (int; the latter defaults to the former when T == S): packed documents, as in the forward.
  """
  mods = ScoreMods(is_causal=bool(causal), window=window_size(window))
  _check_args(query, key, value, out, lse, d_out)
  q_ids, kv_ids = check_segment_ids(segment_ids, kv_segment_ids, query.shape[0], query.shape[1],
                                    key.shape[1])
  if not _mosaic.AVAILABLE:
    raise NotImplementedError(f"Pallas Mosaic GPU does not import here: {_mosaic.IMPORT_ERROR}")
  batch, seq_q, num_heads, head_dim = query.shape
  seq_kv = key.shape[1]
  q_lengths = _checks.check_lengths("q_lengths", q_lengths, batch)
  kv_lengths = _checks.check_lengths("kv_lengths", kv_lengths, batch)
  scale = _checks.default_scale(scale, head_dim)
  if not isinstance(scale, float):
    raise TypeError("the Mosaic backward takes a static float scale")
  config = config or mosaic_backward_config(head_dim, query.dtype)
  if 0 in (batch, seq_q, num_heads) or seq_kv == 0:
    return jnp.zeros_like(query), jnp.zeros_like(key), jnp.zeros_like(value)
  if not _mosaic.on_gpu():
    raise NotImplementedError(_mosaic.INTERPRET_GAPS)

  info = device_info()
  need = config.smem_bytes(head_dim, jnp.dtype(query.dtype).itemsize)
  if need > info.smem_per_block:
    raise ValueError(f"config {config} needs {need} bytes of shared memory at head dim "
                     f"{head_dim} (query {tuple(query.shape)}), over the {info.smem_per_block} "
                     f"of a block on {info.name}")
  block_q, block_kv = config.block_q, config.block_kv
  seq_q_pad = round_up(seq_q, NUM_CONSUMERS * block_q)
  seq_kv_pad = round_up(seq_kv, cta_keys(head_dim, config))  # whole dK/dV CTAs
  q_len = jnp.full((batch,), seq_q, jnp.int32) if q_lengths is None else q_lengths
  kv_len = jnp.full((batch,), seq_kv, jnp.int32) if kv_lengths is None else kv_lengths

  # The preprocess. delta = rowsum(dO * O) (minus the LSE's cotangent), and the LSE in base 2;
  # rows that attend nothing (LSE -inf, padding included) get +inf there, so P = 0, and
  # delta 0. NaN stays NaN.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  lse = lse.astype(jnp.float32)
  empty = lse == -jnp.inf
  if q_lengths is not None:
    empty |= (jnp.arange(seq_q)[None, :] >= q_lengths[:, None])[:, :, None]
  lse2 = jnp.where(empty, jnp.inf, lse * LOG2_E)
  delta = jnp.where(empty, 0.0, delta)
  row_pad = ((0, 0), (0, seq_q_pad - seq_q), (0, 0))
  lse2 = jnp.pad(lse2, row_pad, constant_values=jnp.inf).transpose(0, 2, 1)  # [B, N, T_pad]
  delta = jnp.pad(delta, row_pad).transpose(0, 2, 1)  # [B, N, T_pad]
  q, do = query, d_out.astype(query.dtype)
  if q_lengths is not None:
    # TMA copies whole tiles: rows past a sequence's length reach the tensor cores as they
    # are, and 0 * NaN is NaN.
    rows_ok = (jnp.arange(seq_q)[None, :] < q_lengths[:, None])[:, :, None, None]
    q, do = jnp.where(rows_ok, q, 0), jnp.where(rows_ok, do, 0)
  k, v = key, value
  if kv_lengths is not None:
    keys_ok = (jnp.arange(seq_kv)[None, :] < kv_lengths[:, None])[:, :, None, None]
    k, v = jnp.where(keys_ok, k, 0), jnp.where(keys_ok, v, 0)
  pad4 = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))
  q, do, k, v = pad4(q, seq_q_pad), pad4(do, seq_q_pad), pad4(k, seq_kv_pad), pad4(v, seq_kv_pad)
  segment_arrays = ()
  if q_ids is not None:
    # Per query block the key blocks whose ids may meet (dQ), per key block the query blocks
    # (dK/dV): `segments.block_ranges` from either side.
    q_ids, kv_ids = pad_ids(q_ids, seq_q_pad), pad_ids(kv_ids, seq_kv_pad)
    segment_arrays = (q_ids, kv_ids, block_ranges(q_ids, kv_ids, block_q, block_kv),
                      block_ranges(kv_ids, q_ids, block_kv, block_q))

  launch = functools.partial(_launch, config=config, scale=scale, mods=mods, seq_q=seq_q,
                             seq_kv=seq_kv, sm_count=info.sm_count)

  @jax.custom_batching.custom_vmap
  def run_kernels(*operands):
    return launch(*operands)

  @run_kernels.def_vmap
  def _vmap_rule(axis_size, in_batched, *operands):
    # Under jax.vmap the mapped axis joins the batch (one launch, not one per problem).
    operands = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, batched in zip(operands, in_batched)]
    grads = launch(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in operands))
    unfold = lambda x: x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])
    return tuple(unfold(g) for g in grads), (True, True, True)

  dq, dk, dv = run_kernels(q_len, kv_len, q, k, v, do, lse2, delta, *segment_arrays)
  return dq[:, :seq_q], dk[:, :seq_kv], dv[:, :seq_kv]


__all__ = ["mosaic_backward"]
