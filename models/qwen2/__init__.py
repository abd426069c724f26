"""Qwen2 / Qwen2.5 in Flax NNX with jaxflash attention.

    model = models.qwen2.from_pretrained("~/models/Qwen2.5-1.5B", dtype="bfloat16")
    new_tokens = models.qwen2.generate(model, [prompt_ids], max_new_tokens=64)

The package runs from the repository checkout (the jaxflash wheel ships `jaxflash` only).
"""
from models.qwen2.allocator import OutOfPagesError, PageAllocator
from models.qwen2.cache import KV_DTYPES, ContiguousCache, LayerKV, PagedCache
from models.qwen2.config import PRESETS, Qwen2Config
from models.qwen2.model import Qwen2ForCausalLM
from models.qwen2.parallel import TensorParallel, shard_model
from models.qwen2.plan import DecodeWorkspace, StepPlan
from models.qwen2.sampler import (GenerationOutput, LoopState, Sampler, StepFunctions, generate,
                                  step_functions)
from models.qwen2.sampling import SamplingParams, sample_logits
from models.qwen2.weights import CheckpointError, from_pretrained, load_weights, random_model, save_pretrained

__all__ = [
    "Qwen2Config", "PRESETS", "Qwen2ForCausalLM", "from_pretrained", "random_model", "save_pretrained",
    "load_weights", "CheckpointError", "generate", "Sampler", "GenerationOutput", "step_functions",
    "StepFunctions", "SamplingParams", "sample_logits", "ContiguousCache", "PagedCache", "LayerKV",
    "PageAllocator", "OutOfPagesError", "shard_model", "TensorParallel", "StepPlan",
    "DecodeWorkspace", "LoopState", "KV_DTYPES",
]
