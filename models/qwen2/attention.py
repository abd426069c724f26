"""Qwen2 self-attention: GQA with biased q/k/v projections and RoPE, computed by jaxflash.

Which kernel runs:
  * no cache (T >= 1): the FlashAttention-2 prefill kernel over the new tokens' own keys,
    causal, with `query_seq_lengths` = `key_value_seq_lengths` = the valid (unpadded)
    tokens of each right-padded row;
  * T > 1 new tokens per sequence with a cache (a prompt, or a chunk of one after the
    tokens already cached): `chunk_over_cache_attention`, the paged prefill kernel through
    the block table or the prefill kernel over the contiguous cache;
  * one new token per sequence with a cache (T == 1): the split-KV decode kernel over the
    contiguous cache, or the paged decode kernel through the block table.
`attention_impl` switches the same calls to jaxflash's plain-JAX path ("xla") or to
`jax.nn.dot_product_attention(implementation="cudnn")` ("cudnn", for benchmarks).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jaxflash
from jaxflash.reference import visible_keys
from models.qwen2.cache import LayerKV
from models.qwen2.config import ATTENTION_IMPLS
from models.qwen2.initializers import dense_init
from models.qwen2.linear import Projector
from models.qwen2.rope import apply_rope


def dot_product_attention(query, key, value, *, impl: str | None, is_causal: bool = False,
                          query_lengths=None, kv_lengths=None, block_table=None):
  """query [B, T, N, H]; key/value [B, S, K, H] or pages [P, page, K, H] with block_table
  [B, max_pages]; lengths [B] int32 -> [B, T, N, H]. Causal is bottom-right per sequence."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  if impl == "cudnn":
    if block_table is not None:
      key, value = jaxflash.gather_pages(key, block_table), jaxflash.gather_pages(value, block_table)
    # jax.nn's causal mask is top-left aligned; the model only asks for causal attention
    # when T == S (a prompt over its own keys), where both alignments agree.
    return jax.nn.dot_product_attention(query, key, value, is_causal=is_causal,
                                        query_seq_lengths=query_lengths,
                                        key_value_seq_lengths=kv_lengths, implementation="cudnn")
  return jaxflash.attention(query, key, value, is_causal=is_causal, query_seq_lengths=query_lengths,
                            key_value_seq_lengths=kv_lengths, block_table=block_table,
                            implementation=impl)


def chunk_over_cache_attention(query, kv: LayerKV, new_lengths, *, impl: str | None):
  """Chunked prefill: query [B, T, N, H], row b's first new_lengths[b] rows are its newest
  tokens, already written into kv's cache after the kv.lengths[b] tokens it held; each
  attends to every earlier token of its row and causally to the chunk (bottom-right: query t
  sits at position kv.lengths[b] + t). -> [B, T, N, H]; padding rows give zeros.

  Paged caches go through jaxflash.paged_prefill_attention (on one device; a split model,
  and "xla" / "cudnn", gather the pages first), contiguous ones through
  `dot_product_attention` over the whole cache (the prefill kernel's loop bounds stop at
  each row's length); "cudnn" with a bottom-right mask (jax.nn's causal mask is top-left)."""
  total = kv.lengths + new_lengths  # keys per row, the new ones included
  keys, values = kv.keys, kv.values
  if kv.paged and impl is None and jax.device_count() == 1:
    return jaxflash.paged_prefill_attention(query, keys, values, total, kv.block_table, new_lengths)
  if kv.paged:
    keys, values = jaxflash.gather_pages(keys, kv.block_table), jaxflash.gather_pages(values, kv.block_table)
  if impl == "cudnn":
    batch, steps = query.shape[:2]
    mask = visible_keys(batch, steps, keys.shape[1], is_causal=True, query_seq_lengths=new_lengths,
                        key_value_seq_lengths=total)[:, None]  # [B, 1, T, S]
    out = jax.nn.dot_product_attention(query, keys, values, mask=mask, implementation="cudnn")
    return jnp.where(jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None], out, 0)
  return dot_product_attention(query, keys, values, impl=impl, is_causal=True,
                               query_lengths=new_lengths, kv_lengths=total)


def _split_kv_chunks(query, kv: LayerKV, lengths) -> jaxflash.SplitKV:
  """query [B, 1, N, H] over kv's contiguous or paged cache: the decode kernels' chunks."""
  if kv.block_table is None:
    return jaxflash.decode_attention(query, kv.keys, kv.values, lengths, return_partials=True)
  return jaxflash.paged_decode_attention(query, kv.keys, kv.values, lengths, kv.block_table,
                                         return_partials=True)


class Attention(nnx.Module):
  """x [B, T, hidden] -> [B, T, hidden]: `num_heads` query heads share `num_kv_heads`
  key/value heads (query head n reads KV head n // (num_heads // num_kv_heads))."""

  def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               rope_theta: float, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.rope_theta = rope_theta
    dense = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=dense_init, rngs=rngs)
    self.q_proj = nnx.Linear(hidden_size, num_heads * head_dim, use_bias=True, **dense)
    self.k_proj = nnx.Linear(hidden_size, num_kv_heads * head_dim, use_bias=True, **dense)
    self.v_proj = nnx.Linear(hidden_size, num_kv_heads * head_dim, use_bias=True, **dense)
    self.o_proj = nnx.Linear(num_heads * head_dim, hidden_size, use_bias=False, **dense)

  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], lengths: jax.Array | None,
               kv: LayerKV | None = None, *, norm=None, attention_impl: str | None = None,
               projector: Projector = Projector()) -> tuple[jax.Array, LayerKV | None]:
    """x [B, T, hidden], or norm(x) the input when `norm` (an RMSNorm) is given; rope =
    (cos, sin) [B, T, head_dim/2]; lengths [B] valid new tokens per row (None: all T). With
    `kv`, the new keys/values are written after the tokens it holds and the updated LayerKV
    is returned; they attend to every cached token of their row and causally to each other
    (T > 1: a prompt, or a chunk of one, see `chunk_over_cache_attention`). `projector`: how
    the projections multiply (models/qwen2/linear.py)."""
    heads, kv = self.attend(x, rope, lengths, kv, norm=norm, attention_impl=attention_impl,
                            projector=projector)
    with jax.named_scope("output_projection"):
      return projector(self.o_proj, heads, "row"), kv

  def attend(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], lengths: jax.Array | None,
             kv: LayerKV | None = None, *, norm=None, attention_impl: str | None = None,
             projector: Projector = Projector(), split_kv: bool = False
             ) -> tuple[jax.Array | jaxflash.SplitKV, LayerKV | None]:
    """As `__call__`, but stops before the output projection: the heads' outputs
    [B, T, num_heads * head_dim] in x's dtype (and the LayerKV). With `split_kv`, a decode
    step on jaxflash's kernels with a cache of x's dtype returns the split-KV chunks unmerged
    instead (a jaxflash.SplitKV, for jaxflash.project_split_kv)."""
    batch, steps, _ = x.shape
    layers = (self.q_proj, self.k_proj, self.v_proj)
    new_lengths = jnp.full((batch,), steps, jnp.int32) if lengths is None else lengths
    with jax.named_scope("qkv_projection"):
      fused = None if norm is None else projector.qkv(norm, layers, x, rope, self.head_dim, kv, new_lengths)
      if fused is None:
        q, k, v = projector.many(layers, x if norm is None else norm(x), "column")
      else:
        q, k, v, kv = fused  # k, v None: the kernel wrote them into kv's cache
      q = q.reshape(batch, steps, self.num_heads, self.head_dim)
      if k is not None:
        k = k.reshape(batch, steps, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, steps, self.num_kv_heads, self.head_dim)
    if fused is None:
      with jax.named_scope("rope"):
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)

    if kv is not None and k is not None:
      with jax.named_scope("kv_cache_write"):
        kv = kv.write(k, v, new_lengths)

    with jax.named_scope("attention"):
      if kv is None:
        out = dot_product_attention(q, k, v, impl=attention_impl, is_causal=True,
                                    query_lengths=lengths, kv_lengths=lengths)
      elif steps > 1:
        out = chunk_over_cache_attention(q.astype(kv.keys.dtype), kv, new_lengths, impl=attention_impl)
      else:
        # One new token: it sees every cached key (a bottom-right diagonal at S_b),
        # so the decode kernels need no causal mask, only the lengths.
        if split_kv and attention_impl is None and kv.keys.dtype == x.dtype:
          return _split_kv_chunks(q.astype(kv.keys.dtype), kv, kv.lengths + new_lengths), kv
        out = dot_product_attention(q.astype(kv.keys.dtype), kv.keys, kv.values,
                                    impl=attention_impl, kv_lengths=kv.lengths + new_lengths,
                                    block_table=kv.block_table)
    return out.reshape(batch, steps, self.num_heads * self.head_dim).astype(x.dtype), kv
