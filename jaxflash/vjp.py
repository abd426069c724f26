"""The custom VJP of every attention forward, wired once: a forward kernel paired with a
backward chosen at trace time.

Protocol (any kernel with the out and natural-log LSE of `jaxflash.reference` for the
options the pair is built with: the Pallas-Triton prefill, the Mosaic GPU prefill, the
decode kernels):

    forward(q, k, v, options: Options, with_lse) -> out, or (out, lse) when with_lse
    backward(q, k, v, options: Options, out, lse, d_out, d_lse) -> (dq, dk, dv, ds)

ds is the float32 [B, N, T, S] score gradient (None without a bias). Differentiated, the
residuals are the inputs, out and the LSE (O(n) memory: the scores are recomputed, as
FlashAttention-2's Algorithm 2); bias, sinks and scale get their gradients in XLA
(`jaxflash.option_grads`). Not differentiated, only the forward runs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax

from jaxflash import prefill_backward, sharding
from jaxflash.option_grads import option_grads
from jaxflash.score_mods import ScoreMods

# None: the Mosaic GPU backward where `default_backward_reason` is None, else the Pallas-Triton
# one. "triton": the Pallas-Triton backward (every GPU, every option). "mosaic": the Pallas
# Mosaic GPU backward (sm_90; ValueError with `mosaic_backward_reason` where it cannot serve).
BACKWARD_IMPLEMENTATIONS = (None, "triton", "mosaic")


class Options(NamedTuple):
  """The array options a forward and its backward take, checked (None: absent)."""
  q_lengths: Any = None  # int32 [B]
  kv_lengths: Any = None  # int32 [B]
  bias: Any = None  # float, rank 4, broadcastable to [B, N, T, S]
  mask: Any = None  # bool, rank 4, likewise
  sinks: Any = None  # float32 [N]
  scale: Any = None  # float32 []
  segment_ids: Any = None  # int32 [B, T]
  kv_segment_ids: Any = None  # int32 [B, S]

  def arrays(self) -> dict:
    """The keyword options a kernel takes beside (q, k, v, q_lengths, kv_lengths)."""
    return dict(bias=self.bias, mask=self.mask, sinks=self.sinks, scale=self.scale,
                segment_ids=self.segment_ids, kv_segment_ids=self.kv_segment_ids)


def _first_order(fn: Callable) -> Callable:
  """fn, with a clear error where JAX would differentiate it (second derivatives)."""
  wrapped = jax.custom_jvp(fn)

  def no_jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        "jaxflash attention: second derivatives (differentiating the backward pass, as in "
        "jax.hessian or grad of grad) are not implemented; differentiate once, or use "
        "implementation='xla'")

  wrapped.defjvp(no_jvp)
  return wrapped


def with_backward(forward: Callable, query, key, value, options: Options, *, backward: Callable,
                  return_residual: bool):
  """Attention through `forward`, differentiated through `backward` (a `jax.custom_vjp`;
  protocol: the module docstring). The LSE's cotangent (return_residual=True) enters delta
  as delta - dLSE. Forward-mode (jax.jvp) raises JAX's custom_vjp error; second
  derivatives raise NotImplementedError."""
  backward = _first_order(backward)
  # The forward as the VJP's forward rule runs it: differentiating that (a second
  # derivative) would differentiate the kernel itself.
  forward_for_vjp = _first_order(lambda q, k, v, options: forward(q, k, v, options, True))

  @jax.custom_vjp
  def attend(q, k, v, options):
    return forward(q, k, v, options, return_residual)

  def attend_fwd(q, k, v, options):
    out, lse = forward_for_vjp(q, k, v, options)
    return ((out, lse) if return_residual else out), (q, k, v, options, out, lse)

  def attend_bwd(residuals, cotangent):
    q, k, v, options, out, lse = residuals
    d_out, d_lse = cotangent if return_residual else (cotangent, None)
    dq, dk, dv, ds = backward(q, k, v, options, out, lse, d_out, d_lse)
    d_bias, d_sinks, d_scale = option_grads(q, dq, lse, (out, d_out, d_lse), bias=options.bias,
                                            sinks=options.sinks, scale=options.scale, ds=ds)
    dq, dk, dv = (sharding.like_primal(g, x) for g, x in zip((dq, dk, dv), (q, k, v)))
    d_options = Options(bias=sharding.like_primal(d_bias, options.bias),
                        sinks=sharding.like_primal(d_sinks, options.sinks),
                        scale=sharding.like_primal(d_scale, options.scale))
    # Integer and boolean options (lengths, mask, ids) have no cotangent.
    d_options = Options(*(None if x is None else g for g, x in zip(d_options, options)))
    return dq, dk, dv, d_options

  attend.defvjp(attend_fwd, attend_bwd)
  return attend(query, key, value, options)


def triton_backward(mods: ScoreMods, config, interpret=None) -> Callable:
  """The FlashAttention-2 backward kernels (jaxflash/prefill_backward.py) for `mods` as a
  `with_backward` backward, sharding-aware (jaxflash.sharding.prefill_backward)."""
  kernel = functools.partial(prefill_backward.backward_kernels, mods=mods, config=config,
                             interpret=interpret)

  def backward(q, k, v, options: Options, out, lse, d_out, d_lse):
    arrays = options.arrays()
    return sharding.prefill_backward(kernel, q, k, v, options.q_lengths, options.kv_lengths, out,
                                     lse, d_out, d_lse, **arrays)

  return backward


def check_backward_implementation(backward_implementation):
  if backward_implementation not in BACKWARD_IMPLEMENTATIONS:
    raise ValueError(f"backward_implementation must be one of {BACKWARD_IMPLEMENTATIONS}, got "
                     f"{backward_implementation!r}")
  return backward_implementation


def mosaic_backward(mods: ScoreMods, static_scale: float, config=None) -> Callable:
  """The Mosaic GPU backward (jaxflash/mosaic/backward.py; `config` a MosaicBackwardConfig,
  None: the default) as a `with_backward` backward, sharding-aware like the Triton one."""
  from jaxflash.mosaic.backward import mosaic_backward as kernel_launch

  def kernel(q, k, v, q_len, kv_len, out, lse, d_out, d_lse, *, segment_ids, kv_segment_ids,
             **options):
    del options  # mosaic_backward_reason let through no other array option
    dq, dk, dv = kernel_launch(q, k, v, out, lse, d_out, q_len, kv_len, scale=static_scale,
                               causal=mods.is_causal, window=mods.window, segment_ids=segment_ids,
                               kv_segment_ids=kv_segment_ids, d_lse=d_lse, config=config)
    return dq, dk, dv, None

  def backward(q, k, v, options: Options, out, lse, d_out, d_lse):
    return sharding.prefill_backward(kernel, q, k, v, options.q_lengths, options.kv_lengths, out,
                                     lse, d_out, d_lse, **options.arrays())

  return backward


def mosaic_backward_reason(query, key, value, options: Options, *, mods: ScoreMods,
                           static_scale: float | None) -> str | None:
  """None when the Mosaic GPU backward serves this call, else why not."""
  from jaxflash.mosaic.backward_config import backward_reason
  alignment = mods.causal_alignment if mods.is_causal else "bottom_right"
  if (alignment == "top_left" and query.shape[-3] == key.shape[-3]
      and options.q_lengths is None and options.kv_lengths is None):
    alignment = "bottom_right"  # the two agree when every sequence has as many queries as keys
  reason = backward_reason(query, key, value, is_causal=mods.is_causal,
                           local_window_size=mods.window, logits_soft_cap=mods.logits_soft_cap,
                           causal_alignment=alignment,
                           bias=options.bias, mask=options.mask, sinks=options.sinks,
                           segment_ids=options.segment_ids, kv_segment_ids=options.kv_segment_ids)
  if reason is None and static_scale is None:
    reason = "a traced scale, or a forward that is not the Mosaic prefill's (its scale is compiled in)"
  if reason is None and sharding.manual_axes():
    reason = "inside jax.shard_map the Pallas-Triton backward runs"
  return reason


def default_backward_reason(query, key, value, options: Options, *, mods: ScoreMods,
                            static_scale: float | None) -> str | None:
  """None when backward_implementation=None takes the Mosaic GPU backward: where it serves
  the call and its dK/dV kernel, each KV head's query-head group split over CTAs
  (`mosaic.backward_config.head_splits`), has at least one CTA per SM. Below that (B = 1 at 1K keys
  with 12 / 2 heads at d = 128: 96 CTAs on 132 SMs) the Triton backward, which also splits
  each key block's queries over programs, runs, and at head dims over 128 too (the Mosaic
  layout there has not run compiled yet). Measured at d = 128 from 2K up: 1.04-1.18x the
  Triton backward's fwd+bwd speed at 2K-8K, 1.2-1.4x from 16K and at 4 x 4K
  (bench/studies/results/h100/train_dq_variants.md)."""
  from jaxflash.device import device_info
  from jaxflash.mosaic.backward_config import dkv_programs, mosaic_backward_config
  reason = mosaic_backward_reason(query, key, value, options, mods=mods, static_scale=static_scale)
  if reason is not None:
    return reason
  if query.shape[-1] > 128:
    return ("at head dims over 128 the Mosaic backward's layout (six products a block, one dQ "
            "ring slot) has not yet been compiled and timed against the Triton backward on a "
            "GPU; backward_implementation='mosaic' runs it")
  info = device_info()
  programs = dkv_programs(key.shape, query.shape[2] // key.shape[2],
                          mosaic_backward_config(query.shape[-1], query.dtype, info),
                          causal=mods.is_causal, sm_count=info.sm_count)
  if programs < info.sm_count:
    return (f"{programs} dK/dV programs of the Mosaic backward fill less than one wave of "
            f"{info.sm_count} SMs")
  return None


def choose_backward(backward_implementation, query, key, value, options: Options, *,
                    mods: ScoreMods, static_scale: float | None, config=None,
                    interpret=None) -> Callable:
  """The backward for this call, chosen at trace time (BACKWARD_IMPLEMENTATIONS). config: a
  BackwardConfig for the Triton kernels or a MosaicBackwardConfig, which asks for the Mosaic
  backward (None: the tuned one of the backward chosen)."""
  check_backward_implementation(backward_implementation)
  from jaxflash.mosaic.backward_config import MosaicBackwardConfig
  mosaic_config = isinstance(config, MosaicBackwardConfig)
  if mosaic_config and backward_implementation == "triton":
    raise TypeError("backward_config is a MosaicBackwardConfig, which backward_implementation='triton' "
                    "does not take")
  if backward_implementation == "mosaic" or mosaic_config:
    reason = mosaic_backward_reason(query, key, value, options, mods=mods, static_scale=static_scale)
    if reason is not None:
      what = "backward_implementation='mosaic'" if backward_implementation else "a MosaicBackwardConfig"
      raise ValueError(f"{what} cannot serve this call: {reason}")
    return mosaic_backward(mods, static_scale, config if mosaic_config else None)
  if (backward_implementation is None and config is None
      and default_backward_reason(query, key, value, options, mods=mods, static_scale=static_scale) is None):
    return mosaic_backward(mods, static_scale)
  dtype = jax.numpy.promote_types(query.dtype, key.dtype)
  return triton_backward(mods, prefill_backward.resolve_config(config, query.shape[-1], dtype),
                         interpret)
