"""The attention kernels users compare jaxflash with that are not part of JAX: FlashAttention-3
(`flash_attn3_jax`) and tokamax's Mosaic GPU kernel. Each is imported when first called, so a
machine without it loses one cell of a table, not the run. On a GPU machine without internet
they travel as wheels (README: "Benchmarks").

Calls take query [B, T, N, H] and key/value [B, S, K, H] (GQA by index), causal."""
from __future__ import annotations

import sys
import types


def fa3_attention(q, k, v):
  """FlashAttention-3 (Shah et al., 2024) through flash_attn3_jax, causal."""
  import flash_attn3_jax
  return flash_attn3_jax.flash_mha(q, k, v, is_causal=True)


def _tokamax():
  # tokamax imports xprof for its own benchmarking only: empty stand-in modules let it import.
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(name, types.ModuleType(name))
  if not hasattr(sys.modules["xprof.cli.tools"], "get_kernel_stats_tool"):
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  import tokamax
  return tokamax


def tokamax_attention(q, k, v):
  """tokamax.dot_product_attention with its Pallas Mosaic GPU implementation, causal."""
  return _tokamax().dot_product_attention(q, k, v, is_causal=True, implementation="mosaic")
