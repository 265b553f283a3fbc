"""Image pipelines (tfds sources, generated offline): raster order, masks and bits per dimension, the optional
flip, perplexity of uniform predictions; a dataset that is not there is "not found" with the prepare command,
one whose files are there but cannot be read says so, naming the directory to delete and prepare again."""

from __future__ import annotations

import math

import numpy as np
import pytest

import data
from data import images, testing
from models import metrics
from tests.data.readers import data_config, split_batches


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


@pytest.mark.parametrize("name,shape", [("cifar10", (32, 32, 3)), ("imagenet64", (64, 64, 3))])
def test_images_raster_order_masks_and_bits_per_dim(tmp_path, name, shape):
  import tensorflow_datasets as tfds

  from data import images

  with testing.mock_data(name, tmp_path, num_examples=6) as dd:
    config = data_config(name, dd)
    info = data.dataset_info(config)
    batches = split_batches(config, batch_size=4)
    tfds_name, _, splits, _ = images.SPECS[name]
    source = tfds.data_source(tfds_name, split=splits["validation"])
    first = images.fit_image(source[0]["image"], shape)
  assert info.task == "image" and info.vocab_size == 256 and info.seq_len == math.prod(shape)
  assert info.bos_id == 256 and info.input_vocab_size == 257
  assert len(batches) == 2  # 6 records, batch 4: the last batch is padded
  b = batches[0]
  assert b["inputs"].shape == (4, info.seq_len) and b["inputs"].dtype == np.int32
  assert b["mask"].dtype == bool and b["weights"].dtype == np.float32 and b["segment_ids"].dtype == np.int32
  assert b["inputs"].min() >= 0 and b["inputs"].max() <= 255
  # Raster order, channels innermost: token 3*(r*W + c) + ch is pixel (r, c) channel ch.
  np.testing.assert_array_equal(b["inputs"][0], first.reshape(-1))
  r, c, ch = shape[0] - 1, 1, 2
  assert b["inputs"][0, 3 * (r * shape[1] + c) + ch] == first[r, c, ch]
  last = batches[-1]
  np.testing.assert_array_equal(last["valid"], [True, True, False, False])
  assert not last["mask"][2:].any() and not last["weights"][2:].any() and last["mask"][:2].all()
  # Bits/dim bookkeeping: uniform predictions cost exactly 8 bits per sub-pixel, counted over real rows only.
  totals = {"nll_sum": 0.0, "weight_sum": 0.0}
  for batch in batches:
    logits = np.zeros(batch["inputs"].shape + (info.vocab_size,), np.float32)
    _, sums = metrics.loss_and_sums("image", logits, batch)
    totals = {k: totals[k] + float(sums[k]) for k in totals}
  assert totals["weight_sum"] == 6 * info.seq_len
  assert metrics.summarize("image", totals)["bits_per_dim"] == pytest.approx(8.0, rel=1e-6)


def test_image_flip_is_off_by_default_and_mirrors_when_on():
  from data import images

  rng = np.random.default_rng(1)
  img = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
  seen = set()
  fn = images._ImageFn((4, 5, 3), flip=True)
  for seed in range(20):
    out = fn({"image": img}, np.random.default_rng(seed))["inputs"].reshape(4, 5, 3)
    if np.array_equal(out, img):
      seen.add("same")
    else:
      np.testing.assert_array_equal(out, img[:, ::-1])
      seen.add("flipped")
  assert seen == {"same", "flipped"}
  off = images._ImageFn((4, 5, 3), flip=False)
  for seed in range(5):
    np.testing.assert_array_equal(off({"image": img}, np.random.default_rng(seed))["inputs"], img.reshape(-1))
  with pytest.raises(ValueError, match="seq_len must be 3072"):
    data.dataset_info(data_config("cifar10", seq_len=1024))


def test_metrics_perplexity_of_uniform_predictions():
  rng = np.random.default_rng(0)
  targets = rng.integers(0, 50, (3, 7))
  weights = (rng.random((3, 7)) < 0.6).astype(np.float32)
  batch = {"inputs": targets, "weights": weights}
  _, sums = metrics.loss_and_sums("lm", np.zeros((3, 7, 50), np.float32), batch)
  assert float(sums["weight_sum"]) == weights.sum()
  assert metrics.summarize("lm", sums)["perplexity"] == pytest.approx(50.0, rel=1e-6)
  logits = rng.normal(size=(3, 7, 50)).astype(np.float32)
  _, sums = metrics.loss_and_sums("lm", logits, batch)
  logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  want = -(np.take_along_axis(logp, targets[..., None], -1)[..., 0] * weights).sum()
  assert float(sums["nll_sum"]) == pytest.approx(want, rel=1e-5)
