"""FlashAttention-3 style prefill (causal or not) for Hopper, in Pallas Mosaic GPU.

Same function as `jaxflash.prefill_attention` (the Pallas-Triton FlashAttention-2 kernel,
whose plain-JAX reference `prefill_reference` this module shares), built the way
FlashAttention-3 (Shah et al., 2024) builds it for sm_90:

* Warp specialisation. A CUDA block (CTA) holds two consumer warpgroups (three for long
  sequences at d = 64), each owning `block_q` query rows, and one producer that only issues
  TMA copies of K and V tiles into a `num_stages`-deep shared-memory ring. Each ring slot has a "ready" barrier
  (the TMA completes it) and a "free" barrier (both consumers arrive once they have read
  it); the producer waits on "free" before it overwrites a slot. The producer gives its
  registers away (setmaxnreg) so the consumers can hold a 64 x 128 float32 accumulator and
  a 64 x block_kv score tile each.
* wgmma for both products: S = Q K^T from shared memory into float32 registers, O += P V
  with P (bf16/fp16) straight from registers.
* Ping-pong. The consumers take turns, in a ring of hardware named barriers (the default
  for d = 128 and 256, and with three consumers) or on one two-arrival mbarrier: while one
  runs its softmax on the CUDA cores, another's wgmma runs on the tensor cores
  (FlashAttention-3, section 3.1, "pingpong scheduling").
* Intra-warpgroup overlap (section 3.2; default for d = 128 and 256): a consumer's turn
  issues QK^T of block j together with PV of block j - 1, and P is converted to bf16/fp16
  only after the PV wait (registers a running wgmma reads must not be written before it
  completes). ptxas moves that wait ahead of the exponentials, so the softmax runs after
  the PV, hidden behind the other consumer's turn; keeping it before the wait was slower
  (bench/PERFORMANCE.md).
* Conditional rescaling (FlashAttention-4; d = 256): a row's running max, and with it the
  accumulator's rescale, changes only when a block's max exceeds it by more than a factor
  2^8; a warp whose rows all kept theirs skips the multiply.
* For d <= 128 the output tile has a shared-memory buffer of its own, so the next tile's
  Q load is issued before this tile's epilogue instead of after its store.
* Row sums out of PV (d = 64 from 8192 keys): with V transposed and 8 rows of ones below
  it, PV's wgmma also writes P's row sums, and the CUDA cores skip one add a score.
* A fixed softmax reference (bf16, long sequences): in the key blocks a row sees whole, the
  exponentials subtract the first key block's row max instead of a running max, so those
  steps compute no row max and never rescale (any reference gives the same softmax; the
  running max of FlashAttention-2 only keeps exp2 in range). Rows that then overflow
  float32 are flagged by a NaN LSE, and a second pass of this kernel recomputes their query
  tiles, and only those, with the running max, in place.
* Online softmax in base 2 with the scale folded into one multiply-add (scores times
  scale * log2 e, minus the running max), exp2 lowered to ex2.approx; the output is divided
  by the running sum once, at the end (FlashAttention-2, section 3.1.1).
* Causal attention and sliding windows are loop bounds (jaxflash.score_mods.key_blocks, as
  in the Triton prefill): per consumer, the key blocks every row sees whole run unmasked,
  the blocks that straddle the diagonal, a window edge or the end of the valid keys run
  masked, and the blocks outside are never loaded, so a window w costs O(n w). The bounds
  are computed in the kernel from the per-sequence lengths (data, not shapes: no
  recompiles).
* Persistent CTAs (FlashAttention-3, section 3.1's tile scheduler): one CTA per SM walks
  the query tiles, longest under the causal mask first, heads varying fastest so that CTAs
  resident together read the same KV head (GQA: one KV tile in L2 serves its query heads; K
  and V are never repeated). The tiles are dealt out in a snake (CTA 0 .. G - 1, then back),
  which keeps the longest-first order balanced, and the producer's K/V ring runs on from one
  tile into the next, so a tile's first loads overlap the last one's final steps and store.

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
from jaxflash.device import DeviceInfo, device_info
from jaxflash.prefill import prefill_reference
from jaxflash.score_mods import ScoreMods, key_blocks

NUM_CONSUMERS = 2  # consumer warpgroups per CTA by default (FlashAttention-3's ping-pong pair)
REGISTER_FILE = 65536  # 32-bit registers per SM (and per CTA: one CTA per SM)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SWIZZLE_BYTES = 128
WARPGROUP_THREADS = 128
SCHEDULE_ID = 8  # first hardware named barrier of the ping-pong (Mosaic GPU uses the low IDs)
# conditional_rescale: the running max moves only when a block's row max exceeds it by more
# than this (base 2: probabilities up to 2^8), as FlashAttention-4 does.
RESCALE_THRESHOLD = 8.0
SMEM_RESERVE = 1024  # barriers (no reduction scratch: row reductions stay inside a warp)
ROW_SUM_COLUMNS = 8  # tensor_core_row_sums: rows of ones below V^T (wgmma's N steps by 8)


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
  """Tiles of the Mosaic prefill: `block_q` query rows per consumer warpgroup (a CTA holds
  num_consumers * block_q), `block_kv` keys per step, `num_stages` K/V tiles in flight.

  `auto_barriers`: let Pallas insert its conservative barriers around shared-memory loads
  and stores. Off by default: every shared-memory region here is either written by TMA and
  read by wgmma, or written once by the consumer that then stores it, the two conditions
  under which Pallas documents `unsafe_no_auto_barriers` as safe.

  `named_schedule`: the ping-pong on two hardware named barriers (bar.arrive on the other
  consumer's, bar.sync on one's own) instead of one two-arrival mbarrier.

  `persistent`: one CTA per SM walks the query tiles (longest first, dealt out in a snake),
  its K/V ring running on from one tile into the next, instead of one CTA per tile.

  `overlap_softmax`: FlashAttention-3's intra-warpgroup overlap on top of the named-barrier
  ping-pong: each turn on the tensor cores issues QK^T of block j and PV of block j - 1,
  and the softmax of block j runs while that PV is still in flight.

  `separate_output`: the output tile gets its own shared-memory buffer instead of reusing
  the Q tile's, so the next tile's Q load is issued before this tile's epilogue.

  `conditional_rescale`: FlashAttention-4's conditional rescaling: a row keeps its running
  max until a block's exceeds it by more than a factor 2^8, and a warp skips the
  accumulator's rescale when none of its rows moved. It pays where the accumulator is wide
  against the score tile (d = 256 with 64-key blocks); at d = 64 and 128 the branch costs
  more than the multiply it saves.

  `num_consumers`: consumer warpgroups per CTA, taking turns on the tensor cores in a ring
  (2 or 3; 3 needs the named-barrier schedule with the overlap). With three, each one's
  softmax has two others' turns to hide behind instead of one, for a smaller share of the
  register file (FlashAttention-3 uses three at d = 64).

  `tensor_core_row_sums` (needs the overlap): the softmax's row sums come out of PV itself.
  V is laid out transposed, [H + 8, S] per KV head with 8 rows of ones below it (one pass over
  V before the kernel), so PV's wgmma (N = H + 8, 1/16 more work at d = 128) also writes P
  times ones, the row sums, into 8 more accumulator columns that the online softmax rescales
  with the rest; the CUDA cores, whose instruction stream sets the pace, skip one add a
  score. The sums are then those of P as rounded to bf16/fp16, the very weights PV applies.

  `fixed_reference` (needs the overlap): in the key blocks every row of a consumer sees
  whole, the exponentials subtract a reference fixed by the tile's first key block instead
  of the running max, so those steps compute no row max and never rescale the accumulator
  (the softmax is the same for any reference; FlashAttention-2's running max only keeps
  exp2 in range). Rows whose probabilities then overflow float32 (a later score above the
  first block's largest by 2^128, or P V past float32's range) are flagged and recomputed,
  with the running max, by a second pass over the flagged tiles alone."""

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  auto_barriers: bool = False
  named_schedule: bool = False
  persistent: bool = False
  overlap_softmax: bool = False
  separate_output: bool = False
  conditional_rescale: bool = False
  num_consumers: int = NUM_CONSUMERS
  tensor_core_row_sums: bool = False
  fixed_reference: bool = False

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    row_tiles = (1 + self.separate_output) * self.num_consumers * self.block_q
    tiles = row_tiles + 2 * self.num_stages * self.block_kv
    lse = 4 * self.num_consumers * self.block_q
    ones = itemsize * ROW_SUM_COLUMNS * self.num_stages * self.block_kv * self.tensor_core_row_sums
    return itemsize * head_dim * tiles + lse + ones + SMEM_RESERVE



C = MosaicPrefillConfig
# Head-dim bucket -> candidates, best first; tuned on the H200 with bench/mosaic_sweep.py
# (B = 1, 12 / 2 heads, bf16, causal; TFLOP/s). 2026-12-01, d = 128, one CTA per tile, at
# 8192 / 32768: 64x128x2 566 / 642, 64x128x3 558 / 573, 64x192x2 521 / 619, 64x256x1 542 /
# 617, 64x64x2 479 / 560; d = 64 at 8192: 64x128x2 391, 64x128x4 388, 64x64x4 328; d = 256 at
# 8192: 64x64x2 607, 64x128x1 595, 64x64x1 567. 2026-12-02, persistent, in one run
# (results/h200/mosaic_sweep_named_handoff.log), the mbarrier / named-barrier ping-pong: d = 128
# 644 / 662 and 655 / 670 at 8192 / 32768; d = 64 450 / 433 and d = 256 673 / 676 at 8192.
# 2026-12-02 (results/h200/mosaic_sweep_overlap.log), named ping-pong alone / with the
# separate output buffer / with the intra-warpgroup overlap / with both, at 8192 / 16384 /
# 32768: d = 128 663 / 680 / 654, 671 / 685 / 659, 664 / 685 / 662, 673 / 696 / 671 (64x128x3
# with the overlap 699 / 675 at 16384 / 32768 against 710 / 687 for 64x128x2 with both;
# 64x192x2 with the overlap spills, 431); d = 256 at 8192 682 against 697 with the overlap; d
# = 64 at 8192 448 (mbarrier) against 440 with the separate buffer and 418 / 412 with the
# overlap. block_q stays 64: one wgmma M tile per consumer keeps its accumulator and score
# tile in registers. 2026-12-02, the same, with conditional rescaling against without, at 8192:
# d = 256 731 against 694 (738 / 704 against 696 / 665 at 16384 / 32768); d = 128 664 against
# 671 (652 / 668 at 32768); d = 64 399 against 448 (results/h200/mosaic_sweep_overlap.log, runs 5, 6).
_CONFIGS = {
    64: [C(64, 128, 2, persistent=True), C(64, 64, 2, persistent=True)],
    128: [C(64, 128, 2, named_schedule=True, persistent=True, overlap_softmax=True,
            separate_output=True),
          C(64, 128, 2, named_schedule=True, persistent=True, overlap_softmax=True),
          C(64, 64, 2, persistent=True)],
    256: [C(64, 64, 2, named_schedule=True, persistent=True, overlap_softmax=True,
            conditional_rescale=True)],
}
# Head-dim bucket -> (keys from which it pays, config tried first). Three consumers at d = 64,
# against the first _CONFIGS[64] entry (same process, 2026-12-02, mosaic_sweep_overlap.log run
# 12), TFLOP/s at 1024 / 2048 / 4096 / 8192 / 16384 / 32768 keys: 84 / 201 / 365 / 448 / 499 /
# 527 against 123 / 291 / 381 / 441 / 469 / 479. At d = 128 (64-key blocks, since 64 x 128
# score tiles spill in a third of the register file) 588 / 631 against 670 / 686 at 8192 /
# 32768. With the row sums from PV (2026-12-03, mosaic_sweep_overlap.log run 16; V^T's pass
# included): d = 64 454 / 543 against 444 / 516 at 8192 / 32768; d = 128 within 1% at 8192 ...
# 32768 and 401 against 443 at 2048, so it is not taken there. The fixed reference (bf16 only;
# its second pass included; mosaic_sweep_overlap.log run 19, 2026-12-03), against the entries
# without it, at 2048 / 4096 / 8192 / 16384 / 32768 keys: d = 128 416 / 586 / 718 / 764 / 736
# against 431 / 553 / 663 / 696 / 655; d = 256 515 / 644 / 791 / 798 / 769 against 497 / 601 /
# 726 / 708 / 681; d = 64 (three consumers) 497 / 590 / 617 against 454 / 520 / 537 from 8192.
_LONG_SEQUENCE_CONFIGS = {
    64: (8192, C(64, 128, 2, named_schedule=True, persistent=True, overlap_softmax=True,
                 separate_output=True, num_consumers=3, tensor_core_row_sums=True,
                 fixed_reference=True)),
    128: (4096, C(64, 128, 2, named_schedule=True, persistent=True, overlap_softmax=True,
                  separate_output=True, fixed_reference=True)),
    256: (2048, C(64, 64, 2, named_schedule=True, persistent=True, overlap_softmax=True,
                  conditional_rescale=True, fixed_reference=True)),
}


def _registers(num_consumers: int) -> tuple[int, int]:
  """setmaxnreg per (consumer, producer) thread: the producer keeps few, the consumers share
  the rest of the register file (multiples of 8, at most 256 by setmaxnreg's rules)."""
  producer = 40 if num_consumers == 2 else 24
  per_consumer = (REGISTER_FILE // WARPGROUP_THREADS - producer) // num_consumers
  return min(256, per_consumer // 8 * 8), producer


def _bucket(head_dim: int) -> int:
  return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def mosaic_prefill_config(head_dim: int, dtype, info: DeviceInfo | None = None,
                          num_keys: int | None = None) -> MosaicPrefillConfig:
  """The tuned config for this head dim and dtype (and, when given, this many keys per
  sequence): the first candidate that fits `info`'s shared memory (default: this GPU)."""
  info = info or device_info()
  itemsize = jnp.dtype(dtype).itemsize
  bucket = _bucket(head_dim)
  candidates = list(_CONFIGS[bucket])
  if bucket in _LONG_SEQUENCE_CONFIGS and num_keys is not None:
    min_keys, long_config = _LONG_SEQUENCE_CONFIGS[bucket]
    if num_keys >= min_keys:
      candidates.insert(0, long_config)
  for config in candidates:
    if config.fixed_reference and jnp.dtype(dtype) != jnp.bfloat16:
      config = dataclasses.replace(config, fixed_reference=False)
    if config.smem_bytes(head_dim, itemsize) <= info.smem_per_block:
      return config
  raise ValueError(f"no Mosaic prefill config fits {info.name}'s {info.smem_per_block} bytes of "
                   f"shared memory for head_dim={head_dim}")


def _check_config(config, head_dim: int, dtype, info: DeviceInfo) -> None:
  if not isinstance(config, MosaicPrefillConfig):
    raise TypeError(f"config must be a jaxflash.mosaic.MosaicPrefillConfig, got {type(config).__name__}")
  if config.block_q % 64 or config.block_kv % 64 or not config.block_q or not config.block_kv:
    raise ValueError(f"config.block_q and config.block_kv must be positive multiples of 64 "
                     f"(wgmma tiles, 128-byte swizzle), got {config}")
  if config.num_stages < 2:
    # One slot deadlocks: a consumer that drains a block it does not need waits for that
    # block's V before its turn on the schedule, but with one slot that V is loaded only
    # after the other consumer's PV of the block before, which waits for that very turn
    # (hung in the compiled tests, 2026-12-02; bench/PERFORMANCE.md). Sequences of one key
    # block still run with one slot, which never drains (the ring is never deeper than the
    # keys).
    raise ValueError(f"config.num_stages must be >= 2, got {config}")
  if config.num_consumers not in (2, 3):
    raise ValueError(f"config.num_consumers must be 2 or 3, got {config}")
  if config.num_consumers != 2 and head_dim > 128:
    # A 64 x H float32 accumulator is H / 2 registers a thread: at H > 128 it and a score
    # tile do not fit in the 160 that three consumers get (ptxas: insufficient registers).
    raise ValueError(f"config.num_consumers={config.num_consumers} takes head dims up to 128, got "
                     f"head_dim={head_dim}")
  if config.num_consumers != 2 and not config.overlap_softmax:
    raise ValueError(f"config.num_consumers={config.num_consumers} needs config.overlap_softmax "
                     f"(only its schedule takes turns in a ring), got {config}")
  if config.tensor_core_row_sums and not config.overlap_softmax:
    raise ValueError(f"config.tensor_core_row_sums needs config.overlap_softmax (only its steps "
                     f"take the sums from PV), got {config}")
  if config.tensor_core_row_sums and head_dim + ROW_SUM_COLUMNS > 256:
    raise ValueError(f"config.tensor_core_row_sums takes head dims up to {256 - ROW_SUM_COLUMNS} "
                     f"(wgmma's N = head_dim + {ROW_SUM_COLUMNS} is at most 256), got "
                     f"head_dim={head_dim}")
  if config.fixed_reference and not config.overlap_softmax:
    raise ValueError(f"config.fixed_reference needs config.overlap_softmax (only its steps keep "
                     f"the reference), got {config}")
  if config.fixed_reference and jnp.dtype(dtype) != jnp.bfloat16:
    # Probabilities far below the reference would fall into float16's subnormals (and above
    # it, past 65504), where bfloat16 keeps float32's exponent range.
    raise ValueError(f"config.fixed_reference takes bfloat16 only, got {jnp.dtype(dtype).name}")
  if config.overlap_softmax and not config.named_schedule:
    raise ValueError(f"config.overlap_softmax needs config.named_schedule (its turns are taken on "
                     f"the named barriers), got {config}")
  need = config.smem_bytes(head_dim, jnp.dtype(dtype).itemsize)
  if need > info.smem_per_block:
    raise ValueError(f"{config} needs ~{need} bytes of shared memory for head_dim={head_dim}, over "
                     f"the {info.smem_per_block}-byte budget of a block on {info.name}")


# Options of the shared interface (OPTIONS.md) this kernel does not take: any of them set
# (not None / not the default) is a reason to fall back.
_UNSUPPORTED_OPTIONS = {"bias": None, "mask": None, "logits_soft_cap": None, "sinks": None,
                        "causal_alignment": "bottom_right"}


def supports(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
             info: DeviceInfo | None = None, **options) -> str | None:
  """None when the Mosaic prefill can serve this call, else the reason it cannot.

  query [B, T, N, H], key/value [B, S, K, H] (arrays or ShapeDtypeStructs). `info`
  describes the GPU (default: this process's device; no GPU is a reason). `options` are
  the other keywords of the shared interface (bias, mask, local_window_size,
  logits_soft_cap, sinks, causal_alignment, is_causal, scale, ...); those this kernel
  does not take (all but is_causal, scale and local_window_size) are reasons when set.
  """
  del query_seq_lengths, key_value_seq_lengths  # lengths are always served
  if not _mosaic.AVAILABLE:
    return f"Pallas Mosaic GPU does not import in this JAX ({_mosaic.IMPORT_ERROR})"
  if info is None:
    if not _mosaic.on_gpu():
      return "no GPU: the Mosaic GPU kernel runs compiled on sm_90 only"
    info = device_info()
  major, minor = info.compute_capability
  if major != _mosaic.CAPABILITY_MAJOR:
    return (f"{info.name} is sm_{major}{minor}; the Mosaic GPU kernel needs Hopper, sm_90 "
            "(wgmma, which later GPUs replace with tcgen05)")
  for name, default in _UNSUPPORTED_OPTIONS.items():
    value_ = options.get(name, default)
    if value_ is not None and not (isinstance(default, str) and value_ == default):
      return f"{name}={value_!r} is not supported by the Mosaic prefill"
  for name, x in (("query", query), ("key", key), ("value", value)):
    if getattr(x, "ndim", None) != 4:
      return f"{name} must have rank 4"
    if jnp.dtype(x.dtype) not in DTYPES:
      return f"{name} is {jnp.dtype(x.dtype).name}; the Mosaic prefill takes bfloat16 and float16"
  if not (query.dtype == key.dtype == value.dtype):
    return (f"query, key and value must share one dtype, got {jnp.dtype(query.dtype).name}, "
            f"{jnp.dtype(key.dtype).name} and {jnp.dtype(value.dtype).name}")
  head_dim = query.shape[-1]
  if key.shape[-1] != head_dim or value.shape != key.shape:
    return "key and value must match each other and the query's head dim"
  if head_dim % 64 or not 64 <= head_dim <= 256:
    return f"head_dim={head_dim}; the Mosaic prefill takes multiples of 64 up to 256"
  if key.shape[2] == 0 or query.shape[2] % key.shape[2]:
    return "query heads must be a multiple of key heads"
  try:
    mosaic_prefill_config(head_dim, query.dtype, info)
  except ValueError as e:
    return str(e)
  return None


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _prefill_kernel(
    q_len_ref,  # [B] int32 GMEM: query count per sequence
    kv_len_ref,  # [B] int32 GMEM: key count per sequence
    q_ref,  # [B, T_pad, N, H] GMEM
    k_ref,  # [B, S_pad, K, H] GMEM
    v_ref,  # [B, S_pad, K, H] GMEM, or [B, K, H + 8, S_pad] with rows of ones (tensor_core_row_sums)
    o_ref,  # [B, T_pad, N, H] GMEM
    lse_ref,  # [B, N, T_pad] float32 GMEM: natural-log LSE (seq minor: 1-D TMA stores)
    io_smem,  # ([2, block_q, H],) or twice that, SMEM: each consumer's Q tile, and its
              # output tile (the Q tile's buffer again, unless separate_output)
    k_smem,  # [stages, block_kv, H] SMEM ring
    v_smem,  # [stages, block_kv, H] SMEM ring, or [stages, H + 8, block_kv] (tensor_core_row_sums)
    lse_smem,  # [2, block_q] float32 SMEM
    k_ready, v_ready,  # [stages] barriers: the TMA of a slot landed
    q_ready,  # [2] barriers: a consumer's Q tile landed
    k_free, v_free,  # [stages] barriers, 2 arrivals: both consumers are done with a slot
    schedule,  # barrier, 2 arrivals: the consumers' ping-pong
    *,
    retry_ref=None,  # [B * N * num_q_tiles] int32 GMEM, the second pass only: tiles to redo
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
    named_schedule: bool,
    overlap_softmax: bool,
    conditional_rescale: bool,
    num_consumers: int,
    tensor_core_row_sums: bool,
    fixed_reference: bool,
):
  dtype = q_ref.dtype
  q_smem, o_smem = io_smem[0], io_smem[-1]  # the same buffer unless separate_output
  separate_output = len(io_smem) == 2
  head_dim = q_ref.shape[-1]
  acc_columns = head_dim + ROW_SUM_COLUMNS * tensor_core_row_sums

  def v_tile(slot):
    """PV's right operand [block_kv, H] (or [block_kv, H + 8] from V^T) in ring slot `slot`."""
    return v_smem.at[slot].T if tensor_core_row_sums else v_smem.at[slot]

  wg = lax.axis_index("wg")
  # A CTA serves items item_of(0), item_of(1), ...: all CTAs but the last round's extras
  # serve num_rounds of them.
  num_items = num_heads * batch_size * num_q_tiles
  num_rounds = -(-num_items // num_ctas)

  def item_of(round_):
    """This CTA's work item in a round: CTAs deal the items out in a snake (0 .. G - 1, then
    G - 1 .. 0), so that the longest-first order evens out over the rounds."""
    cta = lax.axis_index("cta")
    return round_ * num_ctas + jnp.where(lax.rem(round_, 2) == 0, cta, num_ctas - 1 - cta)

  num_rounds_here = num_rounds - 1 + (item_of(num_rounds - 1) < num_items).astype(jnp.int32)
  retry = retry_ref is not None

  def tile_of(item):
    """item -> (batch, query tile, head). Items run the longest (causal) query tiles first,
    heads fastest, so that CTAs resident together read the same KV head (GQA: one KV tile in
    L2 serves its query heads; K and V are never repeated)."""
    head = lax.rem(item, num_heads)
    rest = lax.div(item, num_heads)
    return lax.rem(rest, batch_size), num_q_tiles - 1 - lax.div(rest, batch_size), head

  def bounds(batch, q_base):
    """Key blocks (lo, full_lo, full_hi, hi) of rows [q_base, q_base + block_q) of sequence
    `batch`, as score_mods.key_blocks gives them (all zero when no row is valid), and the
    sequence's valid rows, key shift and valid keys."""
    # Query t of this sequence sits at key position t + shift (bottom-right alignment).
    q_len, kv_len = q_len_ref[batch], kv_len_ref[batch]
    q_valid = jnp.minimum(jnp.maximum(q_len, 0), seq_q)
    kv_valid = jnp.minimum(jnp.maximum(kv_len, 0), seq_kv)
    shift = kv_len - q_len
    rows_end = jnp.minimum(q_base + block_q, q_valid)
    blocks = key_blocks(mods, q_base, rows_end - 1, shift, kv_valid, block_kv)
    return [jnp.where(rows_end > q_base, x, 0) for x in blocks], (q_valid, shift, kv_valid)

  def cta_bounds(batch, tile):
    """The key blocks [lo, hi) the producer loads for a query tile: the union of the
    consumers' blocks, from the first consumer's first (its rows are earliest, so a window's
    left edge reaches furthest back) to the latest of their last (under the causal mask the
    later consumers usually need more)."""
    cta_base = tile * (num_consumers * block_q)
    blocks = [bounds(batch, cta_base + w * block_q if w else cta_base)[0]  # (no "+ 0" op)
              for w in range(num_consumers)]
    return blocks[0][0], functools.reduce(jnp.maximum, [b[3] for b in blocks])

  def item_blocks(round_):
    """The key blocks this CTA loads for its item in `round_`: how many, and from which.
    The second pass (retry_ref) loads none for the tiles it skips."""
    batch, tile, head = tile_of(item_of(round_))
    cta_lo, cta_hi = cta_bounds(batch, tile)
    count = cta_hi - cta_lo
    if retry:
      count = jnp.where(retry_ref[(batch * num_heads + head) * num_q_tiles + tile] != 0, count, 0)
    return count, cta_lo

  # The ping-pong, per step of each consumer: `issued` once its QK^T is issued (the other
  # consumer may now run its PV), `softmax_done` before its own PV.
  if named_schedule:
    # Consumer w syncs on hardware barrier SCHEDULE_ID + w, which the one before it in the
    # ring arrives at: one arrive and one sync a step.
    def release():
      if num_consumers == 2:  # the pair's form, as measured (rem gives the same barrier)
        barrier = SCHEDULE_ID + 1 - wg
      else:
        barrier = SCHEDULE_ID + lax.rem(wg + 1, num_consumers)
      _mosaic.named_barrier("arrive", barrier, 2 * WARPGROUP_THREADS)

    def acquire():
      _mosaic.named_barrier("sync", SCHEDULE_ID + wg, 2 * WARPGROUP_THREADS)

    issued = end_turn = release
    start_turn = acquire

    def softmax_done(slot):
      plgpu.barrier_wait(v_ready.at[slot])
      acquire()
  else:
    # One two-arrival mbarrier that both consumers pass twice a step.
    def issued():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    start_turn = end_turn = issued

    def softmax_done(slot):
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(schedule)

  consumer_registers, producer_registers = _registers(num_consumers)

  @pl.when(wg < num_consumers)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    q_tile, o_tile = q_smem.at[wg], o_smem.at[wg]

    def first_row(tile):
      """This consumer's first query row in a query tile."""
      return tile * (num_consumers * block_q) + wg * block_q

    def load_q(item):
      batch, tile, head = tile_of(item)
      q_rows = pl.ds(first_row(tile), block_q)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, q_rows, head], q_tile, q_ready.at[wg])

    if not retry:  # (the second pass loads each tile's Q as it takes the tile)
      load_q(item_of(0))

    def iota(shape, dim):
      return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def rows_bcast(x, shape):
      return lax.broadcast_in_dim(x, shape, [0])

    zero_scores = plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32), plgpu.Layout.WGMMA)

    def attend(round_, ring):
      """One query tile. `ring`: key blocks this CTA consumed before it (ring slot and
      barrier phase continue from there)."""
      count, _ = item_blocks(round_)
      if retry:
        pl.when(count > 0)(lambda: attend_tile(round_, ring))
      else:
        attend_tile(round_, ring)
      return ring + count

    def attend_tile(round_, ring):
      item = item_of(round_)
      batch, tile, head = tile_of(item)
      if retry:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores have read the buffers
        load_q(item)
      q_base = first_row(tile)
      cta_lo, cta_hi = cta_bounds(batch, tile)
      # All consumers start at cta_lo, so that they step through the ring together; the
      # blocks before a later consumer's own window run masked and add nothing.
      (_, full_lo, full_hi, hi), (q_valid, shift, kv_valid) = bounds(batch, q_base)
      hi = jnp.maximum(hi, cta_lo)
      full_lo = jnp.clip(full_lo, cta_lo, hi)
      full_hi = jnp.clip(full_hi, full_lo, hi)

      def slot_of(j):
        return lax.rem(ring + j - cta_lo, num_stages)

      plgpu.barrier_wait(q_ready.at[wg])
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
      l_i = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
      # With tensor_core_row_sums, columns H and up hold the row sums (all equal).
      acc = plgpu.layout_cast(jnp.zeros((block_q, acc_columns), jnp.float32), plgpu.Layout.WGMMA)

      if not overlap_softmax:  # (with the overlap, each turn waits for its own blocks)
        @pl.when(hi > cta_lo)
        def _():
          plgpu.barrier_wait(k_ready.at[slot_of(cta_lo)])

        if named_schedule:
          # A hardware barrier only counts arrivals: had the first consumer run on into this
          # tile, its first arrival on the second's barrier could join the last one of the
          # tile before, both before the second synced, and complete it without the second.
          # So from its second tile on, the first waits for the second's hand-off (below).
          pl.when((wg == 0) & (round_ > 0))(lambda: _mosaic.named_barrier(
              "sync", SCHEDULE_ID, 2 * WARPGROUP_THREADS))
        pl.when(wg == 1)(start_turn)  # the second consumer starts half a step behind

      def softmax(s, m_i, l_i, j, *, masked: bool):
        """Scores s [block_q, block_kv] of key block j -> (P float32, the new running max,
        alpha that rescales what was summed before (None: nothing to rescale), the new running
        sum; l_i as it is when PV sums P)."""
        if fixed_reference and not masked:
          # m_i stays the reference: no row max, no rescale (an overflow shows in l or acc at
          # the end of the tile, which is then recomputed).
          p = jnp.exp2(s * qk_scale - rows_bcast(m_i, s.shape))
          return p, m_i, None, l_i if tensor_core_row_sums else l_i + p.sum(axis=1)
        if masked:
          # Key s is visible to row r (at position p = q_base + r + shift) when s < kv_valid
          # and p - left <= s <= p + right: one or two compares per score.
          shape = (block_q, block_kv)
          keys = iota(shape, 1) + j * block_kv
          rows = iota(shape, 0)
          if mods.right is None:
            visible = keys < kv_valid
          else:
            visible = keys <= jnp.minimum(rows + (q_base + shift + mods.right), kv_valid - 1)
          if mods.left is not None:
            visible &= keys >= rows + (q_base + shift - mods.left)
          s = jnp.where(visible, s, -jnp.inf)
        # m is kept in scaled units so p = exp2(s * c - m) is one FMA per score.
        m_block = s.max(axis=1) * qk_scale
        if conditional_rescale:
          # A row keeps its running max until the block's is more than RESCALE_THRESHOLD
          # above it: p <= 2^threshold stays well inside float32 and bf16, and the output and
          # LSE are the same (both use the max that was kept).
          m_new = jnp.where(m_block > m_i + RESCALE_THRESHOLD, m_block, m_i)
        else:
          m_new = jnp.maximum(m_i, m_block)
        # A row that has seen no key keeps m = -inf; subtract 0 instead (no -inf - -inf).
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m_i - m_safe)
        p = jnp.exp2(s * qk_scale - rows_bcast(m_safe, s.shape))
        if tensor_core_row_sums:
          return p, m_new, alpha, l_i
        return p, m_new, alpha, l_i * alpha + p.sum(axis=1)

      def rescale(acc, alpha):
        """acc [block_q, H] times alpha [block_q] per row: skipped by the warps whose rows
        all kept their max under conditional_rescale."""
        if conditional_rescale:
          return _mosaic.scale_rows_if_any(acc, alpha)
        return acc * rows_bcast(alpha, acc.shape)

      def scores(slot):
        """S = Q K^T [block_q, block_kv] float32 of the key block in `slot`, which is then
        released; the other consumer may run its PV as soon as the QK^T is issued."""
        def qk(s_ref):
          plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].T)
          issued()
          return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        return s

      def step(j, carry, *, masked: bool):
        acc, m_i, l_i = carry  # [block_q, H], [block_q], [block_q] float32
        slot = slot_of(j)
        p, m_new, alpha, l_i = softmax(scores(slot), m_i, l_i, j, masked=masked)
        acc = rescale(acc, alpha)
        p_tile = p.astype(dtype)
        # Keep the softmax before the barrier (the order decides the overlap).
        acc, l_i, m_new, p_tile = lax.optimization_barrier((acc, l_i, m_new, p_tile))
        softmax_done(slot)  # the tensor cores are ours again

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p_tile, v_tile(slot))

          @pl.when(j + 1 < hi)
          def _():
            plgpu.barrier_wait(k_ready.at[slot_of(j + 1)])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # the accumulator stays in its registers
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l_i

      # overlap_softmax (FlashAttention-3, section 3.2): a turn on the tensor cores issues
      # QK^T of block j and PV of block j - 1, and the softmax of block j runs while that PV
      # is in flight. Each consumer takes cta_hi - cta_lo + 1 turns per tile: block cta_lo's
      # QK^T, one per later block, the last block's PV, one per drained block (and one
      # empty turn when it has no block of its own).
      def first_block(_, carry):
        acc, m_i, l_i, _ = carry
        slot = slot_of(cta_lo)
        plgpu.barrier_wait(k_ready.at[slot])
        acquire()
        # acc is still zero: nothing to rescale. (issued() is release() on named barriers.)
        p, m_i, _, l_i = softmax(scores(slot), m_i, l_i, cta_lo, masked=True)
        return acc, m_i, l_i, p.astype(dtype)

      def overlapped_step(j, carry, *, masked: bool):
        acc, m_i, l_i, p_prev = carry  # p_prev [block_q, block_kv]: P of block j - 1
        rescales = not (fixed_reference and not masked)  # else softmax gives no alpha
        slot, prev = slot_of(j), slot_of(j - 1)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[prev])
        acquire()

        def body(refs):
          acc_ref, s_ref, p_ref, m_ref, l_ref, alpha_ref = refs
          plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].T)
          plgpu.wgmma(acc_ref, p_prev, v_tile(prev))
          release()
          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # QK^T landed, PV may still run
          plgpu.barrier_arrive(k_free.at[slot])
          # P stays float32 here: registers that the running PV reads (p_prev) must not be
          # written before it completes, so P is converted after the wait, as in
          # FlashAttention-3. The barrier keeps the softmax ahead of that wait.
          p, m_new, alpha, l_new = softmax(s, m_i, l_i, j, masked=masked)
          if not rescales:  # (the ref still takes a value)
            alpha = m_new
          p_ref[...], m_ref[...], alpha_ref[...], l_ref[...] = lax.optimization_barrier(
              (p, m_new, alpha, l_new))

        acc, _, p, m_new, l_new, alpha = pl.run_state(body)(
            (plgpu.ACC.init(acc), plgpu.ACC.init(zero_scores), zero_scores, m_i, l_i, m_i))
        plgpu.barrier_arrive(v_free.at[prev])
        if rescales:
          acc = rescale(acc, alpha)
        return acc, m_new, l_new, p.astype(dtype)

      def last_pv(_, carry):
        acc, m_i, l_i, p = carry
        slot = slot_of(hi - 1)
        plgpu.barrier_wait(v_ready.at[slot])
        acquire()

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p, v_tile(slot))
          release()

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_i, l_i, p

      def empty_turn():
        acquire()
        release()

      def drain(j, _):
        # Blocks the other consumer still needs: wait for them too (each barrier's phase is
        # tracked per consumer and must stay in step for the next tile), release them, and
        # keep the schedule's count.
        slot = slot_of(j)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        if overlap_softmax:
          empty_turn()
        elif named_schedule:
          issued()
          acquire()
        else:
          issued()
          issued()

      # Blocks [cta_lo, full_lo) and [full_hi, hi) straddle a window edge, the diagonal or
      # the end of the keys and run masked; every row sees all of [full_lo, full_hi).
      if overlap_softmax:
        has_blocks = (hi > cta_lo).astype(jnp.int32)
        pl.when(hi == cta_lo)(empty_turn)
        p0 = plgpu.layout_cast(jnp.zeros((block_q, block_kv), dtype), plgpu.Layout.WGMMA)
        carry = lax.fori_loop(0, has_blocks, first_block, (acc, m_i, l_i, p0))
        start = cta_lo + 1  # block cta_lo ran masked in first_block
        if mods.left is not None:
          carry = lax.fori_loop(start, jnp.maximum(full_lo, start),
                                functools.partial(overlapped_step, masked=True), carry)
        carry = lax.fori_loop(jnp.maximum(full_lo, start), jnp.maximum(full_hi, start),
                              functools.partial(overlapped_step, masked=False), carry)
        carry = lax.fori_loop(jnp.maximum(full_hi, start), hi,
                              functools.partial(overlapped_step, masked=True), carry)
        acc, m_i, l_i, _ = lax.fori_loop(0, has_blocks, last_pv, carry)
      else:
        carry = (acc, m_i, l_i)
        if mods.left is not None:
          carry = lax.fori_loop(cta_lo, full_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
      lax.fori_loop(hi, cta_hi, drain, None)
      next_item = item_of(round_ + 1)
      if not overlap_softmax:
        pl.when(wg == 0)(end_turn)
        if named_schedule:
          # The hand-off: the second consumer has synced for the last time in this tile.
          pl.when((wg == 1) & (next_item < num_items))(lambda: _mosaic.named_barrier(
              "arrive", SCHEDULE_ID, 2 * WARPGROUP_THREADS))

      if separate_output:
        if not retry:
          # Every QK^T of this tile has been waited for: the Q buffer is free already.
          pl.when(next_item < num_items)(lambda: load_q(next_item))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have read
                                                         # the output buffers
      if tensor_core_row_sums:  # the sums' columns are equal: any one is the row sum
        acc, l_i = acc[:, :head_dim], acc[:, head_dim:].max(axis=1)
      if fixed_reference:
        # Probabilities that overflowed leave inf or NaN in l or acc (x * 0 is NaN for
        # those alone): the row's LSE is NaN, and the second pass recomputes its tile.
        overflowed = (l_i * 0.0 + (acc * 0.0).sum(axis=1)) != 0.0
      # FlashAttention-2 divides once, here. Rows that saw no key, and padding rows, give
      # exact zeros (their LSE is set to -inf outside, where the lengths are at hand).
      attended = l_i > 0.0
      inv_l = 1.0 / jnp.where(attended, l_i, 1.0)
      shape = (block_q, head_dim)
      keep = (iota(shape, 0) < q_valid - q_base) & rows_bcast(attended, shape)
      o_tile[...] = jnp.where(keep, acc * rows_bcast(inv_l, shape), 0.0).astype(dtype)
      # m and log2(l) are base 2: ln 2 converts back to the natural-log LSE.
      lse = jnp.where(attended, m_i * LN_2 + jnp.log(jnp.where(attended, l_i, 1.0)), -jnp.inf)
      lse_smem[wg] = jnp.where(overflowed, jnp.nan, lse) if fixed_reference else lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_tile, o_ref.at[batch, pl.ds(q_base, block_q), head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(q_base, block_q)])

      if not (separate_output or retry):
        @pl.when(next_item < num_items)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the buffers
          load_q(next_item)

    if overlap_softmax:
      # Turns go round strictly (first, second, ..., last, first, ...) across tiles: the last
      # consumer lets the first take the first turn, and the first absorbs the last one's
      # final release at the end. (A hardware barrier only counts arrivals: the strict order
      # is what keeps two arrivals of one consumer from completing another's barrier.)
      pl.when(wg == num_consumers - 1)(release)
    lax.fori_loop(0, num_rounds_here, attend, jnp.int32(0))
    if overlap_softmax:
      pl.when(wg == 0)(acquire)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == num_consumers)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")

    def produce(round_, ring):
      batch, tile, head = tile_of(item_of(round_))
      kv_head = lax.div(head, group)
      count, cta_lo = item_blocks(round_)

      @pl.loop(0, count)
      def _(j):
        # The ring's (ring + j)-th load: its slot is free once both consumers released the
        # load num_stages before it (the first num_stages loads find it empty).
        load, slot = ring + j, lax.rem(ring + j, num_stages)
        keys = pl.ds((cta_lo + j) * block_kv, block_kv)
        rows = (batch, keys, kv_head)
        v_rows = (batch, kv_head, slice(None), keys) if tensor_core_row_sums else rows
        pl.when(load >= num_stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
        pl.when(load >= num_stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
        plgpu.copy_gmem_to_smem(v_ref.at[v_rows], v_smem.at[slot], v_ready.at[slot])

      return ring + count

    lax.fori_loop(0, num_rounds_here, produce, jnp.int32(0))


@functools.partial(
    jax.jit, static_argnames=("scale", "is_causal", "local_window_size", "return_residual", "config",
                              "interpret"))
def prefill_attention(query, key, value, query_seq_lengths=None, key_value_seq_lengths=None, *,
                      scale=None, is_causal=False, local_window_size=None, return_residual=False,
                      config: MosaicPrefillConfig | None = None, interpret: bool | None = None):
  """FlashAttention-3 style forward pass on sm_90 (Pallas Mosaic GPU).

  query [B, T, N, H]; key, value [B, S, K, H] with N a multiple of K (query head n reads
  KV head n // (N // K)); bf16 or fp16, one dtype; H a multiple of 64 up to 256.
  query_seq_lengths, key_value_seq_lengths: optional int [B]. Rows t >= q_len[b] are
  padding (zeros out, LSE -inf), keys s >= kv_len[b] are ignored. Query t sits at key
  position p = t + kv_len_b - q_len_b (bottom-right); `is_causal` keeps keys s <= p and
  `local_window_size` w or (left, right) keeps p - left <= s <= p + right, the key blocks
  outside never loaded. Returns out [B, T, N, H] in the query's dtype, and with
  `return_residual` the natural-log LSE [B, T, N] float32 too: the same function as
  `jaxflash.prefill_attention`.

  config: a MosaicPrefillConfig (default: the tuned `mosaic_prefill_config(H, dtype,
    num_keys=S)`).
  interpret: Mosaic GPU's interpret mode (default: when there is no GPU). It cannot run
    this kernel yet (`jaxflash._mosaic.INTERPRET_GAPS`), so True, or no GPU, raises
    NotImplementedError; the Pallas-Triton `jaxflash.prefill_attention` runs anywhere.
  """
  _checks.check_qkv(query, key, value)
  _checks.check_same_batch(query, key)
  batch, seq_q, num_heads, head_dim = query.shape
  seq_kv, num_kv_heads = key.shape[1], key.shape[2]
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  if not _mosaic.AVAILABLE:
    raise NotImplementedError(f"Pallas Mosaic GPU does not import here: {_mosaic.IMPORT_ERROR}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if jnp.dtype(x.dtype) not in DTYPES:
      raise TypeError(f"{name} must be bfloat16 or float16 for the Mosaic prefill, got "
                      f"{jnp.dtype(x.dtype).name} {tuple(x.shape)}")
  if not query.dtype == key.dtype:
    raise TypeError(f"query and key must share one dtype for the Mosaic prefill, got "
                    f"{jnp.dtype(query.dtype).name} and {jnp.dtype(key.dtype).name}")
  if head_dim % 64 or head_dim > 256:
    raise ValueError(f"the Mosaic prefill takes head dims that are multiples of 64 up to 256, "
                     f"got query {tuple(query.shape)}")
  scale = _checks.default_scale(scale, head_dim)
  mods = ScoreMods.from_options(is_causal=is_causal, local_window_size=local_window_size)
  info = device_info()
  if config is None:
    config = mosaic_prefill_config(head_dim, query.dtype, info, num_keys=seq_kv)
  else:
    _check_config(config, head_dim, query.dtype, info)

  if 0 in (batch, seq_q, num_heads) or seq_kv == 0:
    out = jnp.zeros(query.shape, query.dtype)
    lse = jnp.full(query.shape[:3], -jnp.inf, jnp.float32)
    return (out, lse) if return_residual else out

  block_q, block_kv = config.block_q, config.block_kv
  num_consumers = config.num_consumers
  q_rows = num_consumers * block_q
  seq_q_pad, seq_kv_pad = _round_up(seq_q, q_rows), _round_up(seq_kv, block_kv)
  q = query if seq_q_pad == seq_q else jnp.pad(query, ((0, 0), (0, seq_q_pad - seq_q), (0, 0), (0, 0)))
  kv_pad = ((0, 0), (0, seq_kv_pad - seq_kv), (0, 0), (0, 0))
  k = key if seq_kv_pad == seq_kv else jnp.pad(key, kv_pad)
  v = value if seq_kv_pad == seq_kv else jnp.pad(value, kv_pad)
  q_len = jnp.full((batch,), seq_q, jnp.int32) if q_lengths is None else q_lengths
  if kv_lengths is not None:
    # TMA copies whole tiles: values past a sequence's keys reach the tensor cores as they
    # are. Their probabilities are exact zeros, but 0 * NaN is NaN, so they are zeroed here
    # (one pass over V, only when lengths are given). Keys need nothing: their scores are
    # replaced by -inf, whatever they were.
    v = jnp.where((jnp.arange(seq_kv_pad)[None, :] < kv_lengths[:, None])[:, :, None, None], v, 0)
  kv_len = jnp.full((batch,), seq_kv, jnp.int32) if kv_lengths is None else kv_lengths
  num_q_tiles = seq_q_pad // q_rows
  num_stages = min(config.num_stages, seq_kv_pad // block_kv)  # no deeper ring than keys
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
      plgpu.Barrier(num_barriers=num_stages),
      plgpu.Barrier(num_barriers=num_stages),
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
      unsafe_no_auto_barriers=not config.auto_barriers)
  # The fixed reference needs every row to have seen a key before its first whole block;
  # with a window's left edge a row may not have, so windows keep the running max.
  fixed_reference = config.fixed_reference and mods.left is None

  @jax.custom_batching.custom_vmap
  def run_kernels(q_len, kv_len, q, k, v):
    """The kernel on [B, ...] operands, and with the fixed reference its second pass."""
    batch = q.shape[0]
    num_items = num_heads * batch * num_q_tiles
    # Persistent: one CTA per SM (its registers hold no second one) walks the items; else
    # one CTA per item, launched longest first.
    num_ctas = min(info.sm_count, num_items) if config.persistent else num_items
    kernel = functools.partial(
        _prefill_kernel, qk_scale=scale * LOG2_E, mods=mods, block_q=block_q,
        block_kv=block_kv, num_stages=num_stages, seq_q=seq_q, seq_kv=seq_kv,
        num_q_tiles=num_q_tiles, num_heads=num_heads, batch_size=batch, num_ctas=num_ctas,
        group=num_heads // num_kv_heads, named_schedule=config.named_schedule,
        overlap_softmax=config.overlap_softmax,
        conditional_rescale=config.conditional_rescale, num_consumers=num_consumers,
        tensor_core_row_sums=config.tensor_core_row_sums, fixed_reference=fixed_reference)
    kernel.__name__ = "mosaic_prefill"  # the name profiles show
    out_type = (jax.ShapeDtypeStruct(q.shape, query.dtype),
                jax.ShapeDtypeStruct((batch, num_heads, seq_q_pad), jnp.float32))
    mesh = dict(grid=(num_ctas,), grid_names=("cta",), num_threads=num_consumers + 1,
                thread_name="wg")
    out, lse = plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch,
                            compiler_params=compiler_params, **mesh)(q_len, kv_len, q, k, v)
    if not fixed_reference:
      return out, lse
    # Second pass: the tiles with a row whose fixed reference overflowed (NaN LSE), and
    # only those, run again with the running max, written over the first pass's out and LSE.
    rows_valid = jnp.arange(seq_q_pad)[None, :] < jnp.clip(q_len, 0, seq_q)[:, None]  # [B, T_pad]
    overflowed = jnp.isnan(lse) & rows_valid[:, None, :]  # [B, N, T_pad]
    retry = overflowed.reshape(batch, num_heads, num_q_tiles, q_rows).any(axis=-1)
    retry = retry.astype(jnp.int32).reshape(-1)  # [B * N * tiles]

    def recompute(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, retry_ref, o_ref, lse_ref):
      pl.run_scoped(
          lambda *scratch_refs: kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                                       *scratch_refs, retry_ref=retry_ref, fixed_reference=False),
          *scratch, collective_axes="wg")

    def second_pass(refs):
      # pl.kernel (not plgpu.kernel) takes the output refs as operands: it writes into the
      # first pass's buffers in place.
      o_ref, lse_ref = refs
      pl.kernel(recompute, out_type=(), mesh=plgpu.Mesh(**mesh), compiler_params=compiler_params,
                name="mosaic_prefill_recompute")(q_len, kv_len, q, k, v, retry, o_ref, lse_ref)

    return pl.run_state(second_pass)((out, lse))

  @run_kernels.def_vmap
  def _vmap_rule(axis_size, in_batched, *args):
    # Under jax.vmap the mapped axis joins the batch (run_state has no batching rule).
    args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched)]
    out, lse = run_kernels(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
    unfold = lambda x: x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])
    return (unfold(out), unfold(lse)), (True, True)

  out, lse = run_kernels(q_len, kv_len, q, k, v)

  out = out[:, :seq_q]
  if not return_residual:
    return out
  rows_valid = jnp.arange(seq_q)[None, :] < jnp.clip(q_len, 0, seq_q)[:, None]  # [B, T]
  lse = jnp.where(rows_valid[:, :, None], jnp.swapaxes(lse[:, :, :seq_q], 1, 2), -jnp.inf)
  return out, lse


__all__ = ["prefill_attention", "prefill_reference", "supports", "MosaicPrefillConfig",
           "mosaic_prefill_config"]
