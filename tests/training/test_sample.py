"""sample.py end to end on a 3-step default-task workdir, and its image grid / PNG writer."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from configs import default
from training import loop, sample


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
