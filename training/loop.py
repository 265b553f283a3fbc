"""The training loop: train to `config.train.num_steps` from the workdir's newest checkpoint, then evaluate.

- Checkpoints every `train.checkpoint_every` steps (the last `train.keep_checkpoints` kept, atomic, saved
  before the evaluation of the same step) with the data-iterator state; rerunning with the same workdir
  resumes from the newest checkpoint that restores with finite values, after checking the config against the
  run's (training/config_io.py). Checkpoints are written in the background while training goes on
  (training/checkpoints.py); the loop waits for the write in flight before it reports a stop or returns.
  SIGTERM (preemption) to any process stops every process at the same step (training/preemption.py), which
  each saves before returning. A NaN/Inf loss or gradient stops the run with a clear message naming the first
  bad step; the last good checkpoint stays (the bad step is never applied, and no state after it is saved).
  A non-finite final evaluation raises after its metrics are written.
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
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from configs import base as config_base
from models import metrics as metrics_lib
from runtime import paths
from training import config_io, hibert_init, kernel_check, throughput
from training import status as run_status
from training.checkpoints import checkpoint_manager, restore_or_init, save_checkpoint
from training.experiment import Experiment, create_dataset
from training.lock import WorkdirLock, acquire_everywhere
from training.preemption import Preemption


class TrainingDiverged(RuntimeError):
  """Raised when the loss or the gradients are not finite."""


class NonFiniteEvaluation(RuntimeError):
  """Raised when the final evaluation is not finite (its metrics are written, null for the bad values)."""


# -----------------------------------------------------------------------------------------------------------
# Output


def format_metrics(metrics: dict[str, Any]) -> str:
  """`k=v` pairs; the batch and example counts say what an evaluation figure covers."""
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _say(bar: Any, line: str) -> None:
  """A metrics line on stdout that does not break the progress bar, flushed (stdout is often a pipe)."""
  bar.write(line, file=sys.stdout)
  sys.stdout.flush()


def _fingerprint(batch: dict[str, np.ndarray]) -> str:
  import hashlib

  h = hashlib.sha1()
  for k in sorted(batch):
    h.update(k.encode())
    h.update(np.ascontiguousarray(batch[k]).tobytes())
  return h.hexdigest()[:16]


def _close(mgr: Any) -> None:
  """Closes the checkpoint manager, which waits for the write in flight. When an exception is already on its
  way out (a diverged loss, a failed evaluation), a failure of that write is reported, not raised over it."""
  failing = sys.exc_info()[0] is not None
  try:
    mgr.close()
  except Exception as e:
    if not failing:
      raise
    print(f"WARNING: the checkpoint write in flight failed too: {type(e).__name__}: {e}", file=sys.stderr,
          flush=True)


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


def fetch(outs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The metrics of the steps in `outs` on the host, in one transfer: the loop's only read of step results (at
  log steps and before saves), allowed even where the caller forbids device-to-host transfers."""
  with jax.transfer_guard_device_to_host("allow"):
    return jax.device_get(outs)


def _host_reads() -> Any:
  """Where the loop reads device values by design (checkpoint saves, evaluations, restores)."""
  return jax.transfer_guard_device_to_host("allow")


# -----------------------------------------------------------------------------------------------------------
# Train and evaluate


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, devices: list | None = None,
                       stop_after: int | None = None, batch_log: list | None = None,
                       progress: bool = True, allow_config_change: bool = False,
                       heartbeat_s: float = 60.0) -> dict[str, Any]:
  """Trains to `config.train.num_steps` (resuming from `workdir`), evaluates, and returns a dict with always
  the same keys: step, start_step, preempted (stopped early with a checkpoint: SIGTERM or `stop_after`),
  metrics (the final evaluation, as written to metrics.json; empty when preempted), state and experiment.

  stop_after: leave after this many steps of this process, saving a checkpoint (a planned preemption).
  batch_log: if a list, receives (step, fingerprint of the host batch) per step (tests check data order).
  allow_config_change: continue a run whose model/data config differs (the change is recorded in the workdir).
  heartbeat_s: seconds between the heartbeat records in `<workdir>/status/` (training/status.py).
  """
  import tqdm

  config_base.validate(config)
  workdir = os.fspath(paths.path(workdir))  # local (made absolute) or gs://
  # Before anything is written: a workdir of another run, or a different experiment, is refused.
  config_diff = config_io.check_workdir(workdir, config, allow_change=allow_config_change)
  is_main = jax.process_index() == 0
  # One run per workdir; a new run whose start fails (a bad model field, missing data) leaves the workdir as
  # it found it, so config.json comes last, once the model, the data and the checkpoints are in place.
  before = config_io.start_snapshot(workdir) if is_main else None
  wlock = WorkdirLock(workdir, enabled=is_main, every_s=heartbeat_s)
  acquire_everywhere(wlock)
  try:
    # The model's fused kernel compiled and checked on the device first; under "auto" a failure builds the
    # model on the XLA path instead (config.json keeps the config as given).
    exp = Experiment(kernel_check.checked_config(config, workdir, devices=devices, record=is_main),
                     devices=devices)
    num_steps = int(config.train.num_steps)
    # The host's rows of each global batch: the same global stream on any host layout (data/pipeline.py).
    loader = create_dataset(config, "train", **exp.host_batch(int(config.train.batch_size)),
                            seed=int(config.seed))
    data_iter = iter(loader)
    mgr = checkpoint_manager(workdir, config)
    exp.init_rng_state()
    state = restore_or_init(mgr, exp, data_iter, set_aside=True)
    state = hibert_init.pretrained(exp, state)  # HIBERT: a fresh summarisation run takes a pretrained encoder
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
  start = state.step
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  print(f"task={exp.task} data={config.data.name} attention={config.model.attention.name} "
        f"params={n_params:,} mesh={dict(exp.mesh.shape)} steps={start}->{num_steps} workdir={workdir}",
        flush=True)

  status = run_status.Status(workdir, enabled=is_main, every_s=heartbeat_s)
  status.started(step=start, num_steps=num_steps, hosts=jax.process_count(), devices=jax.device_count(),
                 device_kind=jax.devices()[0].device_kind, mesh=dict(exp.mesh.shape))
  writer = summary_writer(paths.join(workdir, "tensorboard")) if is_main else None
  if writer is not None:
    write_hparams(writer, config, start)
  # Model FLOPs per step (training/throughput.py) and the devices' peak, for MFU.
  batch_size = int(config.train.batch_size)
  flops = throughput.model_flops(exp.model_cfg, task=exp.task, abstract_params=state.params, batch=batch_size,
                                 seq_len=int(exp.info.seq_len))
  devices_used = list(exp.mesh.devices.flat)
  peak = throughput.peak_flops(devices_used[0].device_kind, str(exp.model_cfg.get("dtype", "float32")))
  kind = devices_used[0].device_kind
  print(throughput.describe(flops) + ("" if peak or flops["total"] is None else
                                      f"; no peak FLOP/s for {kind!r}: MFU not reported"), flush=True)
  local_devices = [d for d in devices_used if d.process_index == jax.process_index()]
  profile = throughput.ProfileWindow(config.train.get("profile_steps", None), paths.join(workdir, "profile"))

  def log_scalars(prefix: str, values: dict[str, Any], step: int) -> None:
    if writer is not None:
      for k, v in values.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
          writer.add_scalar(f"{prefix}/{k}", v, step)
      writer.flush()

  ckpt_every = int(config.train.checkpoint_every)
  log_every, eval_every = int(config.train.log_every), int(config.train.eval_every)
  bar = tqdm.tqdm(total=num_steps, initial=start, disable=not (progress and is_main), dynamic_ncols=True,
                  unit="step", file=sys.stderr)
  acc: dict[str, float] = {}
  # acc_n: steps in `acc`; timed_n: steps since t_last (the first step of a run, which compiles, is not
  # timed).
  acc_n, timed_n, t_last = 0, 0, time.perf_counter()
  last_saved = start if mgr.latest_step() is not None else None
  steps_this_run = 0
  pending: list[tuple[int, dict[str, Any]]] = []  # (step before, its metrics on the devices), not yet read
  in_flight: collections.deque = collections.deque()  # the newest steps' `finite`, to bound the run-ahead
  result: dict[str, Any] = {"step": start, "start_step": start, "preempted": False, "metrics": {},
                            "state": state, "experiment": exp, "fetched_at": [], "compile_s": None}

  def read_pending() -> None:
    """The pending steps' metrics, read in one transfer and summed into `acc`; a non-finite step raises."""
    nonlocal acc_n
    if not pending:
      return
    values = fetch([out for _, out in pending])
    steps = [s for s, _ in pending]
    pending.clear()
    result["fetched_at"].append(state.step)
    for step_before, out in zip(steps, values, strict=True):
      if not bool(out["finite"]):
        where = (f"the last good checkpoint (step {last_saved}) in {mgr.directory} is intact"
                 if last_saved is not None else "no checkpoint was saved before it")
        raise TrainingDiverged(f"non-finite loss ({float(out['loss'])}) or gradient norm "
                               f"({float(out['grad_norm'])}) at step {step_before}; training stopped and "
                               f"{where}. Lower the learning rate, enable clipping, or use float32.")
      for k in ("loss", "aux_loss", "grad_norm", "nll_sum", "weight_sum", "correct_sum"):
        if k in out:
          acc[k] = acc.get(k, 0.0) + float(out[k])
      acc["lr"] = float(out["lr"])
      acc_n += 1
  try:  # the bar, the summary writer and the checkpoint manager close once, however the run ends
    with Preemption(start) as preempt:
      while state.step < num_steps:
        batch = next(data_iter)
        if batch_log is not None:
          batch_log.append((state.step, _fingerprint(batch)))
        step_before = state.step
        profile.before_step(step_before)
        first = steps_this_run == 0
        t_first = time.perf_counter()
        state, out = exp.train_step(state, batch)  # dispatched: the host goes on while the devices compute
        pending.append((step_before, out))
        if first:  # the compilation, timed apart: the timing windows start after it
          jax.block_until_ready(out)
          t_last = time.perf_counter()
          result["compile_s"] = t_last - t_first
          _say(bar, f"first step (compilation included): {result['compile_s']:.2f}s")
          log_scalars("train", {"compile_s": result["compile_s"]}, state.step)
        else:
          timed_n += 1
        in_flight.append(out["finite"])
        if len(in_flight) > 2:  # waits for the step before last, not for this one: the devices stay busy
          jax.block_until_ready(in_flight.popleft())
        if profile.ends_at(state.step):
          jax.block_until_ready(out)  # the traced steps' time counts in the window, writing the trace not
          t_write = time.perf_counter()
          profile.close()
          t_last += time.perf_counter() - t_write
          _say(bar, f"profile of steps {profile.start}..{profile.stop} written to {profile.logdir}")
        steps_this_run += 1
        status.heartbeat(state.step)
        wlock.refresh()
        bar.update(1)
        # The checkpoint comes first: an evaluation that fails must not lose the step it evaluates (its write
        # goes on in the background, and an exception waits for it in `finally`).
        stop = stop_after is not None and steps_this_run >= stop_after
        preempted = preempt.reached(state.step)  # every boundary, every process: the same answer everywhere
        save = preempted or stop or state.step % ckpt_every == 0 or state.step == num_steps
        if state.step % log_every == 0 or state.step == num_steps:
          read_pending()  # waits for the devices: the window's time is the steps' time
          now = time.perf_counter()
          train_m = metrics_lib.summarize(exp.task, acc)
          line = {"loss": acc["loss"] / acc_n, "aux_loss": acc["aux_loss"] / acc_n,
                  "grad_norm": acc["grad_norm"] / acc_n, "lr": acc["lr"]}
          if timed_n:
            steps_per_s = timed_n / max(now - t_last, 1e-9)
            line.update(steps_per_s=steps_per_s, tokens_per_s=steps_per_s * flops["tokens"],
                        step_ms=1e3 / steps_per_s)
            util = throughput.mfu(flops["total"], steps_per_s, peak, len(devices_used))
            if util is not None:
              line["mfu"] = util
          line.update(throughput.memory(local_devices))
          line.update({k: v for k, v in train_m.items() if k != "loss"})
          _say(bar, f"step {state.step}: " + " ".join(f"{k}={v:.4g}" for k, v in line.items()))
          bar.set_postfix(loss=f"{line['loss']:.4f}", refresh=False)
          log_scalars("train", line, state.step)
          acc, acc_n, timed_n, t_last = {}, 0, 0, now
        if save:
          read_pending()  # no state after a non-finite step is ever saved
          with _host_reads():
            save_checkpoint(mgr, state, data_iter)
          last_saved = state.step
        if preempted or stop:
          mgr.wait_until_finished()  # the step is on disk before the run says it stopped
          why = preempt.reason() if preempted else f"stop_after={stop_after}"
          _say(bar, f"{why}: saved checkpoint at step {state.step} in {mgr.directory}; rerun to resume")
          result.update(step=state.step, preempted=True, state=state)
          status.preempted(state.step, why)
          return result
        if eval_every > 0 and state.step % eval_every == 0 and state.step < num_steps:
          with _host_reads():
            eval_metrics = exp.evaluate(state)
          _say(bar, f"eval {config.eval_split} @ {state.step}: " + format_metrics(eval_metrics))
          log_scalars(f"eval_{config.eval_split}", eval_metrics, state.step)
          timed_n, t_last = 0, time.perf_counter()  # the evaluation is not training time
    profile.close()
    bar.close()
    read_pending()
    with _host_reads():
      if mgr.latest_step() != state.step:
        save_checkpoint(mgr, state, data_iter)
      eval_metrics = exp.evaluate(state)
    eval_metrics.update(step=state.step, split=config.eval_split, start_step=start)
    print(f"final eval {config.eval_split} @ {state.step}: " + format_metrics(eval_metrics), flush=True)
    log_scalars(f"eval_{config.eval_split}", {k: v for k, v in eval_metrics.items() if isinstance(v, float)},
                state.step)
    if is_main:
      config_io.write_json(paths.join(workdir, "metrics.json"), eval_metrics)
    mgr.wait_until_finished()  # the final write (it overlapped the evaluation); its errors fail the run
    result.update(step=state.step, metrics=eval_metrics, state=state)
  except BaseException as e:
    status.failed(e, step=state.step)
    raise
  finally:
    profile.close()
    bar.close()
    if writer is not None:
      writer.close()
    _close(mgr)  # waits for the checkpoint write in flight
    wlock.release()
  bad = sorted(k for k, v in result["metrics"].items() if isinstance(v, float) and not math.isfinite(v))
  if bad:
    e = NonFiniteEvaluation(f"the final evaluation at step {state.step} is not finite ({', '.join(bad)}); "
                            f"the checkpoint of step {state.step} in {mgr.directory} is kept")
    status.failed(e, step=state.step, metrics=result["metrics"])
    raise e
  status.finished(state.step, result["metrics"])
  return result

