"""`synthetic_recall`: key-value retrieval over a long sequence, generated on the fly (the embedded default task).

Each example is a classification problem at length L (default 512):
  position 0           a query token `Q_k` naming one key k,
  num_pairs positions  "pair" tokens `P_(k', v')` (one per key, distinct keys; one of them has k' = k), each at a
                       random offset inside its own 1/num_pairs slice of (0, L), so the pairs are far apart,
  all other positions  filler tokens drawn uniformly from `num_filler` ids.
The label is the value v of the pair whose key is the query's key: chance is 1/num_values. The model must
match the query at position 0 against a token up to L-1 positions away (content-based, long-range attention);
a bag of tokens does not suffice because every example stores a value for each of its keys.

Every example is a pure function of (seed, split, record index), so the grain iterator state alone resumes it.
Vocabulary: 0 unused; [1, 1+F) filler; [1+F, 1+F+K) queries; [1+F+K, 1+F+K+K*V) pairs.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from data import pipeline
from data.info import DatasetInfo

NAME = "synthetic_recall"
DEFAULTS = dict(seq_len=512, num_keys=16, num_values=10, num_pairs=8, num_filler=8, train_examples=1_000_000,
                eval_examples=512)
_SPLIT_SALT = {"train": 0, "validation": 1, "test": 2}


def _field(config: Any, key: str) -> int:
  return int(pipeline.cfg_get(config, key, DEFAULTS[key]))


def dataset_info(config: Any) -> DatasetInfo:
  f, k, v = _field(config, "num_filler"), _field(config, "num_keys"), _field(config, "num_values")
  vocab = 1 + f + k + k * v
  eval_n = _field(config, "eval_examples")
  return DatasetInfo(name=NAME, task="classify", vocab_size=vocab, seq_len=_field(config, "seq_len"),
                     input_vocab_size=vocab + 1, num_classes=v, cls_id=vocab, metric="accuracy",
                     split_sizes={"train": _field(config, "train_examples"), "validation": eval_n, "test": eval_n})


class RecallSource:
  """Random-access source: record i of a split is generated from np.random.default_rng((seed, salt, i))."""

  def __init__(self, config: Any, split: str, seed: int):
    if split not in _SPLIT_SALT:
      raise ValueError(f"{NAME}: split must be one of {sorted(_SPLIT_SALT)}, got {split!r}")
    self.seq_len = _field(config, "seq_len")
    self.num_keys, self.num_values = _field(config, "num_keys"), _field(config, "num_values")
    self.num_pairs, self.num_filler = _field(config, "num_pairs"), _field(config, "num_filler")
    if not 1 <= self.num_pairs <= self.num_keys:
      raise ValueError(f"{NAME}: need 1 <= num_pairs <= num_keys, got {self.num_pairs} and {self.num_keys}")
    if self.seq_len < 2 * self.num_pairs + 1:
      raise ValueError(f"{NAME}: seq_len={self.seq_len} too short for num_pairs={self.num_pairs}")
    self.size = _field(config, "train_examples") if split == "train" else _field(config, "eval_examples")
    self.seed, self.salt = int(seed), _SPLIT_SALT[split]

  def __len__(self) -> int:
    return self.size

  def __repr__(self) -> str:  # grain stores it in the iterator state: keep it free of memory addresses
    return (f"RecallSource(seq_len={self.seq_len}, keys={self.num_keys}, values={self.num_values}, "
            f"pairs={self.num_pairs}, filler={self.num_filler}, size={self.size}, seed={self.seed}, "
            f"salt={self.salt})")

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((self.seed, self.salt, int(index)))
    length, f, k = self.seq_len, self.num_filler, self.num_keys
    tokens = rng.integers(1, 1 + f, size=length)  # filler
    keys = rng.choice(k, size=self.num_pairs, replace=False)
    values = rng.integers(0, self.num_values, size=self.num_pairs)
    # One pair per slice of (0, length): pairs never share a neighbourhood.
    edges = np.linspace(1, length, self.num_pairs + 1).astype(int)
    positions = np.array([rng.integers(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])])
    tokens[positions] = 1 + f + k + keys * self.num_values + values
    which = rng.integers(self.num_pairs)
    tokens[0] = 1 + f + keys[which]
    return {"inputs": tokens.astype(np.int32), "mask": np.ones(length, bool),
            "label": np.int32(values[which])}


def _identity(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return example


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index: int | None = None,
                   shard_count: int | None = None, shuffle: bool | None = None,
                   num_epochs: int | None = None) -> grain.DataLoader:
  source = RecallSource(config, split, seed)
  return pipeline.make_loader(source, [pipeline.Example(_identity)], split=split, batch_size=batch_size,
                              seed=seed, shard_index=shard_index, shard_count=shard_count, shuffle=shuffle,
                              num_epochs=num_epochs, config=config)
