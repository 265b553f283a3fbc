"""`synthetic_local`: a causal LM task whose every token depends on the previous `order` tokens alone,
generated on the fly (the local counterpart of `synthetic_recall`, for attentions that learn how far to look).

Each row of length L (default 512) is an order-`order` Markov chain over `num_symbols` symbols V:
  x_0 .. x_{order-1}   uniform;
  x_t = (c_1 x_{t-1} + ... + c_order x_{t-order} + e_t) mod V   with c_j = 2j - 1 (1, 3, 5, ...),
where the noise e_t is 0 with probability 1 - `noise` and uniform in [0, V) otherwise (then x_t is uniform).
Given the last `order` tokens the earlier ones carry no information about x_t, so the best prediction needs
only a window of `order` tokens: the rule's value, right with probability 1 - noise + noise / V
(`optimal_accuracy`); chance is 1 / V. The noise keeps rows from turning periodic, which a long-range
attention could otherwise exploit by copying from one period back. `weights` is 1 from position `order` on
(the first `order` tokens are unpredictable), so the reported loss and accuracy are those of the rule.

Every example is a pure function of (seed, split, record index), drawn with the same counter-based hash as
`synthetic_recall` (`read_batch` generates a batch of records at once).
Config fields (config.data): seq_len, num_symbols (16), order (2), noise (0.1), train_examples,
eval_examples.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from data import pipeline
from data.info import DatasetInfo
from data.synthetic import _below, _hash_draws
from runtime import cli

NAME = "synthetic_local"
DEFAULTS = dict(seq_len=512, num_symbols=16, order=2, noise=0.1, train_examples=1_000_000, eval_examples=512)
_SPLIT_SALT = {"train": 16, "validation": 17, "test": 18}  # apart from synthetic_recall's salts


def _field(config: Any, key: str) -> Any:
  return pipeline.cfg_get(config, key, DEFAULTS[key])


def coefficients(order: int) -> np.ndarray:
  """c_j = 2j - 1 for j = 1..order: [order], c[j - 1] multiplies x_{t-j}."""
  return 2 * np.arange(1, order + 1, dtype=np.int64) - 1


def chance(config: Any) -> float:
  """Accuracy of guessing a symbol: 1 / num_symbols."""
  return 1.0 / int(_field(config, "num_symbols"))


def optimal_accuracy(config: Any) -> float:
  """Accuracy of predicting the rule's value: 1 - noise + noise / num_symbols."""
  noise = float(_field(config, "noise"))
  return 1.0 - noise + noise / int(_field(config, "num_symbols"))


def dataset_info(config: Any) -> DatasetInfo:
  vocab = int(_field(config, "num_symbols"))
  eval_n = int(_field(config, "eval_examples"))
  return DatasetInfo(name=NAME, task="lm", vocab_size=vocab, seq_len=int(_field(config, "seq_len")),
                     input_vocab_size=vocab + 1, bos_id=vocab, metric="accuracy",
                     split_sizes={"train": int(_field(config, "train_examples")), "validation": eval_n,
                                  "test": eval_n})


class LocalSource:
  """Random-access source: record i of a split is generated from a hash of (seed, salt, i) (`_hash_draws`)."""

  def __init__(self, config: Any, split: str, seed: int):
    if split not in _SPLIT_SALT:
      raise cli.mark_usage(ValueError(f"{NAME}: split must be one of {sorted(_SPLIT_SALT)}, got {split!r}"))
    self.seq_len, self.order = int(_field(config, "seq_len")), int(_field(config, "order"))
    self.num_symbols, self.noise = int(_field(config, "num_symbols")), float(_field(config, "noise"))
    if not 1 <= self.order < self.seq_len:
      raise ValueError(f"{NAME}: need 1 <= order < seq_len, got order={self.order}, seq_len={self.seq_len}")
    if self.num_symbols < 2 or not 0.0 <= self.noise <= 1.0:
      raise ValueError(f"{NAME}: need num_symbols >= 2 and noise in [0, 1], got {self.num_symbols}, "
                       f"{self.noise}")
    self.size = int(_field(config, "train_examples") if split == "train" else _field(config, "eval_examples"))
    self.seed, self.salt = int(seed), _SPLIT_SALT[split]
    self._coef = coefficients(self.order)  # [order]
    self._weights = np.zeros(self.seq_len, np.float32)
    self._weights[self.order:] = 1.0
    self._threshold = np.uint64(min(int(round(self.noise * 2.0**32)), 2**32))  # P(top 32 bits < it) = noise
    self._ones_bool, self._ones_int = np.ones(self.seq_len, bool), np.ones(self.seq_len, np.int32)

  def __len__(self) -> int:
    return self.size

  def __repr__(self) -> str:  # grain stores it in the iterator state: keep it free of memory addresses
    return (f"LocalSource(seq_len={self.seq_len}, symbols={self.num_symbols}, order={self.order}, "
            f"noise={self.noise}, size={self.size}, seed={self.seed}, salt={self.salt})")

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.read_batch([index])[0]

  def read_batch(self, indices: Any) -> list[dict[str, np.ndarray]]:
    """Records `indices`, generated together (`data.records.read_records` uses this when a source has it)."""
    index = np.asarray(indices, np.uint64).reshape(-1)  # [records]
    length, order, v = self.seq_len, self.order, self.num_symbols
    u = _hash_draws(self.seed, self.salt, index, 2 * length)  # [records, 2 L] uint64
    symbols = _below(u[:, :length], v)  # [records, L]: the first tokens and the noisy ones
    noisy = (u[:, length:] >> np.uint64(32)) < self._threshold  # [records, L]
    tokens = symbols.copy()  # [records, L] int64
    for t in range(order, length):
      previous = tokens[:, t - order:t][:, ::-1]  # [records, order]: x_{t-1} .. x_{t-order}
      rule = (previous @ self._coef) % v  # [records]
      tokens[:, t] = np.where(noisy[:, t], symbols[:, t], rule)
    tokens = tokens.astype(np.int32)
    return [{"inputs": x, "mask": self._ones_bool.copy(), "weights": self._weights.copy(),
             "segment_ids": self._ones_int.copy()} for x in tokens]


def _identity(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return example


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index: int | None = None,
                   shard_count: int | None = None, shuffle: bool | None = None,
                   num_epochs: int | None = None) -> grain.IterDataset:
  source = LocalSource(config, split, seed)
  return pipeline.make_loader(source, [pipeline.Example(_identity)], split=split, batch_size=batch_size,
                              seed=seed, shard_index=shard_index, shard_count=shard_count, shuffle=shuffle,
                              num_epochs=num_epochs, config=config)
