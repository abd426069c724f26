"""Device description and per-generation config tables (issue: every NVIDIA generation)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxflash
from jaxflash import configs
from jaxflash.device import A100, H200, RTX_3090, RTX_4060_LAPTOP, DeviceInfo, device_info
from tests.conftest import assert_close, random_array
from tests.reference_np import attention_f64, gather_pages_np

DEVICES = [H200, A100, RTX_3090, RTX_4060_LAPTOP]
HEAD_DIMS = [64, 80, 96, 128, 256]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def test_device_info_without_gpu_is_an_h200():
  if jax.default_backend() == "gpu":
    info = device_info()
    assert info.sm_count > 0 and info.compute_capability[0] >= 8
  else:
    assert device_info() == H200


@pytest.mark.parametrize("info,generation", [(H200, "hopper"), (A100, "ampere"), (RTX_3090, "ampere"),
                                             (RTX_4060_LAPTOP, "ada")])
def test_generation(info, generation):
  assert info.generation == generation


@pytest.mark.parametrize("info", DEVICES, ids=lambda d: d.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_chosen_configs_fit_the_budget(info, dtype):
  itemsize = jnp.dtype(dtype).itemsize
  for head_dim in HEAD_DIMS:
    chosen = [configs.prefill_config(head_dim, dtype, info),
              configs.decode_config(head_dim, dtype, info),
              configs.decode_config(head_dim, dtype, info, paged=True)]
    for config in chosen:
      assert config.smem_bytes(head_dim, itemsize) <= info.smem_per_block, (info.name, head_dim, config)
      configs.check_fits(config, head_dim, dtype, info)  # does not raise


def test_every_table_entry_is_well_formed():
  for _, config in configs.all_configs():
    assert config.block_k >= 16 and config.block_k & (config.block_k - 1) == 0
    assert config.num_warps in (1, 2, 4, 8, 16) and config.num_stages >= 1
    if isinstance(config, configs.PrefillConfig):
      assert config.block_q >= 16 and config.block_q & (config.block_q - 1) == 0


def test_smem_model_matches_the_article():
  # The article's Ada kernel: 128 x 128 Q tile, 64-token K/V tiles, d = 128, bf16 -> 96 KB.
  config = configs.PrefillConfig(128, 64, 8, 2)
  assert config.smem_bytes(128, 2) - configs.RESERVE_BYTES == 96 * 1024
  assert configs.prefill_config(128, jnp.bfloat16, RTX_4060_LAPTOP) == config


def test_smem_model_matches_the_compiler():
  # Triton's requests on the H200 (bench/results/h200/prefill_sweep.md): 64 x 128 tiles at
  # 4 stages asked for 278528 bytes, 128 x 128 at 4 stages for 294912.
  for config, requested in [(configs.PrefillConfig(64, 128, 4, 4), 278528),
                            (configs.PrefillConfig(128, 128, 4, 4), 294912)]:
    assert config.smem_bytes(128, 2) - configs.RESERVE_BYTES == requested


def test_budgets_differ_by_generation():
  # Hopper may take deep pipelines that Ada's 99 KB rule out.
  deep = configs.PrefillConfig(128, 128, 8, 3)
  configs.check_fits(deep, 128, jnp.bfloat16, H200)
  with pytest.raises(ValueError, match="101376-byte budget"):
    configs.check_fits(deep, 128, jnp.bfloat16, RTX_4060_LAPTOP)


def test_a_config_that_cannot_fit_names_the_budget():
  too_big = configs.PrefillConfig(256, 256, 8, 6)
  with pytest.raises(ValueError, match=r"shared memory.*232448-byte budget.*sm_90"):
    configs.check_fits(too_big, 256, jnp.float32, H200)


def test_no_config_fits_a_tiny_budget():
  tiny = DeviceInfo("toy", (8, 6), 4, 8 * 1024)
  with pytest.raises(ValueError, match="no prefill config fits"):
    configs.prefill_config(256, jnp.float32, tiny)


def test_padded_head_dim():
  assert [configs.padded_head_dim(d) for d in (64, 80, 96, 128, 200, 256)] == [64, 128, 128, 128, 256, 256]


@pytest.mark.parametrize("capacity", [32768, 131072])
def test_split_count_matches_the_article_on_its_laptop(capacity):
  # The article found 8 chunks best for batch 1 and 2 KV heads on 24 SMs at long contexts.
  assert configs.num_splits(1, 2, capacity, RTX_4060_LAPTOP) == 8


def test_split_count_fills_an_h200():
  assert configs.num_splits(1, 2, 131072, H200) == 64  # 128 programs on 132 SMs
  assert configs.num_splits(16, 2, 4096, H200) == 4  # batch already gives 32 programs


def test_split_count_is_small_for_short_caches():
  for info in DEVICES:
    for capacity in (1, 100, 256, 1000, 4096):
      splits = configs.num_splits(1, 2, capacity, info)
      assert 1 <= splits <= max(1, -(-capacity // configs.MIN_CHUNK_TOKENS))
  assert configs.num_splits(64, 8, 131072, H200) == 1  # 512 programs: the batch fills the GPU


# --- compiled on the H200 with other generations' configs: they must be valid programs ---

OTHER_GENERATIONS = [RTX_4060_LAPTOP, A100, RTX_3090]


@pytest.mark.gpu
@pytest.mark.parametrize("info", OTHER_GENERATIONS, ids=lambda d: d.name)
@pytest.mark.parametrize("head_dim,dtype", [(128, jnp.bfloat16), (80, jnp.float16), (256, jnp.bfloat16),
                                            (64, jnp.float32)])
def test_other_generations_configs_compile_and_agree(rng, info, head_dim, dtype):
  b, t, n, k = 2, 300, 6, 2
  q = random_array(rng, (b, t, n, head_dim), dtype)
  kv = [random_array(rng, (b, t, k, head_dim), dtype) for _ in range(2)]
  lengths = jnp.array([t, 173], jnp.int32)
  config = configs.prefill_config(head_dim, dtype, info)
  out = jaxflash.prefill_attention(q, *kv, lengths, lengths, is_causal=True, config=config, interpret=False)
  ref, _ = attention_f64(q, *kv, is_causal=True, q_lengths=lengths, kv_lengths=lengths)
  assert_close(out, ref, dtype)

  cache = [random_array(rng, (b, 1000, k, head_dim), dtype) for _ in range(2)]
  lengths = jnp.array([1000, 517], jnp.int32)
  q1 = q[:, :1]
  splits = configs.num_splits(b, k, 1000, info)
  out = jaxflash.decode_attention(q1, *cache, lengths, num_splits=splits,
                                  config=configs.decode_config(head_dim, dtype, info), interpret=False)
  ref, _ = attention_f64(q1, *cache, kv_lengths=lengths)
  assert_close(out, ref, dtype)

  page = 16
  pages = [random_array(rng, (160, page, k, head_dim), dtype) for _ in range(2)]
  table = jnp.asarray(rng.permutation(160)[: b * 64].reshape(b, 64), jnp.int32)
  out = jaxflash.paged_decode_attention(q1, *pages, lengths, table, num_splits=splits,
                                        config=configs.decode_config(head_dim, dtype, info, paged=True),
                                        interpret=False)
  ref, _ = attention_f64(q1, gather_pages_np(pages[0], table), gather_pages_np(pages[1], table),
                         kv_lengths=lengths)
  assert_close(out, ref, dtype)
