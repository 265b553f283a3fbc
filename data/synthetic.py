"""`synthetic_recall`: multi-query key-value recall over a long sequence, generated on the fly (the embedded
default task of `python train.py`).

A causal LM task at length L (default 512) with the loss only on the answers:
  first half   filler tokens with `num_pairs` "pair" tokens P(k, v) (distinct keys k, values v), one at a random
               offset inside each 1/num_pairs slice of the first half, so the pairs are far apart;
  second half  (query, answer) couples Q(k) A(v): k one of the stored keys, v its stored value.
The model predicts every A(v) from the context ending in Q(k): it must find, up to L-1 positions back, the pair
token whose key matches and read its value (content-based long-range attention). Chance accuracy is
1/num_values; `weights` is 1 exactly at the answer positions, so the reported loss/accuracy are the answers'.

Every example is a pure function of (seed, split, record index), so the grain iterator state alone resumes it.
Vocabulary: [0, F) filler; [F, F+K) queries; [F+K, F+K+K*V) pairs; [F+K+K*V, F+K+K*V+V) answers.
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


def vocab_size(config: Any) -> int:
  f, k, v = _field(config, "num_filler"), _field(config, "num_keys"), _field(config, "num_values")
  return f + k + k * v + v


def chance(config: Any) -> float:
  """Accuracy of guessing the answer: 1 / num_values."""
  return 1.0 / _field(config, "num_values")


def dataset_info(config: Any) -> DatasetInfo:
  vocab = vocab_size(config)
  eval_n = _field(config, "eval_examples")
  return DatasetInfo(name=NAME, task="lm", vocab_size=vocab, seq_len=_field(config, "seq_len"),
                     input_vocab_size=vocab + 1, bos_id=vocab, metric="accuracy",
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
    if self.seq_len < 4 * self.num_pairs:
      raise ValueError(f"{NAME}: seq_len={self.seq_len} must be >= 4 * num_pairs = {4 * self.num_pairs}")
    self.size = _field(config, "train_examples") if split == "train" else _field(config, "eval_examples")
    self.seed, self.salt = int(seed), _SPLIT_SALT[split]
    length, half = self.seq_len, self.seq_len // 2
    edges = np.linspace(0, half, self.num_pairs + 1).astype(int)
    # One vectorised draw over the slices consumes the generator like one scalar draw per slice, in order.
    self._slice_lo, self._slice_hi = edges[:-1], edges[1:]
    self._q_pos = half + 2 * np.arange((length - half) // 2)  # query positions; answers follow each
    self._weights = np.zeros(length, np.float32)
    self._weights[self._q_pos + 1] = 1.0
    self._ones_bool, self._ones_int = np.ones(length, bool), np.ones(length, np.int32)

  def __len__(self) -> int:
    return self.size

  def __repr__(self) -> str:  # grain stores it in the iterator state: keep it free of memory addresses
    return (f"RecallSource(seq_len={self.seq_len}, keys={self.num_keys}, values={self.num_values}, "
            f"pairs={self.num_pairs}, filler={self.num_filler}, size={self.size}, seed={self.seed}, "
            f"salt={self.salt})")

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    # The draws (and their order) define the data; everything that does not depend on them is precomputed.
    rng = np.random.default_rng((self.seed, self.salt, int(index)))
    f, k, v = self.num_filler, self.num_keys, self.num_values
    tokens = rng.integers(0, f, size=self.seq_len)  # filler
    keys = rng.choice(k, size=self.num_pairs, replace=False)
    values = rng.integers(0, v, size=self.num_pairs)
    positions = rng.integers(self._slice_lo, self._slice_hi)  # one pair per slice of the first half
    tokens[positions] = f + k + keys * v + values
    which = rng.integers(0, self.num_pairs, size=self._q_pos.shape[0])
    tokens[self._q_pos] = f + keys[which]
    tokens[self._q_pos + 1] = f + k + k * v + values[which]
    return {"inputs": tokens.astype(np.int32), "mask": self._ones_bool.copy(), "weights": self._weights.copy(),
            "segment_ids": self._ones_int.copy()}


def _identity(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return example


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index: int | None = None,
                   shard_count: int | None = None, shuffle: bool | None = None,
                   num_epochs: int | None = None) -> grain.IterDataset:
  source = RecallSource(config, split, seed)
  return pipeline.make_loader(source, [pipeline.Example(_identity)], split=split, batch_size=batch_size,
                              seed=seed, shard_index=shard_index, shard_count=shard_count, shuffle=shuffle,
                              num_epochs=num_epochs, config=config)
