"""Plain-JAX attention with every option the kernels take: the `implementation="xla"` path and
the reference every kernel is compared with. It materialises the [B, N, T, S] scores, so it is
for checking, gradients and small shapes, not speed.

The semantics, for query t of sequence b (T_b = query_seq_lengths[b], S_b =
key_value_seq_lengths[b]):
  * position p = t + S_b - T_b with `causal_alignment="bottom_right"` (FlashAttention's
    convention: a sequence's queries are its last T_b positions), p = t with "top_left"
    (`jax.nn.dot_product_attention`'s tril over [T, S]);
  * key s is visible when s < S_b, t < T_b, `mask[b, n, t, s]` (True = attend),
    `segment_ids[b, t] == kv_segment_ids[b, s]` (packed documents), s <= p under
    `is_causal`, and p - left <= s <= p + right under `local_window_size=(left, right)`;
  * the score is scale * q.k + bias[b, n, t, s], then cap * tanh(score / cap) with
    `logits_soft_cap`, -inf where not visible;
  * `sinks[n]` is one more logit in the softmax's denominator only (gpt-oss's attention sink):
    out = sum_s exp(score_s - lse) v_s with lse = log(sum_s exp(score_s) + exp(sink)).
The returned natural-log LSE includes the sink. Rows with no visible key give zeros and an LSE
of -inf (the sink's logit when `sinks` is given); padded query rows (t >= T_b) give zeros and -inf.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflash._types import Array, ArrayLike, Lengths, Window

CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


def visible_keys(batch: int, seq_q: int, seq_kv: int, *, is_causal: bool = False,
                 query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                 causal_alignment: str = "bottom_right"):
  """The [B, T, S] boolean mask of what lengths, causality and the window let each query see."""
  kv_len = (jnp.full((batch,), seq_kv, jnp.int32) if key_value_seq_lengths is None
            else jnp.asarray(key_value_seq_lengths, jnp.int32))
  q_len = (jnp.full((batch,), seq_q, jnp.int32) if query_seq_lengths is None
           else jnp.asarray(query_seq_lengths, jnp.int32))
  rows = jnp.arange(seq_q)[None, :, None]  # [1, T, 1]
  cols = jnp.arange(seq_kv)[None, None, :]  # [1, 1, S]
  shift = (kv_len - q_len) if causal_alignment == "bottom_right" else jnp.zeros_like(kv_len)
  position = rows + shift[:, None, None]  # [B, T, 1]
  visible = (cols < kv_len[:, None, None]) & (rows < q_len[:, None, None])  # [B, T, S]
  if is_causal:
    visible &= cols <= position
  if local_window_size is not None:
    left, right = local_window_size
    visible &= (cols >= position - left) & (cols <= position + right)
  return visible


def attention_reference(query: Array, key: Array, value: Array, bias: Array | None = None,
                        mask: Array | None = None, *, scale: float | Array, is_causal: bool = False,
                        query_seq_lengths: Lengths = None, key_value_seq_lengths: Lengths = None,
                        local_window_size: Window = None, logits_soft_cap: float | None = None,
                        sinks: Array | None = None, causal_alignment: str = "bottom_right",
                        segment_ids: Array | None = None, kv_segment_ids: Array | None = None
                        ) -> tuple[Array, Array]:
  """query [B, T, N, H], key/value [B, S, K, H] (N a multiple of K), bias/mask broadcastable to
  [B, N, T, S], sinks [N], local_window_size (left, right) or None, segment_ids [B, T] and
  kv_segment_ids [B, S] (both or neither) -> (out [B, T, N, H] in the
  query's dtype, natural-log lse [B, T, N] float32). Semantics: the module docstring."""
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  acc = jnp.promote_types(query.dtype, jnp.float32)
  q = query.astype(acc).reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
  # HIGHEST: float32 stays float32 on a GPU (not TF32), as a reference must.
  highest = jax.lax.Precision.HIGHEST
  scores = jnp.einsum("btkgh,bskh->bkgts", q, key.astype(acc), precision=highest) * scale  # [B, K, G, T, S]
  scores = scores.reshape(b, n, t, s)  # [B, N, T, S]: head n = k * G + g
  if bias is not None:
    scores = scores + jnp.broadcast_to(bias, (b, n, t, s)).astype(acc)
  if logits_soft_cap is not None:
    scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
  visible = visible_keys(b, t, s, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths,
                         local_window_size=local_window_size,
                         causal_alignment=causal_alignment)[:, None]  # [B, 1, T, S]
  if mask is not None:
    visible = visible & jnp.broadcast_to(mask, (b, n, t, s))
  if segment_ids is not None:
    visible = visible & (jnp.asarray(segment_ids)[:, None, :, None]
                         == jnp.asarray(kv_segment_ids)[:, None, None, :])
  visible = jnp.broadcast_to(visible, (b, n, t, s))
  scores = jnp.where(visible, scores, -jnp.inf)
  if sinks is not None:
    sink = jnp.broadcast_to(jnp.asarray(sinks, acc)[None, :, None, None], (b, n, t, 1))
    lse = jax.nn.logsumexp(jnp.concatenate([scores, sink], axis=-1), axis=-1)  # [B, N, T]
  else:
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, N, T]
  safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  probs = jnp.where(visible, jnp.exp(scores - safe_lse[..., None]), 0.0)  # [B, N, T, S]
  probs = probs.reshape(b, kh, n // kh, t, s)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, value.astype(acc), precision=highest)
  out = out.reshape(b, t, n, h).astype(query.dtype)
  q_len = t if query_seq_lengths is None else jnp.asarray(query_seq_lengths)[:, None, None]
  padded = jnp.arange(t)[None, None, :] >= q_len  # [B or 1, 1, T]
  lse = jnp.where(padded, -jnp.inf, lse)
  return out, lse.transpose(0, 2, 1).astype(jnp.float32)


def gather_pages(pages: Array, block_table: ArrayLike) -> Array:
  """pages [P, page, K, H], block_table [B, M] -> contiguous [B, M * page, K, H]."""
  b, m = block_table.shape
  _, page, kh, h = pages.shape
  return pages[block_table].reshape(b, m * page, kh, h)
