"""train.py when the storage refuses a checkpoint: a real filesystem that fills during a save.

Where the test can make one, the workdir is on a small tmpfs mounted in a private mount namespace (`unshare`,
as root or through a user namespace), nearly filled by another file: a save runs out of space (ENOSPC), and
deleting that file is freeing space. Elsewhere a real limit of another kind stands in: RLIMIT_FSIZE, the
largest file the process may write, below the size of a checkpoint's data file (EFBIG), so no save completes.
Our save code is not patched. The run stops with exit 1 and at most 3 lines after the last training line, one
of them the ERROR line naming the checkpoints directory, the OS error and the last intact step; failed.json
records the same; the half-written step is gone and the intact ones untouched; after space is freed, the rerun
resumes from the last intact step and ends with the uninterrupted run's final metrics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.training.localhost import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 20
ARGS = ["train.py", "--config", "configs/default.py:smoke", f"--config.train.num_steps={STEPS}",
        "--config.train.checkpoint_every=5", "--config.train.log_every=5", "--noprogress"]
TMPFS_KB, FILLER_KB = 4096, 3300  # about 800 KB free: one checkpoint of the smoke model (~440 KB), not two
# One CPU device: the checkpoints' sizes the free space is chosen for.
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
FSIZE_LIMIT = 64 * 1024  # bytes; a checkpoint's largest data file is larger

# Inside the private mount namespace: the tmpfs, the filler, the run, the filler removed, the rerun; what the
# test reads is copied out of the mount first.
DRIVER = r'''
set -u
mount -t tmpfs -o size={tmpfs_kb}k tmpfs "$MNT" || exit 90
head -c {filler_kb}k /dev/zero > "$MNT/filler"
cd "$ROOT"
"$PYTHON" {args} --workdir "$MNT/run" > "$OUT/first.log" 2>&1; echo $? > "$OUT/first.rc"
ls "$MNT/run/checkpoints" > "$OUT/checkpoints_after_first"
cp -r "$MNT/run/status" "$OUT/status_after_first"
(cd "$MNT/run/checkpoints" && find . -type f -exec sha1sum {{}} + | sort -k 2) > "$OUT/intact_files_before"
rm "$MNT/filler"
"$PYTHON" {args} --workdir "$MNT/run" > "$OUT/second.log" 2>&1; echo $? > "$OUT/second.rc"
cp "$MNT/run/metrics.json" "$OUT/" 2>/dev/null
exit 0
'''


def _namespace(directory) -> list[str] | None:
  """The unshare command under which this process can mount a tmpfs of its own on `directory`, or None."""
  if shutil.which("unshare") is None:
    return None
  for cmd in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
    probe = subprocess.run([*cmd, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)],
                           capture_output=True)
    if probe.returncode == 0:
      return cmd
  return None


def _after_last_training_line(log: str) -> list[str]:
  lines = log.rstrip("\n").splitlines()
  last = max(i for i, line in enumerate(lines) if re.match(r"step \d+: loss=", line))
  return lines[last + 1:]


def _uninterrupted(tmp_path) -> dict:
  workdir = str(tmp_path / "straight")
  subprocess.run([sys.executable, *ARGS, "--workdir", workdir], cwd=ROOT, check=True, capture_output=True,
                 timeout=600, env=dict(os.environ, **ENV))
  with open(os.path.join(workdir, "metrics.json")) as f:
    return {k: v for k, v in json.load(f).items() if k != "start_step"}


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_rerun_resumes(tmp_path):
  mnt, out = tmp_path / "mnt", tmp_path / "out"
  mnt.mkdir()
  out.mkdir()
  ns = _namespace(mnt)
  if ns is None:
    _fallback_file_size_limit(tmp_path)
    return
  script = DRIVER.format(tmpfs_kb=TMPFS_KB, filler_kb=FILLER_KB, args=" ".join(ARGS))
  env = dict(os.environ, **ENV, MNT=str(mnt), OUT=str(out), ROOT=ROOT, PYTHON=sys.executable)
  done = subprocess.run([*ns, "bash", "-c", script], env=env, capture_output=True, text=True, timeout=1200)
  assert done.returncode == 0, done.stderr[-3000:]
  first = (out / "first.log").read_text()
  assert (out / "first.rc").read_text().strip() == "1", first[-3000:]

  # The account: one ERROR line, at most 3 lines after the last training line.
  after = _after_last_training_line(first)
  print("after the last training line:", *after, sep="\n  ")
  errors = [line for line in after if line.startswith("ERROR: ")]
  assert len(after) <= 3 and len(errors) == 1, after
  m = re.fullmatch(rf"ERROR: writing a checkpoint to {mnt}/run/checkpoints failed: \[Errno 28\] No space "
                   r"left on device; half-written step (\d+) removed; the last intact checkpoint is step "
                   r"(\d+): free space \(or fix the storage\) and rerun to resume from it", errors[0])
  assert m, errors[0]
  half, intact = int(m.group(1)), int(m.group(2))
  assert 0 < intact < half < STEPS
  failed = json.loads((out / "status_after_first" / "failed.json").read_text())
  assert failed["error"] == "CheckpointWriteFailed: " + errors[0][len("ERROR: "):]
  assert (failed["cause"], failed["os_error"], failed["last_intact_step"]) == (
      "checkpoint_write", "[Errno 28] No space left on device", intact)
  assert failed["checkpoint_dir"] == f"{mnt}/run/checkpoints"
  # The half-written step is gone; the intact ones stay (their files hashed before the rerun).
  left = (out / "checkpoints_after_first").read_text().split()
  assert str(half) not in " ".join(left) and str(intact) in left and not any("tmp" in n for n in left), left
  assert (out / "intact_files_before").read_text().strip()

  # After freeing space the rerun resumes from the last intact step and ends as the uninterrupted run.
  second = (out / "second.log").read_text()
  assert (out / "second.rc").read_text().strip() == "0", second[-3000:]
  assert f"resumed from {mnt}/run/checkpoints at step {intact}" in second, second[-3000:]
  resumed = json.loads((out / "metrics.json").read_text())
  assert resumed.pop("start_step") == intact
  assert resumed == _uninterrupted(tmp_path)


def _fallback_file_size_limit(tmp_path) -> None:
  """No tmpfs to be had: RLIMIT_FSIZE makes every checkpoint's largest file too large to write (EFBIG)."""
  import resource

  workdir = str(tmp_path / "run")

  def limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))

  first = subprocess.run([sys.executable, *ARGS, "--workdir", workdir], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, preexec_fn=limit, env=dict(os.environ, **ENV))
  log = first.stdout + first.stderr
  assert first.returncode == 1, log[-3000:]
  after = _after_last_training_line(first.stdout + first.stderr)
  errors = [line for line in after if line.startswith("ERROR: ")]
  assert len(after) <= 3 and len(errors) == 1, after
  assert errors[0].startswith(f"ERROR: writing a checkpoint to {workdir}/checkpoints failed: [Errno 27] File "
                              "too large; "), errors[0]
  assert errors[0].endswith("no checkpoint was completed: free space (or fix the storage) and rerun to start "
                            "again"), errors[0]
  failed = json.loads(open(os.path.join(workdir, "status", "failed.json")).read())
  assert failed["cause"] == "checkpoint_write" and failed["last_intact_step"] is None
  assert not any("tmp" in n for n in os.listdir(os.path.join(workdir, "checkpoints")))
  second = subprocess.run([sys.executable, *ARGS, "--workdir", workdir], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, **ENV))
  assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
  with open(os.path.join(workdir, "metrics.json")) as f:
    resumed = {k: v for k, v in json.load(f).items() if k != "start_step"}
  assert resumed == _uninterrupted(tmp_path)


QUIET_TASKS = r'''
import asyncio, gc, logging, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(format="%(message)s")
from training import checkpoints
checkpoints._quiet_failed_writes()

async def write(error):
  raise error

async def main():
  tasks = [asyncio.get_running_loop().create_task(write(e)) for e in (
      OSError(28, "No space left on device"), ValueError("a bug, not the storage"))]
  await asyncio.sleep(0.01)
  tasks.clear()
  gc.collect()

asyncio.run(main())
gc.collect()
'''


def test_unretrieved_write_tasks_of_a_failed_save_log_nothing_more():
  """A save's write tasks that fail with the storage's error and whose exceptions nobody retrieves (orbax's,
  when the save is abandoned) log nothing beside the run's one-line report; another error still logs."""
  done = subprocess.run([sys.executable, "-c", QUIET_TASKS, ROOT], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr
  assert done.stderr.count("Task exception was never retrieved") == 1, done.stderr
  assert "a bug, not the storage" in done.stderr and "No space left" not in done.stderr, done.stderr
