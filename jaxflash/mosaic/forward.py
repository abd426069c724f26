"""FlashAttention-3 style prefill (causal or not) for Hopper, in Pallas Mosaic GPU.

Same function as `jaxflash.prefill_attention` (the Pallas-Triton FlashAttention-2 kernel),
built the way FlashAttention-3 (Shah et al., 2024, arXiv 2407.08608) builds it for sm_90:

* Warp specialisation. A CTA holds two consumer warpgroups (three for long sequences at
  d = 64), each owning `block_q` query rows, and one producer that only issues TMA copies of
  K and V tiles into a shared-memory ring (pipeline.KVRing). The producer gives its registers
  away (setmaxnreg) so the consumers can hold a 64 x 128 float32 accumulator and a
  64 x block_kv score tile each.
* wgmma for both products: S = Q K^T from shared memory into float32 registers, O += P V
  with P (bf16/fp16) straight from registers.
* Ping-pong (section 3.1): the consumers take turns on the tensor cores (pipeline.TurnOrder):
  while one runs its softmax on the CUDA cores, another's wgmma runs.
* Intra-warpgroup overlap (section 3.2; d = 128 and 256, and three consumers): a consumer's
  turn issues QK^T of block j together with PV of block j - 1, and P is converted to
  bf16/fp16 only after the PV wait (registers a running wgmma reads must not be written
  before it completes). ptxas moves that wait ahead of the exponentials, so the softmax runs
  after the PV, hidden behind the other consumer's turn.
* The online softmax and its variants: jaxflash.mosaic.softmax. With the fixed reference,
  rows that overflow float32 are flagged by a NaN LSE, and a second pass of this kernel
  recomputes their query tiles, and only those, with the running max, in place.
* For `separate_output` the output tile has a shared-memory buffer of its own, so the next
  tile's Q load is issued before this tile's epilogue instead of after its store.
* Causal attention and sliding windows are loop bounds (pipeline.KeyBlocks): per consumer,
  the key blocks every row sees whole run unmasked, the blocks that straddle the diagonal, a
  window edge or the end of the valid keys run masked (jaxflash.mosaic.mask), and the blocks
  outside are never loaded, so a window w costs O(n w).
* Caches or page pools (mosaic.tiles): with a block table the producer copies each key
  block's tiles from the pool's pages in place, one TMA copy per page it spans.
* Persistent CTAs (pipeline.TileScheduler): one CTA per SM walks the query tiles, and the
  producer's K/V ring runs on from one tile into the next, so a tile's first loads overlap
  the last one's final steps and store.

Layout: query [B, T, N, H], key/value [B, S, K, H], N a multiple of K; H a multiple of 64
(the 128-byte swizzle) up to 256; bf16 or fp16. T and S that are not multiples of the tiles
are padded with zeros outside the kernel (padded keys are masked, padded rows sliced off);
the common case of whole tiles pads nothing. With key_value_seq_lengths, values past each
sequence's keys are zeroed first (TMA copies whole tiles, and 0 * NaN is NaN).

Measured on the H200: bench/PERFORMANCE.md ("Prefill on Hopper").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from jaxflash import _checks, _mosaic
from jaxflash._mosaic import LN_2, LOG2_E, pl, plgpu
from jaxflash.device import device_info
from jaxflash.mosaic.config import (DTYPES, ROW_SUM_COLUMNS, MosaicPrefillConfig, check_config,
                                    mosaic_prefill_config, registers, round_up,
                                    SWIZZLE_BYTES)
from jaxflash.mosaic.mask import KeyMask, iota
from jaxflash.mosaic.pipeline import KeyBlocks, KVRing, TileScheduler, TurnOrder
from jaxflash.mosaic.segments import Segments, block_ranges, check_segment_ids, pad_ids
from jaxflash.mosaic.softmax import OnlineSoftmax, rows_bcast
from jaxflash.mosaic.tiles import KeyTiles, copies_per_block
from jaxflash.score_mods import ScoreMods



class _Consumer:
  """One consumer warpgroup of the forward kernel: for each of its CTA's query tiles, its
  block_q rows' attention over the key blocks the producer streams through the ring."""

  def __init__(self, *, wg, q_ref, o_ref, lse_ref, io_smem, lse_smem, q_ready, retry_ref,
               scheduler: TileScheduler, blocks: KeyBlocks, ring: KVRing, turns: TurnOrder,
               mask: KeyMask, softmax: OnlineSoftmax, block_q, block_kv, num_consumers,
               overlap_softmax, separate_output):
    self.wg, self.q_ref, self.o_ref, self.lse_ref = wg, q_ref, o_ref, lse_ref
    self.lse_smem, self.q_ready, self.retry_ref = lse_smem, q_ready, retry_ref
    # Each consumer's Q tile, and its output tile (the Q tile's buffer again, unless a
    # separate output buffer is given).
    self.q_tile, self.o_tile = io_smem[0].at[wg], io_smem[-1].at[wg]
    self.separate_output = separate_output
    self.scheduler, self.blocks, self.ring, self.turns = scheduler, blocks, ring, turns
    self.mask, self.softmax = mask, softmax
    self.block_q, self.block_kv, self.num_consumers = block_q, block_kv, num_consumers
    self.overlap_softmax = overlap_softmax
    self.retry = retry_ref is not None
    self.dtype = q_ref.dtype
    self.head_dim = q_ref.shape[-1]
    self.acc_columns = self.head_dim + ROW_SUM_COLUMNS * softmax.sums_from_pv
    # Blocks before the first whole one are masked only with a window's left edge or
    # documents; else the whole blocks start at the first.
    self.masks_leading_blocks = mask.mods.left is not None or mask.segments is not None

  def first_row(self, tile):
    """This consumer's first query row in a query tile."""
    return tile * (self.num_consumers * self.block_q) + self.wg * self.block_q

  def load_q(self, item):
    batch, tile, head = self.scheduler.tile_of(item)
    q_rows = pl.ds(self.first_row(tile), self.block_q)
    plgpu.copy_gmem_to_smem(self.q_ref.at[batch, q_rows, head], self.q_tile, self.q_ready.at[self.wg])

  def run(self, item_blocks, rounds_here):
    """Every query tile this CTA serves (`rounds_here` of them). `item_blocks(round_)` ->
    (how many key blocks the CTA loads for it, the first)."""
    self.item_blocks = item_blocks
    if not self.retry:  # (the second pass loads each tile's Q as it takes the tile)
      self.load_q(self.scheduler.item_of(0))
    self.zero_scores = plgpu.layout_cast(jnp.zeros((self.block_q, self.block_kv), jnp.float32),
                                         plgpu.Layout.WGMMA)
    self.turns.begin()
    lax.fori_loop(0, rounds_here, self.attend, jnp.int32(0))
    self.turns.finish()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def attend(self, round_, loads):
    """One query tile. `loads`: key blocks this CTA consumed before it (ring slot and
    barrier phase continue from there)."""
    count, _ = self.item_blocks(round_)
    if self.retry:
      pl.when(count > 0)(lambda: self.attend_tile(round_, loads))
    else:
      self.attend_tile(round_, loads)
    return loads + count

  def attend_tile(self, round_, loads):
    scheduler, ring, turns = self.scheduler, self.ring, self.turns
    block_q = self.block_q
    item = scheduler.item_of(round_)
    batch, tile, head = scheduler.tile_of(item)
    if self.retry:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores have read the buffers
      self.load_q(item)
    q_base = self.first_row(tile)
    cta_lo, cta_hi = self.blocks.of_tile(batch, tile)
    # All consumers start at cta_lo, so that they step through the ring together; the
    # blocks before a later consumer's own window run masked and add nothing.
    (_, full_lo, full_hi, hi), (q_valid, shift, kv_valid) = self.blocks.of_rows(batch, q_base)
    hi = jnp.maximum(hi, cta_lo)
    full_lo = jnp.clip(full_lo, cta_lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    slot_of = lambda j: ring.slot(loads + j - cta_lo)

    plgpu.barrier_wait(self.q_ready.at[self.wg])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
    sums = self.softmax.zero_sums(block_q)
    # With the row sums from PV, columns H and up hold the row sums (all equal).
    acc = plgpu.layout_cast(jnp.zeros((block_q, self.acc_columns), jnp.float32), plgpu.Layout.WGMMA)
    segments = self.mask.segments
    row_ids = None if segments is None else segments.row_ids(batch, q_base)  # [block_q] int32
    tile_ = dict(slot_of=slot_of, cta_lo=cta_lo, full_lo=full_lo, full_hi=full_hi, hi=hi,
                 mask=lambda s, j: self.mask.apply(s, j, q_base, shift, kv_valid, batch, row_ids))
    if self.overlap_softmax:
      acc, m_i, sums = self.overlapped_blocks((acc, m_i, sums), **tile_)
    else:
      @pl.when(hi > cta_lo)
      def _():
        plgpu.barrier_wait(ring.k_ready.at[slot_of(cta_lo)])

      turns.begin_tile()
      acc, m_i, sums = self.paired_blocks((acc, m_i, sums), **tile_)

    def skip(j, _):
      # Blocks another consumer still needs: wait for them too, release them, and keep the
      # turns' count.
      ring.skip(slot_of(j))
      turns.skip_turn()

    lax.fori_loop(hi, cta_hi, skip, None)
    next_item = scheduler.item_of(round_ + 1)
    turns.end_tile()
    if self.separate_output:
      if not self.retry:
        # Every QK^T of this tile has been waited for: the Q buffer is free already.
        pl.when(next_item < scheduler.num_items)(lambda: self.load_q(next_item))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have read
                                                       # the output buffers
    self.store_tile(acc, m_i, sums, batch, head, q_base, q_valid)
    if not (self.separate_output or self.retry):
      @pl.when(next_item < scheduler.num_items)
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the buffers
        self.load_q(next_item)

  def scores(self, slot):
    """S = Q K^T [block_q, block_kv] float32 of the key block in `slot`, which is then
    released; the other consumer may run its PV as soon as the QK^T is issued."""
    def qk(s_ref):
      plgpu.wgmma(s_ref, self.q_tile, self.ring.k(slot).T)
      self.turns.end_turn()
      return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((self.block_q, self.block_kv), jnp.float32))
    plgpu.barrier_arrive(self.ring.k_free.at[slot])
    return s

  def paired_blocks(self, carry, *, slot_of, cta_lo, full_lo, full_hi, hi, mask):
    """The ping-pong without the overlap: each step's QK^T, softmax and PV in turn."""
    ring, softmax = self.ring, self.softmax

    def step(j, carry, *, masked: bool):
      acc, m_i, sums = carry  # [block_q, H], [block_q], RowSums float32
      slot = slot_of(j)
      s = self.scores(slot)
      p, m_new, alpha = softmax.step(mask(s, j) if masked else s, m_i, masked=masked)
      acc = softmax.rescale(acc, alpha)
      p_tile = p.astype(self.dtype)
      sums = softmax.add_row_sums(sums, alpha, p, p_tile)
      # Keep the softmax before the barrier (the order decides the overlap).
      acc, sums, m_new, p_tile = lax.optimization_barrier((acc, sums, m_new, p_tile))
      self.turns.start_turn(ring.v_ready.at[slot])  # the tensor cores are ours again

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_tile, ring.v(slot))

        @pl.when(j + 1 < hi)
        def _():
          plgpu.barrier_wait(ring.k_ready.at[slot_of(j + 1)])

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # the accumulator stays in its registers
      plgpu.barrier_arrive(ring.v_free.at[slot])
      return acc, m_new, sums

    # Blocks [cta_lo, full_lo) and [full_hi, hi) straddle a window edge, a document's, the
    # diagonal or the end of the keys and run masked; every row sees all of [full_lo, full_hi).
    if self.masks_leading_blocks:
      carry = lax.fori_loop(cta_lo, full_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)

  def overlapped_blocks(self, carry, *, slot_of, cta_lo, full_lo, full_hi, hi, mask):
    """FlashAttention-3, section 3.2: a turn on the tensor cores issues QK^T of block j and
    PV of block j - 1, and the softmax of block j runs while that PV is in flight. Each
    consumer takes cta_hi - cta_lo + 1 turns per tile: block cta_lo's QK^T, one per later
    block, the last block's PV, one per skipped block (and one empty turn when it has no
    block of its own)."""
    ring, turns, softmax, dtype = self.ring, self.turns, self.softmax, self.dtype

    def first_block(_, carry):
      acc, m_i, sums, _ = carry
      slot = slot_of(cta_lo)
      turns.start_turn(ring.k_ready.at[slot])
      # acc and the sums are still zero: nothing to rescale.
      p, m_i, _ = softmax.step(mask(self.scores(slot), cta_lo), m_i, masked=True)
      p_tile = p.astype(dtype)
      return acc, m_i, softmax.add_row_sums(sums, None, p, p_tile), p_tile

    def overlapped_step(j, carry, *, masked: bool):
      acc, m_i, sums, p_prev = carry  # p_prev [block_q, block_kv]: P of block j - 1
      rescales = not (softmax.fixed_reference and not masked)  # else the step gives no alpha
      slot, prev = slot_of(j), slot_of(j - 1)
      plgpu.barrier_wait(ring.k_ready.at[slot])
      turns.start_turn(ring.v_ready.at[prev])

      def body(refs):
        acc_ref, s_ref, p_ref, m_ref, alpha_ref = refs
        plgpu.wgmma(s_ref, self.q_tile, ring.k(slot).T)
        plgpu.wgmma(acc_ref, p_prev, ring.v(prev))
        turns.end_turn()
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # QK^T landed, PV may still run
        plgpu.barrier_arrive(ring.k_free.at[slot])
        # P stays float32 here: registers that the running PV reads (p_prev) must not be
        # written before it completes, so P is converted after the wait, as in
        # FlashAttention-3. The barrier keeps the softmax ahead of that wait.
        p, m_new, alpha = softmax.step(mask(s, j) if masked else s, m_i, masked=masked)
        if not rescales:  # (the ref still takes a value)
          alpha = m_new
        p_ref[...], m_ref[...], alpha_ref[...] = lax.optimization_barrier((p, m_new, alpha))

      acc, _, p, m_new, alpha = pl.run_state(body)(
          (plgpu.ACC.init(acc), plgpu.ACC.init(self.zero_scores), self.zero_scores, m_i, m_i))
      plgpu.barrier_arrive(ring.v_free.at[prev])
      alpha = alpha if rescales else None
      acc = softmax.rescale(acc, alpha)
      p_tile = p.astype(dtype)
      return acc, m_new, softmax.add_row_sums(sums, alpha, p, p_tile), p_tile

    def last_pv(_, carry):
      acc, m_i, sums, p = carry
      slot = slot_of(hi - 1)
      turns.start_turn(ring.v_ready.at[slot])

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, ring.v(slot))
        turns.end_turn()

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(ring.v_free.at[slot])
      return acc, m_i, sums, p

    has_blocks = (hi > cta_lo).astype(jnp.int32)
    pl.when(hi == cta_lo)(turns.skip_turn)
    p0 = plgpu.layout_cast(jnp.zeros((self.block_q, self.block_kv), dtype), plgpu.Layout.WGMMA)
    carry = lax.fori_loop(0, has_blocks, first_block, (*carry, p0))
    start = cta_lo + 1  # block cta_lo ran masked in first_block
    if self.masks_leading_blocks:
      carry = lax.fori_loop(start, jnp.maximum(full_lo, start),
                            functools.partial(overlapped_step, masked=True), carry)
    carry = lax.fori_loop(jnp.maximum(full_lo, start), jnp.maximum(full_hi, start),
                          functools.partial(overlapped_step, masked=False), carry)
    carry = lax.fori_loop(jnp.maximum(full_hi, start), hi,
                          functools.partial(overlapped_step, masked=True), carry)
    acc, m_i, sums, _ = lax.fori_loop(0, has_blocks, last_pv, carry)
    return acc, m_i, sums

  def store_tile(self, acc, m_i, sums, batch, head, q_base, q_valid):
    """FlashAttention-2 divides once, here, and stores the output tile and its LSE. Rows that
    saw no key (l = 0), and padding rows, give exact zeros (their LSE is set to -inf outside,
    where the lengths are at hand); rows that saw a NaN score or value (l or acc NaN) give
    NaN, as jax.nn does."""
    block_q, head_dim, softmax = self.block_q, self.head_dim, self.softmax
    l_out, l_lse = sums
    if softmax.sums_from_pv:  # the sums' columns are equal: any one is the row sum
      acc, l_out = acc[:, :head_dim], acc[:, head_dim:].max(axis=1)
    if softmax.fixed_reference:
      # Probabilities that overflowed leave inf or NaN in the sums or acc (x * 0 is NaN for
      # those alone): the row's LSE is NaN, and the second pass recomputes its tile.
      overflowed = (l_lse * 0.0 + (acc * 0.0).sum(axis=1)) != 0.0
    attended = l_out != 0.0  # (NaN too)
    inv_l = 1.0 / jnp.where(attended, l_out, 1.0)
    shape = (block_q, head_dim)
    keep = (iota(shape, 0) < q_valid - q_base) & rows_bcast(attended, shape)
    self.o_tile[...] = jnp.where(keep, acc * rows_bcast(inv_l, shape), 0.0).astype(self.dtype)
    # m and log2(l) are base 2: ln 2 converts back to the natural-log LSE.
    lse = jnp.where(attended, m_i * LN_2 + jnp.log(jnp.where(attended, l_lse, 1.0)), -jnp.inf)
    self.lse_smem[self.wg] = jnp.where(overflowed, jnp.nan, lse) if softmax.fixed_reference else lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(self.o_tile, self.o_ref.at[batch, pl.ds(q_base, block_q), head])
    plgpu.copy_smem_to_gmem(self.lse_smem.at[self.wg],
                            self.lse_ref.at[batch, head, pl.ds(q_base, block_q)])


def _forward_kernel(
    q_len_ref,  # [B] int32 GMEM: query count per sequence
    kv_len_ref,  # [B] int32 GMEM: key count per sequence
    q_ref,  # [B, T_pad, N, H] GMEM
    k_ref,  # [B, S_pad, K, H] GMEM
    v_ref,  # [B, S_pad, K, H] GMEM, or [B, K, H + 8, S_pad] with rows of ones (tensor_core_row_sums)
    o_ref,  # [B, T_pad, N, H] GMEM
    lse_ref,  # [B, N, T_pad] float32 GMEM: natural-log LSE (seq minor: 1-D TMA stores)
    io_smem,  # ([consumers, block_q, H],) or twice that (separate_output) SMEM: Q and output tiles
    k_smem,  # [stages, block_kv, H] SMEM ring
    v_smem,  # [stages, block_kv, H] SMEM ring, or [stages, H + 8, block_kv] (tensor_core_row_sums)
    lse_smem,  # [consumers, block_q] float32 SMEM
    k_ready, v_ready,  # [stages] barriers: the TMA of a slot landed
    q_ready,  # [consumers] barriers: a consumer's Q tile landed
    k_free, v_free,  # [stages] barriers, one arrival per consumer: all are done with a slot
    schedule,  # barrier, one arrival per consumer: the pair's turns (without the overlap)
    *,
    retry_ref=None,  # [B * N * num_q_tiles] int32 GMEM, the second pass only: tiles to redo
    segment_refs=None,  # packed documents: ([B, T_pad], [B, S_pad], [B, T_pad // block_q, 4])
                        # int32 GMEM, segment ids of queries and keys and their block ranges
    table_ref=None,  # [B, max_pages] int32 GMEM: a page pool's block table (k_ref, v_ref are
                     # then the pool's rows [P * page, K, H]; mosaic.tiles)
    page_size: int = 0,
    num_pages: int = 0,
    qk_scale: float,
    mods: ScoreMods,
    block_q: int,
    block_kv: int,
    num_stages: int,
    seq_q: int,
    seq_kv: int,
    num_q_tiles: int,
    num_heads: int,
    batch_size: int,
    num_ctas: int,
    group: int,
    overlap_softmax: bool,
    separate_output: bool,
    conditional_rescale: bool,
    num_consumers: int,
    tensor_core_row_sums: bool,
    fixed_reference: bool,
):
  wg = lax.axis_index("wg")
  scheduler = TileScheduler(num_heads, batch_size, num_q_tiles, num_ctas)
  rounds_here = scheduler.rounds_here()
  segments = None if segment_refs is None else Segments(*segment_refs, block_q, block_kv)
  blocks = KeyBlocks(q_len_ref, kv_len_ref, mods, block_q, block_kv, seq_q, seq_kv, num_consumers,
                     segments)
  ring = KVRing(k_smem, v_smem, k_ready, v_ready, k_free, v_free, num_stages, tensor_core_row_sums)
  tiles = KeyTiles(k_ref, v_ref, block_kv, tensor_core_row_sums, table_ref, page_size, num_pages)

  def item_blocks(round_):
    """The key blocks this CTA loads for its item in `round_`: how many, and from which.
    The second pass (retry_ref) loads none for the tiles it skips."""
    batch, tile, head = scheduler.tile_of(scheduler.item_of(round_))
    cta_lo, cta_hi = blocks.of_tile(batch, tile)
    count = cta_hi - cta_lo
    if retry_ref is not None:
      count = jnp.where(retry_ref[(batch * num_heads + head) * num_q_tiles + tile] != 0, count, 0)
    return count, cta_lo

  consumer_registers, producer_registers = registers(num_consumers)

  @pl.when(wg < num_consumers)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    consumer = _Consumer(
        wg=wg, q_ref=q_ref, o_ref=o_ref, lse_ref=lse_ref, io_smem=io_smem, lse_smem=lse_smem,
        q_ready=q_ready, retry_ref=retry_ref, scheduler=scheduler, blocks=blocks, ring=ring,
        turns=TurnOrder(overlap_softmax, num_consumers, schedule, wg),
        mask=KeyMask(mods, block_q, block_kv, segments),
        softmax=OnlineSoftmax(qk_scale, conditional_rescale, fixed_reference, tensor_core_row_sums),
        block_q=block_q, block_kv=block_kv, num_consumers=num_consumers,
        overlap_softmax=overlap_softmax, separate_output=separate_output)
    consumer.run(item_blocks, rounds_here)

  @pl.when(wg == num_consumers)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")

    def produce(round_, loads):
      batch, tile, head = scheduler.tile_of(scheduler.item_of(round_))
      kv_head = lax.div(head, group)
      count, cta_lo = item_blocks(round_)

      @pl.loop(0, count)
      def _(j):
        ring.load(loads + j, ring.slot(loads + j), tiles.copies(batch, kv_head, cta_lo + j))

      return loads + count

    lax.fori_loop(0, rounds_here, produce, jnp.int32(0))


@functools.partial(
    jax.jit, static_argnames=("scale", "is_causal", "local_window_size", "return_residual", "config",
                              "interpret"))
def prefill_attention(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
                      scale=None, is_causal=False, local_window_size=None, segment_ids=None,
                      kv_segment_ids=None, block_table=None, return_residual=False,
                      config: MosaicPrefillConfig | None = None, interpret: bool | None = None):
  """FlashAttention-3 style forward pass on sm_90 (Pallas Mosaic GPU).

  query [B, T, N, H]; key, value [B, S, K, H] with N a multiple of K (query head n reads
  KV head n // (N // K)); bf16 or fp16, one dtype; H a multiple of 64 up to 256.
  query_seq_lengths, key_value_seq_lengths: optional int [B]. Rows t >= q_len[b] are
  padding (zeros out, LSE -inf), keys s >= kv_len[b] are ignored. Query t sits at key
  position p = t + kv_len_b - q_len_b (bottom-right); `is_causal` keeps keys s <= p and
  `local_window_size` w or (left, right) keeps p - left <= s <= p + right, the key blocks
  outside never loaded. segment_ids [B, T] and kv_segment_ids [B, S] int (optional;
  kv_segment_ids defaults to segment_ids when T == S): packed documents, query t sees key s
  only where their ids are equal, on top of the rest; key blocks whose ids cannot meet a
  query tile's are never loaded. Rows that see no key give zeros (LSE -inf); rows that see
  a NaN give NaN, as jax.nn does. Returns out [B, T, N, H] in the query's dtype, and with
  `return_residual` the natural-log LSE [B, T, N] float32 too: the same function as
  `jaxflash.prefill_attention`.

  block_table [B, max_pages] int32 (optional): key and value are then page pools
  [num_pages, page_size, K, H] (page_size a power of two from 8), logical page j of sequence
  b at pool page block_table[b, j], S = max_pages * page_size, and key_value_seq_lengths is
  required: the same function as `jaxflash.paged_prefill_attention`, the tiles copied from
  the pages in place (mosaic.tiles). Values in the pool past a sequence's keys must be
  finite: the contiguous path zeroes them, a pool is not written (their probabilities are
  zero, but 0 * NaN is NaN). Not with segment ids.

  config: a MosaicPrefillConfig (default: the tuned `mosaic_prefill_config(H, dtype,
    num_keys=S)`).
  interpret: Mosaic GPU's interpret mode (default: when there is no GPU). It cannot run
    this kernel yet (`jaxflash._mosaic.INTERPRET_GAPS`), so True, or no GPU, raises
    NotImplementedError; the Pallas-Triton `jaxflash.prefill_attention` runs anywhere.
  """
  batch, seq_q, num_heads, head_dim = query.shape
  paged = block_table is not None
  names = dict(key_name="k_pages", value_name="v_pages") if paged else {}
  _checks.check_qkv(query, key, value, **names)
  num_kv_heads = key.shape[2]
  if paged:
    block_table, seq_kv = _check_pages(key, block_table, key_value_seq_lengths, segment_ids, batch)
  else:
    _checks.check_same_batch(query, key)
    seq_kv = key.shape[1]
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  q_ids, kv_ids = check_segment_ids(segment_ids, kv_segment_ids, batch, seq_q, seq_kv)
  _check_inputs(query, key, value)
  scale = _checks.default_scale(scale, head_dim)
  mods = ScoreMods.from_options(is_causal=is_causal, local_window_size=local_window_size)
  info = device_info()
  if config is None:
    config = mosaic_prefill_config(head_dim, query.dtype, info, num_keys=seq_kv)
    if paged:  # a pool has no V^T with rows of ones
      config = dataclasses.replace(config, tensor_core_row_sums=False)
  else:
    check_config(config, head_dim, query.dtype, info)
    if paged and config.tensor_core_row_sums:
      raise ValueError("config.tensor_core_row_sums needs V^T with rows of ones, which a page "
                       "pool (block_table) does not have")

  if 0 in (batch, seq_q, num_heads) or seq_kv == 0:
    out = jnp.zeros(query.shape, query.dtype)
    lse = jnp.full(query.shape[:3], -jnp.inf, jnp.float32)
    return (out, lse) if return_residual else out

  block_q, block_kv = config.block_q, config.block_kv
  num_consumers = config.num_consumers
  q_rows = num_consumers * block_q
  seq_q_pad, seq_kv_pad = round_up(seq_q, q_rows), round_up(seq_kv, block_kv)
  q = query if seq_q_pad == seq_q else jnp.pad(query, ((0, 0), (0, seq_q_pad - seq_q), (0, 0), (0, 0)))
  q_len = jnp.full((batch,), seq_q, jnp.int32) if q_lengths is None else q_lengths
  num_pages, page_size = key.shape[:2] if paged else (0, 0)
  if paged:
    # [P, page, K, H] -> rows [P * page, K, H]: a bitcast, the pool is read in place.
    k, v = (x.reshape(num_pages * page_size, num_kv_heads, head_dim) for x in (key, value))
  else:
    kv_pad = ((0, 0), (0, seq_kv_pad - seq_kv), (0, 0), (0, 0))
    k = key if seq_kv_pad == seq_kv else jnp.pad(key, kv_pad)
    v = value if seq_kv_pad == seq_kv else jnp.pad(value, kv_pad)
    if kv_lengths is not None:
      # TMA copies whole tiles: values past a sequence's keys reach the tensor cores as they
      # are. Their probabilities are exact zeros, but 0 * NaN is NaN, so they are zeroed here
      # (one pass over V, only when lengths are given). Keys need nothing: their scores are
      # replaced by -inf, whatever they were.
      v = jnp.where((jnp.arange(seq_kv_pad)[None, :] < kv_lengths[:, None])[:, :, None, None], v, 0)
  kv_len = jnp.full((batch,), seq_kv, jnp.int32) if kv_lengths is None else kv_lengths
  num_q_tiles = seq_q_pad // q_rows
  num_stages = min(config.num_stages, seq_kv_pad // block_kv)  # no deeper ring than keys
  # Inputs after value's, and the kernel's keywords for their refs: segment ids, or a table.
  extra_arrays, extra_refs = (), lambda refs: {}
  if q_ids is not None:
    q_ids, kv_ids = pad_ids(q_ids, seq_q_pad), pad_ids(kv_ids, seq_kv_pad)
    extra_arrays = (q_ids, kv_ids, block_ranges(q_ids, kv_ids, block_q, block_kv))
    extra_refs = lambda refs: dict(segment_refs=tuple(refs))
  elif paged:
    extra_arrays, extra_refs = (block_table,), lambda refs: dict(table_ref=refs[0])
  copies = copies_per_block(block_kv, page_size)  # the "ready" barriers' arrivals
  if _mosaic.interpret_params(interpret) is not None:
    raise NotImplementedError(_mosaic.INTERPRET_GAPS)

  # 128-byte swizzled tiles: the layout wgmma reads and TMA writes without bank conflicts.
  swizzled = dict(transforms=(plgpu.TilingTransform((8, SWIZZLE_BYTES // query.dtype.itemsize)),
                              plgpu.SwizzleTransform(SWIZZLE_BYTES)))
  row_tile = plgpu.SMEM((num_consumers, block_q, head_dim), query.dtype, **swizzled)
  scratch = [
      (row_tile, row_tile) if config.separate_output else (row_tile,),
      plgpu.SMEM((num_stages, block_kv, head_dim), key.dtype, **swizzled),
      plgpu.SMEM((num_stages, head_dim + ROW_SUM_COLUMNS, block_kv) if config.tensor_core_row_sums
                 else (num_stages, block_kv, head_dim), value.dtype, **swizzled),
      plgpu.SMEM((num_consumers, block_q), jnp.float32),
      plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_consumers),
      plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=num_consumers),
  ]
  if config.tensor_core_row_sums:
    # V^T [B, K, H + 8, S_pad] with 8 rows of ones: PV then yields P's row sums too.
    ones = jnp.ones((batch, num_kv_heads, ROW_SUM_COLUMNS, seq_kv_pad), v.dtype)
    v = jnp.concatenate([jnp.transpose(v, (0, 2, 3, 1)), ones], axis=2)
  compiler_params = plgpu.CompilerParams(
      # approx_math: exp2 is one ex2.approx; the row max and sum of a wgmma tile stay within
      # a warp, so no shared-memory scratch is reserved for cross-warp reductions.
      approx_math=True, reduction_scratch_bytes=0,
      # Every shared-memory region here is either written by TMA and read by wgmma, or
      # written once by the consumer that then stores it: the two conditions under which
      # Pallas documents its automatic barriers as safe to leave out.
      unsafe_no_auto_barriers=True)
  # The fixed reference needs every row to have seen a key before its first whole block;
  # with a window's left edge or documents a row may not have, so these keep the running max.
  fixed_reference = config.fixed_reference and mods.left is None and q_ids is None

  @jax.custom_batching.custom_vmap
  def run_kernels(q_len, kv_len, q, k, v, *extra_arrays):
    """The kernel on [B, ...] operands, and with the fixed reference its second pass."""
    batch = q.shape[0]
    num_items = num_heads * batch * num_q_tiles
    # One CTA per SM (its registers hold no second one) walks the items.
    num_ctas = min(info.sm_count, num_items)
    kernel = functools.partial(
        _forward_kernel, qk_scale=scale * LOG2_E, mods=mods, block_q=block_q,
        block_kv=block_kv, num_stages=num_stages, seq_q=seq_q, seq_kv=seq_kv,
        num_q_tiles=num_q_tiles, num_heads=num_heads, batch_size=batch, num_ctas=num_ctas,
        group=num_heads // num_kv_heads, overlap_softmax=config.overlap_softmax,
        separate_output=config.separate_output,
        conditional_rescale=config.conditional_rescale, num_consumers=num_consumers,
        tensor_core_row_sums=config.tensor_core_row_sums, fixed_reference=fixed_reference,
        page_size=page_size, num_pages=num_pages)
    kernel.__name__ = "mosaic_prefill"  # the name profiles show
    out_type = (jax.ShapeDtypeStruct(q.shape, query.dtype),
                jax.ShapeDtypeStruct((batch, num_heads, seq_q_pad), jnp.float32))
    mesh = dict(grid=(num_ctas,), grid_names=("cta",), num_threads=num_consumers + 1,
                thread_name="wg")
    out, lse = plgpu.kernel(_mosaic.with_extra_refs(kernel, 5, len(extra_arrays), extra_refs),
                            out_type=out_type, scratch_types=scratch, compiler_params=compiler_params,
                            **mesh)(q_len, kv_len, q, k, v, *extra_arrays)
    if not fixed_reference:
      return out, lse
    # Second pass: the tiles with a row whose fixed reference overflowed (NaN LSE), and
    # only those, run again with the running max, written over the first pass's out and LSE.
    rows_valid = jnp.arange(seq_q_pad)[None, :] < jnp.clip(q_len, 0, seq_q)[:, None]  # [B, T_pad]
    overflowed = jnp.isnan(lse) & rows_valid[:, None, :]  # [B, N, T_pad]
    retry = overflowed.reshape(batch, num_heads, num_q_tiles, q_rows).any(axis=-1)
    retry = retry.astype(jnp.int32).reshape(-1)  # [B * N * tiles]

    def recompute(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, retry_ref, *refs):
      *extra, o_ref, lse_ref = refs
      pl.run_scoped(
          lambda *scratch_refs: kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                                       *scratch_refs, retry_ref=retry_ref, fixed_reference=False,
                                       **extra_refs(extra)),
          *scratch, collective_axes="wg")

    def second_pass(refs):
      # pl.kernel (not plgpu.kernel) takes the output refs as operands: it writes into the
      # first pass's buffers in place.
      o_ref, lse_ref = refs
      pl.kernel(recompute, out_type=(), mesh=plgpu.Mesh(**mesh), compiler_params=compiler_params,
                name="mosaic_prefill_recompute")(q_len, kv_len, q, k, v, retry, *extra_arrays,
                                                 o_ref, lse_ref)

    return pl.run_state(second_pass)((out, lse))

  @run_kernels.def_vmap
  def _vmap_rule(axis_size, in_batched, *args):
    # Under jax.vmap the mapped axis joins the batch (run_state has no batching rule).
    args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched)]
    out, lse = run_kernels(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
    unfold = lambda x: x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])
    return (unfold(out), unfold(lse)), (True, True)

  out, lse = run_kernels(q_len, kv_len, q, k, v, *extra_arrays)

  out = out[:, :seq_q]
  if not return_residual:
    return out
  rows_valid = jnp.arange(seq_q)[None, :] < jnp.clip(q_len, 0, seq_q)[:, None]  # [B, T]
  lse = jnp.where(rows_valid[:, :, None], jnp.swapaxes(lse[:, :, :seq_q], 1, 2), -jnp.inf)
  return out, lse


def _check_inputs(query, key, value) -> None:
  if not _mosaic.AVAILABLE:
    raise NotImplementedError(f"Pallas Mosaic GPU does not import here: {_mosaic.IMPORT_ERROR}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if jnp.dtype(x.dtype) not in DTYPES:
      raise TypeError(f"{name} must be bfloat16 or float16 for the Mosaic prefill, got "
                      f"{jnp.dtype(x.dtype).name} {tuple(x.shape)}")
  if not query.dtype == key.dtype:
    raise TypeError(f"query and key must share one dtype for the Mosaic prefill, got "
                    f"{jnp.dtype(query.dtype).name} and {jnp.dtype(key.dtype).name}")
  head_dim = query.shape[-1]
  if head_dim % 64 or head_dim > 256:
    raise ValueError(f"the Mosaic prefill takes head dims that are multiples of 64 up to 256, "
                     f"got query {tuple(query.shape)}")


def _check_pages(k_pages, block_table, kv_lengths, segment_ids, batch: int):
  """A page pool's checks: (the int32 table [B, max_pages], its capacity in keys)."""
  if segment_ids is not None:
    raise NotImplementedError("segment_ids with a block_table: the Mosaic prefill reads packed "
                              "documents from contiguous caches only")
  return _checks.check_pages(k_pages, block_table, kv_lengths, batch, caller="mosaic.prefill_attention")

