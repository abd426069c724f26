"""jaxflash: fast, exact attention for JAX on NVIDIA GPUs (Pallas, Triton lowering).

Attention: `attention` (a drop-in for `jax.nn.dot_product_attention`), the kernels
`prefill_attention` (Pallas-Triton, or Pallas Mosaic GPU on sm_90), `decode_attention`,
`paged_decode_attention`, and `attention_reference`.
Decode-step fusions for Llama / Qwen-style layers live in `jaxflash.fused` (their functions
are re-exported here).
"""
from jaxflash.attention import IMPLEMENTATIONS, PREFILL_IMPLEMENTATIONS, attention, mosaic_reason, prefill_attention
from jaxflash.configs import (BackwardConfig, DecodeConfig, PrefillConfig, backward_config, decode_config,
                              num_splits, prefill_config)
from jaxflash.decode import SplitKV, decode_attention
from jaxflash.device import DeviceInfo, device_info
from jaxflash.fused import (LinearConfig, add_rms_norm, kv_cache_write, project_split_kv, qkv_projection,
                            skinny_matmul)
from jaxflash.paged import gather_pages, paged_decode_attention, paged_kv_write
from jaxflash.paged_prefill import paged_prefill_attention
from jaxflash.mosaic import MosaicBackwardConfig, MosaicPrefillConfig, mosaic_prefill_config
from jaxflash.quantize import dequantize_kv, quantize_kv
from jaxflash.reference import attention_reference

__all__ = [
    "attention", "IMPLEMENTATIONS", "prefill_attention", "decode_attention", "paged_decode_attention",
    "paged_prefill_attention", "paged_kv_write", "gather_pages", "attention_reference", "PrefillConfig",
    "DecodeConfig",
    "prefill_config", "decode_config", "num_splits", "DeviceInfo", "device_info",
    "skinny_matmul", "LinearConfig", "kv_cache_write", "qkv_projection", "add_rms_norm",
    "SplitKV", "project_split_kv", "BackwardConfig", "backward_config", "PREFILL_IMPLEMENTATIONS",
    "MosaicPrefillConfig", "MosaicBackwardConfig", "mosaic_prefill_config", "mosaic_reason",
    "quantize_kv", "dequantize_kv",
]
__version__ = "0.1.0"
