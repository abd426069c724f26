"""Tensor-parallel Qwen2: the weights split over a mesh axis as Megatron-LM splits a
transformer, so that each device computes its share of the heads and of the MLP units.

    mesh = jax.make_mesh((2,), ("model",))
    model = models.qwen2.shard_model(model, mesh)          # or random_model(..., mesh=mesh)
    new_tokens = models.qwen2.generate(model, prompts, 64)  # caches made split to match

Placement (d = devices on `model_axis`):

- column-parallel q/k/v and gate/up projections: kernel [in, out] split over `out`
  (`P(None, "model")`), biases `P("model")`. A device's q/k/v columns are whole heads
  (N/d query heads, K/d KV heads), so RoPE, the KV-cache write and attention (jaxflash's
  custom partitioning, jaxflash/sharding.py) all run on local heads.
- row-parallel o and down projections: kernel split over `in` (`P("model", None)`); each
  device's product is a partial sum, and XLA's all-reduce of it is the layer's only
  collective (two a layer).
- embedding and norms replicated; an untied LM head split over the vocabulary
  (`P(None, "model")`: each device reads 1/d of it per step, the largest single matrix);
  a tied one stays with the replicated embedding.
- KV caches: contiguous [B, S, K, H] `P(data, None, "model", None)`, page pools
  [P, page, K, H] `P(None, None, "model", None)` (a pool has no batch dimension: block
  tables hold global page ids), block tables and lengths `P(data)`, all created so by
  `Sampler` / `ContiguousCache.create(..., sharding=)`; the decode step keeps them in place.

Fewer KV heads than devices (Qwen2.5-1.5B: 2 KV heads on 4 devices): the KV projections'
heads are repeated up to d at placement (head j a copy of head j // (d / K)), and the
returned model's config says num_key_value_heads = d. Query head n then reads head
n // (N / d), a copy of the head n // (N / K) it read before, so the outputs are unchanged,
and each device holds and reads one KV head of the cache: the cache grows by d / K in total
but not per device, and attention stays local. (Keeping K heads replicated instead would
store the whole cache on every device and copy a head out of it on each call.) Shapes that
split neither way (N or the MLP width not divisible by d; K and d not multiples of one
another) raise a ValueError.

`data_axis` (optional) splits the batch of the caches and of the per-sequence inputs the
sampler places; the weights stay replicated over it. XLA then gathers each step's new keys
and values (one token a sequence, small) over the data axis for the cache writes: a page
pool is not split by batch, and XLA does not see the contiguous write as per-row.

On one device nothing here runs: an unsharded model is the single-device program.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxflash
from models.qwen2.config import Qwen2Config
from models.qwen2.model import Qwen2ForCausalLM

# Parameter path (joined with "/", layer index dropped) -> how it splits: "column" over its
# output features, "row" over its input features, "vocab" (LM head) or replicated (absent).
_SPLITS = {
    "attention/q_proj/kernel": "column", "attention/q_proj/bias": "column",
    "attention/k_proj/kernel": "column", "attention/k_proj/bias": "column",
    "attention/v_proj/kernel": "column", "attention/v_proj/bias": "column",
    "attention/o_proj/kernel": "row",
    "mlp/gate_proj/kernel": "column", "mlp/up_proj/kernel": "column",
    "mlp/down_proj/kernel": "row",
    "lm_head/kernel": "vocab",
}
_KV_PROJECTIONS = ("k_proj", "v_proj")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """Where a sharded model lives: the mesh, the axis the weights split over, and the
  (optional) axis the batch splits over. Hashable: it rides in the model's graphdef."""

  mesh: Mesh
  model_axis: str = "model"
  data_axis: str | None = None

  def __post_init__(self):
    for axis in (self.model_axis, self.data_axis):
      if axis is not None and axis not in self.mesh.axis_names:
        raise ValueError(f"mesh axes are {self.mesh.axis_names}, no {axis!r}")

  @property
  def degree(self) -> int:
    """Devices the weights split over."""
    return self.mesh.shape[self.model_axis]

  def named(self, *spec) -> NamedSharding:
    return NamedSharding(self.mesh, P(*spec))

  def _batch_axis(self, batch: int | None):
    if self.data_axis is None or (batch is not None and batch % self.mesh.shape[self.data_axis]):
      return None  # a batch the data axis does not divide stays replicated
    return self.data_axis

  def per_sequence(self, ndim: int, batch: int | None = None) -> NamedSharding:
    """Arrays with a leading batch dimension (tokens, lengths, block tables)."""
    return self.named(self._batch_axis(batch), *(None,) * (ndim - 1))

  def contiguous_kv(self, batch: int | None = None) -> NamedSharding:
    """A contiguous cache [B, S, K, H]: batch over data, KV heads over model."""
    return self.named(self._batch_axis(batch), None, self.model_axis, None)

  def kv_pages(self) -> NamedSharding:
    """A page pool [P, page, K, H]: KV heads over model, replicated over data."""
    return self.named(None, None, self.model_axis, None)

  def to_device(self, x, batch: int | None = None) -> jax.Array:
    """A host array with a leading batch dimension -> placed as `per_sequence`."""
    x = np.asarray(x)
    return jax.device_put(x, self.per_sequence(x.ndim, batch))

  def skinny_matmul(self, x: jax.Array, w, split: str):
    """x [B, ..., K] @ w [K, N] (or a tuple of such w: a tuple back) with
    jaxflash.skinny_matmul on each device's shard.

    split "column" (w split over N: each device computes its output columns) or "row" (w
    split over K, x's last dimension split alike: each device's partial product, summed
    by one all-reduce, the one XLA's own row-parallel dot makes). The kernel is opaque to
    XLA's partitioner, so shard_map hands it the local shapes instead.
    """
    if split not in ("column", "row"):
      raise ValueError(f"split must be 'column' or 'row', got {split!r}")
    lead = (self._batch_axis(x.shape[0]),) + (None,) * (x.ndim - 2)
    model = self.model_axis
    if split == "column":
      x_spec, w_spec, out_spec = P(*lead, None), P(None, model), P(*lead, model)
    else:
      x_spec, w_spec, out_spec = P(*lead, model), P(model, None), P(*lead, None)
    several = isinstance(w, (tuple, list))
    ws = tuple(w) if several else (w,)

    def local(x, ws):
      outs = jaxflash.skinny_matmul(x, ws)
      return outs if split == "column" else tuple(jax.lax.psum(out, model) for out in outs)

    # check_vma off: Pallas calls carry no varying-axes rule.
    outs = jax.shard_map(local, mesh=self.mesh, in_specs=(x_spec, (w_spec,) * len(ws)),
                         out_specs=(out_spec,) * len(ws), check_vma=False)(x, ws)
    return outs if several else outs[0]


def tensor_parallel_config(config: Qwen2Config, degree: int) -> Qwen2Config:
  """The config of the model split over `degree` devices: the same, except that fewer KV
  heads than devices are repeated up to `degree`. Raises ValueError where no split fits."""
  heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
  problems = []
  if heads % degree:
    problems.append(f"{heads} query heads")
  if kv_heads % degree and degree % kv_heads:
    problems.append(f"{kv_heads} KV heads (neither a multiple nor a divisor of {degree})")
  if config.intermediate_size % degree:
    problems.append(f"intermediate_size {config.intermediate_size}")
  if problems:
    raise ValueError(f"cannot split the Qwen2 model over {degree} devices: "
                     + ", ".join(problems) + f" do not divide by {degree}")
  return config.replace(num_key_value_heads=max(kv_heads, degree))


def partition_specs(state: nnx.State, config: Qwen2Config, model_axis: str = "model",
                    degree: int = 1) -> dict:
  """Flat state path -> PartitionSpec of each parameter of a model with `config` split over
  `degree` devices (see the module docstring)."""
  specs = {}
  for path, variable in nnx.to_flat_state(state):
    name = "/".join(str(k) for k in path if not isinstance(k, int)).removeprefix("layers/")
    split = _SPLITS.get(name)
    ndim = len(variable.shape)
    if split == "column":
      spec = P(*(None,) * (ndim - 1), model_axis)
    elif split == "row":
      spec = P(model_axis, None)
    elif split == "vocab" and config.vocab_size % degree == 0:
      spec = P(None, model_axis)
    else:  # embedding, norms, an LM head the vocabulary does not split evenly
      spec = P()
    specs[path] = spec
  return specs


def _repeat_kv_heads(path: tuple, value: jax.Array, head_dim: int, repeats: int) -> jax.Array:
  """k/v projection kernel [in, K * H] or bias [K * H] -> K * repeats heads, head j a
  copy of head j // repeats."""
  if repeats == 1 or len(path) < 2 or path[-2] not in _KV_PROJECTIONS:
    return value
  heads = value.shape[-1] // head_dim
  split = value.reshape(*value.shape[:-1], heads, head_dim)
  return jnp.repeat(split, repeats, axis=-2).reshape(*value.shape[:-1], heads * repeats * head_dim)


def place(make_arrays, args, config: Qwen2Config, tp: TensorParallel, *, dtype,
          param_dtype) -> Qwen2ForCausalLM:
  """The tensor-parallel model from `make_arrays(*args) -> {flat path: array}`, the
  parameters of an unsplit model with `config`. They are made (or moved) inside one jit
  whose outputs are split, so no device holds the whole model on the way."""
  tp_config = tensor_parallel_config(config, tp.degree)
  repeats = tp_config.num_key_value_heads // config.num_key_value_heads
  abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(tp_config, rngs=nnx.Rngs(0), dtype=dtype,
                                                     param_dtype=param_dtype))
  graphdef, abstract_state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(abstract_state))
  specs = partition_specs(abstract_state, tp_config, tp.model_axis, tp.degree)
  shardings = {path: tp.named(*spec) for path, spec in specs.items()}

  def build(*values):
    arrays = make_arrays(*values)
    return {path: _repeat_kv_heads(path, arrays[path], config.head_dim, repeats).astype(
        variable.dtype) for path, variable in flat.items()}

  arrays = jax.jit(build, out_shardings=shardings)(*args)
  state = nnx.from_flat_state([(path, variable.replace(arrays[path]))
                               for path, variable in flat.items()])
  model = nnx.merge(graphdef, state)
  model.tensor_parallel = tp
  return model


def shard_model(model: Qwen2ForCausalLM, mesh: Mesh, *, model_axis: str = "model",
                data_axis: str | None = None) -> Qwen2ForCausalLM:
  """`model` split tensor-parallel over `mesh[model_axis]` (see the module docstring).

  Returns a new model (the input's arrays are left as they are) whose config has more KV
  heads (repeats) than the input's when it had fewer than the devices; `generate` and
  `Sampler` make its caches split to match.
  """
  tp = TensorParallel(mesh, model_axis, data_axis)
  repeats = tensor_parallel_config(model.config, tp.degree).num_key_value_heads
  repeats //= model.config.num_key_value_heads
  _, state = nnx.split(model)
  specs = partition_specs(state, model.config, model_axis, tp.degree)
  # Each array moves to the mesh already split as it will be (KV projections to repeat:
  # replicated, they are small); the jit then only repeats heads and casts.
  paths, values = zip(*(
      (path, jax.device_put(variable[...], tp.named(
          *(P() if repeats > 1 and path[-2] in _KV_PROJECTIONS else specs[path]))))
      for path, variable in nnx.to_flat_state(state)))
  # The arrays enter the jit as arguments: closed over, they would be baked into the program.
  return place(lambda *arrays: dict(zip(paths, arrays)), values, model.config, tp,
               dtype=model.dtype, param_dtype=model.embedder.embedding.dtype)
