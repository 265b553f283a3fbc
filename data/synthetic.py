"""`synthetic_recall`: multi-query key-value recall over a long sequence, generated on the fly (the embedded
default task of `python train.py`).

A causal LM task at length L (default 512) with the loss only on the answers:
  first half   filler tokens with `num_pairs` "pair" tokens P(k, v) (distinct keys k, values v), one at a
               random offset inside each 1/num_pairs slice of the first half, so the pairs are far apart;
  second half  (query, answer) couples Q(k) A(v): k one of the stored keys, v its stored value.
The model predicts every A(v) from the context ending in Q(k): it must find, up to L-1 positions back, the
pair token whose key matches and read its value (content-based long-range attention). Chance accuracy is
1/num_values; `weights` is 1 exactly at the answer positions, so the reported loss/accuracy are the answers'.

Every example is a pure function of (seed, split, record index), so the grain iterator state alone resumes it:
its random numbers are a counter-based hash (splitmix64) of (seed, split, index, draw number), computed for a
whole batch of records at once (`read_batch`, used by the dataset engine), much cheaper than seeding a numpy
Generator per record, which alone cost more than a smoke train step consumes.
Vocabulary: [0, F) filler; [F, F+K) queries; [F+K, F+K+K*V) pairs; [F+K+K*V, F+K+K*V+V) answers.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from data import pipeline
from data.info import DatasetInfo
from runtime import cli

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
                     split_sizes={"train": _field(config, "train_examples"), "validation": eval_n,
                                  "test": eval_n})


class RecallSource:
  """Random-access source: record i of a split is generated from a hash of (seed, salt, i) (`_hash_draws`)."""

  def __init__(self, config: Any, split: str, seed: int):
    if split not in _SPLIT_SALT:
      raise cli.mark_usage(ValueError(f"{NAME}: split must be one of {sorted(_SPLIT_SALT)}, got {split!r}"))
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
    return self.read_batch([index])[0]

  def read_batch(self, indices: Any) -> list[dict[str, np.ndarray]]:
    """Records `indices`, generated together (`data.records.read_records` uses this when a source has it)."""
    index = np.asarray(indices, np.uint64).reshape(-1)  # [records]
    length, f, k, v = self.seq_len, self.num_filler, self.num_keys, self.num_values
    p, n_q = self.num_pairs, self._q_pos.shape[0]
    u = _hash_draws(self.seed, self.salt, index, length + k + 2 * p + n_q)  # [records, draws] uint64
    filler, scores, value_u, pos_u, which_u = np.split(u, np.cumsum([length, k, p, p]), axis=1)
    tokens = _below(filler, f)  # [records, L] filler
    keys = np.argsort(scores, axis=1, kind="stable")[:, :p]  # distinct keys: a random permutation's head
    values = _below(value_u, v)  # [records, pairs]
    positions = self._slice_lo + _below(pos_u, self._slice_hi - self._slice_lo)  # one pair per slice
    rows = np.arange(index.shape[0])[:, None]
    tokens[rows, positions] = f + k + keys * v + values
    which = _below(which_u, p)  # [records, queries]: which stored pair each query asks for
    tokens[:, self._q_pos] = f + np.take_along_axis(keys, which, axis=1)
    tokens[:, self._q_pos + 1] = f + k + k * v + np.take_along_axis(values, which, axis=1)
    tokens = tokens.astype(np.int32)
    return [{"inputs": t, "mask": self._ones_bool.copy(), "weights": self._weights.copy(),
             "segment_ids": self._ones_int.copy()} for t in tokens]


def _hash_draws(seed: int, salt: int, index: np.ndarray, n: int) -> np.ndarray:
  """[records, n] uint64: splitmix64 of a distinct 64-bit counter per (seed, salt, index, draw)."""
  counter = index[:, None] * np.uint64(n + 1) + np.arange(1, n + 1, dtype=np.uint64)[None, :]  # all distinct
  with np.errstate(over="ignore"):
    base = (np.uint64(seed & (2**64 - 1)) * np.uint64(0xD1B54A32D192ED03)
            + np.uint64(salt) * np.uint64(0x8CB92BA72F3D8DD7))
    z = base + counter * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _below(u: np.ndarray, n: Any) -> np.ndarray:
  """Integers uniform in [0, n) from uint64 draws (the top 32 bits times n; bias < n / 2^32)."""
  return ((u >> np.uint64(32)) * np.asarray(n, np.uint64) >> np.uint64(32)).astype(np.int64)


def _identity(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return example


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index: int | None = None,
                   shard_count: int | None = None, shuffle: bool | None = None,
                   num_epochs: int | None = None) -> grain.IterDataset:
  source = RecallSource(config, split, seed)
  return pipeline.make_loader(source, [pipeline.Example(_identity)], split=split, batch_size=batch_size,
                              seed=seed, shard_index=shard_index, shard_count=shard_count, shuffle=shuffle,
                              num_epochs=num_epochs, config=config)
