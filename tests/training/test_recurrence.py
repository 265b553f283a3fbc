"""Segment recurrence in the trainer: the state carries the memory (sharded over the batch), a batch's reset
empties its rows before the step, checkpoints save the memory so that a resumed run is bit-identical to an
uninterrupted one (through the real checkpoint and data-iterator code), and (slow) the Transformer-XL config
trains with the real module, resumes exactly through the training loop and evaluates deterministically, and
on a mesh that splits the sequence gives one device's losses."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import pystdlib, transformer_xl
from tests.models import test_recurrence as model_tests
from training import checkpoints, experiment, loop
from training.mesh import BATCH_AXES

SEQ, MEM, BATCH = 16, 24, 8


def config():
  """A tiny LM with the test-only memory attention on the ordered pystdlib byte stream."""
  c = pystdlib.get_config(f"smoke,attention={model_tests.NAME},seq_len={SEQ},batch_size={BATCH}")
  c.data.ordered = True
  c.model.position_embedding = "none"
  c.model.mem_len = MEM
  c.optimizer.warmup_steps = 0
  c.optimizer.schedule = "constant"
  return c


def host(tree):
  return jax.tree.map(np.asarray, tree)


def assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.fixture
def memory_module():
  with model_tests.registered():
    yield


def test_memory_in_the_state_reset_and_exact_resume(tmp_path, memory_module):
  c = config()
  exp = experiment.Experiment(c, devices=jax.devices()[:1])
  it = iter(experiment.create_dataset(c, "train", batch_size=BATCH, seed=0))
  mgr = checkpoints.checkpoint_manager(str(tmp_path), c)

  # The memory starts empty, its rows split like the batch's.
  state = exp.init_state()
  layer = state.memory["layers"][0]
  assert layer["hidden"].shape == (BATCH, MEM, c.model.features) and not bool(layer["valid"].any())
  assert layer["hidden"].sharding.spec == P(BATCH_AXES)
  # Four steps, saved after the second (state, memory and data position) and carried on uninterrupted.
  losses = []
  for step in range(4):
    state, out = exp.train_step(state, next(it))
    losses.append(float(out["loss"]))
    if step == 1:
      saved_memory = host(state.memory)
      checkpoints.save_checkpoint(mgr, state, it, wait=True)
  straight = host((state.params, state.memory))
  assert np.asarray(state.memory["layers"][0]["valid"]).all()  # 4 segments of 16 fill a memory of 24

  # A row whose batch says reset starts from an empty memory: only this segment's positions are valid.
  batch = dict(next(it), reset=np.arange(BATCH) == 0)
  reset_state, _ = exp.train_step(state, batch)
  for layer in reset_state.memory["layers"]:
    valid, hidden = np.asarray(layer["valid"]), np.asarray(layer["hidden"])
    np.testing.assert_array_equal(valid[0], np.arange(MEM) >= MEM - SEQ)
    assert not hidden[0, :MEM - SEQ].any() and hidden[0, MEM - SEQ:].any()
    assert valid[1:].all()

  # Resumed from the checkpoint of step 2 (a fresh iterator: its position comes from the checkpoint), two
  # more steps give the uninterrupted run's losses, parameters and memory, bit for bit.
  it = iter(experiment.create_dataset(c, "train", batch_size=BATCH, seed=0))
  state = checkpoints.restore_checkpoint(mgr, exp, it)
  mgr.close()
  assert state.step == 2
  assert np.asarray(state.memory["layers"][0]["valid"]).any()
  assert_same(host(state.memory), saved_memory)
  resumed_losses = []
  for _ in range(2):
    state, out = exp.train_step(state, next(it))
    resumed_losses.append(float(out["loss"]))
  assert resumed_losses == losses[2:]
  assert_same(host((state.params, state.memory)), straight)
  # Without recurrence the checkpoint holds no memory (checkpoints of earlier versions restore unchanged).
  plain = experiment.TrainState(state.params, state.rest, state.opt_state, 4)
  assert "memory" not in checkpoints.state_tree(plain)


@pytest.mark.slow
def test_transformer_xl_trains_resumes_exactly_and_evaluates(tmp_path):
  # The real module (models/transformer_xl_attention.py) through the training loop, on the config's smoke.
  c = transformer_xl.get_config("smoke")
  c.train.num_steps, c.train.checkpoint_every = 4, 2
  straight = loop.train_and_evaluate(c, str(tmp_path / "straight"), progress=False)
  with loop.testing_hooks(stop_after=2):
    first = loop.train_and_evaluate(c, str(tmp_path / "resumed"), progress=False)
  assert first["preempted"] and first["step"] == 2
  second = loop.train_and_evaluate(c, str(tmp_path / "resumed"), progress=False)
  assert second["start_step"] == 2 and second["step"] == 4
  for run in (straight, second):
    assert np.isfinite(run["metrics"]["loss"])
    assert run["state"].memory["layers"][0]["hidden"].shape == (8, 64, 32)
  assert_same(host((straight["state"].params, straight["state"].memory)),
              host((second["state"].params, second["state"].memory)))
  assert straight["metrics"]["loss"] == second["metrics"]["loss"]
  # Evaluation starts each pass with an empty memory of eval_mem_len: two passes agree.
  exp = straight["experiment"]
  assert exp.eval_mem_len == 128
  e1 = exp.evaluate(straight["state"], max_batches=2)
  assert e1 == exp.evaluate(straight["state"], max_batches=2)
  assert e1["loss"] == straight["metrics"]["loss"]


@pytest.mark.slow  # about 25 s: two compilations of Transformer-XL's train step
def test_sequence_parallel_mesh_with_memory_gives_the_single_device_losses():
  """Transformer-XL's smoke config on a mesh that splits the sequence (seq = 2, and fsdp = 2 beside it): the
  memory stays split over the batch alone, and three steps give one device's losses."""

  def losses(seq, devices):
    c = transformer_xl.get_config("smoke")
    c.mesh.seq = seq
    exp = experiment.Experiment(c, devices=jax.devices()[:devices])
    it = iter(experiment.create_dataset(c, "train", batch_size=int(c.train.batch_size), seed=0))
    state, out = exp.init_state(), []
    for _ in range(3):
      state, metrics = exp.train_step(state, next(it))
      out.append(float(metrics["loss"]))
    assert dict(exp.mesh.shape)["seq"] == seq
    assert state.memory["layers"][0]["hidden"].sharding.spec == P(BATCH_AXES)
    return out

  one = losses(1, 1)
  np.testing.assert_allclose(losses(2, 4), one, rtol=1e-5)
