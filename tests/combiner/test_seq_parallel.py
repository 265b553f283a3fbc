"""Sequence-parallel forms of the Combiner plans and their sparse counterparts on 8 simulated CPU devices
(tests/conftest.py): each equals its single-device op in float64 (outputs and the gradients of every input),
causal and bidirectional, with padding masks, max and mean pooling and DeepSets pools; the compiled programs
move span summaries, never the whole K and V; the model picks the form when the mesh splits the sequence.
The forms are reached through their registrations, as the models reach them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention_core import hlo, registry
from attention_core.sharding import traced_in
from combiner import seq_parallel_axial, seq_parallel_logsparse

AUTO = jax.sharding.AxisType.Auto
FAST = {"xla_backend_optimization_level": 0}
# Every plan with a sequence-parallel form besides combiner_fixed (tests/attention_core/test_seq_parallel.py).
PLANS = ("combiner_logsparse", "combiner_axial_rowmajor", "combiner_axial_vertical",
         "combiner_axial_horizontal", "combiner_mixture", "combiner_mixture_joint", "sparse_fixed",
         "sparse_logsparse", "sparse_axial")
POOLED = {"combiner_logsparse", "combiner_axial_rowmajor", "combiner_axial_vertical",
          "combiner_axial_horizontal", "combiner_mixture", "combiner_mixture_joint"}
# One cheap case in the fast run (the fast suite's budget); the rest with -m slow.
FAST_CASE = ("sparse_axial", True, (1, 8), None, False)


def seq_mesh(data: int = 1, seq: int = 8) -> jax.sharding.Mesh:
  return jax.make_mesh((data, seq), ("data", "seq"), axis_types=(AUTO, AUTO),
                       devices=jax.devices()[:data * seq])


def inputs(seed: int, length: int, batch: int = 2, heads: int = 2, dim: int = 4, dtype=jnp.float64):
  """q, k, v, pool_q, pool_k [batch, length, heads, dim] and a mask with a masked run across a device
  boundary (empty spans) and padding at the end."""
  keys = jax.random.split(jax.random.key(seed), 6)
  q, k, v, pq, pk = (jax.random.normal(kk, (batch, length, heads, dim), dtype) for kk in keys[:5])
  mask = np.array(jax.random.uniform(keys[5], (batch, length)) > 0.2)
  mask[0, length // 8 - 5:length // 4 + 3] = False
  mask[-1, -7:] = False
  return q, k, v, jnp.tanh(pq), jnp.cos(pk), jnp.asarray(mask)


def value_and_grads(op, arrays, weights):
  """op(*arrays) and the gradients of <op(*arrays), weights> for every array: one compiled program."""
  def loss(*arrays):
    out = op(*arrays)
    return jnp.sum(out * weights), out

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(arrays))), has_aux=True),
                 compiler_options=FAST)(*arrays)


def check_equal(name, causal, mesh_shape, *, length=256, pooling=None, deepsets=False, seed=0, **sharded_kw):
  spec = registry.get(name)
  q, k, v, pq, pk, mask = inputs(seed, length)
  kw = dict(spec.params(length), causal=causal, mask=mask)
  if pooling is not None:
    kw["pooling"] = pooling
  mesh = seq_mesh(*mesh_shape)
  weights = jax.random.normal(jax.random.key(seed + 1), v.shape, v.dtype)
  arrays = (q, k, v, pq, pk) if deepsets else (q, k, v)

  def op(fn, **extra):
    def run(q, k, v, *pools):
      return fn(q, k, v, **kw, **extra, **dict(zip(("pool_q", "pool_k"), pools, strict=False)))
    return run

  (_, got), got_grads = value_and_grads(op(spec.seq_parallel, mesh=mesh, **sharded_kw), arrays, weights)
  (_, want), want_grads = value_and_grads(op(spec.fn), arrays, weights)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)
  for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-11)


def _cases():
  """Per plan: causal on seq = 8 with max pooling; bidirectional on data = 2 x seq = 4 with mean pooling
  and DeepSets pools (their gradients too) where the op takes them. The logsparse forms, slow to compile
  (pieces per level), run one case each: Combiner's bidirectional (both directions' far spans) on seq = 8."""
  pooled = {name: ("mean", True) if name in POOLED else (None, False) for name in PLANS}
  for name in PLANS:
    if name == "combiner_logsparse":
      yield name, False, (1, 8), *pooled[name]
    elif name == "sparse_logsparse":
      yield name, True, (2, 4), None, False
    else:
      yield from _grid_or_block_cases(name, pooled[name])


def _grid_or_block_cases(name, pooled):
  """Both cases of `_cases`; the two mixtures are one program but for the last merge: one case each."""
  if name != "combiner_mixture":
    yield name, True, (1, 8), None, False
  if name != "combiner_mixture_joint":
    yield name, False, (2, 4), *pooled


@pytest.mark.parametrize("name,causal,mesh_shape,pooling,deepsets", [
    pytest.param(*case, marks=() if case == FAST_CASE else (pytest.mark.slow,),
                 id=f"{case[0]}-{'causal' if case[1] else 'bidir'}-{case[2][0]}x{case[2][1]}")
    for case in _cases()])
def test_equals_single_device(name, causal, mesh_shape, pooling, deepsets):
  # Logsparse compiles a program per dyadic level: 64 positions keep 2 or 3 levels that cross devices.
  length = 64 if name.endswith("logsparse") else 128 if mesh_shape == (1, 8) else 256
  # Per-row summaries in 2 chunks of each device's 4 rows (a loop inside the map).
  chunked = {"query_chunks": 2} if name.endswith(("rowmajor", "horizontal")) and mesh_shape == (2, 4) else {}
  with jax.enable_x64(True):
    check_equal(name, causal, mesh_shape, length=length, pooling=pooling, deepsets=deepsets, **chunked)


@pytest.mark.slow
def test_masked_nan_keys_change_no_real_output():
  """NaN keys and values at masked positions reach no real output when they travel to another device (the
  column layout of the grid plans)."""
  q, k, v, _, _, mask = inputs(5, 128, dtype=jnp.float32)
  real = mask[:, :, None, None]
  poisoned = [jnp.where(real, x, jnp.nan) for x in (k, v)]
  mesh = seq_mesh()
  run = jax.jit(lambda q, k, v: seq_parallel_axial.sparse_axial(q, k, v, row_length=16, causal=False,
                                                                mask=mask, mesh=mesh), compiler_options=FAST)
  clean, dirty = np.asarray(run(q, k, v)), np.asarray(run(q, *poisoned))
  np.testing.assert_allclose(dirty[np.asarray(mask)], clean[np.asarray(mask)], rtol=1e-6, atol=1e-6)


def test_bad_lengths_and_arguments_raise():
  q = jnp.zeros((1, 192, 2, 4))
  mesh = seq_mesh()
  with pytest.raises(ValueError, match="must be a power of two"):  # 192 / 8 = 24 positions per device
    seq_parallel_logsparse.logsparse(q, q, q, causal=True, mesh=mesh)
  with pytest.raises(ValueError, match="multiple of 8 devices .* row_length 16 = 128"):
    seq_parallel_axial.axial(q, q, q, row_length=16, direction="vertical", causal=True, mesh=mesh)
  with pytest.raises(ValueError, match="'row_length' \\(12\\) must be a multiple of the 8 devices"):
    seq_parallel_axial.sparse_axial(q[:, :96], q[:, :96], q[:, :96], row_length=12, causal=True, mesh=mesh)
  with pytest.raises(ValueError, match="span_key_fn"):
    seq_parallel_axial.axial(q, q, q, row_length=8, direction="vertical", causal=True, mesh=mesh,
                             span_key_fn=lambda s: s)
  with pytest.raises(ValueError, match="'seq' axis"):
    seq_parallel_logsparse.logsparse(q, q, q, causal=True, mesh=jax.make_mesh((8,), ("data",)))


def collective_bytes(op, length, mesh, heads=2, dim=8):
  """Bytes one device receives over all collectives of jit(forward + backward), and the collectives."""
  x = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.float32, sharding=NamedSharding(mesh, P(None, "seq")))
  grad = jax.grad(lambda q, k, v: jnp.sum(op(q, k, v)), argnums=(0, 1, 2))
  text = jax.jit(grad, compiler_options=FAST).lower(x, x, x).compile().as_text()
  return hlo.bytes_per_device(text), hlo.collectives(text)


@functools.cache
def dense_bytes(length, heads, dim):
  mesh = seq_mesh()
  return collective_bytes(lambda q, k, v: registry.get("dense").seq_parallel(q, k, v, causal=True, mesh=mesh),
                          length, mesh, heads, dim)


@pytest.mark.slow
@pytest.mark.parametrize("name,share", [  # one per mechanism (the rest: scripts/seq_parallel.py)
    ("combiner_logsparse", 1 / 64), ("sparse_fixed", 1 / 32), ("combiner_axial_rowmajor", 1 / 4),
    ("combiner_axial_vertical", 1 / 2), ("sparse_axial", 1 / 4)])
def test_collectives_move_summaries_not_keys(name, share):
  """L = 2048 over 8 devices, forward + backward: at most `share` of the dense K/V all-gather's bytes, and no
  all-gather brings a device anything the size of the other devices' keys."""
  length, heads, dim = 2048, 2, 8
  mesh = seq_mesh()
  spec = registry.get(name)
  kw = dict(spec.params(length), causal=True, mesh=mesh)
  got, ops = collective_bytes(lambda q, k, v: spec.seq_parallel(q, k, v, **kw), length, mesh, heads, dim)
  dense, _ = dense_bytes(length, heads, dim)
  assert got <= share * dense
  local_keys = length // 8 * heads * dim * 4
  assert all(c.operand_bytes * 7 < local_keys for c in ops if c.kind == "all-gather")


@pytest.mark.slow
def test_model_chooses_seq_parallel_form():
  """A one-layer decoder with combiner_axial_rowmajor under a mesh with seq = 8 (the context mesh while
  tracing, as in train steps): same logits and parameter gradients as without a mesh, DeepSets pools and
  the learned span key (a module called inside the map) included."""
  from flax import nnx

  from configs import base
  from models import transformer

  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 1, 16, 2, 32
  cfg.attention = base.attention_config("combiner_axial_rowmajor")
  cfg.attention.deepsets = cfg.attention.learned_span_key = True
  model = transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=128)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids = jax.random.randint(jax.random.key(5), (2, 128), 0, 11)
  mask = jnp.arange(128)[None, :] < jnp.array([[128], [100]])

  def loss(params, ids, mask):
    logits = nnx.merge(graphdef, params, rest)({"inputs": ids, "mask": mask}, deterministic=True)
    return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2), logits

  want = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST)(params, ids, mask)
  mesh = seq_mesh()
  step = jax.jit(traced_in(mesh, jax.value_and_grad(lambda *a: loss(*a), has_aux=True)),
                 in_shardings=NamedSharding(mesh, P()), compiler_options=FAST)
  compiled = step.lower(params, ids, mask).compile()
  assert any(c.group_size == 8 for c in hlo.collectives(compiled.as_text()))
  got = compiled(params, ids, mask)
  wants = [np.asarray(b) for b in jax.tree.leaves(want)]
  atol = 1e-5 * max(float(np.max(np.abs(b), initial=0.0)) for b in wants)
  for a, b in zip(jax.tree.leaves(got), wants, strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=atol)
