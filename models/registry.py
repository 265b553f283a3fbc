"""The model side of the attention registry: a config name -> its Flax NNX module class and config fields.

Every attention has one registration, in `attention_core.registry` (written in its package's `registry.py`):
op, directions, automatic plan parameters, module, decoder, sequence-parallel form and benchmark inputs. This
module reads the module side of it: `OpSpec.module` ("package.module:Class", imported on first use; None =
`models.attention.OpAttention`), and the config fields the class declares in its `FIELDS` attribute.

Adding an attention mechanism
=============================
1. A pure op (docs/design.md) registered with `attention_core.registry.register(OpSpec(...))` in
   `<your package>/registry.py` (a new package adds its name to `attention_core.registry.OP_PACKAGES`) is
   usable at once by name through `OpAttention` (projections + op); no module is needed.
2. A mechanism with parameters, state or randomness of its own writes a module in `models/<name>_attention.py`
   (its config fields in the class attribute `FIELDS`, {name: models.attention.Field(kind, help, minimum)})
   and names it in the registration:
   `OpSpec("routing", ..., module="models.routing_attention:RoutingAttention")`.
   `register_module(name, cls)` maps a name with no pure op to a module (model-only attentions, tests).

The module contract
-------------------
    cls(config_attention, *, features, num_heads, head_dim, causal, dtype, rngs)
    module(x, mask, *, deterministic) -> y
  config_attention: the `config.model.attention` ConfigDict (`name`, `params` = plan parameters with
    "auto" = the op's `params(L)`, `dropout_rate`, plus those of the module's own fields the config sets:
    read them with `config.get(field)`, absent or None = the module's default); x: [batch, length, features]
    in `dtype`;
  mask: None or [batch, length] bool (True = real token); y: [batch, length, features]. Subclassing
  `models.attention.AttentionBase` gives the q/k/v/output projections with logical axis names.
  Optional context: a constructor that also names `layer` and/or `num_layers` receives the block's index and
  the depth; a module that declares a `seq_len` field receives the model's sequence length in a copy of its
  config when the config leaves it unset (state shaped at construction).

Randomness: `rngs` is an `nnx.Rngs` with the streams "params", "dropout" and "attention". A module needing
  randomness at call time (hashing, sampling) keeps `self.rng = rngs.attention.fork()` (or `rngs`) and calls
  `self.rng()` in `__call__`. The train step reseeds every "dropout" and "attention" stream from the step key
  (`nnx.reseed`), so steps differ and a resumed run repeats them exactly; eval reseeds with a fixed seed, so
  evaluation is deterministic even for random attention.
Non-gradient state: a module may own `nnx.Variable` subclasses that are not `nnx.Param` (e.g.
  `nnx.BatchStat` or a custom `class EmaState(nnx.Variable)` for centroids). Only `nnx.Param` is
  differentiated; the train step carries the rest through, and the module updates it in place
  (`self.centroids.value = ...`) when called with `deterministic=False` only. That state is replicated (or
  sharded by its `out_sharding` logical axes) and saved in checkpoints with the parameters.
Auxiliary losses: `self.sow(nnx.Intermediate, "aux_loss", value)` with a scalar `value`; the train step adds
  `config.aux_loss_weight * sum(all sown aux_loss values)` to the loss and logs it as `aux_loss`. A penalty
  that carries its own weight (a module config field, e.g. adaptive spans' L1) is sown as `"loss_term"`
  instead and added to the loss as it is.
gin: `configurable_fields(name)` lists the constructor fields gin may bind for ablations (see
  `models.gin_bridge`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import ml_collections

from attention_core import registry as ops_registry
from models import attention

# Names with a module and no pure op (`register_module`); every other name is a registered op.
MODULES: dict[str, type] = {}


def register_module(name: str, cls: type) -> type:
  """Maps the config name `name`, which has no registered op, to the module class `cls` (see the contract
  above); the class declares the extra `config.model.attention` fields it reads in `cls.FIELDS`."""
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
  return dict(getattr(cls, "FIELDS", {}))


def configurable_fields(name: str) -> tuple[str, ...]:
  """The `config.model.attention` fields the module for `name` reads (common ones first)."""
  return tuple(f for f in attention.COMMON_FIELDS if f != "name") + tuple(module_fields(get_module(name)))


_KINDS = {bool: "a bool", int: "an int", float: "a number", str: "a string", tuple: "a tuple"}


def _is_kind(value: Any, kind: type) -> bool:
  if kind is bool:
    return isinstance(value, bool)
  if kind in (int, float):
    return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
  return isinstance(value, (tuple, list) if kind is tuple else kind)


def check_fields(config_attention: Any) -> None:
  """Unknown fields, options set for a module that does not read them, and values outside a field's
  declaration (its kind and minimum) are config errors (ValueError naming the field)."""
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
    field = declared.get(key)
    if field is None or value is None or attention.is_auto(value):
      continue
    if not _is_kind(value, field.kind):
      raise ValueError(f"config.model.attention.{key} must be {_KINDS.get(field.kind, field.kind.__name__)} "
                       f"or None ({field.help}), got {value!r}")
    if field.minimum is not None and field.kind in (int, float) and value < field.minimum:
      raise ValueError(f"config.model.attention.{key} must be >= {field.minimum:g} ({field.help}), "
                       f"got {value!r}")


def build(config_attention: Any, *, layer: int | None = None, num_layers: int | None = None,
          seq_len: int | None = None, **kwargs: Any) -> Any:
  """Instantiates the module named by `config_attention.name` (after checking its fields).

  Optional context, passed only to modules that ask for it: `layer` / `num_layers` when the constructor takes
  them (per-layer choices such as routing layers), and `seq_len` written into a copy of the config when the
  module declares a `seq_len` field the config leaves unset (state shaped at construction, e.g. centroids)."""
  cls = get_module(str(config_attention.name))
  check_fields(config_attention)
  wants_length = "seq_len" in module_fields(cls)
  if seq_len is not None and wants_length and config_attention.get("seq_len") is None:
    config_attention = ml_collections.ConfigDict(config_attention.to_dict())
    config_attention.seq_len = int(seq_len)
  params = inspect.signature(cls.__init__).parameters
  if "layer" in params:
    kwargs["layer"] = layer
  if "num_layers" in params:
    kwargs["num_layers"] = num_layers
  return cls(config_attention, **kwargs)
