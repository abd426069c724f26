"""What the attention options do to a tile of scores, written once for the prefill kernels.

The options split in two. The static ones (`ScoreMods`: causal alignment, sliding window,
logit soft-cap) decide which code is compiled and where the key loop starts and stops; the
array ones (bias, mask, sinks, the scale) are kernel operands read tile by tile. The forward
kernel (jaxflash/prefill.py) and a backward kernel share these helpers, so the two passes
see the same visible keys and the same scores.

Positions: query row t of a sequence sits at key position p = t + shift, shift =
kv_len - q_len for bottom-right alignment (FlashAttention's convention) and 0 for top-left
(`jax.nn.dot_product_attention`'s tril over [T, S]). Row t sees key s when s < kv_len and

    p - left <= s <= p + right        (window (left, right); causal makes right 0)

so a block of rows sees one band of keys; only the key blocks that meet the band are ever
loaded, and only the blocks at its two edges need a per-score compare.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from jaxflash import _checks

CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")
LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class ScoreMods:
  """The static options (hashable: a jit static argument).

  is_causal: keys s <= p only. causal_alignment: "bottom_right" or "top_left" (see above).
  window: (left, right) ints >= 0 or None. logits_soft_cap: scores s become
  cap * tanh(s / cap) (after bias, before masking), or None.
  """

  is_causal: bool = False
  causal_alignment: str = "bottom_right"
  window: tuple[int, int] | None = None
  logits_soft_cap: float | None = None

  def __post_init__(self):
    if self.causal_alignment not in CAUSAL_ALIGNMENTS:
      raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got "
                       f"{self.causal_alignment!r}")

  @classmethod
  def from_options(cls, *, is_causal=False, causal_alignment="bottom_right", local_window_size=None,
                   logits_soft_cap=None) -> "ScoreMods":
    """The public functions' keywords, checked (`window_size`, `soft_cap`), as one value."""
    return cls(is_causal=_checks.check_bool("is_causal", is_causal), causal_alignment=causal_alignment,
               window=window_size(local_window_size), logits_soft_cap=soft_cap(logits_soft_cap))

  @property
  def left(self) -> int | None:
    """Keys before p a query may see (None: all)."""
    return None if self.window is None else self.window[0]

  @property
  def right(self) -> int | None:
    """Keys after p a query may see (None: all)."""
    if self.is_causal:
      return 0
    return None if self.window is None else self.window[1]

  def shift(self, q_len, kv_len):
    """p - t: kv_len - q_len (bottom-right) or 0 (top-left)."""
    return kv_len - q_len if self.causal_alignment == "bottom_right" else jnp.zeros_like(kv_len)


def window_size(local_window_size) -> tuple[int, int] | None:
  """jax.nn's `local_window_size`: None, an int w (= (w, w)) or (left, right), ints >= 0."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int,)) and not isinstance(local_window_size, bool):
    local_window_size = (local_window_size, local_window_size)
  try:
    left, right = (int(w) for w in local_window_size)
    ok = all(int(w) == w for w in local_window_size)
  except (TypeError, ValueError):
    ok = False
  if not ok or left < 0 or right < 0:
    raise ValueError(f"local_window_size must be an int >= 0 or a pair (left, right) of ints >= 0, "
                     f"got {local_window_size!r}")
  return left, right


def soft_cap(logits_soft_cap) -> float | None:
  """logits_soft_cap as a positive Python float (a static option), or None."""
  if logits_soft_cap is None:
    return None
  try:
    cap = float(logits_soft_cap)
  except Exception as e:  # a traced value cannot be a static option
    raise TypeError(f"logits_soft_cap must be a concrete number (a static option), got "
                    f"{type(logits_soft_cap).__name__}") from e
  if not cap > 0 or not math.isfinite(cap):
    raise ValueError(f"logits_soft_cap must be a finite number > 0, got {logits_soft_cap!r}")
  return cap


def key_range(mods: ScoreMods, first_row, last_row, shift, kv_valid):
  """Keys the rows first_row..last_row (inclusive, all valid) may see, as key indices:
  (lo, hi) the union of their windows and (full_lo, full_hi) the keys every one of them
  sees; both half-open and clipped to [0, kv_valid). Works on int32 scalars or arrays."""
  left, right = mods.left, mods.right
  lo = 0 if left is None else jnp.maximum(first_row + shift - left, 0)
  full_lo = 0 if left is None else jnp.maximum(last_row + shift - left, 0)
  hi = kv_valid if right is None else jnp.minimum(last_row + shift + right + 1, kv_valid)
  full_hi = kv_valid if right is None else jnp.minimum(first_row + shift + right + 1, kv_valid)
  as_int = lambda x: jnp.asarray(x, jnp.int32)
  return as_int(lo), as_int(jnp.maximum(hi, lo)), as_int(full_lo), as_int(full_hi)


def key_blocks(mods: ScoreMods, first_row, last_row, shift, kv_valid, block_k: int):
  """Key block bounds (lo, full_lo, full_hi, hi) for a block of rows: blocks [lo, full_lo)
  and [full_hi, hi) straddle a window edge or the end of the keys and run masked; blocks
  [full_lo, full_hi) are seen whole by every row; the rest are never loaded."""
  lo, hi, full_lo, full_hi = key_range(mods, first_row, last_row, shift, kv_valid)
  lo_block = lax.div(lo, block_k)
  hi_block = lax.div(hi + (block_k - 1), block_k)
  full_lo_block = jnp.clip(lax.div(full_lo + (block_k - 1), block_k), lo_block, hi_block)
  full_hi_block = jnp.clip(lax.div(jnp.maximum(full_hi, 0), block_k), full_lo_block, hi_block)
  return lo_block, full_lo_block, full_hi_block, hi_block


def query_range(mods: ScoreMods, first_key, last_key, shift, q_valid):
  """Rows that may see any of the keys first_key..last_key: half-open [lo, hi) clipped to
  [0, q_valid) (the inverse of `key_range`, for a pass that loops over queries per key
  block). Row t sees s when s - right <= t + shift <= s + left."""
  left, right = mods.left, mods.right
  lo = 0 if right is None else jnp.maximum(first_key - right - shift, 0)
  hi = q_valid if left is None else jnp.minimum(last_key + left - shift + 1, q_valid)
  return lo, jnp.maximum(hi, lo)


def query_blocks(mods: ScoreMods, first_key, last_key, shift, q_valid, block_q: int):
  """Query block bounds (lo, full_lo, full_hi, hi) for a block of keys (first_key..last_key,
  inclusive), `key_blocks` seen from the keys: blocks [lo, full_lo) and [full_hi, hi) hold
  rows that see part of the keys and run masked; every row of [full_lo, full_hi) sees them
  all; the rest never see one. Row t sees every key when last_key - right <= t + shift and
  t + shift <= first_key + left. Rows past q_valid in the last block are not masked here:
  the backward gives them an LSE of +inf, so they add nothing."""
  lo, hi = query_range(mods, first_key, last_key, shift, q_valid)
  lo_block = lax.div(lo, block_q)
  hi_block = lax.div(hi + (block_q - 1), block_q)
  if mods.right is None:
    full_lo_block = lo_block
  else:
    full_lo = jnp.maximum(last_key - mods.right - shift, 0)
    full_lo_block = jnp.clip(lax.div(full_lo + (block_q - 1), block_q), lo_block, hi_block)
  if mods.left is None:
    full_hi_block = jnp.maximum(hi_block, full_lo_block)
  else:
    full_hi = jnp.minimum(first_key + mods.left - shift + 1, q_valid)
    full_hi_block = jnp.clip(lax.div(jnp.maximum(full_hi, 0), block_q), full_lo_block, hi_block)
  as_int = lambda x: jnp.asarray(x, jnp.int32)
  return as_int(lo_block), as_int(full_lo_block), as_int(full_hi_block), as_int(hi_block)


def visible(mods: ScoreMods, rows, keys, shift, kv_valid, *, transposed: bool = False):
  """rows [R], keys [C] -> [R, C] bool: the structural mask (lengths, causal, window);
  [C, R] with `transposed` (the dK/dV kernel's layout)."""
  position = rows + shift
  position, keys = (position[None, :], keys[:, None]) if transposed else (position[:, None], keys[None, :])
  ok = keys < kv_valid
  if mods.right is not None:
    ok &= keys <= position + mods.right
  if mods.left is not None:
    ok &= keys >= position - mods.left
  return ok


def score_scale(mods: ScoreMods, scale):
  """The factor the kernels multiply q.k by: scale * log2(e) (scores in base 2, for exp2),
  or scale / cap with a soft-cap (tanh takes natural-scale scores; `scores` scales after)."""
  scale = jnp.asarray(scale, jnp.float32)
  if mods.logits_soft_cap is None:
    return scale * LOG2_E
  return scale / mods.logits_soft_cap


def scores(mods: ScoreMods, qk, qk_scale, bias=None):
  """qk [R, C] float32 dot products -> base-2 scores (scale, bias, soft-cap), before
  masking. bias: float32 broadcastable to [R, C] in natural units, or None."""
  cap = mods.logits_soft_cap
  if cap is None:
    s = qk * qk_scale
    return s if bias is None else s + bias * LOG2_E
  s = qk * qk_scale  # (scale / cap) * q.k
  if bias is not None:
    s = s + bias * (1. / cap)
  return jnp.tanh(s) * (cap * LOG2_E)


def scores_grad(mods: ScoreMods, ds, s):
  """dS with respect to the scaled, biased scores before the soft-cap: ds [R, C] float32
  is the gradient at the capped scores, s the base-2 scores `scores` returned. Through
  cap * tanh(x / cap) it is ds * (1 - tanh^2), tanh = s / (cap log2 e)."""
  cap = mods.logits_soft_cap
  if cap is None:
    return ds
  tanh = s * (1. / (cap * LOG2_E))
  return ds * (1. - tanh * tanh)
