"""Tiles of the decode-step fusions and the dispatch thresholds a model uses to pick them.

The thresholds were measured on the H200 (Qwen2.5-1.5B, bfloat16, batch 1 and 8; the
measurements are in bench/PERFORMANCE.md). They decide where a kernel here beats XLA's lowering
of the same product, so another GPU generation may want other values; they sit here, beside
jaxflash/configs.py's per-generation attention tiles, for that reason.
"""
from __future__ import annotations

import dataclasses

MAX_ROWS = 16  # tl.dot's minimum M: x's rows are padded to it, so 16 rows cost what 1 does


@dataclasses.dataclass(frozen=True)
class LinearConfig:
  """Tiles of the skinny matmul: `block_n` output columns per program, `block_k` rows of
  w per pipeline step; `num_splits` K chunks (None: enough programs to fill the GPU)."""

  block_n: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 4
  num_splits: int | None = None

  def __post_init__(self):
    for name in ("block_n", "block_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"LinearConfig.{name} must be a power of two >= 16 (tl.dot's minimum), "
                         f"got {value!r}")
    for name in ("num_warps", "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"LinearConfig.{name} must be a positive int, got {value!r}")
    if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
      raise ValueError(f"LinearConfig.num_splits must be None or a positive int, got {self.num_splits!r}")


# Weights of up to SKINNY_MAX_WEIGHT elements go through the skinny kernel, and so do tall
# ones (K >= SKINNY_MIN_ASPECT * N: a long sum into few outputs) and wide ones (N >=
# SKINNY_MIN_ASPECT * K, with WIDE_CONFIG); other large ones are XLA's. On the H200 at batch
# 1, XLA lowers the 1.5B model's q/k/v and o products (<= 3.1M elements) to a broadcast
# multiply and a reduction (2.4x slower than the kernel), its down projection (8960 x 1536)
# to a GEMM split 16 ways over K plus a reduction kernel (10.8 us in the step against the
# kernel's 8.7), and gate and up (1536 x 8960 each, merged by XLA) to a GEMM of 16.7 us,
# where the kernel with narrow column blocks (WIDE_CONFIG) takes 15.4.
SKINNY_MAX_WEIGHT = 1 << 23
SKINNY_MIN_ASPECT = 4
WIDE_CONFIG = LinearConfig(block_n=64, block_k=64)  # more column blocks than SMs: no K chunks
# jaxflash.project_split_kv (the decode merge in the output projection) paid at batch 1 on the
# H200 (1.5B step -0.02 ms) and lost at batch 8 (+0.1 ms, against the merge kernel and the
# skinny product).
SPLIT_KV_MAX_ROWS = 1
