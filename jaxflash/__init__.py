"""jaxflash: fast, exact attention for JAX on NVIDIA GPUs (Pallas, Triton lowering)."""
from jaxflash.attention import IMPLEMENTATIONS, attention
from jaxflash.cache_write import kv_cache_write
from jaxflash.configs import (BackwardConfig, DecodeConfig, PrefillConfig, backward_config, decode_config,
                              num_splits, prefill_config)
from jaxflash.decode import SplitKV, decode_attention
from jaxflash.device import DeviceInfo, device_info
from jaxflash.linear import LinearConfig, skinny_matmul
from jaxflash.paged import gather_pages, paged_decode_attention, paged_kv_write
from jaxflash.prefill import prefill_attention
from jaxflash.qkv import qkv_projection
from jaxflash.reference import attention_reference
from jaxflash.residual_norm import add_rms_norm
from jaxflash.split_kv_projection import project_split_kv

__all__ = [
    "attention", "IMPLEMENTATIONS", "prefill_attention", "decode_attention", "paged_decode_attention",
    "paged_kv_write", "gather_pages", "attention_reference", "PrefillConfig", "DecodeConfig",
    "prefill_config", "decode_config", "num_splits", "DeviceInfo", "device_info",
    "skinny_matmul", "LinearConfig", "kv_cache_write", "qkv_projection", "add_rms_norm",
    "SplitKV", "project_split_kv", "BackwardConfig", "backward_config",
]
__version__ = "0.1.0"
