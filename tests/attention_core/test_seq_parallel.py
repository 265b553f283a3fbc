"""Sequence parallelism on 8 simulated CPU devices (tests/conftest.py): the sharded ops equal the
single-device ops (outputs and gradients, float32), the compiled program's collectives stay within the
span-summary budget, and the model and train.py pick the sharded op when the mesh has a "seq" axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention_baselines import dense_seq_parallel
from attention_baselines.dense import dense as dense_single
from attention_core import hlo, sharding
from attention_core.sharding import traced_in
from combiner import fixed as fixed_single
from combiner import seq_parallel
from training import experiment
from training import mesh as mesh_lib

AUTO = jax.sharding.AxisType.Auto
FAST = {"xla_backend_optimization_level": 0}


def seq_mesh(data: int = 1, seq: int = 8) -> jax.sharding.Mesh:
  return jax.make_mesh((data, seq), ("data", "seq"), axis_types=(AUTO, AUTO),
                       devices=jax.devices()[:data * seq])


def inputs(seed: int, batch: int, length: int, heads: int, dim: int, value_dim: int):
  kq, kk, kv, km = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, length, heads, dim), jnp.float32)
  k = jax.random.normal(kk, (batch, length, heads, dim), jnp.float32)
  v = jax.random.normal(kv, (batch, length, heads, value_dim), jnp.float32)
  mask = np.array(jax.random.uniform(km, (batch, length)) > 0.25)
  mask[0, 10:25] = False  # whole blocks masked (empty spans), across a device boundary
  mask[-1, -7:] = False  # padding at the end
  return q, k, v, jnp.asarray(mask)


def value_and_grads(op, q, k, v, weights):
  """The op's output and the gradients of <output, weights> for q, k, v: one program."""
  def loss(q, k, v):
    out = op(q, k, v)
    return jnp.sum(out * weights), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def assert_close(got, want, scaled=False):
  """Float32 agreement; `scaled`: absolute tolerance relative to the largest entry of all arrays (gradients
  through a whole model, some of them sums that cancel to ~0, e.g. the key bias's)."""
  wants = [np.asarray(b) for b in jax.tree.leaves(want)]
  atol = 1e-5 * max(float(np.max(np.abs(b), initial=0.0)) for b in wants) if scaled else 5e-6
  for a, b in zip(jax.tree.leaves(got), wants, strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("causal,chunk_blocks", [(True, None), (True, 1), (False, 1)])
def test_fixed_equals_single_device(causal, chunk_blocks):
  # L = 8 devices x 3 blocks x 5: odd block size, odd number of blocks per device.
  q, k, v, mask = inputs(0, 2, 120, 2, 4, 3)
  weights = jax.random.normal(jax.random.key(1), v.shape)
  mesh = seq_mesh()

  def sharded(q, k, v):
    return seq_parallel.fixed(q, k, v, block_size=5, causal=causal, mask=mask, mesh=mesh,
                              chunk_blocks=chunk_blocks)

  def single(q, k, v):
    return fixed_single(q, k, v, block_size=5, causal=causal, mask=mask)

  got = jax.jit(lambda *a: value_and_grads(sharded, *a, weights), compiler_options=FAST)(q, k, v)
  want = jax.jit(lambda *a: value_and_grads(single, *a, weights), compiler_options=FAST)(q, k, v)
  assert_close(got, want)


def test_fixed_pooling_options_batch_axis_and_masked_nan():
  """pool_q / pool_k and mean pooling, batch split over "data" x sequence over "seq"; NaN keys at masked
  positions change no real output (NaN values there reach the single-device op's span einsum as 0 x NaN)."""
  q, k, v, mask = inputs(2, 2, 96, 2, 4, 4)
  pq, pk = jnp.tanh(q), jnp.cos(k)
  kw = dict(block_size=4, causal=True, mask=mask, pooling="mean", pool_q=pq, pool_k=pk)
  mesh = seq_mesh(data=2, seq=4)
  poisoned = [jnp.where(mask[:, :, None, None], x, jnp.nan) for x in (k, pk)]
  run = jax.jit(lambda q, k, v, pk: seq_parallel.fixed(q, k, v, mesh=mesh, **{**kw, "pool_k": pk}),
                compiler_options=FAST)
  got, got_nan = run(q, k, v, pk), run(q, poisoned[0], v, poisoned[1])
  want = jax.jit(lambda q, k, v: fixed_single(q, k, v, **kw), compiler_options=FAST)(q, k, v)
  assert_close(got, want)
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(got_nan)[real], np.asarray(want)[real], rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_equals_single_device(causal):
  q, k, v, mask = inputs(3, 1, 40, 2, 4, 3)
  weights = jax.random.normal(jax.random.key(4), v.shape)
  mesh = seq_mesh()
  got = jax.jit(lambda *a: value_and_grads(
      lambda q, k, v: dense_seq_parallel.dense(q, k, v, causal=causal, mask=mask, mesh=mesh), *a, weights),
      compiler_options=FAST)(q, k, v)
  want = jax.jit(lambda *a: value_and_grads(
      lambda q, k, v: dense_single(q, k, v, causal=causal, mask=mask), *a, weights),
      compiler_options=FAST)(q, k, v)
  assert_close(got, want)


def test_bad_lengths_and_meshes_raise():
  q = jnp.zeros((1, 120, 2, 4))
  mesh = seq_mesh()
  with pytest.raises(ValueError, match="multiple of 8 devices .* block_size 4 = 32"):
    seq_parallel.fixed(q, q, q, block_size=4, causal=True, mesh=mesh)
  with pytest.raises(ValueError, match="chunk_blocks"):
    seq_parallel.fixed(q, q, q, block_size=5, causal=True, mesh=mesh, chunk_blocks=2)
  with pytest.raises(ValueError, match="'seq' axis"):
    seq_parallel.fixed(q, q, q, block_size=5, causal=True, mesh=jax.make_mesh((8,), ("data",)))
  with pytest.raises(ValueError, match="multiple of 8 devices"):
    dense_seq_parallel.dense(q[:, :30], q[:, :30], q[:, :30], causal=True, mesh=mesh)


def compiled_hlo(op, shape, mesh):
  """HLO text of jit(forward + backward) for inputs sharded along the sequence."""
  sharding = NamedSharding(mesh, P(None, "seq"))
  x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
  grad = jax.grad(lambda q, k, v: jnp.sum(op(q, k, v)), argnums=(0, 1, 2))
  return jax.jit(grad).lower(x, x, x).compile().as_text()


@pytest.mark.parametrize("chunk_blocks", [None, 2])
def test_collective_bytes_within_span_summary_budget(chunk_blocks):
  length, block, heads, dim = 8 * 4 * 16, 16, 2, 8
  mesh = seq_mesh()
  text = compiled_hlo(lambda q, k, v: seq_parallel.fixed(q, k, v, block_size=block, causal=True, mesh=mesh,
                                                         chunk_blocks=chunk_blocks),
                      (1, length, heads, dim), mesh)
  rows = length // block  # summaries: one row per block and head
  budget = 4 * rows * heads * dim * 4  # elements x float32 bytes
  ops = hlo.collectives(text)
  assert {c.kind for c in ops} <= {"all-gather", "reduce-scatter", "all-reduce"}
  assert hlo.bytes_per_device(text) <= budget
  # Nothing of the size of K or V crosses devices: the largest collective moves one summary array.
  largest = max(c.operand_bytes * (c.group_size if c.kind == "all-gather" else 1) for c in ops)
  assert largest <= rows * heads * dim * 4
  dense_text = compiled_hlo(lambda q, k, v: dense_seq_parallel.dense(q, k, v, causal=True, mesh=mesh),
                            (1, length, heads, dim), mesh)
  assert hlo.bytes_per_device(text) * block <= hlo.bytes_per_device(dense_text) * 1.01


def test_hlo_parser():
  text = """
  %p = f32[4,8]{1,0} parameter(0)
  %ag = f32[32,8]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %rs = bf16[2,8]{1,0} reduce-scatter(bf16[16,8]{1,0} %x), replica_groups=[2,8]<=[16], dimensions={0}
  %ar = (f32[10]{0}, s32[3]{0}) all-reduce(f32[10]{0} %a, s32[3]{0} %b), replica_groups={{0,1},{2,3}}
  %cp = (f32[5]{0}, f32[5]{0}, u32[], u32[]) collective-permute-start(%p5), source_target_pairs={{0,1}}
  %p5 = f32[5]{0} parameter(1)
  %cpd = f32[5]{0} collective-permute-done(%cp)
  ROOT %a2a = pred[64]{0} all-to-all(pred[64]{0} %m), replica_groups={{0,1,2,3}}, dimensions={0}
  """
  got = [(c.kind, c.operand_bytes, c.group_size) for c in hlo.collectives(text)]
  assert got == [("all-gather", 128, 8), ("reduce-scatter", 256, 8), ("all-reduce", 52, 2),
                 ("collective-permute", 20, 1), ("all-to-all", 64, 4)]
  assert hlo.bytes_per_device(text) == pytest.approx(128 * 7 + 256 * 7 / 8 + 52 + 20 + 64 * 3 / 4)


def test_make_mesh_seq_axis():
  from configs import default

  config = default.get_config("smoke")
  config.mesh.data, config.mesh.seq, config.mesh.model = -1, 4, 1
  assert dict(mesh_lib.make_mesh(config).shape) == {"data": 1, "fsdp": 2, "seq": 4, "model": 1}
  config.mesh.data, config.mesh.seq = 2, -1
  assert dict(mesh_lib.make_mesh(config).shape) == {"data": 2, "fsdp": 1, "seq": 4, "model": 1}
  config.mesh.seq = 3
  with pytest.raises(ValueError, match="does not fit the 8 devices"):
    mesh_lib.make_mesh(config)


def test_model_chooses_seq_parallel_op():
  """A decoder with combiner_fixed under a mesh with seq = 8: same logits and gradients as without, and the
  compiled program gathers span summaries (all-gather) instead of the whole sequence."""
  from flax import nnx

  from configs import base
  from models import transformer

  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 1, 16, 2, 32
  cfg.attention = base.attention_config("combiner_fixed")
  cfg.attention.params.block_size = 4
  model = transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=64)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids = jax.random.randint(jax.random.key(5), (2, 64), 0, 11)
  mask = jnp.arange(64)[None, :] < jnp.array([[64], [50]])

  def loss(params, ids, mask):
    logits = nnx.merge(graphdef, params, rest)({"inputs": ids, "mask": mask}, deterministic=True)
    return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2), logits

  # Two distinct functions: a jit trace cache is keyed by function, and the context mesh is read when tracing.
  want = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST)(params, ids, mask)
  mesh = seq_mesh()  # the context mesh while tracing, as in train steps; inputs placed on its devices
  step = jax.jit(traced_in(mesh, jax.value_and_grad(lambda *a: loss(*a), has_aux=True)),
                 in_shardings=NamedSharding(mesh, P()), compiler_options=FAST)
  compiled = step.lower(params, ids, mask).compile()
  gathers = [c for c in hlo.collectives(compiled.as_text()) if c.kind == "all-gather" and c.group_size == 8]
  # batch x heads x 2 local blocks x head_dim float32: the local K would be 4x more.
  assert gathers and max(c.operand_bytes for c in gathers) <= 2 * 2 * 2 * 8 * 4
  assert_close(compiled(params, ids, mask), want, scaled=True)


@pytest.mark.slow
def test_train_step_with_seq_axis_matches_single_device():
  """train.py with mesh data=2 x seq=4: the attention runs sequence-parallel, one step equals one device's."""
  from configs import default

  def config(data, seq):
    c = default.get_config("smoke,attention=combiner_fixed")
    c.mesh.data, c.mesh.seq, c.mesh.model = data, seq, 1
    return c

  sharded = experiment.Experiment(config(2, 4), devices=jax.devices()[:8])
  assert sharding.seq_size(sharded.mesh) == 4
  batch = next(iter(experiment.create_dataset(sharded.config, "train", batch_size=8, seed=0)))
  s8, out8 = sharded.train_step(sharded.init_state(), batch)
  single = experiment.Experiment(config(1, 1), devices=jax.devices()[:1])
  s1, out1 = single.train_step(single.init_state(), batch)
  np.testing.assert_allclose(float(out8["loss"]), float(out1["loss"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


@pytest.mark.slow
def test_fixed_sends_at_most_a_sixteenth_of_dense_at_64k():
  """L = 65536 over 8 devices, 8 heads, head_dim 64, causal, forward + backward (compiled, not run)."""
  length, heads, dim = 65536, 8, 64
  mesh = seq_mesh()
  shape = (1, length, heads, dim)
  fixed_bytes = hlo.bytes_per_device(compiled_hlo(
      lambda q, k, v: seq_parallel.fixed(q, k, v, block_size=256, causal=True, mesh=mesh), shape, mesh))
  dense_bytes = hlo.bytes_per_device(compiled_hlo(
      lambda q, k, v: dense_seq_parallel.dense(q, k, v, causal=True, mesh=mesh), shape, mesh))
  assert fixed_bytes <= 4 * (length // 256) * heads * dim * 4
  assert fixed_bytes * 16 <= dense_bytes
