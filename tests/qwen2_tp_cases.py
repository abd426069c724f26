"""Tensor-parallel Qwen2 cases (models/qwen2/parallel.py) against the single-device model.

Forced host devices must be set before JAX starts, so tests/test_qwen2_tp.py runs this
module in a subprocess on four of them and reads the JSON it prints last (the 2-device
cases on the first two, the 4-device ones on all four):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m tests.qwen2_tp_cases

The tiny float32 config has 4 query heads and 2 KV heads, so 2 devices split the KV heads
as they are and 4 devices repeat them (one a device). On a multi-GPU host `run` is called
in-process.
"""
from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from models import qwen2

PROMPTS = ([3, 17, 250, 9, 41], [8, 1, 99, 123, 7, 66, 200, 31, 5, 12, 77])
NEW_TOKENS = 5
# Parameter -> the PartitionSpec it must have, trailing Nones dropped (layer 0 stands for
# every layer).
WANT_SPECS = {
    "layers/0/attention/q_proj/kernel": [None, "model"],
    "layers/0/attention/q_proj/bias": ["model"],
    "layers/0/attention/k_proj/kernel": [None, "model"],
    "layers/0/attention/v_proj/bias": ["model"],
    "layers/0/attention/o_proj/kernel": ["model"],
    "layers/0/mlp/gate_proj/kernel": [None, "model"],
    "layers/0/mlp/up_proj/kernel": [None, "model"],
    "layers/0/mlp/down_proj/kernel": ["model"],
    "layers/0/pre_attention_norm/scale": [],
    "embedder/embedding": [],
    "lm_head/kernel": [None, "model"],
}
# The result type is an array type, or a tuple of them where XLA combined several collectives
# into one (GPU compilers do) or made one asynchronous (`*-start`).
COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(all-gather|all-to-all|collective-permute|"
                        r"all-reduce|reduce-scatter)(?:-start)?\(")


def config():
  return qwen2.Qwen2Config.tiny(tie_word_embeddings=False)


def test_model(seed: int = 0):
  """A random model with weights large enough that greedy decoding wanders (HF's 0.02
  initialisation gives near-flat logits, where ties would make the comparison flaky)."""
  model = qwen2.random_model(config(), seed=seed)
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(seed)
  def perturb(path, x):
    name = "/".join(map(str, path))
    if name.endswith("scale"):
      return jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape), x.dtype)
    if name.endswith("bias"):
      return jnp.asarray(0.5 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape) * (2.0 / x.shape[0] ** 0.5 if x.ndim == 2 and
                                                       "embed" not in name else 0.5), x.dtype)
  state = jax.tree_util.tree_map_with_path(
      lambda p, x: perturb(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), x), state)
  return nnx.merge(graphdef, state)


def _spec(sharding):
  spec = list(sharding.spec)
  while spec and spec[-1] is None:
    spec.pop()
  return [list(a) if isinstance(a, tuple) else a for a in spec] if spec else []


def _param_specs(model) -> dict:
  flat = {"/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.split(model)[1])}
  out = {}
  for name, want in WANT_SPECS.items():
    spec = _spec(flat[name].sharding)
    out[name] = dict(spec=spec, want=want, shape=list(flat[name].shape))
  return out


@functools.cache
def _forward_function(graphdef):
  """The jitted forward pass of models of this structure (one compilation per structure)."""
  return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))


def _forward(model, ids):
  graphdef, state = nnx.split(model)
  return _forward_function(graphdef)(state, ids)


@functools.cache
def _single_device_model(device):
  """test_model() on `device`: the reference of every mesh (made once per device)."""
  return jax.device_put(test_model(), device)


def _collectives(hlo: str) -> list[dict]:
  """Each collective of a compiled program: kind, the shape of its (first) result, the
  shapes of all its results (several when XLA combined collectives into one), and whether
  it belongs to the sampler (its op name under the `sample` scope: the top-k / top-p
  branches, which need the vocabulary-split logits whole)."""
  found = []
  for match in COLLECTIVE.finditer(hlo):
    shape_text, kind = match.groups()
    shapes = [[int(d) for d in dims.split(",") if d]
              for dims in re.findall(r"\[([\d,]*)\]", shape_text)]
    line_end = hlo.find("\n", match.end())
    line = hlo[match.start():None if line_end < 0 else line_end]
    found.append(dict(kind=kind, shape=shapes[0] if shapes else [], shapes=shapes, text=shape_text,
                      sampling="/sample/" in line))
  return found


def _decode_step(sampler, cache_kind: str):
  """Prefill + one decode step by hand: (shardings of the new cache, its pool shape, of the
  cache before the step and after it, the step's compiled HLO, whether its projections run
  the skinny kernel)."""
  # As generate passes them (device scalars): its compiled prefill serves this one too.
  greedy = qwen2.SamplingParams().as_arrays()
  eos = jnp.asarray([-1], jnp.int32)
  batch = len(PROMPTS)
  lengths = np.array([len(p) for p in PROMPTS], np.int32)
  tokens = np.zeros((batch, 16), np.int32)
  for row, prompt in enumerate(PROMPTS):
    tokens[row, :len(prompt)] = prompt
  cache = sampler.make_cache(batch, 64)
  if cache_kind == "paged":
    allocator = qwen2.PageAllocator(cache.num_pages, sampler.page_size, batch,
                                    cache.block_table.shape[1])
    for row in range(batch):
      allocator.reserve(row, 32)
    cache = qwen2.PagedCache(cache.key_pages, cache.value_pages,
                             sampler.to_device(allocator.block_table), cache.lengths)
  created = jax.tree.map(lambda x: x.sharding, cache)
  pool_shape = list((cache.key_pages if cache_kind == "paged" else cache.keys)[0].shape)
  state = sampler.prefill(sampler.to_device(tokens), sampler.to_device(lengths), cache,
                          jax.random.key(0), eos, greedy)
  args = (sampler.params, state, eos)
  step = functools.partial(sampler.steps.decode, sampling=greedy,
                           attention_impl=sampler.attention_impl)
  compiled = step.func.lower(*args, **step.keywords).compile()
  skinny = "jaxflash_skinny_matmul" in str(jax.make_jaxpr(step)(*args))
  before = jax.tree.map(lambda x: x.sharding, state.cache)
  # The step run is the program compiled above (sampler.decode would compile it again).
  after = jax.tree.map(lambda x: x.sharding, compiled(*args, sampling=greedy).cache)
  return created, pool_shape, before, after, compiled.as_text(), skinny


def run(devices=None, data_parallel: bool = False) -> dict:
  devices = jax.devices() if devices is None else devices
  d = len(devices)
  if data_parallel:
    mesh = Mesh(np.asarray(devices).reshape(2, d // 2), ("data", "model"))
  else:
    mesh = Mesh(np.asarray(devices), ("model",))
  tp_degree = mesh.shape["model"]
  single = _single_device_model(devices[0])
  sharded = qwen2.shard_model(single, mesh, data_axis="data" if data_parallel else None)
  result: dict = dict(devices=d, tp=tp_degree, data_parallel=data_parallel,
                      kv_heads=sharded.config.num_key_value_heads,
                      params=_param_specs(sharded))

  ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 9)), jnp.int32)
  want = np.asarray(_forward(single, ids))
  got = _forward(sharded, ids)
  result["logits_err"] = float(np.abs(np.asarray(got) - want).max())
  result["logits_scale"] = float(np.abs(want).max())
  result["logits_spec"] = _spec(got.sharding)

  for kind in ("paged", "contiguous"):
    options = dict(max_new_tokens=NEW_TOKENS, cache=kind, eos_token_id=(), page_size=8)
    want_tokens = qwen2.generate(single, PROMPTS, **options)
    got_tokens = qwen2.generate(sharded, PROMPTS, **options)
    sampler = qwen2.Sampler(sharded, cache=kind, page_size=8)
    created, pool_shape, before, after, hlo, skinny = _decode_step(sampler, kind)
    pools = created.key_pages if kind == "paged" else created.keys
    shapes = {tuple(x.shape) for x in jax.tree.leaves(nnx.split(sharded)[1])}
    result[kind] = dict(
        tokens=got_tokens, want_tokens=want_tokens,
        kv_spec=_spec(pools[0]),
        rows_spec=_spec(created.lengths),
        step_keeps_shardings=all(a.is_equivalent_to(b, 4) if hasattr(a, "is_equivalent_to") else
                                 a == b for a, b in zip(jax.tree.leaves(before),
                                                        jax.tree.leaves(after))),
        collectives=_collectives(hlo), skinny_in_step=skinny,
        weight_or_cache_shapes=sorted([list(s) for s in shapes] + [pool_shape]))
  return result


def direct_random_model(devices=None) -> tuple[float, bool]:
  """random_model(mesh=) draws the same weights as random_model + shard_model:
  -> (largest difference, whether every sharding is the same)."""
  devices = jax.devices() if devices is None else devices
  mesh = Mesh(np.asarray(devices), ("model",))
  direct = qwen2.random_model(config(), seed=3, mesh=mesh)
  moved = qwen2.shard_model(qwen2.random_model(config(), seed=3), mesh)
  a = jax.tree.leaves(nnx.split(direct)[1])
  b = jax.tree.leaves(nnx.split(moved)[1])
  same_sharding = all(x.sharding == y.sharding for x, y in zip(a, b))
  return float(max(np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in zip(a, b))), same_sharding


if __name__ == "__main__":
  # {device count: results}. One process for both counts: the single-device reference and
  # its compilations serve every mesh.
  devices = jax.devices()
  assert len(devices) == 4, f"run with 4 forced host devices, not {len(devices)}"
  out = {2: {"tp": run(devices[:2]), "direct_random": direct_random_model(devices[:2])},
         # and a 2 x 2 mesh: batch over "data", heads over "model"
         4: {"tp": run(devices), "dp_tp": run(devices, data_parallel=True)}}
  print(json.dumps(out))
