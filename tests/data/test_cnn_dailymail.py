"""cnn_dailymail for HIBERT (data/cnn_dailymail.py): the sentence splitter, ROUGE-N and the greedy oracle
against hand computations, the per-document arrays and the stand-in pipeline; the ROUGE evaluation's
selection (training/hibert.py)."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from data import cnn_dailymail, tokenizer
from training import hibert


def test_split_sentences():
  text = ('Mr. Smith went to Washington. He said "Hi!" Then J. K. Rowling left at 3.5 p.m. today? Yes.\n'
          "A new line without a period\n\n(Bracketed start.) (Another one.)")
  assert cnn_dailymail.split_sentences(text) == [
      "Mr. Smith went to Washington.", 'He said "Hi!"', "Then J. K. Rowling left at 3.5 p.m. today?", "Yes.",
      "A new line without a period", "(Bracketed start.)", "(Another one.)"]


def test_rouge_n_by_hand():
  cand, ref = "the cat sat".split(), "the cat sat on the mat".split()
  assert cnn_dailymail.rouge_n_f(cand, ref, 1) == pytest.approx(2 / 3)  # P 3/3, R 3/6
  assert cnn_dailymail.rouge_n_f(cand, ref, 2) == pytest.approx(4 / 7)  # P 2/2, R 2/5
  assert cnn_dailymail.rouge_n_f(["dog"], ref, 1) == 0.0


def test_rouge_n_matches_rouge_score():
  from rouge_score import rouge_scorer

  scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2"], use_stemmer=False)
  rng = np.random.default_rng(0)
  lexicon = "a b c d e f g h".split()
  for _ in range(20):
    cand = " ".join(rng.choice(lexicon, int(rng.integers(1, 12))))
    ref = " ".join(rng.choice(lexicon, int(rng.integers(1, 12))))
    got = scorer.score(ref, cand)
    for n in (1, 2):
      want = got[f"rouge{n}"].fmeasure
      assert cnn_dailymail.rouge_n_f(cnn_dailymail.words(cand), cnn_dailymail.words(ref), n) == \
          pytest.approx(want)


def test_oracle_greedy_by_hand():
  # Step 1: "The cat sat." and "On the mat." tie at R1 2/3 + R2 4/7 (the first is kept); step 2: both give
  # the summary exactly (2.0); step 3: the third only lowers it, so the selection stops.
  sentences = ["The cat sat.", "On the mat.", "Dogs bark loudly."]
  assert cnn_dailymail.oracle_labels(sentences, "the cat sat on the mat") == [1, 1, 0]
  assert cnn_dailymail.oracle_labels(sentences, "the cat sat on the mat", max_selected=1) == [1, 0, 0]
  # "Dogs bark." alone scores 2.0; adding "Dogs bark loudly." (read first) drops R1 to 4/7: one sentence.
  three = ["The cat.", "Dogs bark loudly.", "Dogs bark."]
  assert cnn_dailymail.oracle_labels(three, "dogs bark") == [0, 0, 1]
  assert cnn_dailymail.oracle_labels(["Nothing here."], "dogs bark") == [0]


def test_select_top_sentences_in_document_order():
  scores = np.array([[0.1, 0.9, 0.5, 0.7, 2.0], [3.0, 1.0, 2.0, 0.0, 0.0]])
  real = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool)
  assert hibert.select(scores, real, 3) == [[1, 2, 3], [0, 1]]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
  return cnn_dailymail.write_stand_in(str(tmp_path_factory.mktemp("cnn")), num_examples=8)


def config(data_dir: str, **kw) -> ml_collections.ConfigDict:
  data = {"name": "cnn_dailymail", "data_dir": data_dir, "seq_len": 6, "max_sentences": 5, "vocab_size": 128,
          "task": "hibert_summarise", **kw}
  return ml_collections.ConfigDict({"data": data})


def test_document_arrays_and_pipeline(stand_in):
  import data

  cfg = config(stand_in)
  docs = cnn_dailymail.Documents(cfg)
  records = cnn_dailymail.source(cfg, "validation")
  sp = tokenizer.load(docs.model_path)
  for record in [records[i] for i in range(len(records))]:
    ex = docs.example(record)
    sentences, summary = docs.sentences(record)
    assert len(sentences) == min(5, len(cnn_dailymail.split_sentences(record["article"])))
    np.testing.assert_array_equal(ex["sentence_mask"], np.arange(5) < len(sentences))
    for i, sentence in enumerate(sentences):
      pieces = sp.encode(sentence)[:5] + [tokenizer.EOS_ID]
      np.testing.assert_array_equal(ex["inputs"][i][ex["mask"][i]], pieces)
    assert not ex["mask"][len(sentences):].any() and not ex["inputs"][~ex["mask"]].any()
    want = cnn_dailymail.oracle_labels(sentences, summary)
    np.testing.assert_array_equal(ex["labels"][:len(sentences)], want)
  info = data.dataset_info(config(stand_in, task="hibert_pretrain"))
  assert (info.task, info.seq_len, info.max_segments, info.mask_id) == ("hibert_pretrain", 6, 5, 4)
  batch = next(iter(data.create_dataset(cfg, "train", batch_size=4, seed=0, shard_index=0, shard_count=1)))
  assert batch["inputs"].shape == (4, 5, 6) and batch["labels"].shape == (4, 5) and batch["valid"].all()
