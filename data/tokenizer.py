"""SentencePiece tokenizer for Wiki-40B / C4: training, loading, and the fixed special ids.

Special ids are pinned at training time so every model file agrees: pad 0, unk 1, bos 2, eos 3, [MASK] 4; the
rest are ordinary pieces (ids >= FIRST_PIECE_ID), which is the range MLM draws its random replacements from.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterable

PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3, 4
MASK_PIECE = "[MASK]"
FIRST_PIECE_ID = 5


def train(texts: Iterable[str], model_path: str, *, vocab_size: int = 32000, max_sentences: int = 10_000_000,
          character_coverage: float = 0.9995, model_type: str = "unigram", num_threads: int = 2) -> str:
  """Trains a model on `texts` (one document each; split into lines) and writes `model_path` (ending .model).

  `max_sentences` lines are sampled by SentencePiece itself (input_sentence_size + shuffle).
  """
  import sentencepiece as spm

  if not model_path.endswith(".model"):
    raise ValueError(f"model_path must end with .model, got {model_path!r}")
  os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
  with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
    corpus = f.name
    for text in texts:
      for line in text.splitlines():
        if line.strip():
          f.write(line.strip() + "\n")
  try:
    spm.SentencePieceTrainer.train(
      input=corpus, model_prefix=model_path[: -len(".model")], vocab_size=vocab_size, model_type=model_type,
      character_coverage=character_coverage, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
      user_defined_symbols=[MASK_PIECE], input_sentence_size=max_sentences, shuffle_input_sentence=True,
      num_threads=num_threads, minloglevel=2,
    )
  finally:
    os.unlink(corpus)
  check(load(model_path), model_path)
  return model_path


@functools.lru_cache(maxsize=8)
def load(model_path: str):
  import sentencepiece as spm

  from runtime import paths

  if paths.is_uri(model_path):  # gs://: SentencePiece reads only local files, so hand it the bytes
    return spm.SentencePieceProcessor(model_proto=paths.path(model_path).read_bytes())
  return spm.SentencePieceProcessor(model_file=model_path)


def check(sp, model_path: str) -> None:
  """The model's special ids must be the pinned ones (a model trained elsewhere may differ)."""
  got = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.piece_to_id(MASK_PIECE))
  want = (PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID)
  if got != want:
    raise ValueError(f"{model_path}: special ids (pad, unk, bos, eos, [MASK]) are {got}, expected {want}; "
                     "retrain it with python -m data.prepare")
