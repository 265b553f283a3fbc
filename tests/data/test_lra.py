"""LRA readers and the ListOps generator on small generated files (offline): layouts, malformed rows, towers,
pathfinder, TFDS text and image, host shards, the in-memory and kept-id paths, the generated cache."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest

import data
from data import listops, lra, records, testing
from tests.data.readers import data_config, split_batches


def test_lra_listops_reads_both_layouts(lra_dir, tmp_path):
  nested = os.path.join(lra_dir, "lra_release", "lra_release", "listops-1000", "basic_val.tsv")
  rows = [line.rstrip("\n").split("\t") for line in open(nested)][1:]
  flat = tmp_path / "lra_release" / "listops-1000"
  flat.mkdir(parents=True)
  shutil.copy(nested, flat / "basic_val.tsv")
  for base in (lra_dir, str(tmp_path)):
    config = data_config("lra_listops", base)
    info = data.dataset_info(config)
    assert (info.task, info.num_classes, info.seq_len) == ("classify", 10, 2000)
    batches = split_batches(config, batch_size=5)
    inputs = np.concatenate([b["inputs"] for b in batches])
    masks = np.concatenate([b["mask"] for b in batches])
    labels = np.concatenate([b["label"] for b in batches])
    valid = np.concatenate([b["valid"] for b in batches])
    assert valid.sum() == len(rows) == 12
    for i, (src, target) in enumerate(rows):
      toks = [listops.VOCAB[t] for t in inputs[i][masks[i]]]
      assert toks == [t for t in src.split() if t not in "()"]  # parentheses dropped, nothing else
      assert labels[i] == int(target) == listops.evaluate(toks)
      assert not masks[i][len(toks):].any()


def test_lra_malformed_rows_name_file_and_line(lra_dir, tmp_path, caplog):
  root = tmp_path / "lra_release" / "listops-1000"
  root.mkdir(parents=True)
  good = open(os.path.join(lra_dir, "lra_release", "lra_release", "listops-1000", "basic_test.tsv")).read()
  lines = good.splitlines()
  lines.insert(3, "[MAX 1 2 ]")  # missing Target
  lines.insert(5, "[MAX 1 banana ]\t3")  # unknown token
  (root / "basic_test.tsv").write_text("\n".join(lines) + "\n")
  path = str(root / "basic_test.tsv")
  with pytest.raises(ValueError, match=rf"{path}:4: expected 2 tab-separated fields"):
    split_batches(data_config("lra_listops", str(tmp_path)), split="test")
  with caplog.at_level(logging.WARNING, logger="data"):
    batches = split_batches(data_config("lra_listops", str(tmp_path), skip_malformed=True), split="test")
  assert sum(b["valid"].sum() for b in batches) == 12
  assert "skipped 2 malformed rows" in caplog.text and f"{path}:6" in caplog.text


def test_lra_retrieval_two_towers_byte_level(lra_dir):
  config = data_config("lra_retrieval", lra_dir, seq_len=300)
  path = os.path.join(lra_dir, "lra_release", "lra_release", "tsv_data", "new_aan_pairs.train.tsv")
  rows = [line.rstrip("\n").split("\t") for line in open(path)]
  batches = split_batches(config, split="train", batch_size=3, shuffle=False, num_epochs=1)
  got = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  assert data.dataset_info(config).task == "retrieval"
  for i, row in enumerate(rows):
    assert got["label"][i] == int(float(row[0]))
    for j, txt in ((1, row[3]), (2, row[4])):
      raw = np.frombuffer(txt.encode()[:300], np.uint8)
      np.testing.assert_array_equal(got[f"inputs{j}"][i][got[f"mask{j}"][i]], raw)
      assert got[f"mask{j}"][i].sum() == min(300, len(txt.encode()))


def test_lra_pathfinder_pixels_labels_and_file_splits(lra_dir):
  from PIL import Image

  config = data_config("lra_pathfinder", lra_dir)
  root = os.path.join(lra_dir, "lra_release", "lra_release", "pathfinder32", "curv_contour_length_14")
  seen = {}
  for split in ("train", "validation", "test"):
    source, _ = lra.make_source(config, split)
    seen[split] = set(source.items)
    batches = split_batches(config, split=split, batch_size=2, shuffle=False, num_epochs=1)
    b = batches[0]
    rel, label = source.items[0]
    np.testing.assert_array_equal(b["inputs"][0], np.asarray(Image.open(os.path.join(root, rel))).reshape(-1))
    assert b["label"][0] == label and b["mask"][0].all() and b["inputs"].shape[1] == 1024
  assert not (seen["train"] & seen["validation"]) and not (seen["train"] & seen["test"])
  # 10 metadata files x 3 rows: files 0-7 train, 8 validation, 9 test.
  assert [len(seen[s]) for s in ("train", "validation", "test")] == [24, 3, 3]
  assert all(rel.startswith("imgs/9/") for rel, _ in seen["test"])


def test_lra_text_and_image_from_tfds(tmp_path):
  import tensorflow_datasets as tfds

  with testing.mock_data("lra_text", tmp_path, num_examples=5):
    b = split_batches(data_config("lra_text", None, seq_len=50), split="train", batch_size=5, shuffle=False,
                 num_epochs=1)[0]
    src = tfds.data_source("imdb_reviews", split="train")
    for i in range(5):
      raw = np.frombuffer(src[i]["text"].encode("utf-8")[:50], np.uint8)
      np.testing.assert_array_equal(b["inputs"][i][b["mask"][i]], raw)
      assert b["label"][i] == src[i]["label"]
  with testing.mock_data("lra_image", tmp_path, num_examples=3):
    b = split_batches(data_config("lra_image"), split="train", batch_size=3, shuffle=False, num_epochs=1)[0]
    img = tfds.data_source("cifar10", split="train")[1]["image"].astype(np.float64)
    gray = np.round(img @ [0.2989, 0.5870, 0.1140]).reshape(-1)
    np.testing.assert_array_equal(b["inputs"][1], gray)
    assert b["inputs"].shape == (3, 1024) and b["mask"].all()
    # A black pixel is a real token: nothing infers padding from the value 0.
    assert data.dataset_info(data_config("lra_image")).pad_id == 0


def test_missing_files_name_path_and_prepare_command(tmp_path):
  with pytest.raises(FileNotFoundError,
                     match=r"listops-1000/basic_train.tsv.*python -m data.prepare lra_listops"):
    split_batches(data_config("lra_listops", str(tmp_path)), split="train")
  with pytest.raises(FileNotFoundError, match=r"wiki40b/en/1.3.0.*python -m data.prepare wiki40b --data_dir"):
    split_batches(data_config("wiki40b", str(tmp_path)), split="train")
  with pytest.raises(ValueError, match="not a known dataset"):
    data.dataset_info(data_config("mnist"))


def test_listops_generator_published_process():
  rng = np.random.default_rng(0)
  ops_seen = set()
  for _ in range(12):
    toks, label = listops.sample(rng, **listops.DEFAULTS)
    core = [t for t in toks if t not in "()"]
    assert 500 <= len(core) <= 2000
    assert 1 <= listops.expression_depth(toks) <= listops.DEFAULTS["max_depth"]
    assert listops.evaluate(toks) == label == listops.evaluate(core)
    ops_seen |= {t for t in toks if t in listops.OPERATORS}
  assert ops_seen == set(listops.OPERATORS)
  assert listops.apply_op(listops.MED, [1, 4]) == 2 and listops.apply_op(listops.MED, [7, 1, 3]) == 3
  assert listops.apply_op(listops.SUM_MOD, [9, 8, 5]) == 2
  # The text form nests pairs exactly like the LRA files.
  tree = (listops.MAX, [2, (listops.MIN, [5, 3]), 9])
  assert " ".join(listops.tree_tokens(tree)) == "( ( ( ( [MAX 2 ) ( ( ( [MIN 5 ) 3 ) ] ) ) 9 ) ] )"
  assert listops.evaluate(listops.tree_tokens(tree)) == 9 and listops.tree_depth(tree) == 2


def test_listops_synthetic_dataset_is_deterministic_random_access():
  config = data_config("listops_synthetic", min_length=20, max_length=80, num_validation=6)
  a = split_batches(config, batch_size=3)
  b = split_batches(config, batch_size=3)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
  for batch in a:
    for ids, m, label in zip(batch["inputs"], batch["mask"], batch["label"], strict=True):
      toks = [listops.VOCAB[t] for t in ids[m]]
      assert 20 <= len(toks) <= 80 and listops.evaluate(toks) == label


def test_lra_shards_cover_real_reader(lra_dir):
  config = data_config("lra_listops", lra_dir)
  rows = []
  for h in range(2):
    for b in split_batches(config, split="validation", batch_size=5, shard_index=h, shard_count=2):
      rows += [tuple(x[m]) for x, m, v in zip(b["inputs"], b["mask"], b["valid"], strict=True) if v]
  alone = []
  for b in split_batches(config, split="validation", batch_size=5):
    alone += [tuple(x[m]) for x, m, v in zip(b["inputs"], b["mask"], b["valid"], strict=True) if v]
  assert sorted(rows) == sorted(alone) and len(rows) == 12


def test_listops_synthetic_split_is_generated_once_and_bit_identical(tmp_path, monkeypatch):
  fields = dict(min_length=20, max_length=80, num_train=24, num_validation=7, data_seed=3)
  fly = data_config("listops_synthetic", **fields)  # no directory: generated on access
  cached = data_config("listops_synthetic", str(tmp_path), **fields)
  for split, kw in (("validation", {}), ("train", dict(num_epochs=2))):
    a, b = split_batches(fly, split, batch_size=5, **kw), split_batches(cached, split, batch_size=5, **kw)
    assert len(a) == len(b) > 1
    for x, y in zip(a, b, strict=True):
      assert x.keys() == y.keys()
      for key in x:
        assert x[key].dtype == y[key].dtype
        np.testing.assert_array_equal(x[key], y[key])
  assert isinstance(listops.make_source(cached, "train"), listops.CachedSource)
  root = tmp_path / "listops_synthetic"
  # no temporaries left
  assert sorted(p.name.split("-")[0] for p in root.iterdir()) == ["train", "validation"]
  # Later runs read the cache (the generator is not called again) ...
  monkeypatch.setattr(listops, "_generate_range", lambda args: pytest.fail("generated again"))
  assert len(split_batches(cached, "validation", batch_size=5)) == 2
  # ... and every field that changes the examples changes the key.
  for change in (dict(data_seed=4), dict(num_validation=8), dict(max_length=81), dict(listops_parens=True)):
    assert listops.cache_path(data_config("listops_synthetic", str(tmp_path), **{**fields, **change}),
                              "validation") != listops.cache_path(cached, "validation")
  assert listops.cache_path(data_config("listops_synthetic", str(tmp_path), cache_dir=str(tmp_path / "c"),
                                    **fields), "validation").startswith(str(tmp_path / "c"))


def test_prepare_builds_the_listops_synthetic_cache(tmp_path, monkeypatch, capsys):
  from data import prepare

  monkeypatch.setattr(listops, "SPLIT_SIZES", {"train": 6, "validation": 3, "test": 2})
  monkeypatch.setattr(listops, "DEFAULTS", dict(listops.DEFAULTS, min_length=10, max_length=40))
  monkeypatch.setattr(os, "cpu_count", lambda: 1)
  assert prepare.prepare("listops_synthetic", str(tmp_path)) == 0
  out = capsys.readouterr().out
  assert "verified" in out and "listops_synthetic/train-" in out
  config = data_config("listops_synthetic", str(tmp_path))
  for split, n in listops.SPLIT_SIZES.items():
    source = listops.CachedSource(listops.cache_path(config, split))
    gen = listops.GeneratedSource(split, n, 0, listops._params(config))
    for i in range(n):
      tokens, label = gen[i]
      np.testing.assert_array_equal(source[i][0], listops.encode(tokens))
      assert source[i][1] == label


def test_listops_synthetic_generation_resumes_after_an_interruption(tmp_path, monkeypatch):
  fields = dict(min_length=20, max_length=60, num_validation=9, data_seed=1)
  config = data_config("listops_synthetic", str(tmp_path), **fields)
  real, calls = listops._generate_range, []

  def crash_on_third(args):
    calls.append(args[-2:])
    if len(calls) == 3:
      raise KeyboardInterrupt
    return real(args)

  monkeypatch.setattr(listops, "_generate_range", crash_on_third)
  with pytest.raises(KeyboardInterrupt):
    listops.build_cache(config, "validation", workers=1)
  path = listops.cache_path(config, "validation")
  assert not os.path.exists(path) and len(os.listdir(path + ".parts")) == 2  # two shards kept, no cache yet
  calls.clear()
  monkeypatch.setattr(listops, "_generate_range", lambda args: calls.append(args[-2:]) or real(args))
  assert listops.build_cache(config, "validation", workers=1) == path
  assert len(calls) == 2 and not os.path.exists(path + ".parts")  # only the missing shards were generated
  source = listops.CachedSource(path)
  gen = listops.GeneratedSource("validation", 9, 1, listops._params(config))
  for i in range(9):
    np.testing.assert_array_equal(source[i][0], listops.encode(gen[i][0]))


def test_prepare_listops_synthetic_size_flags(tmp_path, monkeypatch, capsys):
  from data import prepare

  monkeypatch.setattr(os, "cpu_count", lambda: 1)
  argv = ["listops_synthetic", "--data_dir", str(tmp_path), "--num_train", "5", "--num_validation", "3",
          "--num_test", "2", "--min_length", "10", "--max_length", "30"]
  assert prepare.main(argv) == 0
  out = capsys.readouterr().out
  assert "--config.data.num_train=5" in out and "--config.data.max_length=30" in out and "verified" in out
  with pytest.raises(SystemExit):
    prepare.main(["lra_text", "--data_dir", str(tmp_path), "--num_train", "5"])
  with pytest.raises(SystemExit):
    prepare.main(["listops_synthetic", "--data_dir", str(tmp_path), "--num_train", "0"])


def test_lra_text_split_in_memory_gives_the_same_batches(tmp_path):
  with testing.mock_data("lra_text", tmp_path, num_examples=11) as dd:
    memory = data_config("lra_text", dd, seq_len=40)
    disk = data_config("lra_text", dd, seq_len=40, cache_in_memory=0)
    source, _ = lra.make_source(memory, "train")
    assert isinstance(source, records.InMemorySource) and len(source) == 11
    assert not isinstance(lra.make_source(disk, "train")[0], records.InMemorySource)
    too_small = data_config("lra_text", dd, seq_len=40, cache_in_memory=1e-6)  # MB: the split does not fit
    assert not isinstance(lra.make_source(too_small, "train")[0], records.InMemorySource)
    a = split_batches(memory, "train", batch_size=4, num_epochs=2)
    b = split_batches(disk, "train", batch_size=4, num_epochs=2)
    image = lra.make_source(data_config("lra_image", dd), "test")[0]
  assert len(a) == len(b) == 6  # 22 records (2 epochs), the last batch padded
  for x, y in zip(a, b, strict=True):
    for key in x:
      assert x[key].dtype == y[key].dtype
      np.testing.assert_array_equal(x[key], y[key])
  assert isinstance(image, records.InMemorySource)


@pytest.mark.parametrize("parens", [False, True])
def test_lra_listops_kept_ids_give_the_same_batches(lra_dir, parens):
  kept = data_config("lra_listops", lra_dir, seq_len=30, listops_parens=parens)
  disk = data_config("lra_listops", lra_dir, seq_len=30, listops_parens=parens, cache_in_memory=0)
  assert lra.make_source(kept, "train")[0].kept is not None and lra.make_source(disk, "train")[0].kept is None
  a = split_batches(kept, "train", batch_size=5, num_epochs=2)
  b = split_batches(disk, "train", batch_size=5, num_epochs=2)
  assert len(a) == len(b) == 5
  for x, y in zip(a, b, strict=True):
    for key in x:
      assert x[key].dtype == y[key].dtype
      np.testing.assert_array_equal(x[key], y[key])
