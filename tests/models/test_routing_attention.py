"""Routing model modules: centroid state, EMA in training only, sharded update, checkpoints,
causality."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import registry
from models.routing_attention import Centroids
from routing.local import local_attention

FEATURES, HEADS, HEAD_DIM, LENGTH = 16, 4, 4, 16


def _build(name, causal=True, **fields):
  params = fields.pop("params", {"num_clusters": 4})
  cfg = ml_collections.ConfigDict(dict(name=name, params=params, dropout_rate=0.0, **fields))
  return registry.build(cfg, features=FEATURES, num_heads=HEADS, head_dim=HEAD_DIM, causal=causal,
                        dtype=jnp.float32, rngs=nnx.Rngs(params=0, dropout=1, attention=2))


def _x(batch=2, seed=0):
  return jax.random.normal(jax.random.key(seed), (batch, LENGTH, FEATURES))


def _step(module, x, deterministic):
  """One jitted call through split/merge, as a train step does: returns (y, new state, sown aux losses)."""
  graphdef, state = nnx.split(module)

  @jax.jit
  def f(state, x):
    m = nnx.merge(graphdef, state)
    y = m(x, None, deterministic=deterministic)
    sown = nnx.pop(m, nnx.Intermediate)
    return y, nnx.state(m), sown

  return f(state, x)


@pytest.mark.parametrize("name", ["routing", "combiner_routed"])
def test_centroids_move_in_training_only_and_aux_loss_is_sown(name):
  m = _build(name)
  assert isinstance(m.centroids, Centroids) and not isinstance(m.centroids, nnx.Param)
  param_paths = [jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param))]
  assert param_paths and not any("centroids" in p for p in param_paths)  # never seen by the optimizer
  before = np.asarray(m.centroids[...])
  y, state, sown = _step(m, _x(), deterministic=True)
  after_eval = np.asarray(jax.tree.leaves(nnx.state(nnx.merge(nnx.graphdef(m), state), Centroids))[0])
  np.testing.assert_array_equal(after_eval, before)
  losses = jax.tree.leaves(sown)
  assert len(losses) == 1 and losses[0].shape == () and float(losses[0]) > 0
  _, state, _ = _step(m, _x(), deterministic=False)
  after_train = np.asarray(jax.tree.leaves(nnx.state(nnx.merge(nnx.graphdef(m), state), Centroids))[0])
  assert np.abs(after_train - before).max() > 0
  assert y.shape == (2, LENGTH, FEATURES) and bool(jnp.isfinite(y).all())


def test_auto_clusters_use_the_first_centroids_only():
  m = _build("routing", params={}, max_clusters=8)
  before = np.asarray(m.centroids[...])
  assert before.shape == (HEADS // 2, 8, HEAD_DIM)
  _, state, _ = _step(m, _x(), deterministic=False)
  after = np.asarray(jax.tree.leaves(nnx.state(nnx.merge(nnx.graphdef(m), state), Centroids))[0])
  moved = np.abs(after - before).max(axis=(0, 2)) > 0
  assert moved[:4].any() and not moved[4:].any()  # sqrt_pow2(16) = 4 clusters in use
  with pytest.raises(ValueError, match="max_clusters"):
    _build("routing", params={}, max_clusters=2)(_x(), None, deterministic=True)


def test_layers_without_routing_are_pure_local_attention():
  with pytest.raises(ValueError, match="layer="):
    _build("routing", routing_layers=[-1])
  cfg = ml_collections.ConfigDict(dict(name="routing", params={"num_clusters": 4, "block_size": 4},
                                       dropout_rate=0.0, routing_layers=[-1]))
  kw = dict(features=FEATURES, num_heads=HEADS, head_dim=HEAD_DIM, causal=True, dtype=jnp.float32)
  first = registry.build(cfg, rngs=nnx.Rngs(0), layer=0, num_layers=3, **kw)
  last = registry.build(cfg, rngs=nnx.Rngs(0), layer=2, num_layers=3, **kw)
  assert first.routing_heads == 0 and first.centroids is None
  assert last.routing_heads == HEADS // 2 and last.centroids is not None
  x = _x()
  q, k, v = first.project(x)
  want = first.out(local_attention(q, k, v, block_size=4, causal=True))
  np.testing.assert_allclose(first(x, None, deterministic=True), want, rtol=1e-5, atol=1e-6)
  # "auto" block = the routing window ceil(16 / 4), even without routing heads
  cfg.params = {"num_clusters": 4}
  auto = registry.build(cfg, rngs=nnx.Rngs(0), layer=0, num_layers=3, **kw)
  np.testing.assert_allclose(auto(x, None, deterministic=True), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["routing", pytest.param("combiner_routed", marks=pytest.mark.slow)])
def test_layer_jacobian_is_causal(name):  # combiner_routed's op-level Jacobian test runs by default
  m = _build(name)
  x = _x(batch=1)[0]
  graphdef, state = nnx.split(m)

  def f(x_):
    return nnx.merge(graphdef, state)(x_[None], None, deterministic=True)[0]

  jac = np.abs(np.asarray(jax.jit(jax.jacrev(f))(x))).sum(axis=(1, 3))  # [out position, in position]
  future = np.triu(np.ones((LENGTH, LENGTH), bool), 1)
  assert np.all(jac[future] == 0.0)
  assert np.all(np.diag(jac) > 0)


def test_sharded_ema_update_equals_one_device():
  devices = jax.devices()
  assert len(devices) == 8
  m = _build("routing")
  x = _x(batch=8, seed=3)
  # as train.py
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
  graphdef, state = nnx.split(m)

  def step(state, x):
    mod = nnx.merge(graphdef, state)
    mod(x, None, deterministic=False)
    return mod.centroids[...]

  one = jax.jit(step)(state, x)
  replicated = jax.device_put(state, NamedSharding(mesh, P()))
  sharded = jax.jit(step, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
                    out_shardings=NamedSharding(mesh, P()))(
                        replicated, jax.device_put(x, NamedSharding(mesh, P("data"))))
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(one), rtol=1e-6, atol=1e-7)
  assert np.abs(np.asarray(one) - np.asarray(m.centroids[...])).max() > 0


def _train_step(module, x, mask, mesh=None):
  """jit of one training call (EMA on) and the gradients of a weighted sum of its output: (output,
  centroids after the update, sown aux loss, parameter gradients); under `mesh` the batch is split over
  "data" and the heads of the attention over "model" (the ops partition themselves)."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  weights = jax.random.normal(jax.random.key(5), (x.shape[0], LENGTH, FEATURES))
  weights = weights * mask[..., None]  # padded rows' outputs are don't-care (the op contract)

  def loss(params, rest, x, mask):
    m = nnx.merge(graphdef, params, rest, copy=True)
    y = m(x, mask, deterministic=False)
    aux = jax.tree.leaves(nnx.pop(m, nnx.Intermediate))[0]
    return jnp.sum(y * weights), (y, m.centroids[...], aux)

  step = jax.grad(loss, has_aux=True)
  if mesh is not None:
    x, mask = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, mask))
    with jax.set_mesh(mesh):
      grads, out = jax.jit(step)(params, rest, x, mask)
  else:
    grads, out = jax.jit(step)(params, rest, x, mask)
  return (*out, grads)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_routed_combiner_on_kernels_trains_as_the_xla_path(causal):
  """implementation="pallas" (interpreted here): the clusters and the k-means assignments of the training
  step from one routing kernel, the attention on the plan's kernels. Output, centroid update, commitment
  loss and gradients equal the XLA path's, with padding."""
  x = _x(seed=4)
  mask = jnp.arange(LENGTH)[None, :] < jnp.array([[LENGTH], [LENGTH - 6]])
  got, want = (_train_step(_build("combiner_routed", causal=causal, implementation=impl), x, mask)
               for impl in ("pallas", "xla"))
  real = np.asarray(mask)[..., None]
  np.testing.assert_allclose(np.where(real, got[0], 0.0), np.where(real, want[0], 0.0), rtol=2e-5, atol=2e-5)
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
  initial = np.asarray(_build("combiner_routed").centroids[...])
  assert float(got[2]) > 0 and np.abs(np.asarray(got[1]) - initial).max() > 0


def test_routed_combiner_on_kernels_sharded_equals_one_device():
  """The training step with the routing kernel on a data x model mesh of 8 simulated devices (batch and
  heads split; the kernels run per device): output, centroid update, loss and gradients as on one device."""
  x = _x(batch=8, seed=6)
  mask = jnp.arange(LENGTH)[None, :] < (LENGTH - jnp.arange(8)[:, None])
  m = _build("combiner_routed", implementation="pallas")
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:8])
  got, want = _train_step(m, x, mask, mesh), _train_step(m, x, mask)
  real = np.asarray(mask)[..., None]
  got, want = (np.where(real, got[0], 0.0), *got[1:]), (np.where(real, want[0], 0.0), *want[1:])
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_centroids_survive_a_checkpoint_round_trip(tmp_path):
  m = _build("routing")
  _, state, _ = _step(m, _x(), deterministic=False)
  trained = nnx.merge(nnx.graphdef(m), state)
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, nnx.state(trained))
  fresh = _build("routing")
  assert np.abs(np.asarray(fresh.centroids[...]) - np.asarray(trained.centroids[...])).max() > 0
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(path, nnx.state(fresh))
  nnx.update(fresh, restored)
  np.testing.assert_array_equal(np.asarray(fresh.centroids[...]), np.asarray(trained.centroids[...]))


@pytest.mark.parametrize("config_file", ["cifar10", "imagenet64"])
def test_routing_paper_variants(config_file):
  import importlib

  from models import transformer

  module = importlib.import_module(f"configs.{config_file}")
  c = module.get_config("routing_paper")
  att = c.model.attention
  assert att.name == "routing" and att.routing_heads == c.model.num_heads // 2
  assert att.params.num_clusters * att.params.window >= c.data.seq_len  # every token can be routed
  assert c.optimizer.lr == 2e-4 and c.aux_loss_weight == 1e-4
  assert module.get_config("routing_paper,layers=3").model.num_layers == 3  # user arguments win
  if config_file == "cifar10":  # routing heads only in the top 4 of 12 layers (the block passes its index)
    model = nnx.eval_shape(lambda: transformer.build_model(c.model, task="image", vocab_size=256,
                                                           seq_len=c.data.seq_len))
    heads = [block.attention.routing_heads for block in model.encoder.blocks]
    assert heads == [0] * 8 + [4] * 4
    assert not c.model.scan_layers and c.model.remat == "none"
  else:  # 24 identical layers at 12288 tokens: scanned and recomputed in the backward pass
    assert c.model.scan_layers and c.model.remat == "full"
    some = module.get_config("routing_paper,routing_layers=2")
    assert not some.model.scan_layers, "blocks that differ by layer are not scanned"
    assert module.get_config("routing_paper,remat=none").model.remat == "none"
  for arg in ("routing_paper,smoke", "routing_paper,smoke,attention=combiner_routed",
              "attention=routing,smoke"):
    c = module.get_config(arg)
    model = nnx.eval_shape(lambda c=c: transformer.build_model(c.model, task="image", vocab_size=256,
                                                               seq_len=c.data.seq_len))
    centroids = [v for _, v in nnx.iter_graph(model) if isinstance(v, Centroids)]
    assert centroids, arg


def test_routing_attentions_build_in_every_experiment_config():
  import importlib

  import data
  from models import transformer

  for config_file in ("default", "cifar10", "imagenet64", "wiki40b", "c4", "lra"):
    for name in ("routing", "combiner_routed"):
      c = importlib.import_module(f"configs.{config_file}").get_config(f"attention={name},smoke")
      info = data.dataset_info(c)
      model = nnx.eval_shape(lambda c=c, info=info: transformer.from_info(c.model, info))
      assert [v for _, v in nnx.iter_graph(model) if isinstance(v, Centroids)], (config_file, name)
  # Bidirectional (encoder) routing runs: separate query/key routing, no shared QK.
  m = _build("routing", causal=False)
  assert not m.share_qk
  y, _, sown = _step(m, _x(), deterministic=False)
  assert bool(jnp.isfinite(y).all()) and len(jax.tree.leaves(sown)) == 1


@pytest.mark.slow
def test_decoder_default_is_exactly_causal_and_balanced_opt_in_leaks():
  """Finite changes, not Jacobians: the paper's balanced membership has a zero Jacobian into the future but
  still leaks through which tokens make a centroid's top-`window`; the module's decoder default does not."""
  x = _x(batch=1)
  x2 = x.at[:, 8:].set(3.0 * jax.random.normal(jax.random.key(7), x[:, 8:].shape))
  for membership, leaks in [(None, False), ("balanced_leaky", True)]:
    m = _build("routing", routing_heads=HEADS, membership=membership)
    a, b = m(x, None, deterministic=True)[:, :8], m(x2, None, deterministic=True)[:, :8]
    assert (float(jnp.max(jnp.abs(a - b))) > 1e-4) == leaks, membership


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_routed_combiner_real_outputs_ignore_padded_content(causal):
  """The module computes every token's cluster from its content; padded tokens must not move the partition:
  random values or NaN at masked positions leave the real positions' outputs unchanged."""
  m = _build("combiner_routed", causal=causal)
  x = _x()
  mask = jnp.arange(LENGTH)[None, :] < jnp.array([[LENGTH - 5], [LENGTH - 9]])  # [2, L]
  out = m(x, mask, deterministic=True)
  for fill in (40.0, jnp.nan):
    x2 = jnp.where(mask[..., None], x, fill * jax.random.normal(jax.random.key(3), x.shape))
    out2 = m(x2, mask, deterministic=True)
    np.testing.assert_array_equal(np.where(mask[..., None], out2, 0.0), np.where(mask[..., None], out, 0.0))


def test_a_causal_routed_combiner_says_its_chunks_depend_on_later_tokens(capsys):
  """The balanced partition of the causal routed plan depends on later tokens' clusters: a causal model built
  on it says so once (a bidirectional one has nothing to leak)."""
  from models import routing_attention

  routing_attention._warn_balanced_causal.cache_clear()  # as in a new process
  _build("combiner_routed", causal=False)
  assert "WARNING" not in capsys.readouterr().err
  _build("combiner_routed")
  _build("combiner_routed")
  assert capsys.readouterr().err.count("WARNING: attention 'combiner_routed' in a causal model") == 1
