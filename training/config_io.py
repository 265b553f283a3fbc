"""A run's config in its workdir: config.json, the recorded changes, the checks before a workdir is trusted.

- A run's first config is `<workdir>/config.json` and is never rewritten. A resume compares the new config
  with the one in force (the last entry of `config_history.json`, else config.json) before anything is
  written: a change of model or data fields is refused with the list of differing fields unless it is
  explicitly allowed; an accepted change is appended to `config_history.json` with the step it applies from.
  `load_config(workdir, step)` gives the config a checkpoint was trained with. A non-empty directory without
  config.json is not a workdir of this project and is refused.
- JSON: metrics files are standard JSON; non-finite numbers are written as null.

File I/O goes through `runtime.paths` / `etils.epath`, so a workdir may be local or `gs://`.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import ml_collections
import numpy as np
from etils import epath

from configs import base as config_base
from runtime import cli, paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, the import root
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.py")
CONFIG = "config.json"
HISTORY = "config_history.json"
# Top-level config sections whose change makes a resumed run a different experiment (shapes, task, data).
GUARDED = ("model", "data")
LOCK = "lock.json"  # training/lock.py: the run that holds the workdir
# What a start may leave before config.json exists when it is killed outright: not files of another run.
START_ENTRIES = (LOCK, "status")


class ConfigMismatch(ValueError):
  """The config given does not match the run in the workdir."""


# ------------------------------------------------------------------------------------------------------------
# JSON


def finite_or_none(x: Any) -> Any:
  """x with every non-finite float (also inside dicts / lists / NumPy scalars) replaced by None."""
  if isinstance(x, dict):
    return {k: finite_or_none(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite_or_none(v) for v in x]
  if isinstance(x, (np.floating, np.integer)):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def write_json(path: Any, obj: Any) -> None:
  """Standard JSON (null, never NaN / Infinity), written whole (`runtime.paths.write_text`)."""
  paths.write_text(path, json.dumps(finite_or_none(obj), indent=2, allow_nan=False) + "\n")


def read_json(path: Any) -> Any:
  """The JSON file at `path`; a damaged one (cut short, edited by hand) is the user's to fix, one line naming
  it, not a traceback."""
  try:
    return paths.read_json(path)
  except json.JSONDecodeError as e:
    raise cli.mark_usage(ValueError(f"{path} is not valid JSON ({e}): restore it from a copy or move the "
                                    "workdir aside")) from e


# ------------------------------------------------------------------------------------------------------------
# Config


def config_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The JSON form of a config, as config.json holds it (tuples become lists)."""
  return json.loads(config.to_json_best_effort(sort_keys=True))


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(d, dict):
    return {prefix: d}
  out: dict[str, Any] = {}
  for k, v in d.items():
    out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
  return out


def differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """{dotted field: (old, new)} for every field that differs (absent = None)."""
  a, b = flatten(old), flatten(new)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _without_new_defaults(diff: dict[str, tuple[Any, Any]], saved: dict[str, Any]
                          ) -> dict[str, tuple[Any, Any]]:
  """`diff` less the fields a run's saved config predates (added to configs/base.py since) that the config
  leaves at their default, the value that keeps the older run's behaviour (e.g. model.mem_len = 0)."""
  had = set(flatten(saved))
  defaults = flatten(config_dict(config_base.base_config()))
  return {k: (old, new) for k, (old, new) in diff.items()
          if k in had or k not in defaults or new != defaults[k]}


def _history(workdir: epath.Path) -> list[dict[str, Any]]:
  path = workdir / HISTORY
  return read_json(path) if path.exists() else []


def saved_config_dict(workdir: Any, step: int | None = None) -> dict[str, Any] | None:
  """The config (JSON form) in force at checkpoint `step` (default: the latest), None without config.json.

  A change recorded when resuming from step s applies to the checkpoints after s.
  """
  workdir = paths.path(workdir)
  if not (workdir / CONFIG).exists():
    return None
  current = read_json(workdir / CONFIG)
  for entry in _history(workdir):
    if step is None or entry["step"] < step:
      current = entry["config"]
  return current


def check_workdir(workdir: Any, config: ml_collections.ConfigDict, *, allow_change: bool = False
                  ) -> dict[str, tuple[Any, Any]]:
  """Decides, before anything is written, whether `config` may run in `workdir`; returns the changed fields.

  Raises ConfigMismatch for a non-empty directory that is not a workdir of this project, and for a change of
  model or data fields unless `allow_change`.
  """
  workdir = paths.path(workdir)
  saved = saved_config_dict(workdir)
  if saved is None:
    if workdir.exists() and any(p.name not in START_ENTRIES for p in workdir.iterdir()):
      names = sorted(p.name for p in workdir.iterdir())
      shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
      raise ConfigMismatch(f"--workdir {workdir} is not empty ({shown}) and has no {CONFIG}: it holds files "
                           "of another run, not a train.py workdir. Choose a new or empty directory.")
    return {}
  diff = _without_new_defaults(differences(saved, config_dict(config)), saved)
  guarded = {k: v for k, v in diff.items() if k.split(".")[0] in GUARDED}
  if guarded and not allow_change:
    lines = "\n".join(f"  {k}: {old!r} -> {new!r}" for k, (old, new) in guarded.items())
    raise ConfigMismatch(f"the config differs from the one the run in {workdir} was trained with, in "
                         f"model/data fields:\n{lines}\nUse a new --workdir for a new experiment, or pass "
                         "--allow_config_change to continue this run with the new config (the change is "
                         f"recorded in {HISTORY}).")
  return diff


def start_snapshot(workdir: Any) -> dict[str, Any] | None:
  """What a new run's workdir holds before the start writes anything (None for an existing run's workdir,
  which has its config.json): `undo_start` removes what the start added if it fails."""
  workdir = paths.path(workdir)
  if (workdir / CONFIG).exists():
    return None
  existed = workdir.exists()
  return {"existed": existed, "names": {p.name for p in workdir.iterdir()} if existed else set()}


def undo_start(workdir: Any, before: dict[str, Any] | None) -> None:
  """Leaves a new run's workdir as `start_snapshot` found it after a failed start (a directory the start
  created goes; entries that were there stay); never raises (the start's own error is the one to report)."""
  if before is None:
    return
  workdir = paths.path(workdir)
  try:
    if not workdir.exists():
      return
    for entry in workdir.iterdir():
      if entry.name in before["names"]:
        continue
      if entry.is_dir():
        paths.rmtree(entry)
      else:
        entry.unlink(missing_ok=True)
    if not before["existed"]:
      workdir.rmdir()
  except Exception as e:
    print(f"could not clean up the failed start in {workdir}: {type(e).__name__}: {e}", flush=True)


def record_config(workdir: Any, config: ml_collections.ConfigDict, diff: dict[str, tuple[Any, Any]],
                  step: int) -> None:
  """Writes config.json for a new run, or appends an accepted change (applying after `step`) to the
  history."""
  workdir = paths.path(workdir)
  if not (workdir / CONFIG).exists():
    write_json(workdir / CONFIG, config_dict(config))
    return
  if not diff:
    return
  history = _history(workdir)
  history.append({"step": int(step), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "changes": {k: {"old": old, "new": new} for k, (old, new) in diff.items()},
                  "config": config_dict(config)})
  write_json(workdir / HISTORY, history)


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes `<workdir>/config.json` (train_and_evaluate writes it through the checks above)."""
  write_json(paths.join(workdir, CONFIG), config_dict(config))


def load_config(workdir: str, step: int | None = None) -> ml_collections.ConfigDict:
  """The config the run in `workdir` trained checkpoint `step` with (default: its latest config)."""
  d = saved_config_dict(paths.path(workdir), step)
  if d is None:
    raise cli.mark_usage(FileNotFoundError(f"no config.json in {workdir}: is it a train.py workdir?"))
  c = ml_collections.ConfigDict(d)
  if c.model.get("image_shape") is not None:
    c.model.image_shape = tuple(c.model.image_shape)
  c.sharding_rules = tuple((name, tuple(axis) if isinstance(axis, list) else axis)
                           for name, axis in c.sharding_rules)
  with c.model.attention.unlocked():
    c.model.attention.params = ml_collections.ConfigDict(c.model.attention.get("params") or {},
                                                         type_safe=False)
  return c


def config_path_of(flags: Any) -> str:
  """The file of the `--config` flag (DEFAULT_CONFIG when it cannot be read from the flag)."""
  from ml_collections import config_flags

  try:
    return config_flags.get_config_filename(flags["config"])
  except Exception:
    return DEFAULT_CONFIG
