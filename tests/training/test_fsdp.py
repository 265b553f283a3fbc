"""FSDP: the mesh's "fsdp" axis splits parameters and optimizer state; the batch is split over data x fsdp.

The mesh sizes a config resolves to, one-line errors for bad values, the per-device bytes of the paper-scale
LM's state (from its shardings, nothing allocated), training steps on 8 simulated devices against one device
(and a checkpoint written under FSDP resumed on one device), and the TPU compiler's per-chip argument bytes
with and without FSDP (libtpu, ahead of time)."""


import jax
import numpy as np
import pytest

from configs import default, validation, wiki40b
from models import stacked
from runtime.cli import UsageError
from training import checkpoints, experiment
from training import mesh as mesh_lib


def sizes(n, **mesh):
  c = default.get_config("smoke")
  for name, value in mesh.items():
    c.mesh[name] = value
  return dict(zip(mesh_lib.AXES, mesh_lib.mesh_sizes(c, n), strict=True))


def test_mesh_sizes_put_data_parallel_devices_on_fsdp_by_default():
  assert sizes(8) == {"data": 1, "fsdp": 8, "seq": 1, "model": 1}
  assert sizes(1) == {"data": 1, "fsdp": 1, "seq": 1, "model": 1}
  assert sizes(8, fsdp=1) == {"data": 8, "fsdp": 1, "seq": 1, "model": 1}  # the switch: plain data parallel
  assert sizes(8, data=2) == {"data": 2, "fsdp": 4, "seq": 1, "model": 1}  # hybrid: 2 groups of 4
  assert sizes(8, fsdp=4) == {"data": 2, "fsdp": 4, "seq": 1, "model": 1}
  assert sizes(8, seq=4) == {"data": 1, "fsdp": 2, "seq": 4, "model": 1}
  assert sizes(8, data=2, seq=-1) == {"data": 2, "fsdp": 1, "seq": 4, "model": 1}
  assert sizes(8, data=4, model=2) == {"data": 4, "fsdp": 1, "seq": 1, "model": 2}
  with pytest.raises(ValueError, match="does not fit the 8 devices"):
    sizes(8, fsdp=3)
  # A config written before the fsdp axis existed (no mesh.fsdp) keeps its plain data-parallel mesh.
  old = default.get_config("smoke")
  del old.mesh["fsdp"]
  assert mesh_lib.mesh_sizes(old, 8) == (8, 1, 1, 1)


@pytest.mark.parametrize("field,value", [("fsdp", 0), ("fsdp", -2), ("data", 0)])
def test_bad_mesh_value_is_one_line_naming_the_field(field, value):
  c = default.get_config("smoke")
  c.mesh[field] = value
  with pytest.raises(UsageError) as e:
    validation.validate(c)
  assert str(e.value).startswith(f"config.mesh.{field} must be ") and "\n" not in str(e.value)


def paper_lm(fsdp, seq=1):
  """The paper-scale LM: 12 layers, width 1024 (16 heads, MLP 4096), SentencePiece 32K, on 8 devices."""
  c = wiki40b.get_config("features=1024,heads=16,mlp_dim=4096")
  c.mesh.fsdp, c.mesh.seq = fsdp, seq
  return experiment.Experiment(c, devices=jax.devices()[:8])


def state_bytes(exp):
  """(bytes of parameters + Adam moments on the fullest device, their total bytes), from the shardings."""
  state = exp.abstract_state()
  tree = {"params": state["params"], "opt_state": state["opt_state"]}
  return mesh_lib.per_device_bytes(tree), sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_paper_lm_state_per_device_is_an_eighth_under_fsdp():
  """Parameters + Adam moments: <= 1.3 x total / 8 per device with FSDP (the whole of it without: the mesh
  then has data = 8, fsdp = 1, and every spec is replicated, as on one device below)."""
  exp = paper_lm(-1)
  per_device, total = state_bytes(exp)
  assert total > 2.5e9  # ~218M parameters, and two Adam moments, in float32
  assert per_device <= 1.3 * total / 8
  # Every matrix is split along its width: the token embedding, an MLP weight, the output head.
  params = exp.param_shardings
  assert params["encoder"]["embed"]["embedding"].get_value().spec == jax.sharding.PartitionSpec(None, "fsdp")
  assert params["encoder"]["blocks"][0]["mlp"]["down"]["kernel"].get_value().spec[1] == "fsdp"
  assert params["head"]["kernel"].get_value().spec[0] == "fsdp"


def test_sequence_parallel_ops_split_the_batch_over_fsdp():
  """With seq = 4 the default mesh has fsdp = 2: the sequence-parallel ops split their batch over it too."""
  from attention_core import sharding

  c = default.get_config("smoke")
  c.mesh.seq = 4
  mesh = mesh_lib.make_mesh(c, jax.devices()[:8])
  assert sharding.seq_specs(mesh, "seq", 4, 2)[0] == jax.sharding.PartitionSpec("fsdp", "seq", None, None)
  assert sharding.seq_specs(mesh, "seq", 3, 2)[0] == jax.sharding.PartitionSpec(None, "seq", None, None)


def test_a_rule_of_several_mesh_axes_splits_over_their_product():
  """("fsdp", "seq") on a mesh of fsdp 2 x seq 4: a dimension 8 divides is split over both, one only 2 divides
  over fsdp, an odd one not at all; an axis an earlier dimension took, or of one device, is left out."""
  c = default.get_config("smoke")
  c.mesh.seq = 4
  mesh = mesh_lib.make_mesh(c, jax.devices()[:8])
  rules = {"embed": ("fsdp", "seq"), "mlp": "fsdp", "kv": ("model", "seq")}
  P = jax.sharding.PartitionSpec

  def spec(names, shape):
    return mesh_lib.logical_to_mesh(names, shape, rules, mesh)

  assert spec(("embed", "kv"), (64, 8)) == P(("fsdp", "seq"), None)  # seq taken; model has one device
  assert spec(("embed",), (6,)) == P("fsdp")
  assert spec(("embed",), (5,)) == P(None)
  assert spec(("mlp", "embed"), (4, 64)) == P("fsdp", "seq")
  assert spec(("kv", "embed"), (8, 64)) == P("seq", "fsdp")
  one = mesh_lib.make_mesh(default.get_config("smoke"), jax.devices()[:1])
  assert mesh_lib.logical_to_mesh(("embed",), (64,), rules, one) == P(None)


def test_sequence_parallel_devices_share_out_the_state_too():
  """The paper-scale LM with seq = 4 (so fsdp = 2) on 8 devices: parameters and Adam moments are split over
  fsdp x seq along the width, 1/8 per device as with fsdp = 8, and the step gathers them over both (the
  compute shardings keep "model" alone). With fsdp = 1 and seq = 8 they are split over seq."""
  for fsdp, seq in ((-1, 4), (1, 8)):
    exp = paper_lm(fsdp, seq)
    per_device, total = state_bytes(exp)
    assert per_device <= 1.3 * total / 8
    width = ("fsdp", "seq") if fsdp == -1 else "seq"
    embed = exp.param_shardings["encoder"]["embed"]["embedding"].get_value()
    assert embed.spec == jax.sharding.PartitionSpec(None, width)
    compute = exp.compute_shardings[0]["encoder"]["embed"]["embedding"].get_value()
    assert compute.spec == jax.sharding.PartitionSpec(None, None)


@pytest.mark.parametrize("devices,fsdp", [(1, -1), (8, 1)])
def test_one_device_and_plain_data_parallel_replicate_everything(devices, fsdp):
  """On one device, and with fsdp = 1, every array is whole on every device, as before FSDP."""
  config = default.get_config("smoke")
  config.mesh.fsdp = fsdp
  exp = experiment.Experiment(config, devices=jax.devices()[:devices])
  state = exp.abstract_state()
  assert all(all(a is None for a in x.sharding.spec) for x in jax.tree.leaves(state))
  assert mesh_lib.per_device_bytes(state) == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert exp.compute_shardings == (None, None) and exp.data_size == devices


def run(exp, batches, state=None):
  state = exp.init_state() if state is None else state
  losses = []
  for batch in batches:
    state, out = exp.train_step(state, batch)
    losses.append(float(out["loss"]))
  return state, losses


@pytest.mark.slow
def test_twenty_fsdp_steps_match_one_device_and_resume_there(tmp_path):
  """20 steps of the smoke Combiner LM on an 8-device FSDP mesh give one device's losses (and, after 10,
  its parameters); a checkpoint written under FSDP after 10 steps restores on one device and continues with
  the same losses."""
  config = default.get_config("smoke,attention=combiner_fixed")
  sharded = experiment.Experiment(config, devices=jax.devices()[:8])
  single = experiment.Experiment(default.get_config("smoke,attention=combiner_fixed"),
                                 devices=jax.devices()[:1])
  assert dict(sharded.mesh.shape) == {"data": 1, "fsdp": 8, "seq": 1, "model": 1}
  stream = iter(experiment.create_dataset(config, "train", batch_size=8, seed=0))
  batches = [next(stream) for _ in range(20)]
  s8, losses8 = run(sharded, batches[:10])
  s1, losses1 = run(single, batches[:10])
  np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
  leaves8 = jax.tree_util.tree_leaves_with_path(s8.params)
  for (path, a), b in zip(leaves8, jax.tree.leaves(s1.params), strict=True):
    if "['key']['bias']" not in jax.tree_util.keystr(path):  # softmax ignores it: its gradient is roundoff
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
  # Parameters and both Adam moments are split 8 ways along the width.
  up = s8.params["encoder"]["blocks"][0]["mlp"]["up"]["kernel"].get_value()
  assert up.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  assert up.addressable_shards[0].data.shape == (up.shape[0] // 8, up.shape[1])
  moments = [x for x in jax.tree.leaves(s8.opt_state) if x.shape == up.shape]
  assert len(moments) == 2 and all(x.sharding.spec == up.sharding.spec for x in moments)

  mgr = checkpoints.checkpoint_manager(str(tmp_path), config)
  checkpoints.save_checkpoint(mgr, s8, None, wait=True)
  restored = checkpoints.restore_checkpoint(mgr, single, None)
  assert restored.step == 10
  _, want = run(single, batches[10:], s1)
  _, resumed = run(single, batches[10:], restored)
  np.testing.assert_allclose(resumed, want, rtol=1e-5)
  _, continued = run(sharded, batches[10:], s8)
  np.testing.assert_allclose(continued, want, rtol=1e-5)


@pytest.mark.slow
def test_scanned_layers_on_fsdp_and_seq_match_unrolled_layers_on_one_device():
  """model.scan_layers (the blocks' parameters stacked on a replicated leading layer axis, split over fsdp x
  seq along their width) on an 8-device mesh with fsdp = 4 and seq = 2 (the sequence-parallel Combiner inside
  the scan) trains as the unrolled model on one device: the same losses over six steps and the same
  parameters."""
  def config(scan):
    c = default.get_config("smoke,attention=combiner_fixed")
    c.model.num_layers, c.model.scan_layers = 3, scan
    c.mesh.seq = 2 if scan else 1
    return c

  scanned = experiment.Experiment(config(True), devices=jax.devices()[:8])
  unrolled = experiment.Experiment(config(False), devices=jax.devices()[:1])
  assert dict(scanned.mesh.shape) == {"data": 1, "fsdp": 4, "seq": 2, "model": 1}
  stream = iter(experiment.create_dataset(config(True), "train", batch_size=8, seed=0))
  batches = [next(stream) for _ in range(6)]
  s8, losses8 = run(scanned, batches)
  s1, losses1 = run(unrolled, batches)
  np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
  up = s8.params["encoder"]["blocks"]["mlp"]["up"]["kernel"].get_value()  # [layers, embed, mlp]
  assert up.shape[0] == 3 and up.sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "seq"), None)
  per_layer = stacked.convert(s8.params, like=s1.params)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(per_layer), jax.tree.leaves(s1.params),
                          strict=True):
    if "['key']['bias']" not in jax.tree_util.keystr(path):  # softmax ignores it: its gradient is roundoff
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


@pytest.fixture
def tpu_slice():
  """A compile-only v5e:2x4 slice (8 chips) from libtpu's topology description."""
  from scripts import compile_tpu  # libtpu for this process (scripts/compile_tpu.py)

  pytest.importorskip("libtpu")

  gen, _ = compile_tpu.parse_topology("v5e-8")
  sl = compile_tpu.Slice(gen, 8)
  assert sl.topology_name == "v5e:2x4"
  return compile_tpu, sl


def test_tpu_slices_are_served_by_data_x_fsdp(tpu_slice):
  """scripts/compile_tpu passes over a slice whose data x fsdp axes do not divide the global batch."""
  compile_tpu, sl = tpu_slice
  config = default.get_config("smoke")
  assert compile_tpu.unservable(config, sl) is None  # batch 8 over fsdp = 8
  config.train.batch_size = 12
  assert "8-way data-parallel axes (data x fsdp)" in compile_tpu.unservable(config, sl)
  config.mesh.data, config.mesh.model = 2, 4  # fsdp = 1: the batch over data = 2 alone
  assert compile_tpu.unservable(config, sl) is None


def test_a_mesh_axis_no_torus_axis_gives_splits_physical_axes():
  """A v5p slice of 64 chips is a 4x4x4 torus; a mesh axis of 2 (the chips a batch leaves to seq) is no
  product of its axes, which jax.make_mesh refuses: make_mesh then splits physical axes."""
  from scripts import compile_tpu  # libtpu for this process (scripts/compile_tpu.py)

  pytest.importorskip("libtpu")

  gen, _ = compile_tpu.parse_topology("v5p-128")
  devices = compile_tpu.devices(compile_tpu.Slice(gen, 64))
  config = default.get_config("smoke")
  config.mesh.data, config.mesh.fsdp, config.mesh.seq, config.mesh.model = 1, 32, 2, 1
  mesh = mesh_lib.make_mesh(config, devices)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 32, "seq": 2, "model": 1}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


@pytest.mark.slow
def test_tpu_fsdp_step_compiles_with_smaller_arguments(tpu_slice):
  """The TPU compiler compiles the FSDP train step for v5e:2x4; its per-chip arguments (parameters, Adam
  moments, the batch) are under 1.3 / 8 of the plain data-parallel step's. Width 1024, so that a chip's
  share of a weight (128 columns) fills the TPU's 128 lanes: narrower shares are padded to them."""
  compile_tpu, sl = tpu_slice
  results = {}
  for fsdp in (-1, 1):
    config = default.get_config("smoke,features=1024,mlp_dim=2048,heads=8")
    config.mesh.fsdp = fsdp
    r = compile_tpu.compile_step(config, sl)
    assert r.status == "fits", r.message
    results[fsdp] = r
  assert results[-1].mesh == {"data": 1, "fsdp": 8, "seq": 1, "model": 1}
  assert results[-1].memory["arguments"] <= 1.3 * results[1].memory["arguments"] / 8
