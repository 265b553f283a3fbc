"""Ops that partition themselves (attention_core.partition): called inside a plain jax.jit with q, k, v
sharded over the batch and/or the heads of a mesh with arbitrary axis names, on 8 simulated CPU devices
(tests/conftest.py), an op equals its one-device result, forward and gradients, with no collective; per-head
weights follow the heads, keys fold in the heads shard, a sharded sequence runs the op's sequence-parallel
form (or is gathered), on Explicit and Auto axes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from attention_baselines.local import local
from attention_core import contract, hlo, partition
from combiner import axial, fixed
from yoso.attention import yoso

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
BOTH = P("rows", None, "cols", None)  # batch over "rows", heads over "cols"
SPLITS = {"batch": P("rows"), "heads": P(None, None, "cols"), "both": BOTH}


def mesh(kind=EXPLICIT, shape=(2, 4), names=("rows", "cols")) -> jax.sharding.Mesh:
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names), devices=jax.devices()[:np.prod(shape)])


def inputs(batch=4, length=32, heads=4, dim=8, seed=0):
  return tuple(jax.random.normal(jax.random.key(seed), (3, batch, length, heads, dim)))


def weighted(out):
  """A loss that reads every output element with its own weight."""
  return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))


def fwd_grads(op, q, k, v, m=None, spec=None, argnums=(0, 1, 2), grads=True, **extra):
  """(out, grads or None, compiled fwd+bwd text or None) of jit(op) on q, k, v (and `extra` arrays as op
  arguments), placed with `spec` on mesh `m` (None: one device)."""
  names = list(extra)

  def f(q, k, v, *xs):
    return op(q, k, v, **dict(zip(names, xs, strict=True)))

  def loss(*args):
    return weighted(f(*args))

  args = (q, k, v, *extra.values())
  if m is None:
    return jax.jit(f)(*args), jax.jit(jax.grad(loss, argnums))(*args) if grads else None, None
  with jax.set_mesh(m):
    args = tuple(jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v)) + args[3:]
    if not grads:
      return jax.jit(f)(*args), None, None
    compiled = jax.jit(jax.grad(loss, argnums)).lower(*args).compile()
    return jax.jit(f)(*args), compiled(*args), compiled.as_text()


def padded(spec: P) -> tuple:
  return tuple(spec) + (None,) * (4 - len(spec))


def assert_same(got, want, tol=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def test_fused_kernel_sharded_over_batch_and_heads_equals_one_device():
  """Combiner-Fixed's Pallas kernel (interpret mode), batch over "rows" and heads over "cols" of an Explicit
  mesh: the output keeps q's sharding, forward and gradients equal one device's, and the compiled gradient
  program has no collective."""
  q, k, v = inputs()

  def op(q, k, v):
    return fixed(q, k, v, causal=True, block_size=8, implementation="pallas")

  want = fwd_grads(op, q, k, v)
  out, grads, text = fwd_grads(op, q, k, v, mesh(), BOTH)
  assert out.sharding.spec == BOTH
  assert_same((out, grads), want[:2])
  assert hlo.collectives(text) == []


@pytest.mark.parametrize("split,kind", [
    ("both", AUTO), ("batch", EXPLICIT),
    *(pytest.param(s, k, marks=pytest.mark.slow) for s, k in (
        ("heads", EXPLICIT), ("both", EXPLICIT), ("batch", AUTO), ("heads", AUTO)))],
    ids=lambda x: x if isinstance(x, str) else str(x).lower().split(".")[-1])
def test_sharded_equals_one_device(split, kind):
  """Every split on Explicit and Auto axes (the XLA path: the partitioning is the op's, not the kernel's).
  Auto axes run on the op's own split (batch over "rows", heads over "cols"), which is the inputs' for
  "both": there the program has no collective either."""
  q, k, v = inputs()

  def op(q, k, v):
    return axial(q, k, v, causal=True, row_length=8, direction="vertical", implementation="xla")

  out, grads, text = fwd_grads(op, q, k, v, mesh(kind), SPLITS[split])
  assert_same((out, grads), fwd_grads(op, q, k, v)[:2])
  if kind == EXPLICIT or split == "both":
    assert hlo.collectives(text) == []
  if kind == EXPLICIT:
    assert padded(out.sharding.spec) == padded(SPLITS[split])


def test_every_registered_op_with_a_fused_path_partitions_itself():
  """The registry's ops with a fused path go through contract.per_platform_op, which partitions them (a new
  op with a kernel is checked here without being named)."""
  from attention_core import registry

  for name in registry.fused_ops():
    fn = registry.get(name).fn
    fn = fn.func if isinstance(fn, functools.partial) else fn
    assert getattr(fn, "partitions_itself", False), f"{name}: {fn.__name__} is not a per_platform_op"


def test_auto_placement_follows_the_data_x_model_layout():
  sizes = {"a": 2, "b": 4, "c": 1}
  m = jax.sharding.AbstractMesh((2, 4, 1), ("a", "b", "c"), axis_types=(AUTO,) * 3)
  assert partition.auto_placement(m, 4, 8) == partition.Placement(("a",), ("b",))
  assert partition.auto_placement(m, 8, 3) == partition.Placement(("a", "b"), ())  # "b" does not divide heads
  one = jax.sharding.AbstractMesh((8,), ("x",), axis_types=(AUTO,))
  assert partition.auto_placement(one, 16, 4) == partition.Placement(("x",), ())
  assert partition.auto_placement(one, 2, 8) == partition.Placement((), ("x",))
  assert partition.dividing(["a", "b"], sizes, 4) == ("a",)


@contract.per_platform_op(lambda *a, **kw: None)
def noisy(q, k, v, *, causal, rng, mask=None):
  """A test op that draws from a key: v plus noise [heads, dim] drawn per head."""
  del q, k, causal, mask
  return v + jax.random.normal(rng, v.shape[2:])[None, None]


def test_keys_are_shared_over_batch_shards_and_folded_with_the_heads_shard():
  """A key passed to a partitioned op (the models pass theirs so): with the batch split every device draws
  the one-device noise; with the heads split too, heads shard j draws with fold_in(key, j), so its heads
  equal a one-device run on those heads with that key."""
  q, k, v = inputs()
  key = jax.random.key(3)

  def op(q, k, v, rng):
    return noisy(q, k, v, causal=False, rng=rng)

  batch_only = fwd_grads(op, q, k, v, mesh(shape=(2, 4)), P("rows"), grads=False, rng=key)[0]
  assert_same(batch_only, op(q, k, v, key))
  out = fwd_grads(op, q, k, v, mesh(shape=(2, 2), names=("rows", "cols")), BOTH, grads=False, rng=key)[0]
  blocks = [op(q[:, :, 2 * j:2 * j + 2], k[:, :, 2 * j:2 * j + 2], v[:, :, 2 * j:2 * j + 2],
               jax.random.fold_in(key, j)) for j in range(2)]
  assert_same(out, jnp.concatenate(blocks, axis=2))
  assert not np.allclose(np.asarray(blocks[1]), np.asarray(op(q, k, v, key)[:, :, 2:]))


def test_yoso_hashes_every_head_as_one_device_does_whatever_splits_the_heads():
  """YOSO draws its hash functions and backward sketch for every head before it partitions itself: with the
  heads split its outputs and gradients equal one device's."""
  q, k, v = inputs()

  def op(q, k, v):
    return yoso(q, k, v, rng=jax.random.key(3), num_hashes=4, tau=3, backward_features=2,
                formulation="sorted")

  got = fwd_grads(op, q, k, v, mesh(shape=(2, 2), names=("rows", "cols")), BOTH)
  assert_same(got[:2], fwd_grads(op, q, k, v)[:2])


@contract.per_platform_op(lambda *a, **kw: None, per_head=("w",))
def scaled(q, k, v, *, causal, w, bias, mask=None):
  """A test op: v scaled per head by w [heads, dim], plus a bias [dim] shared by every head."""
  del q, k, causal, mask
  return v * w[None, None] + bias


@pytest.mark.parametrize("split", ["batch", "both"])
def test_per_head_weights_follow_the_heads_and_shared_weights_are_summed(split):
  """w [heads, dim] is split with the heads, bias [dim] replicated; their gradients equal one device's (the
  batch-only split leaves "cols" unused, the case of the op's own VJP; both splits use every axis)."""
  q, k, v = inputs()
  w, bias = jax.random.normal(jax.random.key(5), (4, 8)), jax.random.normal(jax.random.key(6), (8,))

  def op(q, k, v, w, bias):
    return scaled(q, k, v, causal=True, w=w, bias=bias)

  got = fwd_grads(op, q, k, v, mesh(), SPLITS[split], argnums=(2, 3, 4), w=w, bias=bias)
  assert_same(got[:2], fwd_grads(op, q, k, v, argnums=(2, 3, 4), w=w, bias=bias)[:2])
  assert all(c.kind == "all-reduce" for c in hlo.collectives(got[2]))  # the weights' gradient sums only


def test_sequence_sharded_runs_the_sequence_parallel_form():
  """q split along its length over an Explicit axis: Combiner-Fixed runs its sequence-parallel form, which
  all-gathers block summaries (L / block rows), never a device's keys; the output stays split the same
  way."""
  q, k, v = inputs(batch=2, length=64)
  spec = P("rows", "cols")

  def op(q, k, v):
    return fixed(q, k, v, causal=True, block_size=8, implementation="xla")

  out, grads, text = fwd_grads(op, q, k, v, mesh(), spec)
  assert_same((out, grads), fwd_grads(op, q, k, v)[:2])
  assert tuple(out.sharding.spec)[:2] == ("rows", "cols")
  local_k = 1 * 16 * 4 * 8 * 4  # one device's k: [1, 16, 4, 8] float32
  gathered = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
  assert gathered and all(c.operand_bytes < local_k for c in gathered)


def test_sequence_sharded_without_a_form_is_gathered():
  """An op with no sequence-parallel form (local attention) gathers the sequence: every device sees whole
  sequences of its batch rows and heads; the result equals one device's."""
  q, k, v = inputs(batch=2, length=64)

  def op(q, k, v):
    return local(q, k, v, causal=True, block_size=8, implementation="xla")

  out, grads, text = fwd_grads(op, q, k, v, mesh(), P("rows", "cols"))
  assert_same((out, grads), fwd_grads(op, q, k, v)[:2])
  assert any(c.kind == "all-gather" for c in hlo.collectives(text))


def test_eager_vmap_and_shard_map_callers():
  """Concrete sharded arrays (no jit of the caller's) run jitted on their placement; jax.vmap over a
  partitioned op maps it; inside the caller's own shard_map the op sees this device's arrays (no second
  map)."""
  q, k, v = inputs()
  m = mesh(AUTO)
  placed = [jax.device_put(x, NamedSharding(m, BOTH)) for x in (q, k, v)]
  want = fixed(q, k, v, causal=True, block_size=8)
  assert_same(fixed(*placed, causal=True, block_size=8), want)
  keys = jax.random.split(jax.random.key(0), 2)
  line = mesh(AUTO, shape=(4,), names=("x",))  # the batch over "x": the one-device hashes
  rows = [jax.device_put(x, NamedSharding(line, P("x"))) for x in (q, k, v)]
  with jax.set_mesh(line):
    mapped = jax.jit(jax.vmap(lambda r: yoso(*rows, rng=r, num_hashes=2, tau=2, formulation="sorted")))(keys)
  assert_same(mapped[1], yoso(q, k, v, rng=keys[1], num_hashes=2, tau=2, formulation="sorted"))
  seen = []

  @contract.per_platform_op(lambda *a, **kw: None)
  def probe(q, k, v, *, causal, mask=None):
    seen.append(tuple(q.shape))
    return v

  jax.jit(jax.shard_map(lambda q, k, v: probe(q, k, v, causal=True), mesh=m, in_specs=BOTH, out_specs=BOTH))(
      *placed)
  assert seen == [(2, 32, 1, 8)]


def test_an_eager_call_on_one_device_is_one_compiled_program():
  """A call on concrete one-device arrays compiles the op as one program, once per shapes and arguments (not
  primitive by primitive), equal to the op under jit; another backend or a callable argument traces anew,
  and the values a trace cannot read are checked before it."""
  from combiner import routed

  q, k, v = inputs(batch=2)
  programs = partition._compiled._cache_size
  out = fixed(q, k, v, causal=True, block_size=8)
  assert programs() == 1
  assert_same(fixed(q, k, v, causal=True, block_size=8), out)
  assert programs() == 1
  assert_same(out, jax.jit(lambda q, k, v: fixed(q, k, v, causal=True, block_size=8))(q, k, v), tol=0)
  fixed(q, k, v, causal=False, block_size=8)
  fixed(q[:, :16], k[:, :16], v[:, :16], causal=True, block_size=8)
  assert programs() == 3
  with contract.traced_for("gpu"):  # the GPU choices: not this CPU's program
    fixed(q, k, v, causal=True, block_size=8, implementation="xla")
  assert programs() == 3
  fixed(q, k, v, causal=True, block_size=np.int64(8))  # not a plain value: runs as it is
  assert programs() == 3
  with pytest.raises(ValueError, match=r"'block_size' must be a positive integer, got Array\(8"):
    fixed(q, k, v, causal=True, block_size=jnp.int32(8))  # refused as given, not as a traced value
  assert programs() == 3
  ids = jnp.zeros(q.shape[:3], jnp.int32)
  routed(q, k, v, cluster_ids=ids + 1, num_clusters=2)
  assert programs() == 4
  with pytest.raises(ValueError, match=r"must lie in \[0, num_clusters=2\), got values in \[2, 2\]"):
    routed(q, k, v, cluster_ids=ids + 2, num_clusters=2)
  # equal values of other types are other programs: the op checks each ((0.0,) is not a position)
  from attention_baselines.longformer import longformer

  longformer(q, k, v, causal=False, window=4, global_positions=(0,))
  with pytest.raises(ValueError, match="global_positions"):
    longformer(q, k, v, causal=False, window=4, global_positions=(0.0,))


def test_bad_input_gets_the_ops_own_error():
  q, k, v = inputs()
  m = mesh()
  with jax.set_mesh(m):
    qs = jax.device_put(q, NamedSharding(m, BOTH))
    with pytest.raises(ValueError, match="block_size"):
      jax.jit(lambda q: fixed(q, q, q, causal=True, block_size=0))(qs)
    with pytest.raises(ValueError, match="rank 4"):
      jax.jit(lambda q: fixed(q[..., 0], q[..., 0], q[..., 0], causal=True, block_size=8))(qs)


def _fused_ops() -> list[str]:
  from attention_core import registry

  return sorted(registry.fused_ops())


@pytest.mark.slow
@pytest.mark.parametrize("name", _fused_ops())
def test_every_fused_op_sharded_equals_one_device(name):
  """Every op with a fused path, its kernel interpreted where it runs on CPU (else its XLA path: Splash's
  TPU kernels compile in test_partition_tpu.py), with a key mask: forward and gradients on a (2, 4) mesh equal
  one device's (NSA's per-head weights split with the heads), the batch and the heads both split (ops that
  draw from a key draw for every head before they partition themselves)."""
  from attention_core import registry

  spec, path = registry.get(name), registry.fused_path(registry.get(name))
  value = next((v for v in path.kernels if "cpu" in path.platforms.get(v, ("cpu",))), path.reference)
  q, k, v = inputs(batch=2, length=64)
  mask = jax.random.bernoulli(jax.random.key(9), 0.8, (2, 64)).at[:, 0].set(True)
  params = {**registry.bench_params(spec, 64, batch=2, heads=4, head_dim=8, dtype=jnp.float32),
            path.argument: value}
  arrays = {n: x for n, x in params.items() if isinstance(x, jax.Array)}
  if name == "nsa":  # its compression weights one per head (stand-ins are shared: a leading axis of 1)
    arrays = {n: x * (1 + 0.1 * jnp.arange(4.0)).reshape(4, *[1] * (x.ndim - 1)) for n, x in arrays.items()}
  static = {n: x for n, x in params.items() if n not in arrays}
  causal = spec.causal and path.causal

  def op(q, k, v, **xs):
    return spec.fn(q, k, v, causal=causal, mask=mask, **static, **xs)

  got = fwd_grads(op, q, k, v, mesh(), BOTH, **arrays)
  assert_same(got[:2], fwd_grads(op, q, k, v, **arrays)[:2], tol=1e-4)
  assert hlo.collectives(got[2]) == []


def test_an_eager_call_on_sharded_heads_reshards_per_head_constants():
  """Eager on heads split over an Explicit axis: the routed plan's per-head centroids, made as a constant the
  op's registration passes, are resharded to the heads like q (shard_map refused them replicated)."""
  from attention_core import registry

  spec = registry.get("combiner_routed")
  q, k, v = inputs(batch=2, length=32, heads=4)
  want = spec.fn(q, k, v, causal=True, num_clusters=4)
  m = mesh(EXPLICIT, (4,), ("cols",))
  with jax.set_mesh(m):
    qs, ks, vs = (jax.device_put(x, NamedSharding(m, P(None, None, "cols"))) for x in (q, k, v))
    got = spec.fn(qs, ks, vs, causal=True, num_clusters=4)
  assert padded(got.sharding.spec) == (None, None, "cols", None)
  assert_same(got, want)


SLOW = pytest.mark.slow
SELF_PARTITIONED = ["linear", "bigbird", "reformer", *(pytest.param(name, marks=SLOW) for name in (
    "blockbert", "performer", "routing", "etc", "transformer_xl", "compressive"))]


@pytest.mark.parametrize("name", SELF_PARTITIONED)
@pytest.mark.parametrize("split", ["batch", "heads", "both"])
def test_ops_xla_cannot_split_on_explicit_axes_partition_themselves(name, split):
  """Ops without a fused path whose XLA form updates or reshapes a sharded axis (XLA's partitioner refuses
  that on Explicit axes: ShardingTypeError) partition themselves and equal one device, gradients included:
  what an op makes for every head (blockbert's default shifts, performer's features and reformer's rotations
  drawn from its key, routing's centroids) is made before the heads are split, so each device uses a
  one-device call's."""
  from attention_core import registry

  spec = registry.get(name)
  q, k, v = inputs(batch=4, length=64, heads=4, dim=8)
  kw = dict(spec.params(64), **spec.bench_inputs(64, registry.Shape(batch=4, heads=4, head_dim=8)))
  if name == "reformer":  # 4 chunks, so that the rotations decide which keys a query sees
    kw.update(chunk_size=16, n_buckets=4)

  def op(q, k, v):
    return spec.fn(q, k, v, causal=spec.causal, **kw)

  want = fwd_grads(op, q, k, v)
  got = fwd_grads(op, q, k, v, mesh(EXPLICIT), SPLITS[split])
  assert padded(got[0].sharding.spec) == padded(SPLITS[split])
  assert_same(got[:2], want[:2])


@pytest.mark.slow
def test_memory_keys_and_global_tokens_split_like_q_on_explicit_axes():
  """Arguments of another length than q, split like q: Transformer-XL's keys over [memory; segment] (with a
  mask), and ETC's given global tokens [batch, g, heads, dim] with its global output returned too."""
  from attention_baselines.etc import etc
  from attention_baselines.transformer_xl import transformer_xl

  q, k, v = inputs(batch=4, length=32, heads=4, dim=8)
  kv = jnp.concatenate([k, v], axis=1)  # [batch, 64, heads, dim]: 32 memory positions, then the segment
  mask = jax.random.bernoulli(jax.random.key(3), 0.8, (4, 64)).at[:, -1].set(True)
  r, u, vb = (jax.random.normal(jax.random.key(i), s) for i, s in ((4, (64, 4, 8)), (5, (4, 8)), (6, (1, 8))))

  def xl(q, k, v):
    return transformer_xl(q, kv, kv[..., ::-1] + v.mean(), r=r, u=u, v_bias=vb, causal=True, mask=mask)

  assert_same(fwd_grads(xl, q, k, v, mesh(EXPLICIT), BOTH)[:2], fwd_grads(xl, q, k, v)[:2])
  g = tuple(jax.random.normal(jax.random.key(7 + i), (4, 2, 4, 8)) for i in range(3))  # [batch, g, heads, d]

  def global_tokens(q, k, v):
    long, glob = etc(q, k, v, causal=False, segment_length=16, radius=4, max_distance=2, global_q=g[0],
                     global_k=g[1], global_v=g[2], return_global=True)
    return long + glob.sum(axis=1, keepdims=True)

  got = fwd_grads(global_tokens, q, k, v, mesh(EXPLICIT), BOTH)
  assert padded(got[0].sharding.spec) == padded(BOTH)
  assert_same(got[:2], fwd_grads(global_tokens, q, k, v)[:2])
