"""The attention registry: one registration per attention name, declaring all the code looks up by name.

A registration (`OpSpec`) declares, where the op is registered, what the op is and can do; nothing is read
from its signature or its module (tests/attention_core/test_registry.py holds every registration against its
function):
  fn            the pure op `fn(q, k, v, *, causal, mask=None, **params) -> out` (docs/design.md section 3);
  causal, bidirectional   the directions it supports;
  plan          its plan parameters, {name: Param}: what a config may set under `model.attention.params`;
  params        `params(L)`: the automatic values of some of them for a sequence length L (what "auto" means
                in a config);
  inputs        the arguments the model supplies (weights, keys, DeepSets pools `pool_q`/`pool_k`, a learned
                `span_key_fn`): never config values;
  fused         its accelerated path (`FusedPath`: the argument that chooses it, its values and platforms), or
                None; `PALLAS` is the common `implementation="auto" | "xla" | "pallas"`;
  memory        k, v and the mask may hold M memory positions before the L of q (segment recurrence);
  module        the Flax module that wraps it in a model, as an import path "package.module:Class" resolved by
                `models.registry` (None = `models.attention.OpAttention`, projections + op);
  decode        its cached incremental form (an `attention_core.decode.Decoder`, causal ops that have one);
  seq_parallel  its sequence-parallel form (same signature, the sequence split over the mesh's "seq" axis),
                or None: the partitioner then gathers the sequence;
  bench_inputs  `bench_inputs(L, shape)`: fixed stand-ins for `inputs` (random weights, keys) for the
                benchmark and the op-level tests; `shape` is a `Shape` (batch, heads, head_dim, value_dim,
                dtype).

Each op package registers its attentions in its own `registry` module (`register(OpSpec(...))`); the
packages are listed once, in `OP_PACKAGES`, and `load()` imports their registrations. Op packages import this
module, never the other way round: the package names here are data, imported by name on first lookup.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from attention_core import contract

# The op packages whose `registry` modules register attentions (a new package adds its name here).
OP_PACKAGES = ("attention_baselines", "combiner", "routing", "yoso")
ALL_PLATFORMS = tuple(contract.PLATFORMS)


def sqrt_pow2(length: int) -> int:
  """Block/row size ~ sqrt(L) rounded up to a power of two (L=8192 -> 128; L=16384 -> 128)."""
  return 1 << ((max(length, 1).bit_length() - 1 + 1) // 2)


# -----------------------------------------------------------------------------------------------------------
# Declarations

_KINDS = {bool: "a bool", int: "an int", float: "a number", str: "a string", tuple: "a tuple"}


def check_kind(value: Any, kind: type, *, name: str, minimum: float | None = None,
               maximum: float | None = None, optional: bool = False, note: str = "") -> None:
  """One rule for a declared value (plan parameters here, module fields in models/attention.py): `kind`
  (an int passes for a float, a list for a tuple; None where `optional`) and the bounds; a ValueError naming
  `name` otherwise."""
  if value is None and optional:
    return
  if kind is bool:
    ok = isinstance(value, bool)
  elif kind in (int, float):
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
  else:
    ok = isinstance(value, (tuple, list) if kind is tuple else kind)
  note = f" ({note})" if note else ""
  if not ok:
    what = _KINDS.get(kind, kind.__name__) + (" or None" if optional else "")
    raise ValueError(f"{name} must be {what}{note}, got {value!r}")
  if minimum is not None and kind in (int, float) and value < minimum:
    raise ValueError(f"{name} must be >= {minimum:g}{note}, got {value!r}")
  if maximum is not None and kind in (int, float) and value > maximum:
    raise ValueError(f"{name} must be <= {maximum:g}{note}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Param:
  """A plan parameter's kind: what a config may set it to. "auto" (the op's `params(L)`) is checked by the
  model, the op itself checks what depends on other values (choices, divisibility)."""

  kind: type = int  # bool | int | float | str | tuple
  minimum: float | None = None
  optional: bool = False  # None (the op's own default) is allowed

  def check(self, value: Any, *, name: str) -> None:
    check_kind(value, self.kind, name=name, minimum=self.minimum, optional=self.optional)


INT, POSITIVE, FLOAT, TEXT, FLAG, TUPLE = Param(int), Param(int, 1), Param(float), Param(str), Param(bool), \
    Param(tuple)
CHUNKS = Param(int, 1, optional=True)  # query_chunks / row_chunks: None = the op's memory-bounded choice


@dataclasses.dataclass(frozen=True)
class FusedPath:
  """An op's accelerated path: the argument that chooses it, its values, and where each runs."""

  argument: str  # "implementation" (a config field) or a plan parameter ("formulation")
  reference: str  # the XLA value every other value must equal
  values: tuple[str, ...]  # every allowed value but "auto" and the reference
  kernels: tuple[str, ...]  # those of `values` that run fused kernels (Pallas, Mosaic, Triton, cuDNN)
  causal: bool  # whether the causal form runs them
  platforms: Mapping[str, tuple[str, ...]]  # value -> the platforms it runs on (CPU: interpret mode)

  @classmethod
  def declare(cls, allowed: Iterable[str], *, argument: str = "implementation", reference: str = "xla",
              xla: tuple[str, ...] = (), causal: bool = True,
              platforms: Mapping[str, tuple[str, ...]] | None = None) -> FusedPath:
    """The path of an op whose `argument` takes `allowed` ("auto", the reference, the rest); `xla`: values
    among them that are XLA formulations rather than kernels."""
    values = tuple(v for v in allowed if v not in ("auto", reference))
    return cls(argument, reference, values, tuple(v for v in values if v not in xla), causal,
               dict(platforms or {}))

  @property
  def allowed(self) -> tuple[str, ...]:
    return ("auto", self.reference, *self.values)

  def values_on(self, platform: str) -> tuple[str, ...]:
    return tuple(v for v in self.values if platform in self.platforms.get(v, ALL_PLATFORMS))


PALLAS = FusedPath.declare(contract.IMPLEMENTATIONS)  # implementation = "auto" | "xla" | "pallas", everywhere


class Shape(NamedTuple):
  """The shape `bench_inputs` makes stand-ins for."""

  batch: int = 1
  heads: int = 1
  head_dim: int = 64
  value_dim: int | None = None  # None = head_dim
  dtype: Any = "float32"


def _no_params(length: int) -> dict[str, Any]:
  return {}


def _no_inputs(length: int, shape: Shape) -> dict[str, Any]:
  return {}


@dataclasses.dataclass(frozen=True)
class OpSpec:
  name: str
  fn: Callable[..., Any]
  causal: bool = True  # supports causal=True
  bidirectional: bool = True  # supports causal=False
  params: Callable[[int], dict[str, Any]] = _no_params  # automatic plan parameters for a length
  description: str = ""
  decode: Any = None  # attention_core.decode.Decoder: the cached incremental form (causal ops that have one)
  module: str | None = None  # "package.module:Class" of its Flax module; None = models.attention.OpAttention
  seq_parallel: Callable[..., Any] | None = None  # the sequence-parallel form, if it has one
  bench_inputs: Callable[[int, Shape], dict[str, Any]] = _no_inputs  # stand-ins for `inputs`
  plan: Mapping[str, Param] = dataclasses.field(default_factory=dict)  # config-settable parameters
  inputs: tuple[str, ...] = ()  # arguments the model supplies
  fused: FusedPath | None = None  # the accelerated path, if any
  memory: bool = False  # k, v, mask may hold memory positions before the queries'


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


def names() -> list[str]:
  load()
  return sorted(OPS)


# -----------------------------------------------------------------------------------------------------------
# Reading the declarations


def takes_implementation(spec: OpSpec) -> bool:
  """Whether the op takes `implementation` ("auto" | "xla" | an accelerated kernel)."""
  return spec.fused is not None and spec.fused.argument == "implementation"


def fused_path(spec: OpSpec) -> FusedPath | None:
  """The op's accelerated path as its registration declares it (None: it has none), so a new op with a
  kernel is checked and compiled by the tools without being named in them."""
  return spec.fused


def fused_ops() -> dict[str, FusedPath]:
  """{name: FusedPath} of every registered op with an accelerated path."""
  return {name: spec.fused for name in names() if (spec := OPS[name]).fused is not None}


def bench_params(spec: OpSpec, length: int, **shape: Any) -> dict[str, Any]:
  """Every op argument for a standalone call at `length` (benchmark, op-level tests): `params(L)` plus
  `bench_inputs(L, Shape(**shape))` (shape: batch, heads, head_dim, value_dim, dtype)."""
  return {**spec.params(length), **spec.bench_inputs(length, Shape(**shape))}
