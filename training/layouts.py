"""Checkpoints across the two layouts of a model's blocks: one module per block, or stacked.

With `config.model.scan_layers=True` the blocks are one module whose arrays carry a leading layer axis
(`encoder/blocks/<name>` of shape [layers, ...], models/stacked.py); otherwise each block is its own module
(`encoder/blocks/<i>/<name>`). Checkpoints written before scanned blocks were stacked hold the per-layer
layout under scan_layers=True, and a run may be resumed with scan_layers changed (`--allow_config_change`).

`restore_checkpoint` (training/checkpoints.py) reads from a step's metadata which layout it was saved in.
When it is the other one, the step is restored in its own layout (its checksums verified there, as any
restore) and converted: parameters, optimizer moments and module state stacked or split along the layer axis,
the same bits, each array placed with the run's sharding. The run then continues exactly as it would have in
the saved layout (models/stacked.py: the same values and random streams either way).
"""

from __future__ import annotations

import copy
from typing import Any

import jax

from models import stacked
from runtime import paths


def _part(key: Any) -> str:
  for field in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey (orbax's metadata: DictKey)
    if hasattr(key, field):  # a tree path's entry, whichever of JAX's key classes it is
      return str(getattr(key, field))
  return str(key)


def leaf_arrays(tree: Any) -> dict[tuple[str, ...], Any]:
  """A tree's arrays (or orbax's metadata of them) by path, the paths as strings, comparable between a state
  and orbax's metadata of it."""
  return {tuple(_part(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def leaf_paths(tree: Any) -> frozenset[tuple[str, ...]]:
  """The paths of a tree's arrays as strings (`leaf_arrays`)."""
  return frozenset(leaf_arrays(tree))


def saved_arrays(mgr: Any, step: int) -> dict[tuple[str, ...], Any] | None:
  """The metadata of the arrays the step's state was saved with, by path (`leaf_arrays`); None when its
  metadata does not read (the restore itself then reports the damage)."""
  import orbax.checkpoint as ocp

  try:  # the item's own metadata: a read-only manager knows no handler for it before a restore
    item = paths.path(mgr.directory) / str(step) / "state"
    return leaf_arrays(ocp.StandardCheckpointHandler().metadata(item))
  except Exception:  # missing or damaged metadata: the restore reports it as it reports any damage
    return None


def _other_layout(exp: Any) -> Any | None:
  """The run's experiment with `model.scan_layers` flipped (the other layout), or None when it has no other
  (blocks that differ are never stacked)."""
  from training.experiment import Experiment

  config = copy.deepcopy(exp.config)
  with config.unlocked():
    config.model.scan_layers = not bool(config.model.get("scan_layers", False))
  try:
    other = Experiment(config, devices=list(exp.mesh.devices.flat), info=exp.info)
  except ValueError:  # blocks of different structures cannot be stacked
    return None
  return other


def checkpoint_target(target: dict[str, Any]) -> dict[str, Any]:
  """The restore target as orbax sees it: without an empty `rest` (orbax refuses empty subtrees)."""
  target = dict(target)
  if "rest" in target and not jax.tree.leaves(target["rest"]):
    del target["rest"]
  return target


def saved_layout(saved: dict[tuple[str, ...], Any] | None, exp: Any, target: dict[str, Any]
                 ) -> dict[str, Any] | None:
  """The restore target in the other layout when the step whose `saved_arrays` are `saved` was saved in it;
  None when the step is in the run's layout (or in neither, or its metadata did not read: the restore
  reports that as it reports damage)."""
  saved = None if saved is None else frozenset(saved)
  if saved is None or saved == leaf_paths(target):
    return None
  other = _other_layout(exp)
  if other is None:
    return None
  other_target = checkpoint_target(other.abstract_state())
  return other_target if leaf_paths(other_target) == saved else None


def convert(tree: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
  """A restored state in the other layout -> the run's `target` layout (shapes and shardings), bit for
  bit."""
  shardings = jax.tree.map(lambda a: a.sharding, target)
  return jax.jit(lambda t: stacked.convert(t, like=target), out_shardings=shardings)(tree)
