"""enwik8 and text8 (data/characters.py): `python -m data.prepare` from a small zip built here (never the
network), the 90/5/5 split scaled, the vocabularies, shuffled windows and the ordered stream against the file
sliced by definition, the generated stand-in, and the one-line message when the data is missing."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
import zipfile

import ml_collections
import numpy as np
import pytest

import data
from data import characters, ordered, prepare, testing

SIZE = 20_000  # characters in the test archives: 18,000 / 1,000 / 1,000


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
  """Every URL read fails as it does on a machine without internet."""
  def refuse(url, *args, **kwargs):
    raise urllib.error.URLError("no network in tests")

  monkeypatch.setattr(urllib.request, "urlopen", refuse)


def _raw(name: str, seed: int = 0) -> bytes:
  rng = np.random.default_rng(seed)
  if name == "enwik8":  # every byte value, NUL and 0xFF included
    return bytes(rng.integers(0, 256, size=SIZE, dtype=np.uint8))
  alphabet = np.frombuffer(characters.TEXT8_ALPHABET.encode(), np.uint8)
  return alphabet[rng.integers(0, 27, size=SIZE)].tobytes()


def _zip(root, name: str, raw: bytes, member: str | None = None) -> str:
  path = os.path.join(str(root), f"{name}.zip")
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr(member or name, raw)
  return path


def _config(name: str, data_dir, seq_len: int = 32, **fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {"name": name, "data_dir": str(data_dir), "seq_len": seq_len,
                                             **fields}})


@pytest.mark.parametrize("name", ["enwik8", "text8"])
def test_prepare_from_zip_splits_90_5_5(tmp_path, capsys, name):
  """The zip's member is encoded and split into its first 90%, the next 5% and the last 5%; the published
  sizes (10^8 characters) are what verification checks, so the small archive fails it, saying so."""
  raw = _raw(name)
  _zip(tmp_path, name, raw)
  assert prepare.main([name, "--data_dir", str(tmp_path)]) == 1
  out = capsys.readouterr().out
  assert f"has {SIZE} characters, not the published 100000000" in out
  assert "train: 18000 characters" in out and "expected 175781" in out and "MISMATCH" in out
  config = _config(name, tmp_path)
  splits = [characters.split_tokens(config, s) for s in characters.SPLITS]
  assert [len(s) for s in splits] == [18_000, 1_000, 1_000]
  assert all(s.dtype == np.uint8 for s in splits)
  assert characters.decode(name, np.concatenate(splits)) == raw  # nothing lost, order kept
  assert prepare.verify(name, str(tmp_path), {"train": 18_000 // 512, "validation": 1, "test": 1})
  assert prepare.main([name, "--data_dir", str(tmp_path)]) == 1  # a second run keeps the prepared splits
  assert "already prepared" in capsys.readouterr().out


def test_published_split_and_vocabularies():
  assert characters.split_lengths(10**8) == {"train": 90_000_000, "validation": 5_000_000, "test": 5_000_000}
  enwik8 = data.dataset_info(_config("enwik8", "/nowhere"))
  text8 = data.dataset_info(_config("text8", "/nowhere"))
  assert (enwik8.task, enwik8.vocab_size, enwik8.bos_id, enwik8.input_vocab_size) == ("lm", 256, 256, 257)
  assert (text8.task, text8.vocab_size, text8.bos_id, text8.input_vocab_size) == ("lm", 27, 27, 28)
  assert enwik8.split_sizes == {"train": 90_000_000 // 32, "validation": 5_000_000 // 32,
                                "test": 5_000_000 // 32}
  np.testing.assert_array_equal(characters.encode("text8", b" az b"), [0, 1, 26, 0, 2])
  assert characters.decode("text8", np.arange(27)) == characters.TEXT8_ALPHABET.encode()
  np.testing.assert_array_equal(characters.encode("enwik8", b"\x00\xff<"), [0, 255, 60])
  with pytest.raises(ValueError, match="outside space and a-z"):
    characters.encode("text8", b"ab C")


def test_download_failure_names_the_url_and_the_file(tmp_path, capsys):
  assert prepare.main(["text8", "--data_dir", str(tmp_path)]) == 2
  out = capsys.readouterr().out
  assert "MANUAL STEP MISSING" in out and "http://mattmahoney.net/dc/text8.zip" in out
  assert os.path.join(str(tmp_path), "text8.zip") in out and not os.path.exists(tmp_path / "text8")


def test_wrong_archive_is_refused(tmp_path, capsys):
  _zip(tmp_path, "enwik8", b"x" * 100, member="enwik9")
  assert prepare.prepare("enwik8", str(tmp_path)) == 1
  assert "not 'enwik8'" in capsys.readouterr().err
  _zip(tmp_path, "text8", b"Not text8", member="text8")
  assert prepare.prepare("text8", str(tmp_path)) == 1
  assert "outside space and a-z" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "enwik8") and not os.path.exists(tmp_path / "text8")


@pytest.mark.parametrize("name", ["enwik8", "text8"])
def test_shuffled_windows_and_ordered_stream(tmp_path, name):
  """Shuffled: every row is one whole window [i * L, (i + 1) * L) of the split, an evaluation pass reads each
  window once. Ordered: row b of step t is stream b's segment t, the targets one character on."""
  characters.write_splits(name, str(tmp_path), _raw(name, seed=1), source="test")
  L, B = 32, 4
  config = _config(name, tmp_path, seq_len=L)
  train = characters.split_tokens(config, "train").astype(np.int32)
  windows = train[:len(train) // L * L].reshape(-1, L)  # [records, L]
  batch = next(iter(data.create_dataset(config, "train", batch_size=B, seed=0, shard_index=0, shard_count=1)))
  assert batch["inputs"].shape == (B, L) and batch["inputs"].dtype == np.int32
  assert batch["mask"].all() and (batch["segment_ids"] == 1).all() and batch["valid"].all()
  for row in batch["inputs"]:
    assert (windows == row).all(axis=1).any()
  assert len({tuple(r) for r in batch["inputs"]}) == B  # shuffled: distinct windows
  val = characters.split_tokens(config, "validation").astype(np.int32)
  evals = list(data.create_dataset(config, "validation", batch_size=B, seed=0, shard_index=0, shard_count=1,
                                   shuffle=False, num_epochs=1))
  rows = np.concatenate([b["inputs"][b["valid"]] for b in evals])
  np.testing.assert_array_equal(rows.reshape(-1), val[:len(val) // L * L])

  config.data.ordered = True
  assert name in ordered.lm_streams()
  n = len(train) // B
  streams = train[:n * B].reshape(B, n)  # [B, n]
  it = iter(data.create_dataset(config, "train", batch_size=B, seed=0, shard_index=0, shard_count=1))
  for t in range(3):
    b = next(it)
    np.testing.assert_array_equal(b["inputs"], streams[:, t * L:(t + 1) * L])
    np.testing.assert_array_equal(b["targets"], streams[:, t * L + 1:(t + 1) * L + 1])
    np.testing.assert_array_equal(b["reset"], np.full(B, t == 0))
    assert (b["segment_ids"] == 1).all()
  state = it.get_state()
  assert state["step"] == 3 and state[ordered.ORDERED_KEY]["dataset"] == name


def test_missing_data_names_the_prepare_command(tmp_path):
  config = _config("enwik8", tmp_path / "empty")
  with pytest.raises(FileNotFoundError) as e:
    data.create_dataset(config, "train", batch_size=2, seed=0, shard_index=0, shard_count=1)
  message = str(e.value)
  assert "\n" not in message
  assert f"prepare it with: python -m data.prepare enwik8 --data_dir {tmp_path / 'empty'}" in message
  config.data.ordered = True
  with pytest.raises(FileNotFoundError, match="python -m data.prepare enwik8"):
    data.create_dataset(config, "train", batch_size=2, seed=0, shard_index=0, shard_count=1)


@pytest.mark.parametrize("name", ["enwik8", "text8"])
def test_stand_in_is_prepared_layout_in_the_alphabet(tmp_path, capsys, name):
  """`config.data.stand_in` reads the generated pseudo-text (deterministic, the right alphabet) when the
  prepared splits are missing, shuffled and ordered alike."""
  with testing.mock_data(name, tmp_path) as data_dir:
    config = _config(name, data_dir)
    splits = {s: characters.split_tokens(config, s) for s in characters.SPLITS}
  assert {s: len(v) for s, v in splits.items()} == characters.split_lengths(testing.CHARACTER_STAND_IN)
  text = characters.decode(name, np.concatenate(list(splits.values())))
  assert text == testing.character_text(name, np.random.default_rng(0), testing.CHARACTER_STAND_IN)
  if name == "text8":
    assert set(text) <= set(characters.TEXT8_ALPHABET.encode()) and max(splits["train"]) == 26
  else:
    assert b"<page>" in text and "\u00e9".encode() in text and max(splits["train"]) > 127
  stand_in = _config(name, tmp_path / "missing", seq_len=64, stand_in=True, ordered=True)
  batch = next(iter(data.create_dataset(stand_in, "validation", batch_size=8, seed=0, shard_index=0,
                                        shard_count=1)))
  assert batch["inputs"].shape == (8, 64) and batch["reset"].all()
  stand_in.data.ordered = False
  batch = next(iter(data.create_dataset(stand_in, "train", batch_size=8, seed=0, shard_index=0,
                                        shard_count=1)))
  assert batch["inputs"].shape == (8, 64)
