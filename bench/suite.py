"""The benchmark suite as one table: each benchmark, the shapes it runs (one command line
each) and the providers its table compares. `python -m bench` runs it (bench/__main__.py).

A peer provider (FlashAttention-3, tokamax) joins a benchmark's table when its package
imports on the machine; jaxflash's own providers and JAX's always do. A benchmark whose
script takes the provider list (`providers_flag`) is given the available ones.
"""
from __future__ import annotations

import dataclasses
import importlib.util

# Providers that are packages outside JAX: the module each needs.
PEER_MODULES = {"fa3": "flash_attn3_jax", "tokamax": "tokamax"}


@dataclasses.dataclass(frozen=True)
class Shape:
  """One run of a benchmark: a label and the script's options for it."""
  label: str
  argv: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Entry:
  """A row of the suite. name: what --only selects; module: the script (its main(argv) runs one shape);
  results: the stems of the result files it writes; providers: its table's contenders;
  providers_flag / providers_sep: how its script takes a subset of them; quick: whether the
  script has --quick; min_devices: GPUs it needs (fewer: not run, said so)."""
  name: str
  module: str
  results: tuple[str, ...]
  shapes: tuple[Shape, ...] = (Shape("default"),)
  providers: tuple[str, ...] = ()
  providers_flag: str | None = None
  providers_sep: str = " "
  quick: bool = True
  min_devices: int = 1

  def available_providers(self) -> tuple[str, ...]:
    return tuple(p for p in self.providers
                 if p not in PEER_MODULES or importlib.util.find_spec(PEER_MODULES[p]) is not None)

  def argv(self, shape: Shape, *, quick: bool = False, smoke: bool = False,
           out: str | None = None) -> list[str]:
    """The script's command line for one shape."""
    argv = list(shape.argv)
    if quick and self.quick:
      argv.append("--quick")
    if smoke:
      argv.append("--smoke")
    if out is not None:
      argv += ["--out", out]
    if self.providers_flag is not None:
      chosen = self.available_providers()
      argv += ([self.providers_flag, *chosen] if self.providers_sep == " "
               else [self.providers_flag, self.providers_sep.join(chosen)])
    return argv


_PREFILL_PROVIDERS = ("jaxflash", "jaxflash_triton", "jaxflash_mosaic", "cudnn", "fa3", "tokamax",
                      "pallas_mha", "xla", "naive")
_TRAIN_PROVIDERS = ("jaxflash", "jaxflash_default", "jaxflash_mosaic_bwd", "cudnn", "fa3", "tokamax",
                    "pallas_mha", "xla")

SUITE: tuple[Entry, ...] = (
    Entry("accuracy", "bench.accuracy", ("accuracy",)),
    Entry("prefill", "bench.prefill",
              ("prefill", "prefill_memory", "prefill_sweep", "prefill_d64", "prefill_d64_memory",
               "prefill_d256", "prefill_d256_memory"),
              shapes=(Shape("d128"), Shape("d64", ("--head-dim", "64", "--no-sweep")),
                      Shape("d256", ("--head-dim", "256", "--no-sweep"))),
              providers=_PREFILL_PROVIDERS, providers_flag="--impls"),
    Entry("windowed", "bench.windowed", ("windowed",), providers=("jaxflash", "cudnn", "jaxflash_no_window")),
    Entry("train", "bench.train", ("train", "train_memory", "train_step", "train_sweep", "train_packed",
                                   "train_d64", "train_d64_memory", "train_d256", "train_d256_memory"),
              shapes=(Shape("d128", ("--packed",)), Shape("d64", ("--head-dim", "64")),
                      Shape("d256", ("--head-dim", "256"))),
              providers=_TRAIN_PROVIDERS, providers_flag="--impls", providers_sep=","),
    Entry("decode", "bench.decode", ("decode", "decode_splits", "decode_paged_stages"),
              providers=("jaxflash", "jaxflash_paged16", "jaxflash_paged256", "cudnn", "xla", "naive",
                         "pallas_gqa", "pallas_paged16", "pallas_paged256")),
    Entry("paged_prefill", "bench.paged_prefill", ("paged_prefill",), providers=("jaxflash",)),
    Entry("generate", "bench.generate", ("generate", "generate_loop_sweep"),
              providers=("jaxflash paged", "jaxflash", "cudnn", "xla", "hf")),
    Entry("serve", "bench.serve", ("serve",),
          providers=("engine", "engine_no_prefix", "engine_no_chunking", "static")),
    Entry("generate_tp", "bench.generate_tp", ("generate_tp",), quick=False, min_devices=2),
)


def select(only: str | None) -> list[Entry]:
  """The benchmarks named in `only` (comma-separated; None: all), in the suite's order."""
  if not only:
    return list(SUITE)
  names = [n.strip() for n in only.split(",") if n.strip()]
  known = {b.name for b in SUITE}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"--only names unknown benchmarks {unknown}; the suite has {sorted(known)}")
  return [b for b in SUITE if b.name in names]
