"""Argument checks shared by the public functions: they run at trace time and name the
offending argument and its shape, so a mistake surfaces before any kernel is built."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# The kernels hold a query block's head dim in registers (padded to a power of two).
MAX_HEAD_DIM = 256


def _describe(x) -> str:
  return f"shape {tuple(x.shape)} and dtype {jnp.dtype(x.dtype).name}"


def check_float(name: str, x) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
    raise TypeError(f"{name} must be bfloat16, float16 or float32, got {_describe(x)}")


def check_qkv(query, key, value, *, key_name: str = "key", value_name: str = "value",
              quantized: bool = False) -> None:
  """query [B, T, N, H]; key, value [B, S, K, H] (or pages [P, page, K, H]) with N % K == 0.
  `quantized`: key and value are a quantized cache whose dtype and scales
  `jaxflash.quantize.check_scales` checked."""
  for name, x in (("query", query), (key_name, key), (value_name, value)):
    if not (quantized and name != "query"):
      check_float(name, x)
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 ([B, T, N, H] / [B, S, K, H]), got {_describe(x)}")
  if key.shape != value.shape:
    raise ValueError(f"{key_name} and {value_name} must have the same shape, got "
                     f"{key_name} {tuple(key.shape)} and {value_name} {tuple(value.shape)}")
  if key.dtype != value.dtype:
    raise TypeError(f"{key_name} and {value_name} must have the same dtype, got "
                    f"{jnp.dtype(key.dtype).name} and {jnp.dtype(value.dtype).name}")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"query and {key_name} must have the same head dim, got query "
                     f"{tuple(query.shape)} and {key_name} {tuple(key.shape)}")
  if query.shape[-1] > MAX_HEAD_DIM:
    raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got query {tuple(query.shape)} "
                     f"(head dim {query.shape[-1]})")
  n, k = query.shape[2], key.shape[2]
  if k == 0 or n % k:
    raise ValueError(f"query heads ({n}) must be a multiple of {key_name} heads ({k}): query "
                     f"{tuple(query.shape)}, {key_name} {tuple(key.shape)}")


def check_same_batch(query, key, key_name: str = "key") -> None:
  """query [B, T, N, H] and key [B, S, K, H] must agree on B."""
  if key.shape[0] != query.shape[0]:
    raise ValueError(f"query and {key_name} must have the same batch size, got query "
                     f"{tuple(query.shape)} and {key_name} {tuple(key.shape)}")


def is_concrete(x) -> bool:
  """True where x's values can be read now (not a tracer under jit, grad or vmap)."""
  return not isinstance(x, jax.core.Tracer)


def check_lengths(name: str, lengths, batch: int, limit: int | None = None):
  """lengths: integer [batch]; returned as int32 (None stays None). With `limit`, concrete
  values must lie in [0, limit] (see `check_length_values`)."""
  if lengths is None:
    return None
  if not hasattr(lengths, "dtype"):
    lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array of shape ({batch},), got {_describe(lengths)}")
  if tuple(lengths.shape) != (batch,):
    raise ValueError(f"{name} must have shape ({batch},) (one length per sequence), got {_describe(lengths)}")
  if limit is not None:
    check_length_values(name, lengths, limit)
  return lengths.astype(jnp.int32)


def check_length_values(name: str, lengths, limit: int) -> None:
  """Concrete lengths must lie in [0, limit]. Traced ones cannot be read at trace time: the
  kernels clamp them to [0, limit] (a negative length is 0, one past the end is the end)."""
  if lengths is None or not is_concrete(lengths):
    return
  values = np.asarray(lengths)
  bad = values[(values < 0) | (values > limit)]
  if bad.size:
    raise ValueError(f"{name} must lie in [0, {limit}], got {bad[:4].tolist()} in {name} of shape "
                     f"{tuple(values.shape)}")


def check_table_values(block_table, lengths, *, num_pages: int, page_size: int) -> None:
  """Concrete block-table entries that the lengths make the kernels read must lie in
  [0, num_pages). Traced ones cannot be read at trace time: the kernels clamp them into the
  pool (`jaxflash.paged.block_table_is_valid` checks them under jit)."""
  if not (is_concrete(block_table) and is_concrete(lengths)) or lengths is None:
    return
  table, lengths = np.asarray(block_table), np.asarray(lengths)
  if table.ndim != 2 or lengths.shape != table.shape[:1]:
    return  # the shape checks name it
  pages_read = (np.clip(lengths, 0, table.shape[1] * page_size) + page_size - 1) // page_size  # [B]
  read = np.arange(table.shape[1])[None, :] < pages_read[:, None]  # [B, max_pages]
  bad = np.argwhere(read & ((table < 0) | (table >= num_pages)))
  if bad.size:
    b, j = bad[0]
    raise ValueError(f"block_table[{b}, {j}] = {table[b, j]} lies outside the pool of {num_pages} pages "
                     f"(block_table of shape {tuple(table.shape)}): entries within a sequence's length "
                     f"must lie in [0, {num_pages})")


def check_bool(name: str, flag) -> bool:
  """A Python or NumPy bool (a string or an array is a mistake, not a flag)."""
  if not isinstance(flag, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
  return bool(flag)


def check_block_table(block_table, batch: int):
  """block_table: integer [batch, max_pages]; returned as int32."""
  if not hasattr(block_table, "dtype"):
    block_table = jnp.asarray(block_table)
  if not jnp.issubdtype(block_table.dtype, jnp.integer):
    raise TypeError(f"block_table must be an integer array [batch, max_pages], got {_describe(block_table)}")
  if block_table.ndim != 2 or block_table.shape[0] != batch:
    raise ValueError(f"block_table must have shape ({batch}, max_pages), got {_describe(block_table)}")
  return block_table.astype(jnp.int32)


def check_page_size(page_size: int) -> None:
  if page_size < 8 or page_size & (page_size - 1):
    raise ValueError(f"page size must be a power of two >= 8, got pages of {page_size} tokens")


def check_pages(k_pages, block_table, kv_lengths, batch: int, *, caller: str):
  """The checks every reader of a page pool k_pages [P, page, K, H] shares: its page size, at
  least one page, the table [batch, max_pages], and the lengths (a pool does not hold them).
  Returns (the int32 table, the keys a sequence can have: max_pages * page)."""
  check_page_size(k_pages.shape[1])
  if k_pages.shape[0] == 0:
    raise ValueError(f"the pool needs at least one page, got k_pages {tuple(k_pages.shape)}")
  block_table = check_block_table(block_table, batch)
  if kv_lengths is None:
    raise ValueError(f"{caller} needs key_value_seq_lengths [B] with a block_table: the keys per "
                     f"sequence, the new tokens included")
  return block_table, block_table.shape[1] * k_pages.shape[1]


def default_scale(scale, head_dim: int):
  """The softmax scale: H ** -0.5 by default; a traced scale stays traced."""
  if scale is None:
    return float(head_dim) ** -0.5
  try:
    return float(scale)
  except Exception:  # a tracer (jit, grad): kept as an array
    return jnp.asarray(scale, jnp.float32)


def scale_operand(scale, head_dim: int):
  """scale (None, a number or a scalar array, traced or not) -> float32 [] array."""
  if scale is not None and hasattr(scale, "shape") and tuple(scale.shape) not in ((), (1,)):
    raise ValueError(f"scale must be a real scalar, got {_describe(scale)}")
  if scale is not None and hasattr(scale, "dtype") and not (
      jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
    raise TypeError(f"scale must be a real number, got {_describe(scale)}")
  scale = float(head_dim) ** -0.5 if scale is None else scale
  return jnp.asarray(scale, jnp.float32).reshape(())


def split_scale(scale):
  """scale -> (static float or None, traced float32 [1] or None). A Python or NumPy number
  stays static (a constant in the kernel, as before options existed); a JAX array or tracer
  becomes an operand, so new values never recompile."""
  if scale is None:
    return None, None
  if isinstance(scale, bool) or not (isinstance(scale, (int, float, np.number, np.ndarray))
                                     or hasattr(scale, "dtype")):
    raise TypeError(f"scale must be a number or a scalar array, got {type(scale).__name__}")
  if np.size(scale) != 1 or not jnp.issubdtype(jnp.result_type(scale), jnp.number):
    raise ValueError(f"scale must be a real scalar, got shape {np.shape(scale)} and dtype "
                     f"{jnp.result_type(scale)}")
  if isinstance(scale, (int, float, np.number, np.ndarray)):
    return float(np.asarray(scale).reshape(())), None
  return None, jnp.asarray(scale, jnp.float32).reshape(1)


def broadcast_rank4(name: str, x, shape: tuple[int, ...], axes: str = "[B, N, T, S]"):
  """x broadcastable to `shape` (rank 4, its axes named `axes` in errors) -> x as rank 4,
  each axis 1 or shape's; no copy."""
  if x.ndim > len(shape) or any(d not in (1, full) for d, full in zip(x.shape[::-1], shape[::-1])):
    raise ValueError(f"{name} must be broadcastable to {axes} = {tuple(shape)}, got {_describe(x)}")
  return x.reshape((1,) * (len(shape) - x.ndim) + tuple(x.shape))


def check_bias(bias, shape: tuple[int, ...], axes: str = "[B, N, T, S]"):
  """bias: float, broadcastable to shape [B, N, T, S]; returned as rank 4 (None stays None)."""
  if bias is None:
    return None
  check_float("bias", bias)
  return broadcast_rank4("bias", bias, shape, axes)


def check_mask(mask, shape: tuple[int, ...], axes: str = "[B, N, T, S]"):
  """mask: bool (True = attend), broadcastable to shape [B, N, T, S]; returned as rank 4."""
  if mask is None:
    return None
  if not hasattr(mask, "dtype"):
    mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(f"mask must be a boolean array (True = attend), got {_describe(mask)}")
  return broadcast_rank4("mask", mask, shape, axes)


def check_sinks(sinks, num_heads: int):
  """sinks: float [N], one logit per query head; returned as float32 (None stays None)."""
  if sinks is None:
    return None
  if not hasattr(sinks, "dtype"):
    sinks = jnp.asarray(sinks, jnp.float32)
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must be a float array of shape ({num_heads},), got {_describe(sinks)}")
  if tuple(sinks.shape) != (num_heads,):
    raise ValueError(f"sinks must have shape ({num_heads},) (one logit per query head), got "
                     f"{_describe(sinks)}")
  return sinks.astype(jnp.float32)
