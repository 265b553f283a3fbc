"""Text pipelines on generated corpora (offline): SentencePiece, LM and MLM packing, MLM corruption, the
global packed training stream and its resume on another host count."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import data
from data import resume, text, tokenizer
from tests.data.readers import data_config, split_batches


def test_sentencepiece_trained_on_generated_corpus(text_dirs):
  model = os.path.join(text_dirs["wiki40b"], "spm", "wiki40b.model")
  sp = tokenizer.load(model)
  assert sp.get_piece_size() == 200
  assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.piece_to_id("[MASK]")) == (0, 2, 3, 4)
  sample = "kato rime subanna"
  assert sp.decode(sp.encode(sample)) == sample
  assert text.clean_text("_START_ARTICLE_\nT\n_START_PARAGRAPH_\na_NEWLINE_b") == "T\na\nb"


def _stream(config, split):
  """The documents of `split` in source order, tokenized as the pipeline does."""
  source = text.text_source(config, split)
  tok = text.Tokenize(text.spm_path(config), 200)
  return [tok.map(source[i]) for i in range(len(source))]


def test_lm_packing_respects_document_boundaries(text_dirs):
  config = data_config("wiki40b", text_dirs["wiki40b"], seq_len=48)
  info = data.dataset_info(config)
  assert (info.task, info.bos_id, info.eos_id, info.metric) == ("lm", 2, 3, "perplexity")
  docs = _stream(config, "validation")
  batches = split_batches(config, batch_size=3)
  # Rebuild the documents from the batches: segments in order; a batch's last segment may be cut (counted).
  pieces = []
  for b in batches:
    assert b["inputs"].shape == (3, 48)
    for row in range(3):
      segs = b["segment_ids"][row]
      assert (segs[b["mask"][row]] > 0).all() and not segs[~b["mask"][row]].any()
      assert (np.diff(segs[b["mask"][row]]) >= 0).all()
      for s in np.unique(segs[segs > 0]):
        where = np.flatnonzero(segs == s)
        assert (np.diff(where) == 1).all()
        np.testing.assert_array_equal(b["weights"][row][where], [0.0] + [1.0] * (len(where) - 1))
        pieces.append(b["inputs"][row][where])
  flat = np.concatenate(pieces)
  stream = np.concatenate(docs)
  # Each document starts with bos: its segment start (weight 0) never gets predicted across a boundary.
  assert flat[0] == tokenizer.BOS_ID
  got = [list(p) for p in pieces]
  # Documents are consecutive in the stream; dropped tails only at batch ends, so every piece is a substring.
  pos = 0
  for p in got:
    idx = _find(stream, np.asarray(p), pos)
    assert idx >= 0
    pos = idx + len(p)
  assert len(flat) <= len(stream)
  assert sum(b["weights"].sum() for b in batches) == sum(
    (b["mask"] & ~text.segment_starts(b["segment_ids"])).sum() for b in batches)


def _find(hay: np.ndarray, needle: np.ndarray, start: int) -> int:
  for i in range(start, len(hay) - len(needle) + 1):
    if hay[i] == needle[0] and np.array_equal(hay[i:i + len(needle)], needle):
      return i
  return -1


@pytest.mark.parametrize("name", ["wiki40b", "c4"])
def test_packed_text_training_stream_is_global_and_resumes_on_another_host_count(text_dirs, tmp_path, name):
  """1, 2 and 4 hosts read the same packed global batches (each its rows); a 2-host state continues as 1."""
  config = data_config(name, text_dirs[name], seq_len=32)
  steps, global_batch = 5, 4

  def hosts(count):
    iters = [iter(data.create_dataset(config, "train", batch_size=global_batch // count, seed=3,
                                      shard_index=i, shard_count=count)) for i in range(count)]
    return iters

  def global_batches(iters, n):
    out = []
    for _ in range(n):
      parts = [next(it) for it in iters]
      out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return out

  one = global_batches(hosts(1), steps)
  for count in (2, 4):
    for got, want in zip(global_batches(hosts(count), steps), one, strict=True):
      for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} {count} hosts: {k}")

  two = hosts(2)
  global_batches(two, 2)
  step_dir = tmp_path / "step"
  (step_dir / "data").mkdir(parents=True)
  for i, it in enumerate(two):  # what grain's orbax handler writes per host
    (step_dir / "data" / resume.state_file(i, 2)).write_text(json.dumps(it.get_state()))
  resumed = hosts(1)
  resume.check_iterator_checkpoint(str(step_dir), resumed[0], config)
  resume.restore_iterator(str(step_dir), resumed[0])
  for got, want in zip(global_batches(resumed, steps - 2), one[2:], strict=True):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} resumed: {k}")


def test_mlm_packing_two_segments_and_corruption(text_dirs):
  config = data_config("c4", text_dirs["c4"], seq_len=64)
  info = data.dataset_info(config)
  assert (info.task, info.mask_id, info.max_segments) == ("mlm", 4, 2)
  docs = _stream(config, "validation")
  batches = split_batches(config, batch_size=4)
  targets = []
  for b in batches:
    assert b["segment_ids"].max() <= 2
    chosen = b["weights"] > 0
    assert (b["mask"] | ~chosen).all()  # only real tokens are predicted
    assert not np.isin(b["targets"][chosen], [0, 2, 3]).any()  # never pad/bos/eos
    same = b["inputs"] == b["targets"]
    assert same[~chosen].all()  # unchosen positions are untouched
    for row in range(4):
      for s in (1, 2):
        seg = b["segment_ids"][row] == s
        if seg.any():
          targets.append(b["targets"][row][seg])
  for i, t in enumerate(targets):  # rows hold whole or truncated documents, in order
    np.testing.assert_array_equal(t, docs[i][: len(t)])


def test_mlm_corruption_ratios_on_a_large_sample():
  rng = np.random.default_rng(0)
  inputs = rng.integers(5, 1000, size=(200, 1000)).astype(np.int32)
  inputs[:, 0], inputs[:, -1] = tokenizer.BOS_ID, tokenizer.EOS_ID
  mask = np.ones_like(inputs, bool)
  mask[:, -100:] = False
  out, weights = text.mlm_corrupt(inputs, mask, np.random.default_rng(1), vocab_size=1000)
  chosen = weights > 0
  eligible = mask.copy()
  eligible[:, 0] = False
  assert not (chosen & ~eligible).any()
  assert chosen.sum() / eligible.sum() == pytest.approx(0.15, abs=0.003)
  masked = (out == tokenizer.MASK_ID) & chosen
  kept = (out == inputs) & chosen
  n = chosen.sum()
  assert masked.sum() / n == pytest.approx(0.8, abs=0.01)
  assert kept.sum() / n == pytest.approx(0.1 + 0.1 / 995, abs=0.01)
  randomized = chosen & ~masked & ~kept
  assert randomized.sum() / n == pytest.approx(0.1, abs=0.01)
  assert out[randomized].min() >= tokenizer.FIRST_PIECE_ID and out[randomized].max() < 1000
