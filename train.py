r"""Trains an experiment config: jit over a named device mesh, orbax checkpoints with exact resume.

    python train.py                            # the embedded default (configs/default.py), ~2 min CPU
    python train.py --config configs/cifar10.py:attention=combiner_axial_vertical --workdir workdirs/c10 \
        --config.optimizer.lr=3e-4 --gin_bindings "attention.deepsets = True"

Flags parse here; the work is in training/: the mesh (data, fsdp, seq, model) from `config.mesh` and parameter
shardings (mesh.py), the model and its jitted steps (experiment.py), orbax checkpoints with the data-iterator
state (checkpoints.py), the workdir's config checks (config_io.py), and the loop (loop.py).

- Rerunning with the same workdir resumes from the newest checkpoint that restores with finite values, after
  checking the config against the run's. SIGTERM (preemption) saves a checkpoint and exits 0. A NaN/Inf loss
  or gradient stops the run with a clear message (exit 1); the last good checkpoint stays. A non-finite final
  evaluation exits non-zero.
- Output: a progress bar, metric lines on stdout, TensorBoard summaries in `<workdir>/tensorboard`, the
  resolved config in `<workdir>/config.json`, final eval metrics in `<workdir>/metrics.json`, and the run's
  state in `<workdir>/status/` (started, heartbeats, then finished, failed or preempted: training/status.py).
  The workdir may be `gs://` (files: runtime/paths.py; arrays: orbax).
- Before the first step the model's fused attention kernel (on a GPU/TPU, or named in the config) is compiled
  and compared with the XLA path (training/kernel_check.py): under "auto" a failure trains on the XLA path and
  says so (log, `<workdir>/status/kernel_check.json`); a kernel named explicitly stops the run (exit 1).
- Processes: `--multihost` on Cloud TPU pods and under SLURM (scripts/slurm.py writes the sbatch script);
  elsewhere `--coordinator_address --num_processes --process_id`
  (runtime/distributed.py). Each process feeds its own shard of every global batch. Each process trains in a
  child of its own supervisor (training/supervisor.py): when a host is lost (a process stops sending
  heartbeats for `--host_timeout_s`), JAX stops the others and a supervisor records the cause and the last
  intact step in `<workdir>/status/failed.json` (exit 75); rerunning resumes.
- A checkpoint the storage refuses (a full disk, a quota, a read-only filesystem) stops the run with one
  `ERROR:` line naming the checkpoints directory, the OS error and the last intact step (exit 1, also in
  failed.json); the half-written step is removed, and a rerun after freeing space resumes from that step.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import ml_collections

from runtime import cli, distributed
from training import command_line, config_io, supervisor


def _flags():
  from absl import flags

  command_line.define_config_flag(config_io.DEFAULT_CONFIG)
  flags.DEFINE_string("workdir", None, "checkpoints, summaries and config; default workdirs/<config>-<time>")
  flags.DEFINE_multi_string("gin_file", [], "gin files binding attention constructor fields (ablations)")
  flags.DEFINE_multi_string("gin_bindings", [], "gin bindings, e.g. 'attention.deepsets = True'")
  distributed.define_flags()  # --multihost, --coordinator_address, --num_processes, --process_id
  flags.DEFINE_bool("progress", True, "show the progress bar")
  flags.DEFINE_float("heartbeat_s", 60.0, "seconds between heartbeat records in <workdir>/status/")
  flags.DEFINE_bool("list", False, "list the attention names, the configs and their arguments, then exit")
  flags.DEFINE_bool("allow_config_change", False, "resume a workdir although model/data fields of the config "
                    "differ from its run's (the change is recorded in config_history.json)")
  return flags.FLAGS


def chance_accuracy(config: ml_collections.ConfigDict, info: Any) -> float | None:
  if config.data.name == "synthetic_recall":
    from data import synthetic

    return synthetic.chance(config)
  return 1.0 / info.num_classes if info.num_classes else None


def main(argv: list[str]) -> None:
  del argv
  from absl import flags as absl_flags
  from absl import logging

  logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
  flags = absl_flags.FLAGS
  if flags.list:
    from training import listing

    print(listing.listing())
    return
  cli.workdir_dir("--workdir", flags.workdir, must_exist=False)
  cli.positive("--heartbeat_s", flags.heartbeat_s)
  cli.at_least("--host_timeout_s", flags.host_timeout_s, 1)
  workdir = flags.workdir
  if workdir is None:
    name = os.path.splitext(os.path.basename(config_io.config_path_of(flags)))[0]
    workdir = os.path.join("workdirs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  if distributed.requested(flags) and not supervisor.is_child():  # one process of several: supervised
    sys.exit(supervisor.supervise([os.path.abspath(sys.argv[0]), *sys.argv[1:], f"--workdir={workdir}"],
                                  workdir))
  config = command_line.checked_config(flags)  # before any model is built or anything written
  import jax

  from training import checkpoints, experiment, kernel_check, loop, status

  distributed.initialize_from_flags(flags)
  supervisor.tell(process_index=jax.process_index(), process_count=jax.process_count())
  try:
    info = experiment.dataset_info(config)
    chance = chance_accuracy(config, info)
    print(f"training {config.data.name} -> {workdir}"
          + (f" (chance accuracy: {100 * chance:.1f}%)" if chance else ""), flush=True)
    result = loop.train_and_evaluate(config, workdir, progress=flags.progress, heartbeat_s=flags.heartbeat_s,
                                     allow_config_change=flags.allow_config_change)
  except BaseException as e:  # failed.json for a watcher, unless the loop wrote it already
    if not isinstance(e, config_io.ConfigMismatch):  # the workdir is another run's: nothing is written there
      status.record_failure(workdir, e, enabled=jax.process_index() == 0)
    if not isinstance(e, (loop.TrainingDiverged, loop.NonFiniteEvaluation, config_io.ConfigMismatch,
                          checkpoints.UnrestorableCheckpoint, checkpoints.CheckpointWriteFailed,
                          kernel_check.KernelCheckFailed, supervisor.HostLost)):
      raise
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    sys.exit(supervisor.EXIT_HOST_LOST if isinstance(e, supervisor.HostLost) else 1)
  if "accuracy" in result["metrics"] and chance:
    print(f"accuracy {100 * result['metrics']['accuracy']:.1f}% vs chance {100 * chance:.1f}%", flush=True)


if __name__ == "__main__":
  cli.run_absl(main, _flags)
