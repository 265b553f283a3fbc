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
- failed, no new record for `--stall_s` seconds (a hung step or collective), or train.py gone from worker 0
  for `--grace_s` seconds without a final record: prints the failure and the log's last lines; exit 1.
- preempted (the queued resource SUSPENDED/FAILED or gone): deletes it, creates it again, and training
  resumes from the workdir's checkpoint (at most `--max_restarts` times). A `preempted` record (SIGTERM)
  while the slice stays ACTIVE starts train.py again on it.
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
import atexit
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a file: the repository root is the import root
  sys.path.insert(0, ROOT)

from runtime import cli  # noqa: E402 (one-line user errors, exit 2)
from training import status as run_status  # noqa: E402 (no jax: the records' names and paths)

REMOTE_DIR = "~/combiner"  # code on every worker
REMOTE_VENV = "~/venv"
REMOTE_LOG = "~/train.log"
REMOTE_PID = "~/train.pid"


@dataclasses.dataclass(frozen=True)
class Generation:
  """A TPU generation as gcloud names it: its software image and how its slice names count hosts."""

  runtime: str  # the TPU VM image (cloud.google.com/tpu/docs/runtimes), Ubuntu 22.04
  per_host: int  # the name's count (TensorCores for v2-v4/v5p, chips for v5e/v6e) per host
  single_host: int  # the largest count on one host
  compile_check: bool  # scripts/compile_tpu.py models it


GENERATIONS = {
    "v2": Generation("tpu-ubuntu2204-base", 8, 8, False),
    "v3": Generation("tpu-ubuntu2204-base", 8, 8, False),
    "v4": Generation("tpu-ubuntu2204-base", 8, 8, True),
    "v5litepod": Generation("v2-alpha-tpuv5-lite", 4, 8, True),
    "v5p": Generation("v2-alpha-tpuv5", 8, 8, True),
    "v6e": Generation("v2-alpha-tpuv6e", 4, 8, True),
}
ALIASES = {"v5e": "v5litepod"}  # the name people say -> the accelerator-type prefix gcloud expects
RUNTIMES = {name: g.runtime for name, g in GENERATIONS.items()}
PREEMPTED = ("SUSPENDING", "SUSPENDED", "FAILED", "GONE")
NOT_FOUND = ("NOT_FOUND", "not found", "matched no objects")  # gcloud's answer "there is none"


class LauncherError(RuntimeError):
  """A gcloud/ssh command that kept failing, or a slice that could not be kept: run stops (exit 1)."""


class TrainingFailed(RuntimeError):
  """Training ended without finishing: failed, stalled or gone. `lines` are the details to print."""

  def __init__(self, message: str, lines: Sequence[str] = ()):
    super().__init__(message)
    self.lines = list(lines)


def accelerator_type(name: str) -> str:
  """`v5e-16` -> `v5litepod-16`; checks the `<generation>-<cores or chips>` form."""
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
  if not m:
    raise cli.UsageError(f"--accelerator must look like v4-8 or v5e-16, got {name!r}")
  gen = ALIASES.get(m.group(1), m.group(1))
  if gen not in GENERATIONS:
    known = sorted(GENERATIONS) + sorted(ALIASES)
    raise cli.UsageError(f"--accelerator generation {m.group(1)!r} is not one of {known}")
  return f"{gen}-{m.group(2)}"


def generation(name: str) -> Generation:
  return GENERATIONS[accelerator_type(name).rsplit("-", 1)[0]]


def hosts(name: str) -> int:
  """TPU VM hosts (workers) of a slice: v4-8 and v5e-8 are one host, v4-16 two, v5e-16 four."""
  count, g = int(accelerator_type(name).rsplit("-", 1)[1]), generation(name)
  return 1 if count <= g.single_host else math.ceil(count / g.per_host)


def runtime_version(args: argparse.Namespace) -> str:
  return args.runtime or generation(args.accelerator).runtime


def pinned(package: str, requirements: str = os.path.join(ROOT, "requirements.txt")) -> str:
  """The version requirements.txt pins for `package` (jax: the `jax[tpu]` install must match it)."""
  with open(requirements) as f:
    for line in f:
      name, _, version = line.split("#")[0].strip().partition("==")
      if name.strip().lower() == package and version:
        return version.strip()
  raise ValueError(f"{requirements} does not pin {package}")


def is_gcs(path: str | None) -> bool:
  return bool(path) and path.startswith("gs://")


# ----------------------------------------------------------------------------------------------------------
# Commands (argument lists)


def _where(args: argparse.Namespace) -> list[str]:
  return ["--zone", args.zone] + (["--project", args.project] if args.project else [])


def create_cmd(args: argparse.Namespace) -> list[str]:
  cmd = ["gcloud", "compute", "tpus", "queued-resources", "create", args.name, "--node-id", args.name,
         *_where(args), "--accelerator-type", accelerator_type(args.accelerator),
         "--runtime-version", runtime_version(args)]
  if args.spot:
    cmd.append("--spot")
  elif args.best_effort:
    cmd.append("--best-effort")
  elif args.reserved:
    cmd.append("--reserved")
  return cmd  # none of them: on-demand


def describe_cmd(args: argparse.Namespace) -> list[str]:
  return ["gcloud", "compute", "tpus", "queued-resources", "describe", args.name, *_where(args),
          "--format=value(state.state)"]


def delete_cmd(args: argparse.Namespace) -> list[str]:
  # --force also deletes the TPU VM the queued resource created.
  return ["gcloud", "compute", "tpus", "queued-resources", "delete", args.name, *_where(args), "--force",
          "--quiet"]


def ssh_cmd(args: argparse.Namespace, command: str, worker: str = "all") -> list[str]:
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *_where(args), f"--worker={worker}",
          "--command", command]


def scp_cmd(args: argparse.Namespace, local: str, remote: str) -> list[str]:
  return ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"{args.name}:{remote}", *_where(args),
          "--worker=all"]


def setup_cmds(args: argparse.Namespace) -> list[list[str]]:
  """A venv with the runtime requirements and `jax[tpu]` at the pinned jax version (jax's documented TPU
  install, which brings the libtpu it needs), on every worker."""
  py = shlex.quote(args.python)
  jax_tpu = shlex.quote(f"jax[tpu]=={pinned('jax')}")
  remote = " && ".join([
      f"(command -v {py} >/dev/null"
      f" || (sudo apt-get update -qq && sudo apt-get install -y -qq {py} {py}-venv))",
      f"{py} -m venv {REMOTE_VENV}",
      f"{REMOTE_VENV}/bin/pip install -q --upgrade pip",
      f"cd {REMOTE_DIR} && {REMOTE_VENV}/bin/pip install -q -r requirements.txt -r requirements-tpu.txt "
      f"{jax_tpu}",
  ])
  return [ssh_cmd(args, remote)]


def git(*argv: str) -> str:
  out = subprocess.run(["git", "-C", ROOT, *argv], capture_output=True, text=True)
  if out.returncode:
    raise LauncherError(f"git {' '.join(argv)}: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
  return out.stdout


def shipped_commit(args: argparse.Namespace) -> str:
  """The commit `copy` ships; refuses uncommitted changes to HEAD (they would not be shipped)."""
  ref = args.ref or "HEAD"
  sha = git("rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}").strip()
  if args.ref is None and not args.allow_dirty:
    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line.strip()]
    if changed:
      raise LauncherError(f"the git tree has uncommitted changes ({len(changed)} paths, e.g. {changed[0]}) "
                          f"that the slice would not get: commit them, or pass --allow_dirty to ship "
                          f"HEAD ({sha[:12]}) without them")
  return sha


def _temporary_file(suffix: str) -> str:
  """A new file of this process under the system's temporary directory, removed when the launcher exits."""
  fd, path = tempfile.mkstemp(prefix="scripts-tpu-", suffix=suffix)
  os.close(fd)
  atexit.register(lambda: os.path.exists(path) and os.remove(path))
  return path


def copy_cmds(args: argparse.Namespace, commit: str | None = None) -> list[list[str]]:
  """The code on every worker: the local git HEAD (or --ref) as a tarball with its commit in COMMIT, or a
  clone of `--repo_url` at `--ref`."""
  if args.repo_url:
    ref = f" && git -C {REMOTE_DIR} checkout -q {shlex.quote(args.ref)}" if args.ref else ""
    clone = f"rm -rf {REMOTE_DIR} && git clone -q {shlex.quote(args.repo_url)} {REMOTE_DIR}"
    return [ssh_cmd(args, clone + ref)]
  commit = commit or args.ref or "HEAD"
  tarball = _temporary_file("-code.tar.gz")
  return [["git", "-C", ROOT, "archive", "--format=tar.gz", "-o", tarball, "--end-of-options", commit],
          scp_cmd(args, tarball, "~/code.tar.gz"),
          ssh_cmd(args, f"rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR}"
                        f" && tar xzf ~/code.tar.gz -C {REMOTE_DIR}"
                        f" && echo {shlex.quote(commit)} > {REMOTE_DIR}/COMMIT")]


# A shell test: the process whose pid ~/train.pid holds is alive (a zombie is not).
_ALIVE = (f'pid=$(cat {REMOTE_PID} 2>/dev/null); s=""; '
          f'if [ -n "$pid" ]; then s=$(sed "s/.*) //" /proc/"$pid"/stat 2>/dev/null | cut -c1); fi; '
          f'case "$s" in ""|Z|X) alive=no;; *) alive=yes;; esac')


def train_cmds(args: argparse.Namespace) -> list[list[str]]:
  """train.py --multihost on every worker, detached (nohup, setsid), output appended to ~/train.log, pid in
  ~/train.pid; nothing is started where it already runs (an ssh retried after a dropped connection)."""
  if not args.config or not args.workdir:
    raise cli.UsageError("train needs --config and --workdir (a gs:// path: every worker must see the same "
                         "one)")
  argv = ["train.py", "--multihost", "--config", args.config, "--workdir", args.workdir, "--noprogress",
          *args.train_args]
  run = f"{REMOTE_VENV}/bin/python " + " ".join(shlex.quote(a) for a in argv)
  clear = ""
  if not is_gcs(args.workdir):  # on the worker's disk: the final records of an earlier attempt go here
    clear = "rm -f " + " ".join(shlex.quote(_record(args, n)) for n in run_status.FINAL) + " && "
  start = (f"{clear}TRAINING_LOG={REMOTE_LOG} setsid nohup {run} >> {REMOTE_LOG} 2>&1 < /dev/null & "
           f"echo $! > {REMOTE_PID}")
  return [ssh_cmd(args, f"cd {REMOTE_DIR} || exit 1; {_ALIVE}; if [ $alive = yes ]; then "
                        f"echo \"train.py already runs (pid $pid)\"; else {start}; fi")]


# One chip of worker 0 for a process of its own: the slice's other hosts run nothing yet, so the check must
# not wait for them (the TPU runtime's variables for independent processes on one host).
ONE_CHIP = "TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_BOUNDS=1,1,1 TPU_VISIBLE_DEVICES=0"


def kernel_check_cmd(args: argparse.Namespace) -> list[str]:
  return ssh_cmd(args, f"cd {REMOTE_DIR} && {ONE_CHIP} {REMOTE_VENV}/bin/python -m scripts.check_kernels",
                 worker="0")


def compile_check_cmd(args: argparse.Namespace) -> list[str]:
  """scripts/compile_tpu.py for --config on --accelerator, with the train flags after `--` it understands."""
  config, colon, arg = args.config.partition(":")
  if not os.path.isabs(config) and not os.path.exists(config):
    config = os.path.join(ROOT, config)  # train.py reads it relative to the repository root
  forwarded, rest = [], list(args.train_args)
  while rest:
    a = rest.pop(0)
    name = a.split("=", 1)[0]
    if name.startswith("--config.") or name in ("--gin_file", "--gin_bindings"):
      forwarded.append(a)
      if "=" not in a and rest and not rest[0].startswith("--"):
        forwarded.append(rest.pop(0))
  return [sys.executable, os.path.join(ROOT, "scripts", "compile_tpu.py"), "--config", config + colon + arg,
          "--topology", args.accelerator, *forwarded]


def logs_cmd(args: argparse.Namespace) -> list[str]:
  return ssh_cmd(args, f"tail -n +1 -F {REMOTE_LOG}", worker="0")


def tail_cmd(args: argparse.Namespace, lines: int = run_status.LOG_TAIL_LINES) -> list[str]:
  return ssh_cmd(args, f"tail -n {lines} {REMOTE_LOG}", worker="0")


def _record(args: argparse.Namespace, name: str) -> str:
  return run_status.record_path(args.workdir, name)


def probe_cmd(args: argparse.Namespace) -> list[str]:
  """Worker 0: whether train.py runs (`== alive yes|no`), for a workdir on its disk the records (`== record
  <name>`, then the JSON), then `== end` (its absence means the command did not run through)."""
  parts = [_ALIVE, 'echo "== alive $alive"']
  if args.workdir and not is_gcs(args.workdir):
    parts.append(f"cd {REMOTE_DIR} && for n in {' '.join(run_status.RECORDS)}; do "
                 f"f={shlex.quote(args.workdir.rstrip('/') + '/' + run_status.DIR)}/$n.json; "
                 'if [ -f "$f" ]; then echo "== record $n"; cat "$f"; echo; fi; done')
  parts.append("echo '== end'")
  return ssh_cmd(args, "; ".join(parts), worker="0")


# ----------------------------------------------------------------------------------------------------------
# Running them


@dataclasses.dataclass
class Result:
  code: int
  out: str = ""
  err: str = ""

  def last_error(self) -> str:
    lines = [line for line in self.err.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {self.code}"


class Runner:
  """Runs argument lists (never through a shell), or only prints them with --dry_run. `quiet` commands (the
  watch's queries) are not echoed."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run

  def __call__(self, cmd: Sequence[str], *, capture: bool = True, quiet: bool = False,
               timeout: float | None = None) -> Result:
    if self.dry_run or not quiet:
      print(("" if self.dry_run else "+ ") + shlex.join(cmd), flush=True)
    if self.dry_run:
      return Result(0)
    try:
      out = subprocess.run(list(cmd), check=False, text=True, timeout=timeout,
                           stdout=subprocess.PIPE if capture else None,
                           stderr=subprocess.PIPE if capture else None)
    except subprocess.TimeoutExpired:
      return Result(124, "", f"timed out after {timeout:g}s")
    except OSError as e:  # gcloud not installed
      raise LauncherError(f"{cmd[0]}: {e.strerror}") from e
    result = Result(out.returncode, out.stdout or "", out.stderr or "")
    if capture and not quiet:
      sys.stdout.write(result.out)
      sys.stderr.write(result.err)
      sys.stdout.flush()
    return result

  def note(self, text: str) -> None:
    print(f"# {text}", flush=True)


def call(args: argparse.Namespace, run: Runner, cmd: Sequence[str], *, answers: Sequence[str] = (),
         quiet: bool = False, timeout: float | None = None,
         is_answer: Callable[[Result], bool] | None = None) -> Result:
  """Runs `cmd`; a failure (ssh's own 255, a gcloud error, a timeout, a remote command that failed) is
  retried `--retries` times with doubling waits, unless its stderr holds one of `answers` (e.g. NOT_FOUND:
  a real answer, returned) or `is_answer(result)` says it is one (e.g. a remote program's own exit status).
  A failure that persists raises LauncherError; a failure is never returned as an answer."""
  wait = args.backoff_s
  for attempt in range(args.retries + 1):
    r = run(cmd, quiet=quiet, timeout=timeout)
    if r.code == 0 or any(a in r.err for a in answers) or (is_answer is not None and is_answer(r)):
      return r
    what = " ".join(cmd[1:5]) if cmd[0] == "gcloud" else cmd[0]
    if attempt == args.retries:
      raise LauncherError(f"{what} failed {attempt + 1} times (last: exit {r.code}, {r.last_error()})")
    print(f"{what}: exit {r.code} ({r.last_error()}); retry {attempt + 1}/{args.retries} in {wait:g}s",
          flush=True)
    time.sleep(wait)
    wait *= 2
  raise AssertionError("unreachable")


def queued_state(args: argparse.Namespace, run: Runner) -> str:
  """ACTIVE, PROVISIONING, SUSPENDED, ... or GONE (gcloud's NOT_FOUND)."""
  r = call(args, run, describe_cmd(args), answers=NOT_FOUND, quiet=True, timeout=args.query_timeout_s)
  lines = r.out.strip().splitlines()
  return lines[-1].strip() if r.code == 0 and lines else "GONE"


def delete_slice(args: argparse.Namespace, run: Runner) -> None:
  call(args, run, delete_cmd(args), answers=NOT_FOUND)


def wait_active(args: argparse.Namespace, run: Runner) -> bool:
  """Polls the queued resource until ACTIVE (True) or SUSPENDED/FAILED/gone (False)."""
  if run.dry_run:
    run(describe_cmd(args))
    run.note(f"... repeated every {args.poll_s:g}s until the state is ACTIVE")
    return True
  last = None
  while True:
    state = queued_state(args, run)
    if state != last:
      print(f"queued resource {args.name}: {state}", flush=True)
      last = state
    if state == "ACTIVE":
      return True
    if state in PREEMPTED:
      return False
    time.sleep(args.poll_s)


def create(args: argparse.Namespace, run: Runner) -> bool:
  r = call(args, run, create_cmd(args), answers=("ALREADY_EXISTS", "already exists"))
  if r.code:
    print(f"queued resource {args.name} already exists: using it", flush=True)
  return wait_active(args, run)


def clear_final_records(args: argparse.Namespace, run: Runner) -> None:
  """A gs:// workdir's final records of an earlier attempt go before train.py starts again (so the watch
  never reads an old `finished`); train.py removes them too, and train_cmds does on a worker's disk."""
  if not is_gcs(args.workdir):
    return
  present = gcs_records(args, run)
  for name in run_status.FINAL:
    if name in present:
      call(args, run, ["gcloud", "storage", "rm", _record(args, name)], answers=NOT_FOUND)


def perform(args: argparse.Namespace, run: Runner, cmds: Sequence[Sequence[str]]) -> None:
  """Each command in turn: a gcloud one retried (copy, setup and train can run twice), a local one (git
  archive) once."""
  for cmd in cmds:
    if cmd[0] == "gcloud":
      call(args, run, cmd)
    elif (r := run(cmd)).code:
      raise LauncherError(f"{shlex.join(cmd)} failed: {r.last_error()}")


def start(args: argparse.Namespace, run: Runner, commit: str | None) -> bool:
  """create -> ACTIVE -> copy -> setup -> train; False when the slice was lost before it became ACTIVE."""
  if not create(args, run):
    return False
  perform(args, run, copy_cmds(args, commit) + setup_cmds(args))
  kernel_check(args, run)
  start_training(args, run)
  return True


def kernel_check(args: argparse.Namespace, run: Runner) -> None:
  """scripts/check_kernels.py on one chip of worker 0, the first time a slice is up in this launch. Its
  failure is a warning (train.py decides for its own kernel); ssh's own failure (255) is retried."""
  if args.skip_kernel_check or getattr(args, "kernels_checked", False):
    return
  args.kernels_checked = True
  cmd = kernel_check_cmd(args)
  if run.dry_run:
    run(cmd)
    return
  # Any exit but ssh's own 255 is the check's answer (a failed check is a warning, not retried).
  r = call(args, run, cmd, timeout=args.kernel_check_timeout_s, is_answer=lambda r: r.code != 255)
  if r.code:
    print(f"WARNING: the fused kernels failed their check on {args.accelerator} (scripts/check_kernels.py, "
          f"exit {r.code}: {r.last_error() if r.code == 124 else 'its lines above'}); training starts: "
          "train.py checks the kernel its model uses and, under implementation=auto, trains on the XLA path "
          "when it fails", flush=True)


def start_training(args: argparse.Namespace, run: Runner) -> None:
  clear_final_records(args, run)
  perform(args, run, train_cmds(args))


# ----------------------------------------------------------------------------------------------------------
# Reading the run's state


def read_records(args: argparse.Namespace, run: Runner, names: Sequence[str] = run_status.RECORDS
                 ) -> dict[str, dict[str, Any]]:
  """The workdir's status records (training/status.py) by name; {} when there are none yet."""
  if not args.workdir:
    return {}
  if not is_gcs(args.workdir):
    return {k: v for k, v in probe(args, run)[1].items() if k in names}
  present, records = gcs_records(args, run), {}
  for name in names:
    if name in present:
      r = call(args, run, ["gcloud", "storage", "cat", _record(args, name)], answers=NOT_FOUND, quiet=True,
               timeout=args.query_timeout_s)
      if r.code == 0:
        records[name] = _parse(name, r.out)
  return records


def gcs_records(args: argparse.Namespace, run: Runner) -> set[str]:
  """The names of the records a gs:// workdir holds (`gcloud storage ls`)."""
  listing = call(args, run, ["gcloud", "storage", "ls", args.workdir.rstrip("/") + f"/{run_status.DIR}/"],
                 answers=NOT_FOUND, quiet=True, timeout=args.query_timeout_s)
  lines = listing.out.splitlines() if listing.code == 0 else []  # else NOT_FOUND: none yet
  files = {line.strip().rsplit("/", 1)[-1] for line in lines}
  return {name for name in run_status.RECORDS if f"{name}.json" in files}


def _parse(name: str, text: str) -> dict[str, Any]:
  try:
    value = json.loads(text)
  except ValueError:
    value = None
  if not isinstance(value, dict):  # records are replaced whole: this is not one of them
    raise LauncherError(f"{name}.json in the workdir's status/ is not a status record: {text[:80]!r}")
  return value


def probe(args: argparse.Namespace, run: Runner) -> tuple[bool, dict[str, dict[str, Any]]]:
  """(train.py runs on worker 0, the records on worker 0's disk for a local workdir)."""
  for attempt in range(2):  # an ssh whose output was cut off is retried once more, like a failure
    r = call(args, run, probe_cmd(args), quiet=True, timeout=args.query_timeout_s)
    sections: dict[str, list[str]] = {}
    key = None
    for line in r.out.splitlines():
      if line.startswith("== "):
        key = line[3:].strip()
        sections[key] = []
      elif key is not None:
        sections[key].append(line)
    if "end" in sections and ("alive yes" in sections or "alive no" in sections):
      records = {k.split(" ", 1)[1]: _parse(k, "\n".join(v)) for k, v in sections.items()
                 if k.startswith("record ")}
      return "alive yes" in sections, records
    if attempt:
      raise LauncherError(f"worker 0 answered without the expected lines: {r.out[-200:]!r}")
  raise AssertionError("unreachable")


def log_tail(args: argparse.Namespace, run: Runner) -> list[str]:
  """Worker 0's last log lines, or a line saying why there are none (best effort)."""
  try:
    return call(args, run, tail_cmd(args), quiet=True, timeout=args.query_timeout_s).out.splitlines()
  except LauncherError as e:
    return [f"(worker 0's log is not readable: {e})"]


def _metrics(record: dict[str, Any]) -> str:
  m = record.get("metrics") or {}
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _failure(record: dict[str, Any]) -> TrainingFailed:
  lines = []
  if record.get("traceback"):
    lines += ["traceback (last lines):", *record["traceback"]]
  if record.get("log_tail"):
    lines += ["log (last lines):", *record["log_tail"]]
  return TrainingFailed(f"training failed at step {record.get('step')}: {record.get('error')}", lines)


# ----------------------------------------------------------------------------------------------------------
# The watch


class Restarts:
  """Counts preemptions (recreated slices and restarted train.py) against --max_restarts."""

  def __init__(self, limit: int):
    self.limit, self.count = limit, 0

  def next(self, why: str) -> None:
    self.count += 1
    if self.count > self.limit:
      raise LauncherError(f"preempted {self.count} times (--max_restarts={self.limit}); giving up ({why})")
    print(f"{why}: restart {self.count}", flush=True)


def watch(args: argparse.Namespace, run: Runner, restarts: Restarts) -> dict[str, Any] | None:
  """Until training ends on this slice: the `finished` record, None when the slice was preempted (to be
  recreated); raises TrainingFailed when training failed, stalled or vanished."""
  if run.dry_run:
    run.note(f"every {args.poll_s:g}s: the queued resource's state, whether train.py runs on worker 0, and "
             f"the run's records in {args.workdir}/{run_status.DIR}/")
    run(describe_cmd(args))
    run(probe_cmd(args))
    if is_gcs(args.workdir):
      run(["gcloud", "storage", "ls", f"{args.workdir.rstrip('/')}/{run_status.DIR}/"])
      run(["gcloud", "storage", "cat", _record(args, "heartbeat")])
    run.note("after a preemption (SUSPENDED/FAILED or the queued resource is gone): delete and start again")
    run(delete_cmd(args))
    start(args, run, getattr(args, "commit", None))
    return {"step": None, "metrics": {}}
  seen, changed_at, stopped_at, last_step = None, time.monotonic(), None, None
  while True:
    time.sleep(args.poll_s)
    now = time.monotonic()
    state = queued_state(args, run)
    if state in PREEMPTED:
      print(f"queued resource {args.name}: {state}", flush=True)
      return None
    if state != "ACTIVE":  # provisioning, repairing: nothing runs, nothing stalls
      changed_at, stopped_at = now, None
      continue
    try:
      alive, records = probe(args, run)  # first: a run that ends after this has written its final record
      if is_gcs(args.workdir):
        records = read_records(args, run)
    except LauncherError:
      if queued_state(args, run) != "ACTIVE":
        return None  # the slice went away under the ssh
      raise
    if "finished" in records:
      return records["finished"]
    if "failed" in records:
      raise _failure(records["failed"])
    fingerprint = json.dumps([records.get(n) for n in ("started", "heartbeat", "preempted")], sort_keys=True)
    if fingerprint != seen:
      seen, changed_at = fingerprint, now
      step = (records.get("heartbeat") or records.get("started") or {}).get("step")
      if step is not None and step != last_step:
        print(f"training: step {step}", flush=True)
        last_step = step
    if alive:
      stopped_at = None
    else:
      stopped_at = now if stopped_at is None else stopped_at
      if now - stopped_at >= args.grace_s:
        if "preempted" in records:  # SIGTERM on a slice that stayed ACTIVE: start train.py on it again
          restarts.next(f"train.py stopped ({records['preempted'].get('reason')}) at step "
                        f"{records['preempted'].get('step')} on an ACTIVE slice")
          start_training(args, run)
          seen, changed_at, stopped_at = None, time.monotonic(), None
          continue
        raise TrainingFailed(f"train.py is no longer running on worker 0 and wrote no final record (last "
                             f"step seen: {last_step})", ["log (last lines):", *log_tail(args, run)])
    if now - changed_at >= args.stall_s:
      raise TrainingFailed(f"training stalled: no new status record for {args.stall_s:g}s (last step seen: "
                           f"{last_step})", ["log (last lines):", *log_tail(args, run)])


def run_until_done(args: argparse.Namespace, run: Runner, commit: str | None) -> dict[str, Any]:
  """create/copy/setup/train and watch; after a preemption delete, recreate and go on (train.py resumes)."""
  restarts = Restarts(args.max_restarts)
  while True:
    try:
      if start(args, run, commit):
        done = watch(args, run, restarts)
        if done is not None:
          return done
    except LauncherError:
      if run.dry_run or queued_state(args, run) not in PREEMPTED:
        raise
      print(f"queued resource {args.name} went away under the launcher", flush=True)
    restarts.next(f"queued resource {args.name} lost: deleting and creating it again")
    delete_slice(args, run)


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
      print(f"training finished at step {done.get('step')}: {_metrics(done)}", flush=True)
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
      extra = {"finished": _metrics(r), "failed": r.get("error"), "preempted": r.get("reason"),
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
  p.add_argument("--max_restarts", type=int, default=20, help="give up after this many preemptions")
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
