"""Offline stand-ins for every dataset, for tests and CPU smoke runs.

    with data.testing.mock_data("wiki40b", tmp_path) as data_dir:
      config.data.data_dir = data_dir
      loader = data.create_dataset(config, "train", batch_size=2, seed=0)

TFDS-backed sets (cifar10, imagenet64, lra_text, lra_image) use `tfds.testing.mock_data` (random records,
served through `tfds.data_source` exactly like real data); LRA file sets get small files in the official
`lra_release/lra_release/...` layout; wiki40b/c4/pg19/imdb/sst5 get a small prepared TFDS ArrayRecord
directory (pg19: a few generated books, `books`, with pg19's features; imdb and sst5: labelled reviews and
sentences) plus a SentencePiece model (vocabulary `spm_vocab`, at most config.data.vocab_size) trained on
the generated text;
enwik8/text8 get ~400 KB of pseudo-text in their alphabet (Wikipedia-like XML with some UTF-8; a-z and
space) in the prepared `{data_dir}/<name>/` layout; listops_synthetic and synthetic_recall need nothing. All
content is generated from `seed`.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator

import numpy as np

from data import listops
from data.info import DATASETS

TFDS_BACKED = {"cifar10", "imagenet64", "lra_text", "lra_image"}
SYLLABLES = ("ka", "to", "ri", "me", "su", "na", "lo", "pe", "zi", "vu", "ban", "dor", "el", "qui", "stra",
             "om")


def words(rng: np.random.Generator, n: int) -> str:
  """n pseudo-words (a Zipf-ish vocabulary so SentencePiece has structure to learn)."""
  out = []
  for _ in range(n):
    k = 1 + min(int(rng.zipf(2.0)), 3)
    out.append("".join(SYLLABLES[int(rng.zipf(1.5)) % len(SYLLABLES)] for _ in range(k)))
  return " ".join(out)


def documents(rng: np.random.Generator, n: int, *, min_words: int = 3, max_words: int = 400,
              wiki_markup: bool = False) -> list[str]:
  docs = []
  for i in range(n):
    body = words(rng, int(rng.integers(min_words, max_words + 1)))
    if wiki_markup:
      half = len(body) // 2
      body = (f"\n_START_ARTICLE_\nTitle {i}\n_START_SECTION_\nPart\n_START_PARAGRAPH_\n"
              f"{body[:half]}_NEWLINE_{body[half:]}")
    docs.append(body)
  return docs


# ------------------------------------------------------------------------------------------------------------
# LRA files in the official layout


def write_listops(path: str, rng: np.random.Generator, n: int, *, min_length: int = 10, max_length: int = 60,
                  max_depth: int = 4) -> list[tuple[str, int]]:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  rows = []
  for _ in range(n):
    toks, label = listops.sample(rng, min_length=min_length, max_length=max_length, max_depth=max_depth,
                                 max_args=5, op_p=0.4)
    rows.append((" ".join(toks), label))
  with open(path, "w") as f:
    f.write("Source\tTarget\n")
    for src, label in rows:
      f.write(f"{src}\t{label}\n")
  return rows


def write_retrieval(path: str, rng: np.random.Generator, n: int) -> list[tuple[int, str, str]]:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  rows = []
  with open(path, "w") as f:
    for i in range(n):
      label = int(rng.integers(2))
      t1, t2 = words(rng, int(rng.integers(5, 300))), words(rng, int(rng.integers(5, 300)))
      rows.append((label, t1, t2))
      f.write(f"{float(label)}\tpaper{i}a\tpaper{i}b\t{t1}\t{t2}\n")
  return rows


def write_pathfinder(root: str, rng: np.random.Generator, n_files: int = 10, per_file: int = 3,
                     resolution: int = 32) -> None:
  """`<root>/metadata/<i>.npy` index text files and `<root>/imgs/<i>/sample_<j>.png` grayscale images."""
  from PIL import Image

  os.makedirs(os.path.join(root, "metadata"), exist_ok=True)
  for i in range(n_files):
    os.makedirs(os.path.join(root, "imgs", str(i)), exist_ok=True)
    lines = []
    for j in range(per_file):
      pixels = rng.integers(0, 256, size=(resolution, resolution), dtype=np.uint8)
      Image.fromarray(pixels, mode="L").save(os.path.join(root, "imgs", str(i), f"sample_{j}.png"))
      lines.append(f"imgs/{i} sample_{j}.png {j} {int(rng.integers(2))} 0 0")
    with open(os.path.join(root, "metadata", f"{i}.npy"), "w") as f:
      f.write("\n".join(lines) + "\n")


def write_lra(data_dir: str, seed: int = 0, num_examples: int = 12) -> str:
  """All LRA file sets under `{data_dir}/lra_release/lra_release/` (the archive's double nesting)."""
  from data import lra

  rng = np.random.default_rng(seed)
  root = os.path.join(data_dir, "lra_release", "lra_release")
  for _split, name in lra.LISTOPS_FILES.items():
    write_listops(os.path.join(root, "listops-1000", name), rng, num_examples)
  for _split, name in lra.RETRIEVAL_FILES.items():
    write_retrieval(os.path.join(root, "tsv_data", name), rng, num_examples)
  for difficulty in lra.PATHFINDER_DIFFICULTIES:
    write_pathfinder(os.path.join(root, "pathfinder32", difficulty), rng, n_files=10,
                     per_file=max(1, num_examples // 4))
  return root


# ------------------------------------------------------------------------------------------------------------
# Wiki-40B / C4: a small prepared TFDS directory + SentencePiece model


def write_prepared_text(name: str, data_dir: str, split_docs: dict[str, list[str]]) -> str:
  """Writes `{data_dir}/<tfds name>/<version>` with TFDS's own ArrayRecord writer (no TensorFlow needed)."""
  import tensorflow_datasets as tfds

  from data import text

  spec = text.SPECS[name]
  tfds_name, _, config_name = spec["tfds_name"].partition("/")
  field = spec.get("text_field", "text")
  extra = {"wiki40b": ("wikidata_id", "version_id"), "c4": ("timestamp", "url"),
           "pg19": ("book_title", "publication_date", "book_link"), "sst5": ("tokens", "tree")}.get(name, ())
  numbers = ("book_id",) if name == "pg19" else ()  # pg19's int32 feature
  # classification: imdb's ClassLabel, sst5's float sentiment in [0, 1] (a label per document, from its index)
  labels = {"imdb": tfds.features.ClassLabel(num_classes=2), "sst5": np.float32}.get(name)

  class _Mock(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version(spec["version"])
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=config_name)] if config_name else []
    code_path = None  # a builder defined inside a package: skip tfds's source-file lookup (checksums)

    # tfds prints "Downloading and preparing dataset ... prepared to <dir>" around a build: the run already
    # says it uses the stand-in, so a stand-in of a few documents builds quietly.
    def _log_download_bytes(self):
      pass

    def _log_download_done(self):
      pass

    def _info(self):
      feats = {field: tfds.features.Text(), **{k: tfds.features.Text() for k in extra},
               **{k: np.int32 for k in numbers}, **({"label": labels} if labels is not None else {})}
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(feats))

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples(docs) for split, docs in split_docs.items()}

    def _generate_examples(self, docs):
      for i, doc in enumerate(docs):
        label = {} if labels is None else {"label": i % 2 if name == "imdb" else np.float32((i % 11) / 10)}
        yield i, {field: doc, **{k: f"{k}{i}" for k in extra}, **{k: i for k in numbers}, **label}

  _Mock.name = tfds_name
  builder = _Mock(data_dir=data_dir, config=config_name or None, file_format="array_record")
  tfds.display_progress_bar(False)  # a stand-in of a few documents: no "Generating splits" bars
  try:
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(verify_ssl=False))
  finally:
    tfds.display_progress_bar(True)
  return builder.data_dir


def books(rng: np.random.Generator, n: int, *, min_words: int = 800, max_words: int = 2500) -> list[str]:
  """n pseudo-books in PG-19's shape: a title line, chapters, paragraphs of lines wrapped at ~70 characters
  separated by blank lines, and some punctuation (so words and pieces differ)."""
  out = []
  for i in range(n):
    body = words(rng, int(rng.integers(min_words, max_words + 1))).split(" ")
    lines, line, chapter = [f"THE BOOK OF {body[0].upper()} {i}", ""], [], 1
    for j, word in enumerate(body):
      line.append(word + ("," if j % 11 == 5 else ". " if j % 17 == 16 else ""))
      if sum(len(w) + 1 for w in line) > 70:
        lines.append(" ".join(line).strip())
        line = []
        if rng.random() < 0.15:
          lines.append("")
        if rng.random() < 0.01:
          chapter += 1
          lines += ["", f"CHAPTER {chapter}.", ""]
    lines.append(" ".join(line).strip())
    out.append("\n".join(lines).strip())
  return out


def write_text(name: str, data_dir: str, *, seed: int = 0, num_examples: int = 24,
               spm_vocab: int = 200) -> None:
  from data import text, tokenizer

  rng = np.random.default_rng(seed)
  wiki = name == "wiki40b"
  splits = ("train", "validation") if name == "c4" else ("train", "validation", "test")
  if name == "pg19":  # fewer, longer documents: books
    split_docs = {s: books(rng, max(2, num_examples // 3)) for s in splits}
  elif name == "imdb":  # reviews with imdb's line-break tags; validation is a slice of train
    split_docs = {s: [d.replace(" ", " <br /><br />", 1) for d in documents(rng, num_examples * (1 + (
        s == "train")), min_words=20, max_words=200)] for s in ("train", "test")}
  elif name == "sst5":  # sentences
    split_docs = {s: documents(rng, num_examples * (1 + 7 * (s == "train")), min_words=3, max_words=40)
                  for s in splits}  # enough training text for the tokenizer's pieces
  else:
    split_docs = {s: documents(rng, num_examples, wiki_markup=wiki) for s in splits}
  write_prepared_text(name, data_dir, split_docs)
  config = types.SimpleNamespace(data=types.SimpleNamespace(name=name))
  corpus = [text.document_text(config, {"text": d}) for d in split_docs["train"]]
  tokenizer.train(corpus, os.path.join(data_dir, "spm", f"{name}.model"), vocab_size=spm_vocab,
                  character_coverage=1.0)


# ------------------------------------------------------------------------------------------------------------
# enwik8 / text8: pseudo-text in the prepared layout

CHARACTER_STAND_IN = 400_000  # characters: 360K train, 20K validation, 20K test


def character_text(name: str, rng: np.random.Generator, size: int) -> bytes:
  """`size` bytes of deterministic pseudo-text: text8's alphabet (a-z, single spaces), or for enwik8
  MediaWiki-like XML pages with links and a few multi-byte UTF-8 characters."""
  lexicon = words(rng, 3000).split(" ")  # Zipf-ish pseudo-words
  picks = rng.zipf(1.3, size=size // 3) % len(lexicon)  # more words than `size` characters need
  body = " ".join(lexicon[int(i)] for i in picks)
  if name == "text8":
    return body.encode("ascii")[:size]
  out, start, page, total = [], 0, 0, 0
  while total < size:
    length = int(rng.integers(800, 4000))
    text = body[start:start + length] or body[:length]
    start += length
    title = lexicon[int(rng.integers(len(lexicon)))]
    text = text.replace(" ka", " [[ka").replace("ri ", "ri]] ").replace("me", "m\u00e9")
    out.append(f"  <page>\n    <title>{title.capitalize()} {page}</title>\n    <id>{page}</id>\n"
               f"    <text xml:space=\"preserve\">'''{title}''' {text} &quot;\u2013&quot;</text>\n"
               "  </page>\n".encode())
    total += len(out[-1])
    page += 1
  return b"".join(out)[:size]


def write_characters(name: str, data_dir: str, *, seed: int = 0, size: int = CHARACTER_STAND_IN) -> None:
  """`{data_dir}/<name>/` as `python -m data.prepare` writes it, from `character_text`."""
  from data import characters

  raw = character_text(name, np.random.default_rng(seed), size)
  characters.write_splits(name, data_dir, raw, source="data.testing")


# ------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def mock_data(name: str, tmp_dir: str, *, num_examples: int = 12, seed: int = 0) -> Iterator[str]:
  """Makes dataset `name` available offline on tiny generated data; yields the data_dir to put in the config.

  Inside the context, `config.data.data_dir = <yielded dir>` (with the dataset's usual other fields) makes
  `data.create_dataset(config, split, ...)` read the mock. TFDS-backed sets are patched process-wide for the
  duration of the context.
  """
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; allowed: {sorted(DATASETS)}")
  data_dir = os.path.join(str(tmp_dir), f"mock_{name}")
  os.makedirs(data_dir, exist_ok=True)
  if name in TFDS_BACKED:
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=num_examples):
      yield data_dir
    return
  if name.startswith("lra_"):
    write_lra(data_dir, seed=seed, num_examples=num_examples)
  elif name in ("wiki40b", "c4", "pg19", "imdb", "sst5"):
    write_text(name, data_dir, seed=seed, num_examples=max(num_examples, 12))
  elif name in ("enwik8", "text8"):
    write_characters(name, data_dir, seed=seed)
  elif name == "cnn_dailymail":
    from data import cnn_dailymail

    cnn_dailymail.write_stand_in(data_dir, seed=seed, num_examples=max(num_examples, 24))
  yield data_dir
