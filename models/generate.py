"""`python -m models.generate` (run from the repository checkout): stream text from Qwen2.5 on jaxflash.

    python -m models.generate --checkpoint ~/models/Qwen2.5-1.5B-Instruct --chat \\
        --prompt "Why is the sky blue?" --max-new-tokens 128

With `--checkpoint DIR` the model and its tokenizer are read offline from DIR (HF layout:
config.json, *.safetensors, tokenizer.json). Without it, a small Qwen2.5-shaped model with
RANDOM weights and a built-in byte-level tokenizer runs instead, so the command works on
any machine (on a CPU the kernels run in Pallas interpret mode): its text is noise, its
timings are real. Prints the prefill time and the decode speed after the text. User errors
(a checkpoint folder that does not exist or holds no safetensors, an empty prompt, a value
out of range, a missing requests file) print one line, `error: ...`, on stderr and exit with
status 2. `--prompt-env NAME` reads the prompt from the environment variable NAME, so no
shell ever interprets it (`make demo PROMPT=...` passes it this way).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import jaxflash

DEFAULT_PROMPT = "The best thing about fast attention kernels is"
CHAT_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def demo_config():
  """Qwen2.5's layout (GQA 2:1 here, biased q/k/v, SwiGLU, tied embeddings, rope_theta
  1e6) at a size that runs in seconds on a CPU; the vocabulary fits the byte tokenizer."""
  from models.qwen2 import Qwen2Config
  from models.tokenizer import SPECIAL_TOKENS
  return Qwen2Config(vocab_size=256 + len(SPECIAL_TOKENS), hidden_size=256, intermediate_size=768,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, rope_theta=1_000_000.0, max_position_embeddings=4096,
                     tie_word_embeddings=True, eos_token_id=256)


RANDOM_WEIGHT_SCALE = 8.0


def demo_model(seed: int, dtype, config=None):
  """The random-weight demo model (of `config`, default demo_config()). Its matrices are drawn RANDOM_WEIGHT_SCALE times wider
  than Hugging Face's initialisation (std 0.02): at that init every layer is a near-identity
  and greedy decoding repeats the prompt's last byte forever; wider weights make it wander."""
  from flax import nnx

  from models import qwen2
  model = qwen2.random_model(config or demo_config(), seed=seed, dtype=dtype)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.Linear):
      module.kernel[...] = module.kernel[...] * RANDOM_WEIGHT_SCALE
    elif isinstance(module, nnx.Embed):
      module.embedding[...] = module.embedding[...] * RANDOM_WEIGHT_SCALE
  return model


DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m models.generate",
                                   description="Stream text from Qwen2.5 with jaxflash attention.",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--checkpoint", help="local HF Qwen2/Qwen2.5 directory (none: a small "
                      "random-weight model with a byte-level tokenizer)")
  parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text to continue")
  parser.add_argument("--prompt-env", metavar="NAME", help="read the prompt from environment "
                      "variable NAME instead of --prompt (no shell interprets it)")
  parser.add_argument("--chat", action="store_true", help="wrap the prompt in Qwen's chat template")
  parser.add_argument("--max-new-tokens", type=int, default=None,
                      help="tokens to generate (none: 64 with a checkpoint, 24 for the random "
                      "model; 0: none)")
  parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
  parser.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens "
                      "(none: all)")
  parser.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of "
                      "tokens whose probability reaches p, in (0, 1] (none: all)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the sampling draws and of the "
                      "random model's weights")
  parser.add_argument("--cache", choices=("paged", "contiguous"), default="paged", help="KV cache layout")
  parser.add_argument("--page-size", type=int, default=16, help="tokens per page of the paged cache "
                      "(a power of two >= 8)")
  names = [name for name in jaxflash.IMPLEMENTATIONS if name is not None]
  parser.add_argument("--attention", choices=names, default=None,
                      help="jaxflash.attention's implementation (none: the best kernel for the "
                      "device; xla: jaxflash's plain-JAX path; cudnn and mosaic: GPU only)")
  from models.qwen2.cache import KV_DTYPES
  parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                      help="keep the KV cache quantized, one float32 scale per token and KV head "
                      "(unset: the model's dtype)")
  parser.add_argument("--steps-per-call", type=int, default=None,
                      help="decode steps per dispatch (none: models.qwen2's STEPS_PER_CALL, 8)")
  parser.add_argument("--dtype", choices=DTYPES, default=None, help="weights and activations (none: "
                      "the checkpoint's dtype; float32 for the random model)")
  parser.add_argument("--no-stream", action="store_true",
                      help="show a progress bar and print the text at the end")
  parser.add_argument("--requests", metavar="FILE", help="a JSONL file of prompts to serve through "
                      "the continuous-batching engine (models/serving/demo.py says the format)")
  parser.add_argument("--slots", type=int, default=8, help="with --requests: sequences at once")
  args = parser.parse_args(argv)
  if args.prompt_env is not None:
    if args.prompt_env not in os.environ:
      parser.exit(2, f"error: --prompt-env {args.prompt_env}: no such environment variable\n")
    args.prompt = os.environ[args.prompt_env]
  return args


def check_args(args: argparse.Namespace) -> None:
  """Values argparse's types let through, checked before anything loads (UserError)."""
  if not args.prompt:
    raise UserError("the prompt is empty" + (f" (${args.prompt_env})" if args.prompt_env else ""))
  for name, value, ok, rule in (
      ("--max-new-tokens", args.max_new_tokens, lambda v: v >= 0, ">= 0"),
      ("--temperature", args.temperature, lambda v: v >= 0, ">= 0 (0: greedy)"),
      ("--top-k", args.top_k, lambda v: v >= 1, ">= 1"),
      ("--top-p", args.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
      ("--page-size", args.page_size, lambda v: v >= 8 and not v & (v - 1), "a power of two >= 8"),
      ("--steps-per-call", args.steps_per_call, lambda v: v >= 1, ">= 1"),
      ("--slots", args.slots, lambda v: v >= 1, ">= 1")):
    if value is not None and not ok(value):
      raise UserError(f"{name} must be {rule}, got {value}")
  if args.attention in ("cudnn", "mosaic") and jax.default_backend() != "gpu":
    raise UserError(f"--attention {args.attention} needs a GPU; this machine runs on "
                    f"{jax.default_backend()} (use the default or xla)")
  if args.requests and not os.path.isfile(args.requests):
    raise UserError(f"requests file {args.requests} does not exist")


def _eos_ids(checkpoint: str, config) -> tuple[int, ...]:
  """The config's EOS ids plus generation_config.json's (instruct models stop on <|im_end|>)."""
  ids = list(config.eos_token_ids)
  path = os.path.join(checkpoint, "generation_config.json")
  if os.path.exists(path):
    with open(path) as f:
      extra = json.load(f).get("eos_token_id")
    ids += [extra] if isinstance(extra, int) else list(extra or [])
  return tuple(dict.fromkeys(ids))


class UserError(Exception):
  """A problem with what the user asked for: printed as one line, exit status 2."""


def load(args):
  """-> (model, tokenizer, eos ids, a description of what was loaded)."""
  from tokenizers import Tokenizer

  from models import qwen2
  from models.tokenizer import byte_tokenizer
  if args.checkpoint:
    checkpoint = os.path.expanduser(args.checkpoint)
    if not os.path.isdir(checkpoint):
      raise UserError(f"checkpoint folder {args.checkpoint} does not exist")
    tokenizer_file = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
      raise UserError(f"no tokenizer.json in {args.checkpoint}")
    try:
      model = qwen2.from_pretrained(checkpoint, dtype=args.dtype, progress=True)
    except (FileNotFoundError, NotImplementedError, ValueError, KeyError) as e:  # CheckpointError too
      raise UserError(str(e)) from e
    tokenizer = Tokenizer.from_file(tokenizer_file)
    return model, tokenizer, _eos_ids(checkpoint, model.config), f"checkpoint {args.checkpoint}"
  model = demo_model(args.seed, args.dtype or "float32")
  config = model.config
  label = (f"RANDOM WEIGHTS (no --checkpoint): a Qwen2.5-shaped demo model, {config.num_hidden_layers} "
           f"layers, hidden {config.hidden_size}, {config.num_attention_heads}:"
           f"{config.num_key_value_heads} GQA heads; byte-level tokenizer. The text is noise.")
  return model, byte_tokenizer(), config.eos_token_ids, label


def printable(text: str) -> str:
  """Control characters (random bytes are full of them) shown as '.', lines kept."""
  return "".join(c if c.isprintable() or c in "\n\t" else "." for c in text)


class TextStream:
  """Turns tokens into text as they arrive, holding back a split multi-byte character."""

  def __init__(self, tokenizer, out=sys.stdout):
    self.tokenizer, self.out = tokenizer, out
    self.tokens: list[int] = []
    self.printed = 0

  def __call__(self, step_tokens) -> None:
    if step_tokens[0] is None:
      return
    self.tokens.append(step_tokens[0])
    self._write(final=False)

  def finish(self) -> None:
    self._write(final=True)

  def _write(self, final: bool) -> None:
    text = self.tokenizer.decode(self.tokens)
    if text.endswith("\ufffd") and not final:
      return  # wait for the rest of a UTF-8 sequence split between tokens
    self.out.write(printable(text[self.printed:]))
    self.out.flush()
    self.printed = len(text)


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    check_args(args)
    return run(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
  from tqdm.auto import tqdm

  from models import qwen2

  started = time.perf_counter()
  model, tokenizer, eos_ids, label = load(args)
  max_new = args.max_new_tokens if args.max_new_tokens is not None else (64 if args.checkpoint else 24)
  prompt = CHAT_TEMPLATE.format(prompt=args.prompt) if args.chat else args.prompt
  prompt_ids = tokenizer.encode(prompt).ids
  if not prompt_ids:
    raise UserError("the prompt is empty (it encodes to no tokens)")
  limit = model.config.max_position_embeddings
  if not args.requests and len(prompt_ids) + max_new > limit:
    raise UserError(f"the prompt ({len(prompt_ids)} tokens) and --max-new-tokens {max_new} exceed the "
                    f"model's max_position_embeddings {limit}")
  backend = jax.default_backend()
  kernels = "jaxflash kernels" + ("" if backend == "gpu" else " (Pallas interpret mode: no GPU)")
  attention = {None: kernels, "xla": "jaxflash's plain-JAX path"}.get(args.attention,
                                                                      f"jaxflash.attention({args.attention!r})")
  print(f"model:     {label}")
  print(f"attention: {attention}; {args.cache} KV cache; {jnp.dtype(model.dtype).name} on "
        f"{jax.devices()[0].device_kind}")
  if args.requests:
    from models.serving.demo import serve_requests
    return serve_requests(args, model, tokenizer, eos_ids, max_new=max_new, printable=printable)

  if max_new == 0:
    print(f"prompt:    {prompt!r} ({len(prompt_ids)} tokens)\n\nno new tokens (--max-new-tokens 0)")
    return 0
  per_call = {} if args.steps_per_call is None else dict(steps_per_call=args.steps_per_call)
  try:
    sampler = qwen2.Sampler(model, cache=args.cache, page_size=args.page_size,
                            attention_impl=args.attention, kv_dtype=args.kv_dtype, **per_call)
  except ValueError as e:
    raise UserError(str(e)) from e
  options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                 eos_token_id=eos_ids, seed=args.seed)
  # Compile the prefill and the decode step on the real shapes (a run stopped after two
  # steps), so the timings below measure running, not compiling.
  stops = iter([False])
  with tqdm(total=1, desc="compiling", bar_format="{desc}: {elapsed}", leave=False) as bar:
    compile_start = time.perf_counter()
    sampler([prompt_ids], max_new, stream=lambda _: next(stops, True), **options)
    compile_seconds = time.perf_counter() - compile_start
    bar.update()
  print(f"ready in {time.perf_counter() - started:.1f} s (compilation {compile_seconds:.1f} s)")
  print(f"prompt:    {prompt!r} ({len(prompt_ids)} tokens)\n")

  if args.no_stream:
    bar = tqdm(total=max_new, desc="generating", unit="tok")

    def advance(_) -> None:  # returns None: tqdm's update() returns True when it redraws
      bar.update()

    result = sampler([prompt_ids], max_new, stream=advance, **options)
    bar.close()
    print(printable(tokenizer.decode(result.tokens[0])))
  else:
    sys.stdout.write(prompt)
    text_stream = TextStream(tokenizer)
    result = sampler([prompt_ids], max_new, stream=text_stream, **options)
    text_stream.finish()
    print()
  new = len(result.tokens[0])
  stopped = "EOS" if new and result.tokens[0][-1] in eos_ids else "max tokens"
  print(f"\nprefill:   {result.prefill_seconds * 1e3:.1f} ms for {len(prompt_ids)} prompt tokens")
  if result.decode_steps:
    print(f"decode:    {result.decode_tokens} tokens in {result.decode_seconds:.3f} s = "
          f"{result.decode_tokens_per_second:.1f} tokens/s ({stopped})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
