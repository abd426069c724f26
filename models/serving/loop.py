"""The engine in its own thread: any thread submits requests and reads their tokens as they
come, while one thread owns the engine and steps it whenever it has work.

    loop = EngineLoop(engine).start()
    stream = loop.submit(prompt_ids, 64, temperature=0.7, seed=1)
    for token in stream:        # blocks until each token arrives
      ...
    loop.close()

Only the loop's thread touches the engine's state: `submit` validates the request in the
caller's thread (so a bad one raises there, at once) and hands it over through a queue;
`cancel` is handed over the same way. Each stream is told of its new tokens after every step
through its `on_update` callback (the HTTP server wakes its event loop with it); by default
a stream collects them in a thread-safe queue for iteration.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Callable, Iterator

from models.serving.engine import Engine
from models.serving.request import Request, RequestHandle

# The loop's thread waits for the device with the GIL released. When the device answers it
# should run again at once, not after Python's default 5 ms switch interval while another
# thread (the HTTP server's event loop) holds the GIL: that wait would be a step's length.
SWITCH_INTERVAL_S = 2e-4

# on_update(new_tokens, finish_reason): called in the loop's thread; finish_reason is None
# until the request's last update.
UpdateCallback = Callable[[list[int], "str | None"], None]


class Stream:
  """A request submitted to an EngineLoop. Iterating yields its tokens as they arrive (when
  no `on_update` callback was given); `handle` is the engine's RequestHandle once the loop
  has taken the request (its timings, counts and `finish_reason`)."""

  def __init__(self, request: Request, arrival: float, on_update: UpdateCallback | None):
    self.request = request
    self.arrival = arrival
    self.handle: RequestHandle | None = None
    self.finish_reason: str | None = None
    self.sent = 0  # tokens handed to on_update so far
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self.on_update = on_update or (lambda tokens, reason: self._queue.put((tokens, reason)))

  def __iter__(self) -> Iterator[int]:
    while True:
      tokens, reason = self._queue.get()
      yield from tokens
      if reason is not None:
        return

  def result(self) -> list[int]:
    return list(self)


class EngineLoop:
  """Steps `engine` in a daemon thread while it has work; sleeps on an event otherwise."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit", Stream) / ("cancel", Stream)
    self._wake = threading.Event()
    self._closing = False
    self._active: list[Stream] = []
    self._thread = threading.Thread(target=self._run, name="jaxflash-engine", daemon=True)
    self.error: BaseException | None = None  # what stopped the loop, if anything did

  def start(self) -> "EngineLoop":
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    self._thread.start()
    return self

  def submit(self, prompt, max_new_tokens: int, *, on_update: UpdateCallback | None = None,
             **options) -> Stream:
    """Queues a request (options as Engine.submit's); thread-safe. Bad requests raise
    ValueError / TypeError here and never reach the engine."""
    if self.error is not None or self._closing:
      raise RuntimeError("the engine loop has stopped") from self.error
    stream = Stream(self.engine.check_request(prompt, max_new_tokens, **options), time.perf_counter(),
                    on_update)
    self._inbox.put(("submit", stream))
    self._wake.set()
    return stream

  def cancel(self, stream: Stream) -> None:
    """Ends the stream's request (finish_reason "cancelled") and frees its slot; thread-safe."""
    self._inbox.put(("cancel", stream))
    self._wake.set()

  def close(self, timeout: float | None = 10.0) -> None:
    self._closing = True
    self._wake.set()
    if self._thread.is_alive():
      self._thread.join(timeout)

  # ----------------------------------------------------------------------------- the thread

  def _take_inbox(self) -> None:
    while True:
      try:
        kind, stream = self._inbox.get_nowait()
      except queue.Empty:
        return
      if kind == "submit":
        stream.handle = self.engine.add(stream.request, stream.arrival)
        self._active.append(stream)
      elif stream.handle is not None:
        self.engine.cancel(stream.handle)

  def _publish(self) -> None:
    """Hands each stream its new tokens; forgets finished ones."""
    still = []
    for stream in self._active:
      handle = stream.handle
      new = handle.tokens[stream.sent:]
      stream.sent += len(new)
      if handle.done:
        stream.finish_reason = handle.finish_reason
      if new or handle.done:
        stream.on_update(list(new), handle.finish_reason)
      if not handle.done:
        still.append(stream)
    self._active = still

  def _run(self) -> None:
    try:
      while not self._closing:
        self._wake.clear()  # a submit from here on wakes the wait below at once
        self._take_inbox()
        stepped = self.engine.step()
        self._publish()
        if not stepped and not self._active:
          self._wake.wait(0.1)
    except BaseException as e:  # noqa: BLE001 - reported to every waiting stream
      self.error = e
      for stream in self._active:
        stream.finish_reason = "error"
        stream.on_update([], "error")
      raise
