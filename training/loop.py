"""The training loop: train to `config.train.num_steps` from the workdir's newest checkpoint, then evaluate.

- Checkpoints every `train.checkpoint_every` steps (the last `train.keep_checkpoints` kept, atomic, saved
  before the evaluation of the same step) with the data-iterator state; rerunning with the same workdir
  resumes from the newest checkpoint that restores with finite values, after checking the config against the
  run's (training/config_io.py). Checkpoints are written in the background while training goes on
  (training/checkpoints.py); the loop waits for the write in flight before it reports a stop or returns.
  SIGTERM (preemption) to any process stops every process at the same step (training/preemption.py), which
  each saves before returning. A NaN/Inf loss or gradient stops the run with a clear message naming the first
  bad step; the last good checkpoint stays (the bad step is never applied, and no state after it is saved).
  A non-finite final evaluation raises after its metrics are written. A checkpoint the storage refuses raises
  CheckpointWriteFailed (one line: the directory, the OS error, the last intact step; the half-written step
  removed); a collective that lost the other end in a run of several processes raises HostLost
  (training/supervisor.py), recorded with cause `host_lost`.
- The host never waits for a step's result to start the next: the steps' metrics stay on the devices and are
  fetched together at log steps and before every checkpoint save (at most two steps are left in flight, so
  the host stays close behind). The finiteness of each step is read then, so a bad step stops the run at the
  next log step or save, whichever comes first: the steps between it and that point ran (the bad one skipped
  by the step itself) but are never saved.
- Output: a tqdm bar (step, loss, ETA), metric lines on stdout (loss, steps/s, tokens/s, step time, MFU
  where the device's peak is known, device memory where the device reports it; the first step, which
  compiles, is timed apart and reported once), TensorBoard summaries in `<workdir>/tensorboard`
  (tensorboardX; the config as hyperparameters and as text), the resolved config in `<workdir>/config.json`,
  final eval metrics in `<workdir>/metrics.json`, and the run's state for a watcher in `<workdir>/status/`
  (training/status.py: started, a heartbeat every `heartbeat_s` seconds, then finished, failed or preempted).
- `config.train.profile_steps = (start, stop)` writes a `jax.profiler` trace of those steps to
  `<workdir>/profile` (training/throughput.py).

The steps themselves are training/steps.py's; a model's own start (HIBERT's pretrained encoder) is its
declared warm start (training/experiment.py), so nothing here names a task.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from configs import validation
from models import metrics as metrics_lib
from runtime import paths
from training import config_io, kernel_check, steps, supervisor, throughput
from training import status as run_status
from training.checkpoints import (
  CheckpointWriteFailed,
  checkpoint_manager,
  reporting_write_errors,
  restore_or_init,
  save_checkpoint,
)
from training.experiment import Experiment, TrainState, create_dataset
from training.lock import WorkdirLock, acquire_everywhere
from training.preemption import Preemption


class TrainingDiverged(RuntimeError):
  """Raised when the loss or the gradients are not finite."""


class NonFiniteEvaluation(RuntimeError):
  """Raised when the final evaluation is not finite (its metrics are written, null for the bad values)."""


# -----------------------------------------------------------------------------------------------------------
# What tests observe and steer


@dataclasses.dataclass(frozen=True)
class TestHooks:
  """What a test observes and steers in `train_and_evaluate` (`testing_hooks`); production runs have none."""

  devices: list | None = None  # the devices to run on (default: all)
  stop_after: int | None = None  # leave after this many steps of this process with a checkpoint
  batch_log: list | None = None  # receives (step, fingerprint of the host batch) per step (data order)


_HOOKS: contextvars.ContextVar[TestHooks | None] = contextvars.ContextVar("loop_test_hooks", default=None)


@contextlib.contextmanager
def testing_hooks(**hooks: Any) -> Iterator[None]:
  """`train_and_evaluate` calls inside run with these `TestHooks`."""
  token = _HOOKS.set(TestHooks(**hooks))
  try:
    yield
  finally:
    _HOOKS.reset(token)


def _fingerprint(batch: dict[str, np.ndarray]) -> str:
  h = hashlib.sha1()
  for k in sorted(batch):
    h.update(k.encode())
    h.update(np.ascontiguousarray(batch[k]).tobytes())
  return h.hexdigest()[:16]


# -----------------------------------------------------------------------------------------------------------
# Output


def format_metrics(metrics: dict[str, Any]) -> str:
  """`k=v` pairs; the batch and example counts say what an evaluation figure covers."""
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _say(bar: Any, line: str) -> None:
  """A metrics line on stdout that does not break the progress bar, flushed (stdout is often a pipe)."""
  bar.write(line, file=sys.stdout)
  sys.stdout.flush()


def summary_writer(logdir: str) -> Any:
  """A tensorboardX writer for a local or `gs://` logdir (runtime/paths.py)."""
  return paths.summary_writer(logdir)


def write_hparams(writer: Any, config: ml_collections.ConfigDict, step: int) -> None:
  """The config in TensorBoard: its scalar fields as an hparams summary (HParams tab, in the run's own event
  file) and the whole config as JSON text (Text tab)."""
  from tensorboardX.summary import hparams

  flat = {}
  for key, value in config_io.flatten(config_io.config_dict(config)).items():
    if isinstance(value, (bool, int, float, str)):
      flat[key] = value
    elif value is None:
      flat[key] = "None"
    else:
      flat[key] = str(value)
  for summary in hparams(flat, {"train/loss": 0.0}):
    writer._get_file_writer().add_summary(summary, step)
  text = json.dumps(config_io.config_dict(config), indent=2, sort_keys=True, default=str)
  writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), step)
  writer.flush()


def _log_scalars(writer: Any, prefix: str, values: dict[str, Any], step: int) -> None:
  if writer is not None:
    for k, v in values.items():
      if isinstance(v, (int, float)) and math.isfinite(v):
        writer.add_scalar(f"{prefix}/{k}", v, step)
    writer.flush()


def fetch(outs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The metrics of the steps in `outs` on the host, in one transfer: the loop's only read of step results (at
  log steps and before saves), allowed even where the caller forbids device-to-host transfers."""
  with jax.transfer_guard_device_to_host("allow"):
    return jax.device_get(outs)


def _host_reads() -> Any:
  """Where the loop reads device values by design (checkpoint saves, evaluations, restores)."""
  return jax.transfer_guard_device_to_host("allow")


def _close(mgr: Any) -> None:
  """Closes the checkpoint manager, which waits for the write in flight. When an exception is already on its
  way out (a diverged loss, a failed evaluation), a failure of that write is reported, not raised over it;
  after a failed write (CheckpointWriteFailed, already reported) nothing more is said."""
  failing = sys.exc_info()[1]
  try:
    with reporting_write_errors(mgr):
      mgr.close()
  except Exception as e:
    if failing is None:
      raise
    if not isinstance(failing, CheckpointWriteFailed):
      print(f"WARNING: the checkpoint write in flight failed too: {type(e).__name__}: {e}", file=sys.stderr,
            flush=True)


# -----------------------------------------------------------------------------------------------------------
# Starting a run: the workdir, the experiment, the state


@dataclasses.dataclass
class Run:
  """A started run: the experiment, its data, checkpoints and state, and what reports on it."""

  config: ml_collections.ConfigDict
  workdir: str
  exp: Experiment
  data_iter: Any
  mgr: Any  # orbax CheckpointManager
  state: TrainState
  start: int
  wlock: WorkdirLock
  status: run_status.Status
  writer: Any  # tensorboardX writer (None but on process 0)


def start_run(config: ml_collections.ConfigDict, workdir: str, *, allow_change: bool, heartbeat_s: float,
              devices: list | None) -> Run:
  """The run in `workdir`, started or resumed: the workdir checked and locked, the model's fused kernel
  checked, the experiment built, the state restored or initialised (through the model's warm start) and
  config.json recorded. A start that fails leaves the workdir as it found it."""
  # Before anything is written: a workdir of another run, or a different experiment, is refused.
  config_diff = config_io.check_workdir(workdir, config, allow_change=allow_change)
  is_main = jax.process_index() == 0
  before = config_io.start_snapshot(workdir) if is_main else None
  wlock = WorkdirLock(workdir, enabled=is_main, every_s=heartbeat_s)
  acquire_everywhere(wlock)
  try:
    # The model's fused kernel compiled and checked on the device first; under "auto" a failure builds the
    # model on the XLA path instead (config.json keeps the config as given).
    exp = Experiment(kernel_check.checked_config(config, workdir, devices=devices, record=is_main),
                     devices=devices)
    # The host's rows of each global batch: the same global stream on any host layout (data/pipeline.py).
    loader = create_dataset(config, "train", **exp.host_batch(int(config.train.batch_size)),
                            seed=int(config.seed))
    data_iter = iter(loader)
    mgr = checkpoint_manager(workdir, config)
    exp.init_rng_state()
    state = exp.warm_start(restore_or_init(mgr, exp, data_iter, set_aside=True))
    if is_main:  # a new run's config.json, or an accepted change appended to its history
      config_io.record_config(workdir, config, config_diff, state.step)
  except BaseException:
    if is_main:
      config_io.undo_start(workdir, before)
    wlock.release()
    raise
  if is_main and config_diff and state.step:
    print(f"config changed when resuming at step {state.step} (recorded in {config_io.HISTORY}): "
          + ", ".join(sorted(config_diff)), flush=True)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  print(f"task={exp.task} data={config.data.name} attention={config.model.attention.name} "
        f"params={n_params:,} mesh={dict(exp.mesh.shape)} steps={state.step}->{config.train.num_steps} "
        f"workdir={workdir}", flush=True)
  status = run_status.Status(workdir, enabled=is_main, every_s=heartbeat_s, relay=supervisor.relay_record)
  status.started(step=state.step, num_steps=int(config.train.num_steps), hosts=jax.process_count(),
                 devices=jax.device_count(), device_kind=jax.devices()[0].device_kind,
                 mesh=dict(exp.mesh.shape))
  writer = summary_writer(paths.join(workdir, "tensorboard")) if is_main else None
  if writer is not None:
    write_hparams(writer, config, state.step)
  return Run(config, workdir, exp, data_iter, mgr, state, state.step, wlock, status, writer)


# -----------------------------------------------------------------------------------------------------------
# The steps' metrics: read in batches, summed over a log window, timed


class Window:
  """The steps' metrics since the last log line: pending on the devices until `read`, then summed; and the
  time of the steps since the window opened (the first step of a process, which compiles, is timed apart)."""

  def __init__(self, run: Run):
    exp = run.exp
    self.run = run
    # Model FLOPs per step (training/throughput.py) and the devices' peak, for MFU.
    self.flops = throughput.model_flops(exp.model_cfg, task=exp.task, abstract_params=run.state.params,
                                        batch=int(run.config.train.batch_size), seq_len=int(exp.info.seq_len))
    self.devices = list(exp.mesh.devices.flat)
    kind = self.devices[0].device_kind
    self.peak = throughput.peak_flops(kind, str(exp.model_cfg.get("dtype", "float32")))
    print(throughput.describe(self.flops) + ("" if self.peak or self.flops["total"] is None else
                                             f"; no peak FLOP/s for {kind!r}: MFU not reported"), flush=True)
    self.local_devices = [d for d in self.devices if d.process_index == jax.process_index()]
    self.pending: list[tuple[int, dict[str, Any]]] = []  # (step before, its metrics on the devices)
    self.in_flight: collections.deque = collections.deque()  # the newest steps' `finite`: the run-ahead
    self.sums: dict[str, float] = {}
    self.count = self.timed = 0
    self.opened = time.perf_counter()
    self.last_saved = run.start if run.mgr.latest_step() is not None else None
    self.fetched_at: list[int] = []

  def add(self, step_before: int, out: dict[str, Any], *, timed: bool) -> None:
    """A dispatched step; waits for the step before last, not for this one, so the devices stay busy."""
    self.pending.append((step_before, out))
    self.timed += timed
    self.in_flight.append(out["finite"])
    if len(self.in_flight) > 2:
      jax.block_until_ready(self.in_flight.popleft())

  def restart_clock(self) -> None:
    """What ran since is not training time (the compilation, an evaluation)."""
    self.timed, self.opened = 0, time.perf_counter()

  def read(self) -> None:
    """The pending steps' metrics, read in one transfer and summed; a non-finite step raises."""
    if not self.pending:
      return
    values = fetch([out for _, out in self.pending])
    steps_before = [s for s, _ in self.pending]
    self.pending.clear()
    self.fetched_at.append(self.run.state.step)
    for step_before, out in zip(steps_before, values, strict=True):
      if not bool(out["finite"]):
        where = (f"the last good checkpoint (step {self.last_saved}) in {self.run.mgr.directory} is intact"
                 if self.last_saved is not None else "no checkpoint was saved before it")
        raise TrainingDiverged(f"non-finite loss ({float(out['loss'])}) or gradient norm "
                               f"({float(out['grad_norm'])}) at step {step_before}; training stopped and "
                               f"{where}. Lower the learning rate, enable clipping, or use float32.")
      for k in steps.METRICS:
        if k in out:
          self.sums[k] = self.sums.get(k, 0.0) + float(out[k])
      self.sums["lr"] = float(out["lr"])
      self.count += 1

  def line(self) -> dict[str, float]:
    """The window's log line (waits for its steps: their time is the window's), then a new window."""
    self.read()
    now, n = time.perf_counter(), self.count
    line = {"loss": self.sums["loss"] / n, "aux_loss": self.sums["aux_loss"] / n,
            "grad_norm": self.sums["grad_norm"] / n, "lr": self.sums["lr"]}
    if self.timed:
      steps_per_s = self.timed / max(now - self.opened, 1e-9)
      line.update(steps_per_s=steps_per_s, tokens_per_s=steps_per_s * self.flops["tokens"],
                  step_ms=1e3 / steps_per_s)
      util = throughput.mfu(self.flops["total"], steps_per_s, self.peak, len(self.devices))
      if util is not None:
        line["mfu"] = util
    line.update(throughput.memory(self.local_devices))
    line.update({k: v for k, v in metrics_lib.summarize(self.run.exp.task, self.sums).items() if k != "loss"})
    self.sums, self.count, self.timed, self.opened = {}, 0, 0, now
    return line


# -----------------------------------------------------------------------------------------------------------
# Train and evaluate


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
                       allow_config_change: bool = False, heartbeat_s: float = 60.0) -> dict[str, Any]:
  """Trains to `config.train.num_steps` (resuming from `workdir`), evaluates, and returns a dict with always
  the same keys: step, start_step, preempted (stopped early with a checkpoint), metrics (the final
  evaluation, as written to metrics.json; empty when preempted), state and experiment.

  allow_config_change: continue a run whose model/data config differs (the change is recorded in the workdir).
  heartbeat_s: seconds between the heartbeat records in `<workdir>/status/` (training/status.py).
  """
  import tqdm

  validation.validate(config)
  workdir = os.fspath(paths.path(workdir))  # local (made absolute) or gs://
  hooks = _HOOKS.get() or TestHooks()
  run = start_run(config, workdir, allow_change=allow_config_change, heartbeat_s=heartbeat_s,
                  devices=hooks.devices)
  window = Window(run)
  profile = throughput.ProfileWindow(config.train.get("profile_steps", None), paths.join(workdir, "profile"))
  bar = tqdm.tqdm(total=int(config.train.num_steps), initial=run.start, dynamic_ncols=True, unit="step",
                  disable=not (progress and jax.process_index() == 0), file=sys.stderr)
  result: dict[str, Any] = {"step": run.start, "start_step": run.start, "preempted": False, "metrics": {},
                            "state": run.state, "experiment": run.exp, "fetched_at": window.fetched_at,
                            "compile_s": None}
  try:  # the bar, the summary writer and the checkpoint manager close once, however the run ends
    with Preemption(run.start) as preempt:
      why = train(run, window, preempt, profile, bar, result, hooks)
    if why is not None:
      run.status.preempted(run.state.step, why)
    else:
      profile.close()
      bar.close()
      result["metrics"] = final_evaluation(run, window)
    result.update(step=run.state.step, state=run.state, preempted=why is not None)
  except BaseException as e:
    lost = supervisor.lost_host(e, workdir)  # a collective whose other end went away
    run.status.failed(lost or e, step=run.state.step)
    if lost is not None:
      raise lost from e
    raise
  finally:
    profile.close()
    bar.close()
    if run.writer is not None:
      run.writer.close()
    _close(run.mgr)  # waits for the checkpoint write in flight
    run.wlock.release()
  if not result["preempted"]:
    _finished(run, result["metrics"])
  return result


def train(run: Run, window: Window, preempt: Preemption, profile: Any, bar: Any, result: dict[str, Any],
          hooks: TestHooks) -> str | None:
  """Steps to `config.train.num_steps`, logging, saving and evaluating on the way; returns None, or why the
  run stopped early (SIGTERM, `stop_after`) with its step saved."""
  t = run.config.train
  num_steps, ckpt_every, log_every, eval_every = (int(t.num_steps), int(t.checkpoint_every),
                                                  int(t.log_every), int(t.eval_every))
  steps_this_run = 0
  while run.state.step < num_steps:
    batch = next(run.data_iter)
    if hooks.batch_log is not None:
      hooks.batch_log.append((run.state.step, _fingerprint(batch)))
    step_before = run.state.step
    profile.before_step(step_before)
    t_first = time.perf_counter()
    run.state, out = run.exp.train_step(run.state, batch)  # dispatched: the host goes on meanwhile
    window.add(step_before, out, timed=steps_this_run > 0)
    if steps_this_run == 0:  # the compilation, timed apart: the timing windows start after it
      jax.block_until_ready(out)
      window.restart_clock()
      result["compile_s"] = window.opened - t_first
      _say(bar, f"first step (compilation included): {result['compile_s']:.2f}s")
      _log_scalars(run.writer, "train", {"compile_s": result["compile_s"]}, run.state.step)
    if profile.ends_at(run.state.step):
      jax.block_until_ready(out)  # the traced steps' time counts in the window, writing the trace not
      t_write = time.perf_counter()
      profile.close()
      window.opened += time.perf_counter() - t_write
      _say(bar, f"profile of steps {profile.start}..{profile.stop} written to {profile.logdir}")
    steps_this_run += 1
    step = run.state.step
    run.status.heartbeat(step)
    run.wlock.refresh()
    bar.update(1)
    # The checkpoint comes first: an evaluation that fails must not lose the step it evaluates (its write
    # goes on in the background, and an exception waits for it in `finally`).
    stop = hooks.stop_after is not None and steps_this_run >= hooks.stop_after
    preempted = preempt.reached(step)  # every boundary, every process: the same answer everywhere
    if step % log_every == 0 or step == num_steps:
      line = window.line()
      _say(bar, f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in line.items()))
      bar.set_postfix(loss=f"{line['loss']:.4f}", refresh=False)
      _log_scalars(run.writer, "train", line, step)
    if preempted or stop or step % ckpt_every == 0 or step == num_steps:
      window.read()  # no state after a non-finite step is ever saved
      with _host_reads(), reporting_write_errors(run.mgr):  # a failed write: one line, the last intact step
        save_checkpoint(run.mgr, run.state, run.data_iter)
      window.last_saved = step
    if preempted or stop:
      with reporting_write_errors(run.mgr):
        run.mgr.wait_until_finished()  # the step is on disk before the run says it stopped
      why = preempt.reason() if preempted else f"stop_after={hooks.stop_after}"
      _say(bar, f"{why}: saved checkpoint at step {step} in {run.mgr.directory}; rerun to resume")
      return why
    if eval_every > 0 and step % eval_every == 0 and step < num_steps:
      evaluate(run, bar)
      window.restart_clock()  # the evaluation is not training time
  return None


def evaluate(run: Run, bar: Any) -> dict[str, Any]:
  """An evaluation during training, logged."""
  split = run.config.eval_split
  with _host_reads():
    metrics = run.exp.evaluate(run.state)
  _say(bar, f"eval {split} @ {run.state.step}: " + format_metrics(metrics))
  _log_scalars(run.writer, f"eval_{split}", metrics, run.state.step)
  return metrics


def final_evaluation(run: Run, window: Window) -> dict[str, Any]:
  """The final state saved (unless it is) and evaluated: metrics written to metrics.json and returned."""
  window.read()
  split, step = run.config.eval_split, run.state.step
  with _host_reads():
    if run.mgr.latest_step() != step:
      with reporting_write_errors(run.mgr):
        save_checkpoint(run.mgr, run.state, run.data_iter)
    metrics = run.exp.evaluate(run.state)
  metrics.update(step=step, split=split, start_step=run.start)
  print(f"final eval {split} @ {step}: " + format_metrics(metrics), flush=True)
  _log_scalars(run.writer, f"eval_{split}", {k: v for k, v in metrics.items() if isinstance(v, float)}, step)
  if jax.process_index() == 0:
    config_io.write_json(paths.join(run.workdir, "metrics.json"), metrics)
  with reporting_write_errors(run.mgr):
    run.mgr.wait_until_finished()  # the final write (it overlapped the evaluation); its errors fail the run
  return metrics


def _finished(run: Run, metrics: dict[str, Any]) -> None:
  """The run's finished record, or NonFiniteEvaluation (and a failed record) for a non-finite evaluation."""
  step = run.state.step
  bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
  if bad:
    e = NonFiniteEvaluation(f"the final evaluation at step {step} is not finite ({', '.join(bad)}); "
                            f"the checkpoint of step {step} in {run.mgr.directory} is kept")
    run.status.failed(e, step=step, metrics=metrics)
    raise e
  run.status.finished(step, metrics)
