"""Image density estimation: CIFAR-10 (3072 tokens) and downsampled ImageNet 64x64 (12288 tokens).

Each image becomes one sequence of sub-pixels in raster order with the channels innermost (R, G, B of pixel
(0, 0), then pixel (0, 1), ...), values 0..255 as tokens (vocabulary 256). The metric is bits/dim over all
sub-pixels (`models.metrics.summarize`). ImageNet-64 is tfds `downsampled_imagenet/64x64`, the set the
papers use (not `imagenet_resized`). Random horizontal flip is available (`config.data.random_flip`) but off
by default: the paper trains without augmentation. `config.data.image_shape` (default: the dataset's own)
resizes every image (nearest) to a smaller grid, e.g. the 8x8 images of the smoke variants.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from data import pipeline
from data.info import DatasetInfo
from runtime import cli, paths

# name -> (tfds name, image shape, {our split: tfds split}, known record counts)
SPECS: dict[str, tuple[str, tuple[int, int, int], dict[str, str], dict[str, int]]] = {
  "cifar10": ("cifar10", (32, 32, 3), {"train": "train", "validation": "test", "test": "test"},
              {"train": 50_000, "test": 10_000}),
  "imagenet64": ("downsampled_imagenet/64x64", (64, 64, 3),
                 {"train": "train", "validation": "validation", "test": "validation"},
                 {"train": 1_281_149, "validation": 49_999}),
}

_RESIZED = pipeline.Counter("images resized to config.data.image_shape (or mock images to the dataset's)")


def tfds_split(table: dict[str, str], split: str) -> str:
  """Our split name -> the tfds split; tfds slicing syntax ("train[:1000]") passes through."""
  base, sep, rest = split.partition("[")
  if base not in table:
    raise cli.mark_usage(ValueError(f"split must be one of {sorted(table)} (optionally sliced, e.g. "
                                    f"'train[:1000]'), got {split!r}"))
  return table[base] + sep + rest


class UnreadableData(OSError, cli.UsageError):
  """Dataset files that are there but cannot be read (damaged, truncated, not tfds's): the message names the
  directory and how to prepare it again."""


def _prepared_versions(tfds_name: str, data_dir: str | None) -> list[Any]:
  """The version directories of a prepared tfds dataset (those holding dataset_info.json)."""
  root = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  try:
    base = paths.path(os.path.expanduser(root)) / tfds_name
    return sorted(p.parent for p in base.glob("*/dataset_info.json")) if base.exists() else []
  except Exception:  # an unreachable bucket: reported as missing, with tfds's error as the cause
    return []


def tfds_source(tfds_name: str, split: str, data_dir: str | None, dataset: str):
  """`tfds.data_source` (ArrayRecord, random access, no TensorFlow), with an actionable error when missing
  (FileNotFoundError) or there but unreadable (UnreadableData)."""
  import tensorflow_datasets as tfds

  try:
    return tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=False)
  except Exception as e:  # tfds raises several types (AssertionError, FileNotFoundError, DatasetNotFound...)
    what = f"tfds dataset {tfds_name} (split {split})"
    versions = _prepared_versions(tfds_name, data_dir)
    if versions:
      reason = " ".join(str(e).split())[:300]
      raise UnreadableData(
        f"{what} for {dataset!r} is at {versions[-1]} but cannot be read ({type(e).__name__}: {reason}); its "
        f"files are damaged or incomplete: delete {versions[-1]} and prepare it again with: python -m "
        f"data.prepare {dataset} --data_dir {data_dir or 'DIR'}") from e
    where = f"{data_dir or '~/tensorflow_datasets'}/{tfds_name}"
    raise pipeline.missing(where, dataset, data_dir, what=what) from e


def fit_image(image: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
  """Returns `image` [H, W, C] uint8 with exactly `shape`; other sizes are resized (nearest) and counted."""
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[:, :, None]
  if image.shape[2] != shape[2]:
    if image.shape[2] == 1:
      image = np.repeat(image, shape[2], axis=2)
    else:
      raise ValueError(f"image has {image.shape[2]} channels, the dataset needs {shape[2]}")
  if image.shape[:2] != shape[:2]:
    _RESIZED.add("resized", detail=f"{image.shape[:2]} -> {shape[:2]}")
    rows = (np.arange(shape[0]) * image.shape[0]) // shape[0]
    cols = (np.arange(shape[1]) * image.shape[1]) // shape[1]
    image = image[rows][:, cols]
  return image.astype(np.uint8, copy=False)


def image_example(image: np.ndarray) -> dict[str, np.ndarray]:
  """[H, W, C] uint8 -> the `image` task example (raster order, channels innermost)."""
  tokens = image.reshape(-1).astype(np.int32)  # [H*W*C]
  length = tokens.shape[0]
  return {
    "inputs": tokens,
    "mask": np.ones(length, bool),
    "weights": np.ones(length, np.float32),
    "segment_ids": np.ones(length, np.int32),
  }


def _spec(config: Any):
  name = config.data.name
  if name not in SPECS:
    raise ValueError(f"data.images handles {sorted(SPECS)}, got {name!r}")
  return SPECS[name]


def image_shape(config: Any) -> tuple[int, int, int]:
  """(height, width, channels) of the examples: `config.data.image_shape`, default the dataset's own."""
  _, shape, _, _ = _spec(config)
  want = pipeline.cfg_get(config, "image_shape")
  if want is None:
    return shape
  want = tuple(int(s) for s in want)
  if len(want) != 3 or want[2] != shape[2] or min(want) < 1:
    raise ValueError(f"config.data.image_shape must be (height, width, {shape[2]}), got {want}")
  return want


def dataset_info(config: Any) -> DatasetInfo:
  _, _, _, sizes = _spec(config)
  shape = image_shape(config)
  seq_len = shape[0] * shape[1] * shape[2]
  want = pipeline.cfg_get(config, "seq_len", seq_len)
  if want != seq_len:
    raise ValueError(f"config.data.seq_len must be {seq_len} for {config.data.name} ({shape}), got {want}")
  return DatasetInfo(
    name=config.data.name, task="image", vocab_size=256, seq_len=seq_len, input_vocab_size=257, bos_id=256,
    image_shape=shape, metric="bits_per_dim", split_sizes=dict(sizes),
  )


class _ImageFn:
  def __init__(self, shape: tuple[int, int, int], flip: bool):
    self.shape = shape
    self.flip = flip

  def __call__(self, record: dict[str, Any],
               rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    image = fit_image(record["image"], self.shape)
    if self.flip and rng.random() < 0.5:
      image = image[:, ::-1]
    return image_example(image)


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index=None, shard_count=None,
                   shuffle=None, num_epochs=None):
  tfds_name, _, splits, _ = _spec(config)
  shape = dataset_info(config).image_shape  # validates seq_len
  data_dir = pipeline.cfg_get(config, "data_dir")
  source = tfds_source(tfds_name, tfds_split(splits, split), data_dir, config.data.name)
  flip = bool(pipeline.cfg_get(config, "random_flip", False)) and split.startswith("train")
  fn = _ImageFn(shape, flip)
  # A per-record generator costs more than the image itself: only draw one when flipping.
  op = pipeline.SeededExample(fn) if flip else pipeline.Example(fn)
  return pipeline.make_loader(
    source, [op], split=split.partition("[")[0], batch_size=batch_size, seed=seed, shard_index=shard_index,
    shard_count=shard_count, shuffle=shuffle, num_epochs=num_epochs, config=config,
  )
