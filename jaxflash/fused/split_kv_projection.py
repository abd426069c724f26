"""The attention's output projection computed from split-KV decode's chunks: merge and product
in one kernel.

Split-KV decode (jaxflash/decode.py) ends with a small kernel that merges each head's chunks
by their log-sum-exps, and the layer's output projection then multiplies the merged heads
[B, N * H] by w [N * H, D]. In a decode step both are latency, not bandwidth: the merge reads
a few KB and the product a few MB (the 1.5B model: 1.6 + 3.8 us a layer on the H200,
bench/PERFORMANCE.md). Here one program per (output column block, head, up to 8 sequences) merges its
head's chunks itself (each column block of a head redoes that small merge: a few KB from L2)
and multiplies the merged head by the head's [H, block_n] rows of w. Nothing in a program
waits for another, and w's tile is requested at the start, while the merge computes.

The products are per head: fp32 partial sums [N, ..., D] whose total is the projection
(`return_partials=True`, for `jaxflash.add_rms_norm`, which adds them as it reads them), or
their sum. At most a few rows, the product is a multiply and a column sum on the CUDA cores:
no 16-row padding for `tl.dot`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxflash import _checks, configs
from jaxflash._triton import LN_2, CompilerParams, load, load_masked, mask2d, pl, quiet, store, use_interpret
from jaxflash._types import DTypeLike
from jaxflash._util import NEG_INF, next_power_of_2
from jaxflash.decode import SplitKV, chunk_shares, decode_combine_reference, merge_chunks

BLOCK_N = 64  # output columns per program (64 x 4 warps: 3.9 us at the 1.5B o_proj, 128: 4.3)
NUM_WARPS = 4
# Sequences per program, each weight tile read once for all of them (one program per
# sequence read it 8 times at batch 8 and cost the 1.5B step 0.1 ms: bench/PERFORMANCE.md).
MAX_ROWS_PER_PROGRAM = 8


def _merge_project_kernel(out_ref, lse2_ref, w_ref, o_ref, *, batch: int, rows: int, splits: int,
                          head_dim: int, width: int, block_n: int, merged_dtype):
  """Program (j, n, g): columns j*block_n.. of head n's product for sequences g*rows...

  out_ref [B, S, N, H] f32, lse2_ref [B, S, N] f32 (SplitKV); w_ref [N * H, D];
  o_ref [N, B, D] f32 per-head products.
  """
  j, n, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  splits_p = max(2, next_power_of_2(splits))
  head_dim_p = configs.padded_head_dim(head_dim)
  split_ok = jnp.arange(splits_p) < splits
  dim_ok = None if head_dim_p == head_dim else jnp.arange(head_dim_p) < head_dim
  col_ok = None if width % block_n == 0 else j * block_n + jnp.arange(block_n) < width
  # The weight tile depends on nothing: its load goes first and overlaps the merges. It is
  # read once for all of the program's sequences.
  w = load_masked(w_ref.at[pl.ds(n * head_dim, head_dim_p), pl.ds(j * block_n, block_n)],
                  mask2d(dim_ok, col_ok)).astype(jnp.float32)  # [H_p, block_n]
  for r in range(rows):  # static: the sequences' loads are all in flight at once
    b = g * rows + r
    real = b < batch  # past the batch (its last group): reads the last row, stores nothing
    b = jnp.minimum(b, batch - 1)
    lse2 = load(lse2_ref.at[b, pl.ds(0, splits_p), n], mask=split_ok, other=NEG_INF)  # [S_p]
    chunks = load_masked(out_ref.at[b, pl.ds(0, splits_p), n, pl.ds(0, head_dim_p)],
                         mask2d(split_ok, dim_ok, (splits_p, head_dim_p)))  # [S_p, H_p]
    _, share, total = chunk_shares(lse2)  # every chunk empty (length 0): zeros, not NaN
    head = merge_chunks(share, total, chunks)  # [H_p]
    # The merged head rounded as the attention's output would be, then the product in fp32.
    head = head.astype(merged_dtype).astype(jnp.float32)
    product = jnp.sum(head[:, None] * w, axis=0)  # [block_n]
    store_ok = real if col_ok is None else real & col_ok
    store(o_ref.at[n, b, pl.ds(j * block_n, block_n)], product,
          mask=jnp.broadcast_to(store_ok, (block_n,)))


def _check(split: SplitKV, w):
  if not isinstance(split, SplitKV):
    raise TypeError(f"project_split_kv takes the SplitKV of decode_attention(..., return_partials=True), "
                    f"got {type(split).__name__}")
  _checks.check_float("w", w)
  out, lse2 = split
  if out.ndim != 4 or lse2.shape != out.shape[:3]:
    raise ValueError(f"a SplitKV holds out [B, S, N, H] and lse2 [B, S, N], got out {tuple(out.shape)} "
                     f"and lse2 {tuple(lse2.shape)}")
  num_heads, head_dim = out.shape[2:]
  if w.ndim != 2 or w.shape[0] != num_heads * head_dim:
    raise ValueError(f"w must be [N * H, D] = [{num_heads * head_dim}, D] for heads out "
                     f"{tuple(out.shape)}, got w {tuple(w.shape)}")


@functools.partial(jax.jit, static_argnames=("merged_dtype", "return_partials", "interpret"))
def project_split_kv(split: SplitKV, w: jax.Array, *, merged_dtype: DTypeLike | None = None,
                     return_partials: bool = False, interpret: bool | None = None) -> jax.Array:
  """merge(split) @ w: the decode attention's output [B, 1, N * H] times w [N * H, D].

  split: `decode_attention(..., return_partials=True)` or its paged twin. Each head is merged
  in fp32 and rounded to `merged_dtype` (default: w's dtype), as the merged output would be
  before the projection; the product accumulates in fp32. Returns [B, 1, D] in w's dtype, or
  with `return_partials` the per-head products, float32 [N, B, 1, D].
  """
  _check(split, w)
  out, lse2 = split
  batch, splits, num_heads, head_dim = out.shape
  width = w.shape[1]
  merged_dtype = jnp.dtype(w.dtype if merged_dtype is None else merged_dtype)
  if batch == 0 or width == 0:
    products = jnp.zeros((num_heads, batch, width), jnp.float32)
  else:
    rows = min(batch, MAX_ROWS_PER_PROGRAM)
    kernel = functools.partial(_merge_project_kernel, batch=batch, rows=rows, splits=splits,
                               head_dim=head_dim, width=width, block_n=BLOCK_N, merged_dtype=merged_dtype)
    with quiet():
      products = pl.pallas_call(
          kernel,
          grid=(pl.cdiv(width, BLOCK_N), num_heads, pl.cdiv(batch, rows)),
          out_shape=jax.ShapeDtypeStruct((num_heads, batch, width), jnp.float32),
          compiler_params=CompilerParams(num_warps=NUM_WARPS, num_stages=1),
          interpret=use_interpret(interpret),
          name="jaxflash_split_kv_projection",
      )(out, lse2, w)
  products = products.reshape(num_heads, batch, 1, width)
  if return_partials:
    return products
  return products.sum(axis=0).astype(w.dtype)


def project_split_kv_reference(split: SplitKV, w, *, merged_dtype=None):
  """Plain JAX: merge the chunks (`decode_combine_reference`), round, then the product in fp32."""
  out, lse2 = split
  merged, _ = decode_combine_reference(jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse2, 1, 2) * LN_2)  # [B, N, H]
  merged = merged.astype(w.dtype if merged_dtype is None else merged_dtype).astype(jnp.float32)
  batch = out.shape[0]
  product = jnp.matmul(merged.reshape(batch, 1, -1), w.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
  return product.astype(w.dtype)
