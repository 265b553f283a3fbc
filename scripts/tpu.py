r"""Cloud TPU launcher: a TPU VM slice through queued resources, this code and its runtime requirements on
every worker, `train.py --multihost` on all workers, and a watch that knows how training ended.

    python -m scripts.tpu run --name c4-combiner --zone us-central2-b --accelerator v4-8 --spot \
        --config configs/c4.py --workdir gs://my-bucket/c4-combiner --delete_after   # until training ends
    python -m scripts.tpu status --name c4-combiner --zone us-central2-b --workdir gs://my-bucket/c4-combiner
    python -m scripts.tpu logs --name c4-combiner --zone us-central2-b      # follow worker 0's log
    python -m scripts.tpu delete --name c4-combiner --zone us-central2-b

Subcommands: create (a queued resource: on-demand, `--spot`, `--best_effort` or `--reserved`), copy (the git
HEAD as a tarball by scp, its commit in the code's COMMIT file; or `--repo_url` cloned on the workers), setup
(a Python venv with requirements.txt + requirements-tpu.txt and `jax[tpu]` at the pinned jax version, the
install line jax documents, on `--worker=all`), train (train.py on every worker, detached, log in
~/train.log, pid in ~/train.pid; a second `train` while it runs starts nothing), logs, status (the queued
resource's state and the run's records), run (create, copy, setup, a kernel check, train, then watch),
delete. `--dry_run` prints every command instead of running it. Commands are argument lists; the remote shell
commands quote every user-given value with shlex.quote; `--name` must be a GCP resource name, no value may
start with '-' (it would be read as an option), git reads the revision after `--end-of-options`, and the code
tarball is a `tempfile` file. A bad flag is one `ERROR:` line, exit 2. copy and run refuse a git tree with
uncommitted changes (they would not be shipped) unless `--allow_dirty`. A multi-host slice needs a `gs://`
workdir (every worker writes to it).

How `run` knows how training went: train.py writes its state to `<workdir>/status/` (training/status.py):
`started`, a `heartbeat` every minute from the training loop, then `finished`, `failed` or `preempted`.
Every `--poll_s` seconds the watch reads the queued resource's state, whether train.py still runs on worker 0
(its pid, over ssh) and those records (`gcloud storage ls/cat` for a `gs://` workdir, else over ssh from
worker 0's disk):

- finished: prints the final metrics; exit 0.
- failed by an error of the run (cause `exception` or `checkpoint_write`: a restart would repeat it), or no
  new record for `--stall_s` seconds (a hung step or collective): prints the failure and the log's last
  lines; exit 1.
- preempted (the queued resource SUSPENDED/FAILED or gone): deletes it, creates it again, and training
  resumes from the workdir's checkpoint. A `preempted` record (SIGTERM) while the slice stays ACTIVE starts
  train.py again on it.
- a lost host, met like a preemption: a `failed` record with cause `host_lost` (train.py's supervisor writes
  it when a process of the run stopped sending heartbeats: training/supervisor.py), or train.py gone from
  worker 0 for `--grace_s` seconds without a final record (the launcher then writes that record itself).
  What is left of the run is stopped on every worker and train.py starts again on the slice, resuming from
  the last intact checkpoint; a slice that is no longer ACTIVE, or whose workers cannot all be reached, is
  recreated first.
- preemptions and lost hosts together restart at most `--max_restarts` times; past that, a run that keeps
  failing (a deterministic crash) stops with its account and the log's last lines; exit 1.
- a gcloud or ssh error (ssh's exit status 255, a gcloud failure, a timeout) is retried `--retries` times,
  waiting `--backoff_s` seconds and doubling; it is never taken as an answer. When it persists, run stops
  with exit 1.

`--delete_after` deletes the slice when run ends, however it ends (finished, failed, an error or Ctrl-C in
the launcher); `--delete_on_failure` deletes it only when training did not finish.

On the slice, before training starts, `run` compares every fused kernel with its XLA path on one chip of
worker 0 (`python -m scripts.check_kernels`, once per launch; `--skip_kernel_check` skips it). A failure is
printed as a WARNING with the script's lines and training starts all the same: train.py checks the kernel its
model uses itself (training/kernel_check.py) and, under implementation="auto", trains on the XLA path when it
fails (with the kernel named explicitly it stops).

Before create and run make a slice, the config's whole train step is compiled here for the accelerator type
(`scripts/compile_tpu.py`, with the `--config.*` and gin flags given after `--`): a config that does not fit
the slice's HBM or does not compile creates nothing. `--skip_compile_check` skips it; `--dry_run` only
prints it; v2 and v3 slices are not checked (compile_tpu.py models v4, v5e, v5p and v6e).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a file: the repository root is the import root
  sys.path.insert(0, ROOT)

from runtime import cli, tpu_generations  # noqa: E402 (cli: one-line user errors, exit 2)
from scripts.tpu_commands import (  # noqa: E402
  LauncherError,
  accelerator_type,
  compile_check_cmd,
  copy_cmds,
  generation,
  hosts,
  is_gcs,
  logs_cmd,
  setup_cmds,
  shipped_commit,
  train_cmds,
)
from scripts.tpu_watch import (  # noqa: E402
  Runner,
  TrainingFailed,
  create,
  delete_slice,
  final_metrics,
  perform,
  probe,
  queued_state,
  read_records,
  run_until_done,
  start_training,
)
from training import status as run_status  # noqa: E402 (no jax: the records' names and paths)

RUNTIMES = {g.gcloud: g.runtime for g in tpu_generations.GENERATIONS.values()}


def run_command(args: argparse.Namespace, run: Runner) -> int:
  """`run`: the slice is deleted on the way out when asked, whatever happened in between."""
  check_workdir(args)
  train_cmds(args)  # checks --config/--workdir before anything is created
  commit = args.commit = None if args.repo_url else shipped_commit(args)
  compile_check(args, run)
  finished = False
  try:
    done = run_until_done(args, run, commit)
    finished = True
    if not run.dry_run:
      print(f"training finished at step {done.get('step')}: {final_metrics(done)}", flush=True)
      print(f"workdir: {args.workdir}", flush=True)
  except TrainingFailed as e:  # the details first, then the deletion, then the error line (main)
    print("\n".join(e.lines), flush=True)
    e.lines = []
    raise
  finally:
    if args.delete_after or (args.delete_on_failure and not finished):
      why = "--delete_after" if args.delete_after else "--delete_on_failure"
      print(f"deleting queued resource {args.name} ({why})", flush=True)
      try:
        delete_slice(args, run)
      except LauncherError as e:  # never hides the error that got here; says what is left running
        print(f"could not delete {args.name}: {e}; delete it with `python -m scripts.tpu delete --name "
              f"{args.name} --zone {args.zone}`", file=sys.stderr, flush=True)
  return 0


def check_workdir(args: argparse.Namespace) -> None:
  if args.accelerator and args.workdir and not is_gcs(args.workdir) and hosts(args.accelerator) > 1:
    raise cli.UsageError(f"--workdir must be a gs:// path on {args.accelerator} ({hosts(args.accelerator)} "
                     f"hosts): every worker writes to it")


def compile_check(args: argparse.Namespace, run: Runner) -> None:
  """Refuses (LauncherError) to go on when the config's train step does not fit or compile on the slice."""
  if args.skip_compile_check:
    return
  if not args.config:
    run.note("no --config: the compile check is skipped")
    return
  if not generation(args.accelerator).compile_check:
    run.note(f"scripts/compile_tpu.py does not model {args.accelerator}: the compile check is skipped")
    return
  cmd = compile_check_cmd(args)
  if run.dry_run:
    run.note("compile check, not run by --dry_run: " + shlex.join(cmd))
    return
  code = run(cmd, capture=False).code
  if code:
    raise LauncherError(f"the compile check of {args.config} on {args.accelerator} failed (exit {code}): "
                        f"not creating {args.name}; --skip_compile_check creates it anyway")


def show_status(args: argparse.Namespace, run: Runner) -> None:
  state = queued_state(args, run)
  print(f"queued resource {args.name}: {state}", flush=True)
  if state != "ACTIVE" and not is_gcs(args.workdir):
    return
  records = read_records(args, run) if is_gcs(args.workdir) else probe(args, run)[1]
  for name in run_status.RECORDS:
    if name in records:
      r = records[name]
      when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("time", 0)))
      extra = {"finished": final_metrics(r), "failed": r.get("error"), "preempted": r.get("reason"),
               "started": f"commit {r.get('commit')}"}.get(name, "")
      print(f"{name}: step {r.get('step')} at {when} {extra or ''}".rstrip(), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
  """Bad flags and values: one `ERROR:` line on stderr, exit 2 (runtime/cli.py); a failed gcloud/git command
  or training run: one `error:` line, exit 1."""
  return cli.run(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
  args = parse_args(argv)
  run = Runner(args.dry_run)
  try:
    return dispatch(args, run)
  except TrainingFailed as e:
    if e.lines:
      print("\n".join(e.lines), flush=True)
    raise SystemExit(f"error: {e}") from None
  except cli.UsageError:
    raise
  except (ValueError, LauncherError) as e:  # gcloud and git errors say which
    raise SystemExit(f"error: {e}") from None
  except KeyboardInterrupt:
    raise SystemExit("interrupted") from None


def dispatch(args: argparse.Namespace, run: Runner) -> int:
  if args.accelerator:
    accelerator_type(args.accelerator)
  cmd = args.command
  if cmd in ("create", "run") and not args.accelerator:
    raise cli.UsageError(f"{cmd} needs --accelerator (e.g. v4-8, v5e-16)")
  if cmd == "create":
    compile_check(args, run)
    if not create(args, run):
      raise LauncherError(f"queued resource {args.name} did not become ACTIVE")
  elif cmd == "setup":
    perform(args, run, setup_cmds(args))
  elif cmd == "copy":
    perform(args, run, copy_cmds(args, None if args.repo_url else shipped_commit(args)))
  elif cmd == "train":
    check_workdir(args)
    start_training(args, run)
  elif cmd == "logs":
    run(logs_cmd(args), capture=False)
  elif cmd == "status":
    show_status(args, run)
  elif cmd == "delete":
    delete_slice(args, run)
  elif cmd == "run":
    return run_command(args, run)
  return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = cli.ArgumentParser(prog="python -m scripts.tpu", description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("command", choices=["create", "setup", "copy", "train", "logs", "status", "run", "delete"])
  p.add_argument("--name", required=True, help="queued-resource and TPU VM name")
  p.add_argument("--zone", required=True, help="e.g. us-central2-b (v4), us-west4-a (v5e)")
  p.add_argument("--project", default=None, help="GCP project (default: gcloud's configured one)")
  p.add_argument("--accelerator", default=None,
                 help="v2-8, v3-32, v4-8, v5e-16 (= v5litepod-16), v5p-8, v6e-8 ... (v2-v4 and v5p count "
                      "TensorCores, v5e and v6e chips)")
  p.add_argument("--runtime", default=None, help=f"TPU software version (default per generation: {RUNTIMES})")
  kind = p.add_mutually_exclusive_group()
  kind.add_argument("--spot", action="store_true", help="spot capacity (cheapest; preemptible at any time)")
  kind.add_argument("--best_effort", action="store_true", help="best-effort queued capacity (preemptible)")
  kind.add_argument("--reserved", action="store_true", help="the project's reserved capacity")
  p.add_argument("--python", default="python3.11", help="the workers' venv interpreter (requirements: 3.11)")
  p.add_argument("--repo_url", default=None, help="git clone this URL on the workers instead of copying HEAD")
  p.add_argument("--ref", default=None, help="git revision to copy or check out (default HEAD / the clone's)")
  p.add_argument("--allow_dirty", action="store_true",
                 help="copy HEAD although the git tree has uncommitted changes (they are not shipped)")
  p.add_argument("--config", default=None, help="train.py --config value, e.g. configs/c4.py")
  p.add_argument("--workdir", default=None,
                 help="train.py --workdir: a gs:// path (required on multi-host slices), or a path on worker "
                      "0's disk relative to the code")
  p.add_argument("--poll_s", type=float, default=60, help="seconds between checks of the slice and the run")
  p.add_argument("--stall_s", type=float, default=1800,
                 help="run: fail when no new status record (heartbeat) came for this long; it covers "
                      "start-up and the first compilation, so keep it well above them")
  p.add_argument("--grace_s", type=float, default=180,
                 help="run: how long train.py may be gone from worker 0 without a final record (a preemption "
                      "shows in the queued resource's state within this time) before that is a failure")
  p.add_argument("--retries", type=int, default=5, help="retries of a failed gcloud/ssh command")
  p.add_argument("--backoff_s", type=float, default=10, help="seconds before the first retry (then doubling)")
  p.add_argument("--query_timeout_s", type=float, default=300, help="time limit of one query (an error)")
  p.add_argument("--max_restarts", type=int, default=20,
                 help="give up after this many restarts (preemptions and lost hosts together)")
  p.add_argument("--delete_after", action="store_true",
                 help="run: delete the slice when run ends, however it ends")
  p.add_argument("--delete_on_failure", action="store_true",
                 help="run: delete the slice when training did not finish (keep it when it did)")
  p.add_argument("--dry_run", action="store_true", help="print every command instead of running it")
  p.add_argument("--skip_compile_check", action="store_true",
                 help="create the slice without first compiling the config's train step for it here")
  p.add_argument("--skip_kernel_check", action="store_true",
                 help="run: do not run scripts/check_kernels.py on worker 0 before training")
  p.add_argument("--kernel_check_timeout_s", type=float, default=1800,
                 help="run: time limit of the kernel check on worker 0 (a timeout is a warning)")
  p.epilog = "Everything after `--` goes to train.py, e.g. -- --config.seed=1"
  argv = list(sys.argv[1:] if argv is None else argv)
  cut = argv.index("--") if "--" in argv else len(argv)
  args = p.parse_args(argv[:cut])
  args.train_args = argv[cut + 1:]
  check_args(args)
  return args


# GCP resource names (queued resources, TPU VMs): a lowercase letter, then lowercase letters, digits and
# hyphens, at most 63 characters, not ending in a hyphen.
RESOURCE_NAME = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?")


def check_args(args: argparse.Namespace) -> None:
  """Refuses (UsageError, naming the flag) values outside their domains and values that gcloud or git would
  read as options; every value reaches gcloud and git as its own argument, never through a shell."""
  if not RESOURCE_NAME.fullmatch(args.name):
    raise cli.UsageError(f"--name {args.name!r} is not a GCP resource name: a lowercase letter first, then "
                         "lowercase letters, digits and hyphens, at most 63 characters, no hyphen at the end")
  for flag in ("zone", "project", "runtime", "accelerator", "ref", "config", "workdir", "python", "repo_url"):
    value = getattr(args, flag)
    if value is not None and (not value or value.startswith("-")):
      raise cli.UsageError(f"--{flag} {value!r} must not be empty or start with '-' (it would be read as an "
                           "option)")
  for flag in ("poll_s", "stall_s", "query_timeout_s", "kernel_check_timeout_s"):
    cli.positive(f"--{flag}", getattr(args, flag))
  for flag in ("grace_s", "backoff_s", "retries", "max_restarts"):
    cli.at_least(f"--{flag}", getattr(args, flag), 0)


if __name__ == "__main__":
  sys.exit(main())
