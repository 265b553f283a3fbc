"""scripts/tpu.py end to end: the real launcher (`python -m scripts.tpu run`, a subprocess) against a stand-in
of Google Cloud: a fake `gcloud` first on PATH keeps the queued resource's state in files, runs every
`tpu-vm ssh --command` through a real `bash -c` in one directory per worker (its HOME), copies `tpu-vm scp`
files there, and maps `gs://` to a local directory. The setup it runs finds a stand-in `python3.11` whose venv
`python` is a stand-in for train.py: a small script that writes the run's records with training/status.py
(the real format) and finishes, crashes, stalls or is preempted. Failures of ssh (exit 255) are injected by
call number. Also: the dry-run commands and their quoting, the refusals (a dirty git tree, a local workdir on
a multi-host slice), accelerator names, and the compile check before a slice is made."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from scripts import tpu, tpu_commands

ROOT = tpu.ROOT

FAKE_GCLOUD = r'''#!@PYTHON@ -S
"""A stand-in for the Google Cloud CLI (the calls scripts/tpu.py makes), its world in $FAKE_WORLD."""
import json, os, shutil, subprocess, sys

W = os.environ["FAKE_WORLD"]
NOT_FOUND = "ERROR: (gcloud.compute.tpus.queued-resources.{}) NOT_FOUND: Requested entity was not found."
NO_MATCH = "ERROR: (gcloud.storage.{}) One or more URLs matched no objects."


def p(*parts):
  return os.path.join(W, *parts)


def write(path, text):
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def read(path, default=None):
  try:
    with open(path) as f:
      return f.read().strip()
  except FileNotFoundError:
    return default


def fail(message, code=1):
  sys.stderr.write(message + "\n")
  sys.exit(code)


def flag(argv, name):
  for i, a in enumerate(argv):
    if a.startswith(name + "="):
      return a.split("=", 1)[1]
    if a == name:
      return argv[i + 1]
  return None


def gs(url):
  return p("gs", url[len("gs://"):])


argv = sys.argv[1:]
with open(p("calls.log"), "a") as f:
  f.write(json.dumps(argv) + "\n")
scenario = json.loads(read(p("scenario.json")))
state = read(p("state"))
if argv[:3] == ["compute", "tpus", "queued-resources"]:
  verb = argv[3]
  if verb == "create":
    if state is not None:
      fail("ERROR: (gcloud.compute.tpus.queued-resources.create) ALREADY_EXISTS: it exists")
    write(p("state"), "PROVISIONING")
  elif verb == "describe":
    if state is None:
      fail(NOT_FOUND.format("describe"))
    if state == "PROVISIONING":  # one answer PROVISIONING, then the workers exist and it is ACTIVE
      for w in range(scenario["workers"]):
        os.makedirs(p("workers", str(w)))
      write(p("state"), "ACTIVE")
    print(state)
  elif verb == "delete":
    if state is None:
      fail(NOT_FOUND.format("delete"))
    shutil.rmtree(p("workers"), ignore_errors=True)  # the stand-ins see their HOME go and stop
    os.remove(p("state"))
    if os.path.exists(p("worker1_dead")):  # a new slice has no dead host
      os.remove(p("worker1_dead"))
  else:
    fail("unknown verb " + verb)
elif argv[:3] == ["compute", "tpus", "tpu-vm"]:
  n = int(read(p("ssh_calls"), "0")) + 1
  write(p("ssh_calls"), str(n))
  if n in scenario.get("ssh_fail", []):
    fail("ssh: connect to host 10.130.0.2 port 22: Connection refused", 255)
  if state != "ACTIVE":
    fail("ssh: connect to host 10.130.0.2 port 22: Connection timed out", 255)
  worker = flag(argv, "--worker")
  if scenario.get("unreachable") and os.path.exists(p("worker1_dead")) and worker in ("all", "1"):
    fail("ssh: connect to host 10.130.0.3 port 22: No route to host", 255)  # the dead host is still in it
  homes = sorted(os.listdir(p("workers"))) if worker == "all" else [worker]
  if argv[3] == "scp":
    for w in homes:
      shutil.copy(argv[4], os.path.join(p("workers", w), argv[5].split(":", 1)[1].replace("~/", "")))
    sys.exit(0)
  code = 0
  for w in homes:
    env = dict(os.environ, HOME=p("workers", w), FAKE_WORKER=w,
               PATH=p("bin") + os.pathsep + os.environ["PATH"])
    code = max(code, subprocess.run(["bash", "-c", flag(argv, "--command")], cwd=p("workers", w),
                                    env=env).returncode)
  sys.exit(code)
elif argv[:2] == ["storage", "ls"]:
  path = gs(argv[2])
  if not os.path.exists(path):
    fail(NO_MATCH.format("ls"))
  names = sorted(os.listdir(path)) if os.path.isdir(path) else [""]
  print("\n".join(argv[2].rstrip("/") + ("/" + n if n else "") for n in names))
elif argv[:2] == ["storage", "cat"]:
  if not os.path.isfile(gs(argv[2])):
    fail(NO_MATCH.format("cat"))
  sys.stdout.write(open(gs(argv[2])).read())
elif argv[:2] == ["storage", "cp"]:
  os.makedirs(os.path.dirname(gs(argv[3])), exist_ok=True)
  shutil.copy(argv[2], gs(argv[3]))
elif argv[:2] == ["storage", "rm"]:
  if not os.path.isfile(gs(argv[2])):
    fail(NO_MATCH.format("rm"))
  os.remove(gs(argv[2]))
else:
  fail("fake gcloud: unknown command " + " ".join(argv))
'''

# `python3.11 -m venv DIR` on a worker: DIR/bin/pip records its arguments (and checks the -r files exist),
# DIR/bin/python is the stand-in for train.py.
FAKE_PYTHON311 = r'''#!/usr/bin/env bash
set -e
[ "$1" = -m ] && [ "$2" = venv ] || exit 2
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'PIP'
#!/usr/bin/env bash
echo "$@" >> "$HOME/pip.log"
while [ $# -gt 0 ]; do if [ "$1" = -r ]; then [ -f "$2" ] || { echo "no $2" >&2; exit 1; }; fi; shift; done
PIP
printf '#!/bin/sh\nexec @PYTHON@ @STANDIN@ "$@"\n' > "$3/bin/python"
chmod +x "$3/bin/pip" "$3/bin/python"
'''

# train.py's stand-in: the same records as train.py (training/status.py), a checkpoint file to resume from.
STANDIN = r'''
import json, os, sys, time
sys.path.insert(0, @ROOT@)
from training import status

world, worker, home = os.environ["FAKE_WORLD"], int(os.environ["FAKE_WORKER"]), os.environ["HOME"]
argv = sys.argv[1:]
if argv == ["-m", "scripts.check_kernels"]:  # the kernel check: on one chip of its own, passing or failing
  kernels = json.load(open(os.path.join(world, "scenario.json"))).get("kernels", "pass")
  print(f"device: tpu on worker {worker}, chips {os.environ.get('TPU_VISIBLE_DEVICES')} of process bounds "
        f"{os.environ.get('TPU_PROCESS_BOUNDS')}")
  print("ok   combiner_fixed causal=True max" if kernels == "pass" else "FAIL combiner_fixed causal=True max")
  sys.exit(0 if kernels == "pass" else 1)
assert argv[:2] == ["train.py", "--multihost"] and "--noprogress" in argv, argv
workdir = argv[argv.index("--workdir") + 1]
if workdir.startswith("gs://"):
  workdir = os.path.join(world, "gs", workdir[len("gs://"):])
scenario = json.load(open(os.path.join(world, "scenario.json")))
mode, steps = scenario["mode"], scenario["steps"]


def world_up():  # the VM runs (a preempted or deleted slice stops its processes)
  try:
    return open(os.path.join(world, "state")).read().strip() == "ACTIVE" and os.path.isdir(home)
  except FileNotFoundError:
    return False


ckpt = os.path.join(workdir, "checkpoint")
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
run = status.Status(workdir, enabled=worker == 0, every_s=scenario["heartbeat_s"])
run.started(step=start, num_steps=steps, hosts=scenario["workers"], devices=4 * scenario["workers"])
if worker == 0:
  open(os.path.join(workdir, "config.json"), "w").write("{}")  # this run owns it (the supervisor checks)
print(f"training from step {start} with {argv}", flush=True)
step = start
try:
  for step in range(start + 1, steps + 1):
    time.sleep(0.05)
    if not world_up():
      sys.exit(143)  # killed with the VM: no record
    print(f"step {step}: loss={1 / step:.3f}", flush=True)
    if mode == "crash" and step == 3:
      raise RuntimeError("stand-in crash at step 3")
    if mode == "vanish" and step == 3:  # every attempt: gone without a record (a hard crash)
      os._exit(137)
    if mode == "host_dies" and step == 3 and start == 0:  # worker 1's host dies; worker 0 is stopped by JAX
      if worker == 1:
        open(os.path.join(world, "worker1_dead"), "w").close()
        os._exit(137)
      while not os.path.exists(os.path.join(world, "worker1_dead")):
        time.sleep(0.01)
      from training import supervisor  # what train.py's supervisor does for its aborted child
      jax_says = ["UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):", "1",
                  "The tasks have crashed."]
      sys.exit(supervisor.after_failure(workdir, -6, jax_says, {"process_index": 0, "process_count": 2},
                                        since=run.started_at))
    if mode == "stall" and step == 3:
      deadline = time.time() + 30
      while world_up() and time.time() < deadline:
        time.sleep(0.05)
      sys.exit(143)
    if worker == 0:
      os.makedirs(os.path.join(workdir, "checkpoints", str(step)), exist_ok=True)  # a finished step
      with open(ckpt + ".tmp", "w") as f:
        f.write(str(step))
      os.replace(ckpt + ".tmp", ckpt)
    run.heartbeat(step)
    if mode == "sigterm" and step == 3 and start == 0:  # as train.py on SIGTERM: checkpoint, record, exit 0
      run.preempted(step, "SIGTERM")
      sys.exit(0)
    if mode == "preempt" and step == 3 and start == 0 and worker == 0:
      with open(os.path.join(world, "state.tmp"), "w") as f:
        f.write("SUSPENDED")
      os.replace(os.path.join(world, "state.tmp"), os.path.join(world, "state"))
  run.finished(steps, {"accuracy": 0.75, "loss": 0.5, "split": "validation"})
  print("final eval validation", flush=True)
except Exception as e:
  run.failed(e, step=step)
  raise
'''


class World:
  """The fake cloud of one test: its directory, the launcher's command line, and what happened."""

  def __init__(self, root, **scenario):
    self.root = root
    root.mkdir()
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (root / "gs").mkdir()
    (root / "standin.py").write_text(STANDIN.replace("@ROOT@", repr(ROOT)))
    for name, text in (("gcloud", FAKE_GCLOUD), ("python3.11", FAKE_PYTHON311)):
      text = text.replace("@PYTHON@", sys.executable).replace("@STANDIN@", str(root / "standin.py"))
      (bin_dir / name).write_text(text)
      (bin_dir / name).chmod(0o755)
    self.scenario = {"workers": 2, "steps": 6, "heartbeat_s": 0.05, "mode": "finish", **scenario}
    (root / "scenario.json").write_text(json.dumps(self.scenario))

  def launch(self, *argv, workdir="gs://bucket/run", accelerator="v4-16", timeout=60, kernel_check=False):
    env = dict(os.environ, FAKE_WORLD=str(self.root),
               PATH=f"{self.root / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cmd = [sys.executable, "-m", "scripts.tpu", "run", "--name", "t1", "--zone", "us-central2-b",
           "--accelerator", accelerator, "--spot", "--config", "configs/default.py:smoke",
           "--workdir", workdir, "--skip_compile_check", "--allow_dirty", "--poll_s", "0.1",
           "--stall_s", "5", "--grace_s", "0.3", "--retries", "4", "--backoff_s", "0.02",
           "--query_timeout_s", "20", *([] if kernel_check else ["--skip_kernel_check"]), *argv]
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=timeout)
    self.seconds = time.time() - t
    return proc

  def calls(self):
    return [json.loads(line) for line in (self.root / "calls.log").read_text().splitlines()]

  def verbs(self):
    """The queued-resource verbs and the ssh commands' kinds, in order."""
    out = []
    for c in self.calls():
      if c[:3] == ["compute", "tpus", "queued-resources"] and c[3] != "describe":
        out.append(c[3])
      elif c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "setsid nohup" in c[-1]:
        out.append("train")
      elif c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "scripts.check_kernels" in c[-1]:
        out.append("check_kernels")
      elif c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "kill -KILL" in c[-1]:
        out.append("stop")
    return out

  def record(self, name, workdir="bucket/run"):
    return json.loads((self.root / "gs" / workdir / "status" / f"{name}.json").read_text())

  def gone(self):
    return not (self.root / "state").exists() and not (self.root / "workers").exists()

  def cleanup(self):  # whatever the test did, no stand-in outlives it
    shutil.rmtree(self.root / "workers", ignore_errors=True)
    (self.root / "state").unlink(missing_ok=True)


def worlds(tmp_path):
  """make(**scenario) -> a new World under tmp_path; every one cleaned up when the generator ends."""
  made = []

  def make(**scenario):
    made.append(World(tmp_path / f"world{len(made)}", **scenario))
    return made[-1]

  yield make
  for w in made:
    w.cleanup()


@pytest.fixture
def world(tmp_path):
  yield from worlds(tmp_path)


def test_finished_run_prints_its_metrics_and_deletes_the_slice(world):
  w = world()
  proc = w.launch("--delete_after")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "training finished at step 6: accuracy=0.75 loss=0.5 split=validation" in proc.stdout
  assert w.verbs() == ["create", "train", "delete"] and w.gone()
  done, started = w.record("finished"), w.record("started")
  assert done["state"] == "finished" and done["step"] == 6
  commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
  assert started["commit"] is not None and started["hosts"] == 2
  # Shipped: the git HEAD with its commit, on both workers; the runtime requirements and jax[tpu] installed.
  ssh = [c[-1] for c in w.calls() if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"]]
  assert any(f"echo {commit.strip()} > ~/combiner/COMMIT" in c for c in ssh)
  setup = next(c for c in ssh if "pip install -q -r" in c)
  assert f"-r requirements.txt -r requirements-tpu.txt 'jax[tpu]=={tpu_commands.pinned('jax')}'" in setup
  assert "requirements-dev" not in setup


def test_crash_prints_the_failure_and_the_log_and_deletes_the_slice(world):
  """A single-host slice with its workdir on worker 0's disk: the records are read over ssh."""
  w = world(mode="crash", workers=1)
  proc = w.launch("--delete_after", workdir="runs/crash", accelerator="v4-8")
  assert proc.returncode == 1, proc.stdout + proc.stderr
  err = proc.stderr.strip().splitlines()
  assert err[-1] == "error: training failed at step 3: RuntimeError: stand-in crash at step 3"
  assert "step 2: loss=0.500" in proc.stdout and "stand-in crash at step 3" in proc.stdout  # log, traceback
  assert w.verbs() == ["create", "train", "delete"] and w.gone()


def test_stall_is_a_failure_and_deletes_the_slice(world):
  w = world(mode="stall")
  proc = w.launch("--delete_on_failure", "--stall_s", "2")
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "training stalled: no new status record for 2s (last step seen: 2)" in proc.stderr
  assert "step 3: loss=0.333" in proc.stdout  # worker 0's log, read over ssh
  assert w.verbs() == ["create", "train", "delete"] and w.gone()
  assert w.record("heartbeat")["step"] == 2 and not (w.root / "gs/bucket/run/status/failed.json").exists()


def test_preempted_slice_is_recreated_and_training_resumes(world):
  w = world(mode="preempt")
  proc = w.launch("--delete_after")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "queued resource t1: SUSPENDED" in proc.stdout and "restart 1" in proc.stdout
  assert w.verbs() == ["create", "train", "delete", "create", "train", "delete"] and w.gone()
  assert w.record("started")["step"] == 3 and w.record("finished")["step"] == 6  # resumed, not restarted


def test_sigterm_on_a_slice_that_stays_active_starts_training_again(world):
  w = world(mode="sigterm")
  proc = w.launch("--delete_after")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "train.py stopped (SIGTERM) at step 3 on an ACTIVE slice: restart 1" in proc.stdout
  assert w.verbs() == ["create", "train", "train", "delete"] and w.gone()
  assert w.record("started")["step"] == 3 and w.record("finished")["step"] == 6


def test_ssh_failures_are_retried_never_read_as_an_answer(world):
  """ssh exits 255 on the scp, on the command that starts training and three times in a row in the watch;
  every one is retried, training is started once per worker, and the run finishes."""
  w = world(ssh_fail=[1, 5, 7, 8, 9])
  proc = w.launch("--delete_after")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count("Connection refused") == 5 and "retry 3/4" in proc.stdout
  assert "training finished at step 6" in proc.stdout
  assert w.verbs() == ["create", "train", "train", "delete"] and w.gone()
  assert w.record("started")["step"] == 0


def test_persistent_ssh_failure_stops_the_launcher_and_deletes_the_slice(world):
  w = world(ssh_fail=list(range(6, 200)))
  proc = w.launch("--delete_on_failure", "--retries", "2")
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: compute tpus tpu-vm ssh failed 3 times")
  assert "deleting queued resource t1 (--delete_on_failure)" in proc.stdout
  assert w.verbs()[-1] == "delete" and w.gone()


def test_kernels_are_checked_on_worker_0_before_training(world):
  """A failing check is a warning with its lines, and training starts (train.py decides for its kernel); after
  a preemption the recreated slice is not checked again."""
  w = world(kernels="fail", mode="preempt")
  proc = w.launch("--delete_after", kernel_check=True)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert w.verbs() == ["create", "check_kernels", "train", "delete", "create", "train", "delete"]
  check = next(c for c in w.calls() if "scripts.check_kernels" in c[-1])
  assert "--worker=0" in check
  assert "device: tpu on worker 0, chips 0 of process bounds 1,1,1" in proc.stdout
  assert "FAIL combiner_fixed" in proc.stdout
  assert "WARNING: the fused kernels failed their check on v4-16" in proc.stdout
  assert "training finished at step 6" in proc.stdout


def test_without_deletion_the_slice_stays(world):
  w = world()
  proc = w.launch()  # no deletion asked: the slice stays
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert w.verbs() == ["create", "train"] and not w.gone()
  assert w.seconds < 10


# -- without a cloud -----------------------------------------------------------------------------------------


def dry_run(capsys, command, *argv):
  assert tpu.main([command, "--dry_run", *argv]) == 0
  return [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]


def test_dry_run_commands_and_quoting(capsys):
  cmds = dry_run(capsys, "run", "--name", "c4-comb", "--zone", "us-central2-b", "--accelerator", "v4-8",
                 "--spot", "--allow_dirty", "--config", "configs/c4.py", "--workdir", "gs://bucket/c4", "--",
                 "--config.seed=1", "--gin_bindings=attention.deepsets = True")
  create = ("gcloud compute tpus queued-resources create c4-comb --node-id c4-comb --zone us-central2-b "
            "--accelerator-type v4-8 --runtime-version tpu-ubuntu2204-base --spot")
  assert cmds[0] == create
  argv = [shlex.split(c) for c in cmds]
  train = next(a for a in argv if a[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
               and "nohup" in a[-1])
  assert "--worker=all" in train
  check = next(i for i, a in enumerate(argv) if "scripts.check_kernels" in a[-1])
  assert argv[check][-3:] == ["--worker=0", "--command",
                              "cd ~/combiner && TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_BOUNDS=1,1,1 "
                              "TPU_VISIBLE_DEVICES=0 ~/venv/bin/python -m scripts.check_kernels"]
  assert check < argv.index(train)  # before training starts
  remote = shlex.split(train[-1].split("setsid nohup ", 1)[1].split(" >> ")[0])
  assert remote == ["~/venv/bin/python", "train.py", "--multihost", "--config", "configs/c4.py",
                    "--workdir", "gs://bucket/c4", "--noprogress", "--config.seed=1",
                    "--gin_bindings=attention.deepsets = True"]
  cmds = dry_run(capsys, "copy", "--name", "n", "--zone", "z", "--repo_url", "https://x/y.git; rm -rf ~",
                 "--ref", "v1")
  remote = shlex.split(cmds[0])[-1]
  assert "'https://x/y.git; rm -rf ~'" in remote and remote.endswith("checkout -q v1")


@pytest.mark.parametrize("name,gcloud_type,runtime,hosts", [
    ("v2-8", "v2-8", "tpu-ubuntu2204-base", 1), ("v3-32", "v3-32", "tpu-ubuntu2204-base", 4),
    ("v4-8", "v4-8", "tpu-ubuntu2204-base", 1), ("v4-16", "v4-16", "tpu-ubuntu2204-base", 2),
    ("v5e-8", "v5litepod-8", "v2-alpha-tpuv5-lite", 1),
    ("v5litepod-16", "v5litepod-16", "v2-alpha-tpuv5-lite", 4),
    ("v5p-8", "v5p-8", "v2-alpha-tpuv5", 1), ("v6e-16", "v6e-16", "v2-alpha-tpuv6e", 4)])
def test_accelerator_names(name, gcloud_type, runtime, hosts):
  assert tpu.accelerator_type(name) == gcloud_type and tpu.generation(name).runtime == runtime
  assert tpu.hosts(name) == hosts


def test_clear_one_line_refusals(capsys):
  def refused(*argv):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
      tpu.main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err.strip()

  assert "v4-8 or v5e-16" in refused("create", "--name", "n", "--zone", "z", "--accelerator", "tpu8",
                                     "--dry_run")
  assert "--config and --workdir" in refused("run", "--name", "n", "--zone", "z", "--accelerator", "v4-8",
                                             "--dry_run")
  assert refused("run", "--name", "n", "--zone", "z", "--accelerator", "v5e-16", "--config", "c",
                 "--workdir", "runs/x", "--dry_run") == (
                     "ERROR: --workdir must be a gs:// path on v5e-16 (4 hosts): every worker writes to it")
  cmds = dry_run(capsys, "create", "--name", "n", "--zone", "z", "--accelerator", "v6e-8", "--reserved")
  assert cmds[0].endswith("--accelerator-type v6e-8 --runtime-version v2-alpha-tpuv6e --reserved")


@pytest.mark.parametrize("flag,value", [
    ("--name", "--project=evil-proj"), ("--name", "../../root/.ssh/x"), ("--name", "a" * 64),
    ("--name", "ends-"), ("--name", "9lives"), ("--ref", "--output=/tmp/x"), ("--project", "-x"),
    ("--poll_s", "-5"), ("--max_restarts", "-1"), ("--retries", "-1"), ("--stall_s", "0")])
def test_names_refs_and_numbers_outside_their_domains_are_refused(capsys, flag, value):
  argv = ["copy", "--name", "n", "--zone", "z", "--dry_run", "--allow_dirty"]
  argv = [*argv[:1], *argv[3:]] if flag == "--name" else argv
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    tpu.main([*argv, f"{flag}={value}"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"ERROR: {flag}"), err


def test_the_code_tarball_is_a_temporary_file_and_git_reads_no_option(capsys):
  import tempfile

  name = "a" * 63  # the longest valid name
  cmds = dry_run(capsys, "copy", "--name", name, "--zone", "z", "--allow_dirty")
  archive = shlex.split(next(c for c in cmds if " archive " in c))
  tarball = archive[archive.index("-o") + 1]
  assert os.path.dirname(tarball) == tempfile.gettempdir() and name not in tarball
  assert archive[-2] == "--end-of-options" and len(archive[-1]) == 40  # the shipped commit


def test_a_dirty_git_tree_is_refused_in_one_line(tmp_path):
  """The launcher in a repository of its own with an uncommitted change: copy says so and calls no gcloud;
  --allow_dirty ships HEAD."""
  repo = tmp_path / "repo"
  for rel in ("scripts/__init__.py", "scripts/tpu.py", "scripts/tpu_commands.py", "scripts/tpu_watch.py",
              "training/__init__.py", "training/status.py", "runtime/__init__.py", "runtime/cli.py",
              "runtime/tpu_generations.py", "requirements.txt"):
    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(ROOT, rel), repo / rel)
  git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
  for argv in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "launcher"]):
    subprocess.run(git + argv, check=True, capture_output=True)
  (repo / "requirements.txt").write_text("jax==0.10.2\nchanged\n")
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "gcloud").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'gcloud.log'}\nexit 1\n")
  (tmp_path / "bin" / "gcloud").chmod(0o755)
  env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
  cmd = [sys.executable, "-m", "scripts.tpu", "copy", "--name", "n", "--zone", "z"]
  proc = subprocess.run(cmd, cwd=repo, env=env, text=True, capture_output=True)
  assert proc.returncode == 1 and proc.stderr.startswith("error: the git tree has uncommitted changes (1 "
                                                         "paths, e.g. requirements.txt)")
  assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "gcloud.log").exists()
  proc = subprocess.run(cmd + ["--allow_dirty", "--dry_run"], cwd=repo, env=env, text=True,
                        capture_output=True)
  assert proc.returncode == 0 and "archive --format=tar.gz" in proc.stdout


def test_the_compile_check_runs_first_with_the_config_flags(capsys):
  capsys.readouterr()
  assert tpu.main(["create", "--dry_run", "--name", "n", "--zone", "z", "--accelerator", "v5e-16", "--config",
                   "configs/c4.py", "--", "--config.train.batch_size", "64", "--noprogress",
                   "--gin_bindings=attention.deepsets = True"]) == 0
  lines = capsys.readouterr().out.splitlines()
  check = shlex.split(lines[0].split(": ", 1)[1])
  assert lines[0].startswith("# compile check")
  assert lines[1].startswith("gcloud compute tpus queued-resources create")
  assert check[1].endswith("scripts/compile_tpu.py") and check[-5:] == [
      "--topology", "v5e-16", "--config.train.batch_size", "64", "--gin_bindings=attention.deepsets = True"]
  assert tpu.main(["create", "--dry_run", "--name", "n", "--zone", "z", "--accelerator", "v5e-16", "--config",
                   "configs/c4.py", "--skip_compile_check"]) == 0
  assert "compile check" not in capsys.readouterr().out


def test_no_slice_is_created_when_the_config_does_not_fit(tmp_path):
  """The real launcher, with a `gcloud` on PATH that records its calls: the compile check of a batch no chip
  holds fails, so gcloud is never called."""
  import scripts.compile_tpu  # noqa: F401  (libtpu for this process, as for the launcher's compile check)

  pytest.importorskip("libtpu")
  log = tmp_path / "gcloud.log"
  (tmp_path / "gcloud").write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
  (tmp_path / "gcloud").chmod(0o755)
  env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
  proc = subprocess.Popen([sys.executable, "-m", "scripts.tpu", "create", "--name", "n", "--zone", "z",
                           "--accelerator", "v5e-1", "--config", "configs/default.py:smoke", "--",
                           "--config.train.batch_size=4194304"], cwd=tpu.ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 1
  assert "does not fit on v5e-1" in err and "not creating n" in err.splitlines()[-1]
  assert not log.exists()
