"""`jaxflash.attention`: a drop-in for `jax.nn.dot_product_attention` backed by the kernels."""
from __future__ import annotations

import functools

import jax

from jaxflash import _checks, sharding
from jaxflash.reference import attention_reference, gather_pages

IMPLEMENTATIONS = (None, "pallas", "xla")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "is_causal", "local_window_size", "return_residual", "implementation"))
def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              block_table=None, return_residual=False, implementation=None):
  """Scaled dot-product attention with `jax.nn.dot_product_attention`'s arguments.

  Shapes: query [B, T, N, H] (or [T, N, H]); key/value [B, S, K, H] (or [S, K, H]) with
  N a multiple of K (GQA by index: query head n reads KV head n // (N // K)). With
  `block_table` [B, max_pages], key/value are page pools [num_pages, page_size, K, H] and
  T must be 1 (paged decode). Returns [B, T, N, H] in the query's dtype, and with
  `return_residual=True` also the natural-log log-sum-exp [B, T, N] in float32.

  Kernel chosen: T == 1 -> split-KV decode (paged decode with `block_table`), otherwise
  the FlashAttention-2 prefill kernel. Differences from jax.nn: `is_causal` with T < S
  aligns the diagonal bottom-right (query t sits at key position S_b - T_b + t), as
  FlashAttention does; rows with no key to attend to give zeros. `bias`, `mask` and
  `local_window_size` are not supported yet (NotImplementedError).

  Differentiable (jax.grad, jax.vjp, under jit, vmap, checkpoint, scan and on a mesh):
  the prefill and one-token decode paths run the FlashAttention-2 backward kernels
  (jaxflash/prefill_backward.py); paged decode raises NotImplementedError when
  differentiated, as do second derivatives; jax.jvp raises JAX's custom_vjp error.

  implementation: None (the Pallas kernels: compiled on a GPU, interpreted elsewhere),
  "pallas" (the same), or "xla" (plain-JAX reference path).

  Sharded inputs (under `jax.jit` on a mesh): batch and heads may be split (query heads N
  and KV heads K over the same mesh axes); each device runs the kernel on its shard and
  the results keep the split, with no collective. See `jaxflash.sharding`.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  for name, given in (("bias", bias), ("mask", mask), ("local_window_size", local_window_size)):
    if given is not None:
      raise NotImplementedError(f"jaxflash.attention does not support {name} yet")
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.check_float(name, x)
  unbatched = query.ndim == 3
  if unbatched:
    if block_table is not None:
      raise ValueError("block_table needs batched inputs: query [B, 1, N, H]")
    if key.ndim != 3 or value.ndim != 3:
      raise ValueError(f"query is unbatched [T, N, H], so key and value must be [S, K, H]; got key "
                       f"{tuple(key.shape)} and value {tuple(value.shape)}")
    query, key, value = query[None], key[None], value[None]
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
      raise ValueError("sequence lengths need batched inputs [B, T, N, H]")
  _checks.check_qkv(query, key, value)
  batch, t = query.shape[0], query.shape[1]
  scale = _checks.default_scale(scale, query.shape[-1])
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)

  if block_table is not None:
    block_table = _checks.check_block_table(block_table, batch)
    _checks.check_page_size(key.shape[1])
    if t != 1:
      raise ValueError(f"block_table (paged KV) serves one query token per sequence; got query "
                       f"{tuple(query.shape)}")
    if kv_lengths is None:
      raise ValueError("block_table needs key_value_seq_lengths: the valid tokens per sequence")
    if implementation == "xla":
      key, value = gather_pages(key, block_table), gather_pages(value, block_table)
    else:
      from jaxflash.paged import paged_decode_attention
      kernel = functools.partial(paged_decode_attention, scale=scale, return_residual=True)
      paged = _not_differentiable(functools.partial(sharding.paged, kernel), "paged decode (block_table)")
      result = paged(query, key, value, kv_lengths, block_table)
      return _finish(result, return_residual, unbatched)
  else:
    _checks.check_same_batch(query, key)

  if implementation == "xla":
    result = attention_reference(query, key, value, scale=scale, is_causal=is_causal,
                                 query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths)
  elif t == 1 and q_lengths is None:
    # One query token: with a bottom-right diagonal it sees every valid key, causal or not.
    # Its gradient is the prefill backward's with T = 1 (the same math, not causal).
    from jaxflash.decode import decode_attention
    kernel = functools.partial(decode_attention, scale=scale, return_residual=True)
    result = _differentiable(lambda q, k, v, _, kv_len: sharding.decode(kernel, q, k, v, kv_len),
                             query, key, value, None, kv_lengths, scale=scale, is_causal=False)
  else:
    from jaxflash.prefill import prefill_forward
    kernel = functools.partial(prefill_forward, scale=scale, is_causal=is_causal,
                               return_residual=True)
    result = _differentiable(functools.partial(sharding.prefill, kernel), query, key, value,
                             q_lengths, kv_lengths, scale=scale, is_causal=is_causal)
  return _finish(result, return_residual, unbatched)


def _differentiable(forward, query, key, value, q_lengths, kv_lengths, *, scale, is_causal):
  """forward(q, k, v, q_lengths, kv_lengths) -> (out, lse), differentiated by the
  FlashAttention-2 backward kernels (jaxflash/prefill_backward.py), both sharding-aware."""
  from jaxflash.prefill_backward import differentiable, prefill_backward
  kernel = functools.partial(prefill_backward, scale=scale, is_causal=is_causal)

  def backward(q, k, v, q_len, kv_len, out, lse, d_out, d_lse):
    def run(q, k, v, q_len, kv_len, out, lse, d_out, d_lse):
      return kernel(q, k, v, out, lse, d_out, d_lse, q_len, kv_len)
    return sharding.prefill_backward(run, q, k, v, q_len, kv_len, out, lse, d_out, d_lse)

  return differentiable(lambda q, k, v, q_len, kv_len, _: forward(q, k, v, q_len, kv_len), backward,
                        query, key, value, q_lengths, kv_lengths, return_residual=True,
                        what="jaxflash.attention")


def _not_differentiable(fn, path: str):
  """fn, raising NotImplementedError (naming `path`) where JAX would differentiate it."""
  wrapped = jax.custom_jvp(fn)

  def no_jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        f"jaxflash.attention: {path} is not differentiable; differentiate a contiguous cache "
        "or the prefill path, or use implementation='xla'")

  wrapped.defjvp(no_jvp)
  return wrapped


def _finish(result, return_residual: bool, unbatched: bool):
  out, lse = result
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
