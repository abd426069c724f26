"""Tiny random Qwen2 checkpoints written by Hugging Face transformers, for the model tests.

Built once per process (they are cheap, but the HF models are reused for reference
outputs) in a temporary directory removed at exit.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import numpy as np

VOCAB = 256


@functools.cache
def _root() -> str:
  root = tempfile.mkdtemp(prefix="jaxflash_qwen2_")
  atexit.register(shutil.rmtree, root, ignore_errors=True)
  return root


# Checkpoints with a sliding window of WINDOW tokens (smaller than the test prompts), on 2
# layers: "window-mixed" leaves the first (max_window_layers = 1) full, "window-all" windows
# them all.
WINDOW = 7
WINDOWED = {"window-mixed": 1, "window-all": 0}  # name -> max_window_layers


def _key(checkpoint) -> str:
  """A checkpoint's name: "tied" / "untied" (True / False, as the first tests name them) or
  a WINDOWED one."""
  if isinstance(checkpoint, bool):
    return "tied" if checkpoint else "untied"
  return checkpoint


def hf_checkpoint(tied: bool | str):
  """tied: True / False, or a checkpoint's name -> (directory, transformers model): random
  float32 weights (non-zero biases, non-unit norms) scaled so greedy decoding wanders over
  the vocabulary instead of repeating one token. 2 layers, hidden 64, GQA 4:2, eager
  attention. True / "tied": head_dim 16, tied embeddings; False / "untied": head_dim 32,
  untied; the WINDOWED ones: as "tied", with use_sliding_window and a window of WINDOW."""
  return _checkpoint(_key(tied))


@functools.cache
def _checkpoint(name: str):
  import torch
  from transformers import Qwen2Config, Qwen2ForCausalLM

  tied = name != "untied"
  window = dict(num_hidden_layers=2)
  if name in WINDOWED:
    window = dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
                  max_window_layers=WINDOWED[name])
  torch.manual_seed(1234 + tied + 10 * (name in WINDOWED))
  config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16 if tied else 32, tie_word_embeddings=tied,
                       max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                       attn_implementation="eager", **window)
  model = Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name_, param in model.named_parameters():
      if name_.endswith("norm.weight"):
        param.copy_(1 + 0.1 * torch.randn_like(param))
      elif name_.endswith("bias"):
        param.copy_(0.5 * torch.randn_like(param))
      elif "embed_tokens" in name_ or "lm_head" in name_:
        param.copy_(0.5 * torch.randn_like(param))
      else:
        param.copy_(2.0 * torch.randn_like(param) / param.shape[-1] ** 0.5)
  path = os.path.join(_root(), name)
  model.save_pretrained(path, safe_serialization=True)
  return path, model


def hf_greedy(checkpoint, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
  """transformers' greedy continuation of one prompt (no EOS configured: full length)."""
  return _greedy(_key(checkpoint), tuple(prompt), max_new_tokens)


@functools.cache
def _greedy(name: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
  import torch

  _, model = _checkpoint(name)
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def hf_logits(checkpoint, ids: np.ndarray) -> np.ndarray:
  """ids [B, T] -> transformers' logits [B, T, vocab] (float32)."""
  import torch

  _, model = hf_checkpoint(checkpoint)
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


def prompts(lengths, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, n).tolist() for n in lengths]
