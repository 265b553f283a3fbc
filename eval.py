r"""Evaluates a train.py checkpoint on a split, prints the metrics and writes them as JSON to the workdir.

    python eval.py --workdir workdirs/default-20261122-050000                 # latest checkpoint, config.eval_split
    python eval.py --workdir DIR --split test --step 4000 --max_batches 100

The config is the resolved one train.py saved (`<workdir>/config.json`); `--config.*`-style overrides are not
needed because everything that shapes the model is in it. The result goes to `<workdir>/eval_<split>_<step>.json`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax

from runtime import distributed, paths


def restore_workdir(workdir: str, *, step: int | None = None, devices: list | None = None) -> tuple[Any, Any, Any]:
  """(experiment, train state, open read-only checkpoint manager) for `step` (default: the latest) of `workdir`."""
  import train

  config = train.load_config(workdir)
  exp = train.Experiment(config, devices=devices)
  mgr = train.checkpoint_manager(workdir, config, read_only=True)
  available = list(mgr.all_steps())
  if not available:
    raise FileNotFoundError(f"no checkpoint in {paths.join(workdir, 'checkpoints')}")
  if step is not None and step not in available:
    raise ValueError(f"no checkpoint for step {step} in {workdir}; available steps: {sorted(available)}")
  return exp, train.restore_checkpoint(mgr, exp, None, step), mgr


def evaluate_workdir(workdir: str, *, split: str | None = None, step: int | None = None,
                     max_batches: int | None = None, devices: list | None = None) -> dict[str, Any]:
  """Restores `step` (default: the latest) from `workdir` and evaluates `split` (default config.eval_split)."""
  exp, state, mgr = restore_workdir(workdir, step=step, devices=devices)
  config = exp.config
  split = split or config.eval_split
  metrics = exp.evaluate(state, split, max_batches)
  metrics.update(step=state.step, split=split, attention=str(config.model.attention.name),
                 data=str(config.data.name))
  if jax.process_index() == 0:
    path = paths.join(workdir, f"eval_{split}_{state.step}.json")
    paths.write_json(path, metrics)
    metrics["path"] = path
  mgr.close()
  return metrics


def main(argv: list[str]) -> None:
  del argv
  from absl import flags, logging

  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  distributed.initialize_from_flags(f)
  m = evaluate_workdir(f.workdir, split=f.split, step=f.step, max_batches=f.max_batches)
  print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()), flush=True)


if __name__ == "__main__":
  from absl import app, flags

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  flags.DEFINE_string("workdir", None, "a train.py workdir", required=True)
  flags.DEFINE_string("split", None, "split to evaluate (default: the config's eval_split)")
  flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
  flags.DEFINE_integer("max_batches", -1, "evaluate at most this many batches (-1 = the whole split)")
  distributed.define_flags()  # --multihost, --coordinator_address, --num_processes, --process_id
  app.run(main)
