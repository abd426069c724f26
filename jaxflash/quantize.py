"""Quantized KV caches: int8 or FP8 (e4m3) values with one float32 scale per token and KV head.

Decode reads the whole cache once per token, so at long context its time is the cache's
bytes: a one-byte cache halves them against bf16 (FlashAttention-3 and FlashInfer read FP8
caches; vLLM serves them). Each [H] row of a cache is quantized symmetrically by its
absolute maximum, x ~ x_q * scale (per-token scales follow the key and value rows as they are
written, so a cache is never re-quantized); the kernels dequantize a tile right after
loading it and accumulate in float32.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxflash._types import Array, DTypeLike

QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
# The largest magnitude each type holds: an absmax row maps onto [-qmax, qmax].
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized(x) -> bool:
  """True for an array (or dtype) of a quantized cache type, int8 or float8_e4m3fn."""
  dtype = getattr(x, "dtype", x)
  try:
    return jnp.dtype(dtype) in _QMAX
  except TypeError:
    return False


def quantized_dtype(dtype) -> jnp.dtype:
  """dtype (jnp.int8, jnp.float8_e4m3fn or their names) as a numpy dtype, or ValueError."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in _QMAX:
    raise ValueError(f"dtype must be jnp.int8 or jnp.float8_e4m3fn, got {dtype!r}")
  return dtype


def quantize_kv(x: Array, dtype: DTypeLike) -> tuple[Array, Array]:
  """x [..., H] float -> (x_q [..., H] of `dtype`, scale [...] float32), x ~ x_q * scale[..., None].

  Symmetric absmax quantization per row of H (per token and KV head for a [B, S, K, H]
  cache): scale = max|x| / qmax (127 for int8, 448 for float8_e4m3fn). int8 rounds to the
  nearest step, so |x - x_q * scale| <= scale / 2; e4m3 rounds to 3 mantissa bits, a
  relative error of at most 2^-4 (plus 2^-10 * scale for values in its subnormal range).
  A row of zeros gets scale 0 and zeros; a row holding NaN gets a NaN scale, so it
  dequantizes to NaN (NaN in, NaN out).
  """
  dtype = quantized_dtype(dtype)
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be a float array, got {getattr(x, 'dtype', type(x).__name__)}")
  if x.ndim < 1:
    raise ValueError(f"x must have a last (head) axis to quantize over, got shape {tuple(x.shape)}")
  qmax = _QMAX[dtype]
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1) / qmax  # [...]; NaN when the row holds NaN
  divisor = jnp.where(scale > 0.0, scale, 1.0)[..., None]  # zero (and NaN) rows divide by 1
  scaled = jnp.clip(x32 / divisor, -qmax, qmax)  # e4m3 has no inf: values past 448 would be NaN
  if dtype == jnp.int8:
    scaled = jnp.round(scaled)
  return scaled.astype(dtype), scale


def dequantize_kv(x_q: Array, scale: Array, dtype: DTypeLike = jnp.float32) -> Array:
  """x_q [..., H], scale [...] -> x_q * scale[..., None] in `dtype` (the computation in float32)."""
  return (x_q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def check_scales(key, value, k_scale, v_scale, *, key_name: str = "key", value_name: str = "value"):
  """Trace-time checks of a cache and its scales: a quantized cache needs float32 scales of
  its shape without the head axis; a float cache takes none. Returns whether it is quantized."""
  quantized = is_quantized(key) or is_quantized(value)
  given = {"k_scale": k_scale, "v_scale": v_scale}
  if not quantized:
    for name, scale in given.items():
      if scale is not None:
        raise TypeError(f"{name} is given, but {key_name}/{value_name} are "
                        f"{jnp.dtype(key.dtype).name}/{jnp.dtype(value.dtype).name}: scales go with "
                        "int8 or float8_e4m3fn caches (jaxflash.quantize_kv)")
    return False
  if key.dtype != value.dtype:
    raise TypeError(f"{key_name} and {value_name} must have the same dtype, got "
                    f"{jnp.dtype(key.dtype).name} and {jnp.dtype(value.dtype).name}")
  for name, scale, cache_name, cache in (("k_scale", k_scale, key_name, key),
                                         ("v_scale", v_scale, value_name, value)):
    if scale is None:
      raise ValueError(f"{cache_name} is a quantized cache ({jnp.dtype(cache.dtype).name}, shape "
                       f"{tuple(cache.shape)}): pass its {name} of shape {tuple(cache.shape[:-1])} "
                       "(jaxflash.quantize_kv returns it)")
    if not hasattr(scale, "dtype"):
      raise TypeError(f"{name} must be a float32 array, got {type(scale).__name__}")
    if tuple(scale.shape) != tuple(cache.shape[:-1]):
      raise ValueError(f"{name} must have {cache_name}'s shape without the head axis, "
                       f"{tuple(cache.shape[:-1])}, got {name} {tuple(scale.shape)}")
    if scale.dtype != jnp.float32:
      raise TypeError(f"{name} must be float32, got {name} of dtype {jnp.dtype(scale.dtype).name}")
  return True


def dequantize_tile(tile, scale, compute_dtype):
  """Inside a kernel: a loaded K/V tile [block_k, Hp] and its scales [block_k, 1] ->
  tile * scale in float32, cast to the matmul's dtype."""
  return (tile.astype(jnp.float32) * scale).astype(compute_dtype)


def quantized_bytes(shape, dtype) -> int:
  """Bytes of a cache of `shape` [..., H] in `dtype`, with its float32 scales if quantized."""
  size = 1
  for d in shape:
    size *= int(d)
  scales = size // int(shape[-1]) * 4 if is_quantized(dtype) else 0
  return size * jnp.dtype(dtype).itemsize + scales


__all__ = ["quantize_kv", "dequantize_kv", "is_quantized", "QUANTIZED_DTYPES", "check_scales",
           "quantized_bytes"]
