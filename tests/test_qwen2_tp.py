"""Tensor-parallel Qwen2 (models/qwen2/parallel.py): a model split over 2 and 4 devices
gives the single-device logits and greedy tokens (paged and contiguous caches), its
weights and caches are split as intended, and the compiled decode step moves no weight
or cache between devices (its only collectives: the all-reduces after o_proj and
down_proj, and the small all-gathers of the vocabulary-split argmax). Its projections run
jaxflash.skinny_matmul on each device's weight shard.

CPU: forced host devices, set before JAX starts, so the cases run in a subprocess
(tests/qwen2_tp_cases.py) with four, the 2-device meshes on the first two. GPU: in-process
on 2 GPUs.
"""
from __future__ import annotations

import math

import jax
import pytest
from jax.sharding import PartitionSpec as P

from models import qwen2
from tests.conftest import run_on_forced_cpu_devices
from tests.qwen2_tp_cases import PROMPTS

LOGITS_TOLERANCE = 2e-5  # float32 relative to the largest logit: all-reduce sums in another order
DEVICE_COUNTS = (2, 4)


@pytest.fixture(scope="module")
def cpu_results():
  """{device count: its results}, the JSON of `python -m tests.qwen2_tp_cases` on four
  forced host devices."""
  results = run_on_forced_cpu_devices("tests.qwen2_tp_cases")
  results = {int(count): result for count, result in results.items()}
  assert sorted(results) == list(DEVICE_COUNTS)
  return results


def _check(result, data_parallel: bool = False):
  tp = result["tp"]
  # 2 KV heads: split one a device over 2, repeated to one a device over 4.
  assert result["kv_heads"] == max(2, tp)
  for name, facts in result["params"].items():
    assert facts["spec"] == facts["want"], f"{name}: {facts}"
  assert result["params"]["layers/0/attention/k_proj/kernel"]["shape"] == [64, max(2, tp) * 16]
  assert result["logits_err"] <= LOGITS_TOLERANCE * result["logits_scale"], result["logits_err"]
  assert result["logits_spec"] == [None, None, "model"]  # vocabulary-split LM head
  for kind in ("paged", "contiguous"):
    facts = result[kind]
    assert facts["tokens"] == facts["want_tokens"], kind
    batch_axis = "data" if data_parallel else None
    if kind == "paged":  # a pool has no batch dimension: split over heads only
      assert facts["kv_spec"] == [None, None, "model"], facts["kv_spec"]
    else:
      assert facts["kv_spec"] == [batch_axis, None, "model"], facts["kv_spec"]
    assert facts["rows_spec"] == ([batch_axis] if data_parallel else []), facts["rows_spec"]
    assert facts["step_keeps_shardings"], f"{kind}: the decode step moved the cache"
    assert facts["skinny_in_step"], f"{kind}: the projections did not run jaxflash.skinny_matmul"
    big = {tuple(s) for s in facts["weight_or_cache_shapes"]}
    # The sampler's branches (temperature, top-k, top-p are data, chosen on the device) see
    # the vocabulary-split logits: at most one row of logits a sequence moves.
    config = qwen2.Qwen2Config.tiny()
    sampling = [c for c in facts["collectives"] if c["sampling"]]
    for c in sampling:
      for shape in c["shapes"]:
        assert math.prod(shape) <= len(PROMPTS) * config.vocab_size, f"{kind}: sampling {c}"
    step = [c for c in facts["collectives"] if not c["sampling"]]
    reduces = [c for c in step if c["kind"] == "all-reduce"]
    others = [c for c in step if c["kind"] != "all-reduce"]
    # Two all-reduces a layer (after o_proj and down_proj), of one token's hidden state;
    # counted by result array, since a GPU compiler combines several into one tuple.
    reduced = [shape for c in reduces for shape in c["shapes"]]
    assert len(reduced) == 2 * qwen2.Qwen2Config.tiny().num_hidden_layers, reduces
    assert all(shape[-1] == 64 and shape[1] == 1 for shape in reduced), reduces
    for c in others:
      assert c["kind"] == "all-gather", f"{kind}: unexpected {c}"
      for shape in c["shapes"]:  # an asynchronous gather's results: (operand, result)
        assert tuple(shape) not in big, f"{kind}: a weight or the cache is gathered: {c}"
        # Small: the argmax's per-shard maxima, or (data axis) one token's K/V or positions.
        assert shape and math.prod(shape) <= 2 * 2 * 16, f"{kind}: {c}"
    if not data_parallel:
      assert all(len(c["shape"]) == 2 for c in others), others  # the argmax only


@pytest.mark.parametrize("count", DEVICE_COUNTS)
def test_tensor_parallel_cpu(cpu_results, count):
  _check(cpu_results[count]["tp"])


def test_data_and_tensor_parallel_cpu(cpu_results):
  _check(cpu_results[4]["dp_tp"], data_parallel=True)


def test_random_model_on_mesh_cpu(cpu_results):
  error, same_sharding = cpu_results[2]["direct_random"]
  assert error == 0.0 and same_sharding


def test_indivisible_split_raises():
  config = qwen2.Qwen2Config.qwen2_5_7b()
  assert qwen2.parallel.tensor_parallel_config(config, 2).num_key_value_heads == 4
  assert qwen2.parallel.tensor_parallel_config(config, 28 // 7).num_key_value_heads == 4
  with pytest.raises(ValueError, match="28 query heads"):
    qwen2.parallel.tensor_parallel_config(config, 8)
  with pytest.raises(ValueError, match="KV heads"):
    qwen2.parallel.tensor_parallel_config(qwen2.Qwen2Config.tiny(num_attention_heads=6,
                                                                 num_key_value_heads=3), 2)
  small = qwen2.Qwen2Config.qwen2_5_1_5b()
  assert qwen2.parallel.tensor_parallel_config(small, 4).num_key_value_heads == 4
  assert qwen2.parallel.tensor_parallel_config(small, 1) == small


def test_partition_specs_of_7b():
  """The Qwen2.5-7B layout over 2 devices, from shapes alone (nothing allocated)."""
  from flax import nnx
  config = qwen2.Qwen2Config.qwen2_5_7b()
  abstract = nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(config, rngs=nnx.Rngs(0)))
  specs = qwen2.parallel.partition_specs(nnx.split(abstract)[1], config, "model", 2)
  assert specs[("layers", 3, "attention", "q_proj", "kernel")] == P(None, "model")
  assert specs[("layers", 3, "attention", "v_proj", "bias")] == P("model")
  assert specs[("layers", 3, "mlp", "down_proj", "kernel")] == P("model", None)
  assert specs[("lm_head", "kernel")] == P(None, "model")
  assert specs[("embedder", "embedding")] == P()


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_tensor_parallel_gpu():
  from tests import qwen2_tp_cases
  with jax.default_matmul_precision("highest"):  # float32 without TF32, as on the CPU
    _check(qwen2_tp_cases.run(jax.devices()[:2]))
