"""Serving Qwen2.5 on jaxflash: continuous batching with chunked prefill into a paged KV
cache, preemption by recomputation, and prefix caching (models/serving/engine.py), the host
one step ahead of the device; the engine in its own thread (loop.py) and an OpenAI-compatible
HTTP API over it (openai_api.py, `python -m models.serve`)."""
from models.serving.engine import Engine
from models.serving.loop import EngineLoop, Stream
from models.serving.prefix_cache import PrefixCache, page_keys
from models.serving.request import Request, RequestHandle
from models.serving.scheduler import ScheduledStep, Scheduler, Sequence

__all__ = ["Engine", "EngineLoop", "Stream", "Request", "RequestHandle", "PrefixCache", "page_keys",
           "Scheduler", "Sequence", "ScheduledStep"]
