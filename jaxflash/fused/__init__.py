"""Decode-step fusions for Llama / Qwen-style decoder layers (one kernel per file, its
reference beside it): the skinny matmul (linear.py), RMSNorm + q/k/v + bias + RoPE + cache
write (qkv.py), the KV-cache write (cache_write.py), the residual add + RMSNorm
(residual_norm.py), and the split-KV merge folded into the output projection
(split_kv_projection.py). Tiles and the thresholds a model dispatches on: configs.py.

They are forward-only (no VJP): a model calls them in decode steps, never in training.
"""
from jaxflash.fused.cache_write import kv_cache_write
from jaxflash.fused.configs import (MAX_ROWS, SKINNY_MAX_WEIGHT, SKINNY_MIN_ASPECT, SPLIT_KV_MAX_ROWS,
                                    WIDE_CONFIG, LinearConfig)
from jaxflash.fused.linear import skinny_matmul
from jaxflash.fused.qkv import qkv_projection
from jaxflash.fused.residual_norm import add_rms_norm
from jaxflash.fused.split_kv_projection import project_split_kv

__all__ = [
    "skinny_matmul", "LinearConfig", "qkv_projection", "kv_cache_write", "add_rms_norm",
    "project_split_kv", "MAX_ROWS", "SKINNY_MAX_WEIGHT", "SKINNY_MIN_ASPECT", "WIDE_CONFIG",
    "SPLIT_KV_MAX_ROWS",
]
