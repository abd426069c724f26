"""Sharded `jaxflash.attention` cases: each kernel on a mesh, against its single-device run.

Needs 4 devices (2 give a subset). On CPU those are forced host devices, which must be
set before JAX starts, so tests/test_sharding.py runs this module in a subprocess:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m tests.sharding_cases prefill

and reads the JSON list it prints last. On a multi-GPU host the same `run` is called
in-process, with the kernels compiled.
"""
from __future__ import annotations

import functools
import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxflash

B, T, S, N, K, H = 4, 8, 32, 8, 4, 16
PAGE_SIZE, NUM_PAGES = 8, 24
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def layouts(num_devices: int, kernel: str):
  """name -> (mesh shape, axis names, batch axis, head axis, kv heads, query heads)."""
  d = num_devices
  out = {
      "heads": ((d,), ("model",), None, "model", K, N),
      "batch": ((d,), ("data",), "data", None, K, N),
      "replicated": ((d,), ("x",), None, None, K, N),
      # More devices than KV heads: KV replicated over the head axis, one KV head a device.
      "heads_kv_replicated": ((d,), ("model",), None, "model", d // 2, N),
  }
  if d >= 4:
    out["both"] = ((2, d // 2), ("data", "model"), "data", "model", K, N)
  if d == 4 and kernel == "prefill":
    # 3 KV heads cannot split over 4 devices: computed replicated, with a warning.
    out["heads_indivisible"] = ((d,), ("model",), None, "model", 3, 12)
  return out


def _prefill(q, k, v, q_len, kv_len):
  return jaxflash.attention(q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                            is_causal=True, return_residual=True)


def _decode(q, k_cache, v_cache, kv_len):
  return jaxflash.attention(q, k_cache, v_cache, key_value_seq_lengths=kv_len,
                            return_residual=True)


def _paged(q, k_pages, v_pages, kv_len, table):
  return jaxflash.attention(q, k_pages, v_pages, key_value_seq_lengths=kv_len,
                            block_table=table, return_residual=True)


def _paged_prefill(q, k_pages, v_pages, kv_len, table, q_len):
  return jaxflash.attention(q, k_pages, v_pages, key_value_seq_lengths=kv_len, block_table=table,
                            query_seq_lengths=q_len, is_causal=True, causal_alignment="bottom_right",
                            return_residual=True)


def _inputs(kernel: str, rng, kv_heads: int, heads: int):
  """(function of the arrays, arrays, role of each: q, kv, pages or seq (per sequence))."""
  def rand(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)
  kv_lengths = jnp.asarray([S, 19, 1, 27], jnp.int32)
  if kernel == "prefill":
    arrays = (rand(B, T, heads, H), rand(B, S, kv_heads, H), rand(B, S, kv_heads, H),
              jnp.asarray([T, 5, 1, 8], jnp.int32), kv_lengths)
    return _prefill, arrays, ("q", "kv", "kv", "seq", "seq")
  if kernel == "decode":
    arrays = (rand(B, 1, heads, H), rand(B, S, kv_heads, H), rand(B, S, kv_heads, H), kv_lengths)
    return _decode, arrays, ("q", "kv", "kv", "seq")
  if kernel == "paged":
    table = rng.permutation(NUM_PAGES)[:B * S // PAGE_SIZE].reshape(B, S // PAGE_SIZE)
    arrays = (rand(B, 1, heads, H), rand(NUM_PAGES, PAGE_SIZE, kv_heads, H),
              rand(NUM_PAGES, PAGE_SIZE, kv_heads, H), kv_lengths, jnp.asarray(table, jnp.int32))
    return _paged, arrays, ("q", "pages", "pages", "seq", "seq")
  if kernel == "paged_prefill":  # a chunk of T_b new tokens, the last of each sequence's keys
    table = rng.permutation(NUM_PAGES)[:B * S // PAGE_SIZE].reshape(B, S // PAGE_SIZE)
    arrays = (rand(B, T, heads, H), rand(NUM_PAGES, PAGE_SIZE, kv_heads, H),
              rand(NUM_PAGES, PAGE_SIZE, kv_heads, H), kv_lengths, jnp.asarray(table, jnp.int32),
              jnp.asarray([T, 5, 1, 8], jnp.int32))
    return _paged_prefill, arrays, ("q", "pages", "pages", "seq", "seq", "seq")
  raise ValueError(f"unknown kernel {kernel!r}")


def _spec(role: str, ndim: int, batch_axis, head_axis, kv_split: bool):
  kv_axis = head_axis if kv_split else None
  spec = {"q": (batch_axis, None, head_axis, None), "kv": (batch_axis, None, kv_axis, None),
          "pages": (None, None, kv_axis, None), "seq": (batch_axis, None)}[role]
  return P(*spec[:ndim])


def _padded(spec, ndim: int):
  spec = tuple(spec) + (None,) * (ndim - len(spec))
  return [list(a) if isinstance(a, tuple) else a for a in spec]


def run(kernel: str, devices=None, seed: int = 0):
  """Runs every layout for `kernel`; returns one dict of facts per layout."""
  devices = jax.devices() if devices is None else devices
  results = []
  single_device = {}  # one jit a kernel: layouts of the same shapes share its compilation
  for name, (shape, axis_names, batch_axis, head_axis, kv_heads, heads) in layouts(
      len(devices), kernel).items():
    rng = np.random.default_rng(seed)
    fn, arrays, roles = _inputs(kernel, rng, kv_heads, heads)
    mesh = Mesh(np.asarray(devices).reshape(shape), axis_names)
    mesh_heads = mesh.shape[head_axis] if head_axis else 1
    kv_split = kv_heads % mesh_heads == 0
    placed = [jax.device_put(x, NamedSharding(mesh, _spec(r, x.ndim, batch_axis, head_axis, kv_split)))
              for x, r in zip(arrays, roles)]
    reference = single_device.setdefault(fn, jax.jit(fn))
    expected = reference(*(jax.device_put(x, devices[0]) for x in arrays))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      compiled = jax.jit(fn).lower(*placed).compile()
    out, lse = compiled(*placed)
    text = compiled.as_text()
    split_heads = head_axis if heads % mesh_heads == 0 and (kv_split or mesh_heads % kv_heads == 0) else None
    finite = np.isfinite(np.asarray(expected[1]))
    results.append(dict(
        layout=name,
        out_spec=_padded(out.sharding.spec, 4), lse_spec=_padded(lse.sharding.spec, 3),
        want_out_spec=_padded((batch_axis, None, split_heads, None), 4),
        want_lse_spec=_padded((batch_axis, None, split_heads), 3),
        collectives=sorted({c for c in COLLECTIVES if c in text}),
        out_err=float(np.abs(np.asarray(out) - np.asarray(expected[0])).max()),
        lse_err=float(np.abs(np.asarray(lse)[finite] - np.asarray(expected[1])[finite]).max()),
        out_nan=bool(np.isnan(np.asarray(out)).any()),
        lse_inf_same=bool((np.isfinite(np.asarray(lse)) == finite).all()),
        warnings=[str(w.message) for w in caught if "jaxflash" in str(w.message)]))
  return results


def vmap_error(seed: int = 0) -> float:
  """jax.vmap over decode on a multi-device host (custom_partitioning has no batching rule;
  sharding.py supplies one): largest difference from the plain-XLA path."""
  rng = np.random.default_rng(seed)
  _, (q, k, v, kv_len), _ = _inputs("decode", rng, K, N)
  stack = lambda x: jnp.stack([x, x[::-1]])  # a vmapped axis of 2
  out, lse = jax.jit(jax.vmap(_decode))(stack(q), stack(k), stack(v), stack(kv_len))
  want, want_lse = jax.vmap(functools.partial(jaxflash.attention, return_residual=True,
                                              implementation="xla"))(
      stack(q), stack(k), stack(v), key_value_seq_lengths=stack(kv_len))
  return float(max(np.abs(np.asarray(out) - np.asarray(want)).max(),
                   np.nanmax(np.abs(np.asarray(lse) - np.asarray(want_lse)))))


def _prefill_projected_kv(q, kv_projected, q_len, kv_len):
  k = kv_projected.reshape(*kv_projected.shape[:2], -1, H)  # [B, S, K * H] -> [B, S, K, H]
  return _prefill(q, k, k + 1.0, q_len, kv_len)


def projected_kv_case(devices=None, seed: int = 0):
  """Keys reshaped from a [B, S, K * H] projection split over more devices than K: each
  mesh position holds part of a KV head, which no PartitionSpec expresses. The call must
  still run (XLA reshards), with the query's head split kept."""
  devices = jax.devices() if devices is None else devices
  mesh = Mesh(np.asarray(devices), ("model",))
  rng = np.random.default_rng(seed)
  _, (q, k, _, q_len, kv_len), _ = _inputs("prefill", rng, len(devices) // 2, N)
  arrays = (q, k.reshape(B, S, -1), q_len, kv_len)
  specs = (P(None, None, "model"), P(None, None, "model"), P(), P())
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]
  out, lse = jax.jit(_prefill_projected_kv)(*placed)
  want, _ = jax.jit(_prefill_projected_kv)(*(jax.device_put(x, devices[0]) for x in arrays))
  return dict(out_spec=_padded(out.sharding.spec, 4),
              out_err=float(np.abs(np.asarray(out) - np.asarray(want)).max()))


def _prefill_options(q, k, v, q_len, kv_len, bias, mask, sinks, scale):
  return jaxflash.attention(q, k, v, bias, mask, query_seq_lengths=q_len,
                            key_value_seq_lengths=kv_len, is_causal=True, local_window_size=(5, 0),
                            sinks=sinks, scale=scale, logits_soft_cap=4.0, return_residual=True)


def options_case(devices=None, seed: int = 0):
  """Prefill with every option on a (data, model) mesh: a bias broadcast over the batch, a
  mask over heads and queries, sinks split with the heads, a traced scale. The results
  must equal one device's, keep the batch and head splits, with no collective."""
  devices = jax.devices() if devices is None else devices
  d = len(devices)
  shape, names = ((2, d // 2), ("data", "model")) if d >= 4 else ((1, d), ("data", "model"))
  mesh = Mesh(np.asarray(devices).reshape(shape), names)
  rng = np.random.default_rng(seed)
  _, (q, k, v, q_len, kv_len), _ = _inputs("prefill", rng, K, N)
  bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)
  mask = jnp.asarray(rng.random((B, 1, 1, S)) < 0.8)
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
  scale = jnp.float32(0.3)
  arrays = (q, k, v, q_len, kv_len, bias, mask, sinks, scale)
  specs = (P("data", None, "model"), P("data", None, "model"), P("data", None, "model"),
           P("data"), P("data"), P(None, "model"), P("data"), P("model"), P())
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(arrays, specs)]
  compiled = jax.jit(_prefill_options).lower(*placed).compile()
  out, lse = compiled(*placed)
  want, want_lse = jax.jit(_prefill_options)(*(jax.device_put(x, devices[0]) for x in arrays))
  text = compiled.as_text()
  finite = np.isfinite(np.asarray(want_lse))
  return dict(out_spec=_padded(out.sharding.spec, 4),
              collectives=sorted({c for c in COLLECTIVES if c in text}),
              out_err=float(np.abs(np.asarray(out) - np.asarray(want)).max()),
              lse_err=float(np.abs(np.asarray(lse)[finite] - np.asarray(want_lse)[finite]).max()))


def shard_map_case(kernel: str, devices=None, seed: int = 0):
  """jaxflash.attention inside jax.shard_map (check_vma on, its default), batch split over
  the devices: each runs the kernel on its shard; the result equals one device's."""
  devices = jax.devices() if devices is None else devices
  mesh = Mesh(np.asarray(devices), ("data",))
  rng = np.random.default_rng(seed)
  fn, arrays, roles = _inputs(kernel, rng, K, N)
  specs = tuple(P() if role == "pages" else P("data") for role in roles)
  mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(P("data"), P("data"))))
  out, lse = mapped(*arrays)
  want, want_lse = jax.jit(fn)(*(jax.device_put(x, devices[0]) for x in arrays))
  finite = np.isfinite(np.asarray(want_lse))
  return dict(out_err=float(np.abs(np.asarray(out) - np.asarray(want)).max()),
              lse_err=float(np.abs(np.asarray(lse)[finite] - np.asarray(want_lse)[finite]).max()))


if __name__ == "__main__":
  kernel = sys.argv[1]
  print(json.dumps({"layouts": run(kernel),
                    "vmap_error": vmap_error() if kernel == "decode" else None,
                    "projected_kv": projected_kv_case() if kernel == "prefill" else None,
                    "options": options_case() if kernel == "prefill" else None,
                    "shard_map": shard_map_case(kernel)}))
