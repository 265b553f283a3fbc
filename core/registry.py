"""The registry of pure attention ops: name -> function, supported directions and plan parameters.

Each entry names a pure function `fn(q, k, v, *, causal, mask=None, **params) -> out` and how to choose its
plan parameters for a sequence length when a config or the benchmark says "auto". Each op package registers
its ops in its own `registry` module; `models.ops_registry` imports all of them, and models/ and scripts/ read
it there. Ops that need state or randomness (routing, YOSO) register with `params` producing that input
explicitly.
"""

from __future__ import annotations

import dataclasses
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
  decode: Any = None  # core.decode.Decoder: the op's cached incremental form (causal ops that have one)


OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
  if spec.name in OPS:
    raise ValueError(f"attention op {spec.name!r} is already registered")
  OPS[spec.name] = spec
  return spec


def get(name: str) -> OpSpec:
  if name not in OPS:
    raise ValueError(f"unknown attention op {name!r}; registered: {sorted(OPS)}")
  return OPS[name]


def takes_implementation(spec: OpSpec) -> bool:
  """Whether the op takes `implementation` ("auto" | "xla" | an accelerated kernel), from its signature."""
  return "implementation" in inspect.signature(spec.fn).parameters


def names() -> list[str]:
  return sorted(OPS)
