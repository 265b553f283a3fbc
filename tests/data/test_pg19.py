"""PG-19: the TFDS reader on a tiny prepared directory, words per token, the ordered evaluation stream's
word counts, word-level perplexity against a hand computation, and (slow) the compressive smoke run on the
stand-in."""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import data
from configs import compressive
from data import ordered, prepare, testing, text, tokenizer
from models import metrics


@pytest.fixture(scope="module")
def pg19_dir(tmp_path_factory):
  """A prepared pg19 TFDS directory (two generated books per split) and its SentencePiece model."""
  root = str(tmp_path_factory.mktemp("pg19"))
  testing.write_text("pg19", root, seed=3, num_examples=6)
  return root


def _config(root: str, **fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {"name": "pg19", "data_dir": root, "seq_len": 32, **fields}})


def test_tfds_reader_reads_book_text_of_every_split(pg19_dir):
  config = _config(pg19_dir)
  info = data.dataset_info(config)
  assert (info.task, info.vocab_size, info.bos_id) == ("lm", 32000, tokenizer.BOS_ID)
  for split in ("train", "validation", "test"):
    source = text.text_source(config, split)
    assert len(source) == 2
    book = source[0]["text"]  # pg19's `book_text`, read as `text`
    assert isinstance(book, bytes) and book.startswith(b"THE BOOK OF ") and len(book.split()) >= 800
  assert prepare.verify("pg19", pg19_dir, {"train": 2, "validation": 2, "test": 2})
  assert "pg19" in ordered.lm_streams()


def test_token_words_credit_each_whitespace_word_to_its_first_piece(pg19_dir):
  sp = tokenizer.load(text.spm_path(_config(pg19_dir)))
  sample = "  kato rime,  sudor\n\nban-dor   \u00e9l\u20ac vu.\tq "
  ids, words = text.token_words(sp, sample)
  assert ids == sp.encode(sample)
  assert words.dtype == np.uint8 and words.shape == (len(ids),)
  assert int(words.sum()) == len(sample.split()) == 7
  pieces = [p.surface for p in sp.encode(sample, out_type="proto").pieces]
  # a piece holding a word's first character counts it; the pieces that continue a word count nothing
  starts = "".join(p for p, w in zip(pieces, words, strict=True) if w)
  assert starts.split() and all(w in (0, 1) for w in words)
  assert [p.lstrip()[:1] for p, w in zip(pieces, words, strict=True) if w] == [w[0] for w in sample.split()]


def test_ordered_evaluation_stream_carries_the_words_of_its_tokens(pg19_dir):
  config = _config(pg19_dir, ordered=True)
  source = text.text_source(config, "validation")
  books = [text.clean_text(source[i]["text"]) for i in range(len(source))]
  tokens, words = ordered.token_stream(config, "validation"), ordered.word_stream(config, "validation")
  assert words.shape == tokens.shape and int(words.sum()) == sum(len(b.split()) for b in books)
  assert not words[tokens == tokenizer.BOS_ID].any() and not words[tokens == tokenizer.EOS_ID].any()
  B, L = 2, 32
  n_b = len(tokens) // B
  rows = words[:n_b * B].reshape(B, n_b)
  batches = list(data.create_dataset(config, "validation", batch_size=B, seed=0, shard_index=0,
                                     shard_count=1))
  assert len(batches) == (n_b - 1) // L
  for k, b in enumerate(batches):
    np.testing.assert_array_equal(b["words"], rows[:, k * L:(k + 1) * L])
  assert ordered.word_stream(config, "train") is None  # nothing reports words in training
  assert "words" not in next(iter(data.create_dataset(config, "train", batch_size=B, seed=0, shard_index=0,
                                                      shard_count=1)))


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """float64 cross-entropy from the definition: log sum exp - the target's logit."""
  m = logits.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def test_word_perplexity_is_summed_nll_over_summed_words_across_batches():
  rng = np.random.default_rng(7)
  batches = [  # (words per token, weights): a weight-0 position's words do not count
    (np.array([[1, 0, 2, 0], [0, 1, 1, 1]], np.float32), np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)),
    (np.array([[0, 0, 1, 0], [1, 0, 0, 1]], np.float32), np.ones((2, 4), np.float32)),
  ]
  totals: dict[str, float] = {}
  nll_total, words_total, per_batch = 0.0, 0.0, []
  for words, weights in batches:
    logits = rng.normal(size=(2, 4, 5))  # [batch, length, vocab]
    inputs = rng.integers(0, 5, size=(2, 4))  # [batch, length]
    batch = {"inputs": jnp.asarray(inputs, jnp.int32), "mask": jnp.ones((2, 4), bool),
             "weights": jnp.asarray(weights), "words": jnp.asarray(words)}
    _, sums = metrics.loss_and_sums("lm", jnp.asarray(logits, jnp.float32), batch)
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    nll = float((_nll(logits, inputs) * weights).sum())
    nll_total, words_total = nll_total + nll, words_total + float((words * weights).sum())
    per_batch.append(math.exp(nll / float((words * weights).sum())))
  assert words_total == 8.0 and totals["word_sum"] == 8.0  # 5 + 3 by hand
  out = metrics.summarize("lm", totals)
  np.testing.assert_allclose(out["word_perplexity"], math.exp(nll_total / words_total), rtol=1e-5)
  assert abs(out["word_perplexity"] - np.mean(per_batch)) > 1e-3 * out["word_perplexity"]
  np.testing.assert_allclose(out["perplexity"], math.exp(nll_total / 15.0), rtol=1e-5)
  without_words = {k: v for k, v in totals.items() if k != "word_sum"}
  assert "word_perplexity" not in metrics.summarize("lm", without_words)


def test_config_variant():
  c = compressive.get_config("pg19")
  assert (c.data.name, c.data.ordered, c.data.seq_len, c.model.num_layers, c.model.features,
          c.model.num_heads, c.model.mlp_dim, c.model.mem_len, c.model.compressed_mem_len) == (
              "pg19", True, 512, 36, 1024, 8, 4096, 512, 512)
  assert (c.model.attention.compression, c.model.attention.compression_rate) == ("conv", 2)
  assert compressive.get_config("").data.name == "enwik8"
  smoke = compressive.get_config("pg19,smoke")
  assert smoke.data.name == "pg19" and smoke.data.stand_in and smoke.model.num_layers == 1


@pytest.mark.slow
def test_compressive_smoke_trains_on_the_stand_in_and_reports_word_perplexity(tmp_path):
  """configs/compressive.py:pg19,smoke through the ordered stream with memories; evaluation's word perplexity
  is exp(loss * tokens / words) over the evaluated tokens."""
  from training import loop

  c = compressive.get_config("pg19,smoke")
  c.train.num_steps = 2
  c.train.eval_batches = 1
  with testing.mock_data("pg19", str(tmp_path / "data")) as data_dir:
    c.data.data_dir = data_dir
    result = loop.train_and_evaluate(c, str(tmp_path / "run"), progress=False)
    assert result["step"] == 2
    m = result["metrics"]  # the final evaluation (eval.py evaluates through the same Experiment.evaluate)
    words = ordered.word_stream(c, c.eval_split)
  b, length = c.train.eval_batch_size, c.data.seq_len
  stream = len(words) // b
  evaluated = sum(float(words[r * stream:r * stream + length].sum()) for r in range(b))  # step 0 of each row
  assert m["num_batches"] == 1 and np.isfinite(m["loss"])
  np.testing.assert_allclose(math.log(m["word_perplexity"]), m["loss"] * b * length / evaluated, rtol=1e-4)
