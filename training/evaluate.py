"""The evaluation driver: restore a workdir's checkpoint with the config it was trained with, evaluate.

The config is the resolved one train.py saved (`<workdir>/config.json`, with the changes it recorded in
`config_history.json` up to the checkpoint's step). By default it evaluates as many batches as train.py's
evaluations (`config.train.eval_batches`), so the two agree. The result goes to
`<workdir>/eval_<split>_<step>.json` for the whole split, `eval_<split>_<step>_<n>batches.json` for the first
n batches. A latest checkpoint that does not restore is reported and the newest one that does is evaluated.
`eval_mem_len` evaluates a model trained with segment recurrence with another memory length than its config's
(0: each segment alone); the file name then ends in `_mem<N>`. `eval_compressed_mem_len` likewise sets a
Compressive Transformer's compressed-memory length (0: none); the name then ends in `_cmem<N>`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from runtime import cli, paths
from training import checkpoints, config_io, kernel_check
from training.experiment import Experiment


def with_eval_mem_len(config: Any, eval_mem_len: int) -> Any:
  """`config` (changed in place) evaluating with a memory of `eval_mem_len` positions (0: none, each segment
  alone); the model must have been trained with one (config.model.mem_len > 0): its state carries it."""
  if eval_mem_len < 0:
    raise cli.UsageError(f"--eval_mem_len must be >= 0 (0 = no memory), got {eval_mem_len}")
  if not int(config.model.get("mem_len", 0) or 0):
    raise cli.UsageError(f"--eval_mem_len {eval_mem_len}: the model was trained without segment recurrence "
                         "(config.model.mem_len = 0)")
  config.model.eval_mem_len = int(eval_mem_len)  # 0: recurrence.lengths gives no evaluation memory
  return config


def with_eval_compressed_mem_len(config: Any, n: int) -> Any:
  """`config` (changed in place) evaluating with a compressed memory of `n` slots (0: none); the model must
  have been trained with one (config.model.compressed_mem_len > 0)."""
  if n < 0:
    raise cli.UsageError(f"--eval_compressed_mem_len must be >= 0 (0 = none), got {n}")
  if not int(config.model.get("compressed_mem_len", 0) or 0):
    raise cli.UsageError(f"--eval_compressed_mem_len {n}: the model was trained without a compressed memory "
                         "(config.model.compressed_mem_len = 0)")
  config.model.eval_compressed_mem_len = int(n)
  return config


def restore_workdir(workdir: str, *, step: int | None = None, devices: list | None = None,
                    eval_mem_len: int | None = None, eval_compressed_mem_len: int | None = None
                    ) -> tuple[Any, Any, Any]:
  """(experiment, train state, open read-only checkpoint manager) for `step` (default: the newest that
  restores) of `workdir`, with the config that step was trained with (evaluating with a memory of
  `eval_mem_len` positions when given)."""
  config = config_io.load_config(workdir)
  mgr = checkpoints.checkpoint_manager(workdir, config, read_only=True)
  available = list(mgr.all_steps())
  if not available:
    raise cli.mark_usage(FileNotFoundError(f"--workdir {workdir}: no checkpoint in "
                                           f"{paths.join(workdir, 'checkpoints')}"))
  if step is not None and step not in available:
    raise cli.UsageError(f"--step {step}: no checkpoint for step {step} in {workdir}; available steps: "
                         f"{sorted(available)}")
  experiments: dict[str, Any] = {}

  def restore(s: int) -> Any:
    cfg = config_io.load_config(workdir, s)  # the config this checkpoint was trained with
    if eval_mem_len is not None:
      cfg = with_eval_mem_len(cfg, eval_mem_len)
    if eval_compressed_mem_len is not None:
      cfg = with_eval_compressed_mem_len(cfg, eval_compressed_mem_len)
    key = cfg.to_json_best_effort(sort_keys=True)
    if key not in experiments:
      # The fused kernel checked as train.py checks it: under "auto" a failure evaluates on the XLA path.
      experiments[key] = Experiment(kernel_check.checked_config(cfg, workdir, devices=devices, record=False),
                                    devices=devices)
    exp = experiments[key]
    return exp, checkpoints.restore_checkpoint(mgr, exp, None, s)

  steps = available if step is None else [step]
  exp, state = checkpoints.restore_newest(steps, restore, mgr.directory, using="reading",
                                          say=lambda line: print(line, flush=True))
  return exp, state, mgr


class MetricsNotWritten(OSError):
  """The evaluation ran (its metrics were reported) but its JSON could not be written."""


def evaluate_workdir(workdir: str, *, split: str | None = None, step: int | None = None,
                     max_batches: int | None = None, devices: list | None = None,
                     report: Callable[[dict[str, Any]], None] | None = None,
                     eval_mem_len: int | None = None, eval_compressed_mem_len: int | None = None
                     ) -> dict[str, Any]:
  """Restores `step` (default: the newest that restores) from `workdir` and evaluates `split` (default
  config.eval_split) over `max_batches` batches (default config.train.eval_batches, as train.py; -1 = all).

  report: called with the metrics before they are written, so a result that cannot be written (a read-only
  workdir) is not lost: the write failure then raises MetricsNotWritten, after the report. eval_mem_len:
  the evaluation memory of a model trained with segment recurrence (default its config's; 0 = none)."""
  exp, state, mgr = restore_workdir(workdir, step=step, devices=devices, eval_mem_len=eval_mem_len,
                                    eval_compressed_mem_len=eval_compressed_mem_len)
  mgr.close()
  config = exp.config
  split = split or config.eval_split
  metrics = exp.evaluate(state, split, max_batches)
  metrics.update(step=state.step, split=split, attention=str(config.model.attention.name),
                 data=str(config.data.name))
  if eval_mem_len is not None:
    metrics["eval_mem_len"] = int(eval_mem_len)
  if eval_compressed_mem_len is not None:
    metrics["eval_compressed_mem_len"] = int(eval_compressed_mem_len)
  if report is not None:
    report(metrics)
  if jax.process_index() == 0:
    part = "" if metrics["whole_split"] else f"_{metrics['num_batches']}batches"
    part += "" if eval_mem_len is None else f"_mem{eval_mem_len}"
    part += "" if eval_compressed_mem_len is None else f"_cmem{eval_compressed_mem_len}"
    path = paths.join(workdir, f"eval_{split}_{state.step}{part}.json")
    try:
      config_io.write_json(path, metrics)
    except OSError as e:
      raise MetricsNotWritten(f"the metrics above could not be written to {path}: "
                              f"{e.strerror or type(e).__name__}") from e
    metrics["path"] = path
  return metrics
