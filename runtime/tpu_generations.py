"""Cloud TPU generations: every fact about them the project uses, in one table.

Read by the launcher (scripts/tpu.py: gcloud's names, software images, hosts per slice), the ahead-of-time
compiler (scripts/compile_tpu.py: HBM, peak FLOP/s and bandwidth, the slice shapes it compiles for) and the
throughput report (training/throughput.py: the peak FLOP/s behind MFU, found by JAX's `device_kind`).

Figures per chip, one JAX device (v4 and v5p chips are "megacore": both TensorCores form one device), dense
bf16 without sparsity, from the Cloud TPU system architecture pages. A generation without slice shapes (v2,
v3) is launched but not compiled ahead of time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Generation:
  name: str  # what people and JAX's topologies call it ("v5e")
  gcloud: str  # the accelerator-type prefix gcloud expects ("v5litepod")
  device_kinds: tuple[str, ...]  # prefixes of JAX's `device_kind`, lowercase
  runtime: str  # the TPU VM image (cloud.google.com/tpu/docs/runtimes), Ubuntu 22.04
  counts_cores: bool  # accelerator-type names count TensorCores (two per chip), not chips
  per_host: int  # the name's count per host
  single_host: int  # the largest count on one host
  hbm_bytes: int | None = None
  peak_flops: float | None = None  # FLOP/s
  hbm_bandwidth: float | None = None  # bytes/s
  shapes: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # chips -> slice shape

  @property
  def compile_check(self) -> bool:
    """Whether scripts/compile_tpu.py models it (it knows its slice shapes and memory)."""
    return bool(self.shapes)

  @property
  def megacore(self) -> bool:
    return self.counts_cores  # v4 and v5p: one JAX device per chip (both TensorCores)

  def slice_name(self, chips: int) -> str:
    return f"{self.name}-{chips * 2 if self.counts_cores else chips}"


_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
              256: (16, 16)}
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16)}
# In `device_kind` matching order: "tpu v5" (how v5p reports itself) after v5e's "tpu v5 lite".
GENERATIONS = {g.name: g for g in (
    Generation("v2", "v2", ("tpu v2",), "tpu-ubuntu2204-base", True, 8, 8),
    Generation("v3", "v3", ("tpu v3",), "tpu-ubuntu2204-base", True, 8, 8),
    Generation("v4", "v4", ("tpu v4",), "tpu-ubuntu2204-base", True, 8, 8, 32 * GiB, 275e12, 1.2e12,
               _SHAPES_3D),
    Generation("v5e", "v5litepod", ("tpu v5 lite", "tpu v5e"), "v2-alpha-tpuv5-lite", False, 4, 8, 16 * GiB,
               197e12, 819e9, _SHAPES_2D),
    Generation("v5p", "v5p", ("tpu v5p", "tpu v5"), "v2-alpha-tpuv5", True, 8, 8, 95 * GiB, 459e12, 2.765e12,
               _SHAPES_3D),
    Generation("v6e", "v6e", ("tpu v6 lite", "tpu v6e"), "v2-alpha-tpuv6e", False, 4, 8, 32 * GiB, 918e12,
               1.64e12, _SHAPES_2D),
)}


def find(name: str) -> Generation | None:
  """The generation `name` means, by its own name or gcloud's prefix (v5e = v5litepod); None if none."""
  name = name.strip().lower()
  return next((g for g in GENERATIONS.values() if name in (g.name, g.gcloud)), None)


def names() -> list[str]:
  """Every name `find` takes."""
  return sorted({n for g in GENERATIONS.values() for n in (g.name, g.gcloud)})


def of_device(device_kind: str) -> Generation | None:
  """The generation of a JAX device (`device.device_kind`, e.g. "TPU v5 lite"); None for other devices."""
  kind = device_kind.strip().lower()
  return next((g for g in GENERATIONS.values() if any(kind.startswith(k) for k in g.device_kinds)), None)
