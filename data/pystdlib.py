"""`pystdlib`: byte-level language modeling on the Python standard library's own `.py` sources.

A real corpus every machine has offline (about 30 MB in 1,800 files for CPython 3.11): the `.py` files
under `sysconfig.get_paths()["stdlib"]` (or `config.data.stdlib_dir`), without site-packages/dist-packages.
Each file goes wholly to one split, chosen by a hash of its path relative to the root (SHA-256, so the same
file lands in the same split on every machine and Python build): about 90% train, 5% validation, 5% test
(`SPLIT_PERCENT`).
A split is its files' bytes concatenated in sorted path order, each file followed by one NUL byte (which no
source file contains) so a model sees where files end; records are consecutive non-overlapping windows of
`seq_len` bytes (the last partial window dropped). Tokens are the bytes (vocabulary 256, `bos_id` 256); the
metric is bits per byte (the loss in nats / ln 2). The Python version the sources come from is
`DatasetInfo.version` (results quote it: the corpus changes with the Python release).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from typing import Any

import numpy as np

from data import pipeline, records
from data.info import DatasetInfo
from runtime import cli

NAME = "pystdlib"
SPLITS = ("train", "validation", "test")
SPLIT_PERCENT = {"train": 90, "validation": 5, "test": 5}
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
SEPARATOR = b"\0"


def stdlib_dir(config: Any | None = None) -> str:
  """The root holding the sources: `config.data.stdlib_dir`, default this interpreter's standard library."""
  explicit = pipeline.cfg_get(config, "stdlib_dir") if config is not None else None
  return os.path.expanduser(explicit or sysconfig.get_paths()["stdlib"])


def version(config: Any | None = None) -> str:
  """"python <version>" for this interpreter's library, else the configured root (its version is unknown)."""
  explicit = pipeline.cfg_get(config, "stdlib_dir") if config is not None else None
  return f"python {platform.python_version()}" if not explicit else f"sources at {explicit}"


def file_split(relpath: str) -> str:
  """The split of the file at `relpath` (posix, relative to the root): a function of the path alone."""
  bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % 100
  if bucket < SPLIT_PERCENT["train"]:
    return "train"
  return "validation" if bucket < SPLIT_PERCENT["train"] + SPLIT_PERCENT["validation"] else "test"


def list_files(root: str) -> list[str]:
  """Every `.py` file under `root` as a sorted posix path relative to it (site-packages etc. left out)."""
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
    rel = os.path.relpath(dirpath, root)
    for f in filenames:
      if f.endswith(".py"):
        out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
  return sorted(out)


def split_files(root: str) -> dict[str, list[str]]:
  """{split: its files, sorted}; every file in exactly one split."""
  out: dict[str, list[str]] = {s: [] for s in SPLITS}
  for rel in list_files(root):
    out[file_split(rel)].append(rel)
  return out


_STREAMS: dict[tuple[str, str], np.ndarray] = {}


def split_bytes(root: str, split: str) -> np.ndarray:
  """The split's byte stream: its files in order, each followed by NUL; uint8 [total bytes] (cached)."""
  if split not in SPLITS:
    raise cli.mark_usage(ValueError(f"pystdlib split must be one of {SPLITS}, got {split!r}"))
  key = (root, split)
  if key not in _STREAMS:
    if not os.path.isdir(root):
      raise FileNotFoundError(f"Python sources for 'pystdlib' not found at {root}; "
                              "set config.data.stdlib_dir")
    parts = []
    for rel in split_files(root)[split]:
      with open(os.path.join(root, rel), "rb") as f:
        parts.append(f.read())
      parts.append(SEPARATOR)
    _STREAMS[key] = np.frombuffer(b"".join(parts), np.uint8)
  return _STREAMS[key]


class WindowSource(records.StreamWindows):
  """Record i = bytes [i * seq_len, (i + 1) * seq_len) of a split's stream: uint8 [seq_len]."""

  def __init__(self, root: str, split: str, seq_len: int):
    self.root, self.split = root, split
    super().__init__(seq_len, len(split_bytes(root, split)))

  def stream(self) -> np.ndarray:
    return split_bytes(self.root, self.split)

  def __repr__(self) -> str:  # grain compares it on restore
    return f"PyStdlib({self.root}, {self.split}, seq_len={self.seq_len}, records={self.size})"


def lm_example(window: np.ndarray) -> dict[str, np.ndarray]:
  """A window of byte ids as the LM batch layout (every position real and predicted)."""
  length = window.shape[0]
  return {
    "inputs": window.astype(np.int32),  # [L]
    "mask": np.ones(length, bool),
    "weights": np.ones(length, np.float32),
    "segment_ids": np.ones(length, np.int32),
  }


def dataset_info(config: Any) -> DatasetInfo:
  seq_len = int(pipeline.cfg_get(config, "seq_len", 2048))
  return DatasetInfo(name=NAME, task="lm", vocab_size=256, seq_len=seq_len, input_vocab_size=257, bos_id=256,
                     metric="bits_per_byte", version=version(config))


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index=None, shard_count=None,
                   shuffle=None, num_epochs=None):
  seq_len = dataset_info(config).seq_len
  source = WindowSource(stdlib_dir(config), split, seq_len)
  return pipeline.make_loader(
    source, [pipeline.Example(lm_example)], split=split, batch_size=batch_size, seed=seed,
    shard_index=shard_index, shard_count=shard_count, shuffle=shuffle, num_epochs=num_epochs, config=config,
  )
