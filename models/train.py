"""`python -m models.train`: train Qwen2.5 with jaxflash attention (forward and backward kernels).

    python -m models.train                                  # random demo model, synthetic data
    python -m models.train --text README.md --steps 100     # bytes of a text file
    python -m models.train --checkpoint ~/models/Qwen2.5-0.5B --text corpus.txt --dtype bfloat16
    python -m models.train --pack --seq-len 256 --doc-len 64  # packed documents

Next-token cross-entropy, optax AdamW, one jitted step (forward, jaxflash's FlashAttention-2
backward through jax.custom_vjp, the optimizer update). Without `--checkpoint` the model is
the small Qwen2.5-shaped demo model of `python -m models.generate` at Hugging Face's random
initialisation, with its byte-level tokenizer; with one, the checkpoint's model and
tokenizer. Without `--text` the data is synthetic: bytes of a fixed random first-order
Markov chain over a 16-letter alphabet, so the loss falls quickly from ln(vocab) towards the
chain's entropy. On a CPU the kernels run in Pallas interpret mode: the default run (a few
dozen steps on short rows) takes well under a minute.

With `--pack` each row holds several documents of random lengths (random spans of the same
data, up to `--doc-len` tokens each) end to end, with segment ids: attention stays inside each
document (jaxflash.attention's `segment_ids`), positions restart at each, and the loss leaves
out the one target per boundary that belongs to the next document.

`--save DIR` writes the trained model as a Hugging Face checkpoint (config.json, model.safetensors, and the tokenizer.json of a
checkpoint or of the byte tokenizer) that `models.qwen2.from_pretrained` and
`python -m models.generate --checkpoint DIR` read. User errors (a value out of range, a
missing file) print one line, `error: ...`, on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

ALPHABET = b"abcdefghijklmnop"


class UserError(Exception):
  """A problem with what the user asked for: printed as one line, exit status 2."""


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m models.train",
                                   description="Train Qwen2.5 with jaxflash attention.",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--checkpoint", help="local HF Qwen2/Qwen2.5 directory to start from (none: "
                      "the small random demo model with a byte-level tokenizer)")
  parser.add_argument("--text", help="train on this text file (none: synthetic Markov bytes)")
  parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
  parser.add_argument("--batch", type=int, default=4, help="rows per step")
  parser.add_argument("--seq-len", type=int, default=64, help="tokens per row")
  parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
  parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
  parser.add_argument("--attention", choices=[name for name in jaxflash.IMPLEMENTATIONS if name],
                      default=None, help="jaxflash.attention's implementation (none: the best "
                      "kernel for the device; xla: jaxflash's plain-JAX path; cudnn: GPU only)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="weights and activations (none: the checkpoint's dtype; float32 for "
                      "the random model)")
  parser.add_argument("--pack", action="store_true",
                      help="pack documents of random lengths into each row, with segment ids")
  parser.add_argument("--doc-len", type=int, default=None,
                      help="with --pack: the longest document, in tokens (lengths are uniform from "
                      "a quarter of it up; unset: a quarter of --seq-len)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the weights, data and batches")
  parser.add_argument("--log-every", type=int, default=5, help="print the loss every this many steps")
  parser.add_argument("--save", metavar="DIR", help="write the trained model here as a Hugging Face "
                      "checkpoint (config.json, model.safetensors, tokenizer.json)")
  return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
  """Values argparse's types let through, checked before anything loads (UserError)."""
  for name, value in (("--steps", args.steps), ("--batch", args.batch), ("--seq-len", args.seq_len),
                      ("--log-every", args.log_every)):
    if value < 1:
      raise UserError(f"{name} must be >= 1, got {value}")
  if not args.lr > 0:
    raise UserError(f"--lr must be > 0, got {args.lr}")
  if args.weight_decay < 0:
    raise UserError(f"--weight-decay must be >= 0, got {args.weight_decay}")
  if args.attention in ("cudnn", "mosaic") and jax.default_backend() != "gpu":
    raise UserError(f"--attention {args.attention} needs a GPU; this machine runs on "
                    f"{jax.default_backend()}")
  for flag, path, is_there in (("--text", args.text, os.path.isfile),
                               ("--checkpoint", args.checkpoint, os.path.isdir)):
    if path and not is_there(os.path.expanduser(path)):
      raise UserError(f"{flag} {path} does not exist")
  if args.save and os.path.exists(args.save) and not os.path.isdir(args.save):
    raise UserError(f"--save {args.save} is a file, not a directory")


def load(args):
  """-> (model, tokenizer, description)."""
  from tokenizers import Tokenizer

  from models import qwen2
  from models.generate import demo_config
  from models.tokenizer import byte_tokenizer
  if args.checkpoint:
    tokenizer_file = os.path.join(args.checkpoint, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
      raise UserError(f"no tokenizer.json in {args.checkpoint}")
    try:
      model = qwen2.from_pretrained(args.checkpoint, dtype=args.dtype, progress=True)
    except (FileNotFoundError, NotImplementedError, ValueError) as e:  # CheckpointError included
      raise UserError(str(e)) from e
    return model, Tokenizer.from_file(tokenizer_file), f"checkpoint {args.checkpoint}"
  config = demo_config()
  model = qwen2.random_model(config, seed=args.seed, dtype=args.dtype or "float32")
  label = (f"random demo model ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
           f"{config.num_attention_heads}:{config.num_key_value_heads} GQA heads), byte tokenizer")
  return model, byte_tokenizer(), label


def markov_bytes(length: int, seed: int) -> bytes:
  """A fixed random first-order Markov chain over ALPHABET (each letter has 3 likely successors)."""
  rng = np.random.default_rng(seed)
  k = len(ALPHABET)
  logits = rng.standard_normal((k, k)) * 3.0
  probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  out = np.empty(length, np.int64)
  out[0] = 0
  draws = rng.random(length)
  cumulative = probs.cumsum(1)
  for i in range(1, length):
    out[i] = min(int(np.searchsorted(cumulative[out[i - 1]], draws[i])), k - 1)
  return bytes(ALPHABET[j] for j in out)


def token_stream(args, tokenizer) -> np.ndarray:
  if args.text:
    with open(args.text, encoding="utf-8", errors="replace") as f:
      text = f.read()
  else:
    text = markov_bytes(max(20_000, 4 * args.batch * (args.seq_len + 1)), args.seed).decode()
  ids = np.asarray(tokenizer.encode(text).ids, np.int32)
  if ids.size < args.seq_len + 2:
    raise UserError(f"{args.text or 'the data'} has {ids.size} tokens, fewer than --seq-len + 2 "
                    f"({args.seq_len + 2})")
  return ids


def batches(ids: np.ndarray, batch: int, seq_len: int, seed: int):
  """Endless random windows of seq_len + 1 tokens: [batch, seq_len + 1] int32."""
  rng = np.random.default_rng(seed + 1)
  while True:
    starts = rng.integers(0, ids.size - seq_len - 1, batch)
    yield np.stack([ids[s:s + seq_len + 1] for s in starts])


def packed_batches(ids: np.ndarray, batch: int, seq_len: int, doc_len: int, seed: int):
  """Endless rows of seq_len + 1 tokens packed from documents (random spans of `ids`) of
  uniform random lengths in [max(2, doc_len // 4), doc_len], the last one cut to fit:
  (tokens, segment_ids), both [batch, seq_len + 1] int32; ids number the row's documents."""
  rng = np.random.default_rng(seed + 1)
  shortest = max(2, doc_len // 4)
  while True:
    tokens = np.empty((batch, seq_len + 1), np.int32)
    segments = np.empty((batch, seq_len + 1), np.int32)
    for row in range(batch):
      filled, document = 0, 0
      while filled < seq_len + 1:
        length = min(int(rng.integers(shortest, doc_len + 1)), seq_len + 1 - filled)
        start = int(rng.integers(0, ids.size - length))
        tokens[row, filled:filled + length] = ids[start:start + length]
        segments[row, filled:filled + length] = document
        filled, document = filled + length, document + 1
    yield tokens, segments


def cross_entropy(model, tokens, attention_impl, segment_ids=None):
  """Mean next-token cross-entropy of tokens [B, T + 1] (float32 log-softmax). With
  segment_ids [B, T + 1] (packed documents) a token's target counts only inside its document."""
  inputs_segments = None if segment_ids is None else segment_ids[:, :-1]
  logits = model(tokens[:, :-1], attention_impl=attention_impl,
                 segment_ids=inputs_segments).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T]
  if segment_ids is None:
    return jnp.mean(nll)
  inside = (segment_ids[:, :-1] == segment_ids[:, 1:]).astype(jnp.float32)
  return jnp.sum(nll * inside) / jnp.maximum(jnp.sum(inside), 1.)


def make_step(model, optimizer, attention_impl):
  """-> (params, opt_state, step): step(params, opt_state, tokens, segment_ids=None) ->
  (params, opt_state, loss)."""
  import optax
  from flax import nnx
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, tokens, segment_ids):
    return cross_entropy(nnx.merge(graphdef, params, rest), tokens, attention_impl, segment_ids)

  @jax.jit
  def step(params, opt_state, tokens, segment_ids=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, segment_ids)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return params, optimizer.init(params), step


def train(args, log=print) -> list[float]:
  """Runs args.steps steps (and with args.save writes the trained model); returns the loss
  of each."""
  import optax
  from tqdm.auto import tqdm
  model, tokenizer, label = load(args)
  impl = args.attention
  backend = jax.default_backend()
  kernels = "jaxflash kernels" + ("" if backend == "gpu" else " (Pallas interpret mode: no GPU)")
  log(f"model:     {label}")
  log(f"attention: {kernels if impl is None else args.attention}; {jnp.dtype(model.dtype).name} on "
      f"{jax.devices()[0].device_kind}")
  doc_len = args.doc_len or max(2, args.seq_len // 4)
  if args.pack and doc_len < 2:
    raise SystemExit(f"error: --doc-len must be at least 2, got {args.doc_len}")
  packing = f", packed documents of up to {doc_len} tokens" if args.pack else ""
  log(f"data:      {args.text or 'synthetic Markov bytes'}; batch {args.batch} x {args.seq_len} "
      f"tokens{packing}")
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), max(args.steps, 2))
  optimizer = optax.adamw(schedule, weight_decay=args.weight_decay)
  params, opt_state, step = make_step(model, optimizer, impl)
  ids = token_stream(args, tokenizer)
  if args.pack:
    data = packed_batches(ids, args.batch, args.seq_len, doc_len, args.seed)
  else:
    data = ((tokens, None) for tokens in batches(ids, args.batch, args.seq_len, args.seed))
  losses = []
  started = time.perf_counter()
  with tqdm(range(args.steps), desc="training", unit="step") as bar:
    for i in bar:
      tokens, segment_ids = next(data)
      segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
      params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens), segment_ids)
      losses.append(float(loss))
      bar.set_postfix(loss=f"{losses[-1]:.3f}")
      if i % args.log_every == 0 or i == args.steps - 1:
        bar.write(f"step {i:4d}  loss {losses[-1]:.4f}")
  seconds = time.perf_counter() - started
  log(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps ({seconds:.1f} s, "
      f"{args.steps * args.batch * args.seq_len / seconds:.0f} tokens/s incl. compilation)")
  if args.save:
    from flax import nnx

    from models import qwen2
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    qwen2.save_pretrained(nnx.merge(graphdef, params, rest), args.save)
    tokenizer.save(os.path.join(args.save, "tokenizer.json"))
    log(f"saved:     {args.save} (config.json, model.safetensors, tokenizer.json)")
  return losses


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    check_args(args)
    train(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
