"""scripts/reproduce.py: every table row's config builds, the row fixes hold, results are collected; the slow
test runs the smoke form of every implemented row through the runner."""

from __future__ import annotations

import json
import math
import os
import time

import ml_collections
import numpy as np
import pytest

import data
from configs import cifar10, lra, routing_paper, wiki40b
from models import registry
from scripts import reproduce

ROWS = [r for rows in reproduce.tables().values() for r in rows]
IMPLEMENTED = [r for r in ROWS if reproduce.implemented(r)]


def test_rows_are_well_formed():
  ids = [(r.table, r.id) for r in ROWS]
  assert len(ids) == len(set(ids))
  assert {"combiner-1", "combiner-2", "combiner-3", "combiner-4", "combiner-5", "combiner-6", "routing-1",
          "routing-4", "yoso-3", "pystdlib"} <= set(reproduce.tables())
  assert [r.attention for r in reproduce.tables()["pystdlib"]] == list(reproduce.PYSTDLIB_ROWS)
  for r in ROWS:
    assert r.metric in ("bits_per_dim", "perplexity", "accuracy", "bits_per_byte")
    assert r.attention in registry.names() or not reproduce.implemented(r)


@pytest.mark.parametrize("scale", reproduce.SCALES)
def test_every_implemented_row_builds(scale):
  for r in IMPLEMENTED:
    c = reproduce.build_config(r, scale)  # get_config + overrides + attention field checks
    assert str(c.model.attention.name) == r.attention, r
    if scale == "smoke":
      assert c.train.num_steps <= 10 and c.data.seq_len <= 1024, r


def test_row_fixes():
  c = cifar10.get_config("routing_paper,attention=dense")
  registry.check_fields(c.model.attention)
  assert c.model.num_layers == 12 and dict(c.model.attention.params) == {}
  c = cifar10.get_config("routing_paper,routing_heads=0,window=512")
  assert c.model.attention.routing_heads == 0 and c.model.attention.params.window == 512
  c = lra.get_config("task=text,yoso_paper,attention=dense")
  registry.check_fields(c.model.attention)
  assert "tau" not in c.model.attention.params and c.model.features == 64
  c = lra.get_config("task=listops_synthetic,yoso_paper")
  assert c.model.attention.params.num_hashes == 32 and c.train.num_steps == 5000
  assert lra.get_config("task=pathfinder").data.difficulty == "curv_contour_length_9"  # pathfinder-32 "inter"
  main = cifar10.get_config("main")
  m = main.model
  assert (m.num_layers, m.features, m.num_heads, m.mlp_dim) == (128, 256, 2, 512)
  assert main.model.dropout_rate == 0.25 and main.train.num_steps == 1_200_000
  text = wiki40b.get_config("attention=routing")
  assert text.model.attention.routing_heads == text.model.num_heads  # no local heads in the comparison
  assert cifar10.get_config("").model.attention.membership is None  # a regular field
  assert routing_paper.split_flag("smoke,window=8") == ("smoke,window=8", None)


def test_smoke_images_are_small():
  c = cifar10.get_config("smoke")
  assert c.data.seq_len == 8 * 8 * 3 and tuple(c.model.image_shape) == (8, 8, 3) and c.data.stand_in


def test_stand_in_only_when_asked(tmp_path, capsys):
  c = cifar10.get_config("smoke")
  c.data.data_dir = str(tmp_path / "empty")
  batch = next(iter(data.create_dataset(c, "train", batch_size=2, seed=0, shard_index=0, shard_count=1)))
  assert batch["inputs"].shape == (2, 192)
  assert "generated stand-in" in capsys.readouterr().out
  c.data.stand_in = False
  with pytest.raises(FileNotFoundError, match="prepare it with"):
    data.create_dataset(c, "train", batch_size=2, seed=0, shard_index=0, shard_count=1)


def test_list_and_collect(tmp_path, capsys):
  assert reproduce.main(["--table", "combiner-2", "--list", "--scale", "cpu"]) == 0
  out = capsys.readouterr().out
  assert "Combiner-Fixed-2k: paper 17.7" in out and "train.py --config configs/wiki40b.py:" in out
  rows = reproduce.tables()["combiner-2"]
  fixed = next(r for r in rows if r.label == "Combiner-Fixed-2k")
  wd = reproduce.workdir(fixed, "cpu", str(tmp_path))
  os.makedirs(wd)
  with open(os.path.join(wd, "metrics.json"), "w") as f:
    json.dump({"perplexity": 20.0, "loss": 3.0, "step": 600}, f)
  assert reproduce.main(["--table", "combiner-2", "--collect", "--scale", "cpu", "--workdir_root",
                         str(tmp_path)]) == 0
  md = (tmp_path / "results-combiner-2-cpu.md").read_text()
  assert "| Combiner-Fixed-2k | 17.700 | 20.000 | 2.300 | 1 | 600 |" in md
  csv_text = (tmp_path / "results-combiner-2-cpu.csv").read_text()
  assert csv_text.splitlines()[0].startswith("table,row,metric,paper,ours,std,delta,seeds,steps,scale,date")
  assert "not implemented: attention 'performer'" in md or all(reproduce.implemented(r) for r in rows)
  records = reproduce.collect(rows, "cpu", str(tmp_path))
  assert sum(r["status"] == "ok" for r in records) == 1
  # a finished row is skipped by --run
  assert reproduce.run_rows([fixed], "cpu", str(tmp_path)) == []
  assert "finished already" in capsys.readouterr().out


def test_curves_and_plot(tmp_path, capsys):
  """--plot reads each row's evaluation scalars from its TensorBoard events (the later file of a resumed run
  wins a step logged twice; other splits and train scalars are ignored) and averages the seeds."""
  from runtime import paths

  rows = reproduce.tables()["pystdlib"][:2]
  for seed, losses in ((0, {100: 2.0, 200: 1.5}), (1, {100: 3.0, 200: 2.5})):
    wd = reproduce.workdir(rows[0], "cpu", str(tmp_path), seed)
    os.makedirs(wd)
    with open(os.path.join(wd, "config.json"), "w") as f:
      json.dump({"eval_split": "validation"}, f)
    first = paths.summary_writer(os.path.join(wd, "tensorboard"))
    first.add_scalar("eval_validation/loss", 9.0, 200)  # overwritten by the resumed run below
    first.add_scalar("train/loss", 9.0, 100)
    first.add_scalar("eval_test/loss", 9.0, 100)
    first.close()
    time.sleep(1.1)  # event file names carry the second they were opened
    second = paths.summary_writer(os.path.join(wd, "tensorboard"))
    for step, loss in losses.items():
      second.add_scalar("eval_validation/loss", loss, step)
    second.close()
  found = reproduce.curves(rows, "cpu", str(tmp_path), seeds=2)
  assert list(found) == [rows[0]]
  ln2 = math.log(2.0)
  np.testing.assert_allclose(np.array(found[rows[0]]), [[100, 2.5 / ln2], [200, 2.0 / ln2]], rtol=1e-6)
  assert reproduce.main(["--table", "pystdlib", "--plot", "--scale", "cpu", "--seeds", "2", "--workdir_root",
                         str(tmp_path)]) == 0
  assert "plotted 1 rows" in capsys.readouterr().out
  assert (tmp_path / "curves-pystdlib-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tpu_launcher_commands(capsys):
  rows = [r for r in reproduce.tables()["combiner-4"] if reproduce.implemented(r)]
  failed = reproduce.run_rows(rows[:1], "paper", "gs://bucket/r", launcher="tpu",
                              tpu_args="--zone us-central2-b --accelerator v4-32", dry_run=True)
  assert failed == []
  out = capsys.readouterr().out
  assert "scripts.tpu run --name combiner-4-cifar-10-combiner-axial-0 --zone us-central2-b" in out
  assert "--workdir gs://bucket/r/combiner-4/cifar-10-combiner-axial/paper" in out


def test_metric_units():
  assert reproduce.metric_value("accuracy", {"accuracy": 0.5}) == 50.0
  assert reproduce.metric_value("bits_per_byte", {"loss": 0.6931471805599453}) == pytest.approx(1.0)
  assert reproduce.metric_value("perplexity", {}) is None


@pytest.mark.slow
def test_smoke_every_row(tmp_path, capsys):
  """The runner end to end at smoke scale, as a user runs it: every implemented row of every table trains,
  evaluates offline (stand-in data where the real data is missing) and is collected."""
  root = str(tmp_path / "r")
  status = reproduce.main(["--table", "all", "--scale", "smoke", "--run", "--collect", "--noprogress",
                           "--workdir_root", root])
  out = capsys.readouterr().out
  assert status == 0, out[-3000:]
  records = reproduce.collect(ROWS, "smoke", root)
  assert [r["row"] for r in records if r["status"] != "ok"] == [r.label for r in ROWS if r not in IMPLEMENTED]
  assert len(IMPLEMENTED) > 150
  with open(os.path.join(root, "results-all-smoke.md")) as f:
    assert f.read().count("| ok") == len(IMPLEMENTED)


def test_config_dict_overrides():
  r = next(r for r in reproduce.tables()["yoso-3"] if r.attention == "yoso_sketch")
  c = reproduce.build_config(r, "paper")
  assert c.model.attention.params.num_hashes == 16
  assert isinstance(c, ml_collections.ConfigDict)


def test_identical_commands_train_once(tmp_path, capsys):
  rows = [r for r in reproduce.tables()["combiner-1"] if r.label.startswith("cifar10 Combiner-Mixture")]
  assert len(rows) == 2
  assert reproduce.train_argv(rows[0], "smoke", "") == reproduce.train_argv(rows[1], "smoke", "")
  wd = reproduce.workdir(rows[0], "smoke", str(tmp_path))
  os.makedirs(wd)
  with open(os.path.join(wd, "metrics.json"), "w") as f:
    json.dump({"bits_per_dim": 7.5, "step": 4}, f)
  assert reproduce.run_rows(rows, "smoke", str(tmp_path)) == []
  assert "the same command as" in capsys.readouterr().out
  records = reproduce.collect(rows, "smoke", str(tmp_path))
  assert [r["ours"] for r in records] == [7.5, 7.5]
