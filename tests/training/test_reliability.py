"""train.py / eval.py on workdirs that are not what they should be: another config, a foreign directory,
broken or non-finite checkpoints, evaluations that fail or are not finite, bad config values; and eval.py
agreeing with train.py. One tiny run is trained once and copied for each case."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from configs import arguments, default
from tests.training.smoke import smoke as smoke_config
from training import checkpoints, config_io, loop, status
from training.experiment import Experiment, TrainState, create_dataset


def smoke(attention_name="combiner_fixed", **overrides):
  """4 steps, a checkpoint every 2; the final evaluation covers 1 of the 2 validation batches."""
  return smoke_config(attention_name, **{"train.num_steps": 4, "train.checkpoint_every": 2,
                                         "train.eval_batches": 1, **overrides})


def strict_json(path):
  """json.load that refuses NaN / Infinity (not standard JSON)."""
  def refuse(name):
    raise ValueError(f"non-standard JSON constant {name} in {path}")
  with open(path) as f:
    return json.load(f, parse_constant=refuse)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished 4-step run with checkpoints at steps 2 and 4, and its final metrics."""
  workdir = str(tmp_path_factory.mktemp("trained") / "run")
  result = loop.train_and_evaluate(smoke(), workdir, progress=False)
  return workdir, result["metrics"]


def test_the_run_reports_its_state_in_the_workdir(trained):
  """training/status.py's records of the finished run, the ones scripts/tpu.py watches."""
  workdir = trained[0]
  started, beat, done = (strict_json(status.record_path(workdir, name))
                         for name in ("started", "heartbeat", "finished"))
  assert started["state"] == "started" and started["step"] == 0 and started["num_steps"] == 4
  assert started["hosts"] == 1 and started["devices"] == len(jax.devices()) and started["commit"]
  assert beat["state"] == "heartbeat" and 1 <= beat["step"] <= 4 and beat["time"] >= started["time"]
  assert done["step"] == 4 and done["metrics"] == strict_json(os.path.join(workdir, "metrics.json"))
  assert sorted(os.listdir(os.path.join(workdir, "status"))) == ["finished.json", "heartbeat.json",
                                                                 "started.json"]


def copy_of(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained[0], workdir)
  return workdir


# -- 1: config changes on resume, foreign workdirs -----------------------------------------------------------


def test_changed_model_config_is_refused_before_anything_is_written(trained, tmp_path):
  workdir = copy_of(trained, tmp_path)
  before = {name: open(os.path.join(workdir, name), "rb").read() for name in ("config.json", "metrics.json")}
  listing = sorted(os.listdir(workdir))
  with pytest.raises(ValueError, match=r"model\.attention\.name: 'combiner_fixed' -> 'dense'") as e:
    loop.train_and_evaluate(smoke("dense", **{"train.num_steps": 6}), workdir, progress=False)
  assert "allow_config_change" in str(e.value)
  assert sorted(os.listdir(workdir)) == listing
  for name, content in before.items():
    assert open(os.path.join(workdir, name), "rb").read() == content
  # Allowed explicitly: the run continues, config.json stays the original, the change is kept in a history.
  result = loop.train_and_evaluate(smoke("dense", **{"train.num_steps": 6}), workdir, progress=False,
                                   allow_config_change=True)
  assert result["start_step"] == 4 and result["step"] == 6
  assert open(os.path.join(workdir, "config.json"), "rb").read() == before["config.json"]
  history = strict_json(os.path.join(workdir, "config_history.json"))
  assert [h["step"] for h in history] == [4]
  assert history[0]["changes"]["model.attention.name"] == {"old": "combiner_fixed", "new": "dense"}
  # Each checkpoint is evaluated with the config it was trained with.
  assert config_io.load_config(workdir, 4).model.attention.name == "combiner_fixed"
  assert config_io.load_config(workdir, 6).model.attention.name == "dense"
  assert config_io.load_config(workdir).model.attention.name == "dense"


def test_fields_added_since_a_run_was_saved_resume_at_their_defaults(tmp_path):
  """A run saved before model.mem_len and data.ordered existed resumes with them at their defaults (the old
  behaviour); any other value is a change of the model or data like any other."""
  config = smoke()
  saved = config_io.config_dict(config)
  del saved["model"]["mem_len"], saved["data"]["ordered"]
  config_io.write_json(tmp_path / "config.json", saved)
  assert config_io.check_workdir(str(tmp_path), config) == {}
  config.model.mem_len = 8
  with pytest.raises(config_io.ConfigMismatch, match=r"model\.mem_len: None -> 8"):
    config_io.check_workdir(str(tmp_path), config)


def test_workdir_of_another_run_is_refused(tmp_path):
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "notes.txt").write_text("someone else's files")
  with pytest.raises(ValueError, match=r"not empty \(notes\.txt\) and has no config\.json"):
    loop.train_and_evaluate(smoke(), str(foreign), progress=False)
  assert sorted(os.listdir(foreign)) == ["notes.txt"]


# -- 2, 3: broken and non-finite checkpoints -----------------------------------------------------------------


def _damage(step_dir, kind):
  if kind == "no_metadata":
    os.remove(os.path.join(step_dir, "state", "_METADATA"))
  elif kind in ("no_state", "no_meta"):
    shutil.rmtree(os.path.join(step_dir, kind[3:]))
  elif kind == "empty_chunks":
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
      for name in files:
        if root != os.path.join(step_dir, "state") or not name.startswith("_"):
          open(os.path.join(root, name), "w").close()
  elif kind == "data_json":
    for name in os.listdir(os.path.join(step_dir, "data")):
      if name.endswith(".json"):
        with open(os.path.join(step_dir, "data", name), "w") as f:
          f.write('{"broken": ')
  else:
    raise AssertionError(kind)


def _files(top):
  return sorted(os.path.relpath(os.path.join(r, f), top) for r, _, fs in os.walk(top) for f in fs)


@pytest.fixture(scope="module")
def experiment():
  return Experiment(smoke(), devices=jax.devices()[:1])


def _restore(workdir, experiment, capsys):
  config = smoke()
  mgr = checkpoints.checkpoint_manager(workdir, config)
  data_iter = iter(create_dataset(config, "train", batch_size=8, seed=0))
  state = checkpoints.restore_or_init(mgr, experiment, data_iter, set_aside=True)
  steps = list(mgr.all_steps())
  mgr.close()
  return state, steps, capsys.readouterr().out


@pytest.mark.parametrize("kind", ["no_metadata", "no_state", "no_meta", "empty_chunks", "data_json"])
def test_broken_latest_checkpoint_names_its_directory_and_falls_back(trained, experiment, tmp_path, capsys,
                                                                     kind):
  workdir = copy_of(trained, tmp_path)
  broken = os.path.join(workdir, "checkpoints", "4")
  _damage(broken, kind)
  files_before = _files(broken)
  state, steps, out = _restore(workdir, experiment, capsys)
  assert state.step == 2 and steps == [2]
  assert f"checkpoint {broken} does not restore" in out and "resuming from step 2" in out
  # Nothing deleted: the broken step is moved aside whole.
  moved = os.path.join(workdir, "unrestorable_checkpoints", "4")
  assert _files(moved) == files_before


def test_no_restorable_checkpoint_lists_every_step(trained, experiment, tmp_path, capsys):
  from training import evaluate as eval_lib

  workdir = copy_of(trained, tmp_path)
  _damage(os.path.join(workdir, "checkpoints", "4"), "no_meta")
  # eval.py: an explicitly requested broken step names its directory.
  with pytest.raises(RuntimeError, match=r"checkpoints/4 does not restore"):
    eval_lib.evaluate_workdir(workdir, step=4)
  _damage(os.path.join(workdir, "checkpoints", "2"), "no_state")
  with pytest.raises(RuntimeError, match=r"(?s)no checkpoint .* restores.*checkpoints/4 .*checkpoints/2 "):
    _restore(workdir, experiment, capsys)


def test_non_finite_checkpoint_is_not_trusted(trained, experiment, tmp_path, capsys):
  workdir = copy_of(trained, tmp_path)
  config = smoke()
  mgr = checkpoints.checkpoint_manager(workdir, config)
  data_iter = iter(create_dataset(config, "train", batch_size=8, seed=0))
  state = checkpoints.restore_checkpoint(mgr, experiment, data_iter)
  bad = jax.tree.map(lambda x: x * np.nan, state.params)  # what flipped bytes in a chunk can restore as
  checkpoints.save_checkpoint(mgr, TrainState(bad, state.rest, state.opt_state, 6), data_iter)
  mgr.close()
  restored, _, out = _restore(workdir, experiment, capsys)
  assert restored.step == 4
  assert "checkpoints/6 does not restore" in out and "non-finite values in the restored parameters" in out


def test_non_finite_final_evaluation_fails_and_writes_standard_json(trained, tmp_path, monkeypatch):
  from training import evaluate as eval_lib

  workdir = copy_of(trained, tmp_path)
  nan_metrics = {"loss": math.nan, "accuracy": 0.0, "num_batches": 1, "num_examples": 8, "whole_split": False}
  monkeypatch.setattr(Experiment, "evaluate", lambda self, state, split=None, max_batches=None:
                      dict(nan_metrics))
  with pytest.raises(RuntimeError, match="final evaluation at step 4 is not finite"):
    loop.train_and_evaluate(smoke(), workdir, progress=False)
  assert strict_json(os.path.join(workdir, "metrics.json"))["loss"] is None
  failed = strict_json(status.record_path(workdir, "failed"))
  assert failed["error"].startswith("NonFiniteEvaluation: the final evaluation at step 4 is not finite")
  assert failed["metrics"]["loss"] is None and failed["step"] == 4
  m = eval_lib.evaluate_workdir(workdir)
  assert strict_json(m["path"])["loss"] is None


# -- 4: the checkpoint is saved before the evaluation of the same step ---------------------------------------


def test_failing_evaluation_keeps_the_checkpoint_of_its_step(trained, tmp_path, monkeypatch):
  workdir = copy_of(trained, tmp_path)

  def failing(self, state, split=None, max_batches=None):
    raise RuntimeError(f"evaluation failed at step {state.step}")

  monkeypatch.setattr(Experiment, "evaluate", failing)
  config = smoke(**{"train.num_steps": 8, "train.eval_every": 6})
  with pytest.raises(RuntimeError, match="evaluation failed at step 6"):
    loop.train_and_evaluate(config, workdir, progress=False)
  failed = strict_json(status.record_path(workdir, "failed"))  # the copied run's finished.json is gone
  assert failed["error"] == "RuntimeError: evaluation failed at step 6" and failed["step"] == 6
  assert "in failing" in "\n".join(failed["traceback"])
  assert not os.path.exists(status.record_path(workdir, "finished"))
  mgr = checkpoints.checkpoint_manager(workdir, config, read_only=True)
  assert mgr.latest_step() == 6
  mgr.close()


# -- 5: config values are checked before compiling -----------------------------------------------------------


@pytest.mark.parametrize("field,value,message", [
    ("train.checkpoint_every", 0, r"checkpoint_every must be >= 1"),
    ("train.log_every", -1, r"log_every must be >= 1"),
    ("train.eval_every", -2, r"eval_every must be >= 0"),
    ("train.num_steps", -5, r"num_steps must be >= 0"),
    ("train.eval_batches", 0, r"eval_batches must be >= 1 or -1"),
    ("model.scan_unroll", 0, r"config.model.scan_unroll must be >= 1 \(layers per scanned loop iteration\)"),
])
def test_bad_config_values_are_clear_errors_before_compiling(tmp_path, monkeypatch, field, value, message):
  monkeypatch.setattr(loop, "Experiment", None)  # reaching the model build would be a TypeError
  with pytest.raises(ValueError, match=message):
    loop.train_and_evaluate(smoke(**{field: value}), str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("arg,message", [
    ("smoke=1", r"'smoke' is a flag and takes no value"),
    ("smoke,attention", r"'attention' in 'smoke,attention' needs a value"),
    ("attention=", r"'attention' in 'attention=' needs a value"),
])
def test_config_argument_errors(arg, message):
  with pytest.raises(ValueError, match=message):
    default.get_config(arg)
  arguments.parse_arg("smoke,attention=dense")  # the valid form still parses


# -- 7: eval.py and train.py agree by default, and say what they cover ---------------------------------------


def test_eval_agrees_with_train_by_default_and_keeps_each_file(trained, tmp_path):
  from training import evaluate as eval_lib

  workdir = copy_of(trained, tmp_path)
  final = trained[1]
  assert (final["num_batches"], final["num_examples"]) == (1, 8)
  m = eval_lib.evaluate_workdir(workdir)
  assert (m["num_batches"], m["num_examples"]) == (1, 8)
  np.testing.assert_allclose(m["loss"], final["loss"], rtol=1e-6)
  assert m["accuracy"] == final["accuracy"]
  assert not m["whole_split"]
  whole = eval_lib.evaluate_workdir(workdir, max_batches=-1)
  assert (whole["num_batches"], whole["num_examples"], whole["whole_split"]) == (2, 16, True)
  assert whole["path"] != m["path"]
  # as many batches as the split has: the whole split, though max_batches was not -1
  exact = eval_lib.evaluate_workdir(workdir, max_batches=2)
  assert (exact["num_batches"], exact["whole_split"]) == (2, True) and exact["path"] == whole["path"]
  assert strict_json(m["path"])["num_batches"] == 1 and strict_json(whole["path"])["num_batches"] == 2
  assert loop.format_metrics(m).count("num_examples=8") == 1


def test_eval_on_a_workdir_it_cannot_write_reports_its_metrics_first(trained, tmp_path):
  from training import evaluate as eval_lib

  workdir = copy_of(trained, tmp_path)
  split = smoke().eval_split
  os.chmod(workdir, 0o555)
  if os.access(workdir, os.W_OK):  # root writes anyway: the file's own name is taken instead
    os.chmod(workdir, 0o755)
    os.mkdir(os.path.join(workdir, f"eval_{split}_4_1batches.json"))
  reported = []
  try:
    with pytest.raises(eval_lib.MetricsNotWritten, match=rf"written to .*eval_{split}_4_1batches"):
      eval_lib.evaluate_workdir(workdir, report=reported.append)
  finally:
    os.chmod(workdir, 0o755)
  assert len(reported) == 1 and reported[0]["step"] == 4 and math.isfinite(reported[0]["loss"])


def test_a_flipped_bit_in_the_latest_checkpoint_is_detected_and_set_aside(trained, experiment, tmp_path,
                                                                           capsys):
  """A step whose array bytes decode cleanly to one flipped bit (written with the checksums of the true
  values, as a flip on disk would leave it) is refused by the checksums, set aside, and step 2 is used."""
  import orbax.checkpoint as ocp

  from training import integrity

  config = smoke()
  mgr = checkpoints.checkpoint_manager(trained[0], config, read_only=True)
  original = checkpoints.restore_checkpoint(mgr, experiment, None, 4)
  mgr.close()
  workdir = copy_of(trained, tmp_path)
  mgr = checkpoints.checkpoint_manager(workdir, config)
  tree = checkpoints.state_tree(original)
  true_sums = integrity.checksums(tree)
  leaves = [np.array(x) for x in jax.tree.leaves(tree)]
  first_param = next(i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(tree))
                     if jax.tree_util.keystr(path).startswith("['params']"))
  leaves[first_param].view(np.uint32).reshape(-1)[0] ^= 1  # the lowest mantissa bit: finite, one ulp off
  flipped = jax.tree.unflatten(jax.tree.structure(tree), leaves)
  meta = {"step": 6, "checksums": true_sums}
  mgr.save(6, args=ocp.args.Composite(state=ocp.args.StandardSave(flipped), meta=ocp.args.JsonSave(meta)),
           force=True)
  mgr.wait_until_finished()
  mgr.close()
  shutil.copytree(os.path.join(workdir, "checkpoints", "4", "data"), os.path.join(workdir, "checkpoints", "6",
                                                                                  "data"), dirs_exist_ok=True)
  restored, steps, out = _restore(workdir, experiment, capsys)
  assert restored.step == 4 and 6 not in steps
  assert "checkpoints/6 does not restore: ValueError: checksum mismatch in ['params']" in out, out
  assert os.path.isdir(os.path.join(workdir, "unrestorable_checkpoints", "6"))


@pytest.mark.slow
def test_bits_flipped_in_a_chunk_file_never_restore_changed_values(trained, experiment, tmp_path, capsys):
  """Bits flipped in step 4's largest chunk file: each copy is refused (by tensorstore's decoding or by the
  checksums) or restores identical values."""
  config = smoke()
  mgr = checkpoints.checkpoint_manager(trained[0], config, read_only=True)
  original = checkpoints.restore_checkpoint(mgr, experiment, None, 4)
  mgr.close()
  state_dir = os.path.join(trained[0], "checkpoints", "4", "state")
  chunks = [os.path.relpath(os.path.join(root, name), trained[0]) for root, _, names in os.walk(state_dir)
            for name in names if os.path.basename(root) == "d"]
  target = max(chunks, key=lambda f: os.path.getsize(os.path.join(trained[0], f)))
  size = os.path.getsize(os.path.join(trained[0], target))
  for i, position in enumerate(size * np.arange(1, 6) // 6):
    workdir = shutil.copytree(trained[0], str(tmp_path / f"flip{i}"))
    with open(os.path.join(workdir, target), "r+b") as f:
      f.seek(int(position))
      byte = f.read(1)[0]
      f.seek(int(position))
      f.write(bytes([byte ^ 0x01]))
    restored, _, out = _restore(workdir, experiment, capsys)
    if restored.step == 4:  # restored: then bit-identical
      for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(original.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
      assert restored.step == 2 and "checkpoints/4 does not restore" in out, out
