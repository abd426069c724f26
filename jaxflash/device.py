"""What the kernels need to know about the GPU they run on.

`device_info()` describes the current device: its compute capability, SM count and the
shared memory one program (CUDA block) may use. The compute capability and SM count come
from JAX's device object (`compute_capability`, `core_count`). JAX does not expose the
shared-memory limit, so it comes from a table of NVIDIA's per-architecture opt-in maxima
(CUDA C Programming Guide, "Technical Specifications per Compute Capability"); the table
is also the documented fallback for any property JAX leaves out. Without a GPU (interpret
mode) the kernels are configured as for an H200, the card they were tuned on.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

KIB = 1024

# Opt-in shared memory per block, bytes, by compute capability.
_SMEM_PER_BLOCK = {
    (8, 0): 163 * KIB,  # A100
    (8, 6): 99 * KIB,  # RTX 30xx, A10, A40
    (8, 7): 163 * KIB,  # Jetson Orin
    (8, 9): 99 * KIB,  # Ada: RTX 40xx, L4, L40
    (9, 0): 227 * KIB,  # Hopper: H100, H200
    (10, 0): 227 * KIB,  # Blackwell datacenter
    (12, 0): 99 * KIB,  # Blackwell consumer
}
_GENERATIONS = {8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """The facts about a GPU that the kernels' configuration depends on."""

  name: str
  compute_capability: tuple[int, int]
  sm_count: int
  smem_per_block: int  # bytes one program may use (opt-in maximum)

  @property
  def generation(self) -> str:
    """'ampere', 'ada', 'hopper' or 'blackwell': the key of the config tables."""
    if self.compute_capability == (8, 9):
      return "ada"
    return _GENERATIONS.get(self.compute_capability[0], "ampere")


# Reference points: the card we tune on, and the laptop GPU of "Writing an Attention Kernel: FlashAttention and Decode in Triton".
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 227 * KIB)
RTX_4060_LAPTOP = DeviceInfo("NVIDIA GeForce RTX 4060 Laptop GPU", (8, 9), 24, 99 * KIB)
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 163 * KIB)
RTX_3090 = DeviceInfo("NVIDIA GeForce RTX 3090", (8, 6), 82, 99 * KIB)


def _parse_capability(value) -> tuple[int, int] | None:
  try:
    major, minor = str(value).split(".")[:2]
    return int(major), int(minor)
  except (TypeError, ValueError):
    return None


@functools.cache
def _info_for(device) -> DeviceInfo:
  if device.platform != "gpu":
    return H200
  capability = _parse_capability(getattr(device, "compute_capability", None)) or (9, 0)
  sm_count = int(getattr(device, "core_count", 0) or 0) or H200.sm_count
  smem = _SMEM_PER_BLOCK.get(capability) or _SMEM_PER_BLOCK.get((capability[0], 0), 99 * KIB)
  return DeviceInfo(getattr(device, "device_kind", "GPU"), capability, sm_count, smem)


def device_info(device: jax.Device | None = None) -> DeviceInfo:
  """Describes `device` (default: JAX's first device); an H200 when there is no GPU."""
  return _info_for(device if device is not None else jax.devices()[0])
