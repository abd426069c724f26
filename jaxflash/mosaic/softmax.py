"""The online softmax of the Mosaic prefill, one key block at a time (FlashAttention-2,
Dao 2023, section 3.1.1), in base 2 with the scale folded into one multiply-add: scores
times scale * log2 e minus the running max, exp2 lowered to ex2.approx. The output is
divided by the running sum once, at the end of the tile.

Its variants, chosen once per kernel:
* the running max (FlashAttention-2), or FlashAttention-4's conditional rescaling: a row's
  max, and with it the accumulator's rescale, changes only when a block's max exceeds it by
  more than a factor 2^RESCALE_THRESHOLD, and a warp whose rows all kept theirs skips the
  multiply;
* a fixed reference: in the key blocks a row sees whole, the exponentials subtract the
  first key block's row max instead of a running max, so those steps compute no row max and
  never rescale (any reference gives the same softmax; the running max only keeps exp2 in
  range). Rows that overflow float32 are flagged by the caller and recomputed;
* row sums from PV (`sums_from_pv`): the output's sums come out of the tensor cores (V^T
  with rows of ones), and the step adds only the LSE's.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _mosaic
from jaxflash._mosaic import plgpu

# conditional_rescale: the running max moves only when a block's row max exceeds it by more
# than this (base 2: probabilities up to 2^8), as FlashAttention-4 does.
RESCALE_THRESHOLD = 8.0


def rows_bcast(x, shape):
  """x [rows] -> [rows, cols] (each row's value along its columns)."""
  return lax.broadcast_in_dim(x, shape, [0])


class RowSums(NamedTuple):
  """A consumer's running row sums, [block_q] float32 each.

  `output` divides the output: the sums of P as PV multiplies it (rounded to bf16 / fp16),
  so that the numerator (P V) and the denominator weigh every key alike. Where the subtracted
  reference is not the row max (fixed reference, conditional rescaling), a dominant key's
  probability is not 1 and rounds by up to 2^-9, bf16's rounding, and summed before rounding
  that error would show in the output. None with the sums from PV: the tensor cores add them.
  `lse`: the sums of P in float32, for the LSE, which the backward divides by; from rounded P
  it would be off by that rounding on peaky rows, and every gradient with it."""
  output: jax.Array | None
  lse: jax.Array


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
  qk_scale: float  # scale * log2(e): scores to base-2 exponents
  conditional_rescale: bool
  fixed_reference: bool
  sums_from_pv: bool

  def zero_sums(self, block_q: int) -> RowSums:
    zero = lambda: plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32),
                                     plgpu.Layout.WGMMA.reduce(1))
    return RowSums(None if self.sums_from_pv else zero(), zero())

  def step(self, s, m_i, *, masked: bool):
    """Scores s [block_q, block_kv] float32 of one key block (masked: -inf where a row does
    not see a key) -> (P float32, the new running max, alpha that rescales what was summed
    before: the accumulator and the row sums; None: nothing to rescale). m is kept in scaled
    units so p = exp2(s * c - m) is one FMA per score."""
    if self.fixed_reference and not masked:
      # m_i stays the reference: no row max, no rescale (an overflow shows in the sums or
      # acc at the end of the tile, which is then recomputed).
      return jnp.exp2(s * self.qk_scale - rows_bcast(m_i, s.shape)), m_i, None
    m_block = s.max(axis=1) * self.qk_scale
    if self.conditional_rescale:
      # A row keeps its running max until the block's is more than RESCALE_THRESHOLD above
      # it: p <= 2^threshold stays well inside float32 and bf16, and the output and LSE are
      # the same (both use the max that was kept).
      m_new = jnp.where(m_block > m_i + RESCALE_THRESHOLD, m_block, m_i)
    else:
      m_new = jnp.maximum(m_i, m_block)
    # A row that has seen no key keeps m = -inf; subtract 0 instead (no -inf - -inf).
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m_i - m_safe)
    return jnp.exp2(s * self.qk_scale - rows_bcast(m_safe, s.shape)), m_new, alpha

  def add_row_sums(self, sums: RowSums, alpha, p, p_tile) -> RowSums:
    """The sums rescaled by alpha (None: kept), plus this block's: p [block_q, block_kv]
    float32 and p_tile, P as PV multiplies it."""
    if alpha is not None:
      sums = RowSums(None if sums.output is None else sums.output * alpha, sums.lse * alpha)
    output = None if self.sums_from_pv else sums.output + p_tile.astype(jnp.float32).sum(axis=1)
    return RowSums(output, sums.lse + p.sum(axis=1))

  def rescale(self, acc, alpha):
    """acc [block_q, H] times alpha [block_q] per row (None: kept): skipped by the warps
    whose rows all kept their max under conditional rescaling."""
    if alpha is None:
      return acc
    if self.conditional_rescale:
      return _mosaic.scale_rows_if_any(acc, alpha)
    return acc * rows_bcast(alpha, acc.shape)
