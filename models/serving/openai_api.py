"""An OpenAI-compatible HTTP API over an EngineLoop (Starlette): GET /health, GET /v1/models,
POST /v1/completions and POST /v1/chat/completions, whole or streamed as server-sent events
ending with `data: [DONE]`.

A bad request gets HTTP 400 and {"error": {"message", "type"}}, checked before anything
reaches the engine. A client that goes away (closes its stream, or its connection while
waiting for a whole answer) has its request cancelled, which frees its slot.
"""
from __future__ import annotations

import asyncio
import json
import numbers
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from models.serving.chat import ChatTemplate
from models.serving.loop import EngineLoop

DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
FINISH_REASONS = {"stop": "stop", "length": "length", "window": "length", "cancelled": "stop"}
DISCONNECT_POLL_S = 0.25


class BadRequest(ValueError):
  """A client's mistake: answered with HTTP 400."""


def error_response(message: str, status: int = 400, kind: str = "invalid_request_error"):
  return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                      status_code=status)


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _optional(body: dict, name: str, check, expected: str, default=None):
  value = body.get(name)
  if value is None:
    return default
  if not check(value):
    raise BadRequest(f"'{name}' must be {expected}, got {json.dumps(value)[:80]}")
  return value


def sampling_options(body: dict, default_max_tokens: int | None) -> dict:
  """The engine options of a request body (OpenAI's names and defaults; top_k 0 or -1: none).
  A request without a seed gets a fresh random one."""
  max_tokens = _optional(body, "max_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0",
                         default_max_tokens)
  if "max_completion_tokens" in body:
    max_tokens = _optional(body, "max_completion_tokens", lambda v: _is_int(v) and v >= 0,
                           "an integer >= 0", max_tokens)
  n = _optional(body, "n", _is_int, "an integer", 1)
  if n != 1:
    raise BadRequest(f"'n' must be 1 (one choice per request), got {n}")
  top_k = _optional(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1", 0)
  stop = _optional(body, "stop", lambda v: isinstance(v, str) or (
      isinstance(v, list) and all(isinstance(s, str) and s for s in v)), "a string or a list of "
      "non-empty strings", [])
  return dict(
      max_new_tokens=max_tokens,
      temperature=float(_optional(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
                                  "a number in [0, 2]", 1.0)),
      top_p=float(_optional(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1,
                            "a number in (0, 1]", 1.0)),
      top_k=top_k if top_k > 0 else None,
      seed=_optional(body, "seed", _is_int, "an integer", None),
      stop=[stop] if isinstance(stop, str) else list(stop),
      stream=_optional(body, "stream", lambda v: isinstance(v, bool), "a boolean", False))


# OpenAI request fields this server does not implement, with the values that leave them off:
# a request that turns one on gets a 400 naming it rather than an answer that ignores it
# (a log-likelihood evaluation asking for `logprobs` and `echo` would read nothing useful).
UNSUPPORTED_FIELDS = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"})}


def reject_unsupported(body: dict) -> None:
  """BadRequest for a field of UNSUPPORTED_FIELDS set to anything but an off value (numbers
  compare as numbers, others by type too: `false` is not `0`)."""
  for name, off_values in UNSUPPORTED_FIELDS.items():
    value = body.get(name)
    if not any(value == off and (type(value) is type(off) or (_is_number(value) and _is_number(off)))
               for off in off_values):
      raise BadRequest(f"'{name}' is not supported by this server, got {json.dumps(value)[:80]}")


class TextAssembler:
  """Token ids -> text deltas, with stop strings: text that could still turn into a stop
  string (or an incomplete UTF-8 character) is held back until it cannot. A feed decodes
  only its new tokens (with the previous feed's as context), so a reply costs time linear
  in its length, not quadratic."""

  def __init__(self, tokenizer, stop: list[str]):
    self.tokenizer, self.stop = tokenizer, stop
    self.tokens: list[int] = []
    self.text = ""  # the text of tokens[:_read_at]
    self.sent = ""  # text handed out so far: a prefix of `text`
    self.stopped = False
    self._context_at = self._read_at = 0
    self._hold = max((len(s) for s in stop), default=1) - 1

  def feed(self, tokens: list[int], final: bool) -> str:
    """The new text to hand out after `tokens`; sets `stopped` at a stop string."""
    self.tokens += tokens
    self._decode_new(final)
    # A stop string cannot begin inside the text already sent: its first `_hold` characters
    # were held back.
    found = (self.text.find(s, len(self.sent)) for s in self.stop)
    cut = min((i for i in found if i >= 0), default=-1)
    text = self.text
    if cut >= 0:
      text, final, self.stopped = text[:cut], True, True
    if not final:
      text = text[:max(len(self.sent), len(text) - self._hold)]
    delta = text[len(self.sent):]
    self.sent += delta
    return delta

  def _decode_new(self, final: bool) -> None:
    """Appends the text of the tokens not yet decoded. They are decoded after the previous
    feed's tokens and that text is cut off (a tokenizer's decode of a slice need not be a
    slice of the whole's: leading spaces, byte-level pieces); while the new text ends in an
    incomplete character it waits for more tokens, unless this is the last feed."""
    context = self.tokenizer.decode(self.tokens[self._context_at:self._read_at])
    text = self.tokenizer.decode(self.tokens[self._context_at:])
    if len(text) > len(context) and (final or not text.endswith("\ufffd")):
      self.text += text[len(context):]
      self._context_at, self._read_at = self._read_at, len(self.tokens)


class OpenAIServer:
  """The application's state: the engine loop, the tokenizer, the chat template."""

  def __init__(self, loop: EngineLoop, tokenizer, *, model_name: str, stop_ids,
               chat_template: ChatTemplate, chat_stop_ids=()):
    self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
    self.stop_ids, self.chat_stop_ids = tuple(stop_ids), tuple(chat_stop_ids)
    self.chat_template = chat_template
    self.max_seq_len = loop.engine.max_seq_len
    self.ready = False
    self.app = Starlette(routes=[
        Route("/health", self.health, methods=["GET"]),
        Route("/v1/models", self.models, methods=["GET"]),
        Route("/v1/completions", self.completions, methods=["POST"]),
        Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
    ])

  async def health(self, request: HttpRequest):
    if not self.ready or self.loop.error is not None:
      return error_response("not ready", 503, "server_error")
    return JSONResponse({"status": "ok"})

  async def models(self, request: HttpRequest):
    return JSONResponse({"object": "list", "data": [
        {"id": self.model_name, "object": "model", "created": 0, "owned_by": "jaxflash"}]})

  # ----------------------------------------------------------------------------- requests

  async def completions(self, request: HttpRequest):
    return await self._serve(request, chat=False)

  async def chat_completions(self, request: HttpRequest):
    return await self._serve(request, chat=True)

  def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
    if chat:
      messages = body.get("messages")
      if not isinstance(messages, list) or not messages or not all(
          isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
          for m in messages):
        raise BadRequest("'messages' must be a non-empty list of {\"role\": string, \"content\": "
                         "string} objects")
      return self.tokenizer.encode(self.chat_template.render(messages)).ids
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
      return self.tokenizer.encode(prompt).ids
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
      return list(prompt)
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids")

  async def _serve(self, request: HttpRequest, *, chat: bool):
    try:
      body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return error_response(f"the body is not valid JSON: {e}")
    try:
      if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
      _optional(body, "model", lambda v: isinstance(v, str), "a string")
      reject_unsupported(body)
      prompt = self._prompt_ids(body, chat)
      options = sampling_options(body, None if chat else DEFAULT_MAX_TOKENS)
      if options["max_new_tokens"] is None:  # chat: up to the window
        options["max_new_tokens"] = max(self.max_seq_len - len(prompt), 0)
      stop, stream_it = options.pop("stop"), options.pop("stream")
      if options["seed"] is None:
        options["seed"] = uuid.uuid4().int & 0x7FFFFFFF
      events: asyncio.Queue = asyncio.Queue()
      event_loop = asyncio.get_running_loop()
      stream = self.loop.submit(
          prompt, stop_ids=self.stop_ids + (self.chat_stop_ids if chat else ()),
          on_update=lambda tokens, reason: event_loop.call_soon_threadsafe(
              events.put_nowait, (tokens, reason)), **options)
    except (BadRequest, ValueError, TypeError) as e:
      return error_response(str(e))
    except RuntimeError as e:
      return error_response(str(e), 503, "server_error")
    reply = _Reply(self, chat, len(prompt), TextAssembler(self.tokenizer, stop))
    if stream_it:
      return StreamingResponse(self._sse(request, stream, events, reply), media_type="text/event-stream")
    try:
      async for _ in self._updates(request, stream, events, reply):
        pass
    finally:
      if reply.finish_reason is None:  # the client left
        self.loop.cancel(stream)
    if reply.finish_reason == "error":
      return error_response("the engine failed", 500, "server_error")
    return JSONResponse(reply.whole())

  async def _updates(self, request, stream, events: asyncio.Queue, reply: "_Reply"):
    """Yields the text delta of each update (of all that queued up, when this reader falls
    behind) until the request finishes; stops early (the request cancelled by the caller)
    if the client disconnects. A task of its own watches for that, so that waiting for
    tokens is a plain queue read, not a timed wait per update."""
    watcher = asyncio.create_task(_watch_disconnect(request, events))
    try:
      while reply.finish_reason is None:
        update = await events.get()
        while update is not CLIENT_GONE and update[1] is None and not events.empty():
          later = events.get_nowait()
          update = later if later is CLIENT_GONE else (update[0] + later[0], later[1])
        if update is CLIENT_GONE:
          return
        delta = reply.add(*update)
        if reply.assembler.stopped and update[1] is None:
          self.loop.cancel(stream)  # a stop string: the engine need not go on
        yield delta
    finally:
      watcher.cancel()

  async def _sse(self, request, stream, events, reply: "_Reply"):
    try:
      yield _event(reply.chunk(None, first=True))
      async for delta in self._updates(request, stream, events, reply):
        if delta:
          yield _event(reply.chunk(delta))
      if reply.finish_reason is not None:
        yield _event(reply.chunk("", finish=True))
        yield "data: [DONE]\n\n"
    finally:
      if reply.finish_reason is None:
        self.loop.cancel(stream)


CLIENT_GONE = object()  # put in a request's update queue when its client disconnects


async def _watch_disconnect(request: HttpRequest, events: asyncio.Queue) -> None:
  while not await request.is_disconnected():
    await asyncio.sleep(DISCONNECT_POLL_S)
  events.put_nowait(CLIENT_GONE)


def _event(payload: dict | None) -> str:
  return "" if payload is None else f"data: {json.dumps(payload)}\n\n"


class _Reply:
  """One response's text, counts and OpenAI JSON shapes."""

  def __init__(self, server: OpenAIServer, chat: bool, prompt_tokens: int, assembler: TextAssembler):
    self.server, self.chat, self.prompt_tokens, self.assembler = server, chat, prompt_tokens, assembler
    self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.completion_tokens = 0
    self.text = ""
    self.finish_reason: str | None = None

  def add(self, tokens: list[int], reason: str | None) -> str:
    if not self.assembler.stopped:
      self.completion_tokens += len(tokens)
    delta = self.assembler.feed(tokens, reason is not None)
    self.text += delta
    if reason is not None:
      self.finish_reason = "stop" if self.assembler.stopped else FINISH_REASONS.get(reason, reason)
    return delta

  def usage(self) -> dict:
    return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens}

  def _head(self, kind: str) -> dict:
    return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name}

  def whole(self) -> dict:
    if self.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                "finish_reason": self.finish_reason}
      return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage()}
    choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": self.finish_reason}
    return {**self._head("text_completion"), "choices": [choice], "usage": self.usage()}

  def chunk(self, delta: str | None, *, first: bool = False, finish: bool = False) -> dict | None:
    """A streamed chunk (the last one carries finish_reason and usage); None for the
    completions stream's opening (only chat opens with the assistant's role)."""
    reason = self.finish_reason if finish else None
    if self.chat:
      content = {"role": "assistant", "content": ""} if first else ({} if finish else {"content": delta})
      payload = {**self._head("chat.completion.chunk"), "choices": [
          {"index": 0, "delta": content, "logprobs": None, "finish_reason": reason}]}
    elif first:
      return None
    else:
      payload = {**self._head("text_completion"), "choices": [
          {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]}
    if finish:
      payload["usage"] = self.usage()
    return payload
