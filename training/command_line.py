"""The config an entry point's command line gives (train.py, scripts/compile_tpu.py), checked before anything
is built: `--config` with its `--config.*` overrides, the gin files and bindings applied, then every field
with a domain validated (configs/validation.py `validate`, and the attention fields and plan parameters
against what the chosen module and op declare, `models.registry.check_fields`). A fault is a
`runtime.cli.UsageError` naming the flag or field, which the entry points print as one line (exit 2).

A config holds only the attention-module fields it sets (each module declares its own), so `--config.*`
overrides may add fields under `model.attention`; anywhere else an override must name a field the config
file has.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import ml_collections

from runtime import cli

# Overrides may add fields only here: the chosen attention module's own fields (and plan parameters).
NEW_FIELDS_UNDER = "model.attention."


def define_config_flag(default: str, **kwargs: Any) -> None:
  """`--config path[:arg]` with its `--config.FIELD=VALUE` overrides (see the module docstring); kwargs go to
  `config_flags.DEFINE_config_file` (flag_values, sys_argv)."""
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", default, "experiment config file (path[:arg])", lock_config=False,
                                  accept_new_attributes=True, **kwargs)


def _check_override_paths(flag: Any) -> None:
  """An override outside model.attention must name a field of the config file itself (typos are errors)."""
  from ml_collections import config_flags
  from ml_collections.config_flags import config_path

  overrides = [p for p in config_flags.get_override_values(flag) if not p.startswith(NEW_FIELDS_UNDER)]
  if not overrides:
    return
  fresh = flag.parser.parse(flag.config_filename)  # the config file's own fields, before the overrides
  known = [".".join(p) for p in _paths(fresh)]
  for path in overrides:
    try:
      config_path.get_value(path, fresh)
    except (KeyError, AttributeError, IndexError):
      close = difflib.get_close_matches(path, known, n=1)
      raise cli.UsageError(f"--config.{path}: the config has no field {path!r}"
                           + (f" (did you mean --config.{close[0]}?)" if close else "")) from None


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
  if not isinstance(node, ml_collections.ConfigDict):
    return [prefix]
  return [p for key in node.keys() for p in _paths(node[key], prefix + (str(key),))]


def checked_config(flags: Any) -> ml_collections.ConfigDict:
  """flags.config with flags.gin_file / flags.gin_bindings applied, validated (UsageError); locked after."""
  config = flags.config
  config.keys()  # a config file that failed to load raises here (on first use), before jax is imported
  from configs import validation
  from models import gin_bridge, registry

  _check_override_paths(flags["config"])

  if flags.gin_file or flags.gin_bindings:
    for path in flags.gin_file:
      cli.check(os.path.isfile(path), f"--gin_file {path}: no such file")
    try:
      with config.unlocked():
        gin_bridge.apply(config, flags.gin_file, flags.gin_bindings)
    except (ImportError, AssertionError):
      raise
    except Exception as e:  # gin's parse errors and the bridge's refusals name the binding
      raise cli.UsageError(f"--gin_file/--gin_bindings: {e}") from e
  validation.validate(config, attention_names=registry.names())
  try:
    registry.check_fields(config.model.attention)
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  config.lock()
  return config
