"""The attention registry: one registration per attention name, holding everything the code looks up by name.

A registration (`OpSpec`) names
  fn            the pure op `fn(q, k, v, *, causal, mask=None, **params) -> out` (docs/design.md section 3);
  causal, bidirectional   the directions it supports;
  params        `params(L)`: its automatic plan parameters for a sequence length L (what "auto" means in a
                config); plan parameters only, never arrays or keys;
  module        the Flax module that wraps it in a model, as an import path "package.module:Class" resolved by
                `models.registry` (None = `models.attention.OpAttention`, projections + op); the module class
                declares its own config fields (`FIELDS`);
  decode        its cached incremental form (an `attention_core.decode.Decoder`, causal ops that have one);
  seq_parallel  its sequence-parallel form (same signature, the sequence split over the mesh's "seq" axis),
                or None: the partitioner then gathers the sequence;
  bench_inputs  `bench_inputs(L, **shape)`: the op arguments that a model owns (random weights, keys) as fixed
                stand-ins for the benchmark and the op-level tests; may name `batch`, `heads`, `head_dim`,
                `value_dim`, `dtype` to receive them.

Each op package registers its attentions in its own `registry` module (`register(OpSpec(...))`); the
packages are listed once, in `OP_PACKAGES`, and `load()` imports their registrations. Op packages import this
module, never the other way round: the package names here are data, imported by name on first lookup.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from attention_core import contract

# The op packages whose `registry` modules register attentions (a new package adds its name here).
OP_PACKAGES = ("attention_baselines", "combiner", "routing", "yoso")


def sqrt_pow2(length: int) -> int:
  """Block/row size ~ sqrt(L) rounded up to a power of two (L=8192 -> 128; L=16384 -> 128)."""
  return 1 << ((max(length, 1).bit_length() - 1 + 1) // 2)


def _nothing(length: int) -> dict[str, Any]:
  return {}


@dataclasses.dataclass(frozen=True)
class OpSpec:
  name: str
  fn: Callable[..., Any]
  causal: bool = True  # supports causal=True
  bidirectional: bool = True  # supports causal=False
  params: Callable[[int], dict[str, Any]] = _nothing  # automatic plan parameters for a length
  description: str = ""
  decode: Any = None  # attention_core.decode.Decoder: the op's cached incremental form (causal ops that have
                      # one)
  module: str | None = None  # "package.module:Class" of its Flax module; None = models.attention.OpAttention
  seq_parallel: Callable[..., Any] | None = None  # the sequence-parallel form, if it has one
  bench_inputs: Callable[..., dict[str, Any]] = _nothing  # model-owned arguments as benchmark stand-ins


OPS: dict[str, OpSpec] = {}
_loaded = False


def load() -> None:
  """Imports every op package's registrations (idempotent)."""
  global _loaded
  if not _loaded:
    _loaded = True
    for package in OP_PACKAGES:
      importlib.import_module(f"{package}.registry")


def register(spec: OpSpec) -> OpSpec:
  if spec.name in OPS:
    raise ValueError(f"attention op {spec.name!r} is already registered")
  OPS[spec.name] = spec
  return spec


def get(name: str) -> OpSpec:
  load()
  if name not in OPS:
    raise ValueError(f"unknown attention op {name!r}; registered: {sorted(OPS)}")
  return OPS[name]


def takes_implementation(spec: OpSpec) -> bool:
  """Whether the op takes `implementation` ("auto" | "xla" | an accelerated kernel), from its signature."""
  return "implementation" in inspect.signature(spec.fn).parameters


# The arguments that choose an op's fused path: argument -> (the XLA value the fused values are checked
# against, allowed values that are XLA formulations rather than kernels, whether the causal form runs the
# kernels). YOSO's causal form is sorted running sums on every backend (yoso.attention), so its kernels are
# bidirectional only.
FUSED_ARGUMENTS = {"implementation": ("xla", (), True),
                   "formulation": ("sorted", ("onehot",), False)}
ALL_PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class FusedPath:
  """How an op's accelerated paths are chosen and checked (`fused_path`)."""
  argument: str  # "implementation" or "formulation"
  reference: str  # the XLA value every other value must equal
  values: tuple[str, ...]  # every allowed value but "auto" and the reference
  kernels: tuple[str, ...]  # those of `values` that run fused kernels (Pallas, Mosaic, Triton, cuDNN)
  causal: bool  # whether the causal form runs them
  platforms: dict[str, tuple[str, ...]]  # value -> the platforms it runs on (CPU: interpret mode)

  def values_on(self, platform: str) -> tuple[str, ...]:
    return tuple(v for v in self.values if platform in self.platforms.get(v, ALL_PLATFORMS))


def fused_path(spec: OpSpec) -> FusedPath | None:
  """The op's accelerated paths, or None when it has none. Read from the op: the argument among
  FUSED_ARGUMENTS its signature takes, the allowed values its module declares (`IMPLEMENTATIONS`,
  `FORMULATIONS`; attention_core.contract's by default, or a module it imports), and per value the platforms
  it runs on (`IMPLEMENTATION_PLATFORMS` / `FORMULATION_PLATFORMS`, default every platform). So a new op
  with a kernel is checked and compiled by the tools without being named in them."""
  parameters = inspect.signature(spec.fn).parameters
  module = importlib.import_module(getattr(spec.fn, "func", spec.fn).__module__)  # partial plans
  for argument, (reference, not_kernels, causal) in FUSED_ARGUMENTS.items():
    if argument not in parameters:
      continue
    allowed = _declared(module, argument.upper() + "S", argument)
    values = tuple(v for v in allowed if v not in ("auto", reference))
    platforms = _declared(module, argument.upper() + "_PLATFORMS", None) or {}
    return FusedPath(argument, reference, values, tuple(v for v in values if v not in not_kernels), causal,
                     dict(platforms))
  return None


def _declared(module: Any, attribute: str, argument: str | None) -> Any:
  """`attribute` of the op's module, else of a module it imports (yoso.tables' FORMULATIONS), else
  attention_core.contract's IMPLEMENTATIONS for `implementation`; None when nothing declares it and
  `argument` is None."""
  if hasattr(module, attribute):
    return getattr(module, attribute)
  for value in vars(module).values():
    if inspect.ismodule(value) and value.__name__.split(".")[0] == module.__name__.split(".")[0] \
        and hasattr(value, attribute):
      return getattr(value, attribute)
  if argument == "implementation":
    return contract.IMPLEMENTATIONS
  if argument is None:
    return None
  raise ValueError(f"{module.__name__}: no allowed values of {argument!r} found ({attribute})")


def fused_ops() -> dict[str, FusedPath]:
  """{name: FusedPath} of every registered op with an accelerated path."""
  return {name: path for name in names() if (path := fused_path(OPS[name])) is not None}


def names() -> list[str]:
  load()
  return sorted(OPS)


def _call_named(fn: Callable[..., dict[str, Any]], length: int, shape: dict[str, Any]) -> dict[str, Any]:
  try:
    accepted = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    accepted = {}
  return dict(fn(length, **{k: v for k, v in shape.items() if k in accepted}))


def bench_params(spec: OpSpec, length: int, **shape: Any) -> dict[str, Any]:
  """Every op argument for a standalone call at `length` (benchmark, op-level tests): `params(L)` plus
  `bench_inputs(L)`, each receiving the keywords among `shape` (batch, heads, head_dim, value_dim, dtype)
  its signature names."""
  out = _call_named(spec.params, length, shape)
  inputs = getattr(spec, "bench_inputs", None)
  return {**out, **(_call_named(inputs, length, shape) if inputs is not None else {})}
