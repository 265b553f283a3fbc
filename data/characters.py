"""`enwik8` and `text8`: the character-level language-modeling benchmarks of Transformer-XL and Adaptive Span.

enwik8 is the first 10^8 bytes of an English Wikipedia XML dump (http://mattmahoney.net/dc/enwik8.zip, one
member `enwik8`), modeled byte by byte: vocabulary 256, `bos_id` 256. text8 is the first 10^8 characters of
cleaned Wikipedia text (http://mattmahoney.net/dc/text8.zip, one member `text8`) over 27 characters, space and
a-z as ids 0-26 (`TEXT8_ALPHABET`), `bos_id` 27. Both are split as in the papers: the last 5M characters are
the test split, the 5M before them validation, the first 90M training (`split_lengths`: 1/20 each for the held
out splits of a file of any length, so a small stand-in keeps the proportions).

Layout (`python -m data.prepare enwik8|text8 --data_dir DIR` writes it, `prepare_from_zip`):
`{data_dir}/<name>/{train,validation,test}.npy`, the split's token ids as uint8 [characters], and `spec.json`
(source member, its sha256 and length, characters per split), published as one directory.
Records are consecutive non-overlapping windows of `config.data.seq_len` characters (the last partial window
dropped), shuffled like pystdlib's byte windows; `config.data.ordered` reads the same ids as one stream in the
Transformer-XL order (data.ordered). The metric the papers report is bits per character: the loss in nats /
ln 2 over exactly `vocab_size` classes, as for pystdlib's bits per byte (scripts/reproduce.py's
"bits_per_byte").
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from typing import Any

import numpy as np

from data import pipeline, pystdlib, records
from data.info import DatasetInfo
from runtime import cli, paths

SPLITS = ("train", "validation", "test")
TEXT8_ALPHABET = " abcdefghijklmnopqrstuvwxyz"  # id = position
PUBLISHED_LENGTH = 10**8  # characters in either file
DEFAULT_SEQ_LEN = 512  # the papers' training segment

# name -> zip URL, member inside it, vocabulary (ids [0, vocab)), what a character is
SPECS: dict[str, dict[str, Any]] = {
  "enwik8": dict(url="http://mattmahoney.net/dc/enwik8.zip", member="enwik8", vocab_size=256, unit="byte"),
  "text8": dict(url="http://mattmahoney.net/dc/text8.zip", member="text8", vocab_size=len(TEXT8_ALPHABET),
                unit="character"),
}


def _spec(name: str) -> dict[str, Any]:
  if name not in SPECS:
    raise ValueError(f"data.characters handles {sorted(SPECS)}, got {name!r}")
  return SPECS[name]


def data_dir(config: Any) -> str:
  return os.path.expanduser(pipeline.cfg_get(config, "data_dir", "~/tensorflow_datasets"))


def prepared_dir(config: Any) -> str:
  """`{data_dir}/<name>`: the split files and spec.json."""
  return paths.join(data_dir(config), config.data.name)


def zip_path(name: str, root: str) -> str:
  """Where prepare reads the downloaded (or hand-placed) archive: `{data_dir}/<name>.zip`."""
  return os.path.join(os.path.expanduser(root), f"{name}.zip")


def split_lengths(total: int) -> dict[str, int]:
  """Characters per split of a file of `total` characters: 90M/5M/5M for the published 10^8."""
  held = total // 20
  return {"train": total - 2 * held, "validation": held, "test": held}


# ------------------------------------------------------------------------------------------------------------
# Preparation


def encode(name: str, raw: bytes) -> np.ndarray:
  """The file's token ids: uint8 [len(raw)]; ValueError for a text8 character outside space and a-z."""
  data = np.frombuffer(raw, np.uint8)  # [n]
  if name == "enwik8":
    return data
  table = np.full(256, 255, np.uint8)
  table[np.frombuffer(TEXT8_ALPHABET.encode("ascii"), np.uint8)] = np.arange(len(TEXT8_ALPHABET))
  ids = table[data]  # [n]
  bad = np.flatnonzero(ids == 255)
  if bad.size:
    raise ValueError(f"text8 has {bad.size} characters outside space and a-z (the first, byte "
                     f"{int(data[bad[0]])}, at offset {int(bad[0])}): not the published text8")
  return ids


def decode(name: str, ids: np.ndarray) -> bytes:
  """The characters of `ids` (uint8 or int [n]) as bytes: the inverse of `encode`."""
  ids = np.asarray(ids).astype(np.uint8)
  if name == "enwik8":
    return ids.tobytes()
  return np.frombuffer(TEXT8_ALPHABET.encode("ascii"), np.uint8)[ids].tobytes()


def write_splits(name: str, root: str, raw: bytes, *, source: str) -> dict[str, int]:
  """Encodes `raw` (the whole file) and publishes `{root}/<name>/` with its three splits and spec.json;
  returns the characters per split. Nothing is written when the directory is already there."""
  ids = encode(name, raw)  # [n]
  lengths = split_lengths(len(ids))
  files, start = {}, 0
  for split in SPLITS:
    files[f"{split}.npy"] = paths.npy_bytes(ids[start:start + lengths[split]])
    start += lengths[split]
  spec = {"dataset": name, "source": source, "member": SPECS[name]["member"], "length": len(ids),
          "sha256": hashlib.sha256(raw).hexdigest(), "characters": lengths,
          "vocab_size": SPECS[name]["vocab_size"]}
  files["spec.json"] = json.dumps(spec, indent=1).encode()
  paths.publish_dir(paths.join(os.path.expanduser(root), name), files)
  return lengths


def read_zip(name: str, archive: str) -> bytes:
  """The member of `archive` (`enwik8` in enwik8.zip, `text8` in text8.zip); ValueError when it is not a zip
  holding that member."""
  member = _spec(name)["member"]
  try:
    with zipfile.ZipFile(archive) as z:
      if member not in z.namelist():
        raise ValueError(f"{archive} holds {z.namelist()[:5]}, not {member!r}: not the {name} archive")
      return z.read(member)
  except zipfile.BadZipFile as e:
    raise ValueError(f"{archive} is not a zip archive ({e}): a damaged download; delete it and run "
                     "again") from e


def prepare_from_zip(name: str, root: str) -> dict[str, int]:
  """`{root}/<name>.zip` -> `{root}/<name>/`; the characters per split (ValueError for a wrong archive)."""
  archive = zip_path(name, root)
  return write_splits(name, root, read_zip(name, archive), source=os.path.basename(archive))


# ------------------------------------------------------------------------------------------------------------
# Reading


_TOKENS: dict[str, np.ndarray] = {}  # split file -> its ids, once per process


def _load(file: str) -> np.ndarray:
  if file not in _TOKENS:
    _TOKENS[file] = paths.load_npy(file, mmap_over_mb=64)
  return _TOKENS[file]


def split_tokens(config: Any, split: str) -> np.ndarray:
  """The split's token ids in file order: uint8 [characters] (memory-mapped when large; cached); the
  "prepare it with ..." FileNotFoundError when the split is not there."""
  if split not in SPLITS:
    raise cli.mark_usage(ValueError(f"{config.data.name} split must be one of {SPLITS}, got {split!r}"))
  _spec(config.data.name)
  file = paths.join(prepared_dir(config), f"{split}.npy")
  if file not in _TOKENS and not paths.exists(file):
    raise pipeline.missing(prepared_dir(config), config.data.name, pipeline.cfg_get(config, "data_dir"))
  return _load(file)


class WindowSource(records.StreamWindows):
  """Record i = characters [i * seq_len, (i + 1) * seq_len) of a split: uint8 [seq_len]."""

  def __init__(self, config: Any, split: str, seq_len: int):
    self.file = paths.join(prepared_dir(config), f"{split}.npy")
    super().__init__(seq_len, len(split_tokens(config, split)))

  def stream(self) -> np.ndarray:
    return _load(self.file)

  def __repr__(self) -> str:  # grain compares it on restore
    return f"Characters({self.file}, seq_len={self.seq_len}, records={self.size})"


def dataset_info(config: Any) -> DatasetInfo:
  """Vocabulary of the data ids plus a BOS beyond it; split_sizes are the published files' windows."""
  name = config.data.name
  vocab = _spec(name)["vocab_size"]
  seq_len = int(pipeline.cfg_get(config, "seq_len", DEFAULT_SEQ_LEN))
  sizes = {split: n // seq_len for split, n in split_lengths(PUBLISHED_LENGTH).items()}
  return DatasetInfo(name=name, task="lm", vocab_size=vocab, seq_len=seq_len, input_vocab_size=vocab + 1,
                     bos_id=vocab, metric="bits_per_byte", split_sizes=sizes)


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index=None, shard_count=None,
                   shuffle=None, num_epochs=None):
  seq_len = dataset_info(config).seq_len
  source = WindowSource(config, split, seq_len)
  return pipeline.make_loader(
    source, [pipeline.Example(pystdlib.lm_example)], split=split, batch_size=batch_size, seed=seed,
    shard_index=shard_index, shard_count=shard_count, shuffle=shuffle, num_epochs=num_epochs, config=config,
  )
