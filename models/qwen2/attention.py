"""Qwen2 self-attention: GQA with biased q/k/v projections and RoPE, computed by jaxflash.

Which attention runs (`attend`):
  * no cache: the new tokens over their own keys, causal, each right-padded row's valid
    tokens (`lengths`) as both query and key lengths;
  * a cache and T new tokens per row: they are written after the row's cached tokens, then
    attend to everything cached plus themselves, causal with the diagonal bottom-right (query
    t of row b sits at position cache_lengths[b] + t). T == 1 (a decode step) is the split-KV
    decode kernel over the contiguous cache, or the paged decode kernel through the block
    table; T > 1 (a prompt, or a chunk of one) the FlashAttention-2 prefill kernel.

A layer with a sliding window of W (Qwen2's `sliding_window`, on the layers
`Qwen2Config.layer_window` names) passes local_window_size=(W - 1, 0) to every one of these
calls: a query at position p sees keys p - W + 1 .. p, W keys with itself, as transformers'
Qwen2 masks them. The kernels skip the key blocks before the window, and the decode kernels
read only the window's pages, so the paged cache may free pages that have fallen out of
every layer's window (models/qwen2/sampler.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash
from models.qwen2.cache import LayerKV
from models.qwen2.initializers import dense_init
from models.qwen2.linear import PartialSums, compute_dtype, project, skinny_partials
from models.qwen2.norm import RMSNorm
from models.qwen2.plan import DecodeWorkspace, StepPlan
from models.qwen2.rope import apply_rope


def dot_product_attention(query, key, value, *, impl: str | None, is_causal: bool,
                          query_lengths=None, kv_lengths=None, block_table=None,
                          local_window_size=None, segment_ids=None, k_scale=None,
                          v_scale=None) -> jax.Array:
  """query [B, T, N, H]; key/value [B, S, K, H] or page pools [P, page, K, H] with block_table
  [B, max_pages]; lengths [B] int32 -> [B, T, N, H]. Causal is bottom-right per row: query t
  of row b sits at key position kv_lengths[b] - query_lengths[b] + t (FlashAttention's
  convention), so new tokens after a cached prefix see the prefix; local_window_size
  (left, right) keeps keys [p - left, p + right] of a query at position p; segment_ids [B, T]
  (packed documents, no cache) keeps keys of the query's own document; k_scale/v_scale are a
  quantized cache's scales. The model's one call into jaxflash.attention, so that the causal
  alignment is named in one place."""
  return jaxflash.attention(query, key, value, is_causal=is_causal, query_seq_lengths=query_lengths,
                            key_value_seq_lengths=kv_lengths, block_table=block_table,
                            local_window_size=local_window_size, implementation=impl,
                            causal_alignment="bottom_right", segment_ids=segment_ids,
                            k_scale=k_scale, v_scale=v_scale)


class Attention(nnx.Module):
  """norm(x) [B, T, hidden] -> attention's output through o_proj [B, T, hidden]: `num_heads`
  query heads share `num_kv_heads` key/value heads (query head n reads KV head
  n // (num_heads // num_kv_heads)). `sliding_window` W (None: none): each query sees only
  the W keys ending at its own position, in every path (a static property of the layer)."""

  def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
               sliding_window: int | None = None):
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.sliding_window = sliding_window
    dense = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=dense_init, rngs=rngs)
    self.q_proj = nnx.Linear(hidden_size, num_heads * head_dim, use_bias=True, **dense)
    self.k_proj = nnx.Linear(hidden_size, num_kv_heads * head_dim, use_bias=True, **dense)
    self.v_proj = nnx.Linear(hidden_size, num_kv_heads * head_dim, use_bias=True, **dense)
    self.o_proj = nnx.Linear(num_heads * head_dim, hidden_size, use_bias=False, **dense)

  def __call__(self, x: jax.Array, norm: RMSNorm, rope: tuple[jax.Array, jax.Array],
               lengths: jax.Array | None, kv: LayerKV | None, *, plan: StepPlan,
               workspace: DecodeWorkspace | None = None, segment_ids: jax.Array | None = None
               ) -> tuple[PartialSums, LayerKV | None, DecodeWorkspace | None]:
    """Attention of norm(x), x [B, T, hidden] (the norm is applied here: in a decode step it
    folds into the q/k/v kernel); rope = (cos, sin) [B, T, head_dim/2]; lengths [B] valid
    new tokens per row (None: all T). With `kv`, the new keys/values are written to it
    first. Returns (o_proj(heads) as PartialSums [S, B, T, hidden], the updated LayerKV, the
    workspace)."""
    batch, steps, _ = x.shape
    new_lengths = jnp.full((batch,), steps, jnp.int32) if lengths is None else lengths
    with jax.named_scope("qkv_projection"):
      if plan.fused_qkv:
        q, k, v, kv, workspace = self._fused_qkv(x, norm, rope, kv, new_lengths, plan, workspace)
      else:
        q, k, v = project((self.q_proj, self.k_proj, self.v_proj), norm(x), plan, "column")
      q = q.reshape(batch, steps, self.num_heads, self.head_dim)
      if k is not None:
        k = k.reshape(batch, steps, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, steps, self.num_kv_heads, self.head_dim)
    if not plan.fused_qkv:
      with jax.named_scope("rope"):
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if kv is not None and k is not None:
      with jax.named_scope("kv_cache_write"):
        kv = kv.write(k, v, new_lengths, kernel=plan.cache_write == "kernel")
    with jax.named_scope("attention"):
      heads = self.attend(q, k, v, kv, lengths, new_lengths, plan, segment_ids)
    with jax.named_scope("output_projection"):
      return self._output_projection(heads, x.dtype, plan), kv, workspace

  def attend(self, q, k, v, kv: LayerKV | None, lengths, new_lengths, plan: StepPlan,
             segment_ids=None):
    """q [B, T, N, H] over k, v [B, T, K, H] (no cache) or over kv's cache, which already
    holds the new tokens -> heads [B, T, N * H], or a decode step's unmerged split-KV chunks
    (jaxflash.SplitKV) with `plan.split_kv`. segment_ids [B, T]: packed documents (no cache)."""
    batch, steps = q.shape[:2]
    impl = plan.attention_impl
    # Transformers' Qwen2 window: key j is seen from position p when p - W < j <= p.
    window = None if self.sliding_window is None else (self.sliding_window - 1, 0)
    if kv is None:
      out = dot_product_attention(q, k, v, impl=impl, is_causal=True, query_lengths=lengths,
                                  kv_lengths=lengths, local_window_size=window,
                                  segment_ids=segment_ids)
      return out.reshape(batch, steps, -1)
    if not kv.scales:  # a quantized cache is dequantized into the query's dtype instead
      q = q.astype(kv.keys.dtype)
    total = kv.lengths + new_lengths  # [B] tokens in the cache, the new ones included
    if steps == 1:
      # One new token sees every cached key in its window: the decode kernels need only the
      # lengths and the window (they read only the window's part of the cache).
      if plan.split_kv:
        if kv.paged:
          return jaxflash.paged_decode_attention(q, kv.keys, kv.values, total, kv.block_table,
                                                 local_window_size=window, return_partials=True,
                                                 **kv.scales)
        return jaxflash.decode_attention(q, kv.keys, kv.values, total, local_window_size=window,
                                         return_partials=True, **kv.scales)
      out = dot_product_attention(q, kv.keys, kv.values, impl=impl, is_causal=False,
                                  kv_lengths=total, block_table=kv.block_table,
                                  local_window_size=window, **kv.scales)
      return out.reshape(batch, steps, -1)
    # A prompt, or a chunk of one, over the cache: the prefill over the contiguous cache or
    # through the block table (jaxflash.attention picks the kernel: Mosaic GPU on sm_90).
    out = dot_product_attention(q, kv.keys, kv.values, impl=impl, is_causal=True,
                                query_lengths=new_lengths, kv_lengths=total,
                                block_table=kv.block_table, local_window_size=window, **kv.scales)
    return out.reshape(batch, steps, -1)

  def _fused_qkv(self, x, norm: RMSNorm, rope, kv: LayerKV | None, new_lengths, plan: StepPlan,
                 workspace: DecodeWorkspace | None):
    """(q, k, v, kv, workspace) of norm(x) from jaxflash.qkv_projection: RMSNorm, products,
    biases and RoPE in one kernel (two for head dims it cannot finish in one). With
    `plan.cache_write == "qkv"` it also writes k and v into kv's cache at kv.lengths (rows
    with new_lengths 0 write nothing): k and v come back None and kv updated."""
    layers = (self.q_proj, self.k_proj, self.v_proj)
    dtype = compute_dtype(self.q_proj, x)
    biases = tuple(layer.bias[...].astype(dtype) for layer in layers)
    args = (x.astype(dtype), norm.scale[...], tuple(layer.kernel[...].astype(dtype) for layer in layers),
            biases, *rope)
    if plan.cache_write != "qkv":
      q, k, v = jaxflash.qkv_projection(*args, head_dim=self.head_dim, eps=norm.eps)
      return q, k, v, kv, workspace
    counters = workspace.qkv_counters if plan.qkv_counters else None
    q, keys, values, *rest = jaxflash.qkv_projection(
        *args, head_dim=self.head_dim, eps=norm.eps, kv_cache=(kv.keys, kv.values),
        positions=kv.token_positions(new_lengths), block_table=kv.block_table, counters=counters)
    if rest:  # the counters, zero again
      workspace = DecodeWorkspace(rest[0])
    return q, None, None, dataclasses.replace(kv, keys=keys, values=values), workspace

  def _output_projection(self, heads, dtype, plan: StepPlan) -> PartialSums:
    """o_proj(heads) as partial sums for the residual add: the skinny kernel's K chunks, or
    with a jaxflash.SplitKV, jaxflash.project_split_kv's per-head products (it merges the
    chunks as it multiplies); otherwise the product itself."""
    if isinstance(heads, jaxflash.SplitKV):
      weight = self.o_proj.kernel[...].astype(dtype)
      return PartialSums(jaxflash.project_split_kv(heads, weight, return_partials=True), dtype)
    if plan.residual_norm:
      return skinny_partials(self.o_proj, heads.astype(dtype))
    return PartialSums.of(project((self.o_proj,), heads.astype(dtype), plan, "row")[0])
