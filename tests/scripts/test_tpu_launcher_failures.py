"""scripts/tpu.py when a host of the run is lost, against the fake Google Cloud of test_tpu_launcher.py.

Fast, with train.py's stand-in: a worker whose host dies (its stand-in exits, the other's is stopped the way
JAX stops it, and reports through training/supervisor.py) is met like a preemption: train.py starts again on
the slice and resumes, or the slice is recreated when the dead worker cannot be reached; a train.py that
vanishes at the same step every time (a deterministic hard crash) is restarted --max_restarts times, then the
launcher stops with the account and the log's last lines.

Slow, with the real train.py: two workers train through jax.distributed on localhost; the test kills worker
1's whole process tree (its host dies) after the first checkpoint; worker 0's supervisor records the loss,
the launcher starts training again with no human step, and the final metrics equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.scripts.test_tpu_launcher import ROOT, worlds
from tests.training.localhost import CONFIG, final_metrics, uninterrupted, xla_flags


@pytest.fixture
def world(tmp_path):
  yield from worlds(tmp_path)


def test_a_lost_host_restarts_training_on_the_slice(world):
  w = world(mode="host_dies")
  proc = w.launch("--delete_after")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert ("a host was lost at step 2 (HostLost: a host of this run was lost: process 1 of 2 stopped sending "
          "heartbeats (its host died or it was killed); JAX's coordination service stopped process 0; the "
          "last intact checkpoint is step 2 in ") in proc.stdout
  assert "the slice is ACTIVE: starting train.py again: restart 1" in proc.stdout
  assert w.verbs() == ["create", "train", "stop", "train", "delete"] and w.gone()
  assert w.record("started")["step"] == 2 and w.record("finished")["step"] == 6  # resumed
  assert "training finished at step 6" in proc.stdout


def test_a_lost_host_the_slice_cannot_reach_recreates_the_slice(world):
  """The dead worker stays part of the ACTIVE slice (ssh to it fails): the slice is recreated and training
  resumes from the workdir."""
  w = world(mode="host_dies", unreachable=True)
  proc = w.launch("--delete_after", "--retries", "1")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "train.py cannot start again on t1 (compute tpus tpu-vm ssh failed 2 times" in proc.stdout
  assert "recreating the slice" in proc.stdout and "restart 2" in proc.stdout
  assert w.verbs() == ["create", "train", "stop", "stop", "delete", "create", "train", "delete"] and w.gone()
  assert w.record("started")["step"] == 2 and w.record("finished")["step"] == 6


def test_a_deterministic_hard_crash_stops_after_its_restarts(world):
  w = world(mode="vanish")
  proc = w.launch("--delete_on_failure", "--max_restarts", "2")
  assert proc.returncode == 1, proc.stdout + proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: training failed at step 2: HostLost: train.py is no longer running on "
                         "worker 0 and wrote no final record"), last
  assert last.endswith("(it failed so 3 times: --max_restarts=2); giving up"), last
  assert "restart 2" in proc.stdout and "restart 3" not in proc.stdout
  assert "log (last lines):" in proc.stdout and "step 3: loss=0.333" in proc.stdout  # worker 0's log
  assert w.verbs() == ["create", "train", "stop", "train", "stop", "train", "delete"] and w.gone()
  failed = w.record("failed")  # the launcher's own account stays in the workdir
  assert failed["cause"] == "host_lost" and failed["reported_by"] == "launcher" and failed["step"] == 2
  assert any("step 3: loss=0.333" in line for line in failed["log_tail"])


# -- the real train.py ---------------------------------------------------------------------------------------

# The workers' venv `python`: train.py from this checkout as one of two localhost processes (the coordinator's
# port fixed per attempt), its gs:// workdir mapped into the fake bucket.
REAL_PYTHON = r'''#!/usr/bin/env bash
set -e
[ "$1" = train.py ] || exit 3
shift
attempt=$(( $(cat "$HOME/attempts" 2>/dev/null || echo 0) + 1 ))
echo $attempt > "$HOME/attempts"
port=$(@PYTHON@ -c "import json, sys; print(json.load(open(sys.argv[1]))['ports'][$attempt - 1])" \
  "$FAKE_WORLD/scenario.json")
args=()
for a in "$@"; do
  case "$a" in
    --multihost) args+=(--coordinator_address=localhost:$port --num_processes=2 --process_id=$FAKE_WORKER);;
    gs://*) args+=("$FAKE_WORLD/gs/${a#gs://}");;
    *) args+=("$a");;
  esac
done
cd @ROOT@
XLA_FLAGS="@XLA_FLAGS@" JAX_PLATFORMS=cpu exec @PYTHON@ -u train.py "${args[@]}"
'''

def _real_world(make):
  import portpicker

  w = make(ports=[portpicker.pick_unused_port() for _ in range(3)])
  real = w.root / "real_python.sh"
  real.write_text(REAL_PYTHON.replace("@PYTHON@", sys.executable).replace("@ROOT@", ROOT)
                  .replace("@XLA_FLAGS@", xla_flags(2)))
  real.chmod(0o755)
  venv = w.root / "bin" / "python3.11"  # makes the workers' venv: its python is the wrapper above
  standin = f"exec {sys.executable} {w.root / 'standin.py'}"
  assert standin in venv.read_text()
  venv.write_text(venv.read_text().replace(standin, f"exec {real}"))
  return w


@pytest.mark.slow
def test_a_dead_host_comes_back_with_the_same_final_metrics(world, tmp_path_factory):
  w = _real_world(world)
  env = dict(os.environ, FAKE_WORLD=str(w.root), PATH=f"{w.root / 'bin'}{os.pathsep}{os.environ['PATH']}")
  cmd = [sys.executable, "-m", "scripts.tpu", "run", "--name", "t1", "--zone", "us-central2-b",
         "--accelerator", "v4-16", "--spot", "--config", "configs/default.py:smoke", "--workdir",
         "gs://bucket/run", "--skip_compile_check", "--skip_kernel_check", "--allow_dirty", "--poll_s", "1",
         "--stall_s", "600", "--grace_s", "20", "--retries", "2", "--backoff_s", "1", "--delete_after",
         "--", *CONFIG[2:], "--host_timeout_s=10", "--heartbeat_s=1"]
  launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
  ckpt = w.root / "gs" / "bucket" / "run" / "checkpoints"
  try:
    deadline = time.time() + 600
    while not (ckpt.is_dir() and any(n.isdigit() for n in os.listdir(ckpt))):
      assert time.time() < deadline and launcher.poll() is None, launcher.communicate()[0][-4000:]
      time.sleep(0.2)
    pid = int((w.root / "workers" / "1" / "train.pid").read_text())
    killed = time.time()
    os.killpg(pid, signal.SIGKILL)  # worker 1's host dies: its supervisor and its training
    record = w.root / "gs" / "bucket" / "run" / "status" / "failed.json"
    while not record.exists():
      assert time.time() - killed < 120, "no failed record within 2 minutes"
      time.sleep(0.1)
    failed, reported_s = json.loads(record.read_text()), time.time() - killed
    out, _ = launcher.communicate(timeout=900)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  print(f"failed.json {reported_s:.1f}s after the kill: {failed['error']}")
  assert failed["cause"] == "host_lost" and failed["lost_processes"] == [1], failed
  # The survivor hears of it from JAX's heartbeats, or first from a collective whose other end is gone.
  assert ("process 1 of 2 stopped sending heartbeats" in failed["error"]
          or "the connection to process 1 of 2 broke" in failed["error"]), failed["error"]
  assert launcher.returncode == 0, out[-6000:]
  assert "a host was lost" in out and "restart 1" in out
  assert w.verbs() == ["create", "train", "stop", "train", "delete"]
  workdir = str(w.root / "gs" / "bucket" / "run")
  resumed = json.loads(open(os.path.join(workdir, "metrics.json")).read())
  assert resumed["start_step"] == failed["last_intact_step"] > 0
  # The same run uninterrupted, two processes on localhost: the same final metrics.
  assert final_metrics(workdir) == final_metrics(uninterrupted(str(tmp_path_factory.getbasetemp())))
