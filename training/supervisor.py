"""The supervisor of one process of a multi-host run: the process that can still act when training cannot.

When a process of a run dies (its host went down, it was killed with SIGKILL) or stops answering, JAX's
coordination service stops every other process with a C++ abort within its heartbeat timeout (train.py's
`--host_timeout_s`); when the coordinator (process 0) dies, the others abort at once. An aborted process
writes nothing. So train.py, run as one process of several, runs the training in a child process and waits
for it (`supervise`):

- The child's stdout is this process's; its stderr passes through this process, which keeps the last lines.
  SIGTERM and SIGHUP (a preemption notice, a closed terminal) are passed on; SIGINT reaches both from the
  terminal. The child dies with its supervisor (PR_SET_PDEATHSIG), so a killed supervisor is a lost host.
- The child tells its supervisor, through a pipe, its process index and the final record it would write
  (only process 0 writes records: training/status.py).
- When the child fails and no failure of this attempt is recorded yet, the supervisor records one: for a child
  ended by a signal (SIGABRT from JAX, SIGKILL, a crash; not SIGINT, SIGTERM or SIGHUP), cause `host_lost`:
  which process stopped sending heartbeats or that the coordinator stopped answering (from JAX's message),
  the last intact checkpoint step and the child's last stderr lines, with one `ERROR:` line; otherwise the
  record the child told. A child's own error (an exception, a failed checkpoint write) replaces a `host_lost`
  record of this attempt: the others lost their connection to it because it failed.
- Process 0's supervisor acts at once; the others give process 0 a few seconds first.

A collective that fails in the child because another process went away (gloo's "Connection reset by peer",
the coordination service unreachable) is a lost host too (`lost_host`): the training loop records it so.
Exit status 75 (EX_TEMPFAIL) says a host was lost: starting the run again resumes it (scripts/tpu.py does).
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from training import status as run_status

CHILD_ENV = "LSA_SUPERVISOR_FD"  # in the child: the pipe on which it tells its supervisor
EXIT_HOST_LOST = 75
STDERR_LINES = 200  # the child's last stderr lines kept for the account
OTHERS_WAIT_S = 5.0  # how long a process other than 0 lets process 0 record a failure first
PASSED_ON = (signal.SIGTERM, signal.SIGHUP)
NOT_LOST = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a child ended by these was asked to stop
# An error of a collective or of the coordination service whose other end went away.
PEER_GONE = re.compile(r"Connection (reset|closed) by peer|Socket closed|stopped sending heartbeats|"
                       r"heartbeat timeout|Failed to send RPC to coordination service")


class HostLost(RuntimeError):
  """A process of a multi-host run died or stopped answering; `status_fields` go into failed.json."""

  def __init__(self, message: str, *, status_fields: dict[str, Any]):
    super().__init__(message)
    self.status_fields = status_fields


def account(what: str, workdir: str, lost: list[int]) -> HostLost:
  """The HostLost for `what` happened: the last intact checkpoint of `workdir` found and named."""
  from training import checkpoints  # orbax, to tell finished steps from half-written ones

  directory = f"{os.fspath(workdir).rstrip('/')}/checkpoints"
  intact = checkpoints.intact_steps(directory)
  last = intact[-1] if intact else None
  resume = (f"the last intact checkpoint is step {last} in {directory}" if last is not None else
            f"no checkpoint was completed in {directory}")
  return HostLost(f"a host of this run was lost: {what}; {resume}; start the run again to resume",
                  status_fields={"cause": "host_lost", "lost_processes": lost, "last_intact_step": last})


def lost_host(e: BaseException, workdir: str) -> HostLost | None:
  """In a run of several processes, the HostLost an exception of the training loop means (a collective or
  the coordination service lost the other end), else None."""
  import jax

  if jax.process_count() == 1:
    return None
  text, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text.append(f"{type(e).__name__}: {e}")
    e = e.__cause__ or e.__context__
  found = next((t for t in text if PEER_GONE.search(t)), None)
  if found is None:
    return None
  # A collective's error does not name the other end; of two processes it is the one that is not this one.
  count, me = jax.process_count(), jax.process_index()
  lost = [1 - me] if count == 2 else []
  peer = f"process {lost[0]} of {count}" if lost else "another process"
  lost_ = account(f"the connection to {peer} broke ({' '.join(found.split())[:300]})", workdir, lost)
  lost_.status_fields["reported_by"] = me  # process 0 records it itself; the others' supervisors relay it
  return lost_


# -----------------------------------------------------------------------------------------------------------
# In the child


_channel: int | None = None


def is_child() -> bool:
  return CHILD_ENV in os.environ or _channel is not None


def tell(**message: Any) -> None:
  """A line to the supervisor (nothing when this process has none)."""
  global _channel
  if _channel is None and CHILD_ENV in os.environ:
    _channel = int(os.environ.pop(CHILD_ENV))
  if _channel is None:
    return
  try:
    os.write(_channel, (json.dumps(run_status._finite(message)) + "\n").encode())
  except OSError:  # the supervisor is gone: the child dies with it anyway
    pass


def relay_record(record: dict[str, Any]) -> None:
  """Status's relay in processes other than 0: the final record this process would write."""
  tell(record=record)


# -----------------------------------------------------------------------------------------------------------
# The supervisor


def _die_with_parent(parent: int) -> None:
  """In the child before exec: SIGKILL when the supervisor dies (Linux); elsewhere nothing."""
  try:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    return
  if os.getppid() != parent:  # the supervisor died before the request took effect
    os._exit(1)


def _relay_stderr(stream: Any, tail: collections.deque) -> None:
  """Copies the child's stderr to ours as it comes and keeps its last lines."""
  out = sys.stderr.buffer
  pending = b""
  for chunk in iter(lambda: stream.read1(65536), b""):
    try:
      out.write(chunk)
      out.flush()
    except (OSError, ValueError):  # our stderr is gone: keep reading, so the child never blocks
      pass
    lines = (pending + chunk).split(b"\n")
    pending = lines.pop()
    tail.extend(line.decode(errors="replace") for line in lines)
  if pending:
    tail.append(pending.decode(errors="replace"))


def _read_messages(fd: int, told: dict[str, Any]) -> None:
  """What the child tells, line by line, merged into `told`."""
  with os.fdopen(fd, "rb") as f:
    for line in f:
      try:
        told.update(json.loads(line))
      except ValueError:
        pass


def supervise(argv: list[str], workdir: str) -> int:
  """Runs `python argv` (train.py with its flags) as a child and returns the exit status to leave with."""
  read_fd, write_fd = os.pipe()
  env = dict(os.environ, **{CHILD_ENV: str(write_fd)})
  parent = os.getpid()
  started = time.time()
  child = subprocess.Popen([sys.executable, *argv], env=env, stderr=subprocess.PIPE, pass_fds=(write_fd,),
                           preexec_fn=lambda: _die_with_parent(parent))
  os.close(write_fd)
  previous = {s: signal.signal(s, lambda signum, frame: child.send_signal(signum)) for s in PASSED_ON}
  previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal tells the child
  tail: collections.deque = collections.deque(maxlen=STDERR_LINES)
  told: dict[str, Any] = {}
  threads = [threading.Thread(target=_relay_stderr, args=(child.stderr, tail), daemon=True),
             threading.Thread(target=_read_messages, args=(read_fd, told), daemon=True)]
  for t in threads:
    t.start()
  try:
    code = child.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for t in threads:
    t.join(timeout=10)
  if code == 0 or (code < 0 and -code in NOT_LOST):
    return code if code >= 0 else 128 - code
  return after_failure(workdir, code, list(tail), told, since=started)


def after_failure(workdir: str, code: int, stderr_tail: list[str], told: dict[str, Any], *,
                  since: float) -> int:
  """A failed child: the failure recorded unless it is already (see the module docstring); the exit status
  to leave with (75 when a host was lost)."""
  index, count = told.get("process_index"), told.get("process_count")
  if index is None and code >= 0:  # it stopped before joining the run (a bad flag): nothing to account for
    return code
  if index != 0:
    time.sleep(OTHERS_WAIT_S)
  record = run_status.read_record(workdir, "failed")
  recorded = float(record.get("time", 0)) >= since
  if code < 0:  # ended by a signal: this process wrote nothing
    what, lost = cause(stderr_tail, -code, index, count)
    lost_host_ = account(what, workdir, lost)
    said = [line for line in stderr_tail if line.startswith("ERROR: a host of this run was lost")]
    if not said:
      print(f"ERROR: {lost_host_}", file=sys.stderr, flush=True)  # the child said nothing of it
    elif stderr_tail[-1] != said[-1]:  # JAX's abort dump came after the child's account: the account last
      print(said[-1], file=sys.stderr, flush=True)
    if not recorded and _owned(workdir):
      status = run_status.Status(workdir)
      status.step = run_status.read_record(workdir, "heartbeat").get("step")  # the step training reached
      status.failed(lost_host_, exit_status=EXIT_HOST_LOST, reported_by=index,
                    stderr_tail=_readable(stderr_tail))
    return EXIT_HOST_LOST
  own = told.get("record")  # what a process other than 0 would have recorded
  replaces = recorded and record.get("cause") == "host_lost" and (own or {}).get("cause") != "host_lost"
  if own and (not recorded or replaces) and _owned(workdir):
    from runtime import paths

    own["reported_by"] = index
    paths.write_text(run_status.record_path(workdir, "failed"), run_status.record_json(own))
  return EXIT_HOST_LOST if code == EXIT_HOST_LOST else code


def _owned(workdir: str) -> bool:
  """Records go only into a workdir this run owns (its config.json is there), as train.py's own."""
  from runtime import paths

  try:
    return paths.exists(f"{os.fspath(workdir).rstrip('/')}/config.json")
  except Exception:  # a storage error: no record
    return False


def cause(stderr_tail: list[str], signal_number: int, process_index: int | None = None,
          process_count: int | None = None) -> tuple[str, list[int]]:
  """What happened, in a sentence, and the processes lost, from the child's last stderr lines (JAX's
  coordination messages) and the signal that ended it."""
  text = "\n".join(stderr_tail)
  me = f"process {process_index}" if process_index is not None else "this process"
  of = f" of {process_count}" if process_count is not None else ""
  m = re.search(r"stopped sending heartbeats\):\s*\n?([\d,\s]+)", text)
  lost = sorted({int(x) for x in re.findall(r"\d+", m.group(1))}) if m else []
  if not lost:
    lost = sorted({int(x) for x in re.findall(r"Task (\d+) heartbeat timeout", text)})
  if lost:
    who = "process" + ("es " if len(lost) > 1 else " ") + ", ".join(map(str, lost))
    return (f"{who}{of} stopped sending heartbeats (its host died or it was killed); JAX's coordination "
            f"service stopped {me}", lost)
  if "coordination service" in text and ("leader task" in text or "Failed to send RPC" in text):
    return (f"the coordinator (process 0{of}) stopped answering (its host died or it was killed); JAX's "
            f"coordination service stopped {me}", [0])
  name = signal.Signals(signal_number).name if signal_number in signal.valid_signals() else str(signal_number)
  return f"{me}{of} ended by {name}", [] if process_index is None else [process_index]


def _readable(lines: list[str], keep: int = 30) -> list[str]:
  """The child's last stderr lines without the C++ stack frames and Python's thread dumps of the abort."""
  noise = re.compile(r"\s*(@\s+0x|File \"|Thread 0x|Extension modules:|Current thread 0x)")
  out = [line for line in lines if line.strip() and not noise.match(line)]
  return out[-keep:]
