"""sample.py end to end: a 3-step default-task (recall) workdir, byte-level (pystdlib) and SentencePiece
(wiki40b on its generated stand-in) smoke runs of train.py sampled by sample.py as subprocesses, the one-line
errors for a missing tokenizer and a flag the task does not take; and its image grid / PNG writer."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest

from configs import default
from runtime.cli import UsageError
from tests.training import localhost
from training import loop, sample


def entry(script: str, *args: str) -> subprocess.CompletedProcess:
  """`python <script> args...` from the repository root, one CPU device, user errors as one line."""
  env = dict(os.environ, XLA_FLAGS=localhost.xla_flags(1), JAX_PLATFORMS="cpu")
  env.pop("LSA_DEBUG", None)
  return subprocess.run([sys.executable, script, *args], cwd=localhost.ROOT, env=env, text=True,
                        capture_output=True, timeout=400)


def smoke_workdir(tmp_path, config: str, *overrides: str) -> str:
  workdir = str(tmp_path / "run")
  proc = entry("train.py", "--config", config, "--workdir", workdir, *overrides)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir


def assert_usage_error(proc: subprocess.CompletedProcess, *names: str) -> None:
  """Exit 2 with one `ERROR:` line (the last on stderr; library warnings may precede it) naming `names`."""
  errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == errors[0] and "Traceback" not in proc.stderr
  assert all(name in errors[0] for name in names), errors[0]


def samples_text(workdir: str) -> str:
  (path,) = glob.glob(os.path.join(workdir, "samples_*.txt"))
  with open(path, encoding="utf-8") as f:
    return f.read()


@pytest.mark.slow  # ~25 s: trains a tiny workdir, then samples from it twice
def test_sample_recall_end_to_end(tmp_path, capsys):
  config = default.get_config("smoke")
  config.train.num_steps = 3
  config.train.checkpoint_every = 3
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(config, workdir, progress=False)
  out = sample.run(workdir, num_samples=2, temperature=1.0, top_k=5, seed=3)
  again = sample.run(workdir, num_samples=2, temperature=1.0, top_k=5, seed=3)
  np.testing.assert_array_equal(out["recalled"], again["recalled"])  # a seed fixes the samples
  assert out["recalled"].shape == out["right"].shape and out["right"].shape[0] == 2
  printed = capsys.readouterr().out
  assert "recalled" in printed and "right" in printed and "recall accuracy" in printed
  recalled = [line.split("recalled ", 1)[1].split() for line in printed.splitlines() if "recalled " in line]
  assert recalled == 2 * [sample.format_recalled(row).split() for row in out["recalled"]]  # printed twice
  assert all(v == "?" or v.isdigit() for row in recalled for v in row)  # never a negative "value"
  with pytest.raises(UsageError, match="--prompt is for language tasks"):
    sample.run(workdir, num_samples=2, prompt="def ")
  with pytest.raises(UsageError, match="--prompt_len is for image tasks"):
    sample.run(workdir, num_samples=2, prompt_len=4)


def test_format_recalled():
  # a sampled token below the value ids (a key, a query) is shown as "?", not as its negative offset
  assert sample.format_recalled(np.asarray([3, -18, 0, -49, 7])) == "3 ? 0 ? 7"


@pytest.mark.slow  # ~40 s: a pystdlib smoke run, then sample.py twice
def test_sample_bytes_end_to_end(tmp_path):
  workdir = smoke_workdir(tmp_path, "configs/pystdlib.py:smoke")
  proc = entry("sample.py", "--workdir", workdir, "--prompt", "def ", "--num_samples", "2", "--top_k", "8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  text = samples_text(workdir)
  assert text.startswith("def ") and "def " in proc.stdout
  assert "\0" not in text  # a sample ends at the NUL that separates pystdlib's files
  assert_usage_error(entry("sample.py", "--workdir", workdir, "--prompt_len", "4"), "--prompt_len", "image")
  with open(os.path.join(workdir, "metrics.json")) as f:  # a byte-level LM's evaluation in its paper's unit
    metrics = json.load(f)
  assert abs(metrics["bits_per_byte"] - metrics["loss"] / math.log(2.0)) < 1e-6


@pytest.mark.slow  # ~50 s: a wiki40b smoke run on the generated stand-in, then sample.py twice
def test_sample_smoke_text_end_to_end(tmp_path):
  no_data = tmp_path / "no_data"  # an empty data_dir: the stand-in, whatever this machine has prepared
  no_data.mkdir()
  workdir = smoke_workdir(tmp_path, "configs/wiki40b.py:smoke", f"--config.data.data_dir={no_data}")
  # words of the stand-in's vocabulary: they come back as they are only through the tokenizer the run used
  proc = entry("sample.py", "--workdir", workdir, "--prompt", "kato rime", "--num_samples", "2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "using the generated stand-in" in proc.stdout
  assert samples_text(workdir).startswith("kato rime")
  # the same workdir as a real (not smoke) run: its missing SentencePiece model is a one-line error
  real = str(tmp_path / "real")
  shutil.copytree(workdir, real)
  with open(os.path.join(real, "config.json")) as f:
    config = json.load(f)
  config["data"]["stand_in"] = False
  with open(os.path.join(real, "config.json"), "w") as f:
    json.dump(config, f)
  assert_usage_error(entry("sample.py", "--workdir", real, "--prompt", "kato"), "SentencePiece model",
                     "python -m data.prepare wiki40b")


def test_image_grid_and_png(tmp_path):
  tokens = np.arange(2 * 3 * 4 * 3).reshape(2, 36) % 256
  grid = sample.image_grid(tokens, (3, 4, 3), columns=8)
  assert grid.shape == (3, 9, 3)
  np.testing.assert_array_equal(grid[:, :4].reshape(-1), tokens[0])
  path = str(tmp_path / "g.png")
  sample.write_png(path, grid)
  data = open(path, "rb").read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  idat = data.index(b"IDAT")
  length = int.from_bytes(data[idat - 4:idat], "big")
  raw = zlib.decompress(data[idat + 4:idat + 4 + length])
  assert len(raw) == 3 * (1 + 9 * 3)
