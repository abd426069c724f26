"""What the compiled prefill kernel is made of: dumps XLA's compilation of one causal prefill
call (n = 8192, Qwen2.5-1.5B heads, bf16) and counts the instructions that matter in the
Triton kernel's PTX: tensor-core matrix ops (wgmma = Hopper's warpgroup MMA, mma.sync = the
Ampere-style one), asynchronous copies (cp.async = pointer loads into shared memory,
cp.async.bulk = the TMA copy engine) and the exponentials (ex2.approx).

Usage (GPU): PYTHONPATH=. python bench/inspect_prefill.py [DUMP_DIR]
"""
import os
import re
import sys
import tempfile
from pathlib import Path

dump = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="jaxflash_dump_"))
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402

import jaxflash  # noqa: E402

PATTERNS = {"wgmma.mma_async": r"wgmma\.mma_async", "mma.sync": r"\bmma\.sync",
            "cp.async (pointer)": r"cp\.async\.(?:ca|cg)", "cp.async.bulk (TMA)": r"cp\.async\.bulk",
            "ex2.approx": r"ex2\.approx", "ld.global": r"ld\.global", "bar.sync": r"bar\.sync"}

n, heads, kv_heads, d = 8192, 12, 2, 128
q = jax.random.normal(jax.random.key(0), (1, n, heads, d), jnp.bfloat16)
k = jax.random.normal(jax.random.key(1), (1, n, kv_heads, d), jnp.bfloat16)
v = jax.random.normal(jax.random.key(2), (1, n, kv_heads, d), jnp.bfloat16)
jax.block_until_ready(jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, is_causal=True))(q, k, v))

found = False
for path in sorted(dump.rglob("*")):
  if not path.is_file() or path.stat().st_size > 50 << 20:
    continue
  text = path.read_text(errors="ignore")
  if "jaxflash_prefill" not in text or ".entry" not in text:
    continue
  found = True
  counts = {name: len(re.findall(pattern, text)) for name, pattern in PATTERNS.items()}
  print(f"{path.name}: " + ", ".join(f"{name} {count}" for name, count in counts.items()))
if not found:
  print("no PTX with the prefill kernel in", dump, "; files:", [p.name for p in dump.rglob("*")][:40])
