"""Float64 NumPy attention: the ground truth every test compares with."""
from __future__ import annotations

import numpy as np


def attention_f64(q, k, v, *, scale=None, is_causal=False, q_lengths=None, kv_lengths=None):
  """q [B, T, N, H], k/v [B, S, K, H] -> (out [B, T, N, H], lse [B, T, N]) in float64.

  Bottom-right causal: query t of sequence b sits at key position kv_len_b - q_len_b + t.
  Rows with nothing to attend to (and padded query rows) give zeros and lse = -inf.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  scale = h ** -0.5 if scale is None else scale
  group = n // kh
  k = np.repeat(k, group, axis=2)  # [B, S, N, H]
  v = np.repeat(v, group, axis=2)
  scores = np.einsum("btnh,bsnh->bnts", q, k) * scale
  kv_len = np.full(b, s) if kv_lengths is None else np.asarray(kv_lengths)
  q_len = np.full(b, t) if q_lengths is None else np.asarray(q_lengths)
  rows, cols = np.arange(t)[None, :, None], np.arange(s)[None, None, :]
  mask = (cols < kv_len[:, None, None]) & (rows < q_len[:, None, None])
  if is_causal:
    mask = mask & (cols <= rows + (kv_len - q_len)[:, None, None])
  mask = np.broadcast_to(mask[:, None], scores.shape)
  scores = np.where(mask, scores, -np.inf)
  m = scores.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(mask, np.exp(scores - m), 0.0)
  denom = p.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p / np.where(denom > 0, denom, 1.0), v)
  with np.errstate(divide="ignore"):
    lse = (np.log(denom) + m)[..., 0]  # [B, N, T]
  return out, lse.transpose(0, 2, 1)


def gather_pages_np(pages, block_table):
  """pages [P, page, K, H], table [B, M] -> [B, M * page, K, H]."""
  pages, table = np.asarray(pages), np.asarray(block_table)
  b, m = table.shape
  return pages[table].reshape(b, m * pages.shape[1], *pages.shape[2:])
