"""Block shapes, warps and pipeline depths for each kernel, per GPU generation.

Every table lists candidates from fastest to safest; the first that fits the device's
shared memory is taken, so an sm_86 card (99 KB a block) and an A100 (163 KB) share the
Ampere table yet each gets a config that compiles. An explicit config that cannot fit is
refused with an error that names the budget.

Shared-memory model (Triton's software pipeliner, checked against the compiler's own
requests on the H200: 64 x 128 tiles at d = 128, bf16, 4 stages asked for 272 KiB): the Q
tile is staged once and every pipeline stage holds its own K tile and V tile:

    bytes = itemsize * head_dim_padded * (rows_q + stages * 2 * block_k) + reserve

It gives the 96 KB that "Writing an Attention Kernel: FlashAttention and Decode in Triton"
reports for its 128 x 64 tiles at d = 128, bf16, 2 stages; the
reserve covers Triton's scratch for reductions and layout conversions.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxflash._types import DTypeLike
from jaxflash.device import DeviceInfo, device_info

RESERVE_BYTES = 2 * 1024
MIN_BLOCK = 16  # tl.dot needs tiles of at least 16 x 16
DECODE_QUERY_ROWS = 16  # tl.dot needs at least 16 rows: a KV group's query heads are padded to it
# Most query rows one decode program holds: a KV group of more heads (multi-query models,
# 32 or 128 heads on one KV head) is split over ceil(G / rows) programs, each re-reading the
# group's K/V (from L2 when they run together) rather than carrying a [G, H] accumulator.
DECODE_MAX_QUERY_ROWS = 64


def padded_head_dim(head_dim: int) -> int:
  """Triton tiles have power-of-two sides: head dims 80 and 96 run as 128, masked."""
  return max(16, 1 << (int(head_dim) - 1).bit_length())


def _smem_bytes(rows_q: int, block_k: int, num_stages: int, head_dim: int, itemsize: int) -> int:
  return itemsize * padded_head_dim(head_dim) * (rows_q + num_stages * 2 * block_k) + RESERVE_BYTES


def _check_tiles(config, argument: str, tiles: tuple[str, ...]) -> None:
  """Each named tile a power of two >= MIN_BLOCK (None: the kernel's choice); at least one
  warp and one stage. Errors name the argument (`argument`.field) and the config."""
  for name in tiles:
    size = getattr(config, name)
    if size is not None and (size < MIN_BLOCK or size & (size - 1)):
      raise ValueError(f"{argument}.{name} must be a power of two >= {MIN_BLOCK}, got {config}")
  if config.num_warps < 1 or config.num_stages < 1:
    raise ValueError(f"{argument} needs num_warps >= 1 and num_stages >= 1, got {config}")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
  """Tiles of the prefill kernel: `block_q` query rows per program, `block_k` keys per step."""

  block_q: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 2

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    return _smem_bytes(self.block_q, self.block_k, self.num_stages, head_dim, itemsize)

  def check(self, argument: str = "config") -> None:
    _check_tiles(self, argument, ("block_q", "block_k"))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiles of the decode kernels: `block_k` cache tokens per step (spanning whole pages
  in the paged kernel, or a part of one page when pages are larger)."""

  block_k: int
  num_warps: int = 4
  num_stages: int = 2

  def smem_bytes(self, head_dim: int, itemsize: int, query_rows: int = DECODE_QUERY_ROWS) -> int:
    return _smem_bytes(query_rows, self.block_k, self.num_stages, head_dim, itemsize)

  def check(self, argument: str = "config") -> None:
    _check_tiles(self, argument, ("block_k",))


P, D = PrefillConfig, DecodeConfig

# (generation, head-dim bucket, bytes per element) -> candidates, best first.
# Hopper rows were tuned on the H200 (bench/prefill.py's sweep at n = 8192 and
# bench/decode.py's split and stage sweeps). Ada rows follow the RTX 4060 kernel of "Writing an
# Attention Kernel: FlashAttention and Decode in Triton"
# (128 x 64 tiles, 8 warps; its 96 KB means 2 stages under the 99 KB budget). Ampere rows
# take an A100's 163 KB first and fall back to the 99 KB of sm_86 parts.
_PREFILL = {
    ("hopper", 64, 2): [P(128, 64, 4, 3), P(64, 64, 4, 2)],
    ("hopper", 128, 2): [P(128, 64, 8, 3), P(128, 64, 4, 2), P(64, 64, 4, 2)],
    ("hopper", 256, 2): [P(64, 64, 8, 2), P(64, 32, 4, 2), P(32, 32, 4, 2)],
    ("ada", 64, 2): [P(128, 64, 4, 3), P(64, 64, 4, 2)],
    ("ada", 128, 2): [P(128, 64, 8, 2), P(64, 64, 4, 2)],
    ("ada", 256, 2): [P(64, 32, 4, 2), P(32, 32, 4, 2)],
    ("ampere", 64, 2): [P(128, 64, 4, 3), P(64, 64, 4, 2)],
    ("ampere", 128, 2): [P(128, 64, 8, 3), P(128, 64, 8, 2), P(64, 64, 4, 2)],
    ("ampere", 256, 2): [P(64, 64, 8, 2), P(64, 32, 4, 2), P(32, 32, 4, 2)],
}
_PREFILL_FP32 = [P(64, 32, 4, 2), P(32, 32, 4, 2), P(32, 16, 4, 2), P(16, 16, 4, 1)]
_PREFILL_LAST = [P(32, 32, 4, 2), P(16, 16, 4, 1)]

# One-byte rows are int8 / FP8 caches: their tiles stage one byte a value in shared memory
# (converted after the load), so the same budget holds twice the tokens in flight; on Hopper
# 128-token tiles carry as many bytes a stage as bf16's 64 (bench/studies/quantized_decode_tiles.py).
_DECODE = {
    ("hopper", 2): [D(64, 4, 4), D(64, 4, 3), D(32, 4, 2)],
    ("hopper", 1): [D(128, 4, 3), D(64, 4, 4), D(32, 4, 2)],
    ("ada", 2): [D(64, 4, 2), D(32, 4, 2)],
    ("ada", 1): [D(64, 4, 2), D(32, 4, 2)],
    ("ampere", 2): [D(64, 4, 4), D(64, 4, 2), D(32, 4, 2)],
    ("ampere", 1): [D(64, 4, 4), D(64, 4, 2), D(32, 4, 2)],
}
# The paged kernel's K/V addresses come from a table load, a dependent load that costs the
# software pipeline one stage of lookahead (Writing an Attention Kernel, Step 5): its configs
# carry one stage more.
_PAGED = {
    ("hopper", 2): [D(64, 4, 5), D(32, 4, 5), D(32, 4, 3)],
    ("hopper", 1): [D(128, 4, 5), D(64, 4, 5), D(32, 4, 3)],
    ("ada", 2): [D(32, 4, 5), D(32, 4, 3)],
    ("ada", 1): [D(32, 4, 5), D(32, 4, 3)],
    ("ampere", 2): [D(64, 4, 5), D(32, 4, 5), D(32, 4, 3)],
    ("ampere", 1): [D(64, 4, 5), D(32, 4, 5), D(32, 4, 3)],
}
_DECODE_FP32 = [D(32, 4, 2), D(16, 4, 2)]
_DECODE_LAST = [D(16, 4, 2), D(16, 4, 1)]


def _bucket(head_dim: int) -> int:
  return min(max(padded_head_dim(head_dim), 64), 256)


def _generation_key(info: DeviceInfo) -> str:
  return info.generation if info.generation in ("hopper", "ada", "ampere") else (
      "hopper" if info.smem_per_block >= 200 * 1024 else "ada")


def _first_fit(candidates, head_dim: int, itemsize: int, info: DeviceInfo, what: str):
  for config in candidates:
    if config.smem_bytes(head_dim, itemsize) <= info.smem_per_block:
      return config
  raise ValueError(f"no {what} config fits {info.name}'s {info.smem_per_block} bytes of shared memory "
                   f"for head_dim={head_dim}, itemsize={itemsize}")


def check_fits(config, head_dim: int, dtype, info: DeviceInfo | None = None) -> None:
  """Raises ValueError when `config` needs more shared memory than `info` grants a block."""
  info = info or device_info()
  itemsize = jnp.dtype(dtype).itemsize
  need = config.smem_bytes(head_dim, itemsize)
  if need > info.smem_per_block:
    raise ValueError(
        f"{config} needs ~{need} bytes of shared memory for head_dim={head_dim} and "
        f"{jnp.dtype(dtype).name}, over the {info.smem_per_block}-byte budget of a block on "
        f"{info.name} (sm_{info.compute_capability[0]}{info.compute_capability[1]}); "
        "use smaller tiles or fewer stages")


def resolve(config, expected: type, default, head_dim: int, dtype, argument: str = "config"):
  """`config` checked (its type, its tiles, its fit in this GPU's shared memory), or, when
  it is None, `default(head_dim, dtype)`: the tuned one."""
  if config is None:
    return default(head_dim, dtype)
  if not isinstance(config, expected):
    raise TypeError(f"{argument} must be a jaxflash.{expected.__name__}, got {type(config).__name__}")
  config.check(argument)
  check_fits(config, head_dim, dtype)
  return config


def prefill_config(head_dim: int, dtype: DTypeLike, info: DeviceInfo | None = None) -> PrefillConfig:
  """The tuned prefill config for this head dim and dtype on `info` (default: this GPU)."""
  info = info or device_info()
  itemsize = jnp.dtype(dtype).itemsize
  table = _PREFILL_FP32 if itemsize > 2 else _PREFILL.get(
      (_generation_key(info), _bucket(head_dim), itemsize), [])
  return _first_fit([*table, *_PREFILL_LAST], head_dim, itemsize, info, "prefill")


def decode_config(head_dim: int, dtype: DTypeLike, info: DeviceInfo | None = None, *,
                  paged: bool = False) -> DecodeConfig:
  """The tuned decode (or paged decode) config for this head dim and dtype on `info`."""
  info = info or device_info()
  itemsize = jnp.dtype(dtype).itemsize
  tables = _PAGED if paged else _DECODE
  table = _DECODE_FP32 if itemsize > 2 else tables.get((_generation_key(info), itemsize), [])
  return _first_fit([*table, *_DECODE_LAST], head_dim, itemsize, info, "decode")


def decode_query_rows(group: int, config: DecodeConfig, head_dim: int, dtype,
                      info: DeviceInfo | None = None) -> int:
  """Query rows of one decode program for KV groups of `group` heads: the group padded to a
  power of two >= DECODE_QUERY_ROWS, at most DECODE_MAX_QUERY_ROWS and no more than `config`
  leaves room for in shared memory. Groups of up to 16 heads get 16 rows, as they always did."""
  info = info or device_info()
  itemsize = jnp.dtype(dtype).itemsize
  rows = min(max(DECODE_QUERY_ROWS, 1 << (max(group, 1) - 1).bit_length()), DECODE_MAX_QUERY_ROWS)
  while rows > DECODE_QUERY_ROWS and config.smem_bytes(head_dim, itemsize, rows) > info.smem_per_block:
    rows //= 2
  return rows


def all_configs():
  """Every (generation, config) the tables can pick: for the tests' budget checks."""
  for (gen, *_), candidates in _PREFILL.items():
    yield from ((gen, c) for c in candidates)
  for (gen, _), candidates in [*_DECODE.items(), *_PAGED.items()]:
    yield from ((gen, c) for c in candidates)
  for (gen, *_), candidates in _BACKWARD.items():
    yield from ((gen, c) for c in candidates)
  for c in [*_PREFILL_FP32, *_PREFILL_LAST, *_DECODE_FP32, *_DECODE_LAST, *_BACKWARD_FP32,
            *_BACKWARD_LAST]:
    yield None, c


# ----------------------------------------------------------------------------- backward

@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiles of the FlashAttention-2 backward (jaxflash/prefill_backward.py).

  The dK/dV kernel keeps `block_k` keys (their K and V tiles and the dK and dV
  accumulators) resident and streams `block_q` query rows (Q and dO tiles) past them; the
  dQ kernel keeps `dq_block_q` query rows resident (Q, dO, the dQ accumulator) and streams
  `dq_block_k` keys (default: the dK/dV tiles swapped, block_k rows and block_q keys). Each
  stages its resident pair once and a streamed pair per stage:

      bytes = itemsize * head_dim_padded * (2 * resident + stages * 2 * streamed) + reserve

  q_splits: how many programs share each key block's query range in the dK/dV kernel (each
  writes float32 partial dK/dV, summed in a fixed order by XLA: deterministic). None
  chooses (`backward_q_splits`): more than one only where B * K * ceil(S / block_k)
  programs would fill the SMs less than twice.
  """

  block_q: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 2
  dq_block_q: int | None = None
  dq_block_k: int | None = None
  q_splits: int | None = None

  @property
  def dq_tiles(self) -> tuple[int, int]:
    """(query rows, keys) of the dQ kernel."""
    return (self.dq_block_q or self.block_k, self.dq_block_k or self.block_q)

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    per_row = itemsize * padded_head_dim(head_dim)
    rows, keys = self.dq_tiles
    return per_row * max(2 * self.block_k + self.num_stages * 2 * self.block_q,
                         2 * rows + self.num_stages * 2 * keys) + RESERVE_BYTES

  def check(self, argument: str = "backward_config") -> None:
    _check_tiles(self, argument, ("block_q", "block_k", "dq_block_q", "dq_block_k"))
    if self.q_splits is not None and (not isinstance(self.q_splits, int) or self.q_splits < 1):
      raise ValueError(f"{argument}.q_splits must be None or an int >= 1, got {self}")


MAX_Q_SPLITS = 4


def backward_q_splits(config: BackwardConfig, programs: int, query_blocks: int,
                      info: DeviceInfo | None = None) -> int:
  """The dK/dV kernel's split of each key block's query range: config.q_splits if set;
  else 1 where the grid already gives every SM two programs, and otherwise MAX_Q_SPLITS
  (never more than the query blocks). programs: B * K * ceil(S / block_k), the grid
  without a split. On the H200 (bench/results/h200/train_sweep.md, commit 060ed0f; B = 1,
  12 / 2 heads, d = 128) fwd+bwd read 206 / 262 / 327 / 350 TFLOP/s with 1 / 2 / 3 / 4
  splits at n = 4096 (128 programs) and 285 / 402 / 390 / 401 at n = 8192 (256): the
  partial sums cost less than idle SMs."""
  if config.q_splits is not None:
    return config.q_splits
  sm_count = (info or device_info()).sm_count
  if programs >= 2 * sm_count:
    return 1
  return max(1, min(MAX_Q_SPLITS, query_blocks))


B = BackwardConfig
# Hopper rows: the fwd+bwd sweep on the H200 at n = 4096 and 16384 (bench/train.py, B = 1,
# 12 q / 2 KV heads, d = 128, bf16; 2026-12-01): 64 x 64 tiles, 4 warps, 2 stages read 199
# and 415 TFLOP/s against 143 and 362 for 64 x 128 x 8 warps. Small key tiles matter: the
# dK/dV grid has only B * K * S / block_k programs. Ampere and Ada rows keep the shapes
# with the stage counts their budgets allow.
_BACKWARD = {
    ("hopper", 64, 2): [B(64, 64, 4, 2), B(32, 64, 4, 2)],
    ("hopper", 128, 2): [B(64, 64, 4, 2), B(32, 64, 4, 3), B(32, 64, 4, 2)],
    ("hopper", 256, 2): [B(32, 64, 4, 2), B(16, 64, 4, 2), B(16, 32, 4, 2)],
    ("ada", 64, 2): [B(32, 128, 4, 2), B(32, 64, 4, 2)],
    ("ada", 128, 2): [B(32, 64, 4, 2), B(16, 64, 4, 2)],
    ("ada", 256, 2): [B(16, 32, 4, 2), B(16, 16, 4, 1)],
    ("ampere", 64, 2): [B(64, 128, 8, 2), B(32, 64, 4, 2)],
    ("ampere", 128, 2): [B(32, 128, 4, 2), B(32, 64, 4, 2), B(16, 64, 4, 2)],
    ("ampere", 256, 2): [B(16, 64, 4, 2), B(16, 32, 4, 2)],
}
_BACKWARD_FP32 = [B(32, 64, 4, 2), B(16, 32, 4, 2), B(16, 16, 4, 1)]
_BACKWARD_LAST = [B(16, 32, 4, 2), B(16, 16, 4, 1)]


def backward_config(head_dim: int, dtype: DTypeLike, info: DeviceInfo | None = None) -> BackwardConfig:
  """The tuned backward config for this head dim and dtype on `info` (default: this GPU)."""
  info = info or device_info()
  itemsize = jnp.dtype(dtype).itemsize
  table = _BACKWARD_FP32 if itemsize > 2 else _BACKWARD.get(
      (_generation_key(info), _bucket(head_dim), itemsize), [])
  return _first_fit([*table, *_BACKWARD_LAST], head_dim, itemsize, info, "backward")


MIN_CHUNK_TOKENS = 64  # one tile: shorter splits measured faster down to this (bench/PERFORMANCE.md)


def num_splits(batch: int, kv_heads: int, capacity: int, info: DeviceInfo | None = None) -> int:
  """How many chunks Flash-Decoding cuts each cache into.

  One program runs per (sequence, KV head, chunk). Batch x KV heads programs already
  exist; chunks multiply them until the SMs are filled once (rounded down to a power of
  two: on the 24-SM laptop GPU of "Writing an Attention Kernel: FlashAttention and Decode
  in Triton" that is its best 8 chunks for batch 1 and 2 KV heads), but never so many that
  a chunk holds fewer than MIN_CHUNK_TOKENS tokens.
  """
  info = info or device_info()
  programs = max(1, batch * kv_heads)
  fill = max(1, info.sm_count // programs)
  fill = 1 << (fill.bit_length() - 1)
  by_length = max(1, math.ceil(capacity / MIN_CHUNK_TOKENS))
  return int(max(1, min(fill, by_length)))
