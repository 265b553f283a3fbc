"""Input pipelines on small generated data (offline): layouts, masks, tokenization, packing, resume,
sharding."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil

import ml_collections
import numpy as np
import pytest

import data
from data import listops, lra, pipeline, testing, text, tokenizer
from models import metrics


def _config(name: str, data_dir: str | None = None, **fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {"name": name, "data_dir": data_dir, **fields}})


def _batches(config, split="validation", batch_size=4, **kw):
  kw.setdefault("shard_index", 0)
  kw.setdefault("shard_count", 1)
  return list(data.create_dataset(config, split, batch_size=batch_size, seed=0, **kw))


# ------------------------------------------------------------------------------------------------ images


@pytest.mark.parametrize("name,shape", [("cifar10", (32, 32, 3)), ("imagenet64", (64, 64, 3))])
def test_images_raster_order_masks_and_bits_per_dim(tmp_path, name, shape):
  import tensorflow_datasets as tfds

  from data import images

  with testing.mock_data(name, tmp_path, num_examples=6) as dd:
    config = _config(name, dd)
    info = data.dataset_info(config)
    batches = _batches(config, batch_size=4)
    tfds_name, _, splits, _ = images.SPECS[name]
    source = tfds.data_source(tfds_name, split=splits["validation"])
    first = images.fit_image(source[0]["image"], shape)
  assert info.task == "image" and info.vocab_size == 256 and info.seq_len == math.prod(shape)
  assert info.bos_id == 256 and info.input_vocab_size == 257
  assert len(batches) == 2  # 6 records, batch 4: the last batch is padded
  b = batches[0]
  assert b["inputs"].shape == (4, info.seq_len) and b["inputs"].dtype == np.int32
  assert b["mask"].dtype == bool and b["weights"].dtype == np.float32 and b["segment_ids"].dtype == np.int32
  assert b["inputs"].min() >= 0 and b["inputs"].max() <= 255
  # Raster order, channels innermost: token 3*(r*W + c) + ch is pixel (r, c) channel ch.
  np.testing.assert_array_equal(b["inputs"][0], first.reshape(-1))
  r, c, ch = shape[0] - 1, 1, 2
  assert b["inputs"][0, 3 * (r * shape[1] + c) + ch] == first[r, c, ch]
  last = batches[-1]
  np.testing.assert_array_equal(last["valid"], [True, True, False, False])
  assert not last["mask"][2:].any() and not last["weights"][2:].any() and last["mask"][:2].all()
  # Bits/dim bookkeeping: uniform predictions cost exactly 8 bits per sub-pixel, counted over real rows only.
  totals = {"nll_sum": 0.0, "weight_sum": 0.0}
  for batch in batches:
    logits = np.zeros(batch["inputs"].shape + (info.vocab_size,), np.float32)
    _, sums = metrics.loss_and_sums("image", logits, batch)
    totals = {k: totals[k] + float(sums[k]) for k in totals}
  assert totals["weight_sum"] == 6 * info.seq_len
  assert metrics.summarize("image", totals)["bits_per_dim"] == pytest.approx(8.0, rel=1e-6)


def test_image_flip_is_off_by_default_and_mirrors_when_on():
  from data import images

  rng = np.random.default_rng(1)
  img = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
  seen = set()
  fn = images._ImageFn((4, 5, 3), flip=True)
  for seed in range(20):
    out = fn({"image": img}, np.random.default_rng(seed))["inputs"].reshape(4, 5, 3)
    if np.array_equal(out, img):
      seen.add("same")
    else:
      np.testing.assert_array_equal(out, img[:, ::-1])
      seen.add("flipped")
  assert seen == {"same", "flipped"}
  off = images._ImageFn((4, 5, 3), flip=False)
  for seed in range(5):
    np.testing.assert_array_equal(off({"image": img}, np.random.default_rng(seed))["inputs"], img.reshape(-1))
  with pytest.raises(ValueError, match="seq_len must be 3072"):
    data.dataset_info(_config("cifar10", seq_len=1024))


def test_metrics_perplexity_of_uniform_predictions():
  rng = np.random.default_rng(0)
  targets = rng.integers(0, 50, (3, 7))
  weights = (rng.random((3, 7)) < 0.6).astype(np.float32)
  batch = {"inputs": targets, "weights": weights}
  _, sums = metrics.loss_and_sums("lm", np.zeros((3, 7, 50), np.float32), batch)
  assert float(sums["weight_sum"]) == weights.sum()
  assert metrics.summarize("lm", sums)["perplexity"] == pytest.approx(50.0, rel=1e-6)
  logits = rng.normal(size=(3, 7, 50)).astype(np.float32)
  _, sums = metrics.loss_and_sums("lm", logits, batch)
  logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  want = -(np.take_along_axis(logp, targets[..., None], -1)[..., 0] * weights).sum()
  assert float(sums["nll_sum"]) == pytest.approx(want, rel=1e-5)


# ------------------------------------------------------------------------------------------------ LRA


@pytest.fixture(scope="module")
def lra_dir(tmp_path_factory):
  base = str(tmp_path_factory.mktemp("lra"))
  testing.write_lra(base, seed=3, num_examples=12)
  return base


def test_lra_listops_reads_both_layouts(lra_dir, tmp_path):
  nested = os.path.join(lra_dir, "lra_release", "lra_release", "listops-1000", "basic_val.tsv")
  rows = [line.rstrip("\n").split("\t") for line in open(nested)][1:]
  flat = tmp_path / "lra_release" / "listops-1000"
  flat.mkdir(parents=True)
  shutil.copy(nested, flat / "basic_val.tsv")
  for base in (lra_dir, str(tmp_path)):
    config = _config("lra_listops", base)
    info = data.dataset_info(config)
    assert (info.task, info.num_classes, info.seq_len) == ("classify", 10, 2000)
    batches = _batches(config, batch_size=5)
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
    _batches(_config("lra_listops", str(tmp_path)), split="test")
  with caplog.at_level(logging.WARNING, logger="data"):
    batches = _batches(_config("lra_listops", str(tmp_path), skip_malformed=True), split="test")
  assert sum(b["valid"].sum() for b in batches) == 12
  assert "skipped 2 malformed rows" in caplog.text and f"{path}:6" in caplog.text


def test_lra_retrieval_two_towers_byte_level(lra_dir):
  config = _config("lra_retrieval", lra_dir, seq_len=300)
  path = os.path.join(lra_dir, "lra_release", "lra_release", "tsv_data", "new_aan_pairs.train.tsv")
  rows = [line.rstrip("\n").split("\t") for line in open(path)]
  batches = _batches(config, split="train", batch_size=3, shuffle=False, num_epochs=1)
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

  config = _config("lra_pathfinder", lra_dir)
  root = os.path.join(lra_dir, "lra_release", "lra_release", "pathfinder32", "curv_contour_length_14")
  seen = {}
  for split in ("train", "validation", "test"):
    source, _ = lra.make_source(config, split)
    seen[split] = set(source.items)
    batches = _batches(config, split=split, batch_size=2, shuffle=False, num_epochs=1)
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
    b = _batches(_config("lra_text", None, seq_len=50), split="train", batch_size=5, shuffle=False,
                 num_epochs=1)[0]
    src = tfds.data_source("imdb_reviews", split="train")
    for i in range(5):
      raw = np.frombuffer(src[i]["text"].encode("utf-8")[:50], np.uint8)
      np.testing.assert_array_equal(b["inputs"][i][b["mask"][i]], raw)
      assert b["label"][i] == src[i]["label"]
  with testing.mock_data("lra_image", tmp_path, num_examples=3):
    b = _batches(_config("lra_image"), split="train", batch_size=3, shuffle=False, num_epochs=1)[0]
    img = tfds.data_source("cifar10", split="train")[1]["image"].astype(np.float64)
    gray = np.round(img @ [0.2989, 0.5870, 0.1140]).reshape(-1)
    np.testing.assert_array_equal(b["inputs"][1], gray)
    assert b["inputs"].shape == (3, 1024) and b["mask"].all()
    # A black pixel is a real token: nothing infers padding from the value 0.
    assert data.dataset_info(_config("lra_image")).pad_id == 0


def test_missing_files_name_path_and_prepare_command(tmp_path):
  with pytest.raises(FileNotFoundError,
                     match=r"listops-1000/basic_train.tsv.*python -m data.prepare lra_listops"):
    _batches(_config("lra_listops", str(tmp_path)), split="train")
  with pytest.raises(FileNotFoundError, match=r"wiki40b/en/1.3.0.*python -m data.prepare wiki40b --data_dir"):
    _batches(_config("wiki40b", str(tmp_path)), split="train")
  with pytest.raises(ValueError, match="not a known dataset"):
    data.dataset_info(_config("mnist"))


# ------------------------------------------------------------------------------------------ ListOps generator


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
  config = _config("listops_synthetic", min_length=20, max_length=80, num_validation=6)
  a = _batches(config, batch_size=3)
  b = _batches(config, batch_size=3)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
  for batch in a:
    for ids, m, label in zip(batch["inputs"], batch["mask"], batch["label"], strict=True):
      toks = [listops.VOCAB[t] for t in ids[m]]
      assert 20 <= len(toks) <= 80 and listops.evaluate(toks) == label


# ------------------------------------------------------------------------------------------------ text


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
  out = {}
  for name in ("wiki40b", "c4"):
    base = str(tmp_path_factory.mktemp(name))
    testing.write_text(name, base, seed=5, num_examples=30)
    out[name] = base
  return out


def test_sentencepiece_trained_on_generated_corpus(text_dirs):
  model = os.path.join(text_dirs["wiki40b"], "spm", "wiki40b.model")
  sp = tokenizer.load(model)
  assert sp.get_piece_size() == 200
  assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.piece_to_id("[MASK]")) == (0, 2, 3, 4)
  sample = "kato rime subanna"
  assert sp.decode(sp.encode(sample)) == sample
  assert text.clean_text("_START_ARTICLE_\nT\n_START_PARAGRAPH_\na_NEWLINE_b") == "T\na\nb"


def _stream(config, split):
  """The documents of `split` in source order, tokenized as the pipeline does."""
  source = text.text_source(config, split)
  tok = text.Tokenize(text.spm_path(config), 200)
  return [tok.map(source[i]) for i in range(len(source))]


def test_lm_packing_respects_document_boundaries(text_dirs):
  config = _config("wiki40b", text_dirs["wiki40b"], seq_len=48)
  info = data.dataset_info(config)
  assert (info.task, info.bos_id, info.eos_id, info.metric) == ("lm", 2, 3, "perplexity")
  docs = _stream(config, "validation")
  batches = _batches(config, batch_size=3)
  # Rebuild the documents from the batches: segments in order; a batch's last segment may be cut (counted).
  pieces = []
  for b in batches:
    assert b["inputs"].shape == (3, 48)
    for row in range(3):
      segs = b["segment_ids"][row]
      assert (segs[b["mask"][row]] > 0).all() and not segs[~b["mask"][row]].any()
      assert (np.diff(segs[b["mask"][row]]) >= 0).all()
      for s in np.unique(segs[segs > 0]):
        where = np.flatnonzero(segs == s)
        assert (np.diff(where) == 1).all()
        np.testing.assert_array_equal(b["weights"][row][where], [0.0] + [1.0] * (len(where) - 1))
        pieces.append(b["inputs"][row][where])
  flat = np.concatenate(pieces)
  stream = np.concatenate(docs)
  # Each document starts with bos: its segment start (weight 0) never gets predicted across a boundary.
  assert flat[0] == tokenizer.BOS_ID
  got = [list(p) for p in pieces]
  # Documents are consecutive in the stream; dropped tails only at batch ends, so every piece is a substring.
  pos = 0
  for p in got:
    idx = _find(stream, np.asarray(p), pos)
    assert idx >= 0
    pos = idx + len(p)
  assert len(flat) <= len(stream)
  assert sum(b["weights"].sum() for b in batches) == sum(
    (b["mask"] & ~text.segment_starts(b["segment_ids"])).sum() for b in batches)


def _find(hay: np.ndarray, needle: np.ndarray, start: int) -> int:
  for i in range(start, len(hay) - len(needle) + 1):
    if hay[i] == needle[0] and np.array_equal(hay[i:i + len(needle)], needle):
      return i
  return -1


@pytest.mark.parametrize("name", ["wiki40b", "c4"])
def test_packed_text_training_stream_is_global_and_resumes_on_another_host_count(text_dirs, tmp_path, name):
  """1, 2 and 4 hosts read the same packed global batches (each its rows); a 2-host state continues as 1."""
  config = _config(name, text_dirs[name], seq_len=32)
  steps, global_batch = 5, 4

  def hosts(count):
    iters = [iter(data.create_dataset(config, "train", batch_size=global_batch // count, seed=3,
                                      shard_index=i, shard_count=count)) for i in range(count)]
    return iters

  def global_batches(iters, n):
    out = []
    for _ in range(n):
      parts = [next(it) for it in iters]
      out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return out

  one = global_batches(hosts(1), steps)
  for count in (2, 4):
    for got, want in zip(global_batches(hosts(count), steps), one, strict=True):
      for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} {count} hosts: {k}")

  two = hosts(2)
  global_batches(two, 2)
  step_dir = tmp_path / "step"
  (step_dir / "data").mkdir(parents=True)
  for i, it in enumerate(two):  # what grain's orbax handler writes per host
    (step_dir / "data" / pipeline.state_file(i, 2)).write_text(it.get_state().decode())
  resumed = hosts(1)
  pipeline.check_iterator_checkpoint(str(step_dir), resumed[0], config)
  pipeline.restore_iterator(str(step_dir), resumed[0])
  for got, want in zip(global_batches(resumed, steps - 2), one[2:], strict=True):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"{name} resumed: {k}")


def test_mlm_packing_two_segments_and_corruption(text_dirs):
  config = _config("c4", text_dirs["c4"], seq_len=64)
  info = data.dataset_info(config)
  assert (info.task, info.mask_id, info.max_segments) == ("mlm", 4, 2)
  docs = _stream(config, "validation")
  batches = _batches(config, batch_size=4)
  targets = []
  for b in batches:
    assert b["segment_ids"].max() <= 2
    chosen = b["weights"] > 0
    assert (b["mask"] | ~chosen).all()  # only real tokens are predicted
    assert not np.isin(b["targets"][chosen], [0, 2, 3]).any()  # never pad/bos/eos
    same = b["inputs"] == b["targets"]
    assert same[~chosen].all()  # unchosen positions are untouched
    for row in range(4):
      for s in (1, 2):
        seg = b["segment_ids"][row] == s
        if seg.any():
          targets.append(b["targets"][row][seg])
  for i, t in enumerate(targets):  # rows hold whole or truncated documents, in order
    np.testing.assert_array_equal(t, docs[i][: len(t)])


def test_mlm_corruption_ratios_on_a_large_sample():
  rng = np.random.default_rng(0)
  inputs = rng.integers(5, 1000, size=(200, 1000)).astype(np.int32)
  inputs[:, 0], inputs[:, -1] = tokenizer.BOS_ID, tokenizer.EOS_ID
  mask = np.ones_like(inputs, bool)
  mask[:, -100:] = False
  out, weights = text.mlm_corrupt(inputs, mask, np.random.default_rng(1), vocab_size=1000)
  chosen = weights > 0
  eligible = mask.copy()
  eligible[:, 0] = False
  assert not (chosen & ~eligible).any()
  assert chosen.sum() / eligible.sum() == pytest.approx(0.15, abs=0.003)
  masked = (out == tokenizer.MASK_ID) & chosen
  kept = (out == inputs) & chosen
  n = chosen.sum()
  assert masked.sum() / n == pytest.approx(0.8, abs=0.01)
  assert kept.sum() / n == pytest.approx(0.1 + 0.1 / 995, abs=0.01)
  randomized = chosen & ~masked & ~kept
  assert randomized.sum() / n == pytest.approx(0.1, abs=0.01)
  assert out[randomized].min() >= tokenizer.FIRST_PIECE_ID and out[randomized].max() < 1000


# ------------------------------------------------------------------------------------------- resume, sharding


@pytest.mark.parametrize("name", ["wiki40b", "c4", "lra_listops"])
def test_iterator_state_restores_identical_continuation(name, text_dirs, lra_dir):
  base = lra_dir if name.startswith("lra") else text_dirs[name]
  config = _config(name, base, seq_len=32)
  loader = data.create_dataset(config, "train", batch_size=2, seed=7, shard_index=0, shard_count=1)
  it = iter(loader)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(6)]  # crosses an epoch boundary for the small mock splits
  fresh = iter(data.create_dataset(config, "train", batch_size=2, seed=7, shard_index=0, shard_count=1))
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    assert set(got) == set(want)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  other = next(iter(data.create_dataset(config, "train", batch_size=2, seed=8, shard_index=0, shard_count=1)))
  first = next(iter(data.create_dataset(config, "train", batch_size=2, seed=7, shard_index=0, shard_count=1)))
  assert not np.array_equal(other["inputs"] if "inputs" in other else other["inputs1"], first["inputs"])


class _Numbered:
  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return int(i)

  def __repr__(self):
    return f"Numbered({self.n})"


@pytest.mark.parametrize("n,hosts", [(23, 2), (24, 3)])
def test_host_shards_are_disjoint_and_cover_the_split(n, hosts):
  config = _config("numbered")
  op = pipeline.Example(lambda i: {"inputs": np.array([i], np.int32)})
  seen = []
  for h in range(hosts):
    loader = pipeline.make_loader(_Numbered(n), [op], split="validation", batch_size=4, seed=0, shard_index=h,
                                  shard_count=hosts, shuffle=True, num_epochs=1, config=config)
    ids = [int(x) for b in loader for x, v in zip(b["inputs"][:, 0], b["valid"], strict=True) if v]
    seen.append(ids)
  flat = [i for ids in seen for i in ids]
  assert sorted(flat) == list(range(n))  # disjoint and complete
  # Training shards: equal sizes, still disjoint within an epoch.
  per_host = []
  for h in range(hosts):
    loader = pipeline.make_loader(_Numbered(n), [op], split="train", batch_size=1, seed=0, shard_index=h,
                                  shard_count=hosts, shuffle=True, num_epochs=None, config=config)
    it = iter(loader)
    per_host.append({int(next(it)["inputs"][0, 0]) for _ in range(n // hosts)})
  assert sum(len(s) for s in per_host) == len(set().union(*per_host)) == (n // hosts) * hosts


@pytest.mark.parametrize("engine", ["dataset", "loader"])
def test_training_stream_is_global_on_any_host_count(engine, tmp_path):
  """Global batch s of an endless stream is stream positions [s * B, (s + 1) * B) of one record order, host h
  of P reading rows [h * B / P, (h + 1) * B / P): the same examples (and per-record generators) for 1, 2 or
  4 hosts. The dataset engine's state is the global batch index, equal on every host, and a 2-host
  checkpoint's states restore a 1-host iterator to the same place in the stream."""
  n, big, steps = 11, 4, 6  # 6 global batches of 4 run across epochs of 11 records
  config = _config("numbered")

  def hosts(count):
    return [iter(pipeline.make_loader(_Numbered(n), [_Noisy()], split="train", batch_size=big // count,
                                      seed=3, shard_index=h, shard_count=count, shuffle=True, num_epochs=None,
                                      config=config, engine=engine)) for h in range(count)]

  order = pipeline.EpochPermutation(n, seed=pipeline.stream_seed(3), shuffle=True)
  want = [order.keys(np.arange(s * big, (s + 1) * big)) for s in range(steps)]  # the index derivation
  runs = {}
  for count in (1, 2, 4):
    its = hosts(count)
    runs[count] = [np.concatenate([next(it)["inputs"] for it in its]) for _ in range(steps)]
    for s in range(steps):
      np.testing.assert_array_equal(runs[count][s][:, 0], want[s])
      np.testing.assert_array_equal(runs[count][s], runs[1][s])  # the generators' draws too
  if engine == "loader":
    return  # a DataLoader state is per host (test_data_loader_state_needs_its_host_count)
  two = hosts(2)
  for _ in range(3):
    for it in two:
      next(it)
  step_dir = tmp_path / "7"
  (step_dir / "data").mkdir(parents=True)
  for h, it in enumerate(two):
    assert it.get_state() == {"next_index": 3}
    (step_dir / "data" / pipeline.state_file(h, 2)).write_text(json.dumps(it.get_state()))
  one = hosts(1)[0]
  pipeline.check_iterator_checkpoint(str(step_dir), one, config)
  pipeline.restore_iterator(str(step_dir), one)
  for s in range(3, steps):
    np.testing.assert_array_equal(next(one)["inputs"], runs[1][s])
  (step_dir / "data" / pipeline.state_file(1, 2)).write_text(json.dumps({"next_index": 2}))
  with pytest.raises(ValueError, match="differ"):
    pipeline.restore_iterator(str(step_dir), hosts(1)[0])


def test_data_loader_state_needs_its_host_count(tmp_path):
  config = _config("numbered")
  it = iter(pipeline.make_loader(_Numbered(7), [_Noisy()], split="train", batch_size=2, seed=0,
                                 shard_index=1, shard_count=2, shuffle=True, num_epochs=None, config=config,
                                 engine="loader"))
  next(it)
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / pipeline.state_file(1, 2)).write_bytes(it.get_state())
  with pytest.raises(ValueError, match="host count that wrote it"):
    pipeline.check_iterator_checkpoint(str(tmp_path), it, config)  # this process is 1 host, not 2


def test_lra_shards_cover_real_reader(lra_dir):
  config = _config("lra_listops", lra_dir)
  rows = []
  for h in range(2):
    for b in _batches(config, split="validation", batch_size=5, shard_index=h, shard_count=2):
      rows += [tuple(x[m]) for x, m, v in zip(b["inputs"], b["mask"], b["valid"], strict=True) if v]
  alone = []
  for b in _batches(config, split="validation", batch_size=5):
    alone += [tuple(x[m]) for x, m, v in zip(b["inputs"], b["mask"], b["valid"], strict=True) if v]
  assert sorted(rows) == sorted(alone) and len(rows) == 12


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wiki40b", "lra_listops"])
def test_worker_processes_resume_exactly(name, text_dirs, lra_dir):
  base = lra_dir if name.startswith("lra") else text_dirs[name]
  config = _config(name, base, seq_len=32, worker_count=2)
  it = iter(data.create_dataset(config, "train", batch_size=2, seed=3, shard_index=0, shard_count=1))
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]
  fresh = iter(data.create_dataset(config, "train", batch_size=2, seed=3, shard_index=0, shard_count=1))
  fresh.set_state(state)
  for want in expected:
    got = next(fresh)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


class _Noisy(pipeline.SeededExample):
  """A RandomMap whose output shows the generator it got (the engines must seed it alike)."""

  def __init__(self):
    super().__init__(lambda i, rng: {"inputs": np.array([i, rng.integers(1 << 30)], np.int32)})


@pytest.mark.parametrize("split,shuffle,num_epochs", [("train", None, None), ("validation", True, 2),
                                                      ("validation", None, None)])
def test_dataset_engine_yields_the_data_loader_batches(split, shuffle, num_epochs):
  config = _config("numbered", virtual_records=29)  # 29 records cycling 11: also checks VirtualRecords
  batches = {}
  for engine in ("dataset", "loader"):
    loader = pipeline.make_loader(_Numbered(11), [_Noisy()], split=split, batch_size=4, seed=3, shard_index=1,
                                  shard_count=2, shuffle=shuffle, num_epochs=num_epochs, config=config,
                                  engine=engine)
    it = iter(loader)
    batches[engine] = [b for _, b in zip(range(12), it, strict=False)]
  assert len(batches["dataset"]) == len(batches["loader"]) > 2
  for got, want in zip(batches["dataset"], batches["loader"], strict=True):
    assert set(got) == set(want) == {"inputs", "valid"}
    for k in want:
      assert got[k].dtype == want[k].dtype
      np.testing.assert_array_equal(got[k], want[k])
  keys = np.concatenate([b["inputs"][b["valid"], 0] for b in batches["dataset"]])
  assert keys.max() < 11 and len(set(keys.tolist())) == 11  # record i is mock record i % 11


def test_dataset_engine_reading_threads_each_get_a_batch(caplog):
  """Several reading threads (a large host's default) read the same batches as one, and grain is given a
  prefetch buffer of at least one batch per thread (with fewer it warns and leaves threads idle)."""
  batches = {}
  for threads in (1, 4):
    config = _config("numbered", read_threads=threads, prefetch=8)  # 8 records: 2 batches of 4 < 4 threads
    loader = pipeline.make_loader(_Numbered(37), [_Noisy()], split="train", batch_size=4, seed=3,
                                  shard_index=0, shard_count=1, shuffle=True, num_epochs=None, config=config,
                                  engine="dataset")
    with caplog.at_level(logging.WARNING):
      batches[threads] = [b["inputs"] for _, b in zip(range(20), iter(loader), strict=False)]
  assert not [r for r in caplog.records if "prefetch_buffer_size" in r.getMessage()]
  assert len(batches[4]) == 20
  for got, want in zip(batches[4], batches[1], strict=True):
    np.testing.assert_array_equal(got, want)


def test_epoch_permutation_is_a_seeded_reshuffle_per_epoch():
  import pickle

  n = 37
  order = pipeline.EpochPermutation(n, seed=5, shuffle=True)
  epochs = [order.keys(np.arange(e * n, (e + 1) * n)) for e in range(4)]
  for keys in epochs:
    assert keys.dtype == np.int32 and sorted(keys.tolist()) == list(range(n))  # each epoch: every record once
  assert len({tuple(keys.tolist()) for keys in epochs}) == 4 and not np.array_equal(epochs[0], np.arange(n))
  assert len(order._cache) <= 2  # only the current and the next epoch are kept
  # The definition: numpy's default_rng([seed, epoch]) permutation of the records.
  np.testing.assert_array_equal(epochs[2], np.random.default_rng([5, 2]).permutation(n))
  stream = np.concatenate(epochs)  # [4 * n]
  # Same seed, fresh cache, positions asked in any order (and after pickling, as worker processes get it).
  again = pickle.loads(pickle.dumps(pipeline.EpochPermutation(n, seed=5, shuffle=True)))
  backwards = np.arange(4 * n)[::-1]
  np.testing.assert_array_equal(again.keys(backwards), stream[backwards])
  assert not np.array_equal(pipeline.EpochPermutation(n, seed=6, shuffle=True).keys(np.arange(n)), epochs[0])
  # One batch of positions across epoch boundaries (here three epochs) maps each to its own epoch's key.
  positions = np.arange(n - 3, 2 * n + 5)
  np.testing.assert_array_equal(order.keys(positions), stream[positions])
  assert [order.key(p) for p in positions] == stream[positions].tolist()
  plain = pipeline.EpochPermutation(n, seed=5, shuffle=False)
  np.testing.assert_array_equal(plain.keys(np.arange(2 * n)), np.arange(2 * n) % n)


def test_epoch_permutation_of_large_splits_is_keyed_not_stored(monkeypatch):
  """Above MAX_STORED records the order is grain's index shuffle per (seed + epoch): no array per epoch."""
  import grain

  monkeypatch.setattr(pipeline.EpochPermutation, "MAX_STORED", 50)
  n = 300
  order = pipeline.EpochPermutation(n, seed=7, shuffle=True)
  assert not order.stored and pipeline.EpochPermutation(50, seed=7, shuffle=True).stored
  epochs = [order.keys(np.arange(e * n, (e + 1) * n)) for e in range(3)]
  for keys in epochs:
    assert keys.dtype == np.int32 and sorted(keys.tolist()) == list(range(n))
  assert len({tuple(keys.tolist()) for keys in epochs}) == 3 and not order._cache
  want = grain.MapDataset.range(n).shuffle(seed=7)  # grain's own order, epoch e reseeded as seed + e
  np.testing.assert_array_equal(epochs[1], [want[n + i] % n for i in range(n)])
  positions = np.arange(n - 4, n + 4)  # across an epoch boundary
  np.testing.assert_array_equal(order.keys(positions), np.concatenate(epochs)[positions])
  assert [order.key(p) for p in positions] == np.concatenate(epochs)[positions].tolist()
  with pytest.raises(ValueError, match="not stored"):
    order.permutation(0)
  plain = pipeline.EpochPermutation(n, seed=7, shuffle=False)  # without shuffle: records in sequence
  np.testing.assert_array_equal(plain.keys(np.arange(n + 3)), np.arange(n + 3) % n)


@pytest.mark.parametrize("engine", ["dataset", "loader"])
def test_batches_follow_the_epoch_permutation_across_epochs(engine):
  config = _config("numbered")
  op = pipeline.Example(lambda i: {"inputs": np.array([i], np.int32)})
  loader = pipeline.make_loader(_Numbered(5), [op], split="validation", batch_size=4, seed=2, shard_index=0,
                                shard_count=1, shuffle=True, num_epochs=3, config=config, engine=engine)
  batches = list(loader)
  assert [int(b["valid"].sum()) for b in batches] == [4, 4, 4, 3]  # 15 records, batches across epochs
  got = np.concatenate([b["inputs"][b["valid"], 0] for b in batches])
  order = pipeline.EpochPermutation(5, seed=pipeline.host_seed(2, 0), shuffle=True)
  np.testing.assert_array_equal(got, order.keys(np.arange(15)))


def test_index_sampler_checkpoint_is_a_clear_error(tmp_path):
  """A DataLoader state written in grain's IndexSampler order (before EpochPermutation) cannot continue."""
  import json

  import grain

  config = _config("numbered")
  op = pipeline.Example(lambda i: {"inputs": np.array([i], np.int32)})

  def loader():
    return iter(pipeline.make_loader(_Numbered(9), [op], split="train", batch_size=2, seed=0, shard_index=0,
                                     shard_count=1, shuffle=True, num_epochs=None, config=config,
                                     engine="loader"))

  it = loader()
  next(it)
  step_dir = tmp_path / "checkpoints" / "3"
  (step_dir / "data").mkdir(parents=True)
  grain.checkpoint.CheckpointHandler().save(step_dir / "data", item=it)
  (saved,) = (step_dir / "data").glob("process_*.json")
  state = json.loads(saved.read_text())
  assert state["sampler"].startswith("EpochPermutationSampler(num_records=9, shuffle=True, num_epochs=None")
  pipeline.check_iterator_checkpoint(str(step_dir), loader(), config)  # the current order: accepted
  old = grain.samplers.IndexSampler(num_records=9, shard_options=grain.sharding.NoSharding(), shuffle=True,
                                    num_epochs=None, seed=pipeline.host_seed(0, 0))
  saved.write_text(json.dumps({**state, "sampler": repr(old)}))
  with pytest.raises(ValueError, match=r"checkpoints/3 holds .*IndexSampler\(num_records=9.*fresh workdir"):
    pipeline.check_iterator_checkpoint(str(step_dir), loader(), config)


@pytest.mark.parametrize("fields", [dict(seq_len=64),
                                    dict(seq_len=37, num_pairs=9, num_keys=12, num_values=7),
                                    dict(seq_len=2000, num_pairs=3)])
def test_synthetic_recall_records_pose_the_task(fields):
  """Every record: distinct stored keys, one pair per slice of the first half, filler elsewhere, and each
  answer is the value stored with the queried key; batch generation equals one-by-one generation; records
  differ."""
  from data import synthetic

  source = synthetic.RecallSource(_config("synthetic_recall", **fields), "validation", seed=11)
  f, k, v, p = source.num_filler, source.num_keys, source.num_values, source.num_pairs
  length, half = source.seq_len, source.seq_len // 2
  edges = np.linspace(0, half, p + 1).astype(int)
  indices = [int(i) for i in np.random.default_rng(5).integers(0, 1 << 40, size=24)]
  batch = source.read_batch(indices)
  for index, record in zip(indices, batch, strict=True):
    single = source[index]
    for key in single:
      assert record[key].dtype == single[key].dtype
      np.testing.assert_array_equal(record[key], single[key])
    t = record["inputs"]
    assert t.dtype == np.int32 and t.shape == (length,)
    pair_pos = np.flatnonzero((t[:half] >= f + k) & (t[:half] < f + k + k * v))
    assert len(pair_pos) == p and np.all((pair_pos >= edges[:-1]) & (pair_pos < edges[1:]))
    stored = {(x - f - k) // v: (x - f - k) % v for x in t[pair_pos]}
    assert len(stored) == p  # distinct keys
    assert np.all(np.delete(t[:half], pair_pos) < f)
    q_pos = half + 2 * np.arange((length - half) // 2)
    assert np.all(record["weights"][q_pos + 1] == 1) and record["weights"].sum() == len(q_pos)
    for q, a in zip(t[q_pos], t[q_pos + 1], strict=True):
      assert stored[q - f] == a - (f + k + k * v)
  assert len({r["inputs"].tobytes() for r in batch}) == len(batch)
  other = synthetic.RecallSource(_config("synthetic_recall", **fields), "train", seed=11)
  assert not np.array_equal(other[indices[0]]["inputs"], batch[0]["inputs"])  # splits draw different records


def test_synthetic_recall_draws_are_uniform():
  from data import synthetic

  source = synthetic.RecallSource(_config("synthetic_recall", seq_len=512), "train", seed=0)
  tokens = np.stack([r["inputs"] for r in source.read_batch(list(range(400)))])
  filler = tokens[:, :256][tokens[:, :256] < source.num_filler]
  counts = np.bincount(filler, minlength=source.num_filler) / filler.size
  np.testing.assert_allclose(counts, 1 / source.num_filler, atol=0.01)
  answers = tokens[:, 257::2] - (source.num_filler + source.num_keys * (1 + source.num_values))
  np.testing.assert_allclose(np.bincount(answers.ravel(), minlength=10) / answers.size, 0.1, atol=0.01)


@pytest.mark.slow  # ~15 s on the 2-core box, mostly compiling the smoke train step
def test_input_benchmark_reports_pipeline_against_smoke_step(tmp_path):
  import json

  from scripts import benchmark, benchmark_input

  args = benchmark.parse_args(["--mode", "input", "--out_dir", str(tmp_path), "--datasets",
                               "synthetic_recall", "--seconds", "0.2", "--repeats", "2", "--rounds", "2"])
  assert benchmark_input.main(args) == 0
  paths = {"json": tmp_path / "benchmark_input.json", "markdown": tmp_path / "benchmark_input.md"}
  (row,) = json.load(open(paths["json"]))["rows"]
  assert row["config"] == "configs/default.py:smoke" and row["seq_len"] == 64 and row["batch"] == 8
  assert row["examples_per_s"] > 0 and row["step_ms"] > 0 and len(row["step_ms_rounds"]) == 2
  assert row["ratio"] == pytest.approx(row["examples_per_s"] * row["step_ms"] / 1000 / 8)
  assert row["target"] == ("yes" if row["ratio"] >= 10 else "no")
  assert "| synthetic_recall |" in open(paths["markdown"]).read()


# ------------------------------------------------------------------------------------------------ caches


def test_listops_synthetic_split_is_generated_once_and_bit_identical(tmp_path, monkeypatch):
  fields = dict(min_length=20, max_length=80, num_train=24, num_validation=7, data_seed=3)
  fly = _config("listops_synthetic", **fields)  # no directory: generated on access
  cached = _config("listops_synthetic", str(tmp_path), **fields)
  for split, kw in (("validation", {}), ("train", dict(num_epochs=2))):
    a, b = _batches(fly, split, batch_size=5, **kw), _batches(cached, split, batch_size=5, **kw)
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
  assert len(_batches(cached, "validation", batch_size=5)) == 2
  # ... and every field that changes the examples changes the key.
  for change in (dict(data_seed=4), dict(num_validation=8), dict(max_length=81), dict(listops_parens=True)):
    assert listops.cache_path(_config("listops_synthetic", str(tmp_path), **{**fields, **change}),
                              "validation") != listops.cache_path(cached, "validation")
  assert listops.cache_path(_config("listops_synthetic", str(tmp_path), cache_dir=str(tmp_path / "c"),
                                    **fields), "validation").startswith(str(tmp_path / "c"))


def test_prepare_builds_the_listops_synthetic_cache(tmp_path, monkeypatch, capsys):
  from data import prepare

  monkeypatch.setattr(listops, "SPLIT_SIZES", {"train": 6, "validation": 3, "test": 2})
  monkeypatch.setattr(listops, "DEFAULTS", dict(listops.DEFAULTS, min_length=10, max_length=40))
  monkeypatch.setattr(os, "cpu_count", lambda: 1)
  assert prepare.prepare("listops_synthetic", str(tmp_path)) == 0
  out = capsys.readouterr().out
  assert "verified" in out and "listops_synthetic/train-" in out
  config = _config("listops_synthetic", str(tmp_path))
  for split, n in listops.SPLIT_SIZES.items():
    source = listops.CachedSource(listops.cache_path(config, split))
    gen = listops.GeneratedSource(split, n, 0, listops._params(config))
    for i in range(n):
      tokens, label = gen[i]
      np.testing.assert_array_equal(source[i][0], listops.encode(tokens))
      assert source[i][1] == label


def test_listops_synthetic_generation_resumes_after_an_interruption(tmp_path, monkeypatch):
  fields = dict(min_length=20, max_length=60, num_validation=9, data_seed=1)
  config = _config("listops_synthetic", str(tmp_path), **fields)
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
    memory = _config("lra_text", dd, seq_len=40)
    disk = _config("lra_text", dd, seq_len=40, cache_in_memory=0)
    source, _ = lra.make_source(memory, "train")
    assert isinstance(source, pipeline.InMemorySource) and len(source) == 11
    assert not isinstance(lra.make_source(disk, "train")[0], pipeline.InMemorySource)
    too_small = _config("lra_text", dd, seq_len=40, cache_in_memory=1e-6)  # MB: the split does not fit
    assert not isinstance(lra.make_source(too_small, "train")[0], pipeline.InMemorySource)
    a = _batches(memory, "train", batch_size=4, num_epochs=2)
    b = _batches(disk, "train", batch_size=4, num_epochs=2)
    image = lra.make_source(_config("lra_image", dd), "test")[0]
  assert len(a) == len(b) == 6  # 22 records (2 epochs), the last batch padded
  for x, y in zip(a, b, strict=True):
    for key in x:
      assert x[key].dtype == y[key].dtype
      np.testing.assert_array_equal(x[key], y[key])
  assert isinstance(image, pipeline.InMemorySource)


@pytest.mark.parametrize("parens", [False, True])
def test_lra_listops_kept_ids_give_the_same_batches(lra_dir, parens):
  kept = _config("lra_listops", lra_dir, seq_len=30, listops_parens=parens)
  disk = _config("lra_listops", lra_dir, seq_len=30, listops_parens=parens, cache_in_memory=0)
  assert lra.make_source(kept, "train")[0].kept is not None and lra.make_source(disk, "train")[0].kept is None
  a = _batches(kept, "train", batch_size=5, num_epochs=2)
  b = _batches(disk, "train", batch_size=5, num_epochs=2)
  assert len(a) == len(b) == 5
  for x, y in zip(a, b, strict=True):
    for key in x:
      assert x[key].dtype == y[key].dtype
      np.testing.assert_array_equal(x[key], y[key])


def test_data_loader_checkpoint_on_the_dataset_engine_is_a_clear_error(tmp_path):
  import grain

  def loader(engine=None):
    config = _config("synthetic_recall", seq_len=32, train_examples=40,
                     **({"engine": engine} if engine else {}))
    return iter(data.create_dataset(config, "train", batch_size=4, seed=0, shard_index=0, shard_count=1))

  old = loader("loader")
  assert not isinstance(old, grain.DatasetIterator)
  next(old)
  step_dir = tmp_path / "checkpoints" / "7"
  (step_dir / "data").mkdir(parents=True)
  grain.checkpoint.CheckpointHandler().save(step_dir / "data", item=old)
  config = _config("synthetic_recall")
  with pytest.raises(ValueError, match=r"checkpoints/7 holds a data-iterator state of engine 'loader'.*"
                                       r"--config.data.engine=loader"):
    pipeline.check_iterator_checkpoint(str(step_dir), loader(), config)
  # The engine named in the message restores it and continues with the same batches.
  again = loader("loader")
  pipeline.check_iterator_checkpoint(str(step_dir), again, config)
  grain.checkpoint.CheckpointHandler().restore(step_dir / "data", item=again)
  np.testing.assert_array_equal(next(again)["inputs"], next(old)["inputs"])
  np.testing.assert_array_equal(next(loader("loader"))["inputs"], next(loader())["inputs"])
  # And a new-engine checkpoint read by the old engine is named the same way.
  new = loader()
  next(new)
  (tmp_path / "new" / "data").mkdir(parents=True)
  grain.checkpoint.CheckpointHandler().save(tmp_path / "new" / "data", item=new)
  with pytest.raises(ValueError, match=r"engine 'dataset'.*--config.data.engine=dataset"):
    pipeline.check_iterator_checkpoint(str(tmp_path / "new"), loader("loader"), config)


@pytest.mark.slow  # ~15 s: three smoke trainings (the unit test above covers the check itself)
def test_train_resume_from_an_old_engine_checkpoint_names_the_workdir(tmp_path):
  from configs import default
  from training import loop

  config = default.get_config("smoke,attention=dense")
  config.train.num_steps, config.train.checkpoint_every, config.train.eval_every = 2, 2, 0
  config.data.engine = "loader"  # what batched datasets ran on before the dataset engine
  workdir = str(tmp_path / "run")
  assert loop.train_and_evaluate(config, workdir, progress=False)["step"] == 2
  config.train.num_steps = 3
  config.data.engine = None
  with pytest.raises(ValueError, match=rf"{workdir}/checkpoints/2 holds .*--config.data.engine=loader"):
    loop.train_and_evaluate(config, workdir, progress=False, allow_config_change=True)  # engine: deliberate
  config.data.engine = "loader"
  assert loop.train_and_evaluate(config, workdir, progress=False)["start_step"] == 2
