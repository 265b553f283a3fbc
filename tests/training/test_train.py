"""train.py / eval.py: the registry's extension points (state, randomness, aux losses) through a fake module,
sharded vs single-device steps, exact resume after SIGTERM, divergence stop, eval of what train wrote."""

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_baselines.dense import dense
from models import attention, registry
from tests.training.localhost import xla_flags
from tests.training.smoke import smoke
from training import checkpoints, config_io, experiment, listing, loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


class CallCount(nnx.Variable):
  """A custom non-gradient state variable (like routing's centroids)."""


class FakeStatefulAttention(attention.AttentionBase):
  """Dense attention plus every extension point: an rng stream, non-Param state, a sown auxiliary loss."""

  def __init__(self, config, *, features, num_heads, head_dim, causal, dtype, rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    self.rng = rngs.attention.fork()
    self.calls = CallCount(jnp.zeros((), jnp.int32))
    self.last_noise = nnx.BatchStat(jnp.zeros((), jnp.float32))

  def __call__(self, x, mask, *, deterministic):
    q, k, v = self.project(x)  # [batch, length, heads, head_dim]
    noise = jax.random.normal(self.rng(), ())
    if not deterministic:
      self.calls.value = self.calls.value + 1
      self.last_noise.value = noise
    self.sow(nnx.Intermediate, "aux_loss", jnp.mean(jnp.square(q.astype(jnp.float32))))
    o = dense(q, k, v, causal=self.causal, mask=mask) + 1e-2 * noise
    return self.output(o, deterministic=deterministic)


@pytest.fixture
def fake_stateful():
  """Registered for the test only: a module left in the registry would show in every registry-derived list
  (the reproduce tables, the registry sweeps) of later tests in the same worker."""
  registry.register_module("fake_stateful", FakeStatefulAttention)
  yield "fake_stateful"
  del registry.MODULES["fake_stateful"]


def _find(tree, name):
  return [v for path, v in jax.tree_util.tree_leaves_with_path(tree) if name in jax.tree_util.keystr(path)]


@pytest.mark.slow
def test_extension_points_state_randomness_aux_loss(tmp_path, fake_stateful):
  config = smoke(fake_stateful)
  exp = experiment.Experiment(config, devices=jax.devices()[:1])
  state = exp.init_state()
  # Only nnx.Param is optimized: the counter and the BatchStat live in `rest`, not in params or optax state.
  assert _find(state.rest, "calls") and not _find(state.params, "calls")
  assert not _find(state.opt_state, "calls") and not _find(state.opt_state, "last_noise")
  batches = iter(experiment.create_dataset(config, "train", batch_size=8, seed=0))
  b1, b2 = next(batches), next(batches)
  s1, out1 = exp.train_step(state, b1)
  noise1 = float(_find(s1.rest, "last_noise")[0])
  s2, out2 = exp.train_step(s1, b2)
  noise2 = float(_find(s2.rest, "last_noise")[0])
  # Non-gradient state is updated in place by the training forward pass and carried through the step.
  assert int(_find(s2.rest, "calls")[0]) == 2
  # The attention stream is reseeded per step: different noise at different steps ...
  assert noise1 != noise2
  # ... and the same noise when the same step is repeated from the same state (exact resume).
  again, _ = exp.train_step(exp.init_state(), b1)
  assert float(_find(again.rest, "last_noise")[0]) == noise1
  # The sown auxiliary loss is added with config.aux_loss_weight and logged.
  assert float(out2["aux_loss"]) > 0
  np.testing.assert_allclose(float(out2["loss"]), float(out2["task_loss"]) + 1e-4 * float(out2["aux_loss"]),
                             rtol=1e-6)
  # Evaluation uses a fixed seed (deterministic even with random attention) and leaves the state alone.
  e1 = exp.evaluate(s2, max_batches=1)
  e2 = exp.evaluate(s2, max_batches=1)
  assert e1 == e2
  assert int(_find(s2.rest, "calls")[0]) == 2
  # The non-gradient state is checkpointed with the parameters.
  mgr = checkpoints.checkpoint_manager(str(tmp_path), config)
  checkpoints.save_checkpoint(mgr, s2, None)
  restored = checkpoints.restore_checkpoint(mgr, exp, None)
  assert int(_find(restored.rest, "calls")[0]) == 2
  assert float(_find(restored.rest, "last_noise")[0]) == noise2


@pytest.mark.slow
def test_sharded_step_matches_single_device():
  config = smoke("combiner_fixed")
  config.mesh.data, config.mesh.model = 4, 2
  sharded = experiment.Experiment(config, devices=jax.devices()[:8])
  config1 = smoke("combiner_fixed")
  config1.mesh.data, config1.mesh.model = 1, 1
  single = experiment.Experiment(config1, devices=jax.devices()[:1])
  batch = next(iter(experiment.create_dataset(config, "train", batch_size=8, seed=0)))
  s8, out8 = sharded.train_step(sharded.init_state(), batch)
  s1, out1 = single.train_step(single.init_state(), batch)
  np.testing.assert_allclose(float(out8["loss"]), float(out1["loss"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
  # The parameters really are split over the "model" axis by the logical rules (mlp -> model, heads -> model).
  up = s8.params["encoder"]["blocks"][0]["mlp"]["up"]["kernel"].get_value()
  assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  assert up.addressable_shards[0].data.shape == (up.shape[0], up.shape[1] // 2)
  query = s8.params["encoder"]["blocks"][0]["attention"]["query"]["kernel"].get_value()
  assert query.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)


class _SigtermAt(list):
  """batch_log that sends this process SIGTERM when the loop reaches `step` (an in-process preemption)."""

  def __init__(self, step):
    super().__init__()
    self.step = step

  def append(self, item):
    super().append(item)
    if item[0] == self.step:
      os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_resume_after_sigterm_is_exact_and_eval_reads_it(tmp_path):
  from training import evaluate as eval_lib

  config = smoke("combiner_fixed", **{"train.num_steps": 5, "train.checkpoint_every": 2})
  straight_log = []
  with loop.testing_hooks(batch_log=straight_log):
    straight = loop.train_and_evaluate(config, str(tmp_path / "straight"), progress=False)
  killed_log = _SigtermAt(2)
  with loop.testing_hooks(batch_log=killed_log):
    first = loop.train_and_evaluate(config, str(tmp_path / "resumed"), progress=False)
  assert first["preempted"] and first["step"] == 3  # SIGTERM during step 2: saved after it, exited cleanly
  resumed_log = []
  with loop.testing_hooks(batch_log=resumed_log):
    second = loop.train_and_evaluate(config, str(tmp_path / "resumed"), progress=False)
  assert second["start_step"] == 3 and second["step"] == 5
  # Identical data order (the grain iterator state was restored) and identical parameters.
  assert list(killed_log) + resumed_log == straight_log
  for a, b in zip(jax.tree.leaves(straight["state"].params), jax.tree.leaves(second["state"].params),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # eval.py restores what train.py wrote and reproduces its final metrics.
  m = eval_lib.evaluate_workdir(str(tmp_path / "resumed"), max_batches=int(config.train.eval_batches))
  assert m["step"] == 5
  np.testing.assert_allclose(m["loss"], second["metrics"]["loss"], rtol=1e-6)
  with open(m["path"]) as f:
    assert json.load(f)["accuracy"] == m["accuracy"]
  assert os.path.exists(tmp_path / "resumed" / "config.json")
  assert os.listdir(tmp_path / "resumed" / "tensorboard")


@pytest.mark.slow
def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  config = smoke("combiner_fixed", **{"train.num_steps": 6, "train.checkpoint_every": 2})
  build = experiment.Experiment._build_train_step

  def poisoned_at_step_3(self):  # the compiled step, fed NaN parameters at step 3: its loss is NaN
    step_fn = build(self)

    def run(params, rest, opt_state, rng, step, batch):
      if int(step) == 3:
        params = jax.tree.map(lambda x: x * jnp.nan, params)
      return step_fn(params, rest, opt_state, rng, step, batch)
    return run

  monkeypatch.setattr(experiment.Experiment, "_build_train_step", poisoned_at_step_3)
  with pytest.raises(loop.TrainingDiverged, match=r"step 3.*last good checkpoint \(step 2\)"):
    loop.train_and_evaluate(config, str(tmp_path), progress=False)
  exp = experiment.Experiment(config, devices=jax.devices())
  mgr = checkpoints.checkpoint_manager(str(tmp_path), config)
  assert mgr.latest_step() == 2
  state = checkpoints.restore_checkpoint(mgr, exp, None)
  assert state.step == 2
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_sigterm_subprocess_leaves_resumable_checkpoint(tmp_path):
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-u", "train.py", "--config", "configs/default.py:smoke", "--workdir", workdir,
         "--config.train.num_steps=100000", "--config.train.checkpoint_every=100000", "--noprogress"]
  env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  lines = []
  for line in proc.stdout:  # wait until training runs (the first metrics line), then preempt
    lines.append(line)
    if line.startswith("step "):
      proc.send_signal(signal.SIGTERM)
      break
  rest, _ = proc.communicate(timeout=300)
  output = "".join(lines) + rest
  assert proc.returncode == 0, output
  assert "SIGTERM: saved checkpoint at step" in output
  config = config_io.load_config(workdir)
  mgr = checkpoints.checkpoint_manager(workdir, config)
  saved = mgr.latest_step()
  assert saved is not None and saved >= 2
  mgr.close()
  with config.unlocked():
    config.train.num_steps = saved + 1
  result = loop.train_and_evaluate(config, workdir, progress=False)
  assert result["start_step"] == saved and result["step"] == saved + 1


def test_list_names_every_attention_config_and_argument():
  text = listing.listing()
  for name in ("combiner_fixed", "dense", "yoso", "routing"):
    assert f"\n  {name} " in text
  for config in ("configs/default.py", "configs/cifar10.py", "configs/lra.py"):
    assert config in text
  assert "task=" in text and "yoso_paper" in text and "routing_paper" in text and "smoke" in text
  assert "configs/base.py" not in text and "configs/images.py" not in text  # shared settings, not experiments
  assert "bits/dim on the test set." in text  # a summary that wraps in its docstring is listed whole
