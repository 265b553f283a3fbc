"""Long Range Arena: ListOps, Text, Retrieval, Image, Pathfinder, read from the official release.

Sources:
  lra_listops    {lra}/listops-1000/basic_{train,val,test}.tsv (header `Source<TAB>Target`); parentheses are
                 dropped like the LRA input pipeline (`config.data.listops_parens=True` keeps them); seq_len
                 2000.
  lra_text       tfds `imdb_reviews/plain_text`, byte level (UTF-8 bytes 0..255). Default seq_len 4000, the
                 length of the LRA paper's Text task; LRA's own released config uses 1000 for some models:
                 set `config.data.seq_len=1000` for that variant. Evaluation uses the test split (LRA has no
                 separate validation split for Text).
  lra_retrieval  {lra}/tsv_data/new_aan_pairs.{train,eval,test}.tsv (label, id1, id2, text1, text2), byte
                 level, seq_len 4000 per document, two towers (inputs1/inputs2).
  lra_image      tfds `cifar10` as 8-bit grayscale (ITU-R 601 luma, as tf.image.rgb_to_grayscale), 1024
                 tokens.
  lra_pathfinder {lra}/pathfinder32/<difficulty>/metadata/*.npy (text files despite the suffix: one line per
                 image, `imgs/<d> sample_<n>.png <x> <label> ...`), PNGs under the same directory;
                 difficulty `curv_contour_length_14` (hard) by default. Splits by metadata file, in numeric
                 order: the first 80% train, next 10% validation, last 10% test.
where {lra} is found under `config.data.lra_dir` or else `config.data.data_dir` (the TFDS data directory,
which also holds imdb_reviews and cifar10): the archive unpacked there as `lra_release/...` or
`lra_release/lra_release/...` (it nests one level), or the directory given being the release itself.

lra_text and lra_image read their tfds split into memory once, and lra_listops keeps the token ids its
validation pass parses, when the split fits `config.data.cache_in_memory` (MB, default 512; 0 reads every
record from disk each time).

Malformed rows (wrong field count, unknown token, bad label, missing image) raise ValueError naming file and
line; with `config.data.skip_malformed=True` they are skipped and counted in the log. Over-long inputs are
truncated to seq_len and counted in the log.
"""

from __future__ import annotations

import glob
import io
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from data import images, listops, pipeline
from data.info import DatasetInfo
from runtime import cli

log = logging.getLogger("data")

NAMES = ("lra_listops", "lra_text", "lra_retrieval", "lra_image", "lra_pathfinder")
DEFAULT_SEQ_LEN = {"lra_listops": 2000, "lra_text": 4000, "lra_retrieval": 4000, "lra_image": 1024,
                   "lra_pathfinder": 1024}
LISTOPS_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}
RETRIEVAL_FILES = {"train": "new_aan_pairs.train.tsv", "validation": "new_aan_pairs.eval.tsv",
                   "test": "new_aan_pairs.test.tsv"}
PATHFINDER_DIFFICULTIES = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")
# Published record counts (for data.prepare's verification).
SPLIT_SIZES = {
  "lra_listops": {"train": 96_000, "validation": 2_000, "test": 2_000},
  "lra_text": {"train": 25_000, "test": 25_000},
  "lra_retrieval": {"train": 147_086, "validation": 18_090, "test": 17_437},
  "lra_image": {"train": 50_000, "test": 10_000},
  "lra_pathfinder": {"train": 160_000, "validation": 20_000, "test": 20_000},
}


def lra_root(config: Any) -> str:
  """The directory holding listops-1000/, tsv_data/, pathfinder32/ (either nesting of the archive)."""
  explicit = pipeline.cfg_get(config, "lra_dir")
  data_dir = pipeline.cfg_get(config, "data_dir", "~/tensorflow_datasets")
  base = os.path.expanduser(explicit or os.path.join(data_dir, "lra_release"))
  # Also accept data_dir pointing at the unpacked release itself.
  top = os.path.expanduser(explicit or data_dir)
  for cand in (os.path.join(base, "lra_release"), base, os.path.join(top, "lra_release"), top):
    if any(os.path.isdir(os.path.join(cand, d)) for d in ("listops-1000", "tsv_data", "pathfinder32")):
      return cand
  return base


def _need(path: str, config: Any) -> str:
  if not os.path.exists(path):
    raise pipeline.missing(path, config.data.name, pipeline.cfg_get(config, "data_dir"), what="LRA file")
  return path


class Malformed:
  """Applies the malformed-row policy: raise naming file:line, or skip and count."""

  def __init__(self, config: Any):
    self.skip = bool(pipeline.cfg_get(config, "skip_malformed", False))
    self.counter = pipeline.Counter(f"{config.data.name}: malformed rows skipped", every=100)
    self.skipped = 0

  def __call__(self, path: str, lineno: int, reason: str) -> None:
    message = f"{path}:{lineno}: {reason}"
    if not self.skip:
      raise ValueError(message + " (set config.data.skip_malformed=True to skip such rows with a logged "
                       "count)")
    self.skipped += 1
    if self.skipped <= 20:  # each of the first rows by location, then a running count
      log.warning("skipping malformed row %s", message)
    else:
      self.counter.add("skipped after the first 20", detail=message)


class TsvSource:
  """Random access to the valid lines of a tab-separated file, by byte offset (the file stays on disk).

  Every line is checked once at construction with `parse`, which returns the record or raises ValueError.
  `keep`: when given, `keep(record)` of every valid line is held in memory from that same pass and served
  instead of re-reading and re-parsing the line (for files whose kept form is small: ListOps token ids).
  """

  def __init__(self, path: str, parse: Callable[[list[str]], Any], *, malformed: Malformed,
               header: str | None, keep: Callable[[Any], Any] | None = None):
    self.path = path
    self.parse = parse
    self.kept: list[Any] | None = [] if keep is not None else None
    offsets, lengths = [], []
    with open(path, "rb") as f:
      offset = 0
      for lineno, raw in enumerate(f, start=1):
        line = raw.rstrip(b"\r\n")
        text = line.decode("utf-8", errors="replace")
        if lineno == 1 and header is not None and text.split("\t")[0] == header:
          offset += len(raw)
          continue
        if not line.strip():
          malformed(path, lineno, "empty line")
        else:
          try:
            record = parse(text.split("\t"))
          except ValueError as e:
            malformed(path, lineno, str(e))
          else:
            offsets.append(offset)
            lengths.append(len(line))
            if keep is not None:
              self.kept.append(keep(record))
        offset += len(raw)
    if malformed.skipped:
      log.warning("%s: skipped %d malformed rows, kept %d", path, malformed.skipped, len(offsets))
    self.offsets = np.asarray(offsets, np.int64)
    self.lengths = np.asarray(lengths, np.int64)
    self._fd: int | None = None

  def __len__(self) -> int:
    return len(self.offsets)

  def __getitem__(self, index: int):
    if self.kept is not None:
      return self.kept[index]
    if self._fd is None:
      self._fd = os.open(self.path, os.O_RDONLY)
    # thread-safe positional read
    raw = os.pread(self._fd, int(self.lengths[index]), int(self.offsets[index]))
    return self.parse(raw.decode("utf-8", errors="replace").split("\t"))

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_fd"] = None
    return state

  def __repr__(self) -> str:
    return f"TsvSource({self.path}, records={len(self)})"


def _parse_listops(fields: list[str]) -> tuple[list[str], int]:
  if len(fields) != 2:
    raise ValueError(f"expected 2 tab-separated fields (Source, Target), got {len(fields)}")
  tokens = fields[0].split()
  unknown = sorted({t for t in tokens if t not in listops.TOKEN_ID or t == "<pad>"})
  if unknown:
    raise ValueError(f"unknown ListOps tokens {unknown[:5]}")
  if not tokens:
    raise ValueError("empty Source")
  try:
    label = int(fields[1])
  except ValueError:
    raise ValueError(f"Target {fields[1]!r} is not an integer") from None
  if not 0 <= label <= 9:
    raise ValueError(f"Target {label} is outside 0..9")
  return tokens, label


def _parse_retrieval(fields: list[str]) -> tuple[str, str, int]:
  if len(fields) != 5:
    raise ValueError(f"expected 5 tab-separated fields (label, id1, id2, text1, text2), got {len(fields)}")
  try:
    label = float(fields[0])
  except ValueError:
    raise ValueError(f"label {fields[0]!r} is not a number") from None
  if label not in (0.0, 1.0):
    raise ValueError(f"label {fields[0]!r} is not 0 or 1")
  return fields[3], fields[4], int(label)


def byte_tokens(text: str | bytes, seq_len: int, counter: pipeline.Counter) -> tuple[np.ndarray, np.ndarray]:
  raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  return listops.pad_to(np.frombuffer(raw, np.uint8).astype(np.int32), seq_len, counter)


class _ListOpsFn:
  def __init__(self, seq_len: int, parens: bool):
    self.seq_len, self.parens = seq_len, parens
    self.counter = pipeline.Counter("lra_listops: inputs truncated to seq_len")

  def __call__(self, record) -> dict[str, np.ndarray]:
    tokens, label = record
    ids = tokens if isinstance(tokens, np.ndarray) else listops.encode(tokens, parens=self.parens)  # kept ids
    ids, mask = listops.pad_to(ids, self.seq_len, self.counter)
    return {"inputs": ids, "mask": mask, "label": np.int32(label)}


class _KeepListOpsIds:
  """The token ids of a parsed ListOps row as uint8 (the vocabulary has 18 tokens; pad_to widens them to
  int32)."""

  def __init__(self, parens: bool):
    self.parens = parens

  def __call__(self, record) -> tuple[np.ndarray, int]:
    tokens, label = record
    return listops.encode(tokens, parens=self.parens).astype(np.uint8), label  # pad_to gives int32


class _TextFn:
  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    self.counter = pipeline.Counter("lra_text: reviews truncated to seq_len")

  def __call__(self, record) -> dict[str, np.ndarray]:
    ids, mask = byte_tokens(record["text"], self.seq_len, self.counter)
    return {"inputs": ids, "mask": mask, "label": np.int32(record["label"])}


class _RetrievalFn:
  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    self.counter = pipeline.Counter("lra_retrieval: documents truncated to seq_len")

  def __call__(self, record) -> dict[str, np.ndarray]:
    text1, text2, label = record
    ids1, mask1 = byte_tokens(text1, self.seq_len, self.counter)
    ids2, mask2 = byte_tokens(text2, self.seq_len, self.counter)
    return {"inputs1": ids1, "mask1": mask1, "inputs2": ids2, "mask2": mask2, "label": np.int32(label)}


def grayscale(image: np.ndarray) -> np.ndarray:
  """[H, W, 3] uint8 -> [H, W] uint8 luma (0.2989 R + 0.5870 G + 0.1140 B, as tf.image.rgb_to_grayscale)."""
  rgb = image.astype(np.float32)
  gray = rgb @ np.array([0.2989, 0.5870, 0.1140], np.float32)
  return np.clip(np.round(gray), 0, 255).astype(np.uint8)


class _GrayImageFn:
  def __call__(self, record) -> dict[str, np.ndarray]:
    image = grayscale(images.fit_image(record["image"], (32, 32, 3)))
    tokens = image.reshape(-1).astype(np.int32)  # [1024], raster order
    return {"inputs": tokens, "mask": np.ones(tokens.shape[0], bool), "label": np.int32(record["label"])}


class PathfinderSource:
  """(png path, label) pairs from the metadata index files of one difficulty; images decoded on access."""

  def __init__(self, root: str, split: str, malformed: Malformed, resolution: int):
    meta_dir = os.path.join(root, "metadata")
    files = sorted(glob.glob(os.path.join(meta_dir, "*.npy")),
                   key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
    if not files:
      raise FileNotFoundError(f"no metadata/*.npy index files under {root}")
    n = len(files)
    bounds = {"train": (0, int(0.8 * n)), "validation": (int(0.8 * n), int(0.9 * n)),
              "test": (int(0.9 * n), n)}
    lo, hi = bounds[split]
    self.root, self.split, self.resolution = root, split, resolution
    self.items: list[tuple[str, int]] = []
    for path in files[lo:hi]:
      with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
          fields = line.split()
          if not fields:
            continue
          if len(fields) < 4:
            malformed(path, lineno, f"expected >= 4 space-separated fields, got {len(fields)}")
            continue
          try:
            label = int(float(fields[3]))
          except ValueError:
            malformed(path, lineno, f"label {fields[3]!r} is not a number")
            continue
          if label not in (0, 1):
            malformed(path, lineno, f"label {label} is not 0 or 1")
            continue
          image = os.path.join(fields[0], fields[1])
          if not os.path.exists(os.path.join(root, image)):
            malformed(path, lineno, f"image {os.path.join(root, image)} does not exist")
            continue
          self.items.append((image, label))

  def __len__(self) -> int:
    return len(self.items)

  def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
    from PIL import Image

    rel, label = self.items[index]
    with open(os.path.join(self.root, rel), "rb") as f:
      image = np.asarray(Image.open(io.BytesIO(f.read())).convert("L"))
    if image.shape != (self.resolution, self.resolution):
      raise ValueError(f"{os.path.join(self.root, rel)}: image shape {image.shape}, expected "
                       f"{(self.resolution, self.resolution)}")
    return image, label

  def __repr__(self) -> str:
    return f"PathfinderSource({self.root}, split={self.split}, records={len(self)})"


def _pathfinder_fn(record) -> dict[str, np.ndarray]:
  image, label = record
  tokens = image.reshape(-1).astype(np.int32)
  return {"inputs": tokens, "mask": np.ones(tokens.shape[0], bool), "label": np.int32(label)}


def dataset_info(config: Any) -> DatasetInfo:
  name = config.data.name
  if name not in NAMES:
    raise ValueError(f"data.lra handles {NAMES}, got {name!r}")
  seq_len = int(pipeline.cfg_get(config, "seq_len", DEFAULT_SEQ_LEN[name]))
  sizes = dict(SPLIT_SIZES[name])
  if name == "lra_listops":
    return listops.info(name, seq_len, sizes)
  if name in ("lra_image", "lra_pathfinder"):
    res = 32 if name == "lra_image" else int(pipeline.cfg_get(config, "resolution", 32))
    if seq_len != res * res:
      raise ValueError(f"config.data.seq_len must be {res * res} for {name}, got {seq_len}")
    return DatasetInfo(name=name, task="classify", vocab_size=256, seq_len=seq_len, input_vocab_size=257,
                       cls_id=256, num_classes=10 if name == "lra_image" else 2, image_shape=(res, res, 1),
                       split_sizes=sizes)
  task = "retrieval" if name == "lra_retrieval" else "classify"
  return DatasetInfo(name=name, task=task, vocab_size=256, seq_len=seq_len, input_vocab_size=257, cls_id=256,
                     num_classes=2, split_sizes=sizes)


def make_source(config: Any, split: str):
  """(random-access source, per-record function) for one LRA split."""
  name = config.data.name
  info = dataset_info(config)
  if split not in ("train", "validation", "test"):
    raise cli.mark_usage(ValueError(f"split must be 'train', 'validation' or 'test', got {split!r}"))
  if name == "lra_listops":
    path = _need(os.path.join(lra_root(config), "listops-1000", LISTOPS_FILES[split]), config)
    parens = bool(pipeline.cfg_get(config, "listops_parens", False))
    # Every token takes >= 2 bytes of the file (a character and a space), so the kept uint8 ids of the whole
    # split take at most half its size (~100 MB for the 96K training rows); a kept record skips the line's
    # parse and encoding on every read (docs/benchmarks_training.md, "Input pipeline costs").
    cap_mb = float(pipeline.cfg_get(config, "cache_in_memory", 512))
    keep = _KeepListOpsIds(parens) if os.path.getsize(path) / 2 <= cap_mb * 2**20 else None
    source = TsvSource(path, _parse_listops, malformed=Malformed(config), header="Source", keep=keep)
    return source, _ListOpsFn(info.seq_len, parens)
  if name == "lra_retrieval":
    path = _need(os.path.join(lra_root(config), "tsv_data", RETRIEVAL_FILES[split]), config)
    source = TsvSource(path, _parse_retrieval, malformed=Malformed(config), header="label")
    return source, _RetrievalFn(info.seq_len)
  if name == "lra_pathfinder":
    difficulty = pipeline.cfg_get(config, "difficulty", "curv_contour_length_14")
    if difficulty not in PATHFINDER_DIFFICULTIES:
      raise ValueError(f"config.data.difficulty must be one of {PATHFINDER_DIFFICULTIES}, got {difficulty!r}")
    res = info.image_shape[0]
    root = _need(os.path.join(lra_root(config), f"pathfinder{res}", difficulty), config)
    return PathfinderSource(root, split, Malformed(config), res), _pathfinder_fn
  data_dir = pipeline.cfg_get(config, "data_dir")
  table = {"train": "train", "validation": "test", "test": "test"}
  # Both splits are small (imdb ~35 MB, cifar10 ~150 MB): read once into memory (config.data.cache_in_memory).
  if name == "lra_text":
    source = images.tfds_source("imdb_reviews", table[split], data_dir, name)
    return pipeline.maybe_in_memory(source, config, name), _TextFn(info.seq_len)
  source = images.tfds_source("cifar10", table[split], data_dir, name)
  return pipeline.maybe_in_memory(source, config, name), _GrayImageFn()


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index=None, shard_count=None,
                   shuffle=None, num_epochs=None):
  source, fn = make_source(config, split)
  return pipeline.make_loader(
    source, [pipeline.Example(fn)], split=split, batch_size=batch_size, seed=seed, shard_index=shard_index,
    shard_count=shard_count, shuffle=shuffle, num_epochs=num_epochs, config=config,
  )
