"""The `pystdlib` corpus: a deterministic split by file, every file in one split, bytes kept exactly."""

from __future__ import annotations

import os

import ml_collections
import numpy as np
import pytest

import data
from data import pystdlib


@pytest.fixture
def tree(tmp_path):
  """A small source tree (with a site-packages directory the corpus leaves out)."""
  rng = np.random.default_rng(0)
  files = {}
  for i in range(60):
    rel = f"pkg{i % 4}/mod_{i}.py" if i % 3 else f"top_{i}.py"
    files[rel] = bytes(rng.integers(1, 256, size=int(rng.integers(10, 300)), dtype=np.uint8))
  files["site-packages/ignored.py"] = b"x = 1\n"
  files["pkg0/notes.txt"] = b"not python"
  for rel, body in files.items():
    os.makedirs(os.path.dirname(os.path.join(tmp_path, rel)) or tmp_path, exist_ok=True)
    with open(os.path.join(tmp_path, rel), "wb") as f:
      f.write(body)
  return str(tmp_path), {k: v for k, v in files.items() if k.endswith(".py") and "site-packages" not in k}


def test_split_is_by_file_deterministic_and_disjoint(tree):
  root, files = tree
  splits = pystdlib.split_files(root)
  assert splits == pystdlib.split_files(root)
  listed = [f for s in pystdlib.SPLITS for f in splits[s]]
  assert sorted(listed) == sorted(files)  # every file once; site-packages and non-.py files left out
  assert len(set(listed)) == len(listed)
  for split, names in splits.items():
    assert all(pystdlib.file_split(n) == split for n in names)  # a function of the relative path alone
  assert pystdlib.file_split("json/decoder.py") == pystdlib.file_split("json/decoder.py")


def test_bytes_round_trip(tree):
  root, files = tree
  for split in pystdlib.SPLITS:
    stream = pystdlib.split_bytes(root, split).tobytes()
    want = b"".join(files[n] + pystdlib.SEPARATOR for n in pystdlib.split_files(root)[split])
    assert stream == want
  seq_len = 32
  source = pystdlib.WindowSource(root, "train", seq_len)
  joined = b"".join(source[i].tobytes() for i in range(len(source)))
  assert joined == pystdlib.split_bytes(root, "train").tobytes()[:len(source) * seq_len]


def test_batches_and_info(tree):
  root, _ = tree
  c = ml_collections.ConfigDict({"data": {"name": "pystdlib", "seq_len": 16, "stdlib_dir": root}})
  info = data.dataset_info(c)
  assert (info.task, info.vocab_size, info.bos_id) == ("lm", 256, 256)
  assert info.version == f"sources at {root}"
  batch = next(iter(data.create_dataset(c, "validation", batch_size=4, seed=0, shard_index=0, shard_count=1)))
  assert batch["inputs"].shape == (4, 16) and batch["inputs"].max() < 256
  default = ml_collections.ConfigDict({"data": {"name": "pystdlib", "seq_len": 16}})
  assert data.dataset_info(default).version.startswith("python ")
