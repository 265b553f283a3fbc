"""Stacked blocks in training (`model.scan_layers`, models/stacked.py, training/layouts.py): a scanned model
trains as its per-layer layout does (same initial values, same dropout masks, losses equal to 1e-6 over 20
steps); a checkpoint saved in one layout restores into the other bit for bit and training continues as in the
saved layout; a workdir written before scanned blocks were stacked (config scan_layers=True, per-layer arrays)
resumes, evaluates and samples."""

import json
import os

import jax
import numpy as np
import pytest

from models import stacked
from tests.training.smoke import smoke
from training import checkpoints, experiment, loop


def _config(scan: bool, **overrides):
  return smoke("dense", **{"model.num_layers": 3, "model.dropout_rate": 0.1, "model.scan_layers": scan,
                           **overrides})


def _bits(tree):
  return [np.asarray(jax.random.key_data(x) if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
          for x in jax.tree.leaves(tree)]


def _assert_same_bits(a, b):
  for x, y in zip(_bits(a), _bits(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _train(exp, state, batches):
  losses = []
  for batch in batches:
    state, out = exp.train_step(state, batch)
    losses.append(float(out["loss"]))
  return state, np.asarray(losses)


@pytest.mark.slow  # ~20 s: two 20-step runs
def test_stacked_blocks_train_as_the_per_layer_layout():
  per_layer = experiment.Experiment(_config(False), devices=jax.devices()[:1])
  scanned = experiment.Experiment(_config(True), devices=jax.devices()[:1])
  loader = iter(experiment.create_dataset(per_layer.config, "train", batch_size=8, seed=0))
  batches = [next(loader) for _ in range(20)]
  s0, t0 = per_layer.init_state(), scanned.init_state()
  assert t0.params["encoder"]["blocks"]["mlp"]["up"]["kernel"].get_value().shape[0] == 3
  _assert_same_bits(stacked.convert(t0.params, like=s0.params), s0.params)  # the same initial values
  _, want = _train(per_layer, s0, batches)
  _, got = _train(scanned, t0, batches)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("saved_scan", [False, True])
def test_a_checkpoint_restores_into_the_other_layout(tmp_path, saved_scan):
  """Saved per-layer (as scanned runs were before), restored stacked; and the other way round."""
  saved = experiment.Experiment(_config(saved_scan), devices=jax.devices()[:1])
  restored_in = experiment.Experiment(_config(not saved_scan), devices=jax.devices()[:1])
  loader = iter(experiment.create_dataset(saved.config, "train", batch_size=8, seed=0))
  batches = [next(loader) for _ in range(3)]
  state, _ = _train(saved, saved.init_state(), batches[:1])
  mgr = checkpoints.checkpoint_manager(str(tmp_path), saved.config)
  checkpoints.save_checkpoint(mgr, state, None, wait=True)
  other = checkpoints.restore_checkpoint(mgr, restored_in, None)
  assert other.step == 1
  _assert_same_bits(stacked.convert({"p": other.params, "o": other.opt_state}, like={"p": state.params,
                                                                                     "o": state.opt_state}),
                    {"p": state.params, "o": state.opt_state})
  # Training goes on as it would have in the saved layout (dropout on: the same random streams).
  _, want = _train(saved, state, batches[1:])
  _, got = _train(restored_in, other, batches[1:])
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.slow  # ~40 s: three short runs, an evaluation and sampling
def test_a_workdir_from_before_stacking_resumes_evaluates_and_samples(tmp_path):
  from training import evaluate, sample

  overrides = {"train.num_steps": 4, "train.checkpoint_every": 2}
  straight = loop.train_and_evaluate(_config(False, **overrides), str(tmp_path / "straight"), progress=False)
  old = str(tmp_path / "old")
  with loop.testing_hooks(stop_after=2):
    loop.train_and_evaluate(_config(False, **overrides), old, progress=False)
  # What such a run's workdir holds: its config says scan_layers=True, its arrays are per layer.
  path = os.path.join(old, "config.json")
  with open(path) as f:
    saved = json.load(f)
  saved["model"]["scan_layers"] = True
  with open(path, "w") as f:
    json.dump(saved, f)
  m = evaluate.evaluate_workdir(old, step=2, max_batches=1)
  assert m["step"] == 2 and np.isfinite(m["loss"])
  assert sample.run(old, num_samples=2, seed=0, step=2)["recalled"].shape[0] == 2
  resumed = loop.train_and_evaluate(_config(True, **overrides), old, progress=False)
  assert resumed["start_step"] == 2 and resumed["step"] == 4
  assert resumed["state"].params["encoder"]["blocks"]["norm1"]["scale"].get_value().shape == (3, 32)
  want = straight["state"].params
  got = stacked.convert(resumed["state"].params, like=want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
    if "['key']['bias']" in jax.tree_util.keystr(path):
      continue  # its gradient is 0 up to rounding (softmax ignores it), which Adam scales up to lr
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
  np.testing.assert_allclose(resumed["metrics"]["loss"], straight["metrics"]["loss"], rtol=1e-6)


@pytest.mark.slow  # ~30 s: two short runs
def test_a_stacked_run_resumes_exactly(tmp_path):
  config = _config(True, **{"train.num_steps": 4, "train.checkpoint_every": 2})
  straight = loop.train_and_evaluate(config, str(tmp_path / "straight"), progress=False)
  with loop.testing_hooks(stop_after=2):
    loop.train_and_evaluate(config, str(tmp_path / "resumed"), progress=False)
  resumed = loop.train_and_evaluate(config, str(tmp_path / "resumed"), progress=False)
  assert resumed["start_step"] == 2
  _assert_same_bits({"p": resumed["state"].params, "o": resumed["state"].opt_state},
                    {"p": straight["state"].params, "o": straight["state"].opt_state})


def _train_step_ops(layers: int, scan: bool) -> int:
  """StableHLO operations of the jitted train step (optimizer, clipping, reseeding included), lowered only."""
  from scripts.compile_tpu import stablehlo_ops

  exp = experiment.Experiment(_config(scan, **{"model.num_layers": layers}), devices=jax.devices()[:1])
  state = exp.abstract_state()
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in
           next(iter(experiment.create_dataset(exp.config, "train", batch_size=8, seed=0))).items()}
  step = jax.ShapeDtypeStruct((), jax.numpy.int32)
  lowered = exp.jitted_train_step().lower(state["params"], state["rest"], state["opt_state"],
                                          exp.abstract_rng_state(), step, batch)
  return stablehlo_ops(lowered.as_text())


def test_the_train_step_does_not_grow_with_depth():
  """Stacked, the step's program is the same size at 2 and 8 layers (within 5%); per layer, 8 layers take
  more than twice as many operations (every layer's block and optimizer update)."""
  stacked_8 = _train_step_ops(8, True)
  assert stacked_8 <= 1.05 * _train_step_ops(2, True)
  assert _train_step_ops(8, False) > 2 * stacked_8
