"""NSA's fused path (implementation="pallas": the compression branch and the block scores in one pass of
`attention_baselines.selection_flash` over the compressed keys, the selection and window branches in one pass
over the keys) against its XLA path: float64 interpret mode, no key mask and a length of whole selection
blocks (the kernels then carry no mask), the gradients of q, k, v, the gates and the compression MLPs; the TPU
branch in the TPU interpreter; the Triton lowering; and a libtpu compile on v5e at L = 4096 within 3x Splash's
device ops (the XLA path ran two loops of 2048 query chunks there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines import selection_flash
from attention_baselines.nsa import nsa
from attention_core import pallas
from attention_core import registry as ops_registry
from tests.attention_baselines.definitions import inputs
from tests.attention_baselines.test_nsa import PLAN
from tests.attention_baselines.test_nsa import _mlps as mlps
from tests.attention_baselines.test_selection_flash import TRITON_OK

SPLASH_DENSE_OPS = 58  # Splash attention, fwd+bwd at L = 4096 on v5e (docs/benchmarks.md)


def _run(implementation, mask, mlp_kwargs):
  """jit((q, k, v, gates, mlps, cot) -> (out, grads of sum(out * cot) w.r.t. q, k, v, gates and mlps))."""
  def loss(q, k, v, gates, weights, cot):
    out = nsa(q, k, v, causal=True, mask=mask, gates=gates, **PLAN, **weights, implementation=implementation)
    return jnp.sum(out * cot), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize("masked", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fused_path_equals_the_xla_path(masked):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(21, length=16)  # 8 selection blocks of 2
    mask = mask if masked else None
    gates = jax.random.uniform(jax.random.key(22), (*q.shape[:3], 3), jnp.float64)
    cot = jax.random.normal(jax.random.key(23), v.shape, jnp.float64)
    _, _, weights = mlps(2, 4, 3)
    want_grads, want = _run("xla", mask, weights)(q, k, v, gates, weights, cot)
    got_grads, got = _run("pallas", mask, weights)(q, k, v, gates, weights, cot)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.slow  # the TPU interpreter
def test_tpu_branch_in_the_tpu_interpreter():
  """The TPU kernels (block lists in SMEM, blocks copied in from HBM) with the race detector, float32, no
  mask."""
  q, k, v, _ = inputs(24, batch=1, length=64, dtype=jnp.float32)
  gates = jax.random.uniform(jax.random.key(25), (*q.shape[:3], 3), jnp.float32)
  cot = jax.random.normal(jax.random.key(26), v.shape, jnp.float32)
  _, _, weights = mlps(2, 4, 3)
  weights = jax.tree.map(lambda a: a.astype(jnp.float32), weights)
  want_grads, want = _run("xla", None, weights)(q, k, v, gates, weights, cot)
  with pallas.simulate("tpu", detect_races=True):
    got_grads, got = jax.block_until_ready(_run("auto", None, weights)(q, k, v, gates, weights, cot))
    assert not pallas.races_found()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)


@pytest.mark.all_platforms
def test_fused_path_lowers_for_cuda():
  """Exported for CUDA: two Triton kernels forward (compressed keys; selection and window together), six
  with the backward."""
  fn = lambda q, k, v: nsa(q, k, v, causal=True)  # noqa: E731  ("auto", mean pooling)
  spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

  def fwd_bwd(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  for f, kernels in ((fn, 2), (fwd_bwd, 6)):
    text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=TRITON_OK)(
        spec, spec, spec).mlir_module()
    assert text.count("xla.gpu.triton") == kernels and "tpu_custom_call" not in text


@pytest.mark.slow  # ~30 s of libtpu compile (the NSA TPU compile is -m slow in test_tpu_kernels_compile too)
@pytest.mark.all_platforms
def test_device_ops_within_three_times_splash():
  """v5e, L = 4096, bfloat16, 16 heads of 128, causal, fwd+bwd of the sum (q, k, v), the registry's
  stand-in compression MLPs: at most 3x Splash dense's 58 device ops."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from attention_core.hlo import device_ops
  from scripts import compile_tpu

  pytest.importorskip("libtpu")  # requirements-tpu-compile.txt
  g = compile_tpu.GENERATIONS["v5e"]
  device = compile_tpu.devices(compile_tpu.Slice(g, min(g.shapes)))[0]
  spec = ops_registry.get("nsa")
  params = ops_registry.bench_params(spec, 4096, heads=16, head_dim=128)
  x = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16,
                           sharding=NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), P()))
  loss = lambda q, k, v: jnp.sum(spec.fn(q, k, v, causal=True, **params).astype(jnp.float32))  # noqa: E731
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().as_text()
  found = device_ops(text)
  assert text.count("selection_flash") and found.ops <= 3 * SPLASH_DENSE_OPS, found


def test_lists_of_the_static_rules_are_constants():
  """Without ids the block lists come from the rules alone: numpy constants, the same for every row."""
  member = np.array([[[True, False, True], [False, False, False]]])
  lists = selection_flash._lists(member, 3)  # per tile: the count, then the members ascending
  assert isinstance(lists, np.ndarray)
  np.testing.assert_array_equal(lists, selection_flash._lists(jnp.asarray(member), 3))  # the traced form's
  width = lists.shape[-1] // 2
  np.testing.assert_array_equal(lists[0, 0, [0, 1, 2, width]], [2, 0, 2, 0])
