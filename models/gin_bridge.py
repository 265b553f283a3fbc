"""gin bindings for the attention modules' constructor fields (ablations), folded into the ml_collections
config.

    python train.py --config configs/cifar10.py --gin_bindings "attention.deepsets = True" \
        --gin_bindings "attention.row_length = 64" --workdir workdirs/c10_deepsets

Flags: `--gin_file FILE` (repeatable) and `--gin_bindings "attention.FIELD = VALUE"` (repeatable). The only
gin scope is `attention`.

The configurable `attention` accepts every field some registered attention module reads (see
`models.registry.configurable_fields`) and every plan parameter of the chosen op. The config stays the source
of truth: `apply(config, ...)` writes the bound values into `config.model.attention` (so the saved config
shows them) and refuses a binding for a field the config itself sets (a value other than None / "auto"), or a
field the chosen module does not read (the message lists the valid ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gin
import ml_collections

from models import attention, registry

GIN_NAME = "attention"


@gin.configurable(GIN_NAME)
def attention_bindings(**kwargs: Any) -> dict[str, Any]:
  """Returns the gin-bound constructor fields (the function itself does nothing else)."""
  return kwargs


def _unset(value: Any) -> bool:
  return value is None or attention.is_auto(value)


def apply(config: ml_collections.ConfigDict, gin_files: Sequence[str] = (),
          gin_bindings: Sequence[str] = ()) -> dict[str, Any]:
  """Parses gin files/bindings and writes the bound attention fields into `config.model.attention`.

  Returns the bound values. Raises ValueError for a field the config sets or the module does not read."""
  if not gin_files and not gin_bindings:
    return {}
  gin.clear_config()
  gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings))
  bound = attention_bindings()
  gin.clear_config()
  att = config.model.attention
  name = str(att.name)
  fields = [f for f in registry.configurable_fields(name) if f != "params"]
  declared = registry.plan_of(att) if name in registry.names() else None
  plan = sorted(set(att.get("params", {}) or {}) | (set(declared[0]) if declared else set()))
  for key, value in bound.items():
    if key in fields:
      if not _unset(att.get(key, None)):
        raise ValueError(f"gin binding {GIN_NAME}.{key}={value!r} conflicts with "
                         f"config.model.attention.{key}={att.get(key)!r}: the config sets it; "
                         "set it in one place only")
      with att.unlocked():
        att[key] = value
    elif key in plan:
      params = att.params
      if not _unset(params.get(key, None)):
        raise ValueError(f"gin binding {GIN_NAME}.{key}={value!r} conflicts with "
                         f"config.model.attention.params.{key}={params.get(key)!r}: the config sets it; "
                         "set it in one place only")
      with params.unlocked():
        params[key] = value
    else:
      raise ValueError(f"gin binding {GIN_NAME}.{key}: attention {name!r} has no field {key!r}; "
                       f"valid: {sorted(set(fields) | set(plan))}")
  return bound
