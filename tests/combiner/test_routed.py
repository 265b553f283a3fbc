"""combiner.routed (Combiner-learnable) against the from-definition reference in float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import combiner
from attention_core import registry as ops_registry
from combiner import kernel_plans, reference


@functools.partial(jax.jit, static_argnames=("num_clusters", "causal", "pooling"))
def _routed(q, k, v, ids, mask, *, num_clusters, causal, pooling="max", pool_q=None, pool_k=None):
  return combiner.routed(q, k, v, cluster_ids=ids, num_clusters=num_clusters, causal=causal, mask=mask,
                         pooling=pooling, pool_q=pool_q, pool_k=pool_k)


def _inputs(seed, b, n, h, d, dv, clusters):
  """float: float64 inside jax.enable_x64 (the reference checks), float32 outside."""
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (b, n, h, d), float)
  k = jax.random.normal(ks[1], (b, n, h, d), float)
  v = jax.random.normal(ks[2], (b, n, h, dv), float)
  # Skewed cluster ids: some clusters large, some empty, so chunks straddle clusters.
  ids = jnp.minimum(jax.random.randint(ks[3], (b, n, h), 0, clusters + 2), clusters - 1)
  mask = jax.random.bernoulli(ks[4], 0.75, (b, n)).at[:, 0].set(True)
  return q, k, v, ids, mask


def _real(out, mask):
  return np.where(np.asarray(mask)[:, :, None, None], np.asarray(out), 0.0)


# Bidirectional over several clusters costs the most: those cases run with -m slow.
@pytest.mark.parametrize("n,clusters,causal", [
    pytest.param(n, clusters, causal, marks=pytest.mark.slow if n > 1 and not causal else ())
    for n, clusters in [(1, 1), (10, 4), (13, 3)] for causal in (False, True)])
def test_matches_reference(causal, n, clusters):
  with jax.enable_x64(True):
    q, k, v, ids, mask = _inputs(n, 2, n, 2, 3, 4, clusters)
    # Both poolings in both modes across the cases (one compile each).
    poolings = ("max",) if n == 1 else (("max",) if causal == (n == 10) else ("mean",))
    for pooling in poolings:
      out = _routed(q, k, v, ids, mask, num_clusters=clusters, causal=causal, pooling=pooling)
      assert out.dtype == jnp.float64 and out.shape == v.shape
      want = reference.reference_op("routed", q, k, v, causal=causal, mask=mask, pooling=pooling,
                                    cluster_ids=ids, num_clusters=clusters)
      np.testing.assert_allclose(_real(out, mask), _real(want, mask), rtol=1e-10, atol=1e-12)


def test_pool_vectors_match_reference():
  with jax.enable_x64(True):
    q, k, v, ids, mask = _inputs(3, 1, 9, 2, 3, 2, 3)
    pq, pk = jax.nn.relu(k[..., ::-1]), jax.nn.relu(q + 1.0)
    for causal in (False, True):
      out = _routed(q, k, v, ids, mask, num_clusters=3, causal=causal, pool_q=pq, pool_k=pk)
      want = reference.reference_op("routed", q, k, v, causal=causal, mask=mask, pool_q=pq, pool_k=pk,
                                    cluster_ids=ids, num_clusters=3)
      np.testing.assert_allclose(_real(out, mask), _real(want, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_full_support_rows_sum_to_one_and_causal_zeros(causal):
  """A from one-hot values (v = I): positive exactly on Omega_i, rows sum to 1, zeros above the diagonal."""
  with jax.enable_x64(True):
    n = 12
    q, k, _, ids, mask = _inputs(5, 1, n, 1, 3, 1, 4)
    eye = jnp.eye(n, dtype=jnp.float64)[None, :, None, :]  # [1, n, 1, n]: value of key j = e_j
    a = np.asarray(_routed(q, k, eye, ids, mask, num_clusters=4, causal=causal))[0, :, 0, :]  # [query, key]
    real = np.asarray(mask[0])
    omega = np.broadcast_to(real[None, :], (n, n))
    if causal:
      omega = omega & np.tril(np.ones((n, n), bool))
    rows = real  # padded query rows are don't-care
    assert np.all(a[rows][omega[rows]] > 0)
    assert np.all(a[rows][~omega[rows]] == 0.0)
    np.testing.assert_allclose(a[rows].sum(-1), 1.0, rtol=1e-12)


@pytest.mark.slow  # test_padded_cluster_ids_and_content_change_no_real_output is the fast invariance check
def test_padding_invariance_gradients_and_bf16():
  q, k, v, ids, mask = (x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
                        for x in _inputs(7, 2, 16, 2, 8, 8, 4))
  pad = ~mask[:, :, None, None]
  noise = 50.0 * jax.random.normal(jax.random.key(1), q.shape)
  for causal in (False, True):
    out = _routed(q, k, v, ids, mask, num_clusters=4, causal=causal)
    out2 = _routed(jnp.where(pad, noise, q), jnp.where(pad, -noise, k), jnp.where(pad, noise, v), ids, mask,
                   num_clusters=4, causal=causal)
    np.testing.assert_allclose(_real(out, mask), _real(out2, mask), rtol=1e-5, atol=1e-6)
    assert bool(jnp.isfinite(out2).all())
  b16 = _routed(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), ids, mask,
                num_clusters=4, causal=True)
  assert b16.dtype == jnp.bfloat16
  np.testing.assert_allclose(_real(b16.astype(jnp.float32), mask), _real(out, mask), atol=0.1)

  def loss(q_, k_, v_):
    return jnp.sum(combiner.routed(q_, k_, v_, cluster_ids=ids, num_clusters=4, causal=True, mask=mask) ** 2)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert all(bool(jnp.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_padded_cluster_ids_and_content_change_no_real_output(causal):
  """Padded positions rank after every real token, so real outputs are the same whatever the padding holds:
  other cluster ids, huge values, NaN (the routing module computes padded tokens' ids from their content)."""
  q, k, v, ids, mask = (x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
                        for x in _inputs(11, 2, 16, 2, 8, 8, 4))
  pad = ~mask[:, :, None, None]
  out = _routed(q, k, v, ids, mask, num_clusters=4, causal=causal)
  for seed, fill in [(2, 50.0), (3, jnp.nan)]:
    other_ids = jnp.where(pad[..., 0], jax.random.randint(jax.random.key(seed), ids.shape, 0, 4), ids)
    noisy = [jnp.where(pad, fill * jax.random.normal(jax.random.key(seed + i), x.shape), x)
             for i, x in enumerate((q, k, v))]
    out2 = _routed(*noisy, other_ids, mask, num_clusters=4, causal=causal)
    np.testing.assert_array_equal(_real(out2, mask), _real(out, mask))


def test_causal_jacobian_exact_zeros():
  with jax.enable_x64(True):
    n = 9
    q, k, v, ids, _ = _inputs(11, 1, n, 1, 3, 2, 3)

    def f(q_, k_, v_):
      return combiner.routed(q_, k_, v_, cluster_ids=ids, num_clusters=3, causal=True)[0, :, 0, 0]

    jacs = jax.jit(jax.jacrev(f, argnums=(0, 1, 2)))(q, k, v)
    future = np.triu(np.ones((n, n), bool), 1)
    for jac in jacs:
      j = np.abs(np.asarray(jac)[:, 0, :, 0, :]).sum(-1)  # [out position, in position]
      assert np.all(j[future] == 0.0)
      assert np.any(j[~future] != 0.0)


def test_rejects_bad_arguments():
  q = jnp.ones((1, 5, 2, 3))
  ids = jnp.zeros((1, 5, 2), jnp.int32)
  with pytest.raises(ValueError, match="cluster_ids"):
    combiner.routed(q, q, q, cluster_ids=ids + 3, num_clusters=3)
  with pytest.raises(ValueError, match="cluster_ids"):
    combiner.routed(q, q, q, cluster_ids=ids[:, :4], num_clusters=3)
  with pytest.raises(TypeError, match="cluster_ids"):
    combiner.routed(q, q, q, cluster_ids=ids.astype(jnp.float32), num_clusters=3)
  with pytest.raises(ValueError, match="num_clusters"):
    combiner.routed(q, q, q, cluster_ids=ids, num_clusters=0)
  with pytest.raises(ValueError, match="pooling"):
    combiner.routed(q, q, q, cluster_ids=ids, num_clusters=2, pooling="sum")


def test_registered_ops_run_under_jit():
  q = jax.random.normal(jax.random.key(0), (1, 20, 2, 8))
  for name in ("routing", "combiner_routed"):
    spec = ops_registry.get(name)
    params = ops_registry.bench_params(spec, 20)
    out = jax.jit(functools.partial(spec.fn, causal=True, **params))(q, q, q)
    assert out.shape == q.shape and bool(jnp.isfinite(out).all())


def _kernels_against_xla(causal, pooling, deepsets, *, length=13, clusters=4, masked=True, seed=3,
                         value_dim=5):
  """(pallas, xla): the output and the gradients of q, k, v (and the DeepSets pools) of sum(out * cotangent),
  float32, skewed clusters, value_dim != head_dim unless given; padded query rows (don't-care) carry no
  cotangent and are compared as zeros."""
  q, k, v, ids, mask = (x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
                        for x in _inputs(seed, 2, length, 2, 8, value_dim, clusters))
  mask = mask if masked else None
  pools = [jax.random.normal(jax.random.key(s), q.shape) for s in (7, 8)] if deepsets else [None, None]
  real = jnp.ones(q.shape[:2], bool) if mask is None else mask
  cotangent = jnp.where(real[:, :, None, None], jax.random.normal(jax.random.key(9), v.shape), 0.0)

  def run(implementation, q, k, v, pool_q, pool_k):
    def f(q, k, v, pool_q, pool_k):
      return combiner.routed(q, k, v, cluster_ids=ids, num_clusters=clusters, causal=causal, mask=mask,
                             pooling=pooling, pool_q=pool_q, pool_k=pool_k, implementation=implementation)
    out, vjp = jax.vjp(f, q, k, v, *pools)
    return (jnp.where(real[:, :, None, None], out, 0.0), *vjp(cotangent))

  got = jax.jit(functools.partial(run, "pallas"))(q, k, v, *pools)
  want = jax.jit(functools.partial(run, "xla"))(q, k, v, *pools)
  return got, want, ("out", "dq", "dk", "dv") + (("dpool_q", "dpool_k") if deepsets else ())


def _assert_equal(got, want, names, tol=2e-5):
  for name, a, b in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol, err_msg=name)


@pytest.mark.parametrize("causal,pooling,deepsets", [
    (False, "max", True), (True, "max", True),
    pytest.param(False, "mean", False, marks=pytest.mark.slow),
    pytest.param(True, "mean", False, marks=pytest.mark.slow)])
def test_kernels_equal_xla(causal, pooling, deepsets):
  """Both directions on their kernels (interpret mode) equal the XLA path: bidirectional on Combiner-Fixed's,
  causal on `combiner.routed_kernels` (the own chunk and prefix states in slot layout, the other chunks'
  states in position layout), with a mask and chunks straddling clusters."""
  _assert_equal(*_kernels_against_xla(causal, pooling, deepsets))


@pytest.mark.slow  # two query and key tiles per block in interpret mode: about 15 s
def test_causal_kernels_equal_xla_over_several_tiles_without_a_mask():
  """Chunks of 150 (frame rows of two 128-position tiles): the summary kernel's masks across key tiles and
  the slot pass's prefix states across its tiles; no mask (validity from positions alone)."""
  _assert_equal(*_kernels_against_xla(True, "max", False, length=300, clusters=2, masked=False), tol=5e-5)


def test_causal_kernels_carry_base_states_over_many_blocks():
  """Eight blocks of 8 over 64 tokens in eight skewed chunks: a chunk's block-start state is carried over
  runs of blocks holding none of its tokens (forward) and its gradient handed back over them to the token
  that ended it (backward, blocks in reverse), with a mask and DeepSets pools."""
  _assert_equal(*_kernels_against_xla(True, "max", True, length=64, clusters=8, seed=5))


@pytest.mark.parametrize("gpu", [False, True], ids=["tpu_layout", "gpu_layout"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_kernels_write_gradients_over_the_reordered_cotangent_and_output(monkeypatch, causal, gpu):
  """value_dim == head_dim: the backward writes dk over the cotangent in rank (slot) order and dv over the
  output there, its own copies (each program reads its own block of them first), in both layouts."""
  if gpu:
    monkeypatch.setattr(kernel_plans, "packs_heads", lambda platform: True)
    monkeypatch.setattr(kernel_plans, "partial_banks", lambda platform: True)
  _assert_equal(*_kernels_against_xla(causal, "max", False, length=40, clusters=5, value_dim=8))


def test_causal_kernels_in_the_gpu_layout(monkeypatch):
  """The GPU layout (heads packed, one head a program; `kernel_plans.packs_heads`), in interpret mode: a GPU
  runs a head's blocks in parallel, so the base states are gathered per block, not carried."""
  monkeypatch.setattr(kernel_plans, "packs_heads", lambda platform: True)
  monkeypatch.setattr(kernel_plans, "partial_banks", lambda platform: True)
  _assert_equal(*_kernels_against_xla(True, "max", False, length=11, clusters=3))


def test_prefix_poolings_through_each_position_match_their_definition():
  """`tiles.pool_upto` (the span of the valid rows up to and including each row) and its gradient
  (`route_prefix(upto=True)`) against the definition, max and mean, with invalid rows, in float32."""
  from combiner import tiles

  n, d = 12, 3
  x = jax.random.normal(jax.random.key(0), (n, d))
  valid = (jnp.arange(n) % 4 != 1)[:, None]
  g = jax.random.normal(jax.random.key(1), (n, d))
  for kind in ("max", "mean"):
    def definition(x, kind=kind):
      rows = []
      for j in range(n):
        members = [x[i] for i in range(j + 1) if bool(valid[i, 0])]
        if not members:
          rows.append(jnp.zeros(d))
        else:
          stack = jnp.stack(members)
          rows.append(jnp.max(stack, axis=0) if kind == "max" else jnp.mean(stack, axis=0))
      return jnp.stack(rows)

    pooled, cnt = tiles.pool_upto(x, valid, kind, "cpu")
    np.testing.assert_allclose(np.asarray(pooled), np.asarray(definition(x)), atol=1e-6, err_msg=kind)
    want = jax.vjp(definition, x)[1](g)[0]
    got = tiles.route_prefix(x, valid, kind, cnt, g, "cpu", upto=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=kind)


def test_causal_kernels_keep_nonfinite_masked_and_future_values_from_visible_outputs():
  """On its kernels, the causal plan selects rather than multiplies: NaN or Inf at masked keys and values,
  or at future values, leaves every visible output as it was (16 tokens in chunks of 4)."""
  q, k, v, ids, mask = (x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
                        for x in _inputs(5, 2, 16, 2, 8, 8, 4))
  run = jax.jit(lambda k, v: combiner.routed(q, k, v, cluster_ids=ids, num_clusters=4, causal=True, mask=mask,
                                             implementation="pallas"))
  clean = np.asarray(run(k, v))
  future = jnp.arange(16)[None, :] > 9
  for bad in (jnp.nan, jnp.inf):
    for where, visible, keys in ((~mask, mask, True), (future, ~future & mask, False)):
      plant = lambda x, where=where, bad=bad: jnp.where(where[:, :, None, None], bad, x)  # noqa: E731
      out = np.asarray(run(plant(k) if keys else k, plant(v)))
      np.testing.assert_array_equal(out[np.asarray(visible)], clean[np.asarray(visible)])
