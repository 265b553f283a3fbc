"""The model side of the attention registry: a config name -> its Flax NNX module class, its config fields and
plan parameters.

Every attention has one registration, in `attention_core.registry` (written in its package's `registry.py`).
This module reads the module side of it: `OpSpec.module` ("package.module:Class", imported on first use; None
= `models.attention.OpAttention`) and what the class declares (`FIELDS`, `CONTEXT`, `PLAN`). How to add an
attention, and the module contract (constructor, call, randomness, state, auxiliary losses), are in
docs/design.md section 5.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import ml_collections

from attention_core import registry as ops_registry
from models import attention

# Names with a module and no pure op (`register_module`); every other name is a registered op.
MODULES: dict[str, type] = {}


def register_module(name: str, cls: type) -> type:
  """Maps the config name `name`, which has no registered op, to the module class `cls` (the module contract:
  docs/design.md section 5); the class declares what it reads and takes (`FIELDS`, `CONTEXT`, `MEMORY`...)."""
  if name in MODULES or name in ops_registry.names():
    raise ValueError(f"attention module {name!r} is already registered")
  MODULES[name] = cls
  return cls


def _module_class(path: str | None) -> type:
  """The class named by a registration's "package.module:Class" (None = OpAttention)."""
  if path is None:
    return attention.OpAttention
  module, _, cls = path.partition(":")
  return getattr(importlib.import_module(module), cls)


def names() -> list[str]:
  """Every attention name a config may use: every registered op plus the model-only modules."""
  return sorted(set(MODULES) | set(ops_registry.names()))


def get_module(name: str) -> type:
  if name in MODULES:
    return MODULES[name]
  if name in ops_registry.names():
    return _module_class(ops_registry.get(name).module)
  raise ValueError(f"unknown attention {name!r}; valid names: {names()}")


def module_fields(cls: type) -> dict[str, attention.Field]:
  """The extra `config.model.attention` fields (beyond attention.COMMON_FIELDS) a module class reads, as it
  declares them in `cls.FIELDS` ({name: attention.Field})."""
  return dict(cls.FIELDS)


def plan_of(config_attention: Any) -> tuple[Mapping[str, ops_registry.Param], tuple[str, ...]] | None:
  """(plan parameters, model inputs) of the configured attention: its module's `PLAN` where it declares one,
  else its op's registration; None for a module-only name without a `PLAN`."""
  name = str(config_attention.name)
  cls = get_module(name)
  if cls.PLAN is not None:
    return cls.PLAN, ()
  op = str(config_attention.get("op", None) or name)
  if op not in ops_registry.names():
    return None
  spec = ops_registry.get(op)
  return spec.plan, spec.inputs


def configurable_fields(name: str) -> tuple[str, ...]:
  """The `config.model.attention` fields the module for `name` reads (common ones first)."""
  return tuple(f for f in attention.COMMON_FIELDS if f != "name") + tuple(module_fields(get_module(name)))


def check_fields(config_attention: Any) -> None:
  """Unknown fields, options set for a module that does not read them, values outside a field's declaration
  (its kind and bounds), and plan parameters the attention does not declare or of another kind are config
  errors (ValueError naming the field)."""
  name = str(config_attention.name)
  known = set(attention.COMMON_FIELDS) | {"op"}
  for other in names():  # every field some registered module reads
    known |= set(module_fields(get_module(other)))
  own = set(configurable_fields(name)) | {"name", "op"}
  declared = module_fields(get_module(name)) if name in names() else {}
  for key in config_attention.keys():
    if key not in known:
      raise ValueError(f"config.model.attention has unknown field {key!r}; valid fields: {sorted(known)}")
    value = config_attention[key]
    if key not in own and value not in (None, False):
      raise ValueError(f"config.model.attention.{key}={value!r}: attention {name!r} does not read it; "
                       f"its fields: {sorted(own)}")
    if key in declared and not attention.is_auto(value):
      declared[key].check(key, value)
  declared_plan = plan_of(config_attention) if name in names() else None
  if declared_plan is not None:
    attention.plan_params(config_attention, declared_plan[0], name, declared_plan[1])


def build(config_attention: Any, *, layer: int | None = None, num_layers: int | None = None,
          seq_len: int | None = None, **kwargs: Any) -> Any:
  """Instantiates the module named by `config_attention.name` (after checking its fields).

  Model facts, passed only to modules that declare them: the ones named in the class's `CONTEXT` among
  `layer`, `num_layers` (per-layer choices such as routing layers) and those in `kwargs` beyond the module
  contract (`mem_len`, `compressed_mem_len`), and `seq_len` written into a copy of the config when the module
  declares a `seq_len` field the config leaves unset (state shaped at construction, e.g. centroids)."""
  cls = get_module(str(config_attention.name))
  check_fields(config_attention)
  if seq_len is not None and "seq_len" in cls.FIELDS and config_attention.get("seq_len") is None:
    config_attention = ml_collections.ConfigDict(config_attention.to_dict())
    config_attention.seq_len = int(seq_len)
  context = {"layer": layer, "num_layers": num_layers, **{k: kwargs.pop(k) for k in CONTEXT if k in kwargs}}
  return cls(config_attention, **kwargs, **{k: v for k, v in context.items() if k in cls.CONTEXT})


# The model facts a module may declare in its `CONTEXT`.
CONTEXT = ("layer", "num_layers", "mem_len", "compressed_mem_len")
