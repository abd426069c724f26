"""How one forward pass of the model runs, decided once per call: `StepPlan`.

A call with a KV cache is a serving step (a prompt chunk, or a decode step of one token per
sequence). When it has at most 16 token rows in all, each product reads a whole weight
matrix for a handful of rows, and XLA's lowering of such products reads the weight three
times; the step then runs jaxflash's decode-step fusions (jaxflash/fused/) instead. Every
other call (training, `model(ids)`, batches of more than 16 rows) is plain XLA and
differentiable: the fused kernels have no VJP.

What varies is decided here, from the model and the batch, so that the layers read as the
math and call the fusions as functions:

* one device, or tensor parallel (`tensor_parallel`): a split model multiplies each device's
  shard with the skinny kernel (shard_map) and keeps XLA's scatter for the cache, which
  XLA partitions; the fusions that read whole heads or whole rows stay off;
* 16 rows or fewer (`skinny`): the products through jaxflash.skinny_matmul;
* one row (`split_kv`): attention's split-KV chunks are merged inside the output projection;
* head dims that do not divide the q/k/v kernel's column blocks (80, 96): that kernel takes
  two launches and needs no counters (`qkv_counters`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxflash.fused import MAX_ROWS, SPLIT_KV_MAX_ROWS, LinearConfig
from jaxflash.quantize import is_quantized
from models.qwen2.linear import fits_skinny

CACHE_WRITES = ("qkv", "kernel", "scatter")


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """How a forward pass computes (hashable: a static argument of the jitted steps).

  attention_impl: `jaxflash.attention`'s `implementation` (one of jaxflash.IMPLEMENTATIONS;
    None: the best kernel for the device).
  skinny: products whose weight fits (`models.qwen2.linear.fits_skinny`) go through
    jaxflash.skinny_matmul, on each device's shard when split.
  fused_qkv: the pre-attention RMSNorm, q/k/v products, biases and RoPE in one
    jaxflash.qkv_projection (one device).
  cache_write: how new keys and values reach the cache: "qkv" (inside qkv_projection, a
    decode step), "kernel" (jaxflash.kv_cache_write, a decode step) or "scatter" (XLA).
  qkv_counters: qkv_projection runs in one launch and counts its K chunks in the decode
    workspace's counters (`DecodeWorkspace`).
  residual_norm: the output projection's partial sums, the residual add and the RMSNorm
    before the MLP in one jaxflash.add_rms_norm (one device).
  split_kv: a decode step's attention hands its split-KV chunks unmerged to
    jaxflash.project_split_kv, which merges them as it multiplies by o_proj.
  tensor_parallel: the model's models.qwen2.TensorParallel, or None on one device.
  """

  attention_impl: str | None = None
  skinny: bool = False
  fused_qkv: bool = False
  cache_write: str = "scatter"
  qkv_counters: bool = False
  residual_norm: bool = False
  split_kv: bool = False
  tensor_parallel: Any = None

  def __post_init__(self):
    if self.cache_write not in CACHE_WRITES:
      raise ValueError(f"cache_write must be one of {CACHE_WRITES}, got {self.cache_write!r}")
    one_device = self.tensor_parallel is None
    needs = {
        "fused_qkv": self.skinny and one_device,
        "cache_write='qkv'": self.fused_qkv,
        "cache_write='kernel'": one_device,
        "qkv_counters": self.cache_write == "qkv",
        "residual_norm": self.skinny and one_device,
        "split_kv": self.residual_norm,
    }
    given = {"fused_qkv": self.fused_qkv, "cache_write='qkv'": self.cache_write == "qkv",
             "cache_write='kernel'": self.cache_write == "kernel", "qkv_counters": self.qkv_counters,
             "residual_norm": self.residual_norm, "split_kv": self.split_kv}
    for name, on in given.items():
      if on and not needs[name]:
        raise ValueError(f"StepPlan: {name} needs " + {
            "fused_qkv": "skinny on one device", "cache_write='qkv'": "fused_qkv",
            "cache_write='kernel'": "one device", "qkv_counters": "cache_write='qkv'",
            "residual_norm": "skinny on one device", "split_kv": "residual_norm"}[name])

  @classmethod
  def build(cls, model, tokens_shape: tuple[int, int], cache=None,
            attention_impl: str | None = None) -> StepPlan:
    """The plan for `model` (a Qwen2ForCausalLM) on tokens [B, T] with `cache` (or None)."""
    config = model.config
    batch, steps = tokens_shape
    rows = batch * steps
    tp = model.tensor_parallel
    one_device = tp is None
    decode = cache is not None and steps == 1
    skinny = cache is not None and 0 < rows <= MAX_ROWS
    fused_qkv = skinny and one_device
    cache_write = "scatter"
    quantized = cache is not None and is_quantized(cache.dtype)
    if decode and one_device:
      # The q/k/v kernel stores float rows; a quantized cache is written by kv_cache_write.
      cache_write = "qkv" if fused_qkv and not quantized else "kernel"
    o_proj = (config.num_attention_heads * config.head_dim, config.hidden_size)
    residual_norm = skinny and one_device and fits_skinny(o_proj)
    split_kv = (residual_norm and decode and rows <= SPLIT_KV_MAX_ROWS and attention_impl is None
                and (quantized or jnp.dtype(cache.dtype) == jnp.dtype(model.dtype)))
    # The one-launch form finishes whole heads in a column block of LinearConfig().block_n.
    qkv_counters = cache_write == "qkv" and LinearConfig().block_n % config.head_dim == 0
    return cls(attention_impl=attention_impl, skinny=skinny, fused_qkv=fused_qkv,
               cache_write=cache_write, qkv_counters=qkv_counters, residual_norm=residual_norm,
               split_kv=split_kv, tensor_parallel=tp)


# Slots of the q/k/v kernel's counters: one per column block of its product (36 for
# Qwen2.5-7B's, at the default 128-column blocks).
COUNTER_SLOTS = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWorkspace:
  """Scratch a decode step's kernels reuse from layer to layer and step to step.

  qkv_counters [COUNTER_SLOTS] int32, all zero: the one-launch jaxflash.qkv_projection counts
  its K chunks in them and leaves them zero again, so the decode loop hands the same donated
  buffer from layer to layer and step to step instead of zeroing a fresh one per layer (a
  memset node each in the step's CUDA graph).
  """

  qkv_counters: jax.Array

  @classmethod
  def create(cls, sharding=None) -> DecodeWorkspace:
    """Zeros; `sharding` (a model's TensorParallel, or None): replicated over its mesh."""
    device = None if sharding is None else sharding.named()
    return cls(jnp.zeros((COUNTER_SLOTS,), jnp.int32, device=device))
