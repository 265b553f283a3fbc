"""The config an entry point's command line gives (train.py, scripts/compile_tpu.py), checked before anything
is built: `--config` with its `--config.*` overrides, the gin files and bindings applied, then every field
with a domain validated (configs/base.py `validate`). A fault is a `runtime.cli.UsageError` naming the flag or
field, which the entry points print as one line (exit 2)."""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from runtime import cli


def checked_config(flags: Any) -> ml_collections.ConfigDict:
  """flags.config with flags.gin_file / flags.gin_bindings applied, validated (UsageError)."""
  config = flags.config
  config.keys()  # a config file that failed to load raises here (on first use), before jax is imported
  from configs import base
  from models import gin_bridge, registry

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
  base.validate(config, attention_names=registry.names())
  return config
