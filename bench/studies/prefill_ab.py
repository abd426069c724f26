"""The prefill (forward, or forward + backward) at an earlier commit against the working
tree's, in one process (device time).

Two runs of a benchmark in different processes (or on different machines of one kind) move by
a few percent on their own, which hides a change's cost when that cost is what is asked (a
budget of 2% for a numerics fix, say). This study imports jaxflash twice: the working tree's,
and the commit's, exported with `git archive` into a temporary folder as a package of its own
name (`jaxflash_at_<rev>`, its imports rewritten to match), and times both trees'
`jaxflash.prefill_attention` (the default dispatch: the Mosaic prefill on sm_90) on the same
inputs in one profiler session, their calls interleaved, each tree twice; with `--train`, the
gradient of both trees' `jaxflash.attention` (forward + backward, as bench/train.py times it;
FLOPs counted 3.5x the forward's). Shapes as bench/prefill.py: Qwen2.5-1.5B attention (12
query / 2 KV heads, d = 128 unless given, bf16, causal).

  python -m bench.studies.prefill_ab --rev 14320a5 [--sizes 2048,4096,16384] [--out DIR]   # GPU
  python -m bench.studies.prefill_ab --rev main --train          # a branch's backward against main
  git archive 14320a5 jaxflash > /tmp/at.tar   # where the run's copy of the tree has no history:
  python -m bench.studies.prefill_ab --rev 14320a5 --archive /tmp/at.tar
  python -m bench.studies.prefill_ab --smoke                                                  # CPU
"""
from __future__ import annotations

import functools
import importlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import timing
from bench.cli import TimeLimit, begin_run, bench_arguments, log
from bench.report import STUDIES_DIR, write_results

ROOT = Path(__file__).resolve().parents[2]
NUM_HEADS, NUM_KV_HEADS = 12, 2


def package_at(rev: str, archive: Path | None = None):
  """jaxflash as it was at `rev`, imported as the package `jaxflash_at_<rev>`: from `archive`
  (a tar of `git archive <rev> jaxflash`) when given, else from this checkout's history."""
  name = f"jaxflash_at_{re.sub(r'[^0-9A-Za-z]', '_', rev)}"
  if name in sys.modules:
    return sys.modules[name]
  if archive is None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "jaxflash"], check=True,
                             capture_output=True).stdout
  else:
    archive = Path(archive).read_bytes()
  folder = Path(tempfile.mkdtemp(prefix="jaxflash_ab_"))
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(folder, filter="data")
  (folder / "jaxflash").rename(folder / name)
  for path in (folder / name).rglob("*.py"):
    # Every reference to the package by name (imports, `jaxflash.x` attributes) names the copy;
    # names that merely start with it (kernel names such as jaxflash_prefill) stay.
    path.write_text(re.sub(r"\bjaxflash\b", name, path.read_text()))
  sys.path.insert(0, str(folder))
  return importlib.import_module(name)


def _forward_and_backward(package):
  """(q, k, v, d_out) -> the gradients of package.attention's causal output against d_out."""
  def loss(q, k, v, d_out):
    out = package.attention(q, k, v, is_causal=True)
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def ab_row(n: int, batch: int, head_dim: int, packages: dict, train: bool = False) -> dict:
  kq, kk, kv, kd = jax.random.split(jax.random.key(n), 4)
  q = jax.random.normal(kq, (batch, n, NUM_HEADS, head_dim), jnp.bfloat16)
  k = jax.random.normal(kk, (batch, n, NUM_KV_HEADS, head_dim), jnp.bfloat16)
  v = jax.random.normal(kv, (batch, n, NUM_KV_HEADS, head_dim), jnp.bfloat16)
  d_out = jax.random.normal(kd, q.shape, jnp.bfloat16)
  cases = {}
  for round_ in (1, 2):
    for label, package in packages.items():
      cases[f"{label}#{round_}"] = (
          (_forward_and_backward(package), (q, k, v, d_out)) if train else
          (functools.partial(package.prefill_attention, is_causal=True), (q, k, v)))
  timings = timing.device_times_us(cases, log=log)
  flops = 4 * batch * n * n * head_dim * NUM_HEADS / 2 * (3.5 if train else 1.0)
  row = {"batch": batch, "n": n, "d": head_dim}
  for label in packages:
    times = [t.us for name, t in timings.items()
             if name.startswith(f"{label}#") and isinstance(t, timing.Timing)]
    row[f"{label}_us"] = min(times) if times else None
    row[f"{label}_tflops"] = flops / min(times) / 1e6 if times else None
  base, tree = (row.get(f"{label}_us") for label in packages)
  row["tree_over_rev"] = tree / base if base and tree else None
  return row


def main(argv=None):
  p = bench_arguments(__doc__, smoke="a tiny CPU run (interpret mode) against HEAD", time_limit_s=300.0)
  p.add_argument("--rev", default="HEAD", help="the earlier commit (any git revision)")
  p.add_argument("--sizes", default="2048,4096,8192,16384", help="batch-1 lengths, then 4 x 4096")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--train", action="store_true", help="time forward + backward (jax.grad)")
  p.add_argument("--archive", type=Path, default=None,
                 help="a tar of `git archive REV jaxflash`, for a copy of the tree without its history")
  args = p.parse_args(argv)
  args.quick = False
  limit = TimeLimit(args.time_limit_s)
  name = "train_ab" if args.train else "prefill_ab"
  meta, out_dir = begin_run(name, args, **(dict(matmul_n=256, hbm_gib=1 / 64) if args.smoke
                                                    else dict(matmul_n=8192, hbm_gib=4.0)))
  if not args.smoke and args.out is None:
    out_dir = STUDIES_DIR
  import jaxflash
  packages = {args.rev: package_at(args.rev, args.archive), "tree": jaxflash}
  meta["title"] = (f"{'Forward + backward' if args.train else 'Prefill'} at {args.rev} against the "
                   "working tree, one process")
  shapes = ([(1, 64)] if args.smoke else
            [(1, int(n)) for n in args.sizes.split(",")] + [(4, 4096)])
  rows, notes = [], []
  for batch, n in shapes:
    if limit.exhausted():
      notes.append(f"{batch} x {n}: skipped (time limit)")
      continue
    rows.append(ab_row(n, batch, args.head_dim, packages, args.train))
    log(f"[{limit.elapsed():6.1f}s] {batch} x {n}: {args.rev} {rows[-1][f'{args.rev}_us']} us, "
        f"tree {rows[-1]['tree_us']} us, tree / rev {rows[-1]['tree_over_rev']}")
    write_results(name, rows, meta,
                  [("batch", "B"), ("n", "n"), ("d", "d"),
                   (f"{args.rev}_tflops", f"{args.rev} TFLOP/s", "{:.0f}"),
                   ("tree_tflops", "tree TFLOP/s", "{:.0f}"),
                   ("tree_over_rev", "tree time ÷ rev time", "{:.3f}")],
                  out_dir=out_dir, notes=notes)
  return rows


if __name__ == "__main__":
  main()
