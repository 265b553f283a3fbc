r"""Cloud TPU launcher: a TPU VM slice through queued resources, this code and its pinned requirements on
every worker, `train.py --multihost` on all workers with a `gs://` workdir, and recovery from preemption.

    python -m scripts.tpu run --name c4-combiner --zone us-central2-b --accelerator v4-8 --spot \
        --config configs/c4.py --workdir gs://my-bucket/c4-combiner          # everything, until training ends
    python -m scripts.tpu logs --name c4-combiner --zone us-central2-b      # follow worker 0's log
    python -m scripts.tpu delete --name c4-combiner --zone us-central2-b

Subcommands: create (a queued resource: on-demand, `--spot` or `--best_effort`), setup (Python venv, the
pinned requirements.txt + requirements-tpu.txt and `jax[tpu]` at the pinned jax version, on `--worker=all`),
copy (a tarball of the git HEAD by scp, or `--repo_url` cloned on the workers), train (nohup train.py on every
worker, log in ~/train.log), logs, status, run (all of these, then watch: when the queued resource is
SUSPENDED/FAILED or gone, it is deleted and recreated and training resumes from the workdir's checkpoint),
delete. `--dry_run` prints every command instead of running it. Commands are argument lists; the remote shell
command quotes every user-given value with shlex.quote.

Before create and run make a slice, the config's whole train step is compiled here for the accelerator type
(`scripts/compile_tpu.py`, with the `--config.*` and gin flags given after `--`): a config that does not fit
the slice's HBM or does not compile creates nothing. `--skip_compile_check` skips it; `--dry_run` only
prints it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_DIR = "~/combiner"  # code on every worker
REMOTE_VENV = "~/venv"
REMOTE_LOG = "~/train.log"
# Software images per TPU generation (cloud.google.com/tpu/docs/runtimes), all Ubuntu 22.04.
RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
            "v6e": "v2-alpha-tpuv6e"}
ALIASES = {"v5e": "v5litepod"}  # the name people say -> the accelerator-type prefix gcloud expects
PREEMPTED = ("SUSPENDING", "SUSPENDED", "FAILED")
LIBTPU_INDEX = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"


def accelerator_type(name: str) -> str:
  """`v5e-16` -> `v5litepod-16`; checks the `<generation>-<cores or chips>` form."""
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
  if not m:
    raise ValueError(f"--accelerator must look like v4-8 or v5e-16, got {name!r}")
  gen = ALIASES.get(m.group(1), m.group(1))
  if gen not in RUNTIMES:
    known = sorted(RUNTIMES) + sorted(ALIASES)
    raise ValueError(f"--accelerator generation {m.group(1)!r} is not one of {known}")
  return f"{gen}-{m.group(2)}"


def runtime_version(args: argparse.Namespace) -> str:
  return args.runtime or RUNTIMES[accelerator_type(args.accelerator).split("-")[0]]


def pinned(package: str, requirements: str = os.path.join(ROOT, "requirements.txt")) -> str:
  """The version requirements.txt pins for `package` (jax: the `jax[tpu]` install must match it)."""
  with open(requirements) as f:
    for line in f:
      name, _, version = line.split("#")[0].strip().partition("==")
      if name.strip().lower() == package and version:
        return version.strip()
  raise ValueError(f"{requirements} does not pin {package}")


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
  return cmd  # neither: on-demand


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
  """Python venv + pinned requirements + jax[tpu] at the pinned jax version, on every worker."""
  py = shlex.quote(args.python)
  jax_tpu = shlex.quote(f"jax[tpu]=={pinned('jax')}")
  remote = " && ".join([
      f"(command -v {py} >/dev/null"
      f" || (sudo apt-get update -qq && sudo apt-get install -y -qq {py} {py}-venv))",
      f"{py} -m venv {REMOTE_VENV}",
      f"{REMOTE_VENV}/bin/pip install -q --upgrade pip",
      f"cd {REMOTE_DIR} && {REMOTE_VENV}/bin/pip install -q -r requirements.txt -r requirements-tpu.txt "
      f"{jax_tpu} -f {LIBTPU_INDEX}",
  ])
  return [ssh_cmd(args, remote)]


def copy_cmds(args: argparse.Namespace) -> list[list[str]]:
  """The code on every worker: the local git HEAD as a tarball, or a clone of `--repo_url` at `--ref`."""
  if args.repo_url:
    ref = f" && git -C {REMOTE_DIR} checkout -q {shlex.quote(args.ref)}" if args.ref else ""
    clone = f"rm -rf {REMOTE_DIR} && git clone -q {shlex.quote(args.repo_url)} {REMOTE_DIR}"
    return [ssh_cmd(args, clone + ref)]
  tarball = os.path.join("/tmp", f"{args.name}-code.tar.gz")
  return [["git", "-C", ROOT, "archive", "--format=tar.gz", "-o", tarball, args.ref or "HEAD"],
          scp_cmd(args, tarball, "~/code.tar.gz"),
          ssh_cmd(args, f"rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR}"
                        f" && tar xzf ~/code.tar.gz -C {REMOTE_DIR}")]


def train_cmds(args: argparse.Namespace) -> list[list[str]]:
  """train.py --multihost on every worker, detached (nohup, setsid), output in ~/train.log."""
  if not args.config or not args.workdir:
    raise ValueError("train needs --config and --workdir (a gs:// path: every worker must see the same one)")
  argv = ["train.py", "--multihost", "--config", args.config, "--workdir", args.workdir, "--noprogress",
          *args.train_args]
  run = f"{REMOTE_VENV}/bin/python " + " ".join(shlex.quote(a) for a in argv)
  return [ssh_cmd(args, f"cd {REMOTE_DIR} && setsid nohup {run} > {REMOTE_LOG} 2>&1 < /dev/null &")]


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


def compile_check(args: argparse.Namespace, run: Runner) -> None:
  """Refuses (SystemExit) to go on when the config's train step does not fit or compile on the slice."""
  if args.skip_compile_check:
    return
  if not args.config:
    run.note("no --config: the compile check is skipped")
    return
  cmd = compile_check_cmd(args)
  if run.dry_run:
    run.note("compile check, not run by --dry_run: " + shlex.join(cmd))
    return
  code, _ = run(cmd, check=False)
  if code:
    raise SystemExit(f"the compile check of {args.config} on {args.accelerator} failed (exit {code}): "
                     f"not creating {args.name}; --skip_compile_check creates it anyway")


def logs_cmd(args: argparse.Namespace) -> list[str]:
  return ssh_cmd(args, f"tail -n +1 -F {REMOTE_LOG}", worker="0")


def running_cmd(args: argparse.Namespace) -> list[str]:
  """Exit status 0 while train.py runs on worker 0."""
  return ssh_cmd(args, "pgrep -f 'python train.py' >/dev/null", worker="0")


def done_cmd(args: argparse.Namespace) -> list[str]:
  """Exit status 0 once the run wrote its final metrics (train.py does so after the last step)."""
  return ["gcloud", "storage", "ls", args.workdir.rstrip("/") + "/metrics.json"]


# ----------------------------------------------------------------------------------------------------------
# Running them


class Runner:
  """Runs argument lists (never through a shell), or only prints them with --dry_run."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run

  def __call__(self, cmd: Sequence[str], *, check: bool = True, capture: bool = False) -> tuple[int, str]:
    print(("" if self.dry_run else "+ ") + shlex.join(cmd), flush=True)
    if self.dry_run:
      return 0, ""
    out = subprocess.run(list(cmd), check=False, text=True, stdout=subprocess.PIPE if capture else None)
    if check and out.returncode:
      raise SystemExit(f"command failed ({out.returncode}): {shlex.join(cmd)}")
    return out.returncode, (out.stdout or "").strip()

  def note(self, text: str) -> None:
    print(f"# {text}", flush=True)


def wait_active(args: argparse.Namespace, run: Runner) -> bool:
  """Polls the queued resource until ACTIVE (True) or SUSPENDED/FAILED/gone (False)."""
  if run.dry_run:
    run(describe_cmd(args), capture=True)
    run.note(f"... repeated every {args.poll_s}s until the state is ACTIVE")
    return True
  while True:
    code, state = run(describe_cmd(args), check=False, capture=True)
    if code == 0 and state == "ACTIVE":
      return True
    if code or state in PREEMPTED:
      print(f"queued resource {args.name}: {state or 'gone'}", flush=True)
      return False
    time.sleep(args.poll_s)


def start(args: argparse.Namespace, run: Runner) -> bool:
  """create -> ACTIVE -> copy -> setup -> train; False when the slice was lost before it became ACTIVE."""
  run(create_cmd(args))
  if not wait_active(args, run):
    return False
  for cmd in copy_cmds(args) + setup_cmds(args) + train_cmds(args):
    run(cmd)
  return True


def watch(args: argparse.Namespace, run: Runner) -> None:
  """Until train.py finished: on preemption delete, recreate and restart (train.py resumes from workdir)."""
  if run.dry_run:
    run.note(f"every {args.poll_s}s: the queued resource's state, then whether train.py still runs, then "
             "whether it finished")
    run(describe_cmd(args), check=False, capture=True)
    run(running_cmd(args), check=False)
    run(done_cmd(args), check=False)
    run.note("after a preemption (SUSPENDED/FAILED or the queued resource is gone): delete and start again")
    run(delete_cmd(args), check=False)
    start(args, run)
    return
  restarts, started = 0, True
  while True:
    time.sleep(args.poll_s)
    code, state = run(describe_cmd(args), check=False, capture=True)
    if started and code == 0 and state == "ACTIVE":
      if run(running_cmd(args), check=False)[0] == 0:
        continue
      if run(done_cmd(args), check=False, capture=True)[0] == 0:
        print(f"training finished: {args.workdir}/metrics.json", flush=True)
        return
      raise SystemExit(f"train.py stopped on worker 0 without writing metrics.json; see "
                       f"`python -m scripts.tpu logs --name {args.name} --zone {args.zone}`")
    if started and code == 0 and state not in PREEMPTED:
      continue  # still provisioning / repairing
    restarts += 1
    if restarts > args.max_restarts:
      raise SystemExit(f"preempted {restarts} times (--max_restarts={args.max_restarts}); giving up")
    print(f"queued resource {args.name}: {state or 'gone'}; recreating (restart {restarts})", flush=True)
    run(delete_cmd(args), check=False)
    started = start(args, run)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    return dispatch(args, Runner(args.dry_run))
  except ValueError as e:  # bad flag values: the message names the flag
    raise SystemExit(f"error: {e}") from e


def dispatch(args: argparse.Namespace, run: Runner) -> int:
  if args.accelerator:
    accelerator_type(args.accelerator)
  cmd = args.command
  if cmd in ("create", "run") and not args.accelerator:
    raise SystemExit(f"{cmd} needs --accelerator (e.g. v4-8, v5e-16)")
  if cmd == "create":
    compile_check(args, run)
    run(create_cmd(args))
    if not wait_active(args, run):
      raise SystemExit(f"queued resource {args.name} did not become ACTIVE")
  elif cmd == "setup":
    [run(c) for c in setup_cmds(args)]
  elif cmd == "copy":
    [run(c) for c in copy_cmds(args)]
  elif cmd == "train":
    [run(c) for c in train_cmds(args)]
  elif cmd == "logs":
    run(logs_cmd(args), check=False)
  elif cmd == "status":
    run(describe_cmd(args))
  elif cmd == "delete":
    run(delete_cmd(args))
  elif cmd == "run":
    train_cmds(args)  # checks --config/--workdir before anything is created
    compile_check(args, run)
    if not start(args, run):
      raise SystemExit(f"queued resource {args.name} did not become ACTIVE")
    watch(args, run)
    if args.delete_after:
      run(delete_cmd(args))
  return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m scripts.tpu", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("command", choices=["create", "setup", "copy", "train", "logs", "status", "run", "delete"])
  p.add_argument("--name", required=True, help="queued-resource and TPU VM name")
  p.add_argument("--zone", required=True, help="e.g. us-central2-b (v4), us-west4-a (v5e)")
  p.add_argument("--project", default=None, help="GCP project (default: gcloud's configured one)")
  p.add_argument("--accelerator", default=None, help="v4-8, v4-32, v5e-16 (= v5litepod-16), v5p-8, v6e-8 ...")
  p.add_argument("--runtime", default=None, help=f"TPU software version (default per generation: {RUNTIMES})")
  kind = p.add_mutually_exclusive_group()
  kind.add_argument("--spot", action="store_true", help="spot capacity (cheapest; preemptible at any time)")
  kind.add_argument("--best_effort", action="store_true", help="best-effort queued capacity (preemptible)")
  p.add_argument("--python", default="python3.11", help="the workers' venv interpreter (requirements: 3.11)")
  p.add_argument("--repo_url", default=None, help="git clone this URL on the workers instead of copying HEAD")
  p.add_argument("--ref", default=None, help="git revision to copy or check out (default HEAD / the clone's)")
  p.add_argument("--config", default=None, help="train.py --config value, e.g. configs/c4.py")
  p.add_argument("--workdir", default=None, help="train.py --workdir, a gs:// path shared by all workers")
  p.add_argument("--poll_s", type=int, default=60, help="seconds between state checks")
  p.add_argument("--max_restarts", type=int, default=20, help="give up after this many preemptions")
  p.add_argument("--delete_after", action="store_true", help="run: delete the slice when training finished")
  p.add_argument("--dry_run", action="store_true", help="print every command instead of running it")
  p.add_argument("--skip_compile_check", action="store_true",
                 help="create the slice without first compiling the config's train step for it here")
  p.epilog = "Everything after `--` goes to train.py, e.g. -- --config.seed=1"
  argv = list(sys.argv[1:] if argv is None else argv)
  cut = argv.index("--") if "--" in argv else len(argv)
  args = p.parse_args(argv[:cut])
  args.train_args = argv[cut + 1:]
  return args


if __name__ == "__main__":
  sys.exit(main())
