"""Models built on jaxflash: `models.qwen2` (Qwen2 / Qwen2.5 in Flax NNX)."""
