"""Type aliases of the public API. Plain `jax.Array` annotations (no runtime dependency
beyond jax); the shapes are in each function's docstring: query [B, T, N, H], key/value
[B, S, K, H] or page pools [P, page_size, K, H], lengths [B] int, block tables [B, max_pages]."""
from __future__ import annotations

from typing import TYPE_CHECKING, Union

import jax

if TYPE_CHECKING:  # decode.py imports this module for its annotations
  from jaxflash.decode import SplitKV

Array = jax.Array
ArrayLike = jax.typing.ArrayLike  # jax or NumPy arrays, Python scalars
DTypeLike = jax.typing.DTypeLike
Lengths = Union[ArrayLike, None]  # int [B]; None: every position valid
Scale = Union[float, jax.Array, None]  # None: H ** -0.5
Window = Union[int, tuple[int, int], None]  # w, or (left, right) keys around the query
# out [B, T, N, H], or (out, lse [B, T, N] float32) with return_residual=True
AttentionResult = Union[jax.Array, tuple[jax.Array, jax.Array]]
# as AttentionResult, or the unmerged chunks with return_partials=True
DecodeResult = Union[jax.Array, tuple[jax.Array, jax.Array], "SplitKV"]
