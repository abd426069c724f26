"""Decode attention: GB/s of KV cache read, jaxflash against cuDNN, XLA, textbook attention
and JAX's Pallas decode / paged kernels.

The method of "Writing an Attention Kernel: FlashAttention and Decode in Triton": one
compiled function runs the attention of L "layers", each with its own cache, at least 512 MiB
in all, so every call reads cold from DRAM (a 4 MB cache would otherwise sit in the 60 MB L2)
and no launch gaps count; time per call = device time / L.
A compiled function holds at most MAX_SITES layers; past that it rotates between several
sets of caches (bench.timing.ArgSets), which keeps every read cold. Bytes = the K and V
actually read: valid length x KV heads x head dim x 2 bytes x 2. The ceiling is an XLA
reduction over 4 GiB measured in the same run.

Rows: batch 1 at 1K, 4K, 16K, 32K, 128K and batch 16 at 4K (12 query heads, 2 KV heads,
d = 128, bf16, lengths = capacity). Sweeps: Flash-Decoding's chunk count (B=1 at 1K,
4K, 32K and 128K) and the paged kernel's tile and pipeline depth (B=1, 32K, pages of 16).

  python -m bench.decode [--quick] [--no-sweep] [--out DIR]    # GPU, <= ~7 min on an H200
  python -m bench.decode --smoke                               # tiny CPU run, interpret mode
  python -m bench.decode --kv-dtypes int8,float8_e4m3fn        # + int8 / FP8 cache rows

Quantized rows (--kv-dtypes): the same caches through jaxflash.quantize_kv, read by the same
kernels; GB/s of the bytes actually read (one byte a value plus the float32 scale per token
and KV head) and tokens/s against the bf16 cache at the same context (bf16 time / quantized time).
"""
from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.cli import TimeLimit, begin_run, bench_arguments, log
from bench.report import format_value, markdown_table, value_with_pct, write_results
from bench.timing import ArgSets, MAX_ITERS, Timing, device_times_us, free_memory, has_gpu, try_call

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128
DTYPE = jnp.bfloat16
MIB = 2**20
IMPLS = ("jaxflash", "jaxflash_paged16", "jaxflash_paged256", "cudnn", "xla", "naive",
         "pallas_gqa", "pallas_paged16", "pallas_paged256")
LABELS = {"jaxflash": "jaxflash", "jaxflash_paged16": "jaxflash paged 16",
          "jaxflash_paged256": "jaxflash paged 256", "cudnn": "cuDNN (jax.nn)", "xla": "jax.nn xla",
          "naive": "naive einsum", "pallas_gqa": "JAX Pallas gqa", "pallas_paged16": "JAX Pallas paged 16",
          "pallas_paged256": "JAX Pallas paged 256"}
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
PAGED_SWEEP = {"block_k": (16, 32, 64), "num_warps": (4,), "num_stages": (2, 3, 4, 5, 6)}


# ----------------------------------------------------------------------------- one layer's attention
# Contiguous: (q [B, 1, N, H], k, v [B, S, K, H], lengths [B]) -> [B, 1, N, H] (or [B, N, H]).
# Paged: (q, k_pages, v_pages [P, page, K, H], lengths, block_table [B, S / page]).

def jaxflash_decode(num_splits=None):
  def run(q, k, v, lengths):
    from jaxflash.decode import decode_attention  # here: an import error is one cell's error
    return decode_attention(q, k, v, lengths, num_splits=num_splits)
  return run


def jaxflash_paged(tiles=None):
  """tiles: None (the tuned config) or (block_k, num_warps, num_stages)."""
  def run(q, k_pages, v_pages, lengths, table):
    from jaxflash.configs import DecodeConfig
    from jaxflash.paged import paged_decode_attention
    config = None if tiles is None else DecodeConfig(*tiles)
    return paged_decode_attention(q, k_pages, v_pages, lengths, table, config=config)
  return run


def cudnn_decode(q, k, v, lengths):
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")


def xla_decode(q, k, v, lengths):
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")


def naive_decode(q, k, v, lengths):
  """Hugging Face eager attention for one token (matmul, softmax, matmul): K/V repeated to
  every query head, bf16 scores, fp32 softmax. Lengths = capacity here, so no mask."""
  del lengths
  group = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, group, axis=2)  # [B, S, N, H]
  v = jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) * (q.shape[-1] ** -0.5)  # [B, N, 1, S] bf16
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
  return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _pallas_ops():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention
  return decode_attention, paged_attention


def pallas_gqa(q, k, v, lengths):
  """JAX's Pallas split-K decode (defaults: 16 splits, 128-key blocks). It transposes the
  cache to head-major inside the call: that copy counts, as a user pays it."""
  decode_attention, _ = _pallas_ops()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return decode_attention.gqa(q[:, 0], k, v, kv_seq_len=lengths, sm_scale=q.shape[-1] ** -0.5,
                                interpret=not has_gpu())


def pallas_paged(q, k_pages, v_pages, lengths, table):
  """JAX's Pallas paged attention. Its pool is head-major [K, P, page, H]: the conversion
  from the [P, page, K, H] pool counts in its time, and it takes no softmax scale (the
  caller scales q). Splits: 16 (fewer when a sequence has fewer pages); compute blocks of
  8 pages of 16 (128 tokens), one page when pages are larger."""
  _, paged_attention = _pallas_ops()
  pages_per_seq, page = table.shape[1], k_pages.shape[1]
  k_splits = min(16, pages_per_seq)
  per_block = max(1, min(pages_per_seq // k_splits, 128 // page))
  k_heads = jnp.transpose(k_pages, (2, 0, 1, 3))  # [K, P, page, H]
  v_heads = jnp.transpose(v_pages, (2, 0, 1, 3))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return paged_attention.paged_attention(
        q[:, 0] * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k_heads, v_heads, table, lengths,
        k_splits=k_splits,
        pages_per_compute_block=per_block, interpret=not has_gpu())


def jaxflash_quantized(paged: bool):
  """jaxflash's decode over a quantized cache: k, v are (values, scales) pairs."""
  def run(q, k, v, lengths, *table):
    from jaxflash.decode import decode_attention
    from jaxflash.paged import paged_decode_attention
    kernel = paged_decode_attention if paged else decode_attention
    return kernel(q, k[0], v[0], lengths, *table, k_scale=k[1], v_scale=v[1])
  return run


def quantized_bytes(batch: int, length: int, kv_dtype) -> int:
  """K and V bytes a quantized decode call reads: the values and their float32 scales."""
  per_token = NUM_KV_HEADS * (HEAD_DIM * jnp.dtype(kv_dtype).itemsize + 4)
  return batch * length * per_token * 2


def bench_quantized(row, kv_dtypes, layer_sets, lengths, table, ceiling_gbs, limit, ref):
  """Rows of jaxflash over int8 / FP8 caches (the same caches quantized), contiguous and
  through `table` with pages of 16: GB/s of the bytes read and tokens/s over bf16's."""
  import jaxflash
  sites = len(layer_sets[0])
  batch, capacity = row["batch"], row["context"]
  for kv_dtype in kv_dtypes:
    name = jnp.dtype(kv_dtype).name
    quantize = jax.jit(lambda x, d=kv_dtype: jaxflash.quantize_kv(x, d))
    sets = [[(q, quantize(k), quantize(v)) for q, k, v in ls] for ls in layer_sets]
    nbytes = quantized_bytes(batch, capacity, kv_dtype)
    group = {f"jaxflash_{name}": (jaxflash_quantized(False), sets, (lengths,))}
    if table is not None:
      paged = [[(q, *(tuple(to_pages(x, table, 16) for x in pair) for pair in (k, v))) for q, k, v in ls]
               for ls in sets]
      group[f"jaxflash_paged16_{name}"] = (jaxflash_quantized(True), paged, (lengths, jnp.asarray(table)))
    for label, (attention, arg_sets, shared) in group.items():
      timing = time_group({label: attention}, arg_sets, shared, limit, row).get(label)
      record(row, label, timing, sites, nbytes, ceiling_gbs)
      base = row.get(f"{label.replace('_' + name, '')}_us")
      us = row.get(f"{label}_us")
      row[f"{label}_tokens_over_bf16"] = base / us if base and us else None
      if isinstance(timing, Timing):
        row["max_abs_error"][label] = max_error(timing, ref)
    del sets, group
    free_memory()


def over_layers(attention):
  """One compiled function over L layers: attention on each layer's own cache, in order."""
  def run(qs, ks, vs, *shared):
    return [attention(q, k, v, *shared) for q, k, v in zip(qs, ks, vs)]
  return run


# ----------------------------------------------------------------------------- caches

def layer_plan(batch: int, capacity: int, min_bytes: int, max_sites: int):
  """(layers per compiled call, argument sets): layers x sets x cache bytes >= min_bytes."""
  per_layer = cache_bytes(batch, capacity)
  layers = max(1, math.ceil(min_bytes / per_layer))
  sites = min(layers, max_sites)
  return sites, math.ceil(layers / sites)


def cache_bytes(batch: int, length: int) -> int:
  """K and V bytes one decode call reads: length x KV heads x head dim x 2 bytes x 2."""
  return batch * length * NUM_KV_HEADS * HEAD_DIM * 2 * 2


def make_layers(batch: int, capacity: int, count: int, seed: int, *, heads: int = NUM_HEADS,
                kv_heads: int = NUM_KV_HEADS):
  """`count` layers of (q [B, 1, N, H], k, v [B, S, K, H]) random bf16, each its own arrays
  (so a call over them reads cold caches)."""
  @jax.jit
  def one(key):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (batch, 1, heads, HEAD_DIM), DTYPE),
            jax.random.normal(kk, (batch, capacity, kv_heads, HEAD_DIM), DTYPE),
            jax.random.normal(kv, (batch, capacity, kv_heads, HEAD_DIM), DTYPE))
  keys = jax.random.split(jax.random.key(seed), count)
  return [one(keys[i]) for i in range(count)]


def random_block_table(batch: int, pages_per_seq: int, seed: int = 0) -> np.ndarray:
  """Every page of the pool used once, scattered at random (vLLM-style allocation)."""
  perm = np.random.default_rng(seed).permutation(batch * pages_per_seq).astype(np.int32)
  return perm.reshape(batch, pages_per_seq)


def to_pages(cache, table: np.ndarray, page: int):
  """[B, S, K, H] cache -> [B * S / page, page, K, H] pool with pool[table[b, j]] holding
  tokens j * page ... of sequence b, so gathering the pool through `table` gives the cache."""
  b, s, *rest = cache.shape  # rest: [K, H], or [K] for a quantized cache's scales
  inverse = np.argsort(table.reshape(-1))
  return cache.reshape(b * (s // page), page, *rest)[jnp.asarray(inverse)]


# ----------------------------------------------------------------------------- one row

def reference_layer0(layer, lengths):
  """Layer 0's answer in float32 (full-precision matmuls) on the same bf16 inputs."""
  q, k, v = layer
  with jax.default_matmul_precision("highest"):
    return jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        key_value_seq_lengths=n, implementation="xla"))(q, k, v, lengths)


def max_error(timing, ref) -> float | None:
  """Max abs error of layer 0 (first argument set) against the float32 reference."""
  outputs = getattr(timing, "output", None)
  if not outputs:
    return None
  return float(jnp.max(jnp.abs(outputs[0].reshape(ref.shape).astype(jnp.float32) - ref)))


def time_group(name_to_attention: dict, layer_sets, shared, limit, row) -> dict:
  """Times each attention as one compiled call over a set of layers, rotating between the
  sets, under one profiler trace: {name: Timing (per call of all its layers) or error}."""
  sets = ArgSets([(tuple(l[0] for l in ls), tuple(l[1] for l in ls), tuple(l[2] for l in ls),
                   *shared) for ls in layer_sets])
  cases = {}
  for name, attention in name_to_attention.items():
    if limit.exhausted():
      row["errors"][name] = "skipped: time limit"
      continue
    cases[name] = (over_layers(attention), sets)
  # Each call already averages over its layers: a few calls suffice, and keep the trace small.
  max_iters = max(3, min(MAX_ITERS, 512 // len(layer_sets[0])))
  return device_times_us(cases, max_iters=max_iters, keep_output=True, log=log)


def record(row, name: str, timing, sites: int, nbytes: int, ceiling_gbs, kernel_pattern=None):
  if isinstance(timing, dict):
    row["errors"][name] = timing["error"]
  if not isinstance(timing, Timing):
    row[f"{name}_gbs"] = None
    return None
  us = timing.us / sites
  row[f"{name}_us"] = us
  row[f"{name}_gbs"] = nbytes / (us * 1e-6) / 1e9
  row[f"{name}_pct"] = 100 * row[f"{name}_gbs"] / ceiling_gbs if ceiling_gbs else None
  row["kernels"][name] = {
      "us_per_layer": us, "launches_per_layer": timing.launches / sites, "iters": timing.iters,
      "method": timing.method, "temp_bytes": timing.temp_bytes,
      "kernels_us_per_layer": {k: v / sites for k, v in list(timing.kernels.items())[:8]}}
  row["method"] = timing.method
  if kernel_pattern and timing.kernels:
    kernel_us = timing.kernel_us(kernel_pattern) / sites
    row[f"{name}_kernel_gbs"] = nbytes / (kernel_us * 1e-6) / 1e9 if kernel_us else None
  return row[f"{name}_gbs"]


def bench_row(batch: int, capacity: int, plan, ceiling_gbs, limit, sweeps: dict,
              kv_dtypes=()) -> tuple[dict, list, list]:
  sites, nsets = plan
  nbytes = cache_bytes(batch, capacity)
  row = {"batch": batch, "context": capacity, "layers": sites * nsets, "layers_per_call": sites,
         "arg_sets": nsets, "cache_mib_total": sites * nsets * nbytes / MIB, "bytes_per_call": nbytes,
         "errors": {}, "kernels": {}, "max_abs_error": {}}
  split_rows, stage_rows = [], []
  layers = make_layers(batch, capacity, sites * nsets, seed=capacity + batch)
  layer_sets = [layers[i * sites:(i + 1) * sites] for i in range(nsets)]
  lengths = jnp.full((batch,), capacity, jnp.int32)
  ref = reference_layer0(layers[0], lengths)

  # Contiguous caches: jaxflash, the jax.nn paths, textbook attention, JAX's Pallas gqa.
  contiguous = {"jaxflash": jaxflash_decode(), "cudnn": cudnn_decode, "xla": xla_decode,
                "naive": naive_decode, "pallas_gqa": pallas_gqa}
  for s in sweeps.get("splits", ()):
    contiguous[f"splits{s}"] = jaxflash_decode(num_splits=s)
  timings = time_group(contiguous, layer_sets, (lengths,), limit, row)
  for name in contiguous:
    pattern = "mha_forward" if name == "pallas_gqa" else None
    gbs = record(row, name, timings.get(name), sites, nbytes, ceiling_gbs, pattern)
    if name.startswith("splits"):
      split_rows.append({"batch": batch, "context": capacity, "num_splits": int(name[6:]), "gbs": gbs,
                         "pct": row.get(f"{name}_pct"), "us": row.get(f"{name}_us"),
                         "error": row["errors"].get(name)})
    elif isinstance(timings.get(name), Timing):
      row["max_abs_error"][name] = max_error(timings[name], ref)

  # Paged pools built from the same caches through a random block table, one page size at a time.
  for page in (16, 256):
    if capacity % page:
      for name in (f"jaxflash_paged{page}", f"pallas_paged{page}"):
        row["errors"][name] = f"skipped: context {capacity} is not a multiple of the page size"
      continue
    table = random_block_table(batch, capacity // page, seed=page)
    table_j = jnp.asarray(table)
    paged_sets = [[(q, to_pages(k, table, page), to_pages(v, table, page)) for q, k, v in ls]
                  for ls in layer_sets]
    group = {f"jaxflash_paged{page}": jaxflash_paged(), f"pallas_paged{page}": pallas_paged}
    configs = {}
    if page == 16:
      for bk, warps, stages in sweeps.get("paged_configs", ()):
        configs[f"paged_bk{bk}_w{warps}_s{stages}"] = (bk, warps, stages)
        group[f"paged_bk{bk}_w{warps}_s{stages}"] = jaxflash_paged((bk, warps, stages))
    timings = time_group(group, paged_sets, (lengths, table_j), limit, row)
    for name in group:
      pattern = "paged_attention" if name.startswith("pallas") else None
      gbs = record(row, name, timings.get(name), sites, nbytes, ceiling_gbs, pattern)
      if name in configs:
        bk, warps, stages = configs[name]
        stage_rows.append({"batch": batch, "context": capacity, "page": page, "block_k": bk,
                           "num_warps": warps, "num_stages": stages, "gbs": gbs,
                           "pct": row.get(f"{name}_pct"), "us": row.get(f"{name}_us"),
                           "error": row["errors"].get(name)})
      elif isinstance(timings.get(name), Timing):
        row["max_abs_error"][name] = max_error(timings[name], ref)
    del paged_sets, timings
    free_memory()
  if kv_dtypes:
    table16 = random_block_table(batch, capacity // 16, seed=16) if capacity % 16 == 0 else None
    bench_quantized(row, kv_dtypes, layer_sets, lengths, table16, ceiling_gbs, limit, ref)

  jf = row.get("jaxflash_gbs")
  for key, num, den in (("jf_over_cudnn", jf, row.get("cudnn_gbs")),
                        ("paged16_over_contiguous", row.get("jaxflash_paged16_gbs"), jf),
                        ("paged256_over_contiguous", row.get("jaxflash_paged256_gbs"), jf)):
    row[key] = num / den if num and den else None
  for name in list(row):  # sweep cells live in their own tables
    if name.startswith(("splits", "paged_bk")):
      row.pop(name)
  row["kernels"] = {k: v for k, v in row["kernels"].items() if not k.startswith(("splits", "paged_bk"))}
  del layers, layer_sets, ref
  free_memory()
  return row, split_rows, stage_rows


# ----------------------------------------------------------------------------- script

def write_sweeps(split_rows: list, stage_rows: list, meta: dict, ceiling, stage_context: int, out_dir):
  """The chunk-count and paged-stages sweeps as tables and plots of their own."""
  sub_meta = {k: v for k, v in meta.items() if k != "notes_header"}
  if split_rows:
    split_rows = sorted(split_rows, key=lambda r: (r["context"], r["num_splits"]))
    write_results(
        "decode_splits", split_rows, {**sub_meta, "title": "Flash-Decoding chunk count, jaxflash contiguous, B=1"},
        [("context", "context"), ("num_splits", "num_splits"), ("gbs", "GB/s"), ("pct", "% of HBM"),
         ("us", "us / call"), ("error", "error", lambda e: e[:80])],
        plot={"x": "num_splits", "y": "gbs", "series": "context", "logx": True, "xlabel": "num_splits",
              "ylabel": "GB/s", "title": "jaxflash decode: chunks per sequence, B=1",
              "hline": (ceiling, "HBM read ceiling")}, out_dir=out_dir)
  if stage_rows:
    write_results(
        "decode_paged_stages", stage_rows,
        {**sub_meta, "title": f"Paged decode tiles and pipeline stages, B=1, {stage_context} tokens, pages of 16"},
        [("block_k", "block_k"), ("num_warps", "warps"), ("num_stages", "stages"), ("gbs", "GB/s"),
         ("pct", "% of HBM"), ("us", "us / call"), ("error", "error", lambda e: e[:80])],
        plot={"x": "num_stages", "y": "gbs", "series": "block_k", "xlabel": "num_stages", "ylabel": "GB/s",
              "labels": {bk: f"block_k {bk}" for bk in PAGED_SWEEP["block_k"]},
              "title": "jaxflash paged decode (page 16): stages", "hline": (ceiling, "HBM read ceiling")},
        out_dir=out_dir)


def parse_args(argv=None):
  p = bench_arguments(__doc__, smoke="tiny CPU run end to end (interpret mode)", time_limit_s=360.0,
                      quick="fewer rows", sweep=True)
  p.add_argument("--min-mib", type=float, default=512.0, help="caches per row, MiB (cold reads)")
  p.add_argument("--rows", default=None, help="comma-separated BxCONTEXT subset, e.g. 1x1024,1x4096")
  p.add_argument("--kv-dtypes", default="",
                 help="comma-separated quantized cache dtypes to add rows for: int8, float8_e4m3fn")
  p.add_argument("--max-sites", type=int, default=64,
                 help="layers per compiled call (more rotate between argument sets)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  limit = TimeLimit(args.time_limit_s)
  if args.smoke:
    rows_spec = [(1, 512), (2, 256)]
    split_contexts, stage_context = (512,), 512
    splits, paged_configs = (1, 2, 4), [(16, 4, 2), (32, 4, 3)]
    min_bytes, max_sites = 2 * MIB, 2
    ceiling_args = dict(matmul_n=256, hbm_gib=1 / 64)
  else:
    rows_spec = ([(1, 4096), (1, 32768), (16, 4096)] if args.quick else
                 [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 131072), (16, 4096)])
    split_contexts = (32768,) if args.quick else (1024, 4096, 32768, 131072)
    stage_context = 32768
    splits = SPLITS
    paged_configs = list(itertools.product(*PAGED_SWEEP.values()))
    min_bytes, max_sites = int(args.min_mib * MIB), args.max_sites
    ceiling_args = dict(matmul_n=8192, hbm_gib=4.0)
  if args.rows:
    rows_spec = [tuple(int(n) for n in spec.split("x")) for spec in args.rows.split(",")]
  kv_dtypes = tuple(jnp.dtype(name) for name in args.kv_dtypes.split(",") if name)
  meta, out_dir = begin_run("decode", args, **ceiling_args)
  ceiling = meta["ceilings"].get("hbm_read_gbs")
  meta.update(
      title="Decode attention: GB/s of K+V read on device time",
      shapes=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
                  query_tokens=1, lengths="= capacity"),
      method=(f"one compiled call over L layers, each with its own cache, >= {min_bytes / MIB:.0f} MiB in all "
              f"(at most {max_sites} layers per call, rotating between argument sets beyond); "
              "time per attention = device time / layers per call"),
      bytes="K + V read: valid length x KV heads x head dim x 2 bytes x 2")
  meta["notes_header"] = [
      f"GB/s of K+V read per call (% of the HBM read ceiling above). Caches >= {min_bytes / MIB:.0f} MiB "
      "per row (L layers, each its own cache) so every read is cold.",
      "JAX Pallas gqa / paged: their cache layout conversion (transpose to head-major) counts in their "
      "time, as a user pays it; the kernel alone is in the JSON (*_kernel_gbs).",
      "Paged: every page of the pool used once, block table randomly permuted.",
  ]

  rows, split_rows, stage_rows, notes = [], [], [], []
  for batch, capacity in rows_spec:
    if limit.exhausted():
      notes.append(f"B={batch} context={capacity}: skipped (time limit)")
      continue
    plan = layer_plan(batch, capacity, min_bytes, max_sites)
    sweeps = {}
    if args.sweep and batch == 1 and capacity in split_contexts:
      sweeps["splits"] = splits
    if args.sweep and batch == 1 and capacity == stage_context:
      sweeps["paged_configs"] = paged_configs
    log(f"[{limit.elapsed():6.1f}s] B={batch} context={capacity}: {plan[0]} layers x {plan[1]} sets, "
        f"{plan[0] * plan[1] * cache_bytes(batch, capacity) / MIB:.0f} MiB")
    got, err = try_call(bench_row, batch, capacity, plan, ceiling, limit, sweeps, kv_dtypes)
    if err:
      notes.append(f"B={batch} context={capacity}: row failed: {err[:300]}")
      log(f"  row failed: {err}")
      continue
    row, srows, prow = got
    rows.append(row)
    split_rows += srows
    stage_rows += prow
    for name, err in row["errors"].items():
      notes.append(f"B={batch} context={capacity} {LABELS.get(name, name)}: {err[:300]}")
    for name, e in row["max_abs_error"].items():
      if not isinstance(e, float) or e > 0.05:
        notes.append(f"B={batch} context={capacity} {LABELS.get(name, name)}: max abs error vs float32 = {e}")
    log("  " + ", ".join(f"{name} {format_value(row.get(f'{name}_gbs'))}" for name in IMPLS))
    write_results("decode", rows, meta, main_columns(kv_dtypes), out_dir=out_dir, notes=notes,
                  extra={"splits_sweep": split_rows, "paged_stages_sweep": stage_rows})

  plot = {"x": "context", "y": [f"{n}_gbs" for n in IMPLS], "logx": True,
          "labels": {f"{n}_gbs": LABELS[n] for n in IMPLS}, "where": lambda r: r["batch"] == 1,
          "xlabel": "context (batch 1)", "ylabel": "GB/s of K+V (device time)",
          "title": "Decode, 12 q heads / 2 kv heads, d=128, bf16", "hline": (ceiling, "HBM read ceiling")}
  paths = write_results("decode", rows, meta, main_columns(kv_dtypes), plot=plot, out_dir=out_dir,
                        notes=notes,
                        extra={"splits_sweep": split_rows, "paged_stages_sweep": stage_rows})
  write_sweeps(split_rows, stage_rows, meta, ceiling, stage_context, out_dir)

  log(f"\n[{limit.elapsed():6.1f}s] results in {Path(paths['json']).parent}")
  log(f"HBM read ceiling {format_value(ceiling)} GB/s; timing: {meta['timing']}")
  if split_rows:
    for ctx in sorted({r["context"] for r in split_rows}):
      got = [r for r in split_rows if r["context"] == ctx and r.get("gbs")]
      if got:
        best = max(got, key=lambda r: r["gbs"])
        log(f"splits sweep {ctx}: best {best['num_splits']} chunks, {best['gbs']:.0f} GB/s")
  if stage_rows:
    got = [r for r in stage_rows if r.get("gbs")]
    if got:
      best = max(got, key=lambda r: r["gbs"])
      log(f"paged stages sweep: best block_k {best['block_k']} stages {best['num_stages']}, {best['gbs']:.0f} GB/s")
  log(markdown_table(rows, [("batch", "B"), ("context", "ctx")] + [
      (f"{n}_gbs", n.replace("jaxflash", "jf").replace("pallas", "pl")) for n in IMPLS]))


def main_columns(kv_dtypes=()):
  cols = [("batch", "B"), ("context", "context"), ("layers", "L")]
  cols += [(lambda r, n=n: value_with_pct(r, f"{n}_gbs", f"{n}_pct"), LABELS[n]) for n in IMPLS]
  cols += [("jf_over_cudnn", "jaxflash / cuDNN", "{:.2f}"),
           ("paged16_over_contiguous", "paged 16 / contiguous", "{:.3f}")]
  for kv_dtype in kv_dtypes:  # GB/s of the bytes read, and tokens/s over the bf16 cache's
    for prefix, label in (("jaxflash", "jaxflash"), ("jaxflash_paged16", "paged 16")):
      n = f"{prefix}_{jnp.dtype(kv_dtype).name}"
      title = f"{label} {jnp.dtype(kv_dtype).name}"
      cols += [(lambda r, n=n: value_with_pct(r, f"{n}_gbs", f"{n}_pct"), title),
               (f"{n}_tokens_over_bf16", f"{title} tokens/s / bf16", "{:.2f}")]
  return cols


if __name__ == "__main__":
  main()
