"""Forward + backward of causal attention with the Mosaic GPU backward, against the same
forward with the Pallas-Triton backward (today's `jaxflash.attention`) and cuDNN, in one
profiler session (device time). B = 1, 12 query heads / 2 KV heads, d = 128, bf16.

  python -m bench.mosaic_backward [n ...]      (default: 4096 16384)

Forward + backward FLOPs are counted as 3.5x the causal forward (FlashAttention-2's rule)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from bench.timing import Timing, device_times_us
from bench.train import cudnn_attention, forward_backward, jaxflash_default_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 12, 2, 128, jnp.bfloat16


def mosaic_attention(q, k, v):
  """The Mosaic prefill with the Mosaic backward as its VJP."""
  from jaxflash.mosaic.backward import mosaic_backward
  from jaxflash.mosaic.prefill import prefill_attention

  @jax.custom_vjp
  def attend(q, k, v):
    return prefill_attention(q, k, v, is_causal=True)

  def forward(q, k, v):
    out, lse = prefill_attention(q, k, v, is_causal=True, return_residual=True)
    return out, (q, k, v, out, lse)

  def backward(res, d_out):
    q, k, v, out, lse = res
    return mosaic_backward(q, k, v, out, lse, d_out, causal=True)

  attend.defvjp(forward, backward)
  return attend(q, k, v)


def main(argv=None):
  sizes = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or [4096, 16384]
  contenders = {"mosaic_bwd": mosaic_attention, "triton_bwd": jaxflash_default_attention,
                "cudnn": cudnn_attention}
  for n in sizes:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, n, NUM_HEADS, HEAD_DIM), DTYPE)
    k = jax.random.normal(keys[1], (1, n, NUM_KV_HEADS, HEAD_DIM), DTYPE)
    v = jax.random.normal(keys[2], (1, n, NUM_KV_HEADS, HEAD_DIM), DTYPE)
    d_out = jax.random.normal(keys[3], (1, n, NUM_HEADS, HEAD_DIM), DTYPE)
    cases = {name: (forward_backward(fn), (q, k, v, d_out)) for name, fn in contenders.items()}
    flops = 3.5 * NUM_HEADS * 4 * n * n * HEAD_DIM / 2
    for name, t in device_times_us(cases).items():
      if isinstance(t, Timing):
        top = ", ".join(f"{kname[:40]} {us:.0f}" for kname, us in list(t.kernels.items())[:4])
        print(f"n={n} {name}: {t.us:.0f} us ({t.method}), {flops / t.us / 1e6:.0f} TFLOP/s "
              f"fwd+bwd; kernels: {top}", flush=True)
      else:
        print(f"n={n} {name}: {t}", flush=True)


if __name__ == "__main__":
  main()
