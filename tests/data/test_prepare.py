"""`python -m data.prepare`: plan printed up front, manual steps, unpacking, tokenizer training,
verification."""

from __future__ import annotations

import os
import tarfile

import numpy as np
import pytest

from data import prepare, testing, tokenizer


def test_plan_names_size_time_and_manual_downloads(capsys):
  text = prepare.describe("imagenet64", "/data")
  assert "size:" in text and "time:" in text
  assert "train_64x64.tar" in text and "/data/downloads/manual/" in text
  lra = prepare.describe("lra_pathfinder", "/data")
  assert ("https://storage.googleapis.com/long-range-arena/lra_release.gz" in lra
          and "/data/lra_release/" in lra)


def test_lra_missing_archive_is_a_manual_step(tmp_path, capsys):
  assert prepare.main(["lra_listops", "--data_dir", str(tmp_path)]) == 2
  out = capsys.readouterr().out
  assert "MANUAL STEP MISSING" in out and "lra_release.gz" in out and str(tmp_path) in out


def test_lra_archive_is_unpacked_and_counts_verified(tmp_path, capsys):
  src = tmp_path / "src"
  testing.write_lra(str(src), seed=1, num_examples=8)
  dest = tmp_path / "dest"
  dest.mkdir()
  with tarfile.open(dest / "lra_release.gz", "w:gz") as tar:
    tar.add(src / "lra_release", arcname="lra_release")
  # Published sizes differ from the 8-row fixtures: verification must say so and fail.
  assert prepare.prepare("lra_listops", str(dest)) == 1
  out = capsys.readouterr().out
  assert os.path.isfile(dest / "lra_release" / "lra_release" / "listops-1000" / "basic_train.tsv")
  assert "found 8" in out and "expected 96000" in out and "MISMATCH" in out
  assert prepare.verify("lra_listops", str(dest), {"train": 8, "validation": 8, "test": 8})
  assert prepare.verify("lra_retrieval", str(dest), {"train": 8, "validation": 8, "test": 8})
  assert not prepare.verify("lra_retrieval", str(dest), {"train": 9, "validation": 8, "test": 8})


def test_wiki40b_tokenizer_training_from_prepared_directory(tmp_path, capsys):
  testing.write_prepared_text("wiki40b", str(tmp_path), {
    s: testing.documents(np.random.default_rng(i), 20, wiki_markup=True)
    for i, s in enumerate(("train", "validation", "test"))})
  model = tmp_path / "spm" / "wiki40b.model"
  assert not model.exists()
  status = prepare.prepare("wiki40b", str(tmp_path), skip_build=True, vocab_size=150, spm_docs=15)
  assert status == 1  # 20-document fixture vs the published 2,926,536
  sp = tokenizer.load(str(model))
  assert sp.get_piece_size() == 150 and sp.piece_to_id("[MASK]") == tokenizer.MASK_ID
  out = capsys.readouterr().out
  assert "found 20" in out and "expected 2926536" in out
  assert prepare.verify("wiki40b", str(tmp_path), {"train": 20, "validation": 20, "test": 20})


def test_unknown_dataset_is_rejected(capsys):
  """One line naming the argument and the datasets, exit 2, no usage block."""
  with pytest.raises(SystemExit) as exit_info:
    prepare.main(["mnist", "--data_dir", "/tmp"])
  assert exit_info.value.code == 2
  (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
  assert line.startswith("ERROR: argument dataset: invalid choice: 'mnist'") and "'cifar10'" in line


def test_imagenet64_archives_are_served_from_the_manual_directory(tmp_path):
  calls = []

  class _Builder:
    def _split_generators(self, dl_manager):
      paths = dl_manager.download(["http://image-net.org/small/train_64x64.tar",
                                   "http://image-net.org/small/valid_64x64.tar"])
      calls.append(dl_manager.iter_archive(paths[0]))
      return paths

  class _RealManager:
    def iter_archive(self, path):
      return f"iter:{path}"

  builder = _Builder()
  prepare._serve_manual_archives(builder, str(tmp_path), prepare.IMAGENET64_ARCHIVES)
  paths = builder._split_generators(_RealManager())
  assert paths == [str(tmp_path / "train_64x64.tar"), str(tmp_path / "valid_64x64.tar")]
  assert calls == [f"iter:{tmp_path / 'train_64x64.tar'}"]


def _lra_archive(tmp_path):
  src = tmp_path / "src"
  testing.write_lra(str(src), seed=1, num_examples=8)
  dest = tmp_path / "dest"
  dest.mkdir()
  with tarfile.open(dest / "lra_release.gz", "w:gz") as tar:
    tar.add(src / "lra_release", arcname="lra_release")
  return dest


def test_lra_archive_checksum_is_recorded_and_checked(tmp_path, capsys):
  """No published checksum: the unpack records the archive's sha256; a later run with a different archive
  (damaged or another download) is refused naming both; --lra_sha256 is checked before unpacking."""
  import hashlib

  dest = _lra_archive(tmp_path)
  archive = dest / "lra_release.gz"
  digest = hashlib.sha256(archive.read_bytes()).hexdigest()
  assert prepare.main(["lra_listops", "--data_dir", str(dest), "--lra_sha256", "0" * 64]) == 1
  assert "not the expected" in capsys.readouterr().err and not (dest / "lra_release").exists()
  assert prepare.main(["lra_listops", "--data_dir", str(dest), "--lra_sha256", digest]) == 1  # fixture sizes
  assert (dest / "lra_release.gz.sha256").read_text() == f"{digest}  lra_release.gz\n"
  capsys.readouterr()
  data = bytearray(archive.read_bytes())
  data[len(data) // 2] ^= 1
  archive.write_bytes(bytes(data))
  assert prepare.prepare("lra_listops", str(dest)) == 1
  err = capsys.readouterr().err
  assert digest in err and "was unpacked from one with sha256" in err
  with pytest.raises(SystemExit):
    prepare.main(["lra_listops", "--data_dir", str(dest), "--lra_sha256", "xyz"])
