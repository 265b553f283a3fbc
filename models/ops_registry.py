"""The single registry of pure attention ops (DESIGN.md section 3), read by models/ and scripts/benchmark.py.

Each entry names a pure function `fn(q, k, v, *, causal, mask=None, **params) -> out` and how to choose its plan
parameters for a sequence length when a config or the benchmark says "auto". Modules in models/ wrap these ops;
ops that need state or randomness (routing, YOSO) register here with `params` producing that input explicitly.
Later issues add their ops with one `register(...)` call in their own package (see `_PROVIDERS`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any


def sqrt_pow2(length: int) -> int:
  """Block/row size ~ sqrt(L) rounded up to a power of two (L=8192 -> 128; L=16384 -> 128)."""
  return 1 << ((max(length, 1).bit_length() - 1 + 1) // 2)


@dataclasses.dataclass(frozen=True)
class OpSpec:
  name: str
  fn: Callable[..., Any]
  causal: bool = True  # supports causal=True
  bidirectional: bool = True  # supports causal=False
  params: Callable[[int], dict[str, Any]] = lambda length: {}
  description: str = ""


OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
  if spec.name in OPS:
    raise ValueError(f"attention op {spec.name!r} is already registered")
  OPS[spec.name] = spec
  return spec


# Packages that register ops when imported. A package that is not importable yet is skipped, so the registry
# works at every stage of the project's growth.
_PROVIDERS = ("baselines.registry", "combiner.registry", "routing.registry", "yoso.registry")
_loaded = False


def _load() -> None:
  global _loaded
  if _loaded:
    return
  _loaded = True
  for module in _PROVIDERS:
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name != module:  # a real missing dependency inside the provider must not be hidden
        raise


def get(name: str) -> OpSpec:
  _load()
  if name not in OPS:
    raise ValueError(f"unknown attention op {name!r}; registered: {sorted(OPS)}")
  return OPS[name]


def takes_implementation(spec: OpSpec) -> bool:
  """Whether the op takes `implementation` ("auto" | "xla" | an accelerated kernel), read from its signature."""
  return "implementation" in inspect.signature(spec.fn).parameters


def names() -> list[str]:
  _load()
  return sorted(OPS)
