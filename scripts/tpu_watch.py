"""What scripts/tpu.py does with its commands: runs them with retries (`Runner`), keeps the slice, reads the
run's records and watches training to its end (see scripts/tpu.py's docstring for what each outcome does).
A lost host is met like a preemption: the run starts again and resumes from its last intact checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from scripts.tpu_commands import (
  LauncherError,
  copy_cmds,
  create_cmd,
  delete_cmd,
  describe_cmd,
  is_gcs,
  kernel_check_cmd,
  probe_cmd,
  record_path,
  setup_cmds,
  stop_cmd,
  tail_cmd,
  train_cmds,
  write_record_cmd,
)
from training import status as run_status  # no jax: the records' names and paths

PREEMPTED = ("SUSPENDING", "SUSPENDED", "FAILED", "GONE")
NOT_FOUND = ("NOT_FOUND", "not found", "matched no objects")  # gcloud's answer "there is none"


class TrainingFailed(RuntimeError):
  """Training ended without finishing: failed, stalled or gone. `lines` are the details to print."""

  def __init__(self, message: str, lines: Sequence[str] = ()):
    super().__init__(message)
    self.lines = list(lines)


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
      call(args, run, ["gcloud", "storage", "rm", record_path(args, name)], answers=NOT_FOUND)


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


def restart_training(args: argparse.Namespace, run: Runner) -> None:
  """train.py again on every worker of the slice, after what is left of the last attempt is stopped."""
  call(args, run, stop_cmd(args))
  start_training(args, run)


def restarted(args: argparse.Namespace, run: Runner) -> bool:
  """restart_training after a lost host; False when the slice cannot take it (a worker does not answer: the
  dead host is still part of it), so that the watch hands it back to be recreated."""
  try:
    restart_training(args, run)
  except LauncherError as e:
    print(f"train.py cannot start again on {args.name} ({e}): recreating the slice", flush=True)
    return False
  return True


def write_record(args: argparse.Namespace, run: Runner, name: str, record: dict[str, Any]) -> None:
  """A status record of the launcher's own (what the slice tells when train.py could write none)."""
  text = run_status.record_json(record)
  if not is_gcs(args.workdir):
    call(args, run, write_record_cmd(args, name, text), quiet=True, timeout=args.query_timeout_s)
    return
  with tempfile.NamedTemporaryFile("w", prefix="scripts-tpu-", suffix=".json") as f:
    f.write(text)
    f.flush()
    call(args, run, ["gcloud", "storage", "cp", f.name, record_path(args, name)], quiet=True,
         timeout=args.query_timeout_s)


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
      r = call(args, run, ["gcloud", "storage", "cat", record_path(args, name)], answers=NOT_FOUND,
               quiet=True, timeout=args.query_timeout_s)
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


def final_metrics(record: dict[str, Any]) -> str:
  m = record.get("metrics") or {}
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _failure(record: dict[str, Any]) -> TrainingFailed:
  lines = []
  if record.get("traceback"):
    lines += ["traceback (last lines):", *record["traceback"]]
  if record.get("stderr_tail"):
    lines += ["the lost process's last lines:", *record["stderr_tail"]]
  if record.get("log_tail"):
    lines += ["log (last lines):", *record["log_tail"]]
  return TrainingFailed(f"training failed at step {record.get('step')}: {record.get('error')}", lines)


# ----------------------------------------------------------------------------------------------------------
# The watch


class Restarts:
  """Counts preemptions and lost hosts (recreated slices and restarted train.py) against --max_restarts."""

  def __init__(self, limit: int):
    self.limit, self.count = limit, 0

  def next(self, why: str, failure: TrainingFailed | None = None) -> None:
    """Counts one restart; past the limit, a lost host's `failure` (the run's account, its log's last lines)
    is raised, or for a preemption a LauncherError."""
    self.count += 1
    if self.count > self.limit:
      if failure is not None:
        raise TrainingFailed(f"{failure} (it failed so {self.count} times: --max_restarts={self.limit}); "
                             "giving up", failure.lines)
      raise LauncherError(f"preempted {self.count} times (--max_restarts={self.limit}); giving up ({why})")
    print(f"{why}: restart {self.count}", flush=True)


def watch(args: argparse.Namespace, run: Runner, restarts: Restarts) -> dict[str, Any] | None:
  """Until training ends on this slice: the `finished` record, None when the slice was preempted (to be
  recreated); raises TrainingFailed when training failed by an error of its own or stalled, or lost a host
  (a `host_lost` record, or train.py gone without a record) more often than --max_restarts allows; a lost
  host below that starts train.py again on the slice."""
  if run.dry_run:
    run.note(f"every {args.poll_s:g}s: the queued resource's state, whether train.py runs on worker 0, and "
             f"the run's records in {args.workdir}/{run_status.DIR}/")
    run(describe_cmd(args))
    run(probe_cmd(args))
    if is_gcs(args.workdir):
      run(["gcloud", "storage", "ls", f"{args.workdir.rstrip('/')}/{run_status.DIR}/"])
      run(["gcloud", "storage", "cat", record_path(args, "heartbeat")])
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
      failed = records["failed"]
      if failed.get("cause") not in run_status.RESTARTABLE:  # an error of the run: a restart repeats it
        raise _failure(failed)
      restarts.next(f"a host was lost at step {failed.get('step')} ({failed.get('error')}); the slice is "
                    "ACTIVE: starting train.py again", _failure(failed))
      if not restarted(args, run):
        return None
      seen, changed_at, stopped_at = None, time.monotonic(), None
      continue
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
        lost = lost_without_record(args, run, last_step)
        restarts.next(f"{lost}; the slice is ACTIVE: starting train.py again", lost)
        if not restarted(args, run):
          return None
        seen, changed_at, stopped_at = None, time.monotonic(), None
        continue
    if now - changed_at >= args.stall_s:
      raise TrainingFailed(f"training stalled: no new status record for {args.stall_s:g}s (last step seen: "
                           f"{last_step})", ["log (last lines):", *log_tail(args, run)])


def lost_without_record(args: argparse.Namespace, run: Runner, last_step: int | None) -> TrainingFailed:
  """train.py gone from worker 0 without a final record (its host died, it was killed, it crashed hard): the
  launcher's own `failed` record (cause host_lost) and the account, with worker 0's last log lines."""
  lines = log_tail(args, run)
  error = ("HostLost: train.py is no longer running on worker 0 and wrote no final record (its host died, "
           f"it was killed or it crashed); the last step seen was {last_step}")
  record = {"state": "failed", "time": time.time(), "step": last_step, "error": error, "cause": "host_lost",
            "reported_by": "launcher", "log_tail": lines[-run_status.LOG_TAIL_LINES:]}
  try:
    write_record(args, run, "failed", record)
  except LauncherError as e:  # the account below still says it all
    print(f"could not write the failed record: {e}", flush=True)
  return TrainingFailed(f"training failed at step {last_step}: {error}", ["log (last lines):", *lines])


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
