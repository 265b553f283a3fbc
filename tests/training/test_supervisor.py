"""training/supervisor.py with real child processes (small Python scripts in place of the training): what it
reads from JAX's messages, the failed record it writes for a child ended by a signal, the record a process
other than 0 relays, which failure of an attempt stays, SIGTERM passed on, and a child that dies with its
supervisor. The two-process runs with a killed host are in test_multiprocess.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from runtime import paths
from training import status, supervisor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEATS = ["E1128 coordination_service.cc:1549] Use error polling to propagate the following error to all "
              "tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):", "1",
              "The tasks have crashed."]
LEADER = ["F1128 client.h:80] Terminating process because the JAX distributed service detected fatal errors. "
          "absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
          "preempted/died/restarted unexpectedly or this task is experiencing network issues."]


@pytest.fixture
def workdir(tmp_path):
  """A workdir of a run: its config.json, finished steps 5 and 10, a half-written step 15."""
  (tmp_path / "config.json").write_text("{}")
  for name in ("5", "10", "15.orbax-checkpoint-tmp"):
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  return str(tmp_path)


def child(tmp_path, body: str) -> list[str]:
  """argv of a child that runs `body` (with `supervisor` imported) from the repository root."""
  path = tmp_path / "child.py"
  path.write_text(f"import os, signal, sys, time\nsys.path.insert(0, {ROOT!r})\n"
                  "from training import supervisor\n" + textwrap.dedent(body))
  return [str(path)]


def test_jax_messages_name_the_lost_process():
  assert supervisor.cause(HEARTBEATS, signal.SIGABRT, 0, 2) == (
      "process 1 of 2 stopped sending heartbeats (its host died or it was killed); JAX's coordination "
      "service stopped process 0", [1])
  assert supervisor.cause(LEADER, signal.SIGABRT, 1, 2) == (
      "the coordinator (process 0 of 2) stopped answering (its host died or it was killed); JAX's "
      "coordination service stopped process 1", [0])
  assert supervisor.cause(["Segmentation fault"], signal.SIGSEGV, 1, 4) == ("process 1 of 4 ended by SIGSEGV",
                                                                           [1])


def test_a_child_ended_by_jax_is_recorded_as_a_lost_host(tmp_path, workdir, capfd):
  argv = child(tmp_path, f"""
      supervisor.tell(process_index=0, process_count=2)
      print({HEARTBEATS!r}[0], {HEARTBEATS!r}[1], sep="\\n", file=sys.stderr, flush=True)
      os.abort()
      """)
  assert supervisor.supervise(argv, workdir) == supervisor.EXIT_HOST_LOST
  err = capfd.readouterr().err
  assert "stopped sending heartbeats" in err  # the child's stderr, passed through
  account = err.strip().splitlines()[-1]
  assert account == ("ERROR: a host of this run was lost: process 1 of 2 stopped sending heartbeats (its "
                     "host died or it was killed); JAX's coordination service stopped process 0; the last "
                     f"intact checkpoint is step 10 in {workdir}/checkpoints; start the run again to resume")
  failed = status.read_record(workdir, "failed")
  assert failed["error"] == "HostLost: " + account[len("ERROR: "):]
  assert (failed["cause"], failed["lost_processes"], failed["last_intact_step"], failed["reported_by"],
          failed["exit_status"]) == ("host_lost", [1], 10, 0, 75)
  assert any("stopped sending heartbeats" in line for line in failed["stderr_tail"])


def test_a_process_other_than_0_records_its_own_error_or_leaves_the_first(tmp_path, workdir, monkeypatch):
  monkeypatch.setattr(supervisor, "OTHERS_WAIT_S", 0.0)
  record = {"state": "failed", "time": time.time() + 1, "error": "ValueError: bad data on host 1",
            "cause": "exception", "step": 7}
  argv = child(tmp_path, f"""
      supervisor.tell(process_index=1, process_count=2)
      supervisor.relay_record({record!r})
      sys.exit(1)
      """)
  # Nothing recorded yet: its record is written.
  assert supervisor.supervise(argv, workdir) == 1
  assert status.read_record(workdir, "failed")["error"] == "ValueError: bad data on host 1"
  # A host_lost record of this attempt (process 0 lost its connection to it): its own error replaces it.
  during = time.time() + 60  # written while the child ran
  write = lambda **r: paths.write_text(status.record_path(workdir, "failed"), status.record_json(r))  # noqa: E731
  write(state="failed", time=during, error="HostLost: connection reset by peer", cause="host_lost")
  assert supervisor.supervise(argv, workdir) == 1
  assert status.read_record(workdir, "failed")["error"] == "ValueError: bad data on host 1"
  # Another error of this attempt stays (the first failure is the cause); a workdir not owned gets none.
  write(state="failed", time=during, error="RuntimeError: out of memory on host 0", cause="exception")
  assert supervisor.supervise(argv, workdir) == 1
  assert status.read_record(workdir, "failed")["error"] == "RuntimeError: out of memory on host 0"
  os.remove(os.path.join(workdir, "config.json"))
  os.remove(status.record_path(workdir, "failed"))
  assert supervisor.supervise(argv, workdir) == 1 and not status.read_record(workdir, "failed")


def test_a_failure_before_joining_the_run_keeps_its_status_and_writes_nothing(tmp_path, workdir):
  assert supervisor.supervise(child(tmp_path, "sys.exit(2)"), workdir) == 2
  assert not status.read_record(workdir, "failed")


def _supervised(tmp_path, workdir, body: str) -> subprocess.Popen:
  code = (f"import sys; sys.path.insert(0, {ROOT!r}); from training import supervisor; "
          f"sys.exit(supervisor.supervise({child(tmp_path, body)!r}, {workdir!r}))")
  return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)


def _wait_for(path, timeout=60):
  deadline = time.time() + timeout
  while not os.path.exists(path):
    assert time.time() < deadline, path
    time.sleep(0.02)


def test_sigterm_is_passed_on_and_the_child_dies_with_its_supervisor(tmp_path, workdir):
  # SIGTERM to the supervisor reaches the child, which saves and exits 0, as train.py does.
  flag = tmp_path / "sigterm"
  proc = _supervised(tmp_path, workdir, f"""
      signal.signal(signal.SIGTERM, lambda *a: (open({str(flag)!r}, "w").close(), sys.exit(0)))
      open({str(tmp_path / "ready")!r}, "w").close()
      time.sleep(60)
      """)
  _wait_for(tmp_path / "ready")
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=30) == 0 and flag.exists()
  # SIGKILL to the supervisor (its host dies) kills the child too.
  pid_file = tmp_path / "pid"
  proc = _supervised(tmp_path, workdir, f"""
      with open({str(pid_file)!r} + ".tmp", "w") as f:  # renamed whole: the test never reads it half-written
        f.write(str(os.getpid()))
      os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
      time.sleep(60)
      """)
  _wait_for(pid_file)
  pid = int(pid_file.read_text())
  proc.kill()
  proc.wait()
  deadline = time.time() + 10
  while _alive(pid):
    assert time.time() < deadline, "the child outlived its supervisor"
    time.sleep(0.02)


def _alive(pid: int) -> bool:
  """Whether process `pid` runs: it exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(") ")[1][0] != "Z"
  except FileNotFoundError:
    return False


def test_the_record_of_an_attempt_is_standard_json(workdir):
  s = status.Status(workdir)
  s.failed(supervisor.account("x", workdir, [1]), step=3)
  with open(status.record_path(workdir, "failed")) as f:
    record = json.loads(f.read())
  assert record["cause"] == "host_lost" and record["last_intact_step"] == 10 and record["step"] == 3
