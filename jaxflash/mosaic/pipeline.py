"""The Mosaic prefill's pipeline, shared by its kernels: which query tile each CTA serves
and which key blocks it reads (`TileScheduler`), the shared-memory ring of K/V tiles
between the producer warpgroup and the consumers (`KVRing`), and the order in which the
consumer warpgroups take turns on the tensor cores (`TurnOrder`).

FlashAttention-3 (Shah et al., 2024, arXiv 2407.08608), section 3.1: a producer
warpgroup that only issues TMA copies, consumers that only compute, and "pingpong
scheduling" so that one consumer's softmax runs on the CUDA cores while another's
matmuls run on the tensor cores.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from jaxflash import _mosaic
from jaxflash._mosaic import pl, plgpu
from jaxflash.mosaic.config import WARPGROUP_THREADS
from jaxflash.mosaic.segments import Segments
from jaxflash.score_mods import ScoreMods, key_blocks, query_blocks

SCHEDULE_ID = 8  # first hardware named barrier of the turns (Mosaic GPU uses the low IDs)


@dataclasses.dataclass(frozen=True)
class TileScheduler:
  """Persistent CTAs (FlashAttention-3's tile scheduler): CTA c serves the work items
  item_of(0), item_of(1), ..., one query tile of one head of one sequence each.

  Items run the longest (causal) query tiles first, heads fastest, so that CTAs resident
  together read the same KV head (GQA: one KV tile in L2 serves its query heads; K and V
  are never repeated), and are dealt out in a snake (CTA 0 .. G - 1, then back), which
  keeps the longest-first order balanced over the rounds."""

  num_heads: int
  batch_size: int
  num_q_tiles: int
  num_ctas: int

  @property
  def num_items(self) -> int:
    return self.num_heads * self.batch_size * self.num_q_tiles

  @property
  def num_rounds(self) -> int:
    return -(-self.num_items // self.num_ctas)

  def item_of(self, round_):
    """This CTA's work item in a round (it may be past the last item: no work)."""
    cta = lax.axis_index("cta")
    return round_ * self.num_ctas + jnp.where(lax.rem(round_, 2) == 0, cta, self.num_ctas - 1 - cta)

  def rounds_here(self):
    """How many rounds this CTA serves: all but the last round's extras serve num_rounds."""
    return self.num_rounds - 1 + (self.item_of(self.num_rounds - 1) < self.num_items).astype(jnp.int32)

  def tile_of(self, item):
    """item -> (batch, query tile, head)."""
    head = lax.rem(item, self.num_heads)
    rest = lax.div(item, self.num_heads)
    return (lax.rem(rest, self.batch_size), self.num_q_tiles - 1 - lax.div(rest, self.batch_size),
            head)


@dataclasses.dataclass(frozen=True)
class _Bounds:
  """What the loop bounds of a sequence's blocks are computed from: its lengths (data, not
  shapes: no recompiles), the static options and the tiles."""

  q_len_ref: object  # [B] int32 GMEM: query count per sequence
  kv_len_ref: object  # [B] int32 GMEM: key count per sequence
  mods: ScoreMods
  block_q: int
  block_kv: int
  seq_q: int
  seq_kv: int
  num_consumers: int
  segments: Segments | None = None  # packed documents: blocks whose ids cannot meet skipped

  def lengths(self, batch):
    """(valid rows, valid keys, shift) of sequence `batch`: query t sits at key position
    t + shift (bottom-right alignment)."""
    q_len, kv_len = self.q_len_ref[batch], self.kv_len_ref[batch]
    q_valid = jnp.minimum(jnp.maximum(q_len, 0), self.seq_q)
    kv_valid = jnp.minimum(jnp.maximum(kv_len, 0), self.seq_kv)
    return q_valid, kv_valid, kv_len - q_len

  def per_consumer(self, of_block, batch, tile, block: int):
    """[of_block(batch, base) for each consumer's `block` rows (or keys) of a CTA's tile]."""
    cta_base = tile * (self.num_consumers * block)
    return [of_block(batch, cta_base + w * block if w else cta_base)  # (no "+ 0")
            for w in range(self.num_consumers)]

  @staticmethod
  def union(blocks):
    """The [lo, hi) covering consumers' (lo, full_lo, full_hi, hi): from the earliest start
    among the consumers that have blocks (none: an empty range) to the latest end."""
    hi = functools.reduce(jnp.maximum, [b[3] for b in blocks])
    return functools.reduce(jnp.minimum, [jnp.where(b[3] > b[0], b[0], hi) for b in blocks]), hi


@dataclasses.dataclass(frozen=True)
class KeyBlocks(_Bounds):
  """Key block bounds of query rows: causal masks and windows are loop bounds
  (jaxflash.score_mods.key_blocks, as in the Triton prefill), computed in the kernel from
  the per-sequence lengths."""

  def of_rows(self, batch, q_base):
    """Key blocks (lo, full_lo, full_hi, hi) of rows [q_base, q_base + block_q) of sequence
    `batch`, as score_mods.key_blocks gives them (all zero when no row is valid), and the
    sequence's valid rows, key shift and valid keys."""
    q_valid, kv_valid, shift = self.lengths(batch)
    rows_end = jnp.minimum(q_base + self.block_q, q_valid)
    blocks = key_blocks(self.mods, q_base, rows_end - 1, shift, kv_valid, self.block_kv)
    blocks = [jnp.where(rows_end > q_base, x, 0) for x in blocks]
    if self.segments is not None:
      blocks = self.segments.bound(batch, q_base, blocks)
    return blocks, (q_valid, shift, kv_valid)

  def of_tile(self, batch, tile):
    """The key blocks [lo, hi) the producer loads for a query tile: the union of the
    consumers' blocks, from the first consumer's first (its rows are earliest, so a window's
    left edge reaches furthest back) to the latest of their last (under the causal mask the
    later consumers usually need more)."""
    blocks = self.per_consumer(lambda b, base: self.of_rows(b, base)[0], batch, tile, self.block_q)
    if self.segments is None:
      return blocks[0][0], functools.reduce(jnp.maximum, [b[3] for b in blocks])
    # With segment ids any consumer's blocks may start first.
    return self.union(blocks)


@dataclasses.dataclass(frozen=True)
class QueryBlocks(_Bounds):
  """`KeyBlocks` seen from the keys, for the backward's dK/dV kernel: the query blocks
  (lo, full_lo, full_hi, hi) that see a block of keys (jaxflash.score_mods.query_blocks),
  narrowed by the segment ids' block ranges. `segments` is the keys' view: `Segments` over
  (kv_ids, q_ids) with block_ranges(kv_ids, q_ids, block_kv, block_q), so its "rows" are
  keys and its "keys" query rows."""

  def of_keys(self, batch, k_base):
    """Query blocks (lo, full_lo, full_hi, hi) of keys [k_base, k_base + block_kv): blocks
    [full_lo, full_hi) have every row see every key (all of them valid: else none is
    full); the rest of [lo, hi) need the mask; all zero when no key is valid."""
    q_valid, kv_valid, shift = self.lengths(batch)
    keys_end = jnp.minimum(k_base + self.block_kv, kv_valid)
    lo, full_lo, full_hi, hi = query_blocks(self.mods, k_base, keys_end - 1, shift, q_valid,
                                            self.block_q)
    all_valid = k_base + self.block_kv <= kv_valid
    blocks = [lo, jnp.where(all_valid, full_lo, hi), jnp.where(all_valid, full_hi, hi), hi]
    blocks = [jnp.where(keys_end > k_base, x, 0) for x in blocks]
    if self.segments is not None:
      blocks = self.segments.bound(batch, k_base, blocks)
    return blocks

  def of_tile(self, batch, kv_tile):
    """The query blocks [lo, hi) the producer streams for a CTA's keys: the union of the
    consumers' (with segment ids any consumer's may start first)."""
    return self.union(self.per_consumer(self.of_keys, batch, kv_tile, self.block_kv))


@dataclasses.dataclass(frozen=True)
class KVRing:
  """The producer's `num_stages`-deep shared-memory ring of K and V tiles. Each slot has a
  "ready" barrier (the TMA completes it) and a "free" barrier (every consumer arrives once it
  has read the slot); the producer waits on "free" before it overwrites a slot. Every
  consumer steps through every block the CTA loads, so each barrier's phase stays in step."""

  k_smem: object  # [stages, block_kv, H] SMEM
  v_smem: object  # [stages, block_kv, H] SMEM, or [stages, H + 8, block_kv] (V^T with ones)
  k_ready: object  # [stages] barriers: the TMA of a slot landed
  v_ready: object
  k_free: object  # [stages] barriers, one arrival per consumer: all are done with a slot
  v_free: object
  num_stages: int
  v_transposed: bool

  def slot(self, load):
    """The ring slot of the CTA's `load`-th key block."""
    return lax.rem(load, self.num_stages)

  def k(self, slot):
    return self.k_smem.at[slot]

  def v(self, slot):
    """PV's right operand [block_kv, H] (or [block_kv, H + 8] from V^T) in `slot`."""
    return self.v_smem.at[slot].T if self.v_transposed else self.v_smem.at[slot]

  def load(self, load, slot, copies):
    """Producer: the `load`-th block's K and V into its slot, once the consumers have freed
    it (the first num_stages loads find it empty). copies: [(rows of the slot or None for
    all, K source, V source)] (mosaic.tiles.KeyTiles); the "ready" barriers expect one
    arrival per copy."""
    def into(smem, rows):
      return smem.at[slot] if rows is None else smem.at[slot, rows]

    pl.when(load >= self.num_stages)(lambda: plgpu.barrier_wait(self.k_free.at[slot]))
    for rows, k_src, _ in copies:
      plgpu.copy_gmem_to_smem(k_src, into(self.k_smem, rows), self.k_ready.at[slot])
    pl.when(load >= self.num_stages)(lambda: plgpu.barrier_wait(self.v_free.at[slot]))
    for rows, _, v_src in copies:
      plgpu.copy_gmem_to_smem(v_src, into(self.v_smem, rows), self.v_ready.at[slot])

  def skip(self, slot):
    """Consumer: a block this consumer does not need, waited for and released (the barriers'
    phases are tracked per consumer and must stay in step for the next tile)."""
    plgpu.barrier_wait(self.k_ready.at[slot])
    plgpu.barrier_arrive(self.k_free.at[slot])
    plgpu.barrier_wait(self.v_ready.at[slot])
    plgpu.barrier_arrive(self.v_free.at[slot])


@dataclasses.dataclass(frozen=True)
class TurnOrder:
  """The consumers' turns on the tensor cores: while one runs its softmax on the CUDA cores,
  another's wgmma runs (FlashAttention-3, section 3.1).

  `ring` (with the intra-warpgroup overlap, any number of consumers): consumer w syncs on
  hardware named barrier SCHEDULE_ID + w, which the one before it in the ring arrives at:
  one bar.arrive and one bar.sync a turn, cheaper than an mbarrier round trip through
  shared memory. Turns go round strictly (first, second, ..., last, first, ...) across
  tiles: a hardware barrier only counts arrivals, and the strict order is what keeps two
  arrivals of one consumer from completing another's barrier.

  Otherwise (two consumers): one two-arrival mbarrier (`schedule`) that both pass twice a
  step, the second consumer running half a step behind the first within each tile."""

  ring: bool
  num_consumers: int
  schedule: object  # barrier, one arrival per consumer (the pair's)
  wg: object  # this consumer's index, lax.axis_index("wg")

  def _pass_schedule(self):
    plgpu.barrier_arrive(self.schedule)
    plgpu.barrier_wait(self.schedule)

  def end_turn(self):
    """This consumer's matmuls are issued: the next one may run its own."""
    if not self.ring:
      self._pass_schedule()
      return
    wg = self.wg
    if self.num_consumers == 2:  # the pair's form, as measured (rem gives the same barrier)
      barrier = SCHEDULE_ID + 1 - wg
    else:
      barrier = SCHEDULE_ID + lax.rem(wg + 1, self.num_consumers)
    _mosaic.named_barrier("arrive", barrier, 2 * WARPGROUP_THREADS)

  def start_turn(self, operands_ready=None):
    """Wait for this consumer's turn, and for the barrier `operands_ready` (the operands
    of the matmuls the turn issues) while it comes."""
    if not self.ring:
      plgpu.barrier_arrive(self.schedule)
      if operands_ready is not None:
        plgpu.barrier_wait(operands_ready)
      plgpu.barrier_wait(self.schedule)
      return
    if operands_ready is not None:
      plgpu.barrier_wait(operands_ready)
    _mosaic.named_barrier("sync", SCHEDULE_ID + self.wg, 2 * WARPGROUP_THREADS)

  def skip_turn(self):
    """A turn with no matmul (a block this consumer does not need): the count stays in step."""
    if self.ring:
      self.start_turn()
      self.end_turn()
    else:
      self._pass_schedule()
      self._pass_schedule()

  def begin(self):
    """Before the first tile: the last consumer of the ring lets the first take the first turn."""
    if self.ring:
      pl.when(self.wg == self.num_consumers - 1)(self.end_turn)

  def finish(self):
    """After the last tile: the first consumer absorbs the last one's final turn."""
    if self.ring:
      pl.when(self.wg == 0)(self.start_turn)

  def begin_tile(self):
    """The pair: the second consumer starts each tile half a step behind the first."""
    if not self.ring:
      pl.when(self.wg == 1)(self._pass_schedule)

  def end_tile(self):
    """The pair: the first consumer catches up with the second at the end of each tile."""
    if not self.ring:
      pl.when(self.wg == 0)(self._pass_schedule)
