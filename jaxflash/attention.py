"""`jaxflash.attention`: a drop-in for `jax.nn.dot_product_attention` backed by the kernels,
and the one registry of attention implementations (`IMPLEMENTATIONS`)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxflash import _checks, configs, segments, sharding, vjp
from jaxflash._types import Array, ArrayLike, AttentionResult, Lengths, Scale, Window
from jaxflash._triton import use_interpret
from jaxflash.quantize import check_scales, dequantize_kv, is_quantized
from jaxflash.reference import attention_reference, gather_pages, visible_keys
from jaxflash.score_mods import ScoreMods

if TYPE_CHECKING:
  from jaxflash.mosaic import MosaicPrefillConfig

# None: the best kernel for the device. "triton": the Pallas-Triton kernels ("pallas", the
# older name, is an alias). "mosaic": the Pallas Mosaic GPU prefill (sm_90). "xla":
# jaxflash's plain-JAX reference (every option). "cudnn": jax.nn.dot_product_attention's
# cuDNN path (the options jax.nn has).
IMPLEMENTATIONS = (None, "triton", "pallas", "mosaic", "xla", "cudnn")


def attention(query: Array, key: Array, value: Array, bias: Array | None = None, mask: Array | None = None,
              *, scale: Scale = None, is_causal: bool = False, query_seq_lengths: Lengths = None,
              key_value_seq_lengths: Lengths = None, local_window_size: Window = None,
              block_table: ArrayLike | None = None, return_residual: bool = False,
              implementation: str | None = None, causal_alignment: str = "top_left",
              logits_soft_cap: float | None = None, sinks: Array | None = None,
              segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
              backward_implementation: str | None = None,
              k_scale: Array | None = None, v_scale: Array | None = None) -> AttentionResult:
  """Scaled dot-product attention with `jax.nn.dot_product_attention`'s arguments and values.

  Shapes: query [B, T, N, H] (or [T, N, H]); key/value [B, S, K, H] (or [S, K, H]) with
  N a multiple of K (GQA by index: query head n reads KV head n // (N // K)). With
  `block_table` [B, max_pages], key/value are page pools [num_pages, page_size, K, H]
  (S = max_pages * page_size). Returns [B, T, N, H] in the query's dtype, and with
  `return_residual=True` also the natural-log log-sum-exp [B, T, N] in float32 (it
  includes the sink; padded rows -inf).

  Bad arguments raise TypeError/ValueError at trace time naming them (`is_causal` must be a
  bool; head dims up to 256); lengths (in [0, T] and [0, S]) and block-table entries (in
  [0, num_pages)) are checked where concrete; traced (under jit) they cannot be read and
  are clamped into those ranges (`jaxflash.paged.block_table_is_valid` checks tables there).

  Semantics as jax.nn's (rows it leaves unspecified give zeros here; a row whose visible
  scores hold a NaN gives NaN, and so do its gradients; finite logits of any size, ~1e9
  included, give finite results, the LSE within float32's rounding of the scores, about
  1e-6 of the largest sum_h |q_h k_h| * scale): query t sits at
  position p = t (`causal_alignment="top_left"`, jax.nn's tril over [T, S]) and the lengths
  are padding masks; `causal_alignment="bottom_right"` puts sequence b's T_b queries at its
  last positions, p = t + S_b - T_b (FlashAttention's convention: caches, chunked prefill).
  `is_causal` keeps keys s <= p; `local_window_size` w or (left, right) keeps
  p - left <= s <= p + right; mask (bool, True = attend) and bias (added to the scaled
  scores) broadcast to [B, N, T, S]; scale: a float or a traced scalar (H ** -0.5 by
  default). Beyond jax.nn: `logits_soft_cap` (cap * tanh(s / cap) after the bias) and
  `sinks` [N] (a per-head logit in the softmax's denominator only, as gpt-oss), and packed
  documents: `segment_ids` int [B, T] and `kv_segment_ids` int [B, S] (default: segment_ids
  when T == S), query t seeing key s only where the ids are equal (key blocks whose ids
  cannot meet are skipped; prefill only: NotImplementedError for paged or one-token decode).

  implementation (`jaxflash.IMPLEMENTATIONS`): None (the best kernel for the device: the
  Pallas-Triton kernels, compiled on a GPU, interpreted elsewhere), "triton" ("pallas"),
  "mosaic" (Hopper prefill; ValueError where it cannot serve), "xla" (the plain-JAX
  reference, every option) or "cudnn" (jax.nn's cuDNN path; NotImplementedError for the
  options it lacks). Kernel chosen: one query token whose position is its sequence's last
  (bottom-right, or no causal mask and no window) -> split-KV decode (paged decode with
  `block_table`), otherwise the prefill: the Mosaic GPU kernel on sm_90 where it serves the
  call (`mosaic_reason`; with `block_table` too, its tiles copied from the pages in place),
  else the FlashAttention-2 Pallas-Triton kernel (over pages in place, every option but
  segment ids).

  Precision: bf16 / fp16 inputs multiply on the tensor cores in their own type with float32
  accumulation and a float32 softmax, in every kernel. float32 inputs run on the Pallas-Triton
  kernels (Mosaic and cuDNN take 16-bit inputs only) with IEEE float32 dots, not TF32 (XLA's
  GPU default): `jax.default_matmul_precision("tensorfloat32")` (or "high", "default",
  "bfloat16") around the call asks for TF32 dots instead; "xla" is float32 at HIGHEST.

  Differentiable (jax.grad, jax.vjp, under jit, vmap, checkpoint, scan and on a mesh) with
  every option: the prefill and one-token decode paths, whichever forward kernel runs
  (Pallas-Triton or Mosaic GPU), are differentiated by FlashAttention-2 backward kernels,
  which give the gradients of query, key, value, bias, sinks and a traced scale; paged
  calls (block_table) raise NotImplementedError when differentiated, as do second
  derivatives; jax.jvp raises JAX's custom_vjp error. backward_implementation
  (`jaxflash.vjp.BACKWARD_IMPLEMENTATIONS`): "triton" (Pallas-Triton), "mosaic" (the Mosaic GPU backward on sm_90 after the Mosaic
  forward: d = 64 / 128 / 256, causal or not, lengths; ValueError with
  `jaxflash.vjp.mosaic_backward_reason` where it cannot serve), or None: the Mosaic one where
  `jaxflash.vjp.default_backward_reason` is None (it serves the call with at least one wave of
  dK/dV programs, and no backward_config is given), else Pallas-Triton.

  Sharded inputs (under `jax.jit` on a mesh): batch and heads may be split (query heads N
  and KV heads K over the same mesh axes); each device runs the kernel on its shard, with
  no collective (jaxflash.sharding). Inside `jax.shard_map` the kernel runs per device.

  Quantized caches: key/value int8 or float8_e4m3fn (`jaxflash.quantize_kv`) with k_scale /
  v_scale float32 of their shape without H ([B, S, K], or [P, page, K] for pages). The
  split-KV decode, the paged decode and the paged prefill (every other paged call) dequantize
  each tile after its load; other calls dequantize the cache first. Not differentiable.
  """
  implementation = _check_implementation(implementation)
  vjp.check_backward_implementation(backward_implementation)
  _checks.check_float("query", query)
  mods = ScoreMods.from_options(is_causal=is_causal, causal_alignment=causal_alignment,
                                local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
  if any(x is not None for x in (k_scale, v_scale)) or is_quantized(key) or is_quantized(value):
    if implementation in ("cudnn", "mosaic"):
      raise NotImplementedError(f"implementation={implementation!r} does not read quantized KV caches "
                                "(k_scale/v_scale); use implementation=None, 'triton' or 'xla'")
    if segment_ids is not None or kv_segment_ids is not None:
      raise NotImplementedError("segment_ids: packed documents are for prefill; a quantized KV cache "
                                "(k_scale/v_scale) does not take them")
    check_scales(key, value, k_scale, v_scale)
    implementation = implementation or "triton"
    static_scale = None if implementation == "xla" else _concrete_scale(scale, query.shape[-1])
    if scale is not None:
      scale = jnp.asarray(scale, jnp.float32)
    run = _not_differentiable(functools.partial(
        _quantized_attention, mods=mods, static_scale=static_scale, return_residual=bool(return_residual),
        implementation=implementation), "a quantized KV cache (k_scale/v_scale)",
        "dequantize it (jaxflash.dequantize_kv) to differentiate through the cache's values")
    return run(query, key, value, k_scale, v_scale, bias, mask, scale, query_seq_lengths,
               key_value_seq_lengths, block_table, sinks)
  if implementation is None or implementation == "mosaic":
    reason = mosaic_reason(query, key, value, query_seq_lengths, key_value_seq_lengths,
                           block_table, bias, mask, sinks, scale=scale, mods=mods,
                           forced=implementation == "mosaic", segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids)
    if implementation == "mosaic" and reason is not None:
      raise ValueError(f"implementation='mosaic' cannot serve this call: {reason}")
    implementation = "mosaic" if reason is None else "triton"
  # The decode kernels, the Mosaic prefill and cuDNN take the scale as a compile-time
  # number; the Triton prefill (over caches or pages) and the reference take it as an
  # operand, so a new value never recompiles.
  decode_like = _decode_semantics(query, query_seq_lengths, mods)
  static_scale = None
  if implementation in ("cudnn", "mosaic") or (implementation == "triton" and decode_like):
    static_scale = _concrete_scale(scale, query.shape[-1])
  if scale is not None:
    scale = jnp.asarray(scale, jnp.float32)  # one operand type: Python and NumPy scalars share a trace
  _check_concrete_values(query, key, query_seq_lengths, key_value_seq_lengths, block_table)
  return _attention(query, key, value, bias, mask, scale, query_seq_lengths, key_value_seq_lengths,
                    block_table, sinks, segment_ids, kv_segment_ids, mods=mods,
                    static_scale=static_scale,
                    return_residual=bool(return_residual), implementation=implementation,
                    backward_implementation=backward_implementation)


def _check_concrete_values(query, key, query_seq_lengths, key_value_seq_lengths, block_table) -> None:
  """Lengths and table entries, where their values are concrete: inside the jitted
  `_attention` they are tracers, so they are read here, before it."""
  if not (hasattr(query, "shape") and hasattr(key, "shape") and query.ndim == key.ndim == 4):
    return  # unbatched inputs take no lengths; _attention names any other mistake
  _checks.check_length_values("query_seq_lengths", query_seq_lengths, query.shape[1])
  if block_table is None:
    _checks.check_length_values("key_value_seq_lengths", key_value_seq_lengths, key.shape[1])
  elif len(np.shape(block_table)) == 2:
    num_pages, page_size = key.shape[:2]
    _checks.check_length_values("key_value_seq_lengths", key_value_seq_lengths,
                                np.shape(block_table)[1] * page_size)
    _checks.check_table_values(block_table, key_value_seq_lengths, num_pages=num_pages, page_size=page_size)


# The prefill kernels `prefill_attention` chooses between (a subset of IMPLEMENTATIONS).
PREFILL_IMPLEMENTATIONS = (None, "triton", "pallas", "mosaic")


def prefill_attention(query: Array, key: Array, value: Array, query_seq_lengths: Lengths = None,
                      key_value_seq_lengths: Lengths = None, *, bias: Array | None = None,
                      mask: Array | None = None, scale: Scale = None, is_causal: bool = False,
                      local_window_size: Window = None, logits_soft_cap: float | None = None,
                      sinks: Array | None = None, causal_alignment: str = "bottom_right",
                      segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
                      return_residual: bool = False, implementation: str | None = None,
                      config: configs.PrefillConfig | MosaicPrefillConfig | None = None,
                      backward_config: configs.BackwardConfig | None = None,
                      backward_implementation: str | None = None,
                      interpret: bool | None = None) -> AttentionResult:
  """The FlashAttention-2 prefill with its forward kernel chosen: the Pallas-Triton kernel
  (`jaxflash.prefill.prefill_attention`: every option, any GPU, interpreted off one) or the
  Pallas Mosaic GPU kernel (`jaxflash.mosaic.prefill_attention`: sm_90). Arguments, values
  and gradients are the Triton kernel's (the Triton backward differentiates either forward).

  implementation (`PREFILL_IMPLEMENTATIONS`): None picks the Mosaic kernel where
  `jaxflash.attention` would (an sm_90 GPU, bf16/fp16, the options it takes, a concrete
  scale) and the Triton kernel otherwise; "triton" ("pallas") or "mosaic" forces one, and
  "mosaic" raises ValueError saying why where it cannot serve the call.
  config: a `PrefillConfig` (Triton tiles) or a `MosaicPrefillConfig`; given with
  implementation=None, its type picks the kernel. backward_config: the backward's, a
  `BackwardConfig` (Triton tiles) or, after the Mosaic forward, a `MosaicBackwardConfig`
  (which asks for the Mosaic backward).
  backward_implementation: the backward's kernel, as `jaxflash.attention`'s.
  interpret=True runs the Triton kernel interpreted (the Mosaic kernel is compiled only).
  """
  from jaxflash import prefill as triton_prefill
  from jaxflash.mosaic import MosaicBackwardConfig, MosaicPrefillConfig
  vjp.check_backward_implementation(backward_implementation)
  if implementation not in PREFILL_IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {PREFILL_IMPLEMENTATIONS}, got {implementation!r}")
  if config is not None and not isinstance(config, (configs.PrefillConfig, MosaicPrefillConfig)):
    raise TypeError(f"config must be a PrefillConfig or a MosaicPrefillConfig, got {type(config).__name__}")
  options = dict(bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                 local_window_size=local_window_size, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 causal_alignment=causal_alignment, return_residual=return_residual,
                 segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  implementation = _check_implementation(implementation)
  if implementation is None:
    if isinstance(config, MosaicPrefillConfig):
      implementation = "mosaic"
    elif isinstance(config, configs.PrefillConfig) or interpret:
      implementation = "triton"
  wrong_config = configs.PrefillConfig if implementation == "mosaic" else MosaicPrefillConfig
  if isinstance(config, wrong_config):
    raise TypeError(f"config is a {type(config).__name__}, which implementation="
                    f"{implementation!r} does not take")
  _checks.check_qkv(query, key, value)
  _check_concrete_values(query, key, query_seq_lengths, key_value_seq_lengths, None)
  is_causal = options["is_causal"] = _checks.check_bool("is_causal", is_causal)  # a static argument next
  if implementation != "triton":
    mods = ScoreMods.from_options(is_causal=is_causal, causal_alignment=causal_alignment,
                                  local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
    # forced: one query token is a prefill here; the decode kernels are jaxflash.attention's.
    reason = mosaic_reason(query, key, value, query_seq_lengths, key_value_seq_lengths, None, bias,
                           mask, sinks, scale=scale, mods=mods, forced=True,
                           segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    if implementation == "mosaic" and reason is not None:
      raise ValueError(f"implementation='mosaic' cannot serve this call: {reason}")
    implementation = "mosaic" if reason is None else "triton"
  if implementation == "triton":
    if isinstance(backward_config, MosaicBackwardConfig):
      raise TypeError("backward_config is a MosaicBackwardConfig: the Mosaic backward follows the "
                      "Mosaic forward, which does not serve this call")
    return triton_prefill.prefill_attention(
        query, key, value, query_seq_lengths, key_value_seq_lengths, config=config,
        backward_config=backward_config, backward_implementation=backward_implementation,
        interpret=interpret, **options)

  from jaxflash.mosaic import prefill_attention as mosaic_prefill
  batch = query.shape[0]
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch, query.shape[1])
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch, key.shape[1])
  segment_ids, kv_segment_ids = segments.check_segment_ids(segment_ids, kv_segment_ids, batch,
                                                           query.shape[1], key.shape[1])
  # mosaic_reason let through only what the kernel computes: bottom-right positions (or
  # top-left ones that equal them), no bias, mask, soft-cap or sinks, a concrete scale.
  kernel = functools.partial(mosaic_prefill, scale=_concrete_scale(scale, query.shape[-1]),
                             is_causal=mods.is_causal, local_window_size=mods.window,
                             return_residual=True, config=config, interpret=interpret)

  def forward(q, k, v, o: vjp.Options, with_lse):
    del with_lse
    return kernel(q, k, v, o.q_lengths, o.kv_lengths, **_segment_kwargs(o))

  out, lse = _differentiable(forward, query, key, value,
                             vjp.Options(q_lengths, kv_lengths, scale=scale, segment_ids=segment_ids,
                                         kv_segment_ids=kv_segment_ids),
                             mods=mods, backward_implementation=backward_implementation,
                             static_scale=_concrete_scale(scale, query.shape[-1]),
                             backward_config=backward_config)
  return (out, lse) if return_residual else out


def _check_implementation(implementation) -> str | None:
  """The registry name, with "pallas" read as "triton"; None stays None (chosen per call)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  return "triton" if implementation == "pallas" else implementation


def _segment_kwargs(options: vjp.Options) -> dict:
  """The segment ids as the Mosaic prefill's keywords, only where given (so a kernel without
  them is called as before)."""
  return {name: x for name, x in (("segment_ids", options.segment_ids),
                                   ("kv_segment_ids", options.kv_segment_ids)) if x is not None}


def mosaic_reason(query: Array, key: Array, value: Array, query_seq_lengths: Lengths = None,
                  key_value_seq_lengths: Lengths = None, block_table: ArrayLike | None = None,
                  bias: Array | None = None, mask: Array | None = None, sinks: Array | None = None, *,
                  scale: Scale = None, mods: ScoreMods = ScoreMods(), forced: bool = False,
                  segment_ids: Array | None = None, kv_segment_ids: Array | None = None) -> str | None:
  """None when the Mosaic GPU prefill serves this call (what `implementation=None` then
  picks on sm_90, over caches or page pools), else why not: one-token decode (unless
  `forced`), a traced scale, a top-left causal mask that differs from the bottom-right one
  the kernel computes, the options it lacks (`jaxflash.mosaic.supports`), or no Hopper GPU."""
  from jaxflash.mosaic import supports
  if not forced and _decode_semantics(query, query_seq_lengths, mods):
    return "one query token per sequence runs on the split-KV decode kernels"
  if _concrete_scale(scale, query.shape[-1]) is None:
    return "a traced scale (the Mosaic prefill compiles the scale in)"
  if sharding.manual_axes():
    return "inside jax.shard_map the Pallas-Triton kernels run"
  packed = segment_ids is not None or kv_segment_ids is not None
  alignment = mods.causal_alignment
  positional = mods.is_causal or mods.window is not None
  if positional and alignment == "top_left":
    # Top-left and bottom-right agree when every sequence has as many queries as keys.
    same = (query.shape[-3] == key.shape[-3] and query_seq_lengths is None
            and key_value_seq_lengths is None)
    if not same:
      return "a top-left causal mask with T != S or sequence lengths"
    alignment = "bottom_right"
  batched = [jax.ShapeDtypeStruct((1,) * (4 - x.ndim) + tuple(x.shape), x.dtype)
             for x in (query, key, value)]
  segment_options = ({} if not packed
                     else dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids))
  return supports(*batched, bias=bias, mask=mask, sinks=sinks, local_window_size=mods.window,
                  logits_soft_cap=mods.logits_soft_cap,
                  causal_alignment=alignment if positional else "bottom_right", **segment_options)


def _decode_semantics(query, query_seq_lengths, mods: ScoreMods) -> bool:
  """True when every query is one token at its sequence's last position, as the decode
  kernels assume. With top-left alignment the one query sits at position 0 instead: a
  causal mask or a window then differs from decode (jax.nn's tril lets it see key 0 only)."""
  one_token = query.ndim >= 3 and query.shape[-3] == 1 and query_seq_lengths is None
  last_position = mods.causal_alignment == "bottom_right" or (not mods.is_causal and mods.window is None)
  return one_token and last_position


def _concrete_scale(scale, head_dim: int) -> float | None:
  """scale as a Python float, or None when it is traced."""
  if scale is None:
    return float(head_dim) ** -0.5
  try:
    return float(scale)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


@functools.partial(jax.jit, static_argnames=("mods", "static_scale", "return_residual",
                                             "implementation", "backward_implementation"))
def _attention(query, key, value, bias, mask, scale, query_seq_lengths, key_value_seq_lengths,
               block_table, sinks, segment_ids, kv_segment_ids, *, mods: ScoreMods,
               static_scale: float | None, return_residual: bool, implementation: str,
               backward_implementation):
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.check_float(name, x)
  unbatched = query.ndim == 3
  if unbatched:
    if block_table is not None:
      raise ValueError("block_table needs batched inputs: query [B, 1, N, H]")
    if key.ndim != 3 or value.ndim != 3:
      raise ValueError(f"query is unbatched [T, N, H], so key and value must be [S, K, H]; got key "
                       f"{tuple(key.shape)} and value {tuple(value.shape)}")
    query, key, value = query[None], key[None], value[None]
    # Unbatched ids are [T] and [S].
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)[None]
    kv_segment_ids = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids)[None]
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
      raise ValueError("sequence lengths need batched inputs [B, T, N, H]")
  _checks.check_qkv(query, key, value)
  batch, t, num_heads, head_dim = query.shape
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)

  paged = block_table is not None
  block_table, seq_kv = _checked_keys(query, key, block_table, kv_lengths)
  scores_shape = (batch, num_heads, t, seq_kv)
  bias = _checks.check_bias(bias, scores_shape)
  mask = _checks.check_mask(mask, scores_shape)
  sinks = _checks.check_sinks(sinks, num_heads)
  _checks.scale_operand(scale, head_dim)  # shape and dtype errors name `scale` on every path
  segment_ids, kv_segment_ids = segments.check_segment_ids(segment_ids, kv_segment_ids, batch, t, seq_kv)
  packed = segment_ids is not None
  if packed and (paged or (static_scale is not None and _decode_semantics(query, q_lengths, mods)
                           and implementation == "triton")):
    what = "paged caches (block_table)" if paged else "one-token decode calls"
    raise NotImplementedError(f"segment_ids: packed documents are for prefill; {what} do not take them")
  options = dict(bias=bias, mask=mask, sinks=sinks)
  # Interpreted inside jax.shard_map, only the prefill path's stand-in serves (prefill.py says why).
  own_kernels = not (sharding.manual_axes() and use_interpret())

  if implementation == "xla":
    if paged:  # the reference reads contiguous caches only
      key, value = gather_pages(key, block_table), gather_pages(value, block_table)
    result = attention_reference(
        query, key, value, bias, mask, scale=_checks.default_scale(scale, head_dim),
        is_causal=mods.is_causal, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        local_window_size=mods.window, logits_soft_cap=mods.logits_soft_cap, sinks=sinks,
        causal_alignment=mods.causal_alignment, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  elif implementation == "cudnn":
    if packed:  # cuDNN takes the documents as an explicit [B, 1, T, S] mask
      same = segments.same_segment(segment_ids, kv_segment_ids)[:, None]
      options["mask"] = same if mask is None else mask & same
    out = _cudnn(query, key, value, q_lengths, kv_lengths, block_table, mods=mods,
                 scale=static_scale, return_residual=return_residual, **options)
    return out[0] if unbatched else out
  elif implementation == "mosaic":
    from jaxflash.mosaic import prefill_attention as mosaic_prefill
    kernel = functools.partial(mosaic_prefill, scale=static_scale, is_causal=mods.is_causal,
                               local_window_size=mods.window, return_residual=True)
    if paged:
      # Chunks over a page pool: the kernel copies each key block from its pages in place
      # (within 1.1x of its contiguous call: bench/studies/results/h100/paged_prefill.md).
      run = _not_differentiable(lambda *arrays: sharding.paged_prefill(
          lambda q, kp, vp, kl, table, ql: kernel(q, kp, vp, ql, kl, block_table=table), *arrays),
          "paged prefill (block_table)")
      result = run(query, key, value, kv_lengths, block_table, q_lengths)
    else:
      # The Mosaic forward, differentiated by the backward vjp.choose_backward picks
      # (mosaic_reason let only bottom-right semantics here).
      result = _differentiable(
          lambda q, k, v, o, _: sharding.prefill(kernel, q, k, v, o.q_lengths, o.kv_lengths,
                                                 **_segment_kwargs(o)),
          query, key, value, vjp.Options(q_lengths, kv_lengths, scale=scale, segment_ids=segment_ids,
                                         kv_segment_ids=kv_segment_ids), mods=mods,
          backward_implementation=backward_implementation,
          static_scale=static_scale)
  elif own_kernels and static_scale is not None and _decode_semantics(query, q_lengths, mods):
    # Only the options given reach the decode kernels (each a keyword they take): the
    # arrays as operands, the static ones bound here.
    given = {name: x for name, x in options.items() if x is not None}
    static = dict(scale=static_scale, return_residual=True)
    if mods.window is not None:
      static["local_window_size"] = mods.window
    if mods.logits_soft_cap is not None:
      static["logits_soft_cap"] = mods.logits_soft_cap
    if paged:
      from jaxflash.paged import paged_decode_attention
      kernel = functools.partial(paged_decode_attention, **static)
      run = _not_differentiable(lambda *arrays: sharding.paged(kernel, *arrays[:5], **dict(
          zip(given, arrays[5:]))), "paged decode (block_table)")
      result = run(query, key, value, kv_lengths, block_table, *given.values())
    else:
      from jaxflash.decode import decode_attention
      kernel = functools.partial(decode_attention, **static)
      # One query token at its sequence's last position: its gradient is the prefill
      # backward's with T = 1 (the same math).
      def forward(q, k, v, o: vjp.Options, with_lse):
        del with_lse
        arrays = {name: x for name, x in dict(bias=o.bias, mask=o.mask, sinks=o.sinks).items()
                  if x is not None}
        return sharding.decode(kernel, q, k, v, o.kv_lengths, **arrays)
      result = _differentiable(forward, query, key, value,
                               vjp.Options(None, kv_lengths, scale=static_scale, **options),
                               # One query row a sequence: the Triton backward.
                               mods=mods, backward_implementation=backward_implementation,
                               static_scale=None)
  elif paged:
    # Every other paged call (T > 1, a top-left position, a traced scale) runs the prefill
    # kernel over the pages, read in place through the block table, with every option.
    given = {name: x for name, x in dict(scale=scale, **options).items() if x is not None}
    kernel = _paged_prefill_kernel(mods)
    run = _not_differentiable(lambda *arrays: sharding.paged_prefill(kernel, *arrays[:6], **dict(
        zip(given, arrays[6:]))), "paged prefill (block_table)")
    result = run(query, key, value, kv_lengths, block_table, q_lengths, *given.values())
  else:
    from jaxflash.prefill import prefill_forward
    config = configs.prefill_config(head_dim, jnp.promote_types(query.dtype, key.dtype))

    def kernel(q, k, v, q_len, kv_len, *, bias=None, mask=None, sinks=None, scale, segment_ids=None,
               kv_segment_ids=None):
      return prefill_forward(q, k, v, q_len, kv_len, bias=bias, mask=mask, scale=scale, sinks=sinks,
                             segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, mods=mods,
                             return_residual=True, config=config, interpret=None)

    def forward(q, k, v, o: vjp.Options, with_lse):
      del with_lse
      return sharding.prefill(kernel, q, k, v, o.q_lengths, o.kv_lengths, **o.arrays())
    result = _differentiable(forward, query, key, value,
                             vjp.Options(q_lengths, kv_lengths, scale=scale, segment_ids=segment_ids,
                                         kv_segment_ids=kv_segment_ids, **options), mods=mods,
                             backward_implementation=backward_implementation,
                             static_scale=static_scale)
  return _finish(result, return_residual, unbatched)


@functools.partial(jax.jit, static_argnames=("mods", "static_scale", "return_residual",
                                             "implementation"))
def _quantized_attention(query, key, value, k_scale, v_scale, bias, mask, scale, query_seq_lengths,
                         key_value_seq_lengths, block_table, sinks, *, mods: ScoreMods,
                         static_scale: float | None, return_residual: bool, implementation: str):
  """`attention` over a quantized cache (checked by check_scales): the decode kernels and the
  paged prefill dequantize tile by tile; every other call dequantizes the cache and runs
  `_attention`'s path for it."""
  unbatched = query.ndim == 3
  if unbatched:
    if block_table is not None or query_seq_lengths is not None or key_value_seq_lengths is not None:
      raise ValueError("block_table and sequence lengths need batched inputs: query [B, T, N, H]")
    query, key, value, k_scale, v_scale = (x[None] for x in (query, key, value, k_scale, v_scale))
  _checks.check_qkv(query, key, value, quantized=True)
  batch, t, num_heads, head_dim = query.shape
  q_lengths = _checks.check_lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _checks.check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  paged = block_table is not None
  block_table, seq_kv = _checked_keys(query, key, block_table, kv_lengths)
  scores_shape = (batch, num_heads, t, seq_kv)
  options = dict(bias=_checks.check_bias(bias, scores_shape), mask=_checks.check_mask(mask, scores_shape),
                 sinks=_checks.check_sinks(sinks, num_heads))
  scales = dict(k_scale=k_scale, v_scale=v_scale)
  # Interpreted inside jax.shard_map, the decode kernels step aside (as in _attention).
  own_kernels = not (sharding.manual_axes() and use_interpret())
  kernels = implementation == "triton" and static_scale is not None and own_kernels
  if kernels and _decode_semantics(query, q_lengths, mods):
    from jaxflash.decode import decode_attention
    from jaxflash.paged import paged_decode_attention
    static = dict(scale=static_scale, local_window_size=mods.window, logits_soft_cap=mods.logits_soft_cap,
                  return_residual=True)
    if paged:
      result = paged_decode_attention(query, key, value, kv_lengths, block_table, **options, **static,
                                      **scales)
    else:
      result = decode_attention(query, key, value, kv_lengths, **options, **static, **scales)
  elif implementation == "triton" and paged:  # the prefill kernel over the pages, as in _attention
    result = _paged_prefill_kernel(mods)(query, key, value, kv_lengths, block_table, q_lengths, scale=scale,
                                         **options, **scales)
  else:  # no kernel reads this call's quantized cache: dequantize it, then the float path
    key, value = dequantize_kv(key, k_scale, query.dtype), dequantize_kv(value, v_scale, query.dtype)
    result = _attention(query, key, value, options["bias"], options["mask"], scale, q_lengths, kv_lengths,
                        block_table, options["sinks"], None, None, mods=mods, static_scale=static_scale,
                        return_residual=True, implementation=implementation,
                        backward_implementation=None)
  return _finish(result, return_residual, unbatched)


def _checked_keys(query, key, block_table, kv_lengths):
  """(the checked block table or None, S: the key positions a sequence has). key is a page
  pool [P, page, K, H] with a block table, else [B, S, K, H]."""
  if block_table is None:
    _checks.check_same_batch(query, key)
    return None, key.shape[1]
  return _checks.check_pages(key, block_table, kv_lengths, query.shape[0], caller="attention")


def _paged_prefill_kernel(mods: ScoreMods):
  """jaxflash.paged_prefill_attention with the call's static options bound, returning
  (out, lse): it serves every paged call the paged decode kernel does not."""
  from jaxflash.paged_prefill import paged_prefill_attention
  return functools.partial(paged_prefill_attention, is_causal=mods.is_causal,
                           causal_alignment=mods.causal_alignment, local_window_size=mods.window,
                           logits_soft_cap=mods.logits_soft_cap, return_residual=True)


def _cudnn(query, key, value, q_lengths, kv_lengths, block_table, *, mods: ScoreMods, scale: float | None, return_residual: bool, bias, mask, sinks):
  """jax.nn.dot_product_attention(implementation="cudnn"), for the options jax.nn has."""
  def unsupported(what):
    return NotImplementedError(f"implementation='cudnn' (jax.nn.dot_product_attention) does not "
                               f"support {what}; use implementation=None or 'xla'")
  if mods.logits_soft_cap is not None:
    raise unsupported("logits_soft_cap")
  if sinks is not None:
    raise unsupported("sinks")
  if return_residual:
    raise unsupported("return_residual")
  if scale is None:
    raise unsupported("a traced scale (cuDNN takes the scale as a compile-time number)")
  if block_table is not None:  # cuDNN reads contiguous caches only
    key, value = gather_pages(key, block_table), gather_pages(value, block_table)
  batch, t, s = query.shape[0], query.shape[1], key.shape[1]
  masks_positions = mods.is_causal or mods.window is not None
  if (mods.causal_alignment == "bottom_right" and masks_positions
      and (t != s or q_lengths is not None or kv_lengths is not None)):
    # jax.nn aligns is_causal and the window top-left; where bottom-right differs (T != S, or
    # lengths) the visible keys go in as an explicit mask [B, 1, T, S], and rows that see no
    # key are zeroed (cuDNN leaves them unspecified).
    visible = visible_keys(batch, t, s, is_causal=mods.is_causal, query_seq_lengths=q_lengths,
                           key_value_seq_lengths=kv_lengths, local_window_size=mods.window,
                           causal_alignment="bottom_right")[:, None]
    mask = visible if mask is None else mask & visible
    out = jax.nn.dot_product_attention(query, key, value, bias, mask, scale=scale,
                                       implementation="cudnn")
    attended = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # [B, T, N or 1, 1]
    return jnp.where(attended, out, 0).astype(out.dtype)
  return jax.nn.dot_product_attention(
      query, key, value, bias, mask, scale=scale, is_causal=mods.is_causal,
      query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
      local_window_size=mods.window, implementation="cudnn")


def _differentiable(forward, query, key, value, options, *, mods: ScoreMods, backward_implementation,
                    static_scale: float | None, backward_config=None):
  """forward (jaxflash/vjp.py's protocol, returning (out, lse)) differentiated by the backward
  `vjp.choose_backward` picks for the call (the Mosaic GPU one needs `static_scale`); both
  sharding-aware."""
  backward = vjp.choose_backward(backward_implementation, query, key, value, options, mods=mods,
                                 static_scale=static_scale, config=backward_config)
  options = options._replace(scale=_checks.scale_operand(options.scale, query.shape[-1]))
  return vjp.with_backward(forward, query, key, value, options, backward=backward,
                           return_residual=True)


def _not_differentiable(fn, path: str, hint: str = "differentiate a contiguous cache or the prefill path, "
                                                   "or use implementation='xla'"):
  """fn, raising NotImplementedError (naming `path`, then `hint`) where JAX would differentiate it."""
  wrapped = jax.custom_jvp(fn)

  def no_jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        f"jaxflash.attention: {path} is not differentiable; {hint}")

  wrapped.defjvp(no_jvp)
  return wrapped


def _finish(result, return_residual: bool, unbatched: bool):
  out, lse = result
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out
