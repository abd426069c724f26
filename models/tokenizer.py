"""A byte-level tokenizer built in code with the `tokenizers` library: one token per byte
(ids 0-255) plus Qwen's special tokens, so the demo runs without downloading anything."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
EOS_TOKEN = "<|endoftext|>"


def _printable_byte_alphabet() -> dict[int, str]:
  """byte -> the printable character byte-level BPE writes for it (GPT-2's scheme, which
  `pre_tokenizers.ByteLevel` and its decoder use): printable Latin-1 bytes stand for
  themselves, the rest are shifted past U+0100."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  alphabet, shifted = {}, 0
  for byte in range(256):
    if byte in printable:
      alphabet[byte] = chr(byte)
    else:
      alphabet[byte] = chr(256 + shifted)
      shifted += 1
  return alphabet


def byte_tokenizer() -> Tokenizer:
  """Token id = byte value for every byte; special tokens follow at 256.."""
  vocab = {char: byte for byte, char in _printable_byte_alphabet().items()}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
  return tokenizer
