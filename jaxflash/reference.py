"""Plain-JAX attention with jaxflash's semantics: the `implementation="xla"` path and the
reference every kernel is compared with. It materialises the [B, N, T, S] scores, so it is
for checking and small shapes, not speed."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(query, key, value, *, scale: float, is_causal: bool = False,
                        query_seq_lengths=None, key_value_seq_lengths=None):
  """query [B, T, N, H], key/value [B, S, K, H] -> (out [B, T, N, H], lse [B, T, N] float32).

  Query t of sequence b sits at key position S_b - T_b + t (bottom-right causal alignment,
  S_b / T_b = that sequence's key / query length). Rows with nothing to attend to, and
  padded query rows, give zeros and an LSE of -inf.
  """
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  acc = jnp.promote_types(query.dtype, jnp.float32)
  q = query.astype(acc).reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
  scores = jnp.einsum("btkgh,bskh->bkgts", q, key.astype(acc)) * scale  # [B, K, G, T, S]
  kv_len = jnp.full((b,), s, jnp.int32) if key_value_seq_lengths is None else key_value_seq_lengths
  q_len = jnp.full((b,), t, jnp.int32) if query_seq_lengths is None else query_seq_lengths
  rows = jnp.arange(t)[None, :, None]  # [1, T, 1]
  cols = jnp.arange(s)[None, None, :]  # [1, 1, S]
  mask = (cols < kv_len[:, None, None]) & (rows < q_len[:, None, None])  # [B, T, S]
  if is_causal:
    mask &= cols <= rows + (kv_len - q_len)[:, None, None]
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)  # [B, K, G, T]
  safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  probs = jnp.where(mask[:, None, None], jnp.exp(scores - safe_lse[..., None]), 0.0)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, value.astype(acc))
  out = out.reshape(b, t, n, h).astype(query.dtype)
  lse = lse.transpose(0, 3, 1, 2).reshape(b, t, n).astype(jnp.float32)
  return out, lse


def gather_pages(pages, block_table):
  """pages [P, page, K, H], block_table [B, M] -> contiguous [B, M * page, K, H]."""
  b, m = block_table.shape
  _, page, kh, h = pages.shape
  return pages[block_table].reshape(b, m * page, kh, h)
