"""One writer per workdir: a lock file that names its holder, refreshed while the run is alive.

`<workdir>/lock.json` holds the host, pid, start time and last refresh of the run that trains there. A second
run on the same workdir stops with one line naming the holder. A lock whose holder is gone is taken over with
a message: on the same host when its pid no longer runs, from another host when it has not been refreshed for
`stale_s` seconds (the holder refreshes it with its heartbeat). Only process 0 of a run holds the lock; the
other processes follow its decision.

Local workdirs create the file exclusively (`O_EXCL`), and a takeover first renames the stale file away, so of
two runs starting at once exactly one wins. Object stores (`gs://`) offer no exclusive create through the path
layer: the lock is written with a random token and read back after a pause, which catches a concurrent writer
unless both write within the same pause.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from typing import Any

import jax
import numpy as np

from runtime import paths
from training.config_io import LOCK, ConfigMismatch

GS_SETTLE_S = 2.0  # object stores: the pause between writing the lock and reading it back


class WorkdirLocked(ConfigMismatch):
  """Another live run holds the workdir (nothing is written there)."""


def _alive(holder: dict[str, Any], stale_s: float) -> bool:
  """Whether the run that wrote `holder` still runs: its pid on this host, its refresh time elsewhere."""
  if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
    try:
      os.kill(holder["pid"], 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      return True
    return not _zombie(holder["pid"])
  return time.time() - float(holder.get("refreshed", 0.0)) < stale_s


def _zombie(pid: int) -> bool:
  """A process that has ended but is not yet reaped (a killed run whose parent died with it), where /proc
  tells."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except (OSError, IndexError):
    return False


def describe(holder: dict[str, Any]) -> str:
  started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0.0))))
  return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}"


class WorkdirLock:
  """`acquire()` before the first write to the workdir, `refresh()` with the heartbeat, `release()` at the
  end (only a lock that is still ours is removed). A no-op where `enabled` is False."""

  def __init__(self, workdir: str, *, enabled: bool = True, every_s: float = 60.0,
               stale_s: float | None = None):
    self.workdir = os.fspath(workdir)
    self.path = paths.join(self.workdir, LOCK)
    self.enabled = enabled
    self.every_s = float(every_s)
    self.stale_s = float(stale_s) if stale_s is not None else max(5 * self.every_s, 300.0)
    self.record: dict[str, Any] | None = None
    self._last = 0.0

  def _read(self) -> dict[str, Any] | None:
    try:
      return json.loads(paths.read_text(self.path))
    except FileNotFoundError:
      return None
    except (ValueError, OSError):  # a half-written or unreadable lock: its writer died mid-write
      return {}

  def _new_record(self) -> dict[str, Any]:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "refreshed": now,
            "token": uuid.uuid4().hex, "argv": sys.argv}

  def _create_local(self, record: dict[str, Any]) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w") as f:
      json.dump(record, f)
    return True

  def acquire(self) -> None:
    if not self.enabled:
      return
    paths.makedirs(self.workdir)
    record = self._new_record()
    for _ in range(3):  # another starter may take the lock between our read and our create
      holder = self._read()
      if holder is not None:
        if holder and _alive(holder, self.stale_s):
          raise self._refused(holder)
        print("taking over the lock of a run that is gone"
              + (f" ({describe(holder)})" if holder else "") + f": {self.path}", flush=True)
        if not paths.is_uri(self.path):
          try:  # a rename succeeds for one of two runs taking over at once
            os.replace(self.path, f"{self.path}.stale-{record['token']}")
            os.remove(f"{self.path}.stale-{record['token']}")
          except FileNotFoundError:
            continue
      if paths.is_uri(self.path):
        paths.write_text(self.path, json.dumps(record))
        time.sleep(GS_SETTLE_S)
        if (self._read() or {}).get("token") != record["token"]:
          continue
        self.record = record
        return
      if self._create_local(record):
        self.record = record
        return
    raise self._refused(self._read() or {})

  def _refused(self, holder: dict[str, Any]) -> WorkdirLocked:
    return WorkdirLocked(f"--workdir {self.workdir} is in use by another run ({describe(holder)}): one run "
                         f"per workdir. Wait for it, stop it, or choose another --workdir.")

  def refresh(self, *, force: bool = False) -> None:
    """Rewrites the refresh time every `every_s` seconds; never raises (a storage error must not stop
    training: the lock only goes stale for other hosts)."""
    if self.record is None:
      return
    now = time.time()
    if not force and now - self._last < self.every_s:
      return
    self._last = now
    self.record["refreshed"] = now
    try:
      paths.write_text(self.path, json.dumps(self.record))
    except Exception as e:
      print(f"could not refresh {self.path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

  def release(self) -> None:
    """Removes the lock if it is still ours; never raises."""
    if self.record is None:
      return
    try:
      if (self._read() or {}).get("token") == self.record["token"]:
        paths.path(self.path).unlink(missing_ok=True)
    except Exception as e:
      print(f"could not remove {self.path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    self.record = None


def acquire_everywhere(lock: WorkdirLock) -> None:
  """Process 0 takes the lock (`lock.enabled` there only) and every process follows its answer, so a refused
  multi-host run stops on every host instead of waiting in its first collective."""
  error = None
  try:
    lock.acquire()
  except WorkdirLocked as e:
    error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    if not int(multihost_utils.broadcast_one_to_all(np.int32(error is None))) and error is None:
      error = WorkdirLocked(f"--workdir {lock.workdir} is in use by another run (process 0 says who)")
  if error is not None:
    raise error
