"""Hugging Face checkpoints -> Qwen2ForCausalLM: safetensors read as NumPy, mapped by a regex
table, every shape checked; and random-weight models for tests and benchmarks.

Only safetensors files are read (`model.safetensors`, or the shards a
`model.safetensors.index.json` names); pickled PyTorch files are never opened.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from models.qwen2.config import Qwen2Config
from models.qwen2.model import Qwen2ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _transpose(w: jax.Array) -> jax.Array:
  return w.T  # torch Linear stores [out, in]; nnx.Linear's kernel is [in, out]


# HF tensor name <-> our state path. "{layer}" and "{proj}" stand for the parts that vary;
# the transform turns the stored tensor into our parameter.
WEIGHT_MAP: tuple[tuple[str, str, Callable | None], ...] = (
    ("model.embed_tokens.weight", "embedder/embedding", None),
    ("model.layers.{layer}.input_layernorm.weight", "layers/{layer}/pre_attention_norm/scale", None),
    ("model.layers.{layer}.self_attn.{proj}_proj.weight",
     "layers/{layer}/attention/{proj}_proj/kernel", _transpose),
    ("model.layers.{layer}.self_attn.{proj}_proj.bias", "layers/{layer}/attention/{proj}_proj/bias",
     None),
    ("model.layers.{layer}.post_attention_layernorm.weight", "layers/{layer}/pre_mlp_norm/scale",
     None),
    ("model.layers.{layer}.mlp.{proj}_proj.weight", "layers/{layer}/mlp/{proj}_proj/kernel",
     _transpose),
    ("model.norm.weight", "final_norm/scale", None),
    ("lm_head.weight", "lm_head/kernel", _transpose),
)
# Present in some exports, carrying nothing the model needs: RoPE's precomputed inverse
# frequencies (recomputed from rope_theta).
IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq"),)


def _template_regex(template: str, separator: str) -> re.Pattern:
  """"model.layers.{layer}.x" -> a regex with a named group per placeholder."""
  parts = re.split(r"(\{\w+\})", template)
  return re.compile("".join(f"(?P<{p[1:-1]}>[^{re.escape(separator)}]+)" if p.startswith("{")
                            else re.escape(p) for p in parts))


_RULES = tuple((_template_regex(hf, "."), hf, _template_regex(ours, "/"), ours, transform)
               for hf, ours, transform in WEIGHT_MAP)


def _state_path(name: str) -> tuple[tuple, Callable | None] | None:
  """HF tensor name -> (our state path, transform), or None when no rule matches."""
  for hf_regex, _, _, ours, transform in _RULES:
    match = hf_regex.fullmatch(name)
    if match:
      path = ours.format(**match.groupdict()).split("/")
      # nnx.List keys its layers by int: ("layers", 3, ...), not ("layers", "3", ...).
      return tuple(int(k) if k.isdigit() else k for k in path), transform
  return None


def hf_name(path: tuple) -> str:
  """Our state path -> the HF tensor name that fills it (for error messages)."""
  joined = "/".join(map(str, path))
  for _, hf, ours_regex, _, _ in _RULES:
    match = ours_regex.fullmatch(joined)
    if match:
      return hf.format(**match.groupdict())
  return joined


class CheckpointError(ValueError):
  """A checkpoint whose tensors do not match the model the config describes."""


def resolve_dtype(dtype, default=None):
  """'bfloat16' / 'float32' / a dtype / None (-> default) -> a jnp dtype (or None)."""
  if dtype is None:
    return None if default is None else resolve_dtype(default)
  if isinstance(dtype, str):
    name = dtype.removeprefix("torch.").removeprefix("jnp.")
    aliases = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16",
               "float": "float32"}
    name = aliases.get(name, name)
    if name not in ("bfloat16", "float16", "float32"):
      raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    return jnp.dtype(name)
  return jnp.dtype(dtype)


def checkpoint_files(path: str | os.PathLike) -> dict[str, str]:
  """Tensor name -> safetensors file, from the index of a sharded checkpoint or the single file."""
  path = os.path.expanduser(os.fspath(path))
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
  single = os.path.join(path, SINGLE_FILE)
  if os.path.exists(single):
    with safe_open(single, framework="np") as f:
      return {name: single for name in f.keys()}
  raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path!r} (only safetensors "
                          "checkpoints are read)")


def _iter_tensors(files: dict[str, str]) -> Iterable[tuple[str, np.ndarray]]:
  by_file: dict[str, list[str]] = {}
  for name, file in files.items():
    by_file.setdefault(file, []).append(name)
  for file, names in by_file.items():
    with safe_open(file, framework="np") as f:
      for name in sorted(names):
        yield name, f.get_tensor(name)


def _plural(items: list, limit: int = 8) -> str:
  shown = ", ".join(items[:limit])
  return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def load_weights(model: Qwen2ForCausalLM, files: dict[str, str], *, progress: bool = False
                 ) -> Qwen2ForCausalLM:
  """Fills `model` (abstract or concrete) with the tensors of `files`; checks that every
  parameter is given exactly once with the right shape. Returns the loaded model."""
  graphdef, state = nnx.split(model)
  flat = dict(nnx.to_flat_state(state))
  expected = {path: (tuple(v.shape), v.dtype) for path, v in flat.items()}
  loaded: dict[tuple, jax.Array] = {}
  unexpected, misshaped = [], []
  tied = model.config.tie_word_embeddings
  items = _iter_tensors(files)
  if progress:
    from tqdm.auto import tqdm
    items = tqdm(items, total=len(files), desc="loading weights", unit="tensor")
  for name, array in items:
    if any(p.fullmatch(name) for p in IGNORED):
      continue
    target = _state_path(name)
    if target is None:
      unexpected.append(name)
      continue
    path, transform = target
    if path not in expected:
      # A tied model has no lm_head of its own: HF ignores a stored copy, and so do we.
      if tied and name == "lm_head.weight":
        continue
      unexpected.append(name)
      continue
    shape, dtype = expected[path]
    value = jnp.asarray(array)
    if transform is not None:
      value = transform(value)
    if tuple(value.shape) != shape:
      misshaped.append(f"{name}: checkpoint {tuple(array.shape)}, model expects "
                       f"{shape if transform is None else shape[::-1]}")
      continue
    loaded[path] = value.astype(dtype)
  missing = [hf_name(p) for p in expected if p not in loaded]
  problems = []
  if missing:
    problems.append(f"missing {len(missing)} parameter(s): {_plural(missing)}")
  if unexpected:
    problems.append(f"unexpected {len(unexpected)} tensor(s): {_plural(unexpected)}")
  if misshaped:
    problems.append(f"{len(misshaped)} tensor(s) with the wrong shape: {_plural(misshaped)}")
  if problems:
    raise CheckpointError("checkpoint does not match the Qwen2 config: " + "; ".join(problems))
  new_state = nnx.from_flat_state([(path, variable.replace(loaded[path]))
                                   for path, variable in flat.items()])
  return nnx.merge(graphdef, new_state)


def from_pretrained(path: str | os.PathLike, *, dtype=None, param_dtype=None, progress: bool = False,
                    mesh=None, model_axis: str = "model", data_axis: str | None = None,
                    **config_overrides) -> Qwen2ForCausalLM:
  """Loads a local Hugging Face Qwen2 / Qwen2.5 checkpoint directory (config.json and
  safetensors; `~` is expanded). `param_dtype` defaults to the checkpoint's dtype, `dtype`
  (computation) to `param_dtype`; both accept names ("bfloat16", "float32") or dtypes. With
  `mesh`, the loaded model is then split tensor-parallel (`models.qwen2.shard_model`).
  Raises FileNotFoundError for a folder that does not exist or holds no config.json or no
  safetensors weights."""
  path = os.path.expanduser(os.fspath(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
  config = Qwen2Config.from_pretrained(path, **config_overrides)
  checkpoint_dtype = config.torch_dtype or "float32"
  param_dtype = resolve_dtype(param_dtype, dtype if dtype is not None else checkpoint_dtype)
  dtype = resolve_dtype(dtype, param_dtype)
  abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                     param_dtype=param_dtype))
  model = load_weights(abstract, checkpoint_files(path), progress=progress)
  if mesh is None:
    return model
  from models.qwen2.parallel import shard_model
  return shard_model(model, mesh, model_axis=model_axis, data_axis=data_axis)


def save_pretrained(model: Qwen2ForCausalLM, path: str | os.PathLike) -> None:
  """Writes `model` as a Hugging Face checkpoint directory (config.json and
  model.safetensors, HF's tensor names and layouts) that `from_pretrained` reads back."""
  from safetensors.numpy import save_file
  path = os.path.expanduser(os.fspath(path))
  os.makedirs(path, exist_ok=True)
  _, state = nnx.split(model)
  tensors = {}
  for state_path, variable in nnx.to_flat_state(state):
    value = np.asarray(jnp.asarray(variable[...], jnp.float32))  # float32: NumPy has no bfloat16
    name = hf_name(state_path)
    tensors[name] = np.ascontiguousarray(value.T if _state_path(name)[1] is _transpose else value)
  save_file(tensors, os.path.join(path, SINGLE_FILE))
  config = dataclasses.replace(model.config, torch_dtype=jnp.dtype(model.dtype).name)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config.to_hf_dict(), f, indent=2)


def random_model(config: Qwen2Config, seed: int = 0, dtype="float32", *, param_dtype=None,
                 mesh=None, model_axis: str = "model", data_axis: str | None = None
                 ) -> Qwen2ForCausalLM:
  """A model with HF's random initialisation (normal(0.02) matrices, zero biases, unit norms).

  With `mesh`: the same weights, drawn directly split tensor-parallel over
  `mesh[model_axis]` (see models/qwen2/parallel.py), never whole on one device.
  """
  dtype = resolve_dtype(dtype)
  param_dtype = resolve_dtype(param_dtype, dtype)
  def create():
    return Qwen2ForCausalLM(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)
  if mesh is not None:
    from models.qwen2.parallel import TensorParallel, place
    def arrays():
      return {path: v[...] for path, v in nnx.to_flat_state(nnx.split(create())[1])}
    return place(arrays, (), config, TensorParallel(mesh, model_axis, data_axis), dtype=dtype,
                 param_dtype=param_dtype)
  graphdef, _ = nnx.split(nnx.eval_shape(create))
  # Drawn inside jit: on a GPU the weights are made there, never on the host.
  state = jax.jit(lambda: nnx.split(create())[1])()
  return nnx.merge(graphdef, state)
