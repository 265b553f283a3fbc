"""One run per workdir (training/lock.py) and a failed start that leaves the workdir as it found it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.training.smoke import smoke
from training import loop
from training.lock import LOCK, WorkdirLock, WorkdirLocked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def _holder(workdir, **fields):
  record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "refreshed": time.time(), "token": "x"} | fields
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, LOCK), "w") as f:
    json.dump(record, f)


def test_a_live_holder_refuses_and_a_gone_one_is_taken_over(tmp_path, capsys):
  wd = str(tmp_path / "w")
  first = WorkdirLock(wd)
  first.acquire()
  with pytest.raises(WorkdirLocked, match=rf"in use by another run \(pid {os.getpid()} on "):
    WorkdirLock(wd).acquire()
  first.refresh(force=True)
  first.release()
  assert not os.path.exists(os.path.join(wd, LOCK))
  # The holder's process is gone (same host): taken over, with a message.
  _holder(wd, pid=_dead_pid())
  lock = WorkdirLock(wd)
  lock.acquire()
  assert "taking over the lock of a run that is gone" in capsys.readouterr().out
  lock.release()
  # Ended but not reaped (a killed run whose parent died with it): gone too.
  zombie = subprocess.Popen([sys.executable, "-c", "pass"])
  while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.01)
  _holder(wd, pid=zombie.pid)
  lock = WorkdirLock(wd)
  lock.acquire()
  zombie.wait()
  lock.release()
  # Another host: alive while it refreshes, taken over once stale.
  _holder(wd, host="elsewhere", pid=1)
  with pytest.raises(WorkdirLocked, match="on elsewhere"):
    WorkdirLock(wd, stale_s=60).acquire()
  _holder(wd, host="elsewhere", pid=1, refreshed=time.time() - 120)
  lock = WorkdirLock(wd, stale_s=60)
  lock.acquire()
  # Only our own lock is removed: a lock rewritten by another run stays.
  _holder(wd, token="theirs")
  lock.release()
  assert os.path.exists(os.path.join(wd, LOCK))


@pytest.mark.slow
def test_failed_start_leaves_the_workdir_as_found_and_the_corrected_run_trains(tmp_path):
  wd = tmp_path / "w"
  with pytest.raises(ValueError, match="bogus"):
    loop.train_and_evaluate(smoke("bogus"), str(wd), progress=False)
  assert not wd.exists()  # created by the start, removed with it
  wd.mkdir()
  (wd / "notes.txt").write_text("mine")
  c = smoke("combiner_fixed", **{"train.num_steps": 2, "model.features": 0})
  with pytest.raises(ValueError):
    loop.train_and_evaluate(c, str(wd), progress=False)
  assert sorted(p.name for p in wd.iterdir()) == ["notes.txt"]  # what was there stays, nothing else
  (wd / "notes.txt").unlink()
  result = loop.train_and_evaluate(smoke("combiner_fixed", **{"train.num_steps": 2}), str(wd), progress=False)
  assert result["step"] == 2 and (wd / "config.json").exists() and not (wd / LOCK).exists()


@pytest.mark.slow
def test_second_run_on_a_busy_workdir_is_refused_and_the_first_is_unaffected(tmp_path):
  wd = str(tmp_path / "w")
  cmd = [sys.executable, "train.py", "--config", "configs/default.py:smoke", "--workdir", wd, "--noprogress",
         "--config.train.num_steps=60", "--config.train.log_every=20", "--config.train.checkpoint_every=30"]
  first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while (not os.path.exists(os.path.join(wd, "config.json")) and first.poll() is None
         and time.time() < deadline):
    time.sleep(0.2)
  second = subprocess.run(cmd[:-3] + ["--config.optimizer.lr=0.02"], cwd=ROOT, capture_output=True, text=True)
  out, err = first.communicate(timeout=600)
  assert first.returncode == 0, err[-2000:]
  assert second.returncode != 0
  assert f"in use by another run (pid {first.pid} on {socket.gethostname()}" in second.stderr
  assert "Traceback" not in second.stderr
  with open(os.path.join(wd, "metrics.json")) as f:
    assert json.load(f)["step"] == 60
  with open(os.path.join(wd, "config.json")) as f:
    assert json.load(f)["optimizer"]["lr"] != 0.02  # the second run wrote nothing
  assert not os.path.exists(os.path.join(wd, LOCK))
