"""The commands scripts/tpu.py runs, as argument lists: gcloud's queued resources, ssh and scp to the TPU VM
workers, the setup, code copy, training and probe shells (every user-given value quoted with shlex.quote),
and the slice names they use (accelerator types, hosts, runtime images: runtime/tpu_generations.py)."""

from __future__ import annotations

import argparse
import atexit
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile

from runtime import cli, tpu_generations
from training import status as run_status  # no jax: the records' names and paths


class LauncherError(RuntimeError):
  """A gcloud/ssh command that kept failing, or a slice that could not be kept: run stops (exit 1)."""


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_DIR = "~/combiner"  # code on every worker
REMOTE_VENV = "~/venv"
REMOTE_LOG = "~/train.log"
REMOTE_PID = "~/train.pid"



def accelerator_type(name: str) -> str:
  """`v5e-16` -> `v5litepod-16`; checks the `<generation>-<cores or chips>` form."""
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
  if not m:
    raise cli.UsageError(f"--accelerator must look like v4-8 or v5e-16, got {name!r}")
  gen = tpu_generations.find(m.group(1))
  if gen is None:
    raise cli.UsageError(f"--accelerator generation {m.group(1)!r} is not one of {tpu_generations.names()}")
  return f"{gen.gcloud}-{m.group(2)}"


def generation(name: str) -> tpu_generations.Generation:
  return tpu_generations.find(accelerator_type(name).rsplit("-", 1)[0])


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
    clear = "rm -f " + " ".join(shlex.quote(record_path(args, n)) for n in run_status.FINAL) + " && "
  start = (f"{clear}TRAINING_LOG={REMOTE_LOG} setsid nohup {run} >> {REMOTE_LOG} 2>&1 < /dev/null & "
           f"echo $! > {REMOTE_PID}")
  return [ssh_cmd(args, f"cd {REMOTE_DIR} || exit 1; {_ALIVE}; if [ $alive = yes ]; then "
                        f"echo \"train.py already runs (pid $pid)\"; else {start}; fi")]


def stop_cmd(args: argparse.Namespace) -> list[str]:
  """On every worker, train.py (the process group ~/train.pid names: its supervisor and the training) killed
  where it still runs: what is left of a run that lost a host, before it starts again."""
  return ssh_cmd(args, f'{_ALIVE}; if [ $alive = yes ]; then kill -KILL -- -"$pid" 2>/dev/null || '
                       'kill -KILL "$pid"; echo "stopped train.py (pid $pid)"; fi; true')


def write_record_cmd(args: argparse.Namespace, name: str, text: str) -> list[str]:
  """A status record written on worker 0's disk (a workdir there), replaced whole as train.py does."""
  target = record_path(args, name)
  quoted = shlex.quote(target)
  write = f"printf '%s' {shlex.quote(text)} > {quoted}.tmp && mv {quoted}.tmp {quoted}"
  return ssh_cmd(args, f"cd {REMOTE_DIR} && mkdir -p {shlex.quote(os.path.dirname(target))} && {write}",
                 worker="0")


# One chip of worker 0 for a process of its own: the slice's other hosts run nothing yet, so the check must
# not wait for them (the TPU runtime's variables for independent processes on one host).
ONE_CHIP = "TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_BOUNDS=1,1,1 TPU_VISIBLE_DEVICES=0"


def kernel_check_cmd(args: argparse.Namespace) -> list[str]:
  return ssh_cmd(args, f"cd {REMOTE_DIR} && {ONE_CHIP} {REMOTE_VENV}/bin/python -m scripts.check_kernels",
                 worker="0")


def compile_check_cmd(args: argparse.Namespace) -> list[str]:
  """scripts/compile_tpu.py for --config on --accelerator, with the train flags after `--` it understands; it
  checks the fit only (--nocount_layers: no second compile of a scanned model for its roofline)."""
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
          "--nocount_layers", "--topology", args.accelerator, *forwarded]


def logs_cmd(args: argparse.Namespace) -> list[str]:
  return ssh_cmd(args, f"tail -n +1 -F {REMOTE_LOG}", worker="0")


def tail_cmd(args: argparse.Namespace, lines: int = run_status.LOG_TAIL_LINES) -> list[str]:
  return ssh_cmd(args, f"tail -n {lines} {REMOTE_LOG}", worker="0")


def record_path(args: argparse.Namespace, name: str) -> str:
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
