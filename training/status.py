"""What a training run says about itself in `<workdir>/status/`, for whoever watches it (scripts/tpu.py).

Process 0 writes small JSON records, each replaced whole (a local file through a temporary file and a rename,
a `gs://` object as one upload: runtime/paths.py), so a reader never sees half a record:

- `started.json`: step, num_steps, host count, devices, the code's commit (a `COMMIT` file at the repository
  root, as scripts/tpu.py ships it, else `git rev-parse HEAD`), host, pid, argv. Starting removes the final
  records of an earlier attempt.
- `heartbeat.json`: step and time, at most every `every_s` seconds, written from the training loop itself
  (a hung step or collective stops it, which is the point).
- one final record: `finished.json` (step, the final evaluation's metrics), `failed.json` (the exception as
  one line, the last traceback lines, the exit status, the last lines of the log when the environment variable
  TRAINING_LOG names it, and its `cause`), or `preempted.json` (step and reason: SIGTERM or a planned stop;
  the run resumes from its checkpoint when started again).

A failure's `cause` says what a watcher can do about it: `exception` (an error of the run itself: restarting
repeats it), `checkpoint_write` (the storage refused a checkpoint: `checkpoint_dir`, `os_error` and
`last_intact_step` say where and why; someone must free space or fix the storage), or `host_lost` (a process
of a multi-host run died or stopped answering: training/supervisor.py; starting the run again resumes it from
its last intact checkpoint, as after a preemption).

Every record has `state` (its name), `time` (Unix seconds) and `step`. Only process 0 writes them, but for a
lost host, which the supervisor of whichever process is left reports.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

DIR = "status"
FINAL = ("finished", "failed", "preempted")
RECORDS = ("started", "heartbeat", *FINAL)
LOG_ENV = "TRAINING_LOG"  # the launcher points this at the run's log file (its tail goes into failed.json)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_TAIL_LINES = 40
RESTARTABLE = ("host_lost",)  # failure causes that starting the run again can cure (scripts/tpu.py does)


def record_path(workdir: str, name: str) -> str:
  """`<workdir>/status/<name>.json` (string join: keeps `gs://`)."""
  return f"{os.fspath(workdir).rstrip('/')}/{DIR}/{name}.json"


def commit(root: str = ROOT) -> str | None:
  """The code's commit: the `COMMIT` file a shipped tarball carries, else git's HEAD; None when unknown."""
  try:
    with open(os.path.join(root, "COMMIT")) as f:
      return f.read().strip() or None
  except OSError:
    pass
  try:
    out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return (out.stdout.strip() or None) if out.returncode == 0 else None


def _finite(x: Any) -> Any:
  """Standard JSON: NaN/Inf become null; numpy scalars become Python numbers."""
  if isinstance(x, dict):
    return {str(k): _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  if hasattr(x, "item") and callable(x.item):  # numpy / jax scalars, without importing either here
    try:
      x = x.item()
    except (TypeError, ValueError):
      return str(x)
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  return str(x)


def one_line(exc: BaseException) -> str:
  """`TrainingDiverged: non-finite loss ...`: the exception's type and its message's first line."""
  text = str(exc).strip().splitlines()
  return type(exc).__name__ + (f": {text[0]}" if text else "")


def log_tail(path: str | None = None, lines: int = LOG_TAIL_LINES) -> list[str]:
  """The last lines of the run's log (TRAINING_LOG), [] when there is none."""
  path = path or os.environ.get(LOG_ENV)
  if not path:
    return []
  try:
    with open(os.path.expanduser(path), errors="replace") as f:
      return [line.rstrip("\n") for line in f.readlines()[-lines:]]
  except OSError:
    return []


def record_json(record: dict[str, Any]) -> str:
  """A record as its file holds it: standard JSON (NaN/Inf as null)."""
  return json.dumps(_finite(record), indent=2, allow_nan=False) + "\n"


def read_record(workdir: str, name: str) -> dict[str, Any]:
  """A record of the workdir, {} when there is none or it cannot be read."""
  from runtime import paths

  try:
    record = json.loads(paths.read_text(record_path(workdir, name)))
  except (OSError, ValueError):
    return {}
  return record if isinstance(record, dict) else {}


class Status:
  """The records of one run; a no-op where `enabled` is False (processes other than 0), but for the final
  records, which go to `relay` when given (training/supervisor.py: written if process 0 writes none)."""

  def __init__(self, workdir: str, *, enabled: bool = True, every_s: float = 60.0,
               relay: Callable[[dict[str, Any]], None] | None = None):
    self.workdir = os.fspath(workdir)
    self.enabled = enabled
    self.every_s = float(every_s)
    self.relay = relay
    self.step: int | None = None
    self.started_at: float | None = None  # when this attempt started (its own records are newer)
    self._last_beat: float | None = None
    self.final: str | None = None  # the final record written, if any
    self._unwritable: set[str] = set()  # records whose last write failed (reported once, not at every beat)

  def write(self, name: str, **fields: Any) -> None:
    """Replaces `<name>.json`; a failed write is reported on stderr (once until a write of that record
    succeeds again), never raised (it must not stop training nor hide the error being reported)."""
    if fields.get("step") is not None:
      self.step = int(fields["step"])
    record = {"state": name, "time": time.time(), **fields, "step": self.step}
    if not self.enabled:
      if self.relay is not None and name in FINAL:
        self.relay(record)
      return
    from runtime import paths

    try:
      paths.write_text(record_path(self.workdir, name), record_json(record))
    except Exception as e:  # a transient storage error, a full disk
      if name not in self._unwritable:
        print(f"could not write {record_path(self.workdir, name)}: {one_line(e)}", file=sys.stderr,
              flush=True)
      self._unwritable.add(name)
      return
    self._unwritable.discard(name)
    if name in FINAL:
      self.final = name

  def started(self, *, step: int, num_steps: int | None = None, hosts: int | None = None,
              devices: int | None = None, **extra: Any) -> None:
    """A new attempt: the final records of an earlier one go, then `started`."""
    self.started_at = time.time()
    if not self.enabled:
      return
    from runtime import paths

    try:
      for name in FINAL:
        paths.path(record_path(self.workdir, name)).unlink(missing_ok=True)
    except Exception as e:  # a transient storage error: the launcher clears them too
      print(f"could not clear the final status records: {one_line(e)}", file=sys.stderr, flush=True)
    self.final = None
    self.write("started", step=step, num_steps=num_steps, hosts=hosts, devices=devices, commit=commit(),
               host=socket.gethostname(), pid=os.getpid(), argv=sys.argv, **extra)

  def heartbeat(self, step: int, *, force: bool = False) -> None:
    """Writes `heartbeat` on the first call, then when `every_s` seconds have passed since the last write
    (or with `force`)."""
    self.step = int(step)
    if not self.enabled:
      return
    now = time.monotonic()
    if force or self._last_beat is None or now - self._last_beat >= self.every_s:
      self._last_beat = now
      self.write("heartbeat", step=step)

  def finished(self, step: int, metrics: dict[str, Any]) -> None:
    self.write("finished", step=step, metrics=metrics)

  def preempted(self, step: int, reason: str) -> None:
    self.write("preempted", step=step, reason=reason)

  def failed(self, exc: BaseException, *, exit_status: int = 1, step: int | None = None,
             **fields: Any) -> None:
    """The failure as one line, the traceback's last lines and the log's, its cause (`cause` in `fields` or
    the exception's `status_fields`, else "exception"); marks `exc` as recorded. The first failure of an
    attempt is its cause: one recorded since it started (another process's, by its supervisor) stays."""
    if step is not None:
      self.step = int(step)
    tb = "".join(traceback.format_exception(exc)).rstrip().splitlines()[-20:]
    fields = {"cause": "exception", **getattr(exc, "status_fields", {}), **fields}
    earlier = read_record(self.workdir, "failed") if self.enabled and self.started_at is not None else {}
    if float(earlier.get("time", 0)) < (self.started_at or math.inf):
      self.write("failed", error=one_line(exc), exit_status=exit_status, traceback=tb, log_tail=log_tail(),
                 **fields)
    try:
      exc.status_recorded = True  # train.py's own failure path does not write it again
    except AttributeError:
      pass


def record_failure(workdir: str, exc: BaseException, *, enabled: bool = True, exit_status: int = 1) -> None:
  """`failed.json` for an exception that escaped the training loop before (or outside) its own records; never
  raises (a failure to report must not hide the failure itself). Only in a workdir this run already owns
  (its config.json is there), so that a refused or not yet created workdir gains no files; a failure before
  that leaves no record (the log says why)."""
  if not enabled or getattr(exc, "status_recorded", False):
    return
  if isinstance(exc, SystemExit) and exc.code in (0, None):
    return
  from runtime import paths

  try:
    owned = paths.exists(f"{os.fspath(workdir).rstrip('/')}/config.json")
  except Exception:  # a storage error: no record
    owned = False
  if owned:
    Status(workdir).failed(exc, exit_status=exit_status)
