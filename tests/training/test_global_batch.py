"""The global batch of a step does not depend on the topology: the smoke task trained as 1 process x 4
devices, 2 x 2 and 4 x 1 (jax.distributed on localhost) logs equal losses at every step, and a checkpoint a
2-process run wrote mid-run resumes as 1 process into the uninterrupted run's stream and final metrics."""

import glob
import os
import shutil
import struct

import jax
import pytest

from tests.training.localhost import finish, launch
from tests.training.smoke import smoke
from training import loop

STEPS, HALF = 6, 3
OVERRIDES = {"train.num_steps": STEPS, "train.checkpoint_every": HALF, "train.log_every": 1}
ARGS = ["--config", "configs/default.py:smoke", "--noprogress",
        *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]


def _losses(workdir: str) -> dict[int, float]:
  """step -> train/loss from the workdir's TensorBoard event files (float32, as written; later files win)."""
  from tensorboardX.proto import event_pb2

  out = {}
  for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")),
                     key=os.path.getmtime):
    with open(path, "rb") as f:
      raw = f.read()
    at = 0
    while at < len(raw):  # TFRecord framing: length, its crc, the record, its crc
      (n,) = struct.unpack("<Q", raw[at:at + 8])
      event = event_pb2.Event.FromString(raw[at + 12:at + 12 + n])
      at += 12 + n + 4
      for value in event.summary.value:
        if value.tag == "train/loss":
          out[event.step] = value.simple_value
  return out


def _train_in_process(workdir: str) -> tuple[dict, list]:
  """train.py's loop as 1 process on 4 of this process's CPU devices; returns the result and the batches'
  fingerprints per step."""
  batches = []
  with loop.testing_hooks(devices=jax.devices()[:4], batch_log=batches):
    result = loop.train_and_evaluate(smoke(**OVERRIDES), workdir, progress=False)
  return result, batches


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
  return abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.slow
def test_steps_read_the_same_examples_on_any_topology_and_resume_across_process_counts(tmp_path):
  # 2 x 2 and 4 x 1 as real processes (together: their startup overlaps), 1 x 4 meanwhile in this process.
  runs = {"2x2": launch("train.py", ARGS, str(tmp_path / "2x2"), processes=2, devices=2),
          "4x1": launch("train.py", ARGS, str(tmp_path / "4x1"), processes=4, devices=1)}
  one, one_batches = _train_in_process(str(tmp_path / "1x4"))
  for procs in runs.values():
    finish(procs)
  losses = {name: _losses(str(tmp_path / name)) for name in ("1x4", "2x2", "4x1")}
  print("losses per step:", losses)
  for name in ("2x2", "4x1"):
    assert sorted(losses[name]) == sorted(losses["1x4"]) == list(range(1, STEPS + 1)), losses
    bad = {s: (losses[name][s], losses["1x4"][s]) for s in losses["1x4"]
           if not _close(losses[name][s], losses["1x4"][s])}
    assert not bad, (name, bad)

  # The 2-process run's mid-run checkpoint (step HALF), resumed as 1 process: the same batches as the
  # uninterrupted run from step HALF on (no repeat, no gap), the same losses and final metrics.
  resumed_dir = str(tmp_path / "resumed")
  shutil.copytree(str(tmp_path / "2x2"), resumed_dir)
  shutil.rmtree(os.path.join(resumed_dir, "checkpoints", str(STEPS)))
  shutil.rmtree(os.path.join(resumed_dir, "tensorboard"))
  os.remove(os.path.join(resumed_dir, "metrics.json"))
  resumed, resumed_batches = _train_in_process(resumed_dir)
  assert resumed["start_step"] == HALF and resumed["step"] == STEPS
  assert resumed_batches == one_batches[HALF:]  # bitwise the same host batches, step by step
  after = _losses(resumed_dir)
  assert sorted(after) == list(range(HALF + 1, STEPS + 1))
  assert all(_close(after[s], losses["1x4"][s]) for s in after), (after, losses["1x4"])
  for k in ("loss", "accuracy", "num_examples"):
    assert _close(resumed["metrics"][k], one["metrics"][k]), (k, resumed["metrics"], one["metrics"])
  print("final metrics: uninterrupted 1x4", one["metrics"], "| 2x2 then 1x4", resumed["metrics"])
