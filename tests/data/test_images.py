"""tfds image sources: a dataset that is not there is "not found" with the prepare command; one whose files
are there but cannot be read says so, naming the directory to delete and prepare again."""

from __future__ import annotations

import pytest

from data import images


def test_missing_and_unreadable_datasets_are_told_apart(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"not found at .*cifar10; prepare it with: python -m data"):
    images.tfds_source("cifar10", "train", str(tmp_path), "cifar10")
  version = tmp_path / "cifar10" / "3.0.2"
  version.mkdir(parents=True)
  (version / "dataset_info.json").write_text("garbage, not JSON")
  (version / "cifar10-train.array_record-00000-of-00001").write_bytes(b"\x00garbage")
  with pytest.raises(images.UnreadableData) as e:
    images.tfds_source("cifar10", "train", str(tmp_path), "cifar10")
  message = str(e.value)
  assert "not found" not in message and "cannot be read" in message and str(version) in message
  assert "python -m data.prepare cifar10" in message
