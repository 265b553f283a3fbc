"""Ordered LM streams (`config.data.ordered`, data/ordered.py): every batch against the stream sliced from its
definition, consecutive segments, reset flags, rows on 1 or 2 processes, exact resume, refused states."""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np
import pytest

import data
from data import ordered, pystdlib, resume, testing, text, tokenizer

KEYS = {"inputs": np.int32, "targets": np.int32, "mask": np.bool_, "weights": np.float32,
        "segment_ids": np.int32, "valid": np.bool_, "reset": np.bool_}


@pytest.fixture(scope="module")
def stdlib_root(tmp_path_factory):
  """A small generated source tree (the pystdlib tests' kind): ~60 files of random bytes."""
  root = tmp_path_factory.mktemp("stdlib")
  rng = np.random.default_rng(3)
  for i in range(60):
    rel = f"pkg{i % 4}/mod_{i}.py" if i % 3 else f"top_{i}.py"
    os.makedirs(os.path.dirname(os.path.join(root, rel)) or root, exist_ok=True)
    with open(os.path.join(root, rel), "wb") as f:
      f.write(bytes(rng.integers(1, 256, size=int(rng.integers(10, 300)), dtype=np.uint8)))
  return str(root)


def _config(root: str, seq_len: int = 16, **fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {"name": "pystdlib", "seq_len": seq_len, "stdlib_dir": root,
                                             "ordered": True, **fields}})


def _iter(config, split="train", batch_size=4, index=0, count=1, **kw):
  return iter(data.create_dataset(config, split, batch_size=batch_size, seed=0, shard_index=index,
                                  shard_count=count, **kw))


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_batches_are_consecutive_segments_of_contiguous_streams(stdlib_root):
  """Every batch equals the stream sliced by definition; step t + 1 continues step t; reset at each epoch."""
  config, L, B = _config(stdlib_root), 16, 4
  tokens = pystdlib.split_bytes(stdlib_root, "train").astype(np.int64)
  n_b = len(tokens) // B
  rows = tokens[:n_b * B].reshape(B, n_b)  # the remainder dropped
  steps = (n_b - 1) // L
  assert steps >= 3
  batches = _take(_iter(config), 2 * steps + 1)  # two whole epochs and the first step of the third
  shuffled = next(_iter(_config(stdlib_root, ordered=False)))
  for t, b in enumerate(batches):
    assert {k: v.dtype for k, v in b.items()} == {k: np.dtype(d) for k, d in KEYS.items()}
    assert set(shuffled) | {"targets", "reset"} == set(b)
    assert all(b[k].dtype == shuffled[k].dtype and b[k].shape == shuffled[k].shape for k in shuffled)
    k = t % steps
    np.testing.assert_array_equal(b["inputs"], rows[:, k * L:(k + 1) * L])
    np.testing.assert_array_equal(b["targets"], rows[:, k * L + 1:(k + 1) * L + 1])
    np.testing.assert_array_equal(b["reset"], np.full(B, k == 0))
    assert b["mask"].all() and (b["weights"] == 1).all() and b["valid"].all()
    assert (b["segment_ids"] == 1).all()  # no BOS in a byte stream
    if k + 1 < steps and t + 1 < len(batches):  # step t's targets end where step t + 1's inputs begin
      following = batches[t + 1]["inputs"]
      np.testing.assert_array_equal(b["targets"][:, -1], following[:, 0])
      joined = np.concatenate([b["inputs"], following], axis=1)  # [B, 2L]: the stream continues
      np.testing.assert_array_equal(joined[:, 1:L + 1], b["targets"])
  # Evaluation: the split from its start, one epoch, the same order.
  val = pystdlib.split_bytes(stdlib_root, "validation")
  evals = list(data.create_dataset(config, "validation", batch_size=2, seed=5, shard_index=0, shard_count=1,
                                   shuffle=False, num_epochs=1))
  n_v = len(val) // 2
  assert len(evals) == (n_v - 1) // L and evals[0]["reset"].all() and not evals[-1]["reset"].any()
  np.testing.assert_array_equal(evals[1]["inputs"][1], val[n_v + L:n_v + 2 * L])


def test_rows_do_not_depend_on_the_process_count(stdlib_root):
  config = _config(stdlib_root)
  one = _take(_iter(config, batch_size=4), 5)
  two = [_iter(config, batch_size=2, index=i, count=2) for i in range(2)]
  for want in one:
    parts = [next(it) for it in two]
    for k in want:
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), want[k], err_msg=k)


def test_resume_at_step_s_gives_the_uninterrupted_batches(stdlib_root, tmp_path):
  """A saved state (JSON, as grain's handler writes it) continues exactly, across an epoch boundary and on
  another process count (2 saved, 1 resumes) through the trainer's check and restore."""
  config = _config(stdlib_root)
  straight = _take(_iter(config), 12)
  two = [_iter(config, batch_size=2, index=i, count=2) for i in range(2)]
  for it in two:
    _take(it, 5)
  (tmp_path / "data").mkdir()
  for i, it in enumerate(two):
    (tmp_path / "data" / resume.state_file(i, 2)).write_text(json.dumps(it.get_state(), indent=4))
  resumed = _iter(config)
  resume.check_iterator_checkpoint(str(tmp_path), resumed, config)
  resume.restore_iterator(str(tmp_path), resumed)
  fresh = _iter(config)
  fresh.set_state(json.loads(json.dumps(two[0].get_state())))
  for it in (resumed, fresh):
    for want in straight[5:]:
      got = next(it)
      for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_mismatched_states_and_datasets_are_one_line_errors(stdlib_root, tmp_path):
  config = _config(stdlib_root)
  it = _iter(config)
  next(it)
  other = _iter(config, batch_size=8)  # another global batch: another stream layout
  with pytest.raises(ValueError, match=r"ordered stream layout .*streams=4.*streams=8") as e:
    other.set_state(it.get_state())
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="seq_len=16.*seq_len=8"):
    _iter(_config(stdlib_root, seq_len=8)).set_state(it.get_state())
  shuffled = _iter(_config(stdlib_root, ordered=False))
  next(shuffled)
  with pytest.raises(ValueError, match="shuffled pipeline's position.*config.data.ordered=False"):
    it.set_state(shuffled.get_state())
  # The trainer's check (before any restore): an ordered state into a shuffled run and the reverse.
  (tmp_path / "data").mkdir()
  state_file = tmp_path / "data" / resume.state_file(0, 1)
  state_file.write_text(json.dumps(it.get_state()))
  with pytest.raises(ValueError, match="ordered stream.s position .*config.data.ordered=True"):
    resume.check_iterator_checkpoint(str(tmp_path), shuffled, config)
  with pytest.raises(ValueError, match="ordered stream layout"):
    resume.check_iterator_checkpoint(str(tmp_path), other, config)
  state_file.write_text(json.dumps(shuffled.get_state()))
  with pytest.raises(ValueError, match="shuffled pipeline's position"):
    resume.check_iterator_checkpoint(str(tmp_path), it, config)
  # Datasets that are not a causal LM stream: the field named, nothing read.
  for name in ("c4", "cifar10", "lra_listops", "synthetic_recall"):
    bad = ml_collections.ConfigDict({"data": {"name": name, "seq_len": 16, "ordered": True}})
    with pytest.raises(ValueError, match=rf"config.data.ordered=True needs a causal LM .*'{name}'") as e:
      data.create_dataset(bad, "train", batch_size=2, seed=0, shard_index=0, shard_count=1)
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="shorter than one segment"):
    _iter(config, batch_size=4096)


def test_text_stream_is_the_documents_in_order_tokenized_once(tmp_path, monkeypatch):
  """wiki40b: the documents' [bos] + pieces + [eos] in source order, documents numbered per row from BOS."""
  base = str(tmp_path / "wiki40b")
  testing.write_text("wiki40b", base, seed=5, num_examples=12)
  config = ml_collections.ConfigDict({"data": {"name": "wiki40b", "data_dir": base, "seq_len": 24,
                                               "ordered": True}})
  source = text.text_source(config, "validation")
  tok = text.Tokenize(text.spm_path(config), 200)
  tokens = np.concatenate([tok.map(source[i]) for i in range(len(source))])
  B, L = 3, 24
  n_b = len(tokens) // B
  rows = tokens[:n_b * B].reshape(B, n_b)
  batches = list(data.create_dataset(config, "validation", batch_size=B, seed=0, shard_index=0,
                                     shard_count=1))
  assert len(batches) == (n_b - 1) // L
  for k, b in enumerate(batches):
    np.testing.assert_array_equal(b["inputs"], rows[:, k * L:(k + 1) * L])
    np.testing.assert_array_equal(b["targets"], rows[:, k * L + 1:(k + 1) * L + 1])
    bos = b["inputs"] == tokenizer.BOS_ID
    want = 1 + np.cumsum(bos & (np.arange(L) > 0), axis=1)
    np.testing.assert_array_equal(b["segment_ids"], want)
  assert rows[0, 0] == tokenizer.BOS_ID and max(b["segment_ids"].max() for b in batches) > 1
  # Tokenized once: a second dataset reads the cached stream (tokenizing now would fail).
  cached = list((tmp_path / "wiki40b" / "ordered_tokens" / "wiki40b").glob("validation-*/tokens.npy"))
  assert len(cached) == 1 and np.load(cached[0]).dtype == np.uint16
  ordered._TOKENS.clear()
  monkeypatch.setattr(text.Tokenize, "map", lambda self, record: pytest.fail("tokenized again"))
  again = next(iter(data.create_dataset(config, "validation", batch_size=B, seed=0, shard_index=0,
                                        shard_count=1)))
  np.testing.assert_array_equal(again["inputs"], batches[0]["inputs"])
