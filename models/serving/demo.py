"""`python -m models.generate --requests FILE`: a JSONL file of prompts through the engine.

Each line is a JSON string (the prompt) or an object with "prompt" and optionally
"max_new_tokens", "temperature", "top_k", "top_p", "seed" (the command line's values
otherwise). Shows a progress bar of tokens, then each request's text and a summary:
output tokens/s, time to first token and inter-token latency (p50 / p99), compilations.
A bad line (not JSON, no "prompt" string, a setting of the wrong type) is reported on
stderr and skipped; the others run, and results carry their request (line) numbers.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np


SETTING_TYPES = {"max_new_tokens": int, "top_k": int, "seed": int, "temperature": (int, float),
                 "top_p": (int, float)}


def read_requests(path: str) -> list[tuple[int, dict]]:
  """-> (line number, request) pairs; a bad line is reported on stderr and skipped."""
  requests = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        item = json.loads(line)
      except json.JSONDecodeError as e:
        print(f"{path}:{number}: skipped: not JSON ({e.msg})", file=sys.stderr)
        continue
      item = {"prompt": item} if isinstance(item, str) else item
      if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
        print(f"{path}:{number}: skipped: expected a JSON string or an object with a \"prompt\" "
              f"string", file=sys.stderr)
        continue
      wrong = [f"{key}={item[key]!r}" for key, kind in SETTING_TYPES.items()
               if key in item and (not isinstance(item[key], kind) or isinstance(item[key], bool))]
      if wrong:
        print(f"{path}:{number}: skipped: {', '.join(wrong)} (numbers expected)", file=sys.stderr)
        continue
      requests.append((number, item))
  if not requests:
    print(f"error: no requests in {path}", file=sys.stderr)
    raise SystemExit(2)
  return requests


def _ms(values, q) -> str:
  return f"{np.percentile(values, q) * 1e3:.1f} ms" if len(values) else "n/a"


def serve_requests(args, model, tokenizer, eos_ids, *, max_new: int, printable) -> int:
  """Runs the requests of args.requests through models.serving.Engine; prints the results."""
  from tqdm.auto import tqdm

  from models.serving import Engine
  numbered = read_requests(args.requests)
  items = [item for _, item in numbered]
  encoded = [tokenizer.encode(item["prompt"]).ids for item in items]
  longest = max(len(ids) for ids in encoded) + max(int(item.get("max_new_tokens", max_new)) for item in items)
  window = min(model.config.max_position_embeddings, -(-longest // 256) * 256)
  engine = Engine(model, max_slots=args.slots, page_size=args.page_size, max_seq_len=window,
                  attention_impl=args.attention, kv_dtype=args.kv_dtype)
  start = time.perf_counter()
  handles, numbers = [], []  # accepted handles and their request (line) numbers
  for i, ((number, item), ids) in enumerate(zip(numbered, encoded)):
    try:
      handles.append(engine.submit(
          ids, int(item.get("max_new_tokens", max_new)), temperature=item.get("temperature", args.temperature),
          top_k=item.get("top_k", args.top_k), top_p=item.get("top_p", args.top_p),
          seed=item.get("seed", args.seed + i), stop_ids=eos_ids))
      numbers.append(number)
    except (ValueError, TypeError) as e:
      print(f"request {number} refused: {e}", file=sys.stderr)
  total = sum(h.request.max_new_tokens for h in handles)
  with tqdm(total=total, desc=f"{len(handles)} requests", unit="tok") as bar:
    produced = 0
    while engine.step():
      now = sum(len(h.tokens) for h in handles)
      bar.update(now - produced)
      produced = now
  seconds = time.perf_counter() - start
  for number, handle in zip(numbers, handles):
    print(f"\n[{number}] {printable(tokenizer.decode(list(handle.request.prompt)))!r} ->")
    print(printable(tokenizer.decode(handle.tokens)))
  tokens = sum(len(h.tokens) for h in handles)
  ttft = [h.ttft for h in handles if h.ttft is not None]
  itl = [gap for h in handles for gap in h.inter_token_latencies]
  stats = engine.stats
  print(f"\n{len(handles)} requests, {tokens} new tokens in {seconds:.2f} s = {tokens / seconds:.1f} "
        f"tokens/s (compilations included: {stats['compilations']})")
  print(f"time to first token: p50 {_ms(ttft, 50)}, p99 {_ms(ttft, 99)}; inter-token latency: "
        f"p50 {_ms(itl, 50)}, p99 {_ms(itl, 99)}")
  print(f"steps {stats.get('steps', 0)}, prefill tokens {stats.get('prefill_tokens', 0)}, "
        f"prefix-cache hits {stats.get('prefix_hit_tokens', 0)} tokens, preemptions "
        f"{stats.get('preemptions', 0)}")
  return 0
