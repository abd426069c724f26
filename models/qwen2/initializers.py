"""Random initialisation as Hugging Face's Qwen2 does it: normal(0, 0.02) for every matrix.
Only random-weight models (tests, benchmarks) use it; checkpoints overwrite everything."""
from __future__ import annotations

from flax import nnx

INITIALIZER_RANGE = 0.02

dense_init = nnx.initializers.normal(INITIALIZER_RANGE)
embed_init = nnx.initializers.normal(INITIALIZER_RANGE)
