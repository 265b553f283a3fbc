"""The path layer (runtime/paths.py): workdir files written by train.py/eval.py go through etils.epath, so a
`gs://` workdir works. An in-memory fake GCS registered with fsspec (what epath uses for gs:// without
TensorFlow) shows that config, metrics, TensorBoard events and checkpoint-side reads never touch local
files."""

import builtins
import importlib
import os

import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from configs import default
from data import resume
from runtime import paths
from training import config_io, loop


class FakeGCS(MemoryFileSystem):
  """gs://bucket/key objects in a dict, as gcsfs names them (no protocol, no leading slash)."""

  protocol = ("gs", "gcs")
  root_marker = ""
  store: dict = {}
  pseudo_dirs = [""]

  @classmethod
  def _strip_protocol(cls, path):
    path = str(path)
    for prefix in ("gs://", "gcs://"):
      if path.startswith(prefix):
        path = path[len(prefix):]
    return path.strip("/")


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  registry = importlib.import_module("fsspec.registry")._registry  # fsspec's protocol -> class table
  FakeGCS.store, FakeGCS.pseudo_dirs = {}, [""]
  for name in ("gs", "gcs"):
    monkeypatch.setitem(registry, name, FakeGCS)  # restored (or removed) by monkeypatch
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  monkeypatch.chdir(tmp_path)  # a bypass would show up here, e.g. as a local "gs:" directory
  real_open, real_makedirs = builtins.open, os.makedirs

  def no_uri(fn):
    def guarded(p, *args, **kw):
      assert "gs:" not in os.fspath(p) if isinstance(p, (str, os.PathLike)) else True, f"local I/O on {p}"
      return fn(p, *args, **kw)
    return guarded

  monkeypatch.setattr(builtins, "open", no_uri(real_open))
  monkeypatch.setattr(os, "makedirs", no_uri(real_makedirs))
  yield FakeGCS.store
  monkeypatch.undo()
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  assert os.listdir(tmp_path) == []


def test_workdir_files_on_fake_gcs(fake_gcs):
  workdir = "gs://bucket/runs/a"
  assert paths.join(workdir, "checkpoints") == "gs://bucket/runs/a/checkpoints"
  config = default.get_config("smoke")
  config_io.save_config(config, workdir)
  assert "bucket/runs/a/config.json" in fake_gcs
  assert config_io.load_config(workdir).to_json(sort_keys=True) == config.to_json(sort_keys=True)
  paths.write_json(paths.join(workdir, "metrics.json"), {"accuracy": 0.5})
  assert paths.read_json(paths.join(workdir, "metrics.json")) == {"accuracy": 0.5}

  writer = loop.summary_writer(paths.join(workdir, "tensorboard"))
  writer.add_scalar("train/loss", 1.5, 3)
  writer.flush()
  events = [k for k in fake_gcs if k.startswith("bucket/runs/a/tensorboard/events.out.tfevents.")]
  assert len(events) == 1
  size = len(fake_gcs[events[0]].getvalue())
  writer.add_scalar("train/loss", 1.25, 4)
  writer.close()
  data = fake_gcs[events[0]].getvalue()
  assert len(data) > size and b"train/loss" in data  # rewritten whole on each flush

  # A checkpoint step without grain state on gs:// is accepted quietly; a foreign one names the checkpoint.
  resume.check_iterator_checkpoint(paths.join(workdir, "checkpoints", "5"), None, config)
  paths.write_json(paths.join(workdir, "checkpoints", "5", "data", "process_0-of-1.json"),
                   {"last_seen_indices": {}, "sampler": "IndexSampler(num_records=3)"})
  with pytest.raises(ValueError, match="checkpoints/5"):
    resume.check_iterator_checkpoint(paths.join(workdir, "checkpoints", "5"), None, config)


def test_local_paths_are_absolute_and_written_whole(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert os.fspath(paths.path("wd")) == os.path.join(str(tmp_path), "wd")
  paths.makedirs("wd/tensorboard")
  paths.write_json("wd/metrics.json", {"a": 1})
  paths.write_json("wd/metrics.json", {"a": 2})
  assert paths.read_json(os.path.join(tmp_path, "wd", "metrics.json")) == {"a": 2}
  assert sorted(os.listdir(tmp_path / "wd")) == ["metrics.json", "tensorboard"]  # no temporary left behind
  writer = paths.summary_writer("wd/tensorboard")
  writer.add_scalar("x", 1.0, 1)
  writer.close()
  assert len(os.listdir(tmp_path / "wd" / "tensorboard")) == 1


def test_listops_cache_on_fake_gcs(fake_gcs, monkeypatch):
  import ml_collections
  import numpy as np

  from data import listops

  config = ml_collections.ConfigDict({"data": {"name": "listops_synthetic", "data_dir": "gs://bucket/data",
                                               "min_length": 20, "max_length": 60, "num_validation": 5,
                                               "data_seed": 3}})
  path = listops.build_cache(config, "validation")
  assert path.startswith("gs://bucket/data/listops_synthetic/validation-")
  names = sorted(k.rsplit("/", 1)[1] for k in fake_gcs if "listops_synthetic" in k)
  assert names == ["labels.npy", "offsets.npy", "spec.json", "tokens.npy"]  # published, no temporary left
  source = listops.CachedSource(path)
  generated = listops.GeneratedSource("validation", 5, 3, listops._params(config))
  for i in range(5):
    np.testing.assert_array_equal(source[i][0], listops.encode(generated[i][0]))
    assert source[i][1] == generated[i][1]
  monkeypatch.setattr(listops, "_generate_range", lambda args: pytest.fail("generated again"))
  assert listops.build_cache(config, "validation") == path
