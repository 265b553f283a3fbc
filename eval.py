r"""Evaluates a train.py checkpoint on a split, prints the metrics and writes them as JSON to the workdir.

    python eval.py --workdir workdirs/default-20261122-050000  # latest checkpoint, config.eval_split
    python eval.py --workdir DIR --split test --step 4000 --max_batches 100

The config is the resolved one train.py saved (`<workdir>/config.json`, with the changes it recorded in
`config_history.json` up to the checkpoint's step); `--config.*`-style overrides are not needed because
everything that shapes the model is in it. By default it evaluates as many batches as train.py's evaluations
(`config.train.eval_batches`), so the two agree; both print how many batches and examples a figure covers. The
result goes to `<workdir>/eval_<split>_<step>.json` for the whole split, `eval_<split>_<step>_<n>batches.json`
for the first n batches. A latest checkpoint that does not restore is reported and the newest one that does is
evaluated.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import jax

from runtime import distributed, paths


def restore_workdir(workdir: str, *, step: int | None = None,
                    devices: list | None = None) -> tuple[Any, Any, Any]:
  """(experiment, train state, open read-only checkpoint manager) for `step` (default: the newest that
  restores) of `workdir`, with the config that step was trained with."""
  import resume
  import train

  config = train.load_config(workdir)
  mgr = train.checkpoint_manager(workdir, config, read_only=True)
  available = list(mgr.all_steps())
  if not available:
    raise FileNotFoundError(f"no checkpoint in {paths.join(workdir, 'checkpoints')}")
  if step is not None and step not in available:
    raise ValueError(f"no checkpoint for step {step} in {workdir}; available steps: {sorted(available)}")
  experiments: dict[str, Any] = {}

  def restore(s: int) -> Any:
    cfg = train.load_config(workdir, s)  # the config this checkpoint was trained with
    key = cfg.to_json_best_effort(sort_keys=True)
    if key not in experiments:
      experiments[key] = train.Experiment(cfg, devices=devices)
    exp = experiments[key]
    return exp, train.restore_checkpoint(mgr, exp, None, s)

  steps = available if step is None else [step]
  exp, state = resume.restore_newest(steps, restore, mgr.directory, say=lambda line: print(line, flush=True))
  return exp, state, mgr


def evaluate_workdir(workdir: str, *, split: str | None = None, step: int | None = None,
                     max_batches: int | None = None, devices: list | None = None) -> dict[str, Any]:
  """Restores `step` (default: the newest that restores) from `workdir` and evaluates `split` (default
  config.eval_split) over `max_batches` batches (default config.train.eval_batches, as train.py; -1 = all)."""
  import resume

  exp, state, mgr = restore_workdir(workdir, step=step, devices=devices)
  config = exp.config
  split = split or config.eval_split
  metrics = exp.evaluate(state, split, max_batches)
  metrics.update(step=state.step, split=split, attention=str(config.model.attention.name),
                 data=str(config.data.name))
  if jax.process_index() == 0:
    part = "" if metrics["whole_split"] else f"_{metrics['num_batches']}batches"
    path = paths.join(workdir, f"eval_{split}_{state.step}{part}.json")
    resume.write_json(path, metrics)
    metrics["path"] = path
  mgr.close()
  return metrics


def main(argv: list[str]) -> None:
  del argv
  from absl import flags, logging

  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  distributed.initialize_from_flags(f)
  import train

  m = evaluate_workdir(f.workdir, split=f.split, step=f.step, max_batches=f.max_batches)
  print(train.format_metrics(m), flush=True)
  bad = sorted(k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v))
  if bad:
    print(f"ERROR: the evaluation is not finite ({', '.join(bad)})", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  from absl import app, flags

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  flags.DEFINE_string("workdir", None, "a train.py workdir", required=True)
  flags.DEFINE_string("split", None, "split to evaluate (default: the config's eval_split)")
  flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
  flags.DEFINE_integer("max_batches", None, "evaluate at most this many batches (-1 = the whole split; "
                       "default: config.train.eval_batches, as train.py's evaluations)")
  distributed.define_flags()  # --multihost, --coordinator_address, --num_processes, --process_id
  app.run(main)
