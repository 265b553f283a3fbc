"""The generated key-value recall task (data/synthetic.py): what its records pose, and its draws."""

from __future__ import annotations

import numpy as np
import pytest

from tests.data.readers import data_config


@pytest.mark.parametrize("fields", [dict(seq_len=64),
                                    dict(seq_len=37, num_pairs=9, num_keys=12, num_values=7),
                                    dict(seq_len=2000, num_pairs=3)])
def test_synthetic_recall_records_pose_the_task(fields):
  """Every record: distinct stored keys, one pair per slice of the first half, filler elsewhere, and each
  answer is the value stored with the queried key; batch generation equals one-by-one generation; records
  differ."""
  from data import synthetic

  source = synthetic.RecallSource(data_config("synthetic_recall", **fields), "validation", seed=11)
  f, k, v, p = source.num_filler, source.num_keys, source.num_values, source.num_pairs
  length, half = source.seq_len, source.seq_len // 2
  edges = np.linspace(0, half, p + 1).astype(int)
  indices = [int(i) for i in np.random.default_rng(5).integers(0, 1 << 40, size=24)]
  batch = source.read_batch(indices)
  for index, record in zip(indices, batch, strict=True):
    single = source[index]
    for key in single:
      assert record[key].dtype == single[key].dtype
      np.testing.assert_array_equal(record[key], single[key])
    t = record["inputs"]
    assert t.dtype == np.int32 and t.shape == (length,)
    pair_pos = np.flatnonzero((t[:half] >= f + k) & (t[:half] < f + k + k * v))
    assert len(pair_pos) == p and np.all((pair_pos >= edges[:-1]) & (pair_pos < edges[1:]))
    stored = {(x - f - k) // v: (x - f - k) % v for x in t[pair_pos]}
    assert len(stored) == p  # distinct keys
    assert np.all(np.delete(t[:half], pair_pos) < f)
    q_pos = half + 2 * np.arange((length - half) // 2)
    assert np.all(record["weights"][q_pos + 1] == 1) and record["weights"].sum() == len(q_pos)
    for q, a in zip(t[q_pos], t[q_pos + 1], strict=True):
      assert stored[q - f] == a - (f + k + k * v)
  assert len({r["inputs"].tobytes() for r in batch}) == len(batch)
  other = synthetic.RecallSource(data_config("synthetic_recall", **fields), "train", seed=11)
  assert not np.array_equal(other[indices[0]]["inputs"], batch[0]["inputs"])  # splits draw different records


def test_synthetic_recall_draws_are_uniform():
  from data import synthetic

  source = synthetic.RecallSource(data_config("synthetic_recall", seq_len=512), "train", seed=0)
  tokens = np.stack([r["inputs"] for r in source.read_batch(list(range(400)))])
  filler = tokens[:, :256][tokens[:, :256] < source.num_filler]
  counts = np.bincount(filler, minlength=source.num_filler) / filler.size
  np.testing.assert_allclose(counts, 1 / source.num_filler, atol=0.01)
  answers = tokens[:, 257::2] - (source.num_filler + source.num_keys * (1 + source.num_values))
  np.testing.assert_allclose(np.bincount(answers.ravel(), minlength=10) / answers.size, 0.1, atol=0.01)


def test_an_unknown_split_is_the_users_error():
  """A split the dataset lacks is a bad --split / config.eval_split: one line from the entry points."""
  import data
  from runtime import cli

  with pytest.raises(ValueError, match="split must be one of") as e:
    data.create_dataset(data_config("synthetic_recall", seq_len=64), "bogus", batch_size=2, seed=0)
  assert cli.user_error(e.value) == str(e.value)
