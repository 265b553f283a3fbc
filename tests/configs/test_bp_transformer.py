"""configs/bp_transformer.py: the paper's settings per variant, the SST-5 label binning, and the IMDB / SST-5
pipelines on their generated stand-ins (the config sweeps of test_configs.py build and smoke-run every
variant)."""

import ml_collections
import numpy as np
import pytest

import data
from configs import bp_transformer
from data import text
from data.testing import mock_data
from models import registry


@pytest.mark.parametrize("arg,name,length,layers,features,heads,mlp,k", [
  ("", "enwik8", 512, 12, 512, 8, 2048, 64),
  ("text8", "text8", 512, 12, 512, 8, 2048, 64),
  ("imdb", "imdb", 2048, 5, 300, 6, 600, 4),
  ("sst5", "sst5", 128, 4, 300, 6, 600, 2),
])
def test_paper_settings(arg, name, length, layers, features, heads, mlp, k):
  c = bp_transformer.get_config(arg)
  m = c.model
  assert (c.data.name, c.data.seq_len) == (name, length)
  assert (m.num_layers, m.features, m.num_heads, m.mlp_dim) == (layers, features, heads, mlp)
  assert m.attention.name == "bp_transformer" and m.attention.params.context == k
  assert m.position_embedding == "none"
  registry.check_fields(m.attention)
  info = data.dataset_info(c)
  assert info.seq_len == length
  if arg in ("imdb", "sst5"):
    assert (info.task, info.num_classes, m.classifier_pool) == ("classify", 2 if arg == "imdb" else 5, "MEAN")
    assert c.data.vocab_size == text.default_vocab(name) == info.vocab_size
  else:
    assert info.task == "lm" and (c.optimizer.lr, c.train.batch_size, c.optimizer.clip_norm) == (4.1e-4, 64,
                                                                                                  0.25)
  # the 12-layer language model's blocks are scanned and recomputed (its compile sees one block)
  assert (m.scan_layers, m.remat) == ((True, "full") if arg in ("", "text8") else (False, "none"))


def test_arguments():
  assert bp_transformer.get_config("imdb,context=8").model.attention.params.context == 8
  assert "context" not in bp_transformer.get_config("sst5,attention=dense").model.attention.params
  assert bp_transformer.get_config("imdb,smoke").model.attention.params.context == 4
  smoke, unscanned = bp_transformer.get_config("smoke"), bp_transformer.get_config("scan_layers=False")
  assert not smoke.model.scan_layers and not unscanned.model.scan_layers and unscanned.model.remat == "full"
  with pytest.raises(ValueError, match="pick one of"):
    bp_transformer.get_config("imdb,sst5")


def test_sst5_label_binning():
  """SST's fine-grained classes: [0, 0.2], (0.2, 0.4], (0.4, 0.6], (0.6, 0.8], (0.8, 1]; values stored as
  float32 (0.2 is a little above 0.2 in float32) stay in their bin."""
  for value, label in [(0.0, 0), (0.1, 0), (0.2, 0), (0.20001, 1), (0.3, 1), (0.4, 1), (0.5, 2), (0.6, 2),
                       (0.61111, 3), (0.8, 3), (0.80556, 4), (0.9, 4), (1.0, 4)]:
    assert text.sst5_class(value) == label, value
    assert text.sst5_class(np.float32(value)) == label, value


@pytest.mark.parametrize("name", ["imdb", "sst5"])
def test_classification_stand_in(name, tmp_path):
  """Every split of the stand-in reads as `[bos] + pieces` with a mask and a label in range; sst5's labels
  are the binned float values the stand-in stores; imdb's `<br />` tags never reach the tokenizer."""
  with mock_data(name, str(tmp_path)) as data_dir:
    c = ml_collections.ConfigDict({"data": {"name": name, "data_dir": data_dir, "seq_len": 32,
                                            "vocab_size": 256}})
    info = data.dataset_info(c)
    source = text.text_source(c, "train")
    assert "<br" not in text.document_text(c, source[0])
    for split in ("train", "validation", "test"):
      batch = next(iter(data.create_dataset(c, split, batch_size=4, seed=0, num_epochs=1, shuffle=False)))
      assert batch["inputs"].shape == batch["mask"].shape == (4, 32) and batch["label"].shape == (4,)
      real = batch["valid"]
      assert (batch["inputs"][real, 0] == info.cls_id).all() and batch["mask"][real, 0].all()
      assert (batch["inputs"][~batch["mask"]] == 0).all()
      assert ((0 <= batch["label"]) & (batch["label"] < info.num_classes)).all()
    if name == "sst5":
      source = text.text_source(c, "train")
      labels = [text.sst5_class(source[i]["label"]) for i in range(4)]
      assert len(set(labels)) > 1
      first = next(iter(data.create_dataset(c, "train", batch_size=4, seed=0, num_epochs=1, shuffle=False)))
      assert list(first["label"]) == labels


def test_sst5_prepare_names_the_missing_package(tmp_path, monkeypatch, capsys):
  """Without the Hugging Face `datasets` package TFDS cannot build huggingface:sst: data.prepare says what to
  install and exits 2 (a manual step), before any tokenizer training."""
  from data import prepare

  built = []

  def build(name, data_dir, beam_flags=None):
    built.append(name)
    raise ModuleNotFoundError("No module named 'datasets'")

  monkeypatch.setattr(prepare, "build_tfds", build)
  assert prepare.prepare("sst5", str(tmp_path)) == 2
  assert built == ["huggingface:sst/default"]
  out = capsys.readouterr().out
  assert "MANUAL STEP MISSING" in out and "pip install datasets" in out
