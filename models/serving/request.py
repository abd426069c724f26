"""Requests and their handles: what a client submits, and what it reads tokens from."""
from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Callable, Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request: continue `prompt` (token ids) by up to `max_new_tokens` tokens,
  greedy at temperature 0, else sampled (top_k 0 and top_p 1.0 mean no cut) from the
  request's own PRNG stream, `seed` folded with the index of the token drawn (so the tokens
  do not depend on what else runs, or on a preemption). Generation stops after a token of
  `stop_ids`, which is included in the output."""

  prompt: tuple[int, ...]
  max_new_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_ids: frozenset[int] = frozenset()


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def make_request(prompt, max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=0,
                 stop_ids=None, default_stop_ids: Sequence[int] = (), vocab_size: int,
                 max_seq_len: int) -> Request:
  """A validated Request; ValueError / TypeError naming the bad field otherwise.

  stop_ids: None (the model's EOS ids, `default_stop_ids`), an int, or a sequence of ints.
  The prompt may hold at most max_seq_len tokens (the cache's window)."""
  if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
    raise TypeError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
  if not all(_is_int(t) for t in prompt):
    raise TypeError("prompt must hold integer token ids")
  prompt = tuple(int(t) for t in prompt)
  if not prompt:
    raise ValueError("prompt is empty: a request needs at least one token")
  if any(not 0 <= t < vocab_size for t in prompt):
    raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
  if len(prompt) > max_seq_len:
    raise ValueError(f"prompt has {len(prompt)} tokens, over the window of {max_seq_len}")
  if not _is_int(max_new_tokens):
    raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
  if not isinstance(temperature, numbers.Real) or temperature < 0:
    raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
  if top_k is not None and (not _is_int(top_k) or top_k < 1):
    raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
  if top_p is not None and (not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0):
    raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
  if not _is_int(seed):
    raise TypeError(f"seed must be an int, got {type(seed).__name__}")
  if stop_ids is None:
    stop_ids = tuple(default_stop_ids)
  elif _is_int(stop_ids):
    stop_ids = (stop_ids,)
  elif isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
    raise TypeError(f"stop_ids must be None, an int or a sequence of ints, got "
                    f"{type(stop_ids).__name__}")
  else:
    stop_ids = tuple(stop_ids)
    if not all(_is_int(t) for t in stop_ids):
      raise TypeError(f"stop_ids must hold ints, got {stop_ids!r}")
  return Request(prompt, int(max_new_tokens), float(temperature), int(top_k or 0),
                 float(1.0 if top_p is None else top_p), int(seed) & 0xFFFFFFFF,
                 frozenset(int(t) for t in stop_ids))


class RequestHandle:
  """A submitted request's results as they arrive. Iterating yields its new tokens one by
  one, stepping the engine while none is ready; `tokens` holds those produced so far.
  Timings (time.perf_counter seconds): `arrival`, `token_times` (one per token)."""

  def __init__(self, request_id: int, request: Request, step: Callable[[], bool],
               arrival: float | None = None):
    self.id = request_id
    self.request = request
    self.tokens: list[int] = []
    self.token_times: list[float] = []
    self.arrival = time.perf_counter() if arrival is None else arrival
    self.finish_reason: str | None = None  # "stop", "length", "window" or "cancelled" once done
    self.computed_tokens = 0  # tokens fed to the model (recomputation after preemption included)
    self.prefix_hit_tokens = 0  # prompt tokens taken from the prefix cache instead
    self.preemptions = 0
    self._step = step

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  def __iter__(self) -> Iterator[int]:
    seen = 0
    while True:
      while seen < len(self.tokens):
        yield self.tokens[seen]
        seen += 1
      if self.done:
        return
      if not self._step():
        raise RuntimeError(f"request {self.id} is not done but the engine has no work")

  def result(self) -> list[int]:
    """Runs the engine until this request is done; its new tokens."""
    for _ in self:
      pass
    return list(self.tokens)

  @property
  def ttft(self) -> float | None:
    """Time to first token (seconds after arrival)."""
    return self.token_times[0] - self.arrival if self.token_times else None

  @property
  def inter_token_latencies(self) -> list[float]:
    return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

  def _push(self, token: int, now: float) -> None:
    self.tokens.append(token)
    self.token_times.append(now)

  def __repr__(self) -> str:
    return (f"RequestHandle(id={self.id}, prompt={len(self.request.prompt)} tokens, "
            f"{len(self.tokens)} new, finish_reason={self.finish_reason!r})")
