"""`cnn_dailymail`: news articles and their highlights as documents of sentences, for HIBERT
(models/hibert.py).

Source: TFDS `cnn_dailymail` (3.4.0; features `article`, `highlights`), prepared as ArrayRecord under
`{data_dir}/cnn_dailymail/3.4.0` (`tfds build cnn_dailymail --file_format=array_record --data_dir DIR`), or
the generated stand-in (`write_stand_in`: JSON lines in `{data_dir}/cnn_dailymail_stand_in/`, used when
`config.data.stand_in` and the real data is missing). Tokenizer: the project's SentencePiece
(data/tokenizer.py; pad 0, bos 2, eos 3, [MASK] 4) at `config.data.spm_model`, default
`{data_dir}/spm/cnn_dailymail.model` (train one on articles with `data.tokenizer.train`).

Each article is split into sentences by `split_sentences` (deterministic rules, below), and the first
`max_sentences` (default 30, the paper's document length) are kept; each sentence becomes its first
`seq_len - 1` pieces (default seq_len 50) plus EOS. Per record (`Documents.example`):
  inputs int32 [S, T], mask bool [S, T] (True = real token), sentence_mask bool [S],
  labels int32 [S]: the oracle (`oracle_labels`: greedy selection maximising ROUGE-1 F + ROUGE-2 F of the
    selected sentences against the highlights, as the paper), at most `oracle_sentences` (default 3).
`config.data.task` picks the task: "hibert_pretrain" (masked-sentence prediction, the labels unused) or
"hibert_summarise" (sentence labelling). ROUGE evaluation of the top-3 sentences: training/hibert.py.
"""

from __future__ import annotations

import collections
import json
import os
import re
from typing import Any

import grain
import numpy as np

from data import pipeline, tokenizer
from data.info import DatasetInfo
from runtime import cli

NAME = "cnn_dailymail"
VERSION = "3.4.0"
TASKS = ("hibert_pretrain", "hibert_summarise")
SPLITS = {"train": "train", "validation": "validation", "test": "test"}
SPLIT_SIZES = {"train": 287_113, "validation": 13_368, "test": 11_490}
DEFAULTS = dict(task="hibert_summarise", seq_len=50, max_sentences=30, vocab_size=32000, oracle_sentences=3)
STAND_IN = "cnn_dailymail_stand_in"

# Sentence boundaries: one or more of .!? (then closing quotes/brackets) followed by whitespace and an opening
# quote/bracket or an upper-case letter or digit; every line break is also a boundary. A period right after a
# listed abbreviation or a single capital letter (an initial) is not a boundary.
_BOUNDARY = re.compile(r"""[.!?]+["')\]]*(?=\s+["'(\[]?[A-Z0-9])""")
_ABBREVIATIONS = frozenset("mr mrs ms dr prof st jr sr gen gov sen rep lt col sgt capt no vs u.s".split())
_WORDS = re.compile(r"[a-z0-9]+")


def _field(config: Any, key: str) -> Any:
  return pipeline.cfg_get(config, key, DEFAULTS[key])


def split_sentences(text: str) -> list[str]:
  """The sentences of `text` by the rules above, stripped, empty ones dropped."""
  out = []
  for line in text.splitlines():
    start = 0
    for m in _BOUNDARY.finditer(line):
      before = line[start:m.start()].split()
      last = before[-1].lower().rstrip(".") if before else ""
      if m.group().startswith(".") and (last in _ABBREVIATIONS or re.fullmatch(r"[a-z]", last)):
        continue
      out.append(line[start:m.end()].strip())
      start = m.end()
    out.append(line[start:].strip())
  return [s for s in out if s]


def words(text: str) -> list[str]:
  """ROUGE's words for the oracle: lower-cased runs of ASCII letters and digits (rouge-score's tokenizer,
  no stemming)."""
  return _WORDS.findall(text.lower())


def _ngrams(tokens: list[str], n: int) -> collections.Counter:
  return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def rouge_n_f(candidate: list[str], reference: list[str], n: int) -> float:
  """ROUGE-N F1 of `candidate` against `reference` (word lists)."""
  c, r = _ngrams(candidate, n), _ngrams(reference, n)
  overlap = sum((c & r).values())
  if not overlap:
    return 0.0
  p, rec = overlap / sum(c.values()), overlap / sum(r.values())
  return 2 * p * rec / (p + rec)


def oracle_labels(sentences: list[str], summary: str, max_selected: int = 3) -> list[int]:
  """Greedy oracle: add the sentence that most raises ROUGE-1 F + ROUGE-2 F of the selection (read in
  document order) against `summary`, until none raises it or `max_selected` are chosen; 0/1 per sentence."""
  ref = words(summary)
  sent_words = [words(s) for s in sentences]
  chosen: list[int] = []
  best = 0.0
  while len(chosen) < max_selected:
    pick, pick_score = None, best
    for i in range(len(sentences)):
      if i in chosen:
        continue
      cand = [w for j in sorted(chosen + [i]) for w in sent_words[j]]
      score = rouge_n_f(cand, ref, 1) + rouge_n_f(cand, ref, 2)
      if score > pick_score:
        pick, pick_score = i, score
    if pick is None:
      break
    chosen.append(pick)
    best = pick_score
  return [int(i in chosen) for i in range(len(sentences))]


def _missing(message: str) -> FileNotFoundError:
  from runtime import cli

  return cli.mark_usage(FileNotFoundError(message))


def data_dir(config: Any) -> str:
  return os.path.expanduser(pipeline.cfg_get(config, "data_dir", "~/tensorflow_datasets"))


def spm_path(config: Any) -> str:
  return os.path.expanduser(pipeline.cfg_get(config, "spm_model",
                                             os.path.join(data_dir(config), "spm", f"{NAME}.model")))


def dataset_info(config: Any) -> DatasetInfo:
  task = str(_field(config, "task"))
  if task not in TASKS:
    raise ValueError(f"config.data.task must be one of {TASKS} for {NAME}, got {task!r}")
  vocab = int(_field(config, "vocab_size"))
  return DatasetInfo(name=NAME, task=task, vocab_size=vocab, seq_len=int(_field(config, "seq_len")),
                     input_vocab_size=vocab, pad_id=tokenizer.PAD_ID, bos_id=tokenizer.BOS_ID,
                     eos_id=tokenizer.EOS_ID, mask_id=tokenizer.MASK_ID,
                     max_segments=int(_field(config, "max_sentences")),
                     metric="perplexity" if task == "hibert_pretrain" else "accuracy",
                     split_sizes=dict(SPLIT_SIZES))


class JsonLines:
  """Random-access records {"article", "highlights"} of a JSON-lines file (the stand-in)."""

  def __init__(self, path: str):
    with open(path, encoding="utf-8") as f:
      self.records = [json.loads(line) for line in f if line.strip()]
    self.path = path

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int) -> dict[str, str]:
    return self.records[index]

  def __repr__(self) -> str:
    return f"JsonLines({self.path!r}, {len(self.records)})"


def source(config: Any, split: str) -> Any:
  """The split's raw records: the stand-in's JSON lines when present, else the prepared TFDS directory."""
  if split not in SPLITS:
    raise cli.mark_usage(ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}"))
  stand_in = os.path.join(data_dir(config), STAND_IN, f"{split}.jsonl")
  if os.path.exists(stand_in):
    return JsonLines(stand_in)
  path = os.path.join(data_dir(config), NAME, VERSION)
  if not os.path.exists(os.path.join(path, "dataset_info.json")):
    raise _missing(f"prepared tfds directory for {NAME!r} not found at {path}; build it with: tfds build "
                   f"{NAME} --file_format=array_record --data_dir {data_dir(config)}")
  import tensorflow_datasets as tfds

  return tfds.builder_from_directory(path).as_data_source(SPLITS[split])


def _text(value: Any) -> str:
  return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


class Documents:
  """Record -> the arrays of one document (module docstring); also its sentence texts for ROUGE."""

  def __init__(self, config: Any):
    self.model_path = spm_path(config)
    if not os.path.exists(self.model_path):
      raise _missing(f"SentencePiece model for {NAME!r} not found at {self.model_path}; train one on the "
                     f"articles with data.tokenizer.train, or name it in config.data.spm_model")
    sp = tokenizer.load(self.model_path)
    tokenizer.check(sp, self.model_path)
    vocab = int(_field(config, "vocab_size"))
    if sp.get_piece_size() > vocab:
      raise ValueError(f"{self.model_path} has {sp.get_piece_size()} pieces, more than "
                       f"config.data.vocab_size={vocab}")
    self.seq_len, self.max_sentences = int(_field(config, "seq_len")), int(_field(config, "max_sentences"))
    self.oracle = int(_field(config, "oracle_sentences"))

  def sentences(self, record: Any) -> tuple[list[str], str]:
    """The kept sentences of the article and the highlights text."""
    return split_sentences(_text(record["article"]))[:self.max_sentences], _text(record["highlights"])

  def example(self, record: Any) -> dict[str, np.ndarray]:
    sentences, summary = self.sentences(record)
    s, t = self.max_sentences, self.seq_len
    sp = tokenizer.load(self.model_path)
    ids = np.zeros((s, t), np.int32)
    mask = np.zeros((s, t), bool)
    for i, pieces in enumerate(sp.encode(sentences)):
      row = list(pieces)[:t - 1] + [tokenizer.EOS_ID]
      ids[i, :len(row)], mask[i, :len(row)] = row, True
    labels = np.zeros(s, np.int32)
    labels[:len(sentences)] = oracle_labels(sentences, summary, self.oracle)
    return {"inputs": ids, "mask": mask, "sentence_mask": mask.any(axis=1), "labels": labels}


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index: int | None = None,
                   shard_count: int | None = None, shuffle: bool | None = None,
                   num_epochs: int | None = None) -> grain.IterDataset:
  src = source(config, split)
  docs = Documents(config)
  return pipeline.make_loader(src, [pipeline.Example(docs.example)], split=split, batch_size=batch_size,
                              seed=seed, shard_index=shard_index, shard_count=shard_count, shuffle=shuffle,
                              num_epochs=num_epochs, config=config)


# ------------------------------------------------------------------------------------------------------------
# The generated stand-in


_SYLLABLES = ("ka", "to", "ri", "me", "su", "na", "lo", "pe", "zi", "vu", "ban", "dor", "el", "qui", "stra")


def _pseudo_words(rng: np.random.Generator, n: int) -> str:
  """n pseudo-words of 1-3 syllables, Zipf-distributed (structure for SentencePiece to learn)."""
  def word() -> str:
    return "".join(_SYLLABLES[int(rng.zipf(1.5)) % len(_SYLLABLES)] for _ in range(int(rng.integers(1, 4))))

  return " ".join(word() for _ in range(n))


def stand_in_records(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
  """n articles of 4-14 pseudo-word sentences; the highlights restate 2-3 of them (one rephrased by dropping
  a word), so the oracle has something to find."""
  out = []
  for _ in range(n):
    sents = []
    for _ in range(int(rng.integers(4, 15))):
      body = _pseudo_words(rng, int(rng.integers(4, 12)))
      sents.append(body[:1].upper() + body[1:] + ".")
    picks = sorted(rng.choice(len(sents), size=min(len(sents), int(rng.integers(2, 4))), replace=False))
    summary = [sents[i] for i in picks]
    summary[0] = " ".join(summary[0].split()[1:]) or summary[0]
    out.append({"article": " ".join(sents), "highlights": "\n".join(summary)})
  return out


def write_stand_in(root: str, *, seed: int = 0, num_examples: int = 24, spm_vocab: int = 128) -> str:
  """`{root}/cnn_dailymail_stand_in/{split}.jsonl` and `{root}/spm/cnn_dailymail.model`; returns root."""
  rng = np.random.default_rng(seed)
  os.makedirs(os.path.join(root, STAND_IN), exist_ok=True)
  corpus = []
  for split in SPLITS:
    records = stand_in_records(rng, num_examples)
    with open(os.path.join(root, STAND_IN, f"{split}.jsonl"), "w", encoding="utf-8") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")
    corpus += [r["article"] for r in records] if split == "train" else []
  tokenizer.train(corpus, os.path.join(root, "spm", f"{NAME}.model"), vocab_size=spm_vocab,
                  character_coverage=1.0)
  return root
