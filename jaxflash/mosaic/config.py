"""The Mosaic prefill's tiles and modes (`MosaicPrefillConfig`), its tuned table per head dim,
and the dispatch's question "can this kernel serve the call?" (`supports`)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxflash import _mosaic
from jaxflash.device import DeviceInfo, device_info

NUM_CONSUMERS = 2  # consumer warpgroups per CTA by default (FlashAttention-3's ping-pong pair)
REGISTER_FILE = 65536  # 32-bit registers per SM (and per CTA: one CTA per SM)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
WARPGROUP_THREADS = 128
SWIZZLE_BYTES = 128
SMEM_RESERVE = 1024  # barriers (no reduction scratch: row reductions stay inside a warp)
ROW_SUM_COLUMNS = 8  # tensor_core_row_sums: rows of ones below V^T (wgmma's N steps by 8)


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
  """Tiles of the Mosaic prefill: `block_q` query rows per consumer warpgroup (a CTA holds
  num_consumers * block_q), `block_kv` keys per step, `num_stages` K/V tiles in flight.
  One CTA per SM walks the query tiles (jaxflash.mosaic.pipeline.TileScheduler).

  `overlap_softmax`: FlashAttention-3's intra-warpgroup overlap: the consumers take turns on
  the tensor cores in a ring of hardware named barriers, each turn issues QK^T of block j and
  PV of block j - 1, and the softmax of block j runs while that PV is still in flight.
  Without it, the two consumers take turns on one two-arrival mbarrier (the ping-pong).

  `separate_output`: the output tile gets its own shared-memory buffer instead of reusing
  the Q tile's, so the next tile's Q load is issued before this tile's epilogue.

  `conditional_rescale`: FlashAttention-4's conditional rescaling: a row keeps its running
  max until a block's exceeds it by more than a factor 2^8, and a warp skips the
  accumulator's rescale when none of its rows moved. It pays where the accumulator is wide
  against the score tile (d = 256 with 64-key blocks); at d = 64 and 128 the branch costs
  more than the multiply it saves.

  `num_consumers`: consumer warpgroups per CTA, taking turns on the tensor cores in a ring
  (2 or 3; 3 needs the overlap). With three, each one's softmax has two others' turns to hide
  behind instead of one, for a smaller share of the register file (FlashAttention-3 uses
  three at d = 64).

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
# Head-dim bucket -> candidates, best first (the first that fits the shared memory is taken).
# Tuned on the H200 with bench/studies/mosaic_sweep.py; the figures and the modes measured and dropped
# are in bench/PERFORMANCE.md ("Prefill on Hopper"). block_q stays 64: one wgmma M tile per
# consumer keeps its accumulator and score tile in registers.
_CONFIGS = {
    64: [C(64, 128, 2), C(64, 64, 2)],
    128: [C(64, 128, 2, overlap_softmax=True, separate_output=True),
          C(64, 128, 2, overlap_softmax=True),
          C(64, 64, 2)],
    256: [C(64, 64, 2, overlap_softmax=True, conditional_rescale=True)],
}
# Head-dim bucket -> (keys from which it pays, config tried first): three consumers with the
# row sums from PV at d = 64, and the fixed reference (bf16 only) everywhere.
_LONG_SEQUENCE_CONFIGS = {
    64: (8192, C(64, 128, 2, overlap_softmax=True, separate_output=True, num_consumers=3,
                 tensor_core_row_sums=True, fixed_reference=True)),
    128: (4096, C(64, 128, 2, overlap_softmax=True, separate_output=True, fixed_reference=True)),
    256: (2048, C(64, 64, 2, overlap_softmax=True, conditional_rescale=True, fixed_reference=True)),
}


def registers(num_consumers: int) -> tuple[int, int]:
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


def check_config(config, head_dim: int, dtype, info: DeviceInfo) -> None:
  """ValueError / TypeError naming the field when `config` cannot run at this head dim and
  dtype on `info`."""
  if not isinstance(config, MosaicPrefillConfig):
    raise TypeError(f"config must be a jaxflash.mosaic.MosaicPrefillConfig, got {type(config).__name__}")
  if config.block_q % 64 or config.block_kv % 64 or not config.block_q or not config.block_kv:
    raise ValueError(f"config.block_q and config.block_kv must be positive multiples of 64 "
                     f"(wgmma tiles, 128-byte swizzle), got {config}")
  if config.num_stages < 2:
    # One slot deadlocks: a consumer that drains a block it does not need waits for that
    # block's V before its turn on the schedule, but with one slot that V is loaded only
    # after the other consumer's PV of the block before, which waits for that very turn
    # (bench/PERFORMANCE.md). Sequences of one key block still run with one slot, which
    # never drains (the ring is never deeper than the keys).
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
  logits_soft_cap, sinks, causal_alignment, is_causal, scale, segment_ids,
  kv_segment_ids, ...); those this kernel does not take (all but is_causal, scale,
  local_window_size and the segment ids) are reasons when set.
  """
  del query_seq_lengths, key_value_seq_lengths  # lengths are always served
  reason = device_reason(info)
  if reason is not None:
    return reason
  info = info or device_info()
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


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def device_reason(info: DeviceInfo | None) -> str | None:
  """Why the Mosaic GPU kernels cannot run on `info` (None: this process's GPU), else None."""
  if not _mosaic.AVAILABLE:
    return f"Pallas Mosaic GPU does not import in this JAX ({_mosaic.IMPORT_ERROR})"
  if info is None:
    if not _mosaic.on_gpu():
      return "no GPU: the Mosaic GPU kernels run compiled on sm_90 only"
    info = device_info()
  major, minor = info.compute_capability
  if major != _mosaic.CAPABILITY_MAJOR:
    return (f"{info.name} is sm_{major}{minor}; the Mosaic GPU kernels need Hopper, sm_90 "
            "(wgmma, which later GPUs replace with tcgen05)")
  return None
