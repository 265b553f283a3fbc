"""routing.nearest_kernel: Combiner-routed's nearest-centroid ids (and the query-only and key-only ones of the
training step) on one Pallas kernel, against the XLA path (`routing.attention.nearest_assignments`),
interpreted on CPU in both layouts and in the TPU interpreter, and lowered for TPU (Mosaic) and CUDA
(Triton)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core import pallas
from attention_core import registry as ops_registry
from routing import kmeans, nearest_kernel
from routing.attention import nearest_assignments


def _inputs(seed, b, n, h, d, clusters, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, n, h, d)).astype(dtype)
  k = jax.random.normal(ks[1], (b, n, h, d)).astype(dtype)
  return q, k, kmeans.init_centroids(ks[2], h, clusters, d)


def _want(q, k, c, sides=False):
  """The XLA path's joint ids [b, n, h] (sides: and the query-only, key-only [b, h, n])."""
  ids = [np.asarray(x) for x in nearest_assignments(q, k, c)]
  return ids if sides else ids[0]


@pytest.mark.parametrize("per_head", [False, True], ids=["tpu_layout", "gpu_layout"])
@pytest.mark.parametrize("b,n,h,d,clusters,dtype", [
    (2, 37, 3, 16, 4, jnp.float32),  # one partial tile, heads in one block
    pytest.param(1, 2500, 16, 32, 7, jnp.bfloat16,  # several tiles (the last partial), two blocks of 8 heads
                 marks=pytest.mark.slow),
    (1, 130, 2, 8, 1, jnp.float32),  # one cluster
])
def test_equals_xla_ids(per_head, b, n, h, d, clusters, dtype):
  q, k, c = _inputs(n, b, n, h, d, clusters, dtype)
  got = jax.jit(lambda q, k, c: nearest_kernel.nearest(q, k, c, platform="cpu", per_head=per_head))(q, k, c)
  assert got.shape == (b, n, h) and got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), _want(q, k, c))
  sides = jax.jit(lambda q, k, c: nearest_kernel.nearest(q, k, c, platform="cpu", per_head=per_head,
                                                         sides=True))(q, k, c)
  assert [x.shape for x in sides] == [(b, n, h), (b, h, n), (b, h, n)]
  for a, want in zip(sides, _want(q, k, c, sides=True), strict=True):
    np.testing.assert_array_equal(np.asarray(a), want)


def test_float64_inputs_stay_float64():
  with jax.enable_x64(True):
    q, k, c = _inputs(3, 1, 20, 2, 4, 5, jnp.float64)
    got = nearest_kernel.nearest(q, k, c.astype(jnp.float64), platform="cpu")
    np.testing.assert_array_equal(np.asarray(got), _want(q, k, c.astype(jnp.float64)))


def test_nonfinite_token_changes_only_its_own_id():
  q, k, c = _inputs(4, 1, 40, 2, 8, 6)
  bad = q.at[0, 7].set(jnp.nan).at[0, 9, 1].set(jnp.inf)
  clean = np.asarray(nearest_kernel.nearest(q, k, c, platform="cpu"))
  got = np.asarray(nearest_kernel.nearest(bad, k, c, platform="cpu"))
  assert ((0 <= got) & (got < 6)).all()
  keep = np.ones(40, bool)
  keep[[7, 9]] = False
  np.testing.assert_array_equal(got[0, keep], clean[0, keep])


def test_tpu_branch_in_the_tpu_interpreter_has_no_races():
  q, k, c = _inputs(5, 1, 300, 8, 16, 5, jnp.bfloat16)
  with pallas.simulate("tpu", detect_races=True):
    got = jax.block_until_ready(jax.jit(lambda q, k, c: nearest_kernel.nearest(q, k, c, sides=True))(q, k, c))
    assert not pallas.races_found()
  for a, want in zip(got, _want(q, k, c, sides=True), strict=True):
    np.testing.assert_array_equal(np.asarray(a), want)


@pytest.mark.all_platforms
@pytest.mark.parametrize("sides", [False, True])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lowers_for_accelerators(platform, sides):
  spec = jax.ShapeDtypeStruct((1, 2048, 16, 64), jnp.bfloat16)
  cent = jax.ShapeDtypeStruct((16, 48, 64), jnp.float32)
  target = "gpu" if platform == "cuda" else platform
  fn = jax.jit(lambda q, k, c: nearest_kernel.nearest(q, k, c, platform=target, sides=sides))
  text = fn.trace(spec, spec, cent).lower(lowering_platforms=(platform,)).as_text()
  assert "routing_nearest" in text and ("tpu_custom_call" if platform == "tpu" else "xla.gpu.triton") in text


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_op_on_kernels_equals_xla_path(causal):
  """combiner_routed under implementation="pallas" (its ids from the kernel, masked keys not zeroed) equals
  the XLA path, non-finite values at masked keys included."""
  op = ops_registry.get("combiner_routed").fn
  ks = jax.random.split(jax.random.key(6), 4)
  q, k, v = (jax.random.normal(kk, (2, 24, 2, 8)) for kk in ks[:3])
  mask = jax.random.bernoulli(ks[3], 0.7, (2, 24)).at[:, 0].set(True)
  k = jnp.where(mask[:, :, None, None], k, jnp.nan)
  got = jax.jit(lambda q, k, v: op(q, k, v, causal=causal, mask=mask, num_clusters=4,
                                   implementation="pallas"))(q, k, v)
  want = op(q, k, v, causal=causal, mask=mask, num_clusters=4, implementation="xla")
  real = np.asarray(mask)[:, :, None, None]
  np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=2e-5, atol=2e-5)
