"""Wiki-40B and PG-19 (autoregressive LM) and C4 (masked LM), SentencePiece-tokenized and packed to
config.data.seq_len; IMDB and SST-5 (classification) tokenized the same way, one example per record.

Storage: the TFDS-prepared ArrayRecord directory `{data_dir}/wiki40b/en/1.3.0` / `{data_dir}/c4/en/3.1.0` /
`{data_dir}/pg19/0.1.1` (written by `python -m data.prepare`, which needs TensorFlow (+ Beam for wiki40b and
c4); reading needs neither), opened with `tfds.builder_from_directory(...).as_data_source(split)` because
these builders are not registered in a TensorFlow-free install. Tokenizer: `config.data.spm_model`, default
`{data_dir}/spm/<name>.model` (32K pieces, trained by data.prepare from the training split; special ids in
data.tokenizer).

PG-19 (Rae et al., 2019; TFDS `pg19`, one book per record in its `book_text` feature, read here as `text`)
is a spec of this module rather than a module of its own: it is a TFDS text set of task "lm" like wiki40b, so
the reader, the tokenizer training of data.prepare and the ordered stream (data.ordered) serve it as they
are. Tokenizer: a 32K SentencePiece model like wiki40b's, not the paper's 32K TFDS SubwordTextEncoder (the
codebase has one tokenizer machinery; perplexities per token therefore differ from the paper's, per word
they are comparable). Books are long (~69K words on average): train it with `config.data.ordered=True`
(the Transformer-XL order the Compressive Transformer reads books in); the shuffled packing below also
runs but keeps only the start of each book (a document that overflows a batch's last row loses the rest)
and carries no word counts. Word-level perplexity (`word_counts`): the ordered stream of a split that is
not a training split carries `words` [B, L], the whitespace-separated words (`str.split()`) of the book text
(after `clean_text`, which keeps a book's words) credited to the token holding each word's first character
(bos/eos 0), so the words of the evaluated tokens sum to the words of the evaluated text and models.metrics
reports `word_perplexity` = exp(summed token NLL / summed words).

Each document becomes `[bos] + pieces + [eos]`. Packing (per global batch, in the record order; see
`create_dataset` for how hosts share a training stream):
  lm (wiki40b): documents are laid end to end across the B rows of a batch of length L; a document that
    reaches the end of a row continues in the next row. segment_ids number the document pieces of each row 1,
    2, ...; weights are 1 on every real position except the first position of each segment, which would
    otherwise be predicted from another document (or from nothing, at a row start): the loss never crosses a
    boundary. The remainder of the document that overflows a batch's last row is dropped and counted, so every
    batch is a function of a contiguous run of records and the iterator state resumes exactly.
  mlm (c4): at most `max_segments` (2, Appendix E.5) documents per row; a document longer than the room left
    in its row is truncated (counted); the rest of the row is padding. 15% of the real non-special tokens are
    predicted (weights 1, targets = originals); of those 80% become [MASK], 10% a random ordinary piece, 10%
    stay. The randomness is seeded by (seed, record index), so it is identical after a resume.
Classification (task "classify"; the BP-Transformer paper's sentence and document classification, see
configs/bp_transformer.py): `imdb` (TFDS `imdb_reviews/plain_text`, the reviews LRA's Text task reads as
bytes; `<br />` tags become line breaks) and `sst5` (SST fine-grained, TFDS community dataset
`huggingface:sst`, config `default`: `sentence` and a float sentiment `label` in [0, 1], binned into 5 classes
by `sst5_class`) are read through the same prepared TFDS directory and a SentencePiece model trained on their
training split at prepare time (`{data_dir}/spm/imdb.model`, 32K pieces; `sst5.model`, 8K pieces). An
example is `[bos] + pieces`, truncated to seq_len (counted), padded with a mask, and its class `label`; the
bos token (`cls_id`) sits at position 0 for CLS pooling. IMDB has no validation split: like the paper's code
(a 90/10 split of the training reviews), validation is the last 10% of TFDS's training split and training
the first 90%; test is the 25,000 test reviews.

Wiki-40B markup (_START_ARTICLE_, _START_SECTION_, _START_PARAGRAPH_, _NEWLINE_) becomes line breaks.
Attention masks only padding (the op contract has a key mask, no segment mask), so a token may attend to an
earlier document of its row, as in GPT-style concatenation; bos/eos mark the boundary and `segment_ids` is
there for models that want segment embeddings or a segment-aware right shift.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from data import order as data_order
from data import pipeline, tokenizer
from data.info import DatasetInfo
from runtime import cli, paths

SPECS: dict[str, dict[str, Any]] = {
  "wiki40b": dict(tfds_name="wiki40b/en", version="1.3.0", task="lm", max_segments=None,
                  splits={"train": "train", "validation": "validation", "test": "test"},
                  split_sizes={"train": 2_926_536, "validation": 163_597, "test": 162_274}),
  "c4": dict(tfds_name="c4/en", version="3.1.0", task="mlm", max_segments=2,
             splits={"train": "train", "validation": "validation", "test": "validation"},
             split_sizes={"train": 364_868_892, "validation": 364_608}),
  # books per split from recollection of the PG-19 paper; spm_docs: books for SentencePiece (~400 KB each)
  "pg19": dict(tfds_name="pg19", version="0.1.1", task="lm", max_segments=None, text_field="book_text",
               beam=False, spm_docs=2000, word_counts=True,
               splits={"train": "train", "validation": "validation", "test": "test"},
               split_sizes={"train": 28_602, "validation": 50, "test": 100}),
  # Classification (task "classify"): `label_field` holds the class (sst5: a float binned by sst5_class),
  # `markup` is replaced by a line break before tokenizing (training the SentencePiece model too).
  "imdb": dict(tfds_name="imdb_reviews/plain_text", version="1.0.0", task="classify", max_segments=None,
               beam=False, spm_docs=25_000, vocab_size=32000, num_classes=2, markup=r"<br\s*/?>",
               splits={"train": "train[:90%]", "validation": "train[90%:]", "test": "test"},
               split_sizes={"train": 22_500, "validation": 2_500, "test": 25_000}),
  "sst5": dict(tfds_name="sst/default", version="1.0.0", build_name="huggingface:sst/default",
               task="classify", max_segments=None, beam=False, spm_docs=8_544, vocab_size=8000,
               num_classes=5, text_field="sentence", label_binning="sst5",
               splits={"train": "train", "validation": "validation", "test": "test"},
               split_sizes={"train": 8_544, "validation": 1_101, "test": 2_210}),
}
# SST's fine-grained classes from its sentiment value v in [0, 1]: [0, 0.2] very negative, (0.2, 0.4]
# negative, (0.4, 0.6] neutral, (0.6, 0.8] positive, (0.8, 1] very positive (compared in float32, the
# stored type, so that a value stored as 0.2 falls in the first class).
SST5_CUTS = np.asarray([0.2, 0.4, 0.6, 0.8], np.float32)
DEFAULT_VOCAB = 32000
_MARKUP = re.compile(r"_START_(?:ARTICLE|SECTION|PARAGRAPH)_")
_WORD = re.compile(r"\S+")  # a whitespace-separated word, as str.split() finds them


def _spec(config: Any) -> dict[str, Any]:
  name = config.data.name
  if name not in SPECS:
    raise ValueError(f"data.text handles {sorted(SPECS)}, got {name!r}")
  return SPECS[name]


def data_dir(config: Any) -> str:
  return os.path.expanduser(pipeline.cfg_get(config, "data_dir", "~/tensorflow_datasets"))


def prepared_dir(config: Any) -> str:
  """`{data_dir}/<tfds name>/<version>`; config.data.tfds_version overrides the version."""
  spec = _spec(config)
  version = pipeline.cfg_get(config, "tfds_version", spec["version"])
  return os.path.join(data_dir(config), spec["tfds_name"], version)


def spm_path(config: Any) -> str:
  return os.path.expanduser(pipeline.cfg_get(
      config, "spm_model", os.path.join(data_dir(config), "spm", f"{config.data.name}.model")))


def sst5_class(value: float) -> int:
  """SST's sentiment value in [0, 1] -> its fine-grained class 0..4 (SST5_CUTS; right-closed bins)."""
  return int(np.searchsorted(SST5_CUTS, np.float32(value), side="left"))


def default_vocab(name: str) -> int:
  """The SentencePiece size data.prepare trains for `name` (and its configs read)."""
  return int(SPECS[name].get("vocab_size", DEFAULT_VOCAB))


def clean_text(text: str | bytes) -> str:
  if isinstance(text, bytes):
    text = text.decode("utf-8", errors="replace")
  text = _MARKUP.sub("\n", text.replace("_NEWLINE_", "\n"))
  return re.sub(r"\n{2,}", "\n", text).strip()


def document_text(config: Any, record: dict) -> str:
  """A record's text as it is tokenized (and as data.prepare trains the tokenizer on it): `clean_text`,
  after the spec's `markup` (imdb: `<br />`) becomes a line break."""
  text = record["text"]
  markup = _spec(config).get("markup")
  if markup:
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    text = re.sub(markup, "\n", text)
  return clean_text(text)


class RenamedText:
  """A TFDS data source whose records keep their text in `field` (pg19: `book_text`), read as `text`; the
  fields named in `keep` (sst5: `label`) come along."""

  def __init__(self, source, field: str, keep: tuple[str, ...] = ()):
    self.source, self.field, self.keep = source, field, tuple(keep)

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index):
    record = self.source[index]
    return {"text": record[self.field], **{k: record[k] for k in self.keep}}

  def __getitems__(self, indices):
    return [self[i] for i in indices]

  def __repr__(self) -> str:  # grain compares it on restore
    return f"RenamedText({self.source!r}, field={self.field!r})"


def text_source(config: Any, split: str):
  """The random-access source of raw documents (dicts with a `text` field) of one split."""
  import tensorflow_datasets as tfds

  spec = _spec(config)
  base, sep, rest = split.partition("[")
  if base not in spec["splits"]:
    raise cli.mark_usage(ValueError(f"split must be one of {sorted(spec['splits'])}, got {split!r}"))
  path = prepared_dir(config)
  if not paths.exists(paths.join(path, "dataset_info.json")):  # local or gs://
    raise pipeline.missing(path, config.data.name, pipeline.cfg_get(config, "data_dir"),
                           what=f"prepared tfds directory of {spec['tfds_name']}")
  source = tfds.builder_from_directory(path).as_data_source(spec["splits"][base] + sep + rest)
  field = spec.get("text_field", "text")
  keep = ("label",) if spec["task"] == "classify" else ()
  return source if field == "text" else RenamedText(source, field, keep=keep)


def counts_words(config: Any) -> bool:
  """Whether `config.data.name` defines a word count (word-level perplexity): pg19."""
  return bool(_spec(config).get("word_counts", False))


def token_words(sp, text: str) -> tuple[list[int], np.ndarray]:
  """(piece ids, uint8 [pieces] words): the whitespace-separated words of `text` (`str.split()`), each
  credited to the piece holding its first character, so `words.sum() == len(text.split())`."""
  proto = sp.encode(text, out_type="proto")
  ids = [p.id for p in proto.pieces]
  begins = np.asarray([p.begin for p in proto.pieces], np.int64)  # [pieces] byte offsets into text
  chars = np.frombuffer(text.encode("utf-32-le"), np.uint32)  # [characters] code points
  nbytes = 1 + (chars >= 0x80) + (chars >= 0x800) + (chars >= 0x10000)  # UTF-8 bytes per character
  byte_at = np.concatenate([[0], np.cumsum(nbytes)])  # [characters + 1]
  starts = byte_at[[m.start() for m in _WORD.finditer(text)]]  # [words] byte offset of each word
  piece = np.searchsorted(begins, starts, side="right") - 1  # [words] the last piece beginning at or before
  words = np.bincount(np.maximum(piece, 0), minlength=len(ids))[:len(ids)]  # [pieces]
  if words.size and words.max() > 255:
    raise ValueError(f"a piece holds {words.max()} word starts; word counts are stored as uint8")
  return ids, words.astype(np.uint8)


def dataset_info(config: Any) -> DatasetInfo:
  spec = _spec(config)
  seq_len = int(pipeline.cfg_get(config, "seq_len", 2048))
  vocab = int(pipeline.cfg_get(config, "vocab_size", default_vocab(config.data.name)))
  if spec["task"] == "classify":
    return DatasetInfo(
      name=config.data.name, task="classify", vocab_size=vocab, seq_len=seq_len, input_vocab_size=vocab,
      num_classes=spec["num_classes"], pad_id=tokenizer.PAD_ID, bos_id=tokenizer.BOS_ID,
      eos_id=tokenizer.EOS_ID, cls_id=tokenizer.BOS_ID, metric="accuracy",
      split_sizes=dict(spec["split_sizes"]))
  return DatasetInfo(
    name=config.data.name, task=spec["task"], vocab_size=vocab, seq_len=seq_len, input_vocab_size=vocab,
    pad_id=tokenizer.PAD_ID, bos_id=tokenizer.BOS_ID, eos_id=tokenizer.EOS_ID,
    mask_id=tokenizer.MASK_ID if spec["task"] == "mlm" else None,
    metric="perplexity",
    max_segments=int(pipeline.cfg_get(config, "max_segments", spec["max_segments"] or 0)) or None,
    split_sizes=dict(spec["split_sizes"]),
  )


def check_model(model_path: str, vocab_size: int) -> None:
  """The SentencePiece model at `model_path` has the project's special ids (tokenizer.check) and at most
  config.data.vocab_size pieces (its ids index the embedding)."""
  sp = tokenizer.load(model_path)
  tokenizer.check(sp, model_path)
  if sp.get_piece_size() > vocab_size:
    raise ValueError(f"{model_path} has {sp.get_piece_size()} pieces, more than config.data.vocab_size="
                     f"{vocab_size}")


class Tokenize(grain.transforms.Map):
  """Raw record -> int32 [bos] + pieces + [eos].

  `max_chars` (mlm only, where a row keeps at most seq_len tokens of a document) cuts the text before
  encoding: 16 characters per token of room is far more than English pieces use, so only text that would be
  truncated anyway is skipped (counted in the log), and tokenizing a 100 KB page for 2048 tokens is avoided.
  """

  def __init__(self, model_path: str, vocab_size: int, max_chars: int | None = None):
    self.model_path = model_path
    self.max_chars = max_chars
    self.counter = pipeline.Counter("documents cut before tokenization (beyond any row's room)", every=10_000)
    check_model(model_path, vocab_size)

  def map(self, record) -> np.ndarray:
    text = clean_text(record["text"])
    if self.max_chars is not None and len(text) > self.max_chars:
      self.counter.add("cut")
      text = text[: self.max_chars]
    ids = tokenizer.load(self.model_path).encode(text)
    return np.asarray([tokenizer.BOS_ID] + ids + [tokenizer.EOS_ID], np.int32)

  def map_with_words(self, record) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [n] tokens as `map` gives them, uint8 [n] words per token, 0 for bos/eos; `token_words`)."""
    ids, words = token_words(tokenizer.load(self.model_path), clean_text(record["text"]))
    tokens = np.asarray([tokenizer.BOS_ID] + ids + [tokenizer.EOS_ID], np.int32)  # [n]
    return tokens, np.concatenate([[0], words, [0]]).astype(np.uint8)  # [n]


class Classify:
  """A classification record -> {inputs [seq_len] (`[bos] + pieces`, truncated and counted), mask, label}."""

  def __init__(self, config: Any, model_path: str, info: DatasetInfo):
    self.config, self.model_path, self.seq_len = config, model_path, info.seq_len
    self.binning = _spec(config).get("label_binning")
    self.counter = pipeline.Counter(f"{config.data.name}: examples truncated to seq_len")
    check_model(model_path, info.vocab_size)

  def __call__(self, record) -> dict[str, np.ndarray]:
    ids = tokenizer.load(self.model_path).encode(document_text(self.config, record))
    tokens = np.asarray([tokenizer.BOS_ID] + ids, np.int32)
    if tokens.size > self.seq_len:
      self.counter.add("truncated", detail=f"{tokens.size} -> {self.seq_len} tokens")
      tokens = tokens[:self.seq_len]
    inputs = np.zeros(self.seq_len, np.int32)
    inputs[:tokens.size] = tokens
    label = sst5_class(record["label"]) if self.binning == "sst5" else int(record["label"])
    return {"inputs": inputs, "mask": np.arange(self.seq_len) < tokens.size, "label": np.int32(label)}

  def __repr__(self) -> str:
    return f"Classify({self.config.data.name}, {self.model_path}, seq_len={self.seq_len})"


def segment_starts(segment_ids: np.ndarray) -> np.ndarray:
  """bool [..., L]: True at the first position of each segment (padding excluded)."""
  prev = np.concatenate([np.zeros_like(segment_ids[..., :1]), segment_ids[..., :-1]], axis=-1)
  return (segment_ids != prev) & (segment_ids > 0)


def mlm_corrupt(inputs: np.ndarray, mask: np.ndarray, rng: np.random.Generator, *, vocab_size: int,
                rate: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
  """BERT corruption: (corrupted inputs, weights) with weights 1 at the predicted positions."""
  special = (inputs == tokenizer.BOS_ID) | (inputs == tokenizer.EOS_ID) | (inputs == tokenizer.PAD_ID)
  chosen = mask & ~special & (rng.random(inputs.shape) < rate)
  kind = rng.random(inputs.shape)
  random_ids = rng.integers(tokenizer.FIRST_PIECE_ID, vocab_size, size=inputs.shape, dtype=np.int32)
  out = np.where(chosen & (kind < 0.8), np.int32(tokenizer.MASK_ID), inputs)
  out = np.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, out)
  return out.astype(np.int32), chosen.astype(np.float32)


class PackBatches:
  """Tokenized documents, (stream position, tokens) in order -> packed batches (see the module docstring);
  with `rows`, each host's rows of the packed global batch (`data_order.GlobalRows`).

  It never reads a document beyond the ones a yielded batch uses, so the stream position after a batch is an
  exact resume point (`pipeline.Packed`).
  """

  def __init__(self, *, batch_size: int, seq_len: int, task: str, max_segments: int | None, vocab_size: int,
               seed: int, mlm_rate: float = 0.15, rows: data_order.GlobalRows | None = None):
    self.batch_size, self.seq_len, self.task = batch_size, seq_len, task
    self.max_segments, self.vocab_size, self.seed, self.mlm_rate = max_segments, vocab_size, seed, mlm_rate
    self.rows = rows
    self.counter = pipeline.Counter(f"text packing ({task})", every=10_000)

  def _finish(self, inputs: np.ndarray, segs: np.ndarray, last: int) -> dict[str, np.ndarray]:
    """The batch of `inputs` / `segs` [batch, seq_len]; `last`: the stream position of its last document."""
    mask = segs > 0
    valid = mask.any(axis=1)
    if self.task == "lm":
      batch = {"inputs": inputs, "mask": mask, "weights": (mask & ~segment_starts(segs)).astype(np.float32),
               "segment_ids": segs, "valid": valid}
    else:
      rng = np.random.default_rng([self.seed, int(last)])
      corrupted, weights = mlm_corrupt(inputs, mask, rng, vocab_size=self.vocab_size, rate=self.mlm_rate)
      batch = {"inputs": corrupted, "targets": inputs, "weights": weights, "mask": mask, "segment_ids": segs,
               "valid": valid}
    if self.rows is not None:
      lo = self.rows.lo
      batch = {k: v[lo:lo + self.rows.size] for k, v in batch.items()}
    return batch

  def __call__(self, documents: Iterator[tuple[int, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
    b, length = self.batch_size, self.seq_len
    inputs = np.zeros((b, length), np.int32)
    segs = np.zeros((b, length), np.int32)
    row = pos = nseg = 0
    last = None
    for last, toks in documents:
      if self.max_segments is None:  # lm: continue across rows
        while toks.size and row < b:
          take = min(length - pos, toks.size)
          nseg += 1
          inputs[row, pos:pos + take] = toks[:take]
          segs[row, pos:pos + take] = nseg
          toks, pos = toks[take:], pos + take
          if pos == length:
            row, pos, nseg = row + 1, 0, 0
        if toks.size:
          self.counter.add("tokens dropped at batch ends", toks.size)
      else:  # mlm: at most max_segments documents per row, truncated to the room left
        take = min(length - pos, toks.size)
        nseg += 1
        inputs[row, pos:pos + take] = toks[:take]
        segs[row, pos:pos + take] = nseg
        if take < toks.size:
          self.counter.add("tokens truncated", toks.size - take)
        pos += take
        if pos == length or nseg == self.max_segments:
          row, pos, nseg = row + 1, 0, 0
      if row == b:
        yield self._finish(inputs, segs, last)
        inputs = np.zeros((b, length), np.int32)
        segs = np.zeros((b, length), np.int32)
        row = pos = nseg = 0
    if last is not None and (row or pos):  # end of a finite split: padded last batch
      yield self._finish(inputs, segs, last)

  def __repr__(self) -> str:
    return f"PackBatches({self.task}, batch_size={self.batch_size}, seq_len={self.seq_len})"


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index=None, shard_count=None,
                   shuffle=None, num_epochs=None):
  """Packed batches of `batch_size` rows (the host batch).

  A training stream (endless) is global: every host reads the same record order and packs the same global
  batches of batch_size * shard_count rows, keeping its own rows (`PackBatches`' rows), so a step's examples
  and the iterator state do not depend on the number of hosts and a run resumes on any host count. Each host
  tokenizes every document of the global batch (packing is sequential over documents, so a host's rows
  cannot be packed without the rows before them). Finite splits (evaluation) are sharded per host.
  """
  info = dataset_info(config)
  shard_index, shard_count = pipeline.resolve_shards(shard_index, shard_count)
  source = text_source(config, split)
  model = spm_path(config)
  if not paths.exists(model):
    raise pipeline.missing(model, config.data.name, pipeline.cfg_get(config, "data_dir"),
                           what="SentencePiece model")
  if info.task == "classify":  # one example per record, batched like the LRA classification sets
    return pipeline.make_loader(
      source, [pipeline.Example(Classify(config, model, info))], split=split.partition("[")[0],
      batch_size=batch_size,
      seed=seed, shard_index=shard_index, shard_count=shard_count, shuffle=shuffle, num_epochs=num_epochs,
      config=config)
  stream = num_epochs is None and split.partition("[")[0] in pipeline.TRAIN_SPLITS
  rows = data_order.GlobalRows(batch_size, shard_index, shard_count) if stream else None
  pack_size, pack_seed = (rows.global_batch, data_order.stream_seed(seed)) if stream else (
      batch_size, data_order.host_seed(seed, shard_index))
  tokenize = Tokenize(model, info.vocab_size, max_chars=16 * info.seq_len if info.task == "mlm" else None)
  pack = PackBatches(batch_size=pack_size, seq_len=info.seq_len, task=info.task,
                     max_segments=info.max_segments, vocab_size=info.vocab_size, seed=pack_seed,
                     mlm_rate=float(pipeline.cfg_get(config, "mlm_rate", 0.15)),
                     rows=rows if stream and not rows.whole() else None)
  return pipeline.make_loader(
    source, [tokenize], split=split.partition("[")[0], batch_size=None, pack=pack, seed=seed,
    shard_index=0 if stream else shard_index, shard_count=1 if stream else shard_count,
    shuffle=shuffle, num_epochs=num_epochs, config=config,
  )
