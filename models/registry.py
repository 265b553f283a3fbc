"""The attention-module registry: config name -> Flax NNX module class. The extension points live here.

Adding an attention mechanism
=============================
1. A pure op (docs/design.md) registered with `core.registry.register` in `<your package>/registry.py` (a
   new package is added to `models.ops_registry`'s imports) is usable at once by name through `OpAttention`
   (projections + op); no module is needed. `get_module(name)` falls back to `OpAttention` for every
   registered op name that has no module entry.
2. A mechanism with parameters, state or randomness of its own writes a module in `models/<name>_attention.py`
   and registers it in the table below: `register_module("routing", routing_attention.RoutingAttention, ...)`.

The module contract
-------------------
    cls(config_attention, *, features, num_heads, head_dim, causal, dtype, rngs)
    module(x, mask, *, deterministic) -> y
  config_attention: the `config.model.attention` ConfigDict (`name`, `params` = plan parameters with
    "auto" = the op's `params(L)`, `dropout_rate`, plus the module's own fields); x: [batch, length, features]
    in `dtype`;
  mask: None or [batch, length] bool (True = real token); y: [batch, length, features]. Subclassing
  `models.attention.AttentionBase` gives the q/k/v/output projections with logical axis names.
  Optional context: a constructor that also names `layer` and/or `num_layers` receives the block's index and
  the depth; a module that registers a `seq_len` field receives the model's sequence length in a copy of its
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
  `config.aux_loss_weight * sum(all sown aux_loss values)` to the loss and logs it as `aux_loss`.
gin: `configurable_fields(name)` lists the constructor fields gin may bind for ablations (see
  `models.gin_bridge`).
"""

from __future__ import annotations

import inspect
from typing import Any

import ml_collections

from models import (
  attention,
  bigbird_attention,
  learned_baselines_attention,
  ops_registry,
  performer_attention,
  routing_attention,
  yoso_attention,
)

# Config name -> module class. Generic ops are not listed (they fall back to OpAttention).
MODULES: dict[str, type] = {}
# Extra config fields (beyond attention.COMMON_FIELDS) each module class understands; gin binds only these.
MODULE_FIELDS: dict[type, tuple[str, ...]] = {}



def register_module(name: str, cls: type, fields: tuple[str, ...] = ()) -> type:
  """Maps the config name `name` to the module class `cls` (see the contract above).

  `fields` names the extra `config.model.attention` fields the class reads (gin may bind them)."""
  if name in MODULES:
    raise ValueError(f"attention module {name!r} is already registered")
  MODULES[name] = cls
  MODULE_FIELDS[cls] = tuple(dict.fromkeys(MODULE_FIELDS.get(cls, ()) + tuple(fields)))
  return cls


register_module("dense", attention.OpAttention, fields=("recompute",))
for _name in ("combiner_fixed", "combiner_logsparse", "combiner_axial_vertical", "combiner_axial_horizontal",
              "combiner_mixture", "combiner_mixture_joint"):
  register_module(_name, attention.CombinerAttention, fields=("deepsets", "recompute"))
register_module("combiner_axial_rowmajor", attention.CombinerAttention,
                fields=("deepsets", "learned_span_key", "recompute"))
for _name in ("sparse_fixed", "sparse_logsparse", "sparse_axial"):
  register_module(_name, attention.OpAttention)
register_module("routing", routing_attention.RoutingAttention, fields=routing_attention.ROUTING_FIELDS)
register_module("combiner_routed", routing_attention.RoutedCombinerAttention,
                fields=routing_attention.ROUTED_FIELDS)
for _name in (*yoso_attention.SAMPLED, "yoso_e"):
  register_module(_name, yoso_attention.YosoAttention, fields=yoso_attention.YOSO_FIELDS)
register_module("performer", performer_attention.PerformerAttention,
                fields=performer_attention.PERFORMER_FIELDS)
register_module("bigbird", bigbird_attention.BigBirdAttention, fields=("recompute",))
for _name, _cls in learned_baselines_attention.MODULES.items():
  register_module(_name, _cls, fields=learned_baselines_attention.FIELDS[_name])


def names() -> list[str]:
  """Every attention name a config may use: registered modules plus every registered pure op."""
  return sorted(set(MODULES) | set(ops_registry.names()))


def get_module(name: str) -> type:
  if name in MODULES:
    return MODULES[name]
  if name in ops_registry.names():
    return attention.OpAttention
  raise ValueError(f"unknown attention {name!r}; valid names: {names()}")


def configurable_fields(name: str) -> tuple[str, ...]:
  """The `config.model.attention` fields the module for `name` reads (common ones first)."""
  cls = get_module(name)
  return tuple(f for f in attention.COMMON_FIELDS if f != "name") + MODULE_FIELDS.get(cls, ())


def check_fields(config_attention: Any) -> None:
  """Unknown fields, and options set for a module that does not read them, are config errors."""
  name = str(config_attention.name)
  known = set(attention.COMMON_FIELDS) | {"op"}
  for fields in MODULE_FIELDS.values():
    known |= set(fields)
  own = set(configurable_fields(name)) | {"name", "op"}
  for key in config_attention.keys():
    if key not in known:
      raise ValueError(f"config.model.attention has unknown field {key!r}; valid fields: {sorted(known)}")
    value = config_attention[key]
    if key not in own and value not in (None, False):
      raise ValueError(f"config.model.attention.{key}={value!r}: attention {name!r} does not read it; "
                       f"its fields: {sorted(own)}")


def build(config_attention: Any, *, layer: int | None = None, num_layers: int | None = None,
          seq_len: int | None = None, **kwargs: Any) -> Any:
  """Instantiates the module named by `config_attention.name` (after checking its fields).

  Optional context, passed only to modules that ask for it: `layer` / `num_layers` when the constructor takes
  them (per-layer choices such as routing layers), and `seq_len` written into a copy of the config when the
  module declares a `seq_len` field the config leaves unset (state shaped at construction, e.g. centroids)."""
  cls = get_module(str(config_attention.name))
  check_fields(config_attention)
  wants_length = "seq_len" in MODULE_FIELDS.get(cls, ())
  if seq_len is not None and wants_length and config_attention.get("seq_len") is None:
    config_attention = ml_collections.ConfigDict(config_attention.to_dict())
    config_attention.seq_len = int(seq_len)
  params = inspect.signature(cls.__init__).parameters
  if "layer" in params:
    kwargs["layer"] = layer
  if "num_layers" in params:
    kwargs["num_layers"] = num_layers
  return cls(config_attention, **kwargs)
