"""A decoder layer's attention half for one decode step, in one persistent kernel.

In a decode step at batch 1 the attention half of a layer moves ~12 MB (the 1.5B model's
q/k/v and output weights, 1K tokens of cache) yet took four launches of 3-7 us each on the
H200 (q/k/v 6.9, decode 3.9, merge + output projection 4.0, residual add + RMSNorm 3.1:
bench/NOTES.md): every launch pays its ramp-up (first loads) and its tail, and each must wait
for the whole grid of the one before. Here one launch runs the four steps as phases, on one
program per SM that stays resident throughout:

  1. q/k/v: the skinny product of rms_norm(x) by wq|wk|wv, K cut into chunks, and the last
     chunk program of each column block to finish adds the bias, applies RoPE, stores q and
     writes k and v into the KV cache (jaxflash/qkv.py's one-launch kernel, item by item).
  2. attention: split-KV decode over the cache, one item per (sequence, KV head, chunk)
     (jaxflash/decode.py's chunk), each storing its normalised output and log2-sum-exp.
  3. output projection: one item per (column block, group of heads) merges its heads'
     chunks by their log-sum-exps and multiplies them by their rows of w_o; the last item of
     a column block adds the residual (h = x + attn @ w_o), and the last column block to
     finish normalises the whole row for the MLP (rms_norm(h) * scale).

A phase needs all of the one before (q and every cached key; every head's output), so
between phases every program counts itself in on an atomic counter and waits until all
have: a grid-wide barrier. That is safe only because all programs are resident at once
(one per SM, far under any SM's resources) and no program waits on one that cannot run.
Interpreted (no GPU), programs run one after another, so the phases run as three launches
instead and need no waits; the code of each phase is the same.

The counters live in a zeroed int32 buffer the caller passes (a decode loop passes the same
one every layer and step: the cache carries it) and the kernel leaves zeroed: the last
program to leave resets the barriers' counts.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import _checks, configs
from jaxflash import device as device_lib
from jaxflash._triton import (LOG2_E, CompilerParams, atomic_add, count_in, load, load_masked, mask2d, pl,
                              quiet, store, use_interpret)
from jaxflash.cache_write import check_cache_target
from jaxflash.decode import NEG_INF, attend_chunk, chunk_shares, chunking, merge_chunks
from jaxflash.linear import MAX_ROWS, LinearConfig, column_block, k_chunks
from jaxflash.paged import _paged_tile
from jaxflash.qkv import (MAX_SPLITS, NORM_TILE, _cache_target, _check_inputs as _check_qkv_inputs,
                          _head_finisher, _norm_factor_of_x, _padded_half, product_and_finish)
from jaxflash.reference import attention_reference, gather_pages

PROJECTION_BLOCK_N = 64  # output columns per projection item (jaxflash/split_kv_projection.py's)
NUM_WARPS = 4
QKV_CONFIG = LinearConfig()  # qkv_projection's tiles
# Interpreted, programs run one after another, so their number only decides how the items
# are dealt out: a few (fewer than most phases' items) cover the programs' item loops.
INTERPRET_PROGRAMS = 8
MAX_BARRIERS = 4  # between the five phases at most (q/k/v, its finish, attention, projection, residual)
# Experiment switches (read at trace time; jax.clear_caches() between settings).
BARRIER_SPIN = "rmw"  # "rmw": spin on atomic adds of 0; "load": on volatile loads, then one atomic
PREFETCH_WEIGHTS = False  # the projection's weight tiles loaded before the barrier that precedes it
RESIDUAL = "chain"  # "chain": last arrivers add the residual, the last block normalises; "phase": a phase


def _phase_items(p, programs: int, num_items: int, work, prefetched=None):
  """Program p runs items p, p + programs, ... of a phase's `num_items`: work(item), or
  work(item, prefetched) when its one item's loads were issued early (`prefetched`)."""
  if num_items <= programs:
    pl.when(p < num_items)(lambda: work(p) if prefetched is None else work(p, prefetched))
    return

  def body(i, carry):
    work(p + i * programs)
    return carry

  lax.fori_loop(0, lax.div(num_items - p + programs - 1, programs), body, 0)


def _grid_barrier(counter_ref, slot: int, programs: int):
  """Every program counts itself in on counter_ref[slot], then spins until all have (GPU
  only: all programs must be resident). The barrier before the count orders the program's
  stores before it; the count is an acquire-release atomic at GPU scope, so what the others
  stored before counting in is visible after the spin."""
  slot = jnp.int32(slot)
  arrived = count_in(counter_ref, slot, interpret=False) + 1
  if BARRIER_SPIN == "rmw":
    lax.while_loop(lambda n: n < programs, lambda n: atomic_add(counter_ref, slot, jnp.int32(0)), arrived)
    return
  # Volatile loads spin without queueing at the counter's atomic unit; one atomic after them
  # is the acquire that makes the others' stores visible. Its result must be used: Triton
  # then broadcasts it through shared memory behind a barrier, which orders every thread's
  # later loads after the acquire (unused, the other threads ran ahead and read stale data).
  seen = lax.while_loop(lambda n: n < programs, lambda n: load(counter_ref.at[slot], volatile=True), arrived)
  final = atomic_add(counter_ref, slot, jnp.int32(0)) + 0 * seen
  lax.while_loop(lambda n: n < programs, lambda n: atomic_add(counter_ref, slot, jnp.int32(0)), final)


def _leave(counter_ref, exit_slot: int, reset_slots: tuple[int, ...], programs: int):
  """The last program to leave (an atomic count) sets the barriers' counters back to zero:
  every program is past every barrier by then."""
  left = count_in(counter_ref, exit_slot, interpret=False)

  def reset():
    for slot in (*reset_slots, exit_slot):
      counter_ref[slot] = jnp.int32(0)

  pl.when(left == programs - 1)(reset)


def _rows_tile(block_k: int, capacity: int, head_dim_p: int):
  """Tile addresser of a contiguous cache viewed as rows [B * S, K, H]: tokens tok0.. of
  sequence b (the q/k/v phase writes the cache through the same view)."""
  def tile_index(table_ref, b, h, tok0, key_ok):
    del table_ref, key_ok
    return (pl.ds(b * capacity + tok0, block_k), h, pl.ds(0, head_dim_p))
  return tile_index


def _weight_tiles(w_ref, j, g, *, heads_per_group: int, head_dim: int, width: int, block_n: int):
  """The rows of w_ref [N * H, D] of heads g*heads_per_group.., columns j*block_n..: one
  [H_p, block_n] tile a head."""
  head_dim_p = configs.padded_head_dim(head_dim)
  dim_ok = None if head_dim_p == head_dim else jnp.arange(head_dim_p) < head_dim
  col_ok = None if width % block_n == 0 else j * block_n + jnp.arange(block_n) < width
  return [load_masked(w_ref.at[pl.ds((g * heads_per_group + t) * head_dim, head_dim_p), pl.ds(j * block_n, block_n)],
                      mask2d(dim_ok, col_ok)) for t in range(heads_per_group)]


def _project_heads(out_ref, lse2_ref, w_ref, part_ref, j, g, *, batch: int, splits: int,
                   heads_per_group: int, head_dim: int, width: int, block_n: int, merged_dtype, w_tiles=None):
  """Columns j*block_n.. of the output projection of heads g*heads_per_group.. for every
  sequence: each head's chunks merged by their shares (`chunk_shares`), rounded as the
  attention's output would be, times the head's rows of w, summed over the group's heads
  in fp32 into part_ref [groups, M, D].

  out_ref [B, S, N, H] f32 and lse2_ref [B, S, N] f32: the attention phase's chunks;
  w_ref [N * H, D]. At most a few rows: CUDA-core products, no 16-row padding.
  """
  splits_p = max(2, pl.next_power_of_2(splits))
  head_dim_p = configs.padded_head_dim(head_dim)
  split_ok = jnp.arange(splits_p) < splits
  dim_ok = None if head_dim_p == head_dim else jnp.arange(head_dim_p) < head_dim
  col_ok = None if width % block_n == 0 else j * block_n + jnp.arange(block_n) < width
  heads = [g * heads_per_group + t for t in range(heads_per_group)]
  if w_tiles is None:  # the weight tiles depend on nothing: their loads go first, overlapping the merges
    w_tiles = _weight_tiles(w_ref, j, g, heads_per_group=heads_per_group, head_dim=head_dim, width=width,
                            block_n=block_n)
  for row in range(batch):  # static: every row's loads are in flight at once
    b = jnp.int32(row)  # (interpret mode's masked loads take array indices only)
    product = jnp.zeros((block_n,), jnp.float32)
    for n, w in zip(heads, w_tiles):
      lse2 = load(lse2_ref.at[b, pl.ds(0, splits_p), n], mask=split_ok, other=NEG_INF)  # [S_p]
      chunks = load_masked(out_ref.at[b, pl.ds(0, splits_p), n, pl.ds(0, head_dim_p)],
                           mask2d(split_ok, dim_ok, (splits_p, head_dim_p)))  # [S_p, H_p]
      _, share, total = chunk_shares(lse2)  # every chunk empty (length 0): zeros, not NaN
      head = merge_chunks(share, total, chunks).astype(merged_dtype).astype(jnp.float32)  # [H_p]
      product = product + jnp.sum(head[:, None] * w.astype(jnp.float32), axis=0)
    store(part_ref.at[g, b, pl.ds(j * block_n, block_n)], product, mask=col_ok)


def _add_residual(x_ref, part_ref, h_ref, sum_sq_ref, j, *, groups: int, rows: int, width: int,
                  block_n: int):
  """Column block j of h = x + the projection (the sum of its head groups' partials, rounded to
  x's dtype first, as the projection's output would be), stored in h_ref [M, D]; its sum of
  h^2 per row goes to sum_sq_ref [blocks, M] for the norm."""
  row_ok = jnp.arange(MAX_ROWS) < rows
  col_ok = None if width % block_n == 0 else j * block_n + jnp.arange(block_n) < width
  mask = mask2d(row_ok, col_ok)
  cols = pl.ds(j * block_n, block_n)
  delta = jnp.zeros((MAX_ROWS, block_n), jnp.float32)
  for g in range(groups):  # static: independent loads, all in flight at once
    delta = delta + load_masked(part_ref.at[jnp.int32(g), pl.ds(0, MAX_ROWS), cols], mask)
  delta = delta.astype(h_ref.dtype).astype(jnp.float32)
  x = load_masked(x_ref.at[pl.ds(0, MAX_ROWS), cols], mask).astype(jnp.float32)
  h = (x + delta).astype(h_ref.dtype)
  store(h_ref.at[pl.ds(0, MAX_ROWS), cols], h, mask=mask)
  h32 = h.astype(jnp.float32)  # masked lanes are 0 and add nothing
  store(sum_sq_ref.at[j, pl.ds(0, MAX_ROWS)], jnp.sum(h32 * h32, axis=1), mask=row_ok)


def _normalize(h_ref, sum_sq_ref, scale_ref, out_ref, *, blocks: int, rows: int, width: int, eps: float):
  """out = rms_norm(h) * scale for every row of h_ref [M, D], from the column blocks' sums of
  squares sum_sq_ref [blocks, M]; rounded as Hugging Face's Qwen2 rounds (jaxflash/residual_norm.py)."""
  row_ok = jnp.arange(MAX_ROWS) < rows
  blocks_p = max(2, pl.next_power_of_2(blocks))
  sum_sq = load(sum_sq_ref.at[pl.ds(0, blocks_p), pl.ds(0, MAX_ROWS)],
                mask=(jnp.arange(blocks_p) < blocks)[:, None] & row_ok[None, :], other=0.0)
  r = lax.rsqrt(jnp.sum(sum_sq, axis=0) / width + eps)[:, None]  # [16, 1]
  for k0 in range(0, width, NORM_TILE):  # static tiles, all in flight
    cols_ok = None if k0 + NORM_TILE <= width else jnp.arange(NORM_TILE) < width - k0
    mask = mask2d(row_ok, cols_ok)
    cols = pl.ds(k0, NORM_TILE)
    h = load_masked(h_ref.at[pl.ds(0, MAX_ROWS), cols], mask).astype(jnp.float32)
    normed = (h * r).astype(out_ref.dtype).astype(jnp.float32)
    scale = load_masked(scale_ref.at[cols], cols_ok).astype(out_ref.dtype).astype(jnp.float32)
    store(out_ref.at[pl.ds(0, MAX_ROWS), cols], (normed * scale[None, :]).astype(out_ref.dtype), mask=mask)


def _residual_norm_tile(x_ref, part_ref, scale_ref, h_ref, out_ref, t, *, groups: int, rows: int, width: int,
                        eps: float):
  """Columns t*NORM_TILE.. of h = x + the projection (its head groups' partials summed, rounded to
  x's dtype) and of rms_norm(h) * scale, the norm's factor from the whole row of h (every item
  recomputes it: a few KB from L2, no wait on another item). Rounded as jaxflash.add_rms_norm."""
  row_ok = jnp.arange(MAX_ROWS) < rows

  def h_tile(k0):
    cols_ok = jnp.arange(NORM_TILE) < width - k0
    mask = mask2d(row_ok, cols_ok)
    cols = pl.ds(k0, NORM_TILE)
    delta = jnp.zeros((MAX_ROWS, NORM_TILE), jnp.float32)
    for g in range(groups):  # static: independent loads, all in flight at once
      delta = delta + load_masked(part_ref.at[jnp.int32(g), pl.ds(0, MAX_ROWS), cols], mask)
    delta = delta.astype(h_ref.dtype).astype(jnp.float32)
    x = load_masked(x_ref.at[pl.ds(0, MAX_ROWS), cols], mask).astype(jnp.float32)
    return (x + delta).astype(h_ref.dtype), mask, cols_ok, cols

  sum_sq = jnp.zeros((MAX_ROWS,), jnp.float32)
  for k0 in range(0, width, NORM_TILE):  # static tiles, all in flight
    h32 = h_tile(k0)[0].astype(jnp.float32)  # masked lanes are 0 and add nothing
    sum_sq = sum_sq + jnp.sum(h32 * h32, axis=1)
  r = lax.rsqrt(sum_sq / width + eps)[:, None]
  h, mask, cols_ok, cols = h_tile(t * NORM_TILE)
  store(h_ref.at[pl.ds(0, MAX_ROWS), cols], h, mask=mask)
  normed = (h.astype(jnp.float32) * r).astype(out_ref.dtype).astype(jnp.float32)
  scale = load_masked(scale_ref.at[cols], cols_ok).astype(out_ref.dtype).astype(jnp.float32)
  store(out_ref.at[pl.ds(0, MAX_ROWS), cols], (normed * scale[None, :]).astype(out_ref.dtype), mask=mask)


def _kernel(*refs, phases: tuple[str, ...], barriers: bool, programs: int, has_bias: bool, paged: bool,
            scratch_in: bool, qkv: dict, attention: dict, projection: dict, slots: dict, interpret: bool):
  """Program p of the persistent grid: the items of each phase in `phases` that fall to it,
  with a grid barrier between phases when `barriers` (one launch on a GPU).

  refs (inputs): x [M, D], norm scale [D], wq, wk, wv, cos, sin [M, H/2] f32, (bq, bk, bv),
  positions [M], (block_table [B, max_pages]), keys, values (cache rows [R, K, H], aliased),
  kv_lengths [M], w_o [N * H, D], mlp norm scale [D], counters (aliased); with
  `scratch_in` the scratch buffers (aliased: a later phase's launch); then the outputs: the
  scratch (the q/k/v partials [splits, M, N_i], q [M, N, >= H] (padded), the attention's chunks
  [B, S, N, H] and lse2 [B, S, N], the projection's partials [groups, M, D], the column
  blocks' sums of squares [blocks, M]), keys, values, counters, h [M, D], normed [M, D].
  """
  refs = iter(refs)
  x_ref, scale_ref = next(refs), next(refs)
  w_refs = [next(refs) for _ in range(3)]
  cos_ref, sin_ref = next(refs), next(refs)
  b_refs = [next(refs) for _ in range(3)] if has_bias else [None] * 3
  positions_ref = next(refs)
  table_ref = next(refs) if paged else None
  next(refs), next(refs)  # the caches' inputs: their outputs are the same buffers
  lengths_ref, wo_ref, mlp_scale_ref = next(refs), next(refs), next(refs)
  next(refs)  # the counters' input
  scratch = 8
  if scratch_in:
    for _ in range(scratch):
      next(refs)
  part_refs = [next(refs) for _ in range(3)]
  q_ref, chunks_ref, lse2_ref, proj_ref, sum_sq_ref = (next(refs) for _ in range(5))
  keys_ref, values_ref, counter_ref, h_ref, normed_ref = (next(refs) for _ in range(5))

  rows = qkv["rows"]
  p = pl.program_id(0)  # read here: interpret mode resolves program ids only at the top level
  target = _cache_target(positions_ref, table_ref, rows=rows, capacity=qkv["capacity"],
                         page_size=qkv["page_size"])
  finish = _head_finisher(cos_ref, sin_ref, part_refs, b_refs, [q_ref, keys_ref, values_ref], target,
                          splits=qkv["splits"], rows=rows, head_dim=qkv["head_dim"])

  def qkv_item(item):
    j, s = lax.div(item, qkv["splits"]), lax.rem(item, qkv["splits"])
    if qkv["one_launch"]:
      product_and_finish(x_ref, scale_ref, w_refs, part_refs, counter_ref, finish, j, s,
                         **{k: qkv[k] for k in ("widths", "heads", "block_n", "splits", "rows", "k_size",
                                                 "head_dim", "eps", "product")}, interpret=interpret)
      return
    first_block = 0
    for w_ref, part_ref, n_size in zip(w_refs, part_refs, qkv["widths"]):
      blocks = pl.cdiv(n_size, qkv["block_n"])
      pl.when((j >= first_block) & (j < first_block + blocks))(functools.partial(
          column_block, x_ref, w_ref, part_ref, j - first_block, s, n_size=n_size, block_n=qkv["block_n"],
          scale_ref=scale_ref, **qkv["product"]))
      first_block += blocks

  def finish_item(item):  # a head of q, k or v, when the column blocks do not hold whole heads
    r = _norm_factor_of_x(x_ref, rows=rows, k_size=qkv["k_size"], eps=qkv["eps"])
    first_head = 0
    for which, count in enumerate(qkv["heads"]):
      pl.when((item >= first_head) & (item < first_head + count))(
          functools.partial(finish, which, item - first_head, r))
      first_head += count

  def attention_item(item):
    per_sequence = attention["kv_heads"] * attention["chunks"]
    b, rest = lax.div(item, per_sequence), lax.rem(item, per_sequence)
    h, c = lax.div(rest, attention["chunks"]), lax.rem(rest, attention["chunks"])
    attend_chunk(lengths_ref, table_ref, q_ref, keys_ref, values_ref, chunks_ref, lse2_ref, b, h, c,
                 **attention["chunk_args"])

  projection_args = {k: projection[k] for k in ("batch", "splits", "heads_per_group", "head_dim", "width",
                                                 "block_n", "merged_dtype")}

  def projection_prefetch(item):
    j, g = lax.div(item, projection["groups"]), lax.rem(item, projection["groups"])
    return _weight_tiles(wo_ref, j, g, **{k: projection[k] for k in ("heads_per_group", "head_dim", "width",
                                                                       "block_n")})

  def projection_item(item, w_tiles=None):
    groups = projection["groups"]
    j, g = lax.div(item, groups), lax.rem(item, groups)
    _project_heads(chunks_ref, lse2_ref, wo_ref, proj_ref, j, g, w_tiles=w_tiles, **projection_args)
    if RESIDUAL != "chain":
      return
    arrived = count_in(counter_ref, slots["projection"] + j, interpret=interpret)

    def finish_block():
      _add_residual(x_ref, proj_ref, h_ref, sum_sq_ref, j, groups=groups, rows=rows,
                    width=projection["width"], block_n=projection["block_n"])
      counter_ref[slots["projection"] + j] = jnp.int32(0)
      done = count_in(counter_ref, slots["norm"], interpret=interpret)

      def finish_row():  # every column block of h is in
        _normalize(h_ref, sum_sq_ref, mlp_scale_ref, normed_ref, blocks=projection["blocks"], rows=rows,
                   width=projection["width"], eps=projection["eps"])
        counter_ref[slots["norm"]] = jnp.int32(0)

      pl.when(done == projection["blocks"] - 1)(finish_row)

    pl.when(arrived == groups - 1)(finish_block)

  def residual_item(item):
    _residual_norm_tile(x_ref, proj_ref, mlp_scale_ref, h_ref, normed_ref, item, groups=projection["groups"],
                        rows=rows, width=projection["width"], eps=projection["eps"])

  work = {"qkv": (qkv_item, qkv["items"]), "qkv_finish": (finish_item, sum(qkv["heads"])),
          "attention": (attention_item, attention["items"]), "projection": (projection_item, projection["items"]),
          "residual": (residual_item, pl.cdiv(projection["width"], NORM_TILE))}
  for index, phase in enumerate(phases):
    fn, items = work[phase]
    prefetched = None
    if phase == "projection" and PREFETCH_WEIGHTS and items <= programs:
      prefetched = projection_prefetch(jnp.minimum(p, items - 1))
    if barriers and index:
      _grid_barrier(counter_ref, slots["barrier"] + index - 1, programs)
    _phase_items(p, programs, items, fn, prefetched)
  if barriers:
    _leave(counter_ref, slots["exit"], tuple(slots["barrier"] + i for i in range(len(phases) - 1)), programs)


def _check_inputs(x, norm_scale, weights, biases, cos, sin, keys, values, positions, kv_lengths, w_o,
                  mlp_norm_scale, block_table, head_dim: int):
  if x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[1] != 1):
    raise ValueError(f"x holds one token per sequence: [B, D] or [B, 1, D], got x {tuple(x.shape)}")
  _check_qkv_inputs(x, norm_scale, weights, biases, cos, sin, head_dim)
  batch, width = x.shape[0], x.shape[-1]
  heads = tuple(w.shape[1] // head_dim for w in weights)
  if heads[1] != heads[2] or heads[0] % heads[1]:
    raise ValueError(f"wk and wv must have the same heads, a divisor of wq's: got wq {tuple(weights[0].shape)}, "
                     f"wk {tuple(weights[1].shape)}, wv {tuple(weights[2].shape)} for head_dim={head_dim}")
  positions, block_table = check_cache_target(keys, values, (heads[1], head_dim), batch, positions, block_table)
  kv_lengths = _checks.check_lengths("kv_lengths", kv_lengths, batch)
  if kv_lengths is None:
    raise ValueError(f"kv_lengths [B] = ({batch},) are needed: the tokens each sequence attends to")
  for name, a in (("w_o", w_o), ("mlp_norm_scale", mlp_norm_scale)):
    _checks.check_float(name, a)
  if tuple(w_o.shape) != (heads[0] * head_dim, width):
    raise ValueError(f"w_o must be [N * H, D] = {(heads[0] * head_dim, width)}, got w_o {tuple(w_o.shape)}")
  if w_o.dtype != weights[0].dtype:
    raise TypeError(f"w_o must have the q/k/v weights' dtype {jnp.dtype(weights[0].dtype).name}, got "
                    f"w_o {jnp.dtype(w_o.dtype).name}")
  if tuple(mlp_norm_scale.shape) != (width,):
    raise ValueError(f"mlp_norm_scale must be [D] = ({width},), got mlp_norm_scale "
                     f"{tuple(mlp_norm_scale.shape)}")
  if keys.dtype != x.dtype:
    raise TypeError(f"the caches must have x's dtype {jnp.dtype(x.dtype).name}, got keys "
                    f"{jnp.dtype(keys.dtype).name}")
  return positions, block_table, kv_lengths


def _head_groups(num_heads: int, blocks: int, programs: int) -> int:
  """Head groups of the projection: the most that keep its items (blocks x groups) within
  the programs, a divisor of the heads (at least 1)."""
  fits = [g for g in range(1, num_heads + 1) if num_heads % g == 0 and blocks * g <= programs]
  return max(fits) if fits else 1


@functools.partial(jax.jit, static_argnames=("head_dim", "eps", "num_splits", "programs", "one_launch",
                                             "interpret"))
def decode_attention_block(x, norm_scale, weights, biases, cos, sin, keys, values, positions, kv_lengths, w_o,
                           mlp_norm_scale, *, head_dim: int, eps: float = 1e-6, block_table=None, counters=None,
                           num_splits: int | None = None, programs: int | None = None, one_launch: bool = True,
                           interpret: bool | None = None):
  """The attention half of a pre-norm decoder layer (Llama/Qwen2) for one new token per
  sequence, in one kernel launch:

    q, k, v = rope(rms_norm(x) @ wq + bq), rope(rms_norm(x) @ wk + bk), rms_norm(x) @ wv + bv
    k and v written into the cache at `positions`; a = attention(q, cache[:kv_lengths])
    h = x + a @ w_o;  normed = rms_norm(h) * mlp_norm_scale   (the MLP's input)

  x [B, D] or [B, 1, D] (B <= 16); norm_scale [D] (the attention's RMSNorm weight); weights
  (wq, wk, wv) [D, heads * head_dim]; biases (bq, bk, bv) or None; cos, sin [..., head_dim/2]
  per sequence (RoPE, split-halves layout); keys, values: contiguous caches [B, S, K, H] or
  page pools [P, page, K, H] with block_table [B, max_pages], in x's dtype, donated under jit
  for an in-place write; positions [B]: where each sequence's new k and v go (-1: nowhere);
  kv_lengths [B]: the tokens each sequence attends to, the new one included; w_o [N * H, D];
  mlp_norm_scale [D]. Rounded as jaxflash.qkv_projection, decode_attention,
  project_split_kv and add_rms_norm round, one after the other.

  Returns (h, normed, keys, values), h and normed shaped like x; with `counters` ([n] int32
  zeros, n >= the q/k/v product's column blocks + the output's 64-column blocks + 6) also
  the counters, zero again, so that a decode loop can pass the same buffer every call.
  num_splits: the attention's chunks per sequence (default `jaxflash.num_splits`); programs:
  the persistent grid (default: one per SM; 8 interpreted); one_launch=False runs the three phases as three
  launches (what interpret mode always does); interpret: Pallas interpret mode (default:
  when no GPU).
  """
  positions, block_table, kv_lengths = _check_inputs(x, norm_scale, weights, biases, cos, sin, keys, values,
                                                     positions, kv_lengths, w_o, mlp_norm_scale, block_table,
                                                     head_dim)
  interpret = use_interpret(interpret)
  barriers = one_launch and not interpret
  batch, width = x.shape[0], x.shape[-1]
  widths = tuple(int(w.shape[1]) for w in weights)
  heads = tuple(n // head_dim for n in widths)
  num_heads, kv_heads = heads[0], heads[1]
  paged = block_table is not None
  capacity = keys.shape[0] if paged else keys.shape[1]  # cache_rows' "capacity": pages in a pool
  page_size = keys.shape[1]
  kv_capacity = block_table.shape[1] * page_size if paged else keys.shape[1]
  info = device_lib.device_info()
  programs = programs or (INTERPRET_PROGRAMS if interpret else info.sm_count)
  if not isinstance(programs, int) or programs < 1:
    raise ValueError(f"programs must be a positive int, got {programs!r}")

  # q/k/v: jaxflash.qkv_projection's product (at most 8 K chunks) and finish.
  config = QKV_CONFIG
  n_blocks = sum(pl.cdiv(n, config.block_n) for n in widths)
  _, wanted = k_chunks(config, n_blocks * config.block_n, width, info.sm_count)
  chunk_tiles, splits = k_chunks(LinearConfig(config.block_n, config.block_k, num_splits=min(wanted, MAX_SPLITS)),
                                 n_blocks * config.block_n, width, info.sm_count)
  fp32 = jnp.dtype(weights[0].dtype) == jnp.float32
  precision = lax.Precision.HIGHEST if fp32 else None
  qkv = dict(widths=widths, heads=heads, block_n=config.block_n, splits=splits, rows=batch, k_size=width,
             head_dim=head_dim, eps=float(eps), capacity=capacity, page_size=page_size, items=n_blocks * splits,
             one_launch=config.block_n % head_dim == 0,
             product=dict(rows=batch, k_size=width, block_k=config.block_k, chunk_tiles=chunk_tiles, partial=True,
                          precision=precision))

  # Attention: split-KV decode's chunks.
  decode = configs.decode_config(head_dim, keys.dtype, paged=paged)
  chunk, chunks = chunking(num_splits, batch, kv_heads, kv_capacity, decode.block_k)
  head_dim_p = configs.padded_head_dim(head_dim)
  tile_index = (_paged_tile(decode.block_k, page_size, keys.shape[0], head_dim_p) if paged
                else _rows_tile(decode.block_k, kv_capacity, head_dim_p))
  attention = dict(kv_heads=kv_heads, chunks=chunks, items=batch * kv_heads * chunks,
                   chunk_args=dict(tile_index=tile_index, group=num_heads // kv_heads, head_dim=head_dim,
                                   block_k=decode.block_k, chunk=chunk, capacity=kv_capacity,
                                   qk_scale=head_dim ** -0.5 * LOG2_E, final=False, precision=precision))

  # Output projection, residual and norm.
  out_blocks = pl.cdiv(width, PROJECTION_BLOCK_N)
  groups = _head_groups(num_heads, out_blocks, programs)
  projection = dict(groups=groups, blocks=out_blocks, items=out_blocks * groups, batch=batch, splits=chunks,
                    heads_per_group=num_heads // groups, head_dim=head_dim, width=width,
                    block_n=PROJECTION_BLOCK_N, merged_dtype=jnp.dtype(x.dtype), eps=float(eps))

  slots = dict(projection=n_blocks)
  slots.update(norm=n_blocks + out_blocks, barrier=n_blocks + out_blocks + 1)
  slots["exit"] = slots["barrier"] + MAX_BARRIERS
  needed = slots["exit"] + 1
  if counters is not None:
    if counters.dtype != jnp.int32 or counters.ndim != 1:
      raise TypeError(f"counters must be [n] int32, got counters {tuple(counters.shape)} {counters.dtype}")
    if counters.shape[0] < needed:
      raise ValueError(f"counters must have at least {needed} slots here ({n_blocks} q/k/v column blocks + "
                       f"{out_blocks} output column blocks + {needed - n_blocks - out_blocks}), got counters {tuple(counters.shape)}")
  counts = jnp.zeros((needed,), jnp.int32) if counters is None else counters

  q_dim = max(head_dim_p, pl.next_power_of_2(head_dim // 2 + _padded_half(head_dim)))
  x2d = x.reshape(batch, width)
  rope = [cos.reshape(batch, -1).astype(jnp.float32), sin.reshape(batch, -1).astype(jnp.float32)]
  keys_rows, values_rows = keys.reshape(-1, *keys.shape[2:]), values.reshape(-1, *values.shape[2:])  # bitcasts
  operands = [x2d, norm_scale, *weights, *rope, *(biases or ()), positions, *((block_table,) if paged else ())]
  first_cache = len(operands)
  operands += [keys_rows, values_rows, kv_lengths, w_o, mlp_norm_scale, counts]
  scratch_shapes = [*(jax.ShapeDtypeStruct((splits, batch, n), jnp.float32) for n in widths),
                    # q's heads padded so that the stores of their halves stay inside the head
                    jax.ShapeDtypeStruct((batch, num_heads, q_dim), x.dtype),
                    jax.ShapeDtypeStruct((batch, chunks, num_heads, head_dim), jnp.float32),
                    jax.ShapeDtypeStruct((batch, chunks, num_heads), jnp.float32),
                    jax.ShapeDtypeStruct((groups, batch, width), jnp.float32),
                    jax.ShapeDtypeStruct((out_blocks, batch), jnp.float32)]
  out_shapes = [*scratch_shapes, jax.ShapeDtypeStruct(keys_rows.shape, keys.dtype),
                jax.ShapeDtypeStruct(values_rows.shape, values.dtype), jax.ShapeDtypeStruct(counts.shape, jnp.int32),
                jax.ShapeDtypeStruct((batch, width), x.dtype), jax.ShapeDtypeStruct((batch, width), x.dtype)]
  scratch = len(scratch_shapes)
  state_aliases = {first_cache: scratch, first_cache + 1: scratch + 1, first_cache + 5: scratch + 2}
  qkv_phases = ("qkv",) if qkv["one_launch"] else ("qkv", "qkv_finish")
  tail = ("projection",) if RESIDUAL == "chain" else ("projection", "residual")
  launches = [(*qkv_phases, "attention", *tail)] if barriers else [(phase,) for phase in (*qkv_phases, "attention", *tail)]
  kernel = functools.partial(_kernel, barriers=barriers, programs=programs, has_bias=biases is not None,
                             paged=paged, interpret=interpret, qkv=qkv, attention=attention, projection=projection, slots=slots)
  state = None  # a later launch's scratch and state: the outputs of the one before
  with quiet():
    for phases in launches:
      scratch_in = state is not None
      args = operands if state is None else [*operands[:first_cache], state[scratch], state[scratch + 1],
                                             *operands[first_cache + 2:first_cache + 5], state[scratch + 2],
                                             *state[:scratch]]
      aliases = dict(state_aliases)
      if scratch_in:
        aliases.update({len(operands) + i: i for i in range(scratch)})
      state = pl.pallas_call(
          functools.partial(kernel, phases=phases, scratch_in=scratch_in),
          grid=(programs,),
          out_shape=out_shapes,
          input_output_aliases=aliases,
          compiler_params=CompilerParams(num_warps=NUM_WARPS, num_stages=decode.num_stages),
          interpret=interpret,
          name="jaxflash_attention_block",
      )(*args)
  keys_out, values_out, counts_out, h, normed = state[scratch:]
  outs = (h.reshape(x.shape), normed.reshape(x.shape), keys_out.reshape(keys.shape), values_out.reshape(values.shape))
  return (*outs, counts_out) if counters is not None else outs


def decode_attention_block_reference(x, norm_scale, weights, biases, cos, sin, keys, values, positions,
                                     kv_lengths, w_o, mlp_norm_scale, *, head_dim: int, eps: float = 1e-6,
                                     block_table=None):
  """Plain JAX with the same roundings (fp32 products), for checking: the q/k/v reference,
  the cache write, attention over the written cache, the output projection of the rounded
  heads, the residual add and the norm. Returns (h, normed, keys, values)."""
  from jaxflash.cache_write import kv_cache_write_reference
  from jaxflash.qkv import qkv_projection_reference
  from jaxflash.residual_norm import add_rms_norm_reference

  batch, width = x.shape[0], x.shape[-1]
  x2d = x.reshape(batch, width)
  q, k, v = qkv_projection_reference(x2d, norm_scale, weights, biases, cos.reshape(batch, -1),
                                     sin.reshape(batch, -1), head_dim=head_dim, eps=eps)
  kv_heads = k.shape[-1] // head_dim
  keys, values = kv_cache_write_reference(keys, values, k.reshape(batch, kv_heads, head_dim),
                                          v.reshape(batch, kv_heads, head_dim), positions, block_table=block_table)
  if block_table is None:
    k_all, v_all = keys, values
  else:
    table = jnp.clip(block_table, 0, keys.shape[0] - 1)
    k_all, v_all = gather_pages(keys, table), gather_pages(values, table)
  lengths = jnp.clip(kv_lengths, 0, k_all.shape[1])
  heads, _ = attention_reference(q.reshape(batch, 1, -1, head_dim), k_all, v_all, scale=head_dim ** -0.5,
                                 key_value_seq_lengths=lengths)
  heads = heads.reshape(batch, -1).astype(x.dtype).astype(jnp.float32)
  projected = jnp.matmul(heads, w_o.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  h, normed = add_rms_norm_reference(x2d, projected, mlp_norm_scale, eps=eps)
  return h.reshape(x.shape), normed.reshape(x.shape), keys, values


__all__ = ["decode_attention_block", "decode_attention_block_reference"]
