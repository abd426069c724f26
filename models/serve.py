"""`python -m models.serve`: an OpenAI-compatible HTTP server for Qwen2.5 on jaxflash.

    python -m models.serve --checkpoint ~/models/Qwen2.5-1.5B-Instruct --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The sky is", "max_tokens": 16, "temperature": 0}'

Without --checkpoint it serves models.generate's random-weight demo model with the byte-level
tokenizer (its text is noise; the server is real). Requests run on models.serving's engine in
its own thread (models/serving/loop.py); the API is models/serving/openai_api.py. The URL is
printed once the engine has compiled its steps and the server listens (minutes on a GPU: one
step per chunk shape; with JAX_COMPILATION_CACHE_DIR set, JAX keeps the compiled steps on disk
and a restart loads them). A bad flag prints one line and exits with status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, status 2
    self.exit(2, f"error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
  parser = _Parser(prog="python -m models.serve",
                   description="An OpenAI-compatible HTTP server for Qwen2.5 on jaxflash.",
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--checkpoint", help="local HF Qwen2/Qwen2.5 directory (none: the random-"
                      "weight demo model with a byte-level tokenizer)")
  parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
  parser.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free port)")
  parser.add_argument("--model-name", default=None, help="the id /v1/models lists (none: the "
                      "checkpoint folder's name, or 'jaxflash-demo')")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="weights and activations (none: the checkpoint's; float32 for the demo model)")
  parser.add_argument("--kv-dtype", choices=("int8", "float8_e4m3fn"), default=None,
                      help="keep the KV pool quantized, one float32 scale per token and KV head "
                      "(none: the model's dtype)")
  parser.add_argument("--seed", type=int, default=0, help="the demo model's weights")
  parser.add_argument("--attention", default=None, help="jaxflash.attention's implementation "
                      "(none: the best kernel for the device)")
  parser.add_argument("--slots", type=int, default=32, help="sequences at once")
  parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two >= 8)")
  parser.add_argument("--num-pages", type=int, default=None, help="KV pool pages (none: every "
                      "slot's window)")
  parser.add_argument("--max-seq-len", type=int, default=None, help="tokens per sequence (none: "
                      "the model's max_position_embeddings)")
  parser.add_argument("--token-budget", type=int, default=512, help="tokens one step feeds at most")
  parser.add_argument("--prefill-lanes", type=int, default=2, help="prompt chunks a step feeds at "
                      "most (each lane count compiles its own step)")
  parser.add_argument("--min-chunk", type=int, default=16, help="the smallest prefill chunk bucket "
                      "(a power of two; larger: fewer compilations, more padding)")
  parser.add_argument("--decode-steps", type=int, default=4, help="decode steps per dispatch while "
                      "no prompt is being fed (1: one a dispatch; more: fewer host round trips, "
                      "tokens stream in bursts)")
  parser.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt pages")
  parser.add_argument("--no-warm-up", action="store_true", help="compile steps on first use instead")
  args = parser.parse_args(argv)
  if not 0 <= args.port < 65536:
    parser.error(f"--port must be in [0, 65535], got {args.port}")
  return args


def build(args):
  """-> (OpenAIServer, EngineLoop) for the parsed flags; UserError for bad values."""
  from models.generate import load
  from models.serving.chat import checkpoint_chat_template

  load_args = argparse.Namespace(checkpoint=args.checkpoint, dtype=args.dtype, seed=args.seed)
  model, tokenizer, eos_ids, label = load(load_args)
  print(f"model: {label}", flush=True)
  template = checkpoint_chat_template(os.path.expanduser(args.checkpoint)) if args.checkpoint else None
  name = args.model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
                             else "jaxflash-demo")
  return serve_model(model, tokenizer, eos_ids, args, model_name=name, chat_template=template)


def serve_model(model, tokenizer, eos_ids, args, *, model_name: str, chat_template: str | None = None):
  """The engine (flags of `args`) for `model`, warmed up and running in its thread, and the
  API over it: (OpenAIServer, EngineLoop). chat_template None: Qwen's layout."""
  from models.generate import UserError
  from models.serving import Engine
  from models.serving.chat import ChatTemplate
  from models.serving.loop import EngineLoop
  from models.serving.openai_api import OpenAIServer

  try:
    engine = Engine(model, max_slots=args.slots, page_size=args.page_size, num_pages=args.num_pages,
                    max_seq_len=args.max_seq_len, token_budget=args.token_budget,
                    prefill_lanes=args.prefill_lanes, min_chunk=args.min_chunk,
                    prefix_caching=not args.no_prefix_caching, decode_steps=args.decode_steps,
                    attention_impl=args.attention, kv_dtype=args.kv_dtype)
  except (ValueError, TypeError) as e:
    raise UserError(str(e)) from e
  if not args.no_warm_up:
    print("compiling the engine's steps ...", flush=True)
    engine.warm_up()
  im_end = tokenizer.token_to_id("<|im_end|>")
  loop = EngineLoop(engine).start()
  server = OpenAIServer(loop, tokenizer, model_name=model_name, stop_ids=eos_ids,
                        chat_template=ChatTemplate(*([chat_template] if chat_template else [])),
                        chat_stop_ids=() if im_end is None else (im_end,))
  return server, loop


def listening_socket(host: str, port: int) -> socket.socket:
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  sock.listen(2048)  # connections made before uvicorn takes the socket wait in the backlog
  return sock


def url_of(sock: socket.socket) -> str:
  host, port = sock.getsockname()[:2]
  return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(server, sock: socket.socket, *, on_ready=None):
  """A uvicorn.Server for the app on an already bound socket; on_ready() runs once it
  accepts connections."""
  import uvicorn

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    server.ready = True
    if on_ready is not None:
      on_ready()
    yield

  server.app.router.lifespan_context = lifespan
  config = uvicorn.Config(server.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
  return uvicorn.Server(config)


def main(argv=None) -> int:
  args = parse_args(argv)
  from models.generate import UserError
  try:
    sock = listening_socket(args.host, args.port)
  except OSError as e:
    print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
    return 2
  try:
    server, loop = build(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  url = url_of(sock)
  web = uvicorn_server(server, sock, on_ready=lambda: print(f"serving on {url}", flush=True))
  try:
    asyncio.run(web.serve(sockets=[sock]))
  except KeyboardInterrupt:
    pass
  finally:
    loop.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
