"""Sharded inputs: how `jaxflash.attention` runs under `jax.jit` on a mesh.

A `pallas_call` is one opaque custom call to XLA's SPMD partitioner. Left alone, the
partitioner cannot tell that attention is independent per sequence and per query head, so
it all-gathers every operand onto every device and runs the whole problem everywhere.
`custom_partitioning` tells it otherwise: each kernel call here carries

- a Shardy rule (`SdyShardingRule`) naming the dimensions, so sharding propagates between
  the operands and the results, batch to batch and query heads to query heads;
- a `partition` callback that picks, at compile time, the mesh axes the batch and the
  heads stay split over, and runs the unchanged kernel on each device's shard. The
  kernels then see local shapes, so their block sizes and KV splits fit each shard.

What stays split:

- Batch (data parallel): query, key/value, lengths, block_table and the results split
  their batch dimension over the same mesh axes. A page pool has no batch dimension (the
  block table holds global page ids), so it is replicated over the batch axes and split
  over the head axes only.
- Heads (tensor parallel): the query's head split leads, as in a model whose q, k and v
  projections are all split by heads. (A key split alone is followed inside the call, but
  Shardy links only query heads to result heads, so the results come back gathered.) Over
  d devices each keeps whole GQA groups when K % d == 0: N/d query heads with their K/d
  KV heads. When d is a multiple of K instead (2 KV heads on 4 devices), key/value must
  be replicated over the head axes, which costs no collective when they arrive so (a
  model that replicates its KV projections), and each device slices the one KV head its
  N/d query heads read. That slice is a local copy of 1/K of key/value per call: for a
  decode cache, rather repeat the KV heads up to d in the model (head j a copy of head
  j // (d / K)) so the cache splits evenly. When neither divides the other, or d does not
  divide N, heads are computed replicated and a warning says so.
- Every other dimension (query and key tokens, head dim, pages, page size, table width)
  is computed replicated: an operand split over one is gathered by XLA first.

An operand split in a way no such PartitionSpec expresses (a mesh axis split across two
dimensions, as reshaping a [.., K * H] projection split over more devices than K gives)
is resharded by XLA to what the plan needs: correct, at the cost of a collective.

Under `jax.vmap` the call is not partitioned (custom_partitioning has no batching rule;
the kernels' own runs instead). On one device, and inside `jax.shard_map` (manual mesh
axes: the caller has split the arrays, and custom_partitioning cannot run there), nothing
here runs: the kernel is called directly on what it is given.

The options (bias, mask, sinks, scale) travel as operands too: a bias or mask splits with
the batch and heads where it has those axes and is replicated along its broadcast ones.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import warnings

import jax
from jax import lax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# Dimension names of every operand and result: b batch, t query tokens, n query heads,
# h head dim, s key tokens, k KV heads, p pages, z page size, m table width. Only b, n and
# k may stay split.
DENSE_OPERANDS = (("b", "t", "n", "h"),  # query [B, T, N, H]
                  ("b", "s", "k", "h"),  # key [B, S, K, H]
                  ("b", "s", "k", "h"),  # value [B, S, K, H]
                  ("b",),                # query_seq_lengths [B]
                  ("b",))                # key_value_seq_lengths [B]
PAGED_OPERANDS = (("b", "t", "n", "h"),  # query [B, 1, N, H]
                  ("p", "z", "k", "h"),  # key pages [P, page_size, K, H]
                  ("p", "z", "k", "h"),  # value pages [P, page_size, K, H]
                  ("b",),                # key_value_seq_lengths [B]
                  ("b", "m"))            # block_table [B, max_pages]
PAGED_PREFILL_OPERANDS = PAGED_OPERANDS + (("b",),)  # + query_seq_lengths [B]
RESULTS = (("b", "t", "n", "h"),  # out [B, T, N, H]
           ("b", "t", "n"))       # lse [B, T, N]
BACKWARD_OPERANDS = DENSE_OPERANDS + (("b", "t", "n", "h"),  # out [B, T, N, H]
                                      ("b", "t", "n"),       # lse [B, T, N]
                                      ("b", "t", "n", "h"),  # d_out [B, T, N, H]
                                      ("b", "t", "n"))       # d_lse [B, T, N]
GRADIENTS = (("b", "t", "n", "h"),  # dq [B, T, N, H]
             ("b", "s", "k", "h"),  # dk [B, S, K, H]
             ("b", "s", "k", "h"))  # dv [B, S, K, H]
SCORE_GRADIENT = ("b", "n", "t", "s")  # ds [B, N, T, S]: the bias's gradient before its reduction


# Optional operands, passed to the kernel by keyword: bias and mask [B, N, T, S] (rank 4;
# an axis of size 1 is a broadcast one and gets a factor of its own), sinks [N], scale [],
# segment ids [B, T] and [B, S].
OPTION_DIMS = {"bias": ("b", "n", "t", "s"), "mask": ("b", "n", "t", "s"), "sinks": ("n",),
               "scale": (), "segment_ids": ("b", "t"), "kv_segment_ids": ("b", "s")}


def prefill(kernel, query, key, value, query_seq_lengths=None, key_value_seq_lengths=None,
            **options):
  """kernel(query, key, value, q_lengths, kv_lengths, **options) -> (out, lse), sharding-aware.

  query [B, T, N, H], key/value [B, S, K, H], lengths [B] or None; options: arrays named
  in OPTION_DIMS (None: absent).
  """
  return _call(kernel, DENSE_OPERANDS,
               (query, key, value, query_seq_lengths, key_value_seq_lengths), options)


def prefill_backward(kernel, query, key, value, query_seq_lengths, key_value_seq_lengths, out, lse,
                     d_out, d_lse=None, *, bias=None, mask=None, sinks=None, scale=None,
                     segment_ids=None, kv_segment_ids=None):
  """kernel(query, key, value, q_lengths, kv_lengths, out, lse, d_out, d_lse, bias=, mask=,
  sinks=, scale=, segment_ids=, kv_segment_ids=) -> (dq, dk, dv, ds), sharding-aware: the gradients keep the inputs' batch and
  head splits (dq the query's, dk and dv the keys', ds [B, N, T, S] the batch's and query
  heads'; ds None without a bias). Where key/value are replicated over the head axes (fewer
  KV heads than devices), each device's dK/dV covers its query heads only and the devices'
  parts are summed: the one collective the math needs."""
  options = dict(bias=bias, mask=mask, sinks=sinks, scale=scale, segment_ids=segment_ids,
                 kv_segment_ids=kv_segment_ids)
  result_dims = GRADIENTS if bias is None else GRADIENTS + (SCORE_GRADIENT,)

  def run(*args, **kw):
    results = kernel(*args, **{name: kw.get(name) for name in options})
    return results[:3] if bias is None else results

  results = _call(run, BACKWARD_OPERANDS,
                  (query, key, value, query_seq_lengths, key_value_seq_lengths, out, lse, d_out, d_lse),
                  options, result_dims)
  return (*results, None) if bias is None else tuple(results)


def decode(kernel, query, key, value, key_value_seq_lengths=None, **options):
  """kernel(query, key, value, kv_lengths, **options) -> (out, lse), sharding-aware
  (`prefill` without query lengths). query [B, 1, N, H], caches [B, S, K, H], lengths [B]."""
  return prefill(lambda q, k, v, _, kv_lengths, **kw: kernel(q, k, v, kv_lengths, **kw),
                 query, key, value, None, key_value_seq_lengths, **options)


def paged(kernel, query, key_pages, value_pages, key_value_seq_lengths, block_table, **options):
  """kernel(query, key_pages, value_pages, kv_lengths, block_table, **options) -> (out, lse),
  sharding-aware. query [B, 1, N, H], pages [P, page_size, K, H], lengths [B],
  block_table [B, max_pages]; bias/mask [B, N, 1, max_pages * page_size]-broadcastable."""
  return _call(kernel, PAGED_OPERANDS,
               (query, key_pages, value_pages, key_value_seq_lengths, block_table), options)


def paged_prefill(kernel, query, key_pages, value_pages, key_value_seq_lengths, block_table,
                  query_seq_lengths=None, **options):
  """kernel(query, key_pages, value_pages, kv_lengths, block_table, q_lengths, **options) ->
  (out, lse), sharding-aware: `paged` with T new tokens per sequence and their counts [B];
  bias/mask [B, N, T, max_pages * page_size]-broadcastable, sinks [N], scale []."""
  return _call(kernel, PAGED_PREFILL_OPERANDS,
               (query, key_pages, value_pages, key_value_seq_lengths, block_table, query_seq_lengths),
               options)


def manual_axes() -> tuple[str, ...]:
  """Mesh axes the caller is manual over (inside `jax.shard_map`); () outside."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  return tuple(getattr(get(), "manual_axes", ())) if get is not None else ()


def varying_axes(x) -> frozenset:
  """The manual mesh axes (inside `jax.shard_map`, check_vma on) an array varies over."""
  aval = jax.typeof(x)
  axis_type = getattr(aval, "manual_axis_type", None)  # jax 0.10 and later
  if axis_type is not None:
    return frozenset(axis_type.varying)
  return frozenset(getattr(aval, "vma", ()))


def like_primal(cotangent, primal):
  """A cotangent summed over the manual axes it varies over and its primal does not (inside
  `jax.shard_map`: the gradient of a replicated input is the sum of every device's part,
  and a custom VJP must say so itself); unchanged elsewhere."""
  if cotangent is None or not manual_axes():
    return cotangent
  extra = varying_axes(cotangent) - varying_axes(primal)
  return lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def result_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A kernel result's ShapeDtypeStruct. Inside `jax.shard_map` with `check_vma` on, a
  `pallas_call`'s results must say which manual axes they vary over: every axis any of
  the kernel's inputs (None: absent) varies over."""
  if not manual_axes():
    return jax.ShapeDtypeStruct(shape, dtype)
  avals = [jax.typeof(x) for x in inputs if x is not None]
  params = inspect.signature(jax.ShapeDtypeStruct).parameters
  if "manual_axis_type" in params:  # jax 0.10 and later
    varying = frozenset().union(*(a.manual_axis_type.varying for a in avals))
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
  if "vma" in params:  # earlier releases
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset().union(*(a.vma for a in avals)))
  return jax.ShapeDtypeStruct(shape, dtype)


def _option_dims(name: str, x) -> tuple[str, ...]:
  # A broadcast axis (size 1) is its own factor: it may not share one with a full axis.
  return tuple(d if size != 1 else f"{d}1" for d, size in zip(OPTION_DIMS[name], x.shape))


def _call(kernel, operand_dims, operands, options=None, result_dims=RESULTS):
  """kernel(*operands, **options) as one custom-partitioned call (operands named by
  operand_dims, options by OPTION_DIMS, its results by result_dims)."""
  options = {name: x for name, x in (options or {}).items() if x is not None}
  if jax.device_count() == 1 or manual_axes():
    # Nothing to partition: on one device, or per device inside jax.shard_map (the caller
    # has split the arrays already; custom_partitioning cannot run under manual axes),
    # the program stays exactly the kernel's.
    return kernel(*operands, **options)
  # custom_partitioning takes arrays only: absent optional operands (None) are left out
  # here and put back in front of the kernel; options follow the operands.
  names = tuple(options)
  present = tuple(i for i, x in enumerate(operands) if x is not None)
  dims = (tuple(operand_dims[i] for i in present)
          + tuple(_option_dims(name, options[name]) for name in names))

  def run(*arrays):
    full = [None] * len(operands)
    for i, x in zip(present, arrays):
      full[i] = x
    return tuple(kernel(*full, **dict(zip(names, arrays[len(present):]))))

  heads = (operands[0].shape[2], operands[1].shape[2])  # N, K
  call = custom_partitioning(run)
  # decode_shardings=False: the callbacks get the operands' shardings as XLA has them and
  # read them with `_as_named`, which returns None (rather than failing, as the built-in
  # decoding does) for one no PartitionSpec expresses.
  callbacks = dict(partition=functools.partial(_partition, run, dims, heads, result_dims),
                   sharding_rule=_sharding_rule(dims, result_dims), decode_shardings=False)
  if "infer_sharding_from_operands" in inspect.signature(call.def_partition).parameters:
    # Only read by the GSPMD partitioner (jax_use_shardy_partitioner=False).
    callbacks["infer_sharding_from_operands"] = functools.partial(_infer, dims, heads, result_dims)
  call.def_partition(**callbacks)

  # custom_partitioning has no batching rule: under jax.vmap, run the kernels' own (the
  # vmapped call is then not partitioned: XLA gathers its operands).
  batchable = jax.custom_batching.custom_vmap(lambda *arrays: call(*arrays))

  @batchable.def_vmap
  def _(axis_size, in_batched, *arrays):
    del axis_size
    in_axes = tuple(0 if batched else None for batched in in_batched)
    return jax.vmap(run, in_axes=in_axes)(*arrays), (True,) * len(result_dims)

  return batchable(*(operands[i] for i in present), *(options[name] for name in names))


def _sharding_rule(dims, result_dims) -> SdyShardingRule:
  """Shardy's view of the call: b, n and k pass through, every other factor replicates.

  Query heads n and KV heads k are separate factors on purpose. As the compound (k, g),
  with fewer KV heads than devices Shardy splits a mesh axis into sub-axes over k and g
  and hands the call a key split over a sub-axis, which no PartitionSpec expresses;
  `_partition` ties the two instead.
  """
  factors = []  # in order of first appearance: Shardy wants special factors sorted so
  for names in dims + result_dims:
    factors += [name for name in names if name not in factors]
  return SdyShardingRule(
      tuple(ArrayMapping(*names) for names in dims),
      tuple(ArrayMapping(*names) for names in result_dims),
      need_replication_factors=tuple(f for f in factors if f not in ("b", "n", "k")))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Mesh axes the batch and the heads stay split over, and how the KV heads follow."""

  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]
  kv_split: bool  # True: KV heads split with the query's; False: replicated, sliced per device
  kv_share: int = 1  # devices along head_axes that read the same KV head (kv_split False)

  def axes(self, name: str):
    axes = {"b": self.batch_axes, "n": self.head_axes,
            "k": self.head_axes if self.kv_split else ()}.get(name, ())
    return None if not axes else axes[0] if len(axes) == 1 else axes

  def shardings(self, mesh, dims):
    return tuple(NamedSharding(mesh, PartitionSpec(*(self.axes(n) for n in names)))
                 for names in dims)


def _as_named(arg, mesh, names):
  """arg.sharding as a NamedSharding of `mesh` that splits only b, n and k; None if none is.

  XLA hands over shardings, not PartitionSpecs. The shard shape tells how many ways each
  dimension is split; this tries the specs over mesh axes that match those counts.
  """
  sharding = arg.sharding
  if isinstance(sharding, NamedSharding):
    return sharding
  ways = [whole // part for whole, part in zip(arg.shape, sharding.shard_shape(arg.shape))]
  splittable = [i for i, name in enumerate(names) if name in ("b", "n", "k")]
  if any(w > 1 for i, w in enumerate(ways) if i not in splittable):
    return None
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  options = [()] + [p for r in range(1, len(axes) + 1) for p in itertools.permutations(axes, r)]
  per_dim = [[o for o in options if _axes_size(mesh, o) == ways[i]] for i in splittable]
  for choice in itertools.product(*per_dim):
    used = [a for option in choice for a in option]
    if len(used) != len(set(used)):
      continue
    spec = [None] * len(names)
    for i, option in zip(splittable, choice):
      spec[i] = option or None
    candidate = NamedSharding(mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)
    if sharding.is_equivalent_to(candidate, len(names)):
      return candidate
  return None


def _spec_axes(sharding, ndim: int):
  """Mesh axes of each dimension, as tuples (empty: not split); all empty for None."""
  spec = () if sharding is None else tuple(sharding.spec)
  spec += (None,) * (ndim - len(spec))
  return tuple(() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec)


def _axes_size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _plan(mesh, dims, arg_shapes, heads: tuple[int, int]) -> _Plan:
  """Keeps the batch and head splits the operands already have, where the kernel can."""
  num_heads, num_kv_heads = heads
  found = {}
  for names, arg in zip(dims, arg_shapes):  # the query first, then key/value, then the rest
    sharding = _as_named(arg, mesh, names)
    for name, axes in zip(names, _spec_axes(sharding, len(names))):
      group = "heads" if name in ("n", "k") else name
      if axes and group not in found and group in ("b", "heads"):
        found[group] = axes
  batch_axes = found.get("b", ())
  head_axes = tuple(a for a in found.get("heads", ()) if a not in batch_axes)
  if arg_shapes[0].shape[0] % _axes_size(mesh, batch_axes):
    batch_axes = ()
  devices = _axes_size(mesh, head_axes)
  if devices == 1:
    return _Plan(batch_axes, (), True)
  if num_heads % devices == 0 and num_kv_heads % devices == 0:
    return _Plan(batch_axes, head_axes, True)
  if num_heads % devices == 0 and devices % num_kv_heads == 0:
    return _Plan(batch_axes, head_axes, False, devices // num_kv_heads)
  warnings.warn(
      f"jaxflash.attention: {num_heads} query heads and {num_kv_heads} KV heads cannot be split "
      f"over the {devices} devices of mesh axes {head_axes}; computing heads replicated "
      f"(XLA gathers them). Use a head count divisible by the devices.", stacklevel=2)
  return _Plan(batch_axes, (), True)


def _infer(dims, heads, result_dims, mesh, arg_shapes, result_shape):
  """GSPMD propagation: the results' shardings from the operands'."""
  del result_shape
  return _plan(mesh, dims, arg_shapes, heads).shardings(mesh, result_dims)


def _partition(run, dims, heads, result_dims, mesh, arg_shapes, result_shape):
  """Operand and result shardings of the plan, and the per-device computation."""
  del result_shape  # Shardy's guess; the plan's results replace it (XLA reshards if needed)
  plan = _plan(mesh, dims, arg_shapes, heads)

  def per_device(*xs):
    if not (plan.head_axes and not plan.kv_split):
      return run(*xs)
    # This device's N/d query heads all read KV head (device position) // (d / K).
    kv_head = lax.axis_index(plan.head_axes) // plan.kv_share
    xs = tuple(lax.dynamic_slice_in_dim(x, kv_head, 1, axis=names.index("k"))
               if "k" in names else x for x, names in zip(xs, dims))
    results = run(*xs)
    # A KV-head result (a gradient of replicated key/value) holds this device's share of
    # one KV head: put it in place and sum the shares over the head axes.
    return tuple(_scatter_sum(r, kv_head, names.index("k"), num_kv_heads, plan.head_axes)
                 if "k" in names else r for r, names in zip(results, result_dims))

  num_kv_heads = heads[1]
  return mesh, per_device, plan.shardings(mesh, result_dims), plan.shardings(mesh, dims)


def _scatter_sum(part, index, axis: int, size: int, axes):
  """part (size 1 along `axis`) placed at `index` in zeros of `size` there, summed over `axes`."""
  shape = list(part.shape)
  shape[axis] = size
  full = lax.dynamic_update_slice_in_dim(jax.numpy.zeros(shape, part.dtype), part, index, axis)
  return lax.psum(full, axes)
