"""Ordered LM streams (`config.data.ordered`): the Transformer-XL training order, for models that carry
memories of earlier segments from one step to the next.

The split's token stream (the tokens and vocabulary of the dataset's shuffled pipeline: pystdlib's bytes,
enwik8's bytes and text8's characters in file order, wiki40b's `[bos] + pieces + [eos]` per document in source
order) is cut into B = global batch contiguous streams of n // B tokens each (the remainder dropped, as the
paper's code does). Step t of an epoch gives row b the segment of stream b at [t * L, t * L + L)
(L = config.data.seq_len) as `inputs` and the tokens one to the right as `targets`, so the targets of step t
end where the inputs of step t + 1 begin. An epoch is the (n // B - 1) // L whole segments of each stream (a
last partial segment is dropped: every batch has one shape); the next epoch starts the streams again, in the
same order (nothing is shuffled; `seed` is unused).

Batch (the shuffled LM pipeline's keys and dtypes, plus `targets` and `reset`), per host rows [b, L]:
  inputs int32       the segment; the LM reads it right-shifted and predicts it, as with the shuffled
                     pipeline: by BOS without memory, by the previous segment's last token (kept in the
                     memory, models/transformer.py) with it, so consecutive segments read what their
                     concatenation reads
  targets int32      the next token of each input position (for other consumers; the LM does not read it)
  mask bool, weights float32: all real, every token predicted (each token of a stream once per epoch)
  segment_ids int32  documents of the row numbered 1, 2, ... from its first position (a BOS starts the next);
                     all ones for pystdlib, enwik8 and text8 (no BOS in the stream)
  valid bool [b]     always True (no padded rows)
  reset bool [b]     True where the row starts its stream (step 0 of every epoch): drop the memories
  words float32      only for datasets with a word count (data.text `counts_words`: pg19) outside the
                     training splits: the words credited to each input token (data.text.token_words), for
                     models.metrics' word-level perplexity
Each process reads rows [shard_index * b, (shard_index + 1) * b) of the global batch of b * shard_count rows,
the same rows on any process count. Evaluation reads its split in the same order from its start (one epoch).

The iterator state is {"step": global step, ORDERED_KEY: the stream layout}, the same in every process's file,
so grain's checkpoint handler saves it with the train state and `data.resume.restore_iterator` resumes it on
any process count; a state of another layout (dataset, split, token count, streams, seq_len) or of a shuffled
pipeline is refused with a one-line error (`check_state`, before a restore `check_saved_state`).

Text token streams are tokenized once per split and kept as `tokens.npy` (uint16 for vocabularies up to
65536) under `{cache_dir or data_dir}/ordered_tokens/<name>/<split>-<key>` (the key hashes the SentencePiece
model and the split), memory-mapped when large.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Any

import grain
import numpy as np

from data import characters, pipeline, pystdlib, text
from data import order as data_order
from data.info import DATASETS
from runtime import cli, paths

log = logging.getLogger("data")

ORDERED_KEY = pipeline.ORDERED_KEY  # marks an ordered stream's iterator state
CACHE_VERSION = 1
_TOKENS: dict[str, np.ndarray] = {}  # cache path -> token stream, once per process
_WORDS: dict[str, np.ndarray] = {}  # cache path -> words per token (datasets with a word count)
_STREAM_MODULES = {"data.pystdlib": pystdlib, "data.characters": characters}  # besides data.text


def _refuse(message: str) -> ValueError:
  """A ValueError the command line reports as one line (the user's to fix: a setting or the workdir)."""
  return cli.mark_usage(ValueError(message))


def enabled(config: Any) -> bool:
  """Whether `config.data.ordered` asks for the ordered stream."""
  return bool(pipeline.cfg_get(config, "ordered", False))


def lm_streams() -> list[str]:
  """The datasets that have a causal LM token stream: pystdlib, enwik8, text8 and the text datasets of task
  "lm"."""
  out = [name for name, module in DATASETS.items() if module in _STREAM_MODULES]
  return sorted(out + [name for name, spec in text.SPECS.items() if spec["task"] == "lm"])


def check_supported(config: Any) -> None:
  """A one-line ValueError naming the field when `config.data.name` is not a causal LM stream."""
  name = config.data.name
  if name not in lm_streams():
    raise _refuse(f"config.data.ordered=True needs a causal LM token stream ({', '.join(lm_streams())}); "
                  f"config.data.name={name!r} is not one")


# ------------------------------------------------------------------------------------------------------------
# Token streams


def _text_tokens(config: Any, split: str) -> np.ndarray:
  """wiki40b & co: every document of `split` in source order as [bos] + pieces + [eos], concatenated;
  tokenized once into the cache and read back from there."""
  return _TOKENS[_text_cache(config, split)]


def _text_cache(config: Any, split: str) -> str:
  """The cache directory of `split`'s token stream (and words per token, `word_stream`), filled once."""
  info = text.dataset_info(config)
  source = text.text_source(config, split)
  model = text.spm_path(config)
  if not paths.exists(model):
    raise pipeline.missing(model, config.data.name, pipeline.cfg_get(config, "data_dir"),
                           what="SentencePiece model")
  spec = {"version": CACHE_VERSION, "dataset": config.data.name, "split": split, "records": len(source),
          "prepared": os.path.basename(text.prepared_dir(config)), "vocab_size": info.vocab_size,
          "spm": hashlib.sha256(paths.path(model).read_bytes()).hexdigest()}  # what the tokens depend on
  if text.counts_words(config) and split.partition("[")[0] not in pipeline.TRAIN_SPLITS:
    spec["words"] = True  # evaluation splits of pg19 also keep words.npy (other caches keep their key)
  key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
  root = pipeline.cfg_get(config, "cache_dir") or text.data_dir(config)
  safe_split = re.sub(r"[^A-Za-z0-9_.-]", "_", split)  # "train[:10%]" -> "train__10__"
  where = paths.join(root, "ordered_tokens", config.data.name, f"{safe_split}-{key}")
  if where in _TOKENS:
    return where
  file = paths.join(where, "tokens.npy")
  if not paths.exists(file):
    log.warning("%s/%s: tokenizing the split's %d documents once for the ordered stream into %s",
                config.data.name, split, len(source), where)
    tokenize = text.Tokenize(model, info.vocab_size)
    dtype = np.uint16 if info.vocab_size <= 1 << 16 else np.int32
    files = {"spec.json": json.dumps(spec, indent=1).encode()}
    if spec.get("words"):
      pairs = [tokenize.map_with_words(source[i]) for i in range(len(source))]
      docs = [t.astype(dtype) for t, _ in pairs]
      files["words.npy"] = paths.npy_bytes(np.concatenate([w for _, w in pairs]) if pairs
                                           else np.zeros(0, np.uint8))  # [n]
    else:
      docs = [tokenize.map(source[i]).astype(dtype) for i in range(len(source))]
    tokens = np.concatenate(docs) if docs else np.zeros(0, dtype)  # [n]
    files["tokens.npy"] = paths.npy_bytes(tokens)
    paths.publish_dir(where, files)
  _TOKENS[where] = paths.load_npy(file, mmap_over_mb=64)
  if spec.get("words"):
    _WORDS[where] = paths.load_npy(paths.join(where, "words.npy"), mmap_over_mb=64)
  return where


def word_stream(config: Any, split: str) -> np.ndarray | None:
  """uint8 [n]: the words credited to each token of `token_stream(config, split)` (data.text.token_words);
  None for datasets without a word count and for the training splits (nothing reports words there)."""
  if (DATASETS[config.data.name] != "data.text" or not text.counts_words(config)
      or split.partition("[")[0] in pipeline.TRAIN_SPLITS):
    return None
  return _WORDS[_text_cache(config, split)]


def token_stream(config: Any, split: str) -> np.ndarray:
  """The split's whole token stream: [n] integers in [0, vocab_size) (uint8 for pystdlib, enwik8, text8)."""
  check_supported(config)
  if DATASETS[config.data.name] == "data.pystdlib":
    return pystdlib.split_bytes(pystdlib.stdlib_dir(config), split)
  if DATASETS[config.data.name] == "data.characters":
    return characters.split_tokens(config, split)
  return _text_tokens(config, split)


# ------------------------------------------------------------------------------------------------------------
# Streams, iterator, dataset


class Streams:
  """`tokens` [n] as `streams` contiguous rows of n // streams tokens, read in segments of `seq_len`."""

  def __init__(self, tokens: np.ndarray, *, streams: int, seq_len: int, bos_id: int | None,
               layout: dict[str, Any], words: np.ndarray | None = None):
    self.tokens, self.streams, self.seq_len, self.bos_id = tokens, int(streams), int(seq_len), bos_id
    self.words = words  # [n] words per token, or None
    self.stream_len = len(tokens) // self.streams
    self.steps = max(0, (self.stream_len - 1) // self.seq_len)  # a segment also needs its next token
    self.layout = {**layout, "tokens": int(len(tokens)), "streams": self.streams, "seq_len": self.seq_len}
    if self.steps < 1:
      raise _refuse(f"{layout['dataset']}/{layout['split']}: {len(tokens)} tokens make {self.streams} "
                    f"streams of {self.stream_len}, shorter than one segment of seq_len={self.seq_len} "
                    f"plus its next token; use a smaller batch or seq_len")

  def batch(self, step: int, lo: int, size: int) -> dict[str, np.ndarray]:
    """Rows [lo, lo + size) of global step `step` (any epoch)."""
    offset = (int(step) % self.steps) * self.seq_len
    starts = (np.arange(lo, lo + size) * self.stream_len + offset).tolist()
    window = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)  # [size, L+1]
    inputs = window[:, :-1]  # [size, L]
    starts_doc = inputs == (-1 if self.bos_id is None else self.bos_id)  # [size, L]
    starts_doc[:, 0] = False
    shape = inputs.shape
    extra = {}
    if self.words is not None:  # [size, L] the words of each input token
      extra["words"] = np.stack([self.words[s:s + self.seq_len] for s in starts]).astype(np.float32)
    return {
      "inputs": np.ascontiguousarray(inputs),
      "targets": np.ascontiguousarray(window[:, 1:]),  # [size, L]
      "mask": np.ones(shape, bool),
      "weights": np.ones(shape, np.float32),
      "segment_ids": (1 + np.cumsum(starts_doc, axis=1)).astype(np.int32),  # [size, L]
      "valid": np.ones(size, bool),
      "reset": np.full(size, offset == 0),  # [size]
      **extra,
    }


def _describe(layout: Any) -> str:
  return ", ".join(f"{k}={v}" for k, v in layout.items()) if isinstance(layout, dict) else repr(layout)


class OrderedIterator(grain.DatasetIterator):
  """Consecutive global steps of `streams`, this host's rows [lo, lo + size); `num_epochs` None = forever."""

  def __init__(self, streams: Streams, lo: int, size: int, num_epochs: int | None):
    super().__init__()
    self.streams, self.lo, self.size, self.num_epochs = streams, lo, size, num_epochs
    self.step = 0

  def __next__(self) -> dict[str, np.ndarray]:
    if self.num_epochs is not None and self.step >= self.num_epochs * self.streams.steps:
      raise StopIteration
    out = self.streams.batch(self.step, self.lo, self.size)
    self.step += 1
    return out

  def get_state(self) -> dict[str, Any]:
    return {"step": self.step, ORDERED_KEY: dict(self.streams.layout)}

  def check_state(self, state: Any, where: str = "data-iterator state") -> None:
    """Raises a one-line ValueError unless `state` is a position in this iterator's stream layout."""
    if not isinstance(state, dict) or ORDERED_KEY not in state:
      raise _refuse(f"{where} is a shuffled pipeline's position ({str(state)[:80]}), not an ordered "
                    f"stream's; resume it with config.data.ordered=False, or start a fresh workdir")
    if state[ORDERED_KEY] != self.streams.layout:
      raise _refuse(f"{where} is for the ordered stream layout ({_describe(state[ORDERED_KEY])}), but "
                    f"this run reads ({_describe(self.streams.layout)}); it resumes only with the same "
                    f"dataset, split, global batch and config.data.seq_len, else start a fresh workdir")

  def check_saved_state(self, saved: Any, step_dir: str) -> None:
    """`data.resume.check_iterator_checkpoint`'s check before a restore: `saved` is one process's JSON
    state."""
    self.check_state(saved, f"checkpoint {step_dir}'s data-iterator state")

  def set_state(self, state: dict[str, Any]) -> None:
    self.check_state(state)
    self.step = int(state["step"])


class OrderedDataset(grain.IterDataset):
  """What `create_dataset` returns: each `iter()` starts at step 0."""

  def __init__(self, streams: Streams, lo: int, size: int, num_epochs: int | None):
    super().__init__()
    self.streams, self.lo, self.size, self.num_epochs = streams, lo, size, num_epochs

  def __iter__(self) -> OrderedIterator:
    return OrderedIterator(self.streams, self.lo, self.size, self.num_epochs)

  def __len__(self) -> int:
    if self.num_epochs is None:
      raise TypeError("an endless ordered stream has no length")
    return self.num_epochs * self.streams.steps

  def __str__(self) -> str:
    return f"OrderedDataset({_describe(self.streams.layout)}, rows {self.lo}:{self.lo + self.size})"


def create_dataset(config: Any, split: str, *, batch_size: int, seed: int, shard_index: int | None = None,
                   shard_count: int | None = None, shuffle: bool | None = None,
                   num_epochs: int | None = None) -> OrderedDataset:
  """The ordered stream of `split`; `batch_size` is the host batch (rows `data.order.GlobalRows`).

  num_epochs defaults to None (forever) for "train" and 1 otherwise; `seed` and `shuffle` do not apply (the
  order is the corpus order)."""
  del seed, shuffle
  check_supported(config)
  module = _STREAM_MODULES.get(DATASETS[config.data.name], text)
  info = module.dataset_info(config)  # the same vocabulary and seq_len as the shuffled pipeline
  shard_index, shard_count = pipeline.resolve_shards(shard_index, shard_count)
  rows = data_order.GlobalRows(batch_size, shard_index, shard_count)
  if num_epochs is None and split.partition("[")[0] not in pipeline.TRAIN_SPLITS:
    num_epochs = 1
  tokens = token_stream(config, split)
  words = word_stream(config, split) if module is text else None
  streams = Streams(tokens, streams=rows.global_batch, seq_len=info.seq_len, bos_id=info.bos_id,
                    layout={"dataset": config.data.name, "split": split}, words=words)
  return OrderedDataset(streams, rows.lo, rows.size, num_epochs)
