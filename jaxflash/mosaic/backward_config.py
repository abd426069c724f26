"""The Mosaic backward's tiles and whether it serves a call.

`MosaicBackwardConfig` (tiles and ring depths of the two kernels in jaxflash/mosaic/backward.py)
with its shared-memory count, the default table, `backward_reason` (the dispatch's check) and
how the dK/dV kernel's grid is cut: CTAs per key block and parts of a GQA group.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxflash.device import DeviceInfo, device_info
from jaxflash.mosaic.config import DTYPES, device_reason, round_up

NUM_CONSUMERS = 2  # consumer warpgroups per CTA: they share each streamed tile
HEAD_DIMS = (64, 128, 256)
SMEM_ALIGNMENT = 1024  # Pallas starts every shared-memory buffer on a 1 KB boundary
BARRIER_BYTES = 8  # an mbarrier, after the buffers


def shares_keys(head_dim: int) -> bool:
  """Whether both consumers of a dK/dV CTA work on the same keys, each keeping half of dK's
  and dV's columns: dK and dV of 64 keys in float32 take head_dim registers a thread, which
  beside the score tiles fit a consumer up to 128."""
  return head_dim > 128


def cta_key_tiles(head_dim: int) -> int:
  """block_kv-key tiles of a dK/dV CTA: one per consumer, or the one both share."""
  return 1 if shares_keys(head_dim) else NUM_CONSUMERS


def out_columns(head_dim: int) -> int:
  """Columns of a float32 staging copy on dK/dV's way out: half the head dim, or 32 (16 KB
  for both consumers' tiles) where the keys are shared and shared memory is tight."""
  return 32 if shares_keys(head_dim) else head_dim // 2


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
  """Tiles of the Mosaic backward. dK/dV kernel: each consumer owns `block_kv` keys (at head
  dims over 128 both share them, each owning half of the columns) and the query blocks of
  `block_q` rows stream through `num_stages` ring slots. dQ kernel: each consumer owns
  `block_q` rows and the key blocks of `block_kv` stream through `dq_stages` slots (None:
  `num_stages`)."""

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2
  dq_stages: int | None = None

  def __post_init__(self):
    if (self.block_q, self.block_kv) != (64, 64):
      # One wgmma M tile (64 rows) per consumer in both kernels (dK and dV are [block_kv, H],
      # dQ is [block_q, H]); two consumers' registers then hold dK, dV and a 64 x 64 score
      # tile at H = 128.
      raise ValueError(f"MosaicBackwardConfig takes block_q=64 and block_kv=64, got "
                       f"block_q={self.block_q}, block_kv={self.block_kv}")
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got num_stages={self.num_stages}")
    if self.dq_stages is None:
      object.__setattr__(self, "dq_stages", self.num_stages)
    if self.dq_stages < 1:
      raise ValueError(f"dq_stages must be >= 1, got dq_stages={self.dq_stages}")

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """The shared memory of the larger of the two kernels (the dQ kernel's where it runs),
    as `_launch` allocates it."""
    def buffers(count, *shape, size=itemsize):  # `count` buffers of `shape`
      return count * round_up(math.prod(shape) * size, SMEM_ALIGNMENT)

    stages, key_tiles = self.num_stages, cta_key_tiles(head_dim)
    dkv = (buffers(2, key_tiles * self.block_kv, head_dim)  # K and V
           + buffers(2, stages, self.block_q, head_dim)  # the Q and dO ring
           + buffers(2, stages, self.block_q, size=4)  # the LSE and delta ring
           + buffers(1, NUM_CONSUMERS, self.block_kv, out_columns(head_dim), size=4)  # staging
           + BARRIER_BYTES * (2 * key_tiles + 5 * stages))
    dq = (buffers(2, NUM_CONSUMERS, self.block_q, head_dim)  # each consumer's Q and dO
          + buffers(4, NUM_CONSUMERS, self.block_q, size=4)  # LSE, delta and two scales
          + buffers(2, self.dq_stages, self.block_kv, head_dim)  # the K and V ring
          + BARRIER_BYTES * (6 * NUM_CONSUMERS + 3 * self.dq_stages))
    return max(dkv, dq)


def mosaic_backward_config(head_dim: int, dtype, info: DeviceInfo | None = None
                           ) -> MosaicBackwardConfig:
  """The default config: 64 x 64 tiles; three ring slots at H = 64, two at H = 128 and 256,
  where the dQ kernel's ring has one (its two consumers' own Q and dO rows take 128 KB)."""
  del info, dtype  # one table for every sm_90 part (all have 227 KB of shared memory)
  if head_dim > 128:
    return MosaicBackwardConfig(64, 64, 2, dq_stages=1)
  return MosaicBackwardConfig(64, 64, 2) if head_dim > 64 else MosaicBackwardConfig(64, 64, 3)


def backward_reason(query, key, value, *, info: DeviceInfo | None = None, is_causal=False,
                    local_window_size=None, logits_soft_cap=None, bias=None, mask=None,
                    sinks=None, causal_alignment="bottom_right", segment_ids=None,
                    kv_segment_ids=None, **_) -> str | None:
  """None when `mosaic_backward` serves this call, else why not (the dispatch then runs the
  Pallas-Triton backward). query [B, T, N, H], key/value [B, S, K, H] (arrays or
  ShapeDtypeStructs); `info` describes the GPU (default: this process's; no GPU is a
  reason); the other keywords are the shared interface's options."""
  del is_causal  # both served
  reason = device_reason(info)
  if reason is not None:
    return reason
  info = info or device_info()
  del local_window_size, segment_ids, kv_segment_ids  # served
  options = dict(logits_soft_cap=logits_soft_cap, bias=bias, mask=mask, sinks=sinks)
  for name, value_ in options.items():
    if value_ is not None:
      return f"{name} is not supported by the Mosaic backward yet"
  if causal_alignment != "bottom_right":
    return f"causal_alignment={causal_alignment!r}: the Mosaic backward is bottom-right only"
  for name, x in (("query", query), ("key", key), ("value", value)):
    if getattr(x, "ndim", None) != 4:
      return f"{name} must have rank 4, got shape {getattr(x, 'shape', None)}"
    if jnp.dtype(x.dtype) not in DTYPES:
      return f"{name} is {jnp.dtype(x.dtype).name}; the Mosaic backward takes bfloat16 and float16"
  if not query.dtype == key.dtype == value.dtype:
    return "query, key and value must share one dtype for the Mosaic backward"
  head_dim = query.shape[-1]
  if key.shape[-1] != head_dim or value.shape != key.shape:
    return "key and value must match each other and the query's head dim"
  if head_dim not in HEAD_DIMS:
    return f"head_dim={head_dim}; the Mosaic backward takes {HEAD_DIMS}"
  if key.shape[2] == 0 or query.shape[2] % key.shape[2]:
    return "query heads must be a multiple of key heads"
  config = mosaic_backward_config(head_dim, query.dtype, info)
  if config.smem_bytes(head_dim, jnp.dtype(query.dtype).itemsize) > info.smem_per_block:
    return f"the Mosaic backward's tiles do not fit {info.name}'s shared memory"
  return None


def cta_keys(head_dim: int, config: MosaicBackwardConfig) -> int:
  """Keys of a dK/dV CTA: a block_kv tile per consumer, or the one both share."""
  return cta_key_tiles(head_dim) * config.block_kv


def _key_blocks(key_shape, config: MosaicBackwardConfig) -> int:
  """(keys of a dK/dV CTA, KV head, sequence) blocks of keys [B, S, K, H]."""
  batch, seq_kv, kv_heads, head_dim = key_shape
  return batch * kv_heads * -(-seq_kv // cta_keys(head_dim, config))


def head_splits(key_shape, group: int, config: MosaicBackwardConfig, *, causal: bool,
                sm_count: int) -> int:
  """Parts each KV head's group of `group` query heads is split into for keys [B, S, K, H]:
  the fewest (a divisor of the group) that give the dK/dV kernel a CTA per SM, two under a
  causal mask, where the first key blocks see the most queries (each part's partial sums
  cost 8 bytes a key and head dim in HBM, written and read once)."""
  blocks = _key_blocks(key_shape, config)
  wanted = (2 if causal else 1) * sm_count
  return next((s for s in range(1, group + 1) if group % s == 0 and blocks * s >= wanted), group)


def dkv_programs(key_shape, group: int, config: MosaicBackwardConfig, *, causal: bool,
                 sm_count: int) -> int:
  """CTAs of the dK/dV kernel for keys [B, S, K, H]: one per (2 * block_kv keys, or block_kv
  at H > 128, part of a KV head's group, sequence)."""
  return _key_blocks(key_shape, config) * head_splits(key_shape, group, config, causal=causal,
                                                       sm_count=sm_count)
