"""`synthetic_local` (data/synthetic_local.py): every token follows the order-`order` rule from the tokens
before it except the noisy ones, the noise rate and first tokens are as stated, and records are a pure
function of (seed, split, index), read through the registered pipeline."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

import data
from data import synthetic_local


def _config(**fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {"name": "synthetic_local", "data_dir": None, **fields}})


def _rule(tokens: np.ndarray, order: int, v: int) -> np.ndarray:
  """From the definition: [records, L - order], sum_j (2j - 1) x_{t-j} mod v for t >= order, one by one."""
  records, length = tokens.shape
  out = np.zeros((records, length - order), np.int64)
  for r in range(records):
    for t in range(order, length):
      out[r, t - order] = sum((2 * j - 1) * int(tokens[r, t - j]) for j in range(1, order + 1)) % v
  return out


@pytest.mark.parametrize("order,v", [(1, 7), (2, 16), (3, 5)])
def test_noiseless_rows_follow_the_rule(order, v):
  source = synthetic_local.LocalSource(_config(seq_len=40, order=order, num_symbols=v, noise=0.0), "train", 3)
  tokens = np.stack([r["inputs"] for r in source.read_batch(range(6))]).astype(np.int64)  # [6, 40]
  assert tokens.min() >= 0 and tokens.max() < v
  np.testing.assert_array_equal(tokens[:, order:], _rule(tokens, order, v))
  assert len({tuple(row[:order]) for row in tokens}) > 1  # the first tokens are drawn per record
  weights = source[0]["weights"]
  np.testing.assert_array_equal(weights, (np.arange(40) >= order).astype(np.float32))


def test_noise_rate_and_best_accuracy():
  config = _config(seq_len=256, order=2, num_symbols=16, noise=0.1)
  source = synthetic_local.LocalSource(config, "validation", 0)
  tokens = np.stack([r["inputs"] for r in source.read_batch(range(64))]).astype(np.int64)  # [64, 256]
  agree = np.mean(tokens[:, 2:] == _rule(tokens, 2, 16))  # a noisy token equals the rule 1/16 of the time
  best = synthetic_local.optimal_accuracy(config)
  assert best == pytest.approx(0.9 + 0.1 / 16)
  assert abs(agree - best) < 0.01  # 16,256 tokens: standard error ~0.002
  assert synthetic_local.chance(config) == 1 / 16


def test_records_are_a_function_of_seed_split_and_index():
  config = _config(seq_len=32, eval_examples=8)
  a = synthetic_local.LocalSource(config, "validation", 5)
  b = synthetic_local.LocalSource(config, "validation", 5)
  np.testing.assert_array_equal(a[3]["inputs"], b.read_batch([1, 3])[1]["inputs"])
  assert not np.array_equal(a[3]["inputs"], a[4]["inputs"])
  assert not np.array_equal(a[3]["inputs"], synthetic_local.LocalSource(config, "test", 5)[3]["inputs"])
  assert not np.array_equal(a[3]["inputs"], synthetic_local.LocalSource(config, "validation", 6)[3]["inputs"])
  info = data.dataset_info(config)
  got_info = (info.task, info.vocab_size, info.input_vocab_size, info.bos_id, info.seq_len)
  assert got_info == ("lm", 16, 17, 16, 32)
  batches = list(data.create_dataset(config, "validation", batch_size=4, seed=5, shard_index=0,
                                     shard_count=1))
  assert len(batches) == 2 and batches[0]["inputs"].shape == (4, 32) and batches[0]["valid"].all()
  got = sorted(tuple(row) for b in batches for row in b["inputs"])
  assert got == sorted(tuple(a[i]["inputs"]) for i in range(8))  # the split's records, each once


def test_bad_fields_are_refused():
  with pytest.raises(ValueError, match="order"):
    synthetic_local.LocalSource(_config(seq_len=4, order=4), "train", 0)
  with pytest.raises(ValueError, match="noise"):
    synthetic_local.LocalSource(_config(noise=1.5), "train", 0)
  with pytest.raises(ValueError, match="split"):
    synthetic_local.LocalSource(_config(), "dev", 0)
