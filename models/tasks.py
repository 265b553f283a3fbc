"""Every task's model: a dataset's task (`data.info.DatasetInfo.task`) -> the model family that has a head for
it, so the training code builds a model without naming a task."""

from __future__ import annotations

from typing import Any

import ml_collections

from models import hibert, transformer

FAMILIES = {**{task: transformer for task in transformer.TASKS}, **{task: hibert for task in hibert.TASKS}}


def from_info(cfg: ml_collections.ConfigDict, info: Any, *, seed: int = 0) -> Any:
  """The model for a `data.DatasetInfo` (its task, vocabulary, special ids, length, classes)."""
  if info.task not in FAMILIES:
    raise ValueError(f"task {info.task!r} has no model; tasks: {sorted(FAMILIES)}")
  return FAMILIES[info.task].from_info(cfg, info, seed=seed)
