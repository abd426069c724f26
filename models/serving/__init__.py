"""Serving Qwen2.5 on jaxflash: continuous batching with chunked prefill into a paged KV
cache, preemption by recomputation, and prefix caching (models/serving/engine.py)."""
from models.serving.engine import Engine
from models.serving.prefix_cache import PrefixCache, page_keys
from models.serving.request import Request, RequestHandle
from models.serving.scheduler import ScheduledStep, Scheduler, Sequence

__all__ = ["Engine", "Request", "RequestHandle", "PrefixCache", "page_keys", "Scheduler", "Sequence",
           "ScheduledStep"]
