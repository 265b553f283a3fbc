"""Prepare a dataset on the user's machine: build, train the tokenizer, verify record counts.

    python -m data.prepare cifar10 --data_dir ~/tensorflow_datasets
    python -m data.prepare imagenet64 --data_dir DIR     # manual download first (printed)
    python -m data.prepare wiki40b --data_dir DIR        # TFDS Beam build + 32K SentencePiece model
    python -m data.prepare c4 --data_dir DIR             # Beam build (very large) + 32K SentencePiece model
    python -m data.prepare pg19 --data_dir DIR           # TFDS build (books from gs://deepmind-gutenberg)
                                                         # + 32K SentencePiece model on 2000 books
    python -m data.prepare lra --data_dir DIR            # unpack/check lra_release, build imdb_reviews +
                                                         # cifar10
    python -m data.prepare lra_listops --data_dir DIR    # or one LRA task
    python -m data.prepare wiki40b --data_dir DIR --skip_build   # tokenizer + verification only
    python -m data.prepare listops_synthetic --data_dir DIR      # generate the ListOps splits once (all CPUs)
    python -m data.prepare enwik8 --data_dir DIR         # download enwik8.zip (or place it in DIR), split
    python -m data.prepare text8 --data_dir DIR          # the same for text8.zip
    python -m data.prepare imdb --data_dir DIR           # TFDS imdb_reviews + 32K SentencePiece model
    python -m data.prepare sst5 --data_dir DIR           # TFDS huggingface:sst + 8K SentencePiece model
                                                         # (needs `pip install datasets`, see below)

It first prints what it will do, how large and how long (rough figures for one workstation), and any manual
step, then runs, then verifies every split's record count against the published size (exit status 1 on a
mismatch, 2 when a manual step is still missing). The LRA archive has no published checksum: its sha256 is
recorded in `lra_release.gz.sha256` once it is unpacked whole and checked against the archive on every later
run (`--lra_sha256 HEX` also checks it against a value you trust before unpacking). TFDS builds and the Beam
builders (wiki40b, c4) need the extras in requirements-prepare.txt (TensorFlow, Apache Beam); training and
evaluation never do. sst5 is TFDS's community dataset `huggingface:sst`, whose builder also needs the Hugging
Face `datasets` package (not in requirements-prepare.txt): without it the build stops with that message.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import sys
import tarfile
import time
import urllib.error
import urllib.request
from typing import Any

import ml_collections
import numpy as np

from runtime import cli

log = logging.getLogger("data.prepare")

LRA_TASKS = ("lra_listops", "lra_text", "lra_retrieval", "lra_image", "lra_pathfinder")

# name -> (size, time, manual steps or None)
PLAN: dict[str, tuple[str, str, str | None]] = {
  "cifar10": ("~170 MB download, ~150 MB prepared", "a few minutes", None),
  "imagenet64": (
    "~12 GB of archives, ~13 GB prepared",
    "~1-2 hours",
    "Download the 64x64 'Downsampled ImageNet' archives train_64x64.tar and valid_64x64.tar (image-net.org, "
    "https://image-net.org/download-images.php, needs an ImageNet account; tfds fetches them from "
    "http://image-net.org/small/ when that still answers). Put both files in {data_dir}/downloads/manual/ "
    "and re-run this command.",
  ),
  "wiki40b": ("~10 GB download (wiki40b/en), ~10 GB prepared", "~1-3 hours with the Beam DirectRunner, plus "
              "~30-60 min SentencePiece training", None),
  "c4": ("~7 TB of Common Crawl input, ~800 GB prepared", "days on one machine; use a Beam runner on a "
         "cluster (e.g. --beam_runner DataflowRunner via --beam_flags), plus ~1 h SentencePiece training",
         None),
  "pg19": ("~11 GB of books read from gs://deepmind-gutenberg (28,752 books), ~11 GB prepared",
           "~1-2 hours (no Beam), plus ~30 min SentencePiece training", None),
  "lra": (
    "~7.7 GB archive (lra_release.gz), ~30 GB unpacked, plus imdb_reviews (~80 MB) and cifar10 (~170 MB)",
    "~20-40 min to unpack and check",
    "Download https://storage.googleapis.com/long-range-arena/lra_release.gz into {data_dir}/ (this command "
    "unpacks it to {data_dir}/lra_release/), or unpack it there yourself: tar xzf lra_release.gz -C "
    "{data_dir}",
  ),
  "listops_synthetic": ("nothing to download; ~100 MB of generated token ids (default sizes and lengths)",
                        "~11 CPU-minutes (96K+2K+2K examples at ~7 ms each), spread over every CPU", None),
  "enwik8": ("~36 MB download (enwik8.zip), 100 MB prepared", "under a minute after the download", None),
  "text8": ("~31 MB download (text8.zip), 100 MB prepared", "under a minute after the download", None),
  "imdb": ("~80 MB download (imdb_reviews, shared with lra_text), ~130 MB prepared",
           "a few minutes, plus a few minutes of SentencePiece training", None),
  "sst5": ("~10 MB download (huggingface:sst, the Stanford Sentiment Treebank), a few MB prepared",
           "a few minutes, plus under a minute of SentencePiece training", None),
}
SST5_NEEDS = ("sst5 is built by TFDS's community builder huggingface:sst, which needs the Hugging Face "
              "`datasets` package: .venv/bin/pip install datasets (not in requirements-prepare.txt), then "
              "re-run this command")


def _config(name: str, data_dir: str, **fields: Any) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {"name": name, "data_dir": data_dir, **fields}})


def plan_key(name: str) -> str:
  return "lra" if name.startswith("lra") else name


def describe(name: str, data_dir: str) -> str:
  size, duration, manual = PLAN[plan_key(name)]
  lines = [f"data.prepare {name} -> {data_dir}", f"  size: {size}", f"  time: {duration}"]
  if manual:
    lines.append("  manual step: " + manual.format(data_dir=data_dir))
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- verify


def split_counts(name: str, data_dir: str, **fields: Any) -> dict[str, int | str]:
  """Records per split as the pipelines read them (an error string where a split cannot be opened)."""
  import data
  from data import characters, images, lra, text

  config = _config(name, data_dir, **fields)
  expected = data.dataset_info(config).split_sizes
  out: dict[str, int | str] = {}
  for split in expected:
    try:
      if name in images.SPECS:
        # sizes use tfds split names
        source = images.tfds_source(images.SPECS[name][0], split, data_dir, name)
      elif name in text.SPECS:
        source = text.text_source(config, split)
      elif name in characters.SPECS:
        source = characters.WindowSource(config, split, data.dataset_info(config).seq_len)
      elif name in ("lra_text", "lra_image"):
        tfds_name = "imdb_reviews" if name == "lra_text" else "cifar10"
        source = images.tfds_source(tfds_name, split, data_dir, name)
      elif name == "listops_synthetic":
        from data import listops

        source = listops.make_source(config, split)
      else:
        source, _ = lra.make_source(config, split)
      out[split] = len(source)
    except (FileNotFoundError, ValueError) as e:
      out[split] = f"error: {e}"
  return out


def verify(name: str, data_dir: str, expected: dict[str, int] | None = None, **fields: Any) -> bool:
  """Prints a table of split, records found, records expected; True when all match."""
  import data

  expected = expected or data.dataset_info(_config(name, data_dir, **fields)).split_sizes
  got = split_counts(name, data_dir, **fields)
  ok = True
  print(f"verify {name}:")
  for split, want in expected.items():
    have = got.get(split, "missing")
    good = have == want
    ok &= good
    print(f"  {split:<11} found {have!s:<12} expected {want:<12} {'ok' if good else 'MISMATCH'}")
  return ok


# ------------------------------------------------------------------------------------------------------ steps


IMAGENET64_ARCHIVES = ("train_64x64.tar", "valid_64x64.tar")


def _serve_manual_archives(builder: Any, manual: str, names: tuple[str, ...]) -> None:
  """Makes `builder` read `names` from `manual` instead of downloading them (downsampled_imagenet has no
  manual-download path of its own and its image-net.org URLs now need a login)."""
  original = builder._split_generators

  class _Local:
    def __init__(self, dl_manager):
      self._dl = dl_manager

    def download(self, urls):
      return [os.path.join(manual, os.path.basename(u)) for u in urls]

    def __getattr__(self, attr):  # iter_archive etc. from the real download manager
      return getattr(self._dl, attr)

  builder._split_generators = lambda dl_manager: original(_Local(dl_manager))
  log.info("reading %s from %s", ", ".join(names), manual)


def build_tfds(tfds_name: str, data_dir: str, beam_flags: list[str] | None = None) -> None:
  import tensorflow_datasets as tfds

  builder = tfds.builder(tfds_name, data_dir=data_dir, file_format="array_record")
  manual_dir = os.path.join(data_dir, "downloads", "manual")
  if tfds_name.startswith("downsampled_imagenet") and all(
      os.path.exists(os.path.join(manual_dir, n)) for n in IMAGENET64_ARCHIVES):
    _serve_manual_archives(builder, manual_dir, IMAGENET64_ARCHIVES)
  config = {}
  if beam_flags is not None:
    try:
      import apache_beam as beam
    except ImportError as e:
      raise SystemExit(f"{tfds_name} is built with Apache Beam: pip install -r "
                       "requirements-prepare.txt") from e
    config["beam_options"] = beam.options.pipeline_options.PipelineOptions(flags=beam_flags)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir, **config))


def train_spm(name: str, data_dir: str, *, vocab_size: int, docs: int, seed: int) -> str:
  """Trains `{data_dir}/spm/<name>.model` on `docs` random training documents (cleaned like the pipeline)."""
  from data import text, tokenizer

  config = _config(name, data_dir)
  source = text.text_source(config, "train")
  n = len(source)
  rng = np.random.default_rng(seed)
  picks = np.sort(rng.choice(n, size=min(docs, n), replace=False))
  log.info("training SentencePiece (%d pieces) on %d of %d training documents", vocab_size, len(picks), n)
  path = text.spm_path(config)
  tokenizer.train((text.document_text(config, source[int(i)]) for i in picks), path, vocab_size=vocab_size)
  return path


# The LRA release publishes no checksum of lra_release.gz, so none is built in: the archive's sha256 is
# recorded next to it once it has been unpacked whole (`<archive>.sha256`, the `sha256sum -c` format), and
# every later prepare run checks the archive against that record; `--lra_sha256` checks it against a value
# the user trusts before anything is unpacked.
LRA_ARCHIVE = "lra_release.gz"


class ArchiveMismatch(ValueError):
  """An archive whose sha256 is not the one expected or recorded."""


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
  del size, mtime_ns  # the cache key: a rewritten file is hashed again
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def file_sha256(path: str) -> str:
  st = os.stat(path)
  return _sha256(path, st.st_size, st.st_mtime_ns)


def recorded_sha256(archive: str) -> str | None:
  record = archive + ".sha256"
  if not os.path.exists(record):
    return None
  with open(record) as f:
    return (f.read().split() or [""])[0].lower()


def check_lra_archive(archive: str, expected: str | None = None) -> str:
  """The archive's sha256; ArchiveMismatch when it differs from `expected` or from the one recorded when
  the tree was unpacked."""
  digest = file_sha256(archive)
  if expected and digest != expected.strip().lower():
    raise ArchiveMismatch(f"{archive} has sha256 {digest}, not the expected {expected.strip().lower()} "
                          "(--lra_sha256): a damaged or different download; download it again")
  recorded = recorded_sha256(archive)
  if recorded and digest != recorded:
    raise ArchiveMismatch(f"{archive} has sha256 {digest}, but the LRA tree in {os.path.dirname(archive)} "
                          f"was unpacked from one with sha256 {recorded} ({archive}.sha256): a damaged copy "
                          f"or a different download. Delete the tree and {archive}.sha256 to unpack this "
                          "one, or restore the archive")
  return digest


def unpack_lra(data_dir: str, expected_sha256: str | None = None) -> str | None:
  """Unpacks {data_dir}/lra_release.gz when the tree is not there yet, after checking its sha256 (see
  LRA_ARCHIVE); returns the LRA root or None. ArchiveMismatch for an archive that fails the check."""
  from data import lra

  config = _config("lra_listops", data_dir)
  root = lra.lra_root(config)
  archive = os.path.join(data_dir, LRA_ARCHIVE)
  if os.path.isdir(os.path.join(root, "listops-1000")):
    if os.path.exists(archive):
      check_lra_archive(archive, expected_sha256)
      if recorded_sha256(archive) is None:
        print(f"note: {root} has no record of a finished unpack ({archive}.sha256): if an unpack was "
              f"interrupted, delete {root} and run this again", flush=True)
    return root
  if not os.path.exists(archive):
    return None
  digest = check_lra_archive(archive, expected_sha256)
  print(f"unpacking {archive} (sha256 {digest}) into {data_dir} ...", flush=True)
  with tarfile.open(archive, "r:gz") as tar:
    tar.extractall(data_dir, filter="data")
  root = lra.lra_root(config)
  if not os.path.isdir(os.path.join(root, "listops-1000")):
    return None
  with open(archive + ".sha256", "w") as f:  # written once the whole archive is unpacked
    f.write(f"{digest}  {LRA_ARCHIVE}\n")
  return root


def download(url: str, dest: str) -> None:
  """`url` -> `dest`, through a partial file renamed when complete (an interrupted download leaves no
  `dest`). OSError (urllib.error.URLError included) when the URL cannot be read."""
  part = dest + ".part"
  print(f"downloading {url} -> {dest} ...", flush=True)
  with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as f:
    for chunk in iter(lambda: response.read(1 << 20), b""):
      f.write(chunk)
  os.replace(part, dest)


def prepare_characters(name: str, data_dir: str) -> int | None:
  """enwik8/text8: `{data_dir}/<name>.zip` (downloaded when absent) -> `{data_dir}/<name>/`; None when the
  splits are there, else the exit status of a step that could not run (2: the download, 1: a bad archive)."""
  from data import characters

  spec = characters.SPECS[name]
  target = os.path.join(data_dir, name)
  if os.path.isdir(target):
    print(f"  {target} is already prepared (delete it to prepare it again)", flush=True)
    return None
  archive = characters.zip_path(name, data_dir)
  if not os.path.exists(archive):
    try:
      download(spec["url"], archive)
    except OSError as e:
      print(f"MANUAL STEP MISSING: could not download {spec['url']} ({e}). Download it by hand, put it at "
            f"{archive} and re-run this command.", flush=True)
      return 2
  try:
    lengths = characters.prepare_from_zip(name, data_dir)
  except ValueError as e:
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    return 1
  total = sum(lengths.values())
  if total != characters.PUBLISHED_LENGTH:
    print(f"  note: {archive}'s {spec['member']} has {total} characters, not the published "
          f"{characters.PUBLISHED_LENGTH}; split in the same proportions", flush=True)
  for split, n in lengths.items():
    print(f"  {split}: {n} characters -> {os.path.join(target, split + '.npy')}", flush=True)
  return None


def prepare(name: str, data_dir: str, *, skip_build: bool = False, vocab_size: int | None = None,
            spm_docs: int | None = None, beam_flags: list[str] | None = None, seed: int = 0,
            listops_fields: dict[str, Any] | None = None, lra_sha256: str | None = None) -> int:
  """Runs the steps for `name`; returns the exit status (0 ok, 1 verification failed, 2 manual step missing).

  vocab_size: SentencePiece pieces (None: the dataset's own, 32000; sst5 8000).
  listops_fields: `config.data` fields of listops_synthetic (split sizes `num_<split>`, lengths); training
  reads the cache only with the same fields, so they are printed as the matching `--config.data.*` flags.
  """
  from data import characters, images, text

  data_dir = os.path.expanduser(data_dir)
  os.makedirs(data_dir, exist_ok=True)
  print(describe(name, data_dir), flush=True)
  start = time.time()
  if name == "listops_synthetic":
    from data import listops

    fields = dict(listops_fields or {})
    config = _config(name, data_dir, **fields)
    for split in listops.SPLIT_SIZES:
      path = listops.build_cache(config, split, workers=os.cpu_count() or 1, progress=True)
      print(f"  {split}: {path}", flush=True)
    if fields:
      print("  train with the same fields: " + " ".join(f"--config.data.{k}={v}" for k, v in fields.items()))
    ok = verify(name, data_dir, **fields)
    print(f"{name}: {'verified' if ok else 'VERIFICATION FAILED'} in {time.time() - start:.0f} s")
    return 0 if ok else 1
  if name == "lra":
    status = 0
    for task in LRA_TASKS:
      status = max(status, prepare(task, data_dir, skip_build=skip_build, seed=seed, lra_sha256=lra_sha256))
    return status
  if name in images.SPECS and not skip_build:
    build_tfds(images.SPECS[name][0], data_dir)
  elif name in text.SPECS:
    spec = text.SPECS[name]
    if not skip_build:
      beam = spec.get("beam", True)  # pg19's builder is a plain generator
      try:
        build_tfds(spec.get("build_name", spec["tfds_name"]), data_dir, beam_flags=None if not beam else
                   beam_flags or ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                                  f"--direct_num_workers={os.cpu_count()}"])
      except ImportError as e:
        if name != "sst5":
          raise
        print(f"MANUAL STEP MISSING: {SST5_NEEDS} ({e})", flush=True)
        return 2
    train_spm(name, data_dir, vocab_size=vocab_size or text.default_vocab(name),
              docs=spm_docs or spec.get("spm_docs", 1_000_000), seed=seed)
  elif name in characters.SPECS:
    status = prepare_characters(name, data_dir)
    if status is not None:
      return status
  elif name in ("lra_text", "lra_image") and not skip_build:
    build_tfds("imdb_reviews/plain_text" if name == "lra_text" else "cifar10", data_dir)
  elif name in ("lra_listops", "lra_retrieval", "lra_pathfinder"):
    try:
      if unpack_lra(data_dir, lra_sha256) is None:
        print(f"MANUAL STEP MISSING: {PLAN['lra'][2].format(data_dir=data_dir)}")
        return 2
    except ArchiveMismatch as e:
      print(f"ERROR: {e}", file=sys.stderr, flush=True)
      return 1
  ok = verify(name, data_dir)
  print(f"{name}: {'verified' if ok else 'VERIFICATION FAILED'} in {time.time() - start:.0f} s")
  return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
  from data import DATASETS

  generated = ("synthetic_recall", "synthetic_local")  # made on the fly: nothing to prepare
  names = sorted(n for n in DATASETS if n not in generated) + ["lra"]
  parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("dataset", choices=names)
  parser.add_argument("--data_dir", required=True)
  parser.add_argument("--skip_build", action="store_true", help="only tokenizer training and verification")
  parser.add_argument("--vocab_size", type=int, default=None,
                      help="SentencePiece pieces (default 32000; sst5: 8000)")
  parser.add_argument("--spm_docs", type=int, default=None,
                      help="training documents sampled for SentencePiece (default 1M; pg19: 2000 books)")
  parser.add_argument("--beam_flags", default=None, help="Beam pipeline flags, space-separated (wiki40b, c4)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--lra_sha256", default=None,
                      help=f"LRA tasks: the sha256 {LRA_ARCHIVE} must have (checked before unpacking)")
  listops = parser.add_argument_group("listops_synthetic sizes (defaults: the published process)")
  for split in ("train", "validation", "test"):
    listops.add_argument(f"--num_{split}", type=int, default=None, help=f"examples in the {split} split")
  listops.add_argument("--min_length", type=int, default=None, help="shortest expression, in tokens")
  listops.add_argument("--max_length", type=int, default=None, help="longest expression, in tokens")
  args = parser.parse_args(argv)
  listops_fields = {k: getattr(args, k) for k in ("num_train", "num_validation", "num_test", "min_length",
                                                  "max_length") if getattr(args, k) is not None}
  for key, value in listops_fields.items():
    if value < 1:
      parser.error(f"--{key} must be >= 1, got {value}")
  if args.lra_sha256 is not None and len(args.lra_sha256.strip()) != 64 or any(
      c not in "0123456789abcdef" for c in (args.lra_sha256 or "").strip().lower()):
    parser.error(f"--lra_sha256 must be 64 hexadecimal digits, got {args.lra_sha256!r}")
  if listops_fields and args.dataset != "listops_synthetic":
    parser.error(f"--{next(iter(listops_fields))} applies to listops_synthetic only")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  return prepare(args.dataset, args.data_dir, skip_build=args.skip_build, vocab_size=args.vocab_size,
                 spm_docs=args.spm_docs, beam_flags=args.beam_flags.split() if args.beam_flags else None,
                 seed=args.seed, listops_fields=listops_fields, lra_sha256=args.lra_sha256)


if __name__ == "__main__":
  sys.exit(main())
