"""Attention ops under shard_map over the mesh's batch and heads axes (attention_core.sharding): on 8
   simulated CPU
devices (tests/conftest.py) a model's forward pass and gradients equal the one-device run, and for a TPU
topology (libtpu, compile only) the fused kernels compile without gathering q, k, v or the output."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention_baselines.reformer import reformer
from attention_core import sharding
from configs import base
from models import transformer
from training import mesh as mesh_lib
from yoso.attention import yoso, yoso_c

AUTO = jax.sharding.AxisType.Auto
FAST = {"xla_backend_optimization_level": 0}
MESHES = [(8, 1), (4, 2), (1, 8)]  # (data, model)
BATCH, LENGTH, HEADS = 8, 16, 8


def cpu_mesh(data: int, model: int, seq: int = 1) -> jax.sharding.Mesh:
  return jax.make_mesh((data, seq, model), ("data", "seq", "model"), axis_types=(AUTO,) * 3,
                       devices=jax.devices()[:data * seq * model])


def model_config(name: str, heads: int = HEADS) -> tuple:
  """(model config, task): one small layer; the fused kernels chosen explicitly (interpreted on CPU)."""
  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 1, 2 * heads, heads, 16
  cfg.attention = base.attention_config(name)
  task = "lm"
  if name == "combiner_fixed":
    cfg.attention.params.block_size = 4
    cfg.attention.implementation = "pallas"
  elif name == "yoso":
    cfg.attention.params.update(num_hashes=4, tau=3, formulation="pallas")
    task = "mlm"  # YOSO's Pallas tables are its bidirectional form
  elif name == "yoso_conv":  # yoso with the YOSO-C convolution (`yoso_attention.with_conv`)
    cfg.attention = base.attention_config("yoso")
    cfg.attention.params.update(num_hashes=4, tau=3)
    cfg.attention.conv_kernel_size = 3
    task = "mlm"
  elif name == "reformer":
    cfg.attention.params.chunk_size = 4  # 4 chunks: the rotations hash
  elif name == "dense":
    cfg.attention.implementation = "xla"
  elif name in ("linformer", "synthesizer"):  # weights shared by the heads / per head
    cfg.attention.proj_dim = 4 if name == "linformer" else None
    task = "mlm"
  return cfg, task


def loss_and_grads(model, ids, mesh=None):
  """jit(value_and_grad) of a weighted sum of the logits, traced under `mesh` (parameters and batch sharded
  by train.py's rules) or on one device."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  weights = jax.random.normal(jax.random.key(7), (*ids.shape, 11))

  def loss(params, rest, ids):
    logits = nnx.merge(graphdef, params, rest, copy=True)({"inputs": ids}, deterministic=True)
    return jnp.sum(logits[..., :11] * weights), logits

  step = jax.value_and_grad(loss, has_aux=True)
  if mesh is None:
    return jax.jit(step, compiler_options=FAST)(params, rest, ids)
  rules = dict(base.SHARDING_RULES)
  params = jax.device_put(params, mesh_lib.state_shardings(params, rules, mesh))
  ids = jax.device_put(ids, NamedSharding(mesh, P("data")))
  return jax.jit(sharding.traced_in(mesh, step), compiler_options=FAST)(params, rest, ids)


def assert_close(got, want):
  wants = [np.asarray(b) for b in jax.tree.leaves(want)]
  atol = 1e-5 * max(float(np.max(np.abs(b), initial=0.0)) for b in wants)
  for a, b in zip(jax.tree.leaves(got), wants, strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=atol)


def _fast_first(cases: list) -> list:
  """The first case runs in the fast suite, the others with -m slow (each compiles a model on 8 devices)."""
  return [c if i == 0 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(cases)]


@pytest.mark.parametrize("data,model,name", _fast_first(sorted(
    [(d, m, n) for d, m in MESHES[:2] for n in ("combiner_fixed", "yoso", "dense")]
    + [(4, 2, "linformer"), (4, 2, "synthesizer"), (2, 4, "reformer"), (2, 4, "yoso_conv")],
    key=lambda c: c != (4, 2, "combiner_fixed"))))
def test_model_equals_single_device(name, data, model):
  """Forward and gradients of a model layer on a data x model mesh equal the one-device run. The ops that
  draw from a key (YOSO's hashes, Reformer's rotations) draw every head's before they split the heads, so
  a heads shard draws what one device does."""
  cfg, task = model_config(name)
  net = transformer.build_model(cfg, task=task, vocab_size=11, seq_len=LENGTH)
  ids = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, 11)
  assert_close(loss_and_grads(net, ids, cpu_mesh(data, model)), loss_and_grads(net, ids))


@pytest.mark.slow
@pytest.mark.parametrize("op", [yoso, yoso_c, reformer])
def test_ops_drawing_from_a_key_equal_one_device_with_heads_split(op):
  """With heads split over "model" (and the batch over "data"), an op given a key under the models'
  placement (`sharding.attend`) equals the one-device call with that key: its heads draw their hash functions
  or rotations as one device does, not per shard."""
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(x, (BATCH, LENGTH, HEADS, 4)) for x in (kq, kk, kv))
  mask = jnp.arange(LENGTH)[None, :] < jnp.array([LENGTH - 3 * (i % 2) for i in range(BATCH)])[:, None]
  key = jax.random.key(5)
  kw = {yoso: dict(num_hashes=4, tau=3, formulation="pallas", causal=False),
        yoso_c: dict(num_hashes=4, tau=3, causal=False, conv_kernel=jax.random.normal(kk, (HEADS, 3))),
        reformer: dict(n_hashes=2, chunk_size=4, causal=True)}[op]
  mesh = cpu_mesh(4, 2)
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
  args = (*(put(x, "data", None, "model") for x in (q, k, v)), put(mask, "data"), put(key))
  got = jax.jit(sharding.traced_in(mesh, lambda q, k, v, mask, key: sharding.attend(
      op, q, k, v, mask=mask, rng=key, **kw)), compiler_options=FAST)(*args)
  want = op(q, k, v, mask=mask, rng=key, **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_axes_that_do_not_divide_stay_unsplit():
  mesh = cpu_mesh(4, 2)
  assert sharding.split_axes(mesh.abstract_mesh, 8, 8) == (("data",), "model")
  assert sharding.split_axes(mesh.abstract_mesh, 6, 3) == ((), None)
  # Batch 6, heads 3 on data=4 x model=2: nothing splits, the op runs as it is and still equals one device.
  cfg, task = model_config("combiner_fixed", heads=3)
  model = transformer.build_model(cfg, task=task, vocab_size=11, seq_len=LENGTH)
  ids = jax.random.randint(jax.random.key(2), (4, LENGTH), 0, 11)
  assert_close(loss_and_grads(model, ids, cpu_mesh(2, 4)), loss_and_grads(model, ids))


def test_no_mesh_or_one_device_calls_the_op_directly():
  calls = []

  def op(q, k, v, *, mask, causal):
    calls.append(jax.sharding.get_abstract_mesh().axis_types)
    return v

  x = jnp.ones((2, 4, 2, 3))
  sharding.attend(op, x, x, x, causal=True)
  jax.jit(sharding.traced_in(cpu_mesh(1, 1), lambda x: sharding.attend(op, x, x, x, causal=True)))(x)
  assert calls == [(), (AUTO, AUTO, AUTO)]  # not inside a shard_map (whose axes would be Manual)


def tpu_mesh(data: int, model: int) -> jax.sharding.Mesh:
  """Compile-only v5e:2x4 devices (libtpu's topology description) as a data x seq x model mesh."""
  from scripts import compile_tpu  # noqa: F401  (libtpu for this process: scripts/compile_tpu.py)

  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4")
  return jax.sharding.Mesh(np.array(topo.devices).reshape(data, 1, model), ("data", "seq", "model"))


def large_collectives(text: str, elements: int) -> list[str]:
  """Every all-gather / all-to-all in compiled HLO text with an array of at least `elements` elements."""
  found = []
  for line in text.splitlines():
    m = re.search(r"\s(all-gather|all-to-all)(-start)?\(", line)
    if not m or "=" not in line[:m.start()]:
      continue
    for dims in re.findall(r"\b(?:f32|bf16|f16|s32|u32|pred)\[([\d,]*)\]", line[:m.start()]):
      if int(np.prod([int(d) for d in dims.split(",") if d])) >= elements:
        found.append(line.strip()[:200])
  return found


@pytest.mark.slow
@pytest.mark.parametrize("name,data,model",
                         [(n, d, m) for n in ("combiner_fixed", "yoso") for d, m in MESHES[1::-1]]
                         + [("combiner_routed", 4, 2)])
def test_tpu_fused_kernels_compile_sharded_without_gathering_qkv(name, data, model):
  """The real TPU compiler (Mosaic kernels) compiles a model's forward + backward with the batch over "data"
  and heads over "model"; no q, k, v or output-sized array is all-gathered or all-to-all'd (parameter
  all-gathers are at most mlp_dim x features, far below one device's q). combiner_routed: its clusters from
  the routing kernel, per device."""
  mesh = tpu_mesh(data, model)
  batch, length, heads, head_dim = 8, 512, 8, 16
  cfg, task = model_config(name, heads)
  cfg.features, cfg.mlp_dim = heads * head_dim, 2 * heads * head_dim
  if name == "combiner_fixed":
    cfg.attention.params.block_size = 64
  abstract = nnx.eval_shape(lambda: transformer.build_model(cfg, task=task, vocab_size=11, seq_len=length))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  rules = dict(base.SHARDING_RULES)

  def shaped(tree):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                        mesh_lib.state_shardings(tree, rules, mesh))

  ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=NamedSharding(mesh, P("data")))

  def loss(params, rest, ids):
    return jnp.sum(nnx.merge(graphdef, params, rest, copy=True)({"inputs": ids}, deterministic=True))

  step = sharding.traced_in(mesh, jax.grad(loss))
  text = jax.jit(step).lower(shaped(params), shaped(rest), ids).compile().as_text()
  assert "tpu_custom_call" in text  # the Mosaic kernels are in the program
  assert name != "combiner_routed" or "routing_nearest" in text
  local_q = batch // data * length * heads // model * head_dim
  assert not large_collectives(text, local_q)
