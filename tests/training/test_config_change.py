"""train.py resumed with a config whose model has other parameter shapes (`--allow_config_change`): the
checkpoints are whole, so none is damaged or set aside; the start is refused with one `ERROR:` line naming
the step, the first parameter that differs and both shapes (exit 2), and the original config resumes from
the last step. Real train.py subprocesses on one CPU device."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from tests.training.localhost import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 4 steps, a checkpoint every 2: steps 2 and 4.
ARGS = ["--config.train.num_steps=4", "--config.train.checkpoint_every=2", "--config.train.eval_batches=1",
        "--noprogress"]


def _train(workdir, config, *flags):
  cmd = [sys.executable, "-u", "train.py", "--config", config, "--workdir", str(workdir), *ARGS, *flags]
  env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
  env.pop("LSA_DEBUG", None)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _contents(top):
  """Every file under `top` by relative path, with the SHA-1 of its bytes."""
  def digest(path):
    with open(path, "rb") as f:
      return hashlib.sha1(f.read()).hexdigest()
  return {os.path.relpath(os.path.join(r, f), top): digest(os.path.join(r, f))
          for r, _, fs in os.walk(top) for f in fs}


@pytest.mark.slow  # ~15 s: three short train.py runs
def test_a_shape_changing_config_is_refused_and_nothing_is_set_aside(tmp_path):
  workdir = tmp_path / "run"
  first = _train(workdir, "configs/default.py:smoke")
  assert first.returncode == 0, first.stdout + first.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
  before = _contents(workdir)

  changed = _train(workdir, "configs/default.py:smoke,features=64", "--allow_config_change")
  assert changed.returncode == 2, changed.stdout + changed.stderr
  assert "Traceback" not in changed.stderr and "Exception ignored" not in changed.stderr, changed.stderr
  err = changed.stderr.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("ERROR: "), changed.stderr
  shape = r"\(\d+(, \d+)*\) float32"
  assert re.match(rf"ERROR: checkpoint {re.escape(str(workdir))}/checkpoints/4 \(step 4\) was written for "
                  rf"other parameter shapes: params/\S+ is {shape} there, {shape} in the model this config "
                  r"builds\. --allow_config_change cannot change the shapes of parameters", err[0]), err[0]
  assert "does not restore" not in changed.stdout + changed.stderr
  # Nothing moved or rewritten: the only new file is the failed start's record, as for any refused start in
  # a run's workdir.
  assert not (workdir / "unrestorable_checkpoints").exists()
  after = _contents(workdir)
  assert set(after) - set(before) == {"status/failed.json"}
  assert {k: v for k, v in after.items() if k in before} == before
  failed = json.loads((workdir / "status" / "failed.json").read_text())
  assert failed["error"] == "CheckpointMismatch: " + err[0][len("ERROR: "):]

  again = _train(workdir, "configs/default.py:smoke")
  assert again.returncode == 0, again.stdout + again.stderr
  assert f"resumed from {workdir}/checkpoints at step 4" in again.stdout
  assert json.loads((workdir / "metrics.json").read_text())["start_step"] == 4
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
