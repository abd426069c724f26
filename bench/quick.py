"""Quick tuning probe on the GPU: a few prefill configs at n = 8192 and decode variants at
32K / 128K (cold caches), against cuDNN, with device time. For development, not the README."""
import itertools, os, sys
import jax, jax.numpy as jnp
import jaxflash
from jaxflash import PrefillConfig, DecodeConfig
from bench import common
import jaxflash.prefill
jaxflash.prefill.APPROX_EXP2 = os.environ.get("EXP2", "approx") == "approx"
print("APPROX_EXP2", jaxflash.prefill.APPROX_EXP2)

def rnd(key, shape):
  return jax.random.normal(jax.random.key(key), shape, jnp.bfloat16)

rows = []
def rec(name, t, work, unit):
  val = work / (t.us * 1e-6) if hasattr(t, "us") else float("nan")
  rows.append((name, getattr(t, "us", t), val / (1e12 if unit == "TFLOP/s" else 1e9), unit))
  print(f"{name:60s} {getattr(t, 'us', t)!s:>12.12} us  {rows[-1][2]:8.1f} {unit}", flush=True)

if "prefill" in sys.argv:
  n, N, K, H = 8192, 12, 2, 128
  q, k, v = rnd(0, (1, n, N, H)), rnd(1, (1, n, K, H)), rnd(2, (1, n, K, H))
  flops = 4 * n * n * H * N / 2
  cases = {"cudnn": (jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")), (q, k, v)),
           "jaxflash default": (jax.jit(lambda q, k, v: jaxflash.prefill_attention(q, k, v, is_causal=True)), (q, k, v))}
  for bq, bk, w, s in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 4), (128, 128, 4, 3)]:
    cfg = PrefillConfig(bq, bk, w, s)
    cases[f"jaxflash {cfg}"] = (jax.jit(lambda q, k, v, cfg=cfg: jaxflash.prefill_attention(q, k, v, is_causal=True, config=cfg)), (q, k, v))
  res = common.device_times_us(cases, log=print)
  for name, t in res.items():
    rec(f"prefill n=8192 {name}", t, flops, "TFLOP/s") if hasattr(t, "us") else print(name, t)

if "decode" in sys.argv:
  N, K, H = 12, 2, 128
  for S in (32768, 131072):
    per_layer = 2 * S * K * H * 2
    L = max(2, -(-(768 << 20) // per_layer))
    q = rnd(3, (1, 1, N, H))
    ks = [rnd(10 + i, (1, S, K, H)) for i in range(L)]
    vs = [rnd(100 + i, (1, S, K, H)) for i in range(L)]
    lengths = jnp.full((1,), S, jnp.int32)
    def layers(fn):
      return jax.jit(lambda q, ks, vs, lengths: sum(fn(q, k, v, lengths).astype(jnp.float32) for k, v in zip(ks, vs)))
    cases = {"cudnn": (layers(lambda q, k, v, l: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=l, implementation="cudnn")), (q, ks, vs, lengths))}
    for splits, cfg in itertools.product((64, 128), (DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 4), DecodeConfig(64, 2, 3), DecodeConfig(64, 2, 4), DecodeConfig(128, 4, 4), DecodeConfig(32, 2, 6))):
      cases[f"splits={splits} {cfg}"] = (layers(lambda q, k, v, l, s=splits, c=cfg: jaxflash.decode_attention(q, k, v, l, num_splits=s, config=c)), (q, ks, vs, lengths))
    cases["default"] = (layers(lambda q, k, v, l: jaxflash.decode_attention(q, k, v, l)), (q, ks, vs, lengths))
    # paged, page 16, random permutation
    page = 16
    npg = S // page
    perm = jax.random.permutation(jax.random.key(7), npg).astype(jnp.int32)[None]
    kp = [k.reshape(npg, page, K, H)[perm[0].argsort()] for k in ks]
    vp = [v.reshape(npg, page, K, H)[perm[0].argsort()] for v in vs]
    for splits, cfg in itertools.product((64,), (DecodeConfig(64, 4, 5), DecodeConfig(64, 4, 6), DecodeConfig(64, 2, 5), DecodeConfig(128, 4, 5), DecodeConfig(32, 2, 6))):
      f = jax.jit(lambda q, kp, vp, l, t, s=splits, c=cfg: sum(jaxflash.paged_decode_attention(q, a, b, l, t, num_splits=s, config=c).astype(jnp.float32) for a, b in zip(kp, vp)))
      cases[f"paged16 splits={splits} {cfg}"] = (f, (q, kp, vp, lengths, perm))
    res = common.device_times_us(cases, log=print)
    for name in ("default", "cudnn"):
      t = res.get(name)
      if hasattr(t, "kernels"): print("BREAKDOWN", S, name, {k: round(v, 2) for k, v in t.kernels.items()})
    for name, t in res.items():
      rec(f"decode S={S} L={L} {name}", t / L if False else t, per_layer * L, "GB/s") if hasattr(t, "us") else print(name, t)
    del ks, vs, kp, vp
print("\n".join(f"{r[0]:70s} {r[2]:8.1f} {r[3]}" for r in rows))
