"""Float64 NumPy attention: the ground truth every test compares with.

Semantics as jaxflash/reference.py's docstring: bottom-right (default) or top-left causal
alignment, lengths, boolean `mask` and float `bias` broadcastable to [B, N, T, S], a sliding
window (left, right), a logit soft-cap, and per-head sink logits counted in the denominator
(and in the returned LSE)."""
from __future__ import annotations

import numpy as np


def attention_f64(q, k, v, *, scale=None, is_causal=False, q_lengths=None, kv_lengths=None,
                  bias=None, mask=None, window=None, softcap=None, sinks=None,
                  alignment="bottom_right"):
  """q [B, T, N, H], k/v [B, S, K, H] -> (out [B, T, N, H], lse [B, T, N]) in float64.

  Bottom-right causal by default: query t of sequence b sits at key position
  kv_len_b - q_len_b + t ("top_left": at t). Rows with nothing to attend to give zeros and
  lse = -inf (the sink's logit with `sinks`); padded query rows give zeros and -inf.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  scale = h ** -0.5 if scale is None else scale
  group = n // kh
  k = np.repeat(k, group, axis=2)  # [B, S, N, H]
  v = np.repeat(v, group, axis=2)
  scores = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if bias is not None:
    scores = scores + np.broadcast_to(np.asarray(bias, np.float64), scores.shape)
  if softcap is not None:
    scores = softcap * np.tanh(scores / softcap)
  kv_len = np.full(b, s) if kv_lengths is None else np.asarray(kv_lengths)
  q_len = np.full(b, t) if q_lengths is None else np.asarray(q_lengths)
  rows, cols = np.arange(t)[None, :, None], np.arange(s)[None, None, :]
  shift = (kv_len - q_len) if alignment == "bottom_right" else np.zeros(b, int)
  position = rows + shift[:, None, None]
  visible = (cols < kv_len[:, None, None]) & (rows < q_len[:, None, None])
  if is_causal:
    visible = visible & (cols <= position)
  if window is not None:
    left, right = window
    visible = visible & (cols >= position - left) & (cols <= position + right)
  visible = np.broadcast_to(visible[:, None], scores.shape)
  if mask is not None:
    visible = visible & np.broadcast_to(np.asarray(mask, bool), scores.shape)
  scores = np.where(visible, scores, -np.inf)
  m = scores.max(-1, keepdims=True)
  if sinks is not None:
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], m.shape)
    m = np.maximum(m, sink)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(visible, np.exp(scores - m), 0.0)
  denom = p.sum(-1, keepdims=True)
  if sinks is not None:
    denom = denom + np.exp(sink - m)
  out = np.einsum("bnts,bsnh->btnh", p / np.where(denom > 0, denom, 1.0), v)
  with np.errstate(divide="ignore"):
    lse = (np.log(denom) + m)[..., 0]  # [B, N, T]
  lse = np.where((np.arange(t)[None, None, :] >= q_len[:, None, None]), -np.inf, lse)
  return out, lse.transpose(0, 2, 1)


def gather_pages_np(pages, block_table):
  """pages [P, page, K, H], table [B, M] -> [B, M * page, K, H]."""
  pages, table = np.asarray(pages), np.asarray(block_table)
  b, m = table.shape
  return pages[table].reshape(b, m * pages.shape[1], *pages.shape[2:])
