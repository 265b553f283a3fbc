"""Performer, linear transformer, local, Longformer, BigBird and "none": each against a float64 reference
written from its paper's definition (O(L^2)), their limiting cases, causality (zero Jacobian to the future)
and masked keys holding NaN."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from baselines.bigbird import bigbird, block_pattern
from baselines.dense import dense
from baselines.linear import elu_feature_map, exclusive_prefix_sum, linear
from baselines.local import local
from baselines.longformer import longformer
from baselines.none import none
from baselines.performer import orthogonal_features, performer, softmax_kernel_features
from core import registry as ops_registry


def _inputs(key, batch=2, length=11, heads=2, head_dim=4, value_dim=3, dtype=jnp.float64, scale=1.0):
  ks = jax.random.split(jax.random.key(key), 4)
  q, k = (scale * jax.random.normal(kk, (batch, length, heads, head_dim), dtype) for kk in ks[:2])
  v = jax.random.normal(ks[2], (batch, length, heads, value_dim), dtype)
  mask = jax.random.bernoulli(ks[3], 0.75, (batch, length)).at[:, 0].set(True)
  return q, k, v, mask


def _masked_softmax(q, k, v, allowed, mask):
  """Softmax attention in numpy float64 where `allowed[i, j]` (ANDed with the key mask) says i may see j."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h, d = q.shape
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      s = q[bi, :, hi] @ k[bi, :, hi].T / np.sqrt(d)
      keep = allowed & np.asarray(mask[bi])[None, :]
      s = np.where(keep, s, -np.inf)
      m = np.max(s, axis=-1, keepdims=True)
      w = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
      den = w.sum(-1, keepdims=True)
      out[bi, :, hi] = (w / np.where(den > 0, den, 1.0)) @ v[bi, :, hi]
  return out


def _kernel_attention(phi_q, phi_k, v, causal, mask):
  """out_i = sum_j K_ij v_j / sum_j K_ij with K_ij = phi(q_i).phi(k_j) over visible j, from the definition."""
  phi_q, phi_k, v = (np.asarray(x, np.float64) for x in (phi_q, phi_k, v))
  b, n, h, _ = phi_q.shape
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      kern = phi_q[bi, :, hi] @ phi_k[bi, :, hi].T  # [n, n]
      keep = np.asarray(mask[bi])[None, :] & (np.tril(np.ones((n, n), bool)) if causal else True)
      kern = np.where(keep, kern, 0.0)
      out[bi, :, hi] = kern @ v[bi, :, hi] / kern.sum(-1, keepdims=True)
  return out


def _causal(n):
  return np.tril(np.ones((n, n), bool))


# -- linear transformer --------------------------------------------------------------------------------------

def _elu_plus_one(x):
  x = np.asarray(x)
  return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,chunk", [(1, 4), (11, 4), (12, 3)])
def test_linear_equals_its_quadratic_formula(causal, length, chunk):
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(length, length=length)
    out = linear(q, k, v, causal=causal, mask=mask, chunk_size=chunk)
    assert out.dtype == jnp.float64 and out.shape == v.shape
    ref = _kernel_attention(_elu_plus_one(q), _elu_plus_one(k), v, causal, mask)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)


def _linear_definition(q, k, v, mask, causal):
  """Linear attention from the definition, in jax (for autodiff): [b, n, h, *] in and out."""
  phi_q, phi_k = (jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0))) for x in (q, k))
  kern = jnp.einsum("bihd,bjhd->bhij", phi_q, phi_k) * mask[:, None, None, :]
  if causal:
    kern = kern * jnp.tril(jnp.ones(kern.shape[-2:]))
  return jnp.einsum("bhij,bjhe->bihe", kern, v) / jnp.sum(kern, -1).transpose(0, 2, 1)[..., None]


# Pairs of heads and a ragged causal chunk run with the fast tests, the other layouts with the slow ones.
LINEAR_GRADIENT_CASES = [
    pytest.param(*case, marks=() if case in {(False, 3, 4), (True, 3, 3)} else pytest.mark.slow)
    for case in [(False, 1, 4), (False, 2, 4), (False, 3, 4), (False, 8, 4), (True, 1, 4), (True, 3, 3),
                 (True, 1, 16)]]


@pytest.mark.parametrize("causal,row_chunks,chunk", LINEAR_GRADIENT_CASES)
def test_linear_gradients_equal_the_definitions(causal, row_chunks, chunk):
  """The op's hand-written backwards equal autodiff of the definition: bidirectionally in every block layout
  of batch x heads (one block; whole batches; pairs of heads; single rows), causally with ragged and single
  chunks; a masked key's NaN changes nothing and its k, v get zero gradient."""
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(5, batch=2, length=9, heads=4, head_dim=3, value_dim=2)
    cot = jax.random.normal(jax.random.key(6), v.shape, jnp.float64)
    clean_k, clean_v = (jnp.where(mask[:, :, None, None], x, 0.0) for x in (k, v))
    nan_k, nan_v = (jnp.where(mask[:, :, None, None], x, jnp.nan) for x in (k, v))

    def reference(q, k, v):
      return jnp.sum(_linear_definition(q, k, v, mask, causal) * cot)

    def loss(q, k, v):
      return jnp.sum(linear(q, k, v, causal=causal, mask=mask, row_chunks=row_chunks, chunk_size=chunk) * cot)

    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, clean_k, clean_v)
    got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, nan_k, nan_v)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for g, w in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert not np.any(grads[1][~np.asarray(mask)]) and not np.any(grads[2][~np.asarray(mask)])


def test_elu_feature_map_derivatives_equal_elu():
  """phi' = min(phi, 1) is elu's derivative (1 above zero, exp(x) at or below it, so 1 at zero), and its own
  derivative is elu's second (0 above zero, exp(x) below)."""
  with jax.enable_x64(True):
    x = jnp.array([-30.0, -2.0, -1e-9, 0.0, 1e-9, 0.5, 3.0])
    first = jax.vmap(jax.grad(elu_feature_map))(x)
    np.testing.assert_allclose(first, np.where(x > 0, 1.0, np.exp(x)), rtol=1e-15, atol=0)
    second = jax.vmap(jax.grad(jax.grad(elu_feature_map)))(x)
    np.testing.assert_allclose(second[x != 0], np.where(x > 0, 0.0, np.exp(x))[x != 0], rtol=1e-15, atol=0)


def test_exclusive_prefix_sum_is_exact_and_reads_no_later_slice():
  """out[:, i] = the sum of the slices before i (after i when reversed), for any count of slices; a NaN or
  Inf slice reaches only the outputs after it (before it when reversed), never through a zero weight."""
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 13, 3, 2)))
    forward = np.concatenate([np.zeros_like(x[:, :1]), np.cumsum(x, axis=1)[:, :-1]], axis=1)
    later = np.cumsum(x[:, ::-1], axis=1)[:, ::-1]
    backward = np.concatenate([later[:, 1:], np.zeros_like(x[:, :1])], axis=1)
    np.testing.assert_allclose(exclusive_prefix_sum(x), forward, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(exclusive_prefix_sum(x, reverse=True), backward, rtol=1e-12, atol=1e-12)
    bad = x.at[:, 7, 0, 0].set(jnp.inf).at[:, 7, 1, 1].set(jnp.nan)
    assert np.all(np.isfinite(exclusive_prefix_sum(bad)[:, :8]))
    assert np.all(np.isfinite(exclusive_prefix_sum(bad, reverse=True)[:, 7:]))
    assert np.all(np.isinf(exclusive_prefix_sum(bad)[:, 8:, 0, 0]))


def test_causal_linear_non_finite_value_shows_from_its_position_on():
  """A real key's NaN value: outputs before it are unchanged, outputs from it on are NaN (it is visible)."""
  q, k, v, _ = _inputs(8, batch=1, length=11, heads=1, dtype=jnp.float32)
  out = linear(q, k, v, causal=True, chunk_size=4)
  bad = linear(q, k, v.at[0, 5, 0, 1].set(jnp.nan), causal=True, chunk_size=4)
  np.testing.assert_array_equal(bad[0, :5], out[0, :5])
  assert np.all(np.isnan(bad[0, 5:]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_linear_bidirectional_keeps_input_dtypes(dtype):
  q, k, v, mask = _inputs(3, dtype=dtype)
  out, vjp = jax.vjp(lambda q, k, v: linear(q, k, v, causal=False, mask=mask), q, k, v)
  assert out.dtype == dtype and all(g.dtype == dtype for g in vjp(out))
  want = linear(*(x.astype(jnp.float32) for x in (q, k, v)), causal=False, mask=mask)
  np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-6,
                             atol=2e-2 if dtype == jnp.bfloat16 else 1e-6)


# -- performer -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [3, 64])
def test_performer_equals_its_estimator(causal, chunk):
  """The op's stabilised computation equals the unstabilised FAVOR+ estimator of the definition."""
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(1)
    w = orthogonal_features(jax.random.key(7), 10, 4, jnp.float64)
    out = performer(q, k, v, causal=causal, mask=mask, features=w, chunk_size=chunk)
    scale = 4 ** -0.25
    ref = _kernel_attention(softmax_kernel_features(q * scale, w), softmax_kernel_features(k * scale, w), v,
                            causal, mask)
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-12)


def _google_style(q, k, v, w, causal, eps):
  """FAVOR+ with the feature-map stabilisation of google-research's `performer/fast_attention` (jax), written
  here from its formulas: queries exp(Wq' - |q'|^2/2 - max over features of Wq'), keys exp(Wk' - |k'|^2/2 -
  max over keys and features of Wk'), each plus `eps`, times m^-1/2; causal by a prefix sum over positions."""
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  d, m = q.shape[-1], w.shape[0]
  qs, ks = q * d ** -0.25, k * d ** -0.25
  qd, kd = np.einsum("blhd,md->blhm", qs, w), np.einsum("blhd,md->blhm", ks, w)
  qdiag, kdiag = (0.5 * np.sum(x * x, -1, keepdims=True) for x in (qs, ks))
  phi_q = (np.exp(qd - qdiag - qd.max(-1, keepdims=True)) + eps) / np.sqrt(m)
  phi_k = (np.exp(kd - kdiag - kd.max(axis=(1, 3), keepdims=True)) + eps) / np.sqrt(m)
  if causal:
    kv = np.cumsum(np.einsum("blhm,blhd->blhmd", phi_k, v), axis=1)
    num = np.einsum("blhm,blhmd->blhd", phi_q, kv)
    den = np.einsum("blhm,blhm->blh", phi_q, np.cumsum(phi_k, axis=1))
  else:
    num = np.einsum("blhm,bhmd->blhd", phi_q, np.einsum("blhm,blhd->bhmd", phi_k, v))
    den = np.einsum("blhm,bhm->blh", phi_q, phi_k.sum(1))
  return num / den[..., None]


@pytest.mark.parametrize("causal", [True, False])
def test_performer_agrees_with_the_reference_implementation_formulas(causal):
  with jax.enable_x64(True):
    q, k, v, _ = _inputs(2, length=9)
    w = orthogonal_features(jax.random.key(3), 16, 4, jnp.float64)
    out = performer(q, k, v, causal=causal, features=w)
    np.testing.assert_allclose(out, _google_style(q, k, v, w, causal, eps=0.0), rtol=1e-9, atol=1e-12)
    # Its numerical stabiliser (a small constant added to every feature) moves the output only a little.
    np.testing.assert_allclose(out, _google_style(q, k, v, w, causal, eps=1e-6), atol=1e-3)


def test_orthogonal_features_are_orthogonal_gaussian_rows():
  w = np.asarray(orthogonal_features(jax.random.key(0), 10, 4))
  assert w.shape == (10, 4)
  for block in (w[0:4], w[4:8]):
    gram = block @ block.T
    np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-5)
  with pytest.raises(ValueError, match="num_features"):
    orthogonal_features(jax.random.key(0), 0, 4)


@pytest.mark.slow
def test_performer_kernel_estimate_is_unbiased_and_improves_with_features():
  with jax.enable_x64(True):
    ka, kb = jax.random.split(jax.random.key(5))
    a = 0.4 * jax.random.normal(ka, (5, 8), jnp.float64)
    b = 0.4 * jax.random.normal(kb, (5, 8), jnp.float64)
    exact = np.exp(np.asarray(a) @ np.asarray(b).T)  # [5, 5]

    @functools.partial(jax.jit, static_argnums=1)
    def estimates(keys, m):
      def draw(key):
        w = orthogonal_features(key, m, 8, jnp.float64)
        return softmax_kernel_features(a, w) @ softmax_kernel_features(b, w).T

      return jax.vmap(draw)(keys)  # [draws, 5, 5]

    keys = jax.random.split(jax.random.key(11), 1000)
    errors = []
    for m in (8, 32, 128):
      est = np.asarray(estimates(keys, m))
      mean, sem = est.mean(0), est.std(0) / np.sqrt(est.shape[0])
      assert np.all(np.abs(mean - exact) < 5 * sem + 1e-12)  # unbiased: within 5 standard errors everywhere
      errors.append(np.median(np.abs(est - exact)))  # the median: the estimate's tails are heavy
    assert errors[0] > 1.5 * errors[1] and errors[1] > 1.5 * errors[2]  # falls about as 1/sqrt(m)


@pytest.mark.slow
def test_performer_output_error_falls_with_features():
  q, k, v, mask = _inputs(3, batch=1, length=32, head_dim=8, dtype=jnp.float32, scale=0.5)
  exact = dense(q, k, v, causal=False, mask=mask)
  err = []
  for m in (8, 64, 512):
    outs = [performer(q, k, v, causal=False, mask=mask, rng=jax.random.key(s), num_features=m)
            for s in range(4)]
    err.append(np.mean([float(jnp.mean((o - exact) ** 2)) for o in outs]))
  assert err[0] > err[1] > err[2]


def test_performer_rejects_bad_features():
  q, k, v, _ = _inputs(0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="'rng'"):
    performer(q, k, v, causal=True)
  with pytest.raises(ValueError, match="'features'"):
    performer(q, k, v, causal=True, features=jnp.ones((8, 5)))


# -- local ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,block", [(11, 4), (12, 3), (5, 8)])
def test_local_matches_definition(causal, length, block):
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(length + block, length=length)
    pos = np.arange(length)
    allowed = (pos[:, None] // block) == (pos[None, :] // block)
    if causal:
      allowed &= _causal(length)
    out = local(q, k, v, causal=causal, mask=mask, block_size=block)
    np.testing.assert_allclose(out, _masked_softmax(q, k, v, allowed, mask), rtol=1e-10, atol=1e-12)
    if block >= length:
      np.testing.assert_allclose(out, dense(q, k, v, causal=causal, mask=mask), rtol=1e-10, atol=1e-12)


# -- longformer ----------------------------------------------------------------------------------------------

def _longformer_allowed(length, window, glob, causal):
  pos = np.arange(length)
  allowed = np.abs(pos[:, None] - pos[None, :]) <= window
  glob = np.asarray([g % length for g in glob], int)
  allowed[:, glob] = True
  allowed[glob, :] = True
  if causal:
    allowed &= _causal(length)
  return allowed


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,window,glob",
                         [(11, 2, (0,)), (13, 3, (0, 5, -1)), (9, 1, ()), (10, 4, (3, 7))])
def test_longformer_matches_definition(causal, length, window, glob):
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(length * window, length=length)
    out = longformer(q, k, v, causal=causal, mask=mask, window=window, global_positions=glob)
    ref = _masked_softmax(q, k, v, _longformer_allowed(length, window, glob, causal), mask)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [10, 50])
def test_longformer_with_a_window_covering_everything_is_dense(causal, window):
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(window, length=10)
    out = longformer(q, k, v, causal=causal, mask=mask, window=window, global_positions=(0, 4))
    np.testing.assert_allclose(out, dense(q, k, v, causal=causal, mask=mask), rtol=1e-10, atol=1e-12)


def test_longformer_rejects_bad_arguments():
  q, k, v, _ = _inputs(0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="window"):
    longformer(q, k, v, causal=True, window=0)
  with pytest.raises(ValueError, match="global_positions"):
    longformer(q, k, v, causal=True, global_positions=(11,))
  with pytest.raises(ValueError, match="global_positions"):
    longformer(q, k, v, causal=True, global_positions=("a",))


# -- bigbird -------------------------------------------------------------------------------------------------

def _bigbird_allowed(length, block, allowed_blocks):
  """Token-level pattern from the block pattern: i sees j iff block(i) sees block(j)."""
  blocks = np.arange(length) // block
  return allowed_blocks[blocks[:, None], blocks[None, :]]


def test_bigbird_block_pattern_follows_itc():
  n, r = 12, 2
  for causal in (True, False):
    allowed, is_global = block_pattern(n, causal=causal, global_blocks=(0, -1), num_random_blocks=r, seed=3)
    assert list(np.flatnonzero(is_global)) == [0, n - 1]
    for a in range(n):
      row = np.flatnonzero(allowed[a])
      if causal:
        assert row.max() <= a  # no block after its own
      if is_global[a]:
        assert len(row) == (a + 1 if causal else n)
        continue
      window = set(range(max(a - 1, 0), a + 1 if causal else min(a + 2, n)))
      glob = {0} | (set() if causal else {n - 1})
      rand = set(row) - window - glob
      assert window | glob <= set(row) | ({n - 1} if causal else set())
      candidates = set(range(a) if causal else range(n)) - window - glob
      assert len(rand) == min(r, len(candidates))
  # The pattern is a pure function of the seed.
  a1, _ = block_pattern(n, causal=False, global_blocks=(0,), num_random_blocks=r, seed=1)
  a2, _ = block_pattern(n, causal=False, global_blocks=(0,), num_random_blocks=r, seed=1)
  a3, _ = block_pattern(n, causal=False, global_blocks=(0,), num_random_blocks=r, seed=2)
  assert np.array_equal(a1, a2) and not np.array_equal(a1, a3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,block,glob,r", [(22, 2, (0, -1), 2), (13, 3, (1,), 1), (16, 2, (), 3)])
def test_bigbird_matches_definition(causal, length, block, glob, r):
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(length + r, length=length)
    out = bigbird(q, k, v, causal=causal, mask=mask, block_size=block, global_blocks=glob,
                  num_random_blocks=r, seed=4)
    allowed_blocks, _ = block_pattern(-(-length // block), causal=causal, global_blocks=glob,
                                      num_random_blocks=r, seed=4)
    allowed = _bigbird_allowed(length, block, allowed_blocks)
    if causal:
      allowed &= _causal(length)
    np.testing.assert_allclose(out, _masked_softmax(q, k, v, allowed, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird_with_every_block_global_is_dense(causal):
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(9, length=11)
    out = bigbird(q, k, v, causal=causal, mask=mask, block_size=3, global_blocks=(0, 1, 2, 3),
                  num_random_blocks=1)
    np.testing.assert_allclose(out, dense(q, k, v, causal=causal, mask=mask), rtol=1e-10, atol=1e-12)


def test_bigbird_rejects_bad_arguments():
  q, k, v, _ = _inputs(0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="block_size"):
    bigbird(q, k, v, causal=True, block_size=0)
  with pytest.raises(ValueError, match="num_random_blocks"):
    bigbird(q, k, v, causal=True, num_random_blocks=-1)
  with pytest.raises(ValueError, match="global_blocks"):
    bigbird(q, k, v, causal=True, block_size=4, global_blocks=(3,))


# -- none ----------------------------------------------------------------------------------------------------

def test_none_is_zero():
  q, k, v, mask = _inputs(0, dtype=jnp.float32)
  out = none(q, k, v, causal=True, mask=mask)
  assert out.shape == v.shape and out.dtype == v.dtype and not np.any(np.asarray(out))


# -- properties shared by every op ---------------------------------------------------------------------------

OPS = {
    "performer": dict(features=orthogonal_features(jax.random.key(0), 6, 4), chunk_size=3),
    "linear": dict(chunk_size=3),
    "local": dict(block_size=3),
    "longformer": dict(window=2, global_positions=(0, 6)),
    "bigbird": dict(block_size=2, num_random_blocks=1),
    "none": {},
}


# BigBird's and Longformer's compiles are the slowest of these: their cases run with the slow tests.
SLOW_LAST = [pytest.param(n, marks=pytest.mark.slow) if n in ("bigbird", "longformer") else n
             for n in sorted(OPS)]


@pytest.mark.parametrize("name", SLOW_LAST)
def test_causal_outputs_do_not_depend_on_the_future(name):
  fn = functools.partial(ops_registry.get(name).fn, causal=True, **OPS[name])
  q, k, v, _ = _inputs(1, batch=1, length=9, dtype=jnp.float32)
  # reverse mode: the Jacobian through the backward the ops train with (some are hand-written)
  jac = jax.jacrev(lambda q, k, v: fn(q, k, v), argnums=(0, 1, 2))(q, k, v)  # each [1, 9, h, dv, 1, 9, h, d]
  future = np.triu(np.ones((9, 9), bool), 1)  # [output position, input position]
  for j in jac:
    j = np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7))  # [output position, input position]
    assert np.all(j[future] == 0.0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", SLOW_LAST)
def test_masked_keys_holding_nan_change_nothing(name, causal):
  fn = functools.partial(ops_registry.get(name).fn, causal=causal, **OPS[name])
  q, k, v, mask = _inputs(2, length=10, dtype=jnp.float32)
  bad = ~mask[:, :, None, None]
  out = fn(q, k, v, mask=mask)
  poisoned = fn(q, jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v), mask=mask)
  np.testing.assert_allclose(poisoned, out, rtol=1e-6, atol=1e-6)
  grads = jax.grad(lambda k, v: jnp.sum(fn(q, k, v, mask=mask) ** 2), argnums=(0, 1))(
      jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
    assert not np.any(np.asarray(g)[np.asarray(bad[..., 0, 0])])  # masked keys get zero gradient


# Ops that skip their masking work when given no mask; one case with the fast tests.
NO_MASK_FAST = {("linear", True)}
NO_MASK_CASES = [pytest.param(name, causal, marks=() if (name, causal) in NO_MASK_FAST else pytest.mark.slow)
                 for name in ("linear", "local", "performer") for causal in (True, False)]


@pytest.mark.parametrize("name,causal", NO_MASK_CASES)
def test_no_mask_equals_an_all_real_mask(name, causal):
  """Without a mask the op skips its selects: outputs and gradients equal those under an all-True mask, in
  float64, with a ragged last chunk or block."""
  fn = functools.partial(ops_registry.get(name).fn, causal=causal, **OPS[name])
  with jax.enable_x64(True):
    q, k, v, _ = _inputs(9, length=10)
    cot = jax.random.normal(jax.random.key(10), v.shape, jnp.float64)

    def run(mask):
      loss = lambda q, k, v: jnp.sum(fn(q, k, v, mask=mask) * cot)  # noqa: E731
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    want, want_grads = run(jnp.ones(q.shape[:2], bool))
    got, grads = run(None)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for g, w in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("name", sorted(OPS))
def test_registered_ops_run_at_their_automatic_parameters(name):
  spec = ops_registry.get(name)
  q, k, v, mask = _inputs(4, batch=1, length=37, head_dim=8, dtype=jnp.bfloat16)
  for causal in (True, False):
    out = spec.fn(q, k, v, causal=causal, mask=mask, **ops_registry.bench_params(spec, 37))
    assert out.shape == v.shape and out.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


# -- model modules -------------------------------------------------------------------------------------------

def _module(name, layer=None, **fields):
  from flax import nnx

  from configs import base
  from models import registry

  cfg = base.attention_config(name)
  for key, value in fields.items():
    cfg[key] = value
  return registry.build(cfg, layer=layer, features=8, num_heads=2, head_dim=4, causal=True,
                        dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_performer_module_redraws_its_features_on_schedule():
  m = _module("performer", redraw_every=2)
  x = jax.random.normal(jax.random.key(0), (1, 5, 8))
  first = np.asarray(m.random_features[...])
  assert first.shape == (256, 4)
  m(x, None, deterministic=True)  # evaluation never redraws
  assert np.array_equal(np.asarray(m.random_features[...]), first)
  m(x, None, deterministic=False)  # step 0: keeps the initial draw
  m(x, None, deterministic=False)  # step 1
  assert np.array_equal(np.asarray(m.random_features[...]), first)
  m(x, None, deterministic=False)  # step 2: redrawn
  assert not np.array_equal(np.asarray(m.random_features[...]), first)
  with pytest.raises(ValueError, match="redraw_every"):
    _module("performer", redraw_every=-1)


def test_bigbird_module_draws_one_pattern_per_layer():
  assert _module("bigbird", layer=3).plan_params["seed"] == 3
  assert _module("bigbird", layer=None).plan_params["seed"] == 0
