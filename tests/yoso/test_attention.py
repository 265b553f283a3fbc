"""YOSO attention: hashing statistics, convergence to YOSO-E, the custom backward, masking and bad arguments.

Statistical checks are seeded and compare against the Monte-Carlo standard error they measure themselves, with
margins (>= 6 standard errors) that a correct implementation passes for any seed, while a wrong expectation
(an off-by-one tau, a dropped hash, a biased backward) misses by tens of standard errors.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core import contract
from yoso import hashing
from yoso.attention import l2_normalize, yoso, yoso_c, yoso_e
from yoso.collision import arccos_poly, expected_collision


def _key(seed):
  # RBG keys compile in a fraction of threefry's time; the op treats every key impl alike.
  return jax.random.key(seed, impl="rbg")


def _inputs(seed, b=1, length=10, h=2, d=8, e=5, dtype=jnp.float64):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, length, h, d))
  # Keys correlated with queries give a spread of collision probabilities (not all near 2^-tau).
  k = q + 0.8 * rng.normal(size=(b, length, h, d))
  v = rng.normal(size=(b, length, h, e))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _surrogate(q, k, v, mask, tau, causal=False):
  """From the definition: P V on normalised q, k, where dP/d(q.k) is replaced by (tau/2) P (paper eq. 4);
  P_ij = 0 for j > i when causal."""
  qn, kn = l2_normalize(q), l2_normalize(k)
  cos = jnp.einsum("bqhd,bkhd->bhqk", qn, kn)

  @jax.custom_jvp
  def prob(c):
    return (1 - jnp.arccos(c) / np.pi) ** tau

  @prob.defjvp
  def _(primals, tangents):
    p = prob(primals[0])
    return p, (tau / 2) * p * tangents[0]

  length = q.shape[1]
  visible = mask[:, None, None, :] & (np.tri(length, dtype=bool) if causal else True)
  p = jnp.where(visible, prob(cos), 0.0)
  return jnp.einsum("bhqk,bkhe->bqhe", p, v)


def _reference_yoso_e(q, k, v, mask, tau, normalize, causal=False):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros(v.shape)
  for bi in range(q.shape[0]):
    for hi in range(q.shape[2]):
      qn = q[bi, :, hi] / np.linalg.norm(q[bi, :, hi], axis=-1, keepdims=True)
      kn = k[bi, :, hi] / np.linalg.norm(k[bi, :, hi], axis=-1, keepdims=True)
      p = (1 - np.arccos(np.clip(qn @ kn.T, -1, 1)) / np.pi) ** tau * np.asarray(mask[bi])[None, :]
      if causal:
        p = np.tril(p)
      y = p @ v[bi, :, hi]
      out[bi, :, hi] = y / np.linalg.norm(y, axis=-1, keepdims=True) if normalize else y
  return out


# ----------------------------------------------------------------------------------------------- hashing


def test_hadamard_matches_sylvester_matrix():
  with jax.enable_x64(True):
    hmat = np.array([[1.0]])
    for n in (2, 4, 8, 16, 32, 64):  # 32 and 64 use two Kronecker factors
      hmat = np.block([[hmat, hmat], [hmat, -hmat]])
      x = jnp.asarray(np.random.default_rng(n).normal(size=(3, n)))
      np.testing.assert_allclose(hashing.hadamard(x), np.asarray(x) @ hmat.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method,rel_tol", [("gaussian", None), ("fast", 0.25)])
def test_collision_rate_matches_hyperplane_probability(method, rel_tol):
  # Pairs of unit vectors at known angles in d = 64; each hash of each draw is one Bernoulli sample.
  d, tau, m, draws = 64, 6, 32, 300
  rng = np.random.default_rng(0)
  thetas = np.array([0.2, 0.6, 1.0, 1.6, 2.4])
  x = rng.normal(size=(len(thetas), d))
  x /= np.linalg.norm(x, axis=-1, keepdims=True)
  u = rng.normal(size=(len(thetas), d))
  u -= np.sum(u * x, -1, keepdims=True) * x
  u /= np.linalg.norm(u, axis=-1, keepdims=True)
  y = np.cos(thetas)[:, None] * x + np.sin(thetas)[:, None] * u
  pairs = jnp.asarray(np.stack([x, y]), jnp.float32)[:, None]  # [2, heads=1, pairs, d]
  codes = jax.jit(jax.vmap(lambda r: hashing.hash_codes(pairs, r, num_hashes=m, tau=tau, method=method)))(
      jax.random.split(_key(1), draws))  # [draws, 2, 1, pairs, m]
  assert codes.dtype == jnp.int32 and int(codes.min()) >= 0 and int(codes.max()) < 2**tau
  rate = np.asarray(jnp.mean(codes[:, 0] == codes[:, 1], axis=(0, 1, 3)))
  expected = (1 - thetas / np.pi) ** tau
  if rel_tol is None:  # independent hyperplanes: exact in expectation, binomial standard error
    se = np.sqrt(expected * (1 - expected) / (draws * m))
    np.testing.assert_array_less(np.abs(rate - expected), 6 * se + 1e-4)
  else:  # orthogonal rotated coordinates: close, not exact
    np.testing.assert_allclose(rate, expected, rtol=rel_tol, atol=2e-3)


def test_hash_functions_depend_only_on_rng_and_head():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3, 8)), jnp.float32)

  @jax.jit
  def codes(x, r):
    return [hashing.hash_codes(x, r, num_hashes=4, tau=5, method=m) for m in ("gaussian", "fast")]

  # x: [batch, heads, length, dim]; functions are shared over batch and length, drawn per head.
  a, b, c = codes(x, _key(7)), codes(x[1:, :, 2:], _key(7)), codes(x, _key(8))
  for same, part, other in zip(a, b, c, strict=True):
    np.testing.assert_array_equal(same[1:, :, 2:], part)
    assert np.mean(np.asarray(same) != np.asarray(other)) > 0.5


# ----------------------------------------------------------------------------------------------- forward


def test_yoso_e_matches_definition():
  with jax.enable_x64(True):
    q, k, v = _inputs(0, b=2, length=7)
    mask = jnp.ones((2, 7), bool).at[1, 2:4].set(False)
    for normalize in (True, False):
      out = yoso_e(q, k, v, tau=3, mask=mask, normalize_output=normalize)
      assert out.dtype == jnp.float64
      np.testing.assert_allclose(out, _reference_yoso_e(q, k, v, mask, 3, normalize), rtol=1e-10, atol=1e-12)


def test_sampled_mean_converges_to_yoso_e_and_variance_falls_as_one_over_m():
  with jax.enable_x64(True):
    q, k, v = _inputs(1)
    mask = jnp.ones((1, 10), bool).at[0, 6].set(False)
    tau, draws = 3, 400
    expect = yoso_e(q, k, v, tau=tau, mask=mask, normalize_output=False)
    total_var = {}
    for m in (4, 16):
      f = jax.jit(jax.vmap(lambda r, m=m: yoso(q, k, v, rng=r, num_hashes=m, tau=tau, mask=mask,
                                               normalize_output=False)))
      samples = f(jax.random.split(_key(m), draws))  # [draws, b, L, h, e]
      mean, std = samples.mean(0), samples.std(0)
      np.testing.assert_array_less(np.abs(mean - expect), 6 * std / np.sqrt(draws) + 1e-9)
      total_var[m] = float(jnp.sum(std**2))
    # Hashes are independent, so the total variance falls as 1/m: ratio 4 for m = 4 -> 16.
    assert 2.8 < total_var[4] / total_var[16] < 5.5, total_var
    # An off-by-one tau is many standard errors away: the check above can fail.
    wrong = yoso_e(q, k, v, tau=tau + 1, mask=mask, normalize_output=False)
    assert float(jnp.max(jnp.abs(wrong - expect) / (std / np.sqrt(draws) + 1e-9))) > 20


def test_normalized_output_is_the_unit_row_of_the_raw_output():
  with jax.enable_x64(True):
    q, k, v = _inputs(2, length=9)
    f = jax.jit(lambda r: (yoso(q, k, v, rng=r, num_hashes=8, tau=2, normalize_output=False),
                           yoso(q, k, v, rng=r, num_hashes=8, tau=2)))
    raw, out = f(_key(3))
    norms = np.linalg.norm(np.asarray(raw), axis=-1, keepdims=True)
    assert np.all(norms > 1e-3)
    np.testing.assert_allclose(out, np.asarray(raw) / norms, rtol=1e-12)


@pytest.mark.parametrize("path", ["counts", "tables"])
def test_masked_keys_contribute_nothing_and_padding_is_invariant(path, monkeypatch):
  from yoso import backward as ya
  if path == "tables":  # short sequences take dense collision counts unless the threshold is lowered
    monkeypatch.setattr(ya, "COUNTS_MAX_LENGTH", 0)
  with jax.enable_x64(True):
    q, k, v = _inputs(4, length=8)
    mask = jnp.array([[True, True, False, True, True, False, True, False]])
    real = np.flatnonzero(np.asarray(mask[0]))
    junk = jnp.asarray(np.random.default_rng(9).normal(size=q.shape)) * 100
    k2 = jnp.where(mask[..., None, None], k, junk)
    v2 = jnp.where(mask[..., None, None], v, junk[..., :5])
    rng = _key(5)
    kwargs = dict(rng=rng, num_hashes=16, tau=2)
    f = jax.jit(lambda q, k, v, mask: yoso(q, k, v, mask=mask, **kwargs))
    out = f(q, k, v, mask)
    np.testing.assert_array_equal(out, f(q, k2, v2, mask))
    # Same as the sequence with the masked positions removed (hash functions do not depend on length).
    short = f(q[:, real], k[:, real], v[:, real], mask[:, real])
    np.testing.assert_allclose(out[:, real], short, rtol=1e-12, atol=1e-14)
    # And no gradient reaches masked keys or values.
    grads = jax.jit(jax.grad(lambda kk, vv: jnp.sum(f(q, kk, vv, mask) ** 3), argnums=(0, 1)))(k, v)
    for g in grads:
      assert np.all(np.asarray(g)[:, ~np.asarray(mask[0])] == 0)
      assert np.any(np.asarray(g)[:, real] != 0)


def test_finite_for_zero_vectors_and_fully_padded_rows():
  q, k, v = _inputs(5, b=2, length=6, dtype=jnp.float32)
  q = q.at[0, 1].set(0.0)
  k = k.at[0, 2].set(0.0)
  v = v.at[0, 3].set(0.0)
  mask = jnp.ones((2, 6), bool).at[1].set(False)  # a batch row with no real key at all
  fns = (lambda q, k, v: yoso(q, k, v, rng=_key(0), num_hashes=4, tau=4, mask=mask),
         lambda q, k, v: yoso_e(q, k, v, tau=4, mask=mask),
         lambda q, k, v: yoso(q, q, v, rng=_key(0), num_hashes=4, tau=4, backward="dense"))

  @jax.jit
  def all_grads(q, k, v):
    return [jax.value_and_grad(lambda *a, fn=fn: jnp.sum(fn(*a) * v), argnums=(0, 1, 2))(q, k, v)
            for fn in fns]

  for out, grads in all_grads(q, k, v):
    assert np.isfinite(out)
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g)))


def test_dtype_jit_length_one_and_key_kinds():
  q, k, v = _inputs(6, length=5, dtype=jnp.bfloat16)

  @jax.jit
  def run(q, k, v):
    return (yoso(q, k, v, rng=jax.random.key(0), num_hashes=4, tau=3, hash="fast"),
            yoso_e(q, k, v, tau=3),
            yoso(q[:, :1], k[:, :1], v[:, :1], rng=_key(0), num_hashes=3, tau=2),
            # Old-style uint32 keys are accepted and equal to the typed key with the same data.
            yoso(q, k, v, rng=jax.random.PRNGKey(0), num_hashes=4, tau=3, hash="fast"))

  out, expect, one, old = run(q, k, v)
  assert out.dtype == jnp.bfloat16 and out.shape == v.shape and expect.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(one, np.float32)))
  np.testing.assert_array_equal(np.asarray(old, np.float32), np.asarray(out, np.float32))


# ----------------------------------------------------------------------------------------------- backward


def _grads(fn, q, k, v):
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * jnp.cos(jnp.arange(v.shape[-1]))), argnums=(0, 1, 2))(
      q, k, v)


@pytest.mark.parametrize("normalize", [pytest.param(False, marks=pytest.mark.slow), True])  # one fast
def test_dense_backward_matches_surrogate_exactly(normalize):
  with jax.enable_x64(True):
    q, k, v = _inputs(7, b=2, length=6)
    mask = jnp.ones((2, 6), bool).at[0, 4].set(False)
    rng = _key(11)
    sampled = yoso(q, k, v, rng=rng, num_hashes=5, tau=3, mask=mask, normalize_output=False)

    def reference(q, k, v):
      # The sampled forward value with the surrogate's gradient, then (maybe) the l2 normalisation.
      s = _surrogate(q, k, v, mask, 3)
      y = jax.lax.stop_gradient(sampled) + s - jax.lax.stop_gradient(s)
      return l2_normalize(y) if normalize else y

    got = _grads(lambda q, k, v: yoso(q, k, v, rng=rng, num_hashes=5, tau=3, mask=mask, backward="dense",
                                      normalize_output=normalize), q, k, v)
    want = _grads(reference, q, k, v)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("features", [None, 1, pytest.param(3, marks=pytest.mark.slow)])
def test_sampled_backward_is_unbiased_for_surrogate_gradient(features):
  # The forward's codes are re-used; dV is exact in expectation, dQ/dK too (features=1, 3: unbiased sketches
  # through the segment-sum and the chunked implementation).
  with jax.enable_x64(True):
    q, k, v = _inputs(8, length=8, e=4)
    mask = jnp.ones((1, 8), bool).at[0, 5].set(False)
    tau, m, draws = 3, 8, 300
    want = _grads(lambda q, k, v: _surrogate(q, k, v, mask, tau), q, k, v)
    one = jax.jit(jax.vmap(lambda r: _grads(
        lambda q, k, v: yoso(q, k, v, rng=r, num_hashes=m, tau=tau, mask=mask, normalize_output=False,
                             backward_features=features), q, k, v)))
    got = one(jax.random.split(_key(12), draws))
    for name, g, w in zip("qkv", got, want, strict=True):
      mean, se = g.mean(0), g.std(0) / np.sqrt(draws)
      err = np.abs(np.asarray(mean - w))
      assert np.all(err < 6 * se + 1e-9), (name, float(np.max(err / (se + 1e-9))))
      # Not vacuous: the noise is small next to the gradient itself.
      assert float(jnp.max(se)) < 0.2 * float(jnp.max(jnp.abs(w))), name


@pytest.mark.parametrize("path", ["counts", "tables"])
def test_sampled_backward_matches_definition_with_forward_codes(path, monkeypatch):
  # From the definition with the forward's own codes (B^t per hash t), exact for backward_features=None:
  # dV_j = 1/m sum_t,i B_ij dY_i, dQn_i = (tau/2)/m sum_t,j B_ij (dY_i.v_j) kn_j, dKn_j likewise; then the
  # normalisations of q and k by autodiff. Re-hashing in the backward (another rng) would not match. Short
  # sequences take dense collision counts; the LSH tables are forced by lowering the threshold.
  from yoso import backward as ya
  if path == "tables":
    monkeypatch.setattr(ya, "COUNTS_MAX_LENGTH", 0)
  with jax.enable_x64(True):
    q, k, v = _inputs(9, b=2, length=7)
    mask = jnp.ones((2, 7), bool).at[1, 3].set(False)
    rng, tau, m = _key(2), 2, 6
    def fn(q, k, v):
      return yoso(q, k, v, rng=rng, num_hashes=m, tau=tau, mask=mask, normalize_output=False,
                  backward_features=None)

    got = jax.jit(lambda q, k, v: _grads(fn, q, k, v))(q, k, v)
    hash_rng = jax.random.split(rng)[0]
    qn, kn = l2_normalize(q), l2_normalize(k)
    def heads_major(x):  # hashing takes [batch, heads, length, dim]
      return jnp.swapaxes(x, 1, 2)

    qc = np.asarray(heads_major(hashing.hash_codes(heads_major(qn), hash_rng, num_hashes=m, tau=tau)))
    kc = np.asarray(heads_major(hashing.hash_codes(heads_major(kn), hash_rng, num_hashes=m, tau=tau)))
    bmat = (qc[:, :, None] == kc[:, None, :]) * np.asarray(mask)[:, None, :, None, None]  # [b, Lq, Lk, h, m]
    bmat = bmat.mean(-1)
    np.testing.assert_allclose(fn(q, k, v), np.einsum("bqkh,bkhe->bqhe", bmat, v), rtol=1e-12, atol=1e-12)
    dy = np.broadcast_to(np.cos(np.arange(v.shape[-1])), v.shape)
    w = bmat * np.einsum("bqhe,bkhe->bqkh", dy, v)  # B_ij (dY_i . v_j)
    dqn = (tau / 2) * np.einsum("bqkh,bkhd->bqhd", w, kn)
    dkn = (tau / 2) * np.einsum("bqkh,bqhd->bkhd", w, qn)
    np.testing.assert_allclose(got[2], np.einsum("bqkh,bqhe->bkhe", bmat, dy), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[0], jax.vjp(l2_normalize, q)[1](dqn)[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], jax.vjp(l2_normalize, k)[1](dkn)[0], rtol=1e-10, atol=1e-12)


def test_polynomial_arccos_and_collision_derivative_are_float32_exact():
  @jax.jit  # one compile per dtype (eager, every primitive of the polynomial compiles on its own)
  def pieces(x, c):
    grad = jax.grad(lambda c: jnp.sum(expected_collision(c, 8)))(c)  # elementwise: the derivative
    return arccos_poly(x), expected_collision(c, 8), grad

  with jax.enable_x64(True):
    x = np.concatenate([np.linspace(-1.0, 1.0, 20001), [-1.0, -0.0, 0.0, 1.0]])
    c = np.linspace(-0.999, 0.999, 4001)
    acos, p64, g64 = pieces(x, c)
    assert np.max(np.abs(np.asarray(acos) - np.arccos(x))) <= 3e-8  # A&S 4.4.46 bound 2e-8, plus rounding
    # float32 takes the polynomial, float64 jnp.arccos: values and derivatives agree to float32 accuracy.
    _, p32, g32 = pieces(x.astype(np.float32), c.astype(np.float32))
    assert p32.dtype == g32.dtype == jnp.float32
    np.testing.assert_allclose(p32, p64, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-6)
    want = 8 * (1 - np.arccos(c) / np.pi) ** 7 / (np.pi * np.sqrt(1 - c**2))
    np.testing.assert_allclose(g64, want, rtol=1e-12)


def _feature_tables_by_definition(qc, kc, kvalid, qn, kn, v, dy, directions):
  """sum_t sum_j B^t_ij (dY_i R_t . v_j R_t) k_j and its dK twin, pair by pair (R_t = I when directions is
  None); numpy, [g, L, ...] groups as in yoso.tables._feature_tables."""
  qc, kc, kvalid, qn, kn, v, dy = map(np.asarray, (qc, kc, kvalid, qn, kn, v, dy))
  g, length, m = qc.shape
  dq, dk = np.zeros_like(qn), np.zeros_like(kn)
  for t in range(m):
    collide = (qc[:, :, None, t] == kc[:, None, :, t]) & kvalid[:, None, :]  # [g, L_q, L_k]
    if directions is None:
      weight = np.einsum("gie,gje->gij", dy, v)
    else:
      r = np.asarray(directions)[t]  # [g, e, s]
      weight = np.einsum("gie,ges,gjf,gfs->gij", dy, r, v, r)
    w = np.where(collide, weight, 0.0)
    dq += np.einsum("gij,gjd->gid", w, kn)
    dk += np.einsum("gij,gid->gjd", w, qn)
  return dq, dk


@pytest.mark.parametrize("form,sketch", [("chunks", None), ("chunks", 3), ("segments", 1), ("segments", 2),
                                         ("onehot", None), ("onehot", 3)])
def test_backward_feature_tables_match_their_definition(form, sketch):
  # Every implementation against the sum over colliding pairs: the bucket-sorted chunked matmuls (lengths
  # give chunks of 2 and 16), the narrow sketch's segment sums, which also carry dV, and the one-hot matmuls.
  from yoso import tables as ya
  tables = jax.jit({"chunks": ya._feature_tables, "segments": ya._sketched_tables,
                    "onehot": ya._onehot_feature_tables}[form], static_argnums=7)
  with jax.enable_x64(True):
    for length, tau, m in ((10, 3, 3), (300, 4, 3)):
      rng = np.random.default_rng(length)
      g, d, e, nb = 3, 8, 5, 1 << tau
      qn, kn = (jnp.asarray(rng.normal(size=(g, length, d))) for _ in range(2))
      v, dy = (jnp.asarray(rng.normal(size=(g, length, e))) for _ in range(2))
      qc, kc = (jnp.asarray(rng.integers(0, nb, size=(g, length, m)), jnp.int32) for _ in range(2))
      kvalid = jnp.asarray(rng.random((g, length)) > 0.3)
      directions = None if sketch is None else jnp.asarray(rng.normal(size=(m, g, e, sketch)))
      dq, dk, *dv = tables(qc, kc, kvalid, qn, kn, v, dy, nb, directions)
      want_dq, want_dk = _feature_tables_by_definition(qc, kc, kvalid, qn, kn, v, dy, directions)
      np.testing.assert_allclose(dq, want_dq, rtol=1e-10, atol=1e-12)
      real = np.asarray(kvalid)[..., None]
      np.testing.assert_allclose(np.where(real, dk, 0.0), want_dk, rtol=1e-10, atol=1e-12)
      if form != "segments":
        assert not np.any(np.asarray(dk)[~np.asarray(kvalid)])  # masked keys read an empty bucket
      else:  # dV_j = sum_t sum_i B^t_ij dY_i for every key (the caller zeroes masked keys)
        collide = np.asarray(qc)[:, :, None] == np.asarray(kc)[:, None, :]  # [g, L_q, L_k, m]
        want_dv = np.einsum("gijt,gie->gje", collide, np.asarray(dy))
        np.testing.assert_allclose(dv[0], want_dv, rtol=1e-10, atol=1e-12)


def test_formulation_follows_the_backend(monkeypatch):
  from yoso import tables as ya
  assert [ya.resolve_formulation("auto", p) for p in ("cpu", "gpu", "tpu")] == ["sorted", "pallas", "pallas"]
  assert ya.resolve_formulation("sorted", "tpu") == "sorted"
  assert ya.resolve_formulation("onehot", "cpu") == "onehot"
  used = []
  real = ya._pallas_cumulate
  monkeypatch.setattr(ya, "_pallas_cumulate", lambda *a: used.append(1) or real(*a))
  q, k, v = _inputs(3, length=5, dtype=jnp.float32)
  args = dict(rng=_key(0), num_hashes=2, tau=3)
  yoso(q, k, v, **args)
  assert not used
  monkeypatch.setattr(contract, "backend", lambda: "gpu")
  yoso(q, k, v, **args)  # the kernels, interpreted on this CPU
  assert used


@contextlib.contextmanager
def _interpreted(platform):
  """Yields (dtype, tolerance) for a kernel test: float64 in the generic Pallas interpreter (None, exact), or
  float32 with the TPU branch in the TPU interpreter (no float64 there: float32 operands, split in two
  bfloat16 parts, give about 2^-16), which also checks that the kernel made no race."""
  from attention_core import pallas
  if platform is None:
    with jax.enable_x64(True):
      yield np.float64, 1e-12
    return
  with pallas.simulate(platform, detect_races=True):
    yield np.float32, 1e-4
  assert not pallas.races_found()


def _close(got, want, tol):
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.max(np.abs(want))))


@pytest.mark.parametrize("length,platform", [(1, None), (130, None), (130, "tpu")])
def test_kernels_equal_the_table_sums(length, platform, monkeypatch):
  # build sums (weighted) rows per bucket, read sums (weighted) table rows over hashes, codes >= buckets
  # write and read nothing; two row sets share one one-hot; a length past one tile pads. On TPU the build
  # walks its rows in chunks and the read takes its hashes one per chunk (partial sums, summed after).
  from attention_core import pallas
  from yoso import kernels
  monkeypatch.setattr(kernels, "BUILD_ROWS", 128)
  monkeypatch.setattr(kernels, "READ_TABLES_VMEM", 1)
  rng = np.random.default_rng(length)
  g, m, buckets = 2, 3, 8
  wcodes = rng.integers(0, buckets + 1, size=(g, m, length)).astype(np.int32)  # buckets: no bucket
  rcodes = rng.integers(0, buckets + 1, size=(g, m, length)).astype(np.int32)
  rows_a, rows_b = rng.normal(size=(g, length, 5)), rng.normal(size=(g, length, 3))
  w_build, w_read = rng.normal(size=(g, m, length)), rng.normal(size=(g, m, length))
  onehot_w = (wcodes[..., None] == np.arange(buckets)).astype(float)  # [g, m, L, B]
  onehot_r = (rcodes[..., None] == np.arange(buckets)).astype(float)
  want_a = np.einsum("gmlc,gle->gmce", onehot_w, rows_a)
  want_b = np.einsum("gmlc,gml,gle->gmce", onehot_w, w_build, rows_b)

  with _interpreted(platform) as (dtype, tol):
    tables = kernels.build(jnp.asarray(wcodes), [jnp.asarray(rows_a, dtype), jnp.asarray(rows_b, dtype)],
                           jnp.asarray(w_build, dtype), [False, True], buckets=buckets, operands="float32")
    assert platform is None or not pallas.races_found()  # the detector's state is the last kernel's
    outs = kernels.read(jnp.asarray(rcodes), [jnp.asarray(want_a, dtype), jnp.asarray(want_b, dtype)],
                        jnp.asarray(w_read, dtype), [True, False], operands="float32")
  _close(tables[0], want_a, tol)
  _close(tables[1], want_b, tol)
  _close(outs[0], np.einsum("gmlc,gml,gmce->gle", onehot_r, w_read, want_a), tol)
  _close(outs[1], np.einsum("gmlc,gmce->gle", onehot_r, want_b), tol)


@pytest.mark.parametrize("la,lb,codes,platform", [
    (300, 260, 3, None), (300, 260, 3, "tpu"),
    pytest.param(130, 5, 40, None, marks=pytest.mark.slow),
    pytest.param(130, 5, 40, "tpu", marks=pytest.mark.slow),
    pytest.param(1, 1, 1, None, marks=pytest.mark.slow)])
def test_pair_sums_equal_the_colliding_pairs(la, lb, codes, platform):
  # out_a = sum_b [code_a = code_b] (x_a . y_b) z_b over code-sorted rows, with runs of one code across
  # several tiles (3 codes), codes the other side lacks (40 codes, 5 rows), a ragged tile. On TPU the kernel
  # copies its range's tiles from HBM itself, into two slots.
  from yoso import kernels
  rng = np.random.default_rng(la + lb)
  a_codes = np.sort(rng.integers(0, codes, size=(2, la)), axis=1).astype(np.int32)
  b_codes = np.sort(rng.integers(0, codes, size=(2, lb)), axis=1).astype(np.int32)
  x, y, z = rng.normal(size=(2, la, 5)), rng.normal(size=(2, lb, 5)), rng.normal(size=(2, lb, 3))
  want = np.einsum("gab,gae,gbe,gbd->gad", a_codes[:, :, None] == b_codes[:, None, :], x, y, z)
  with _interpreted(platform) as (dtype, tol):
    got = kernels.pair_sums(jnp.asarray(a_codes), jnp.asarray(x, dtype), jnp.asarray(b_codes),
                            jnp.asarray(y, dtype), jnp.asarray(z, dtype), operands="float32")
  _close(got, want, tol)


def test_kernel_operands_split_float32_in_two_bfloat16_parts():
  # float32 rows and weights go to the matmuls as hi + lo bfloat16 parts: relative error near 2^-16, far
  # below bfloat16's 2^-8, which the "bfloat16" operands give.
  from yoso import kernels
  rng = np.random.default_rng(0)
  codes = jnp.asarray(rng.integers(0, 4, size=(1, 2, 200)), jnp.int32)
  rows = jnp.asarray(rng.normal(size=(1, 200, 16)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(1, 2, 200)), jnp.float32)
  want = np.einsum("gmlc,gml,gle->gmce", np.asarray(codes)[..., None] == np.arange(4), np.asarray(weights),
                   np.asarray(rows, np.float64))
  errors = {}
  for operands in kernels.OPERANDS:
    (table,) = kernels.build(codes, [rows], weights, buckets=4, operands=operands)
    errors[operands] = float(np.max(np.abs(np.asarray(table) - want)) / np.max(np.abs(want)))
  assert errors["float32"] < 1e-5 < 1e-3 < errors["bfloat16"] < 2e-2, errors


# The fast run keeps one formulation with features; the others run with -m slow.
@pytest.mark.parametrize("formulation,features", [pytest.param("onehot", None, marks=pytest.mark.slow),
                                                  pytest.param("onehot", 2, marks=pytest.mark.slow),
                                                  pytest.param("pallas", None, marks=pytest.mark.slow),
                                                  pytest.param("pallas", 2, marks=pytest.mark.slow)])
def test_formulations_agree_on_the_same_draws(formulation, features, monkeypatch):
  # Sorted tables, one-hot matmuls and the fused kernels: the same codes, so the same estimate and gradients
  # up to float32 rounding (float32 operands go to the matmuls as two bfloat16 parts: relative error near
  # 2^-16).
  from yoso import backward as ya
  monkeypatch.setattr(ya, "COUNTS_MAX_LENGTH", 0)  # the LSH tables, not the short-sequence counts
  q, k, v = _inputs(4, b=2, length=40, d=8, e=6, dtype=jnp.float32)
  mask = jnp.ones((2, 40), bool).at[1, 30:].set(False)
  v = v.at[1, 33].set(jnp.nan)  # behind the mask: reaches nothing
  cot = jnp.asarray(np.random.default_rng(0).normal(size=v.shape), jnp.float32)

  def run(formulation):
    def fn(q, k, v):
      return yoso(q, k, v, rng=_key(5), num_hashes=4, tau=4, mask=mask, backward_features=features,
                  formulation=formulation)

    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cot))

  for name, got, want in zip(["out", "dq", "dk", "dv"], run(formulation), run("sorted"), strict=True):
    assert np.all(np.isfinite(got)), name
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


@pytest.mark.all_platforms
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("features", [None, 1])
def test_pallas_formulation_lowers_for_accelerators(platform, features):
  # bf16 inputs, L above the short-sequence threshold: forward and forward+backward carry the kernels.
  from yoso import backward as ya
  shape = jax.ShapeDtypeStruct((1, ya.COUNTS_MAX_LENGTH + 100, 2, 64), jnp.bfloat16)

  def forward(q, k, v):
    return yoso(q, k, v, rng=jax.random.key(0), num_hashes=4, tau=8, formulation="pallas",
                backward_features=features)

  def fwdbwd(q, k, v):
    return jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  for fn in (forward, fwdbwd):
    module = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        shape, shape, shape).mlir_module()
    assert marker in module, f"no Pallas kernel in the {platform} program"
  assert ("_pair_kernel" in module) == (features is None)  # the exact dQ/dK's code-sorted pair sums


@pytest.mark.all_platforms
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_onehot_formulation_lowers_for_accelerators(platform):
  # bf16 inputs, L above the short-sequence threshold: forward and forward+backward (tables for dV, dQ, dK).
  from yoso import backward as ya
  shape = jax.ShapeDtypeStruct((1, ya.COUNTS_MAX_LENGTH + 512, 2, 64), jnp.bfloat16)

  def forward(q, k, v):
    return yoso(q, k, v, rng=jax.random.key(0), num_hashes=4, tau=8, formulation="onehot")

  def fwdbwd(q, k, v):
    return jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  for fn in (forward, fwdbwd):
    module = jax.export.export(jax.jit(fn), platforms=[platform])(shape, shape, shape).mlir_module()
    assert "dot_general" in module


def test_sort_by_code_is_a_stable_sort_in_both_forms():
  # Packed int32 keys (code * L + row) when they fit, argsort otherwise (tau = 24 tables): same order.
  from yoso import tables as ya
  rng = np.random.default_rng(7)
  for buckets, length in ((257, 1000), ((1 << 24) + 1, 300)):
    assert (buckets * length < 2**31) == (buckets == 257)
    codes = rng.integers(0, min(buckets, 40), size=length)  # few distinct codes: many ties to keep in order
    order, sorted_codes = jax.jit(ya._sort_by_code, static_argnums=1)(jnp.asarray(codes, jnp.int32), buckets)
    want = np.argsort(codes, kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(sorted_codes, codes[want])


def test_expected_collision_is_finite_at_parallel_vectors():
  c = jnp.array([1.0, -1.0, 1.0000001, 0.3], jnp.float32)
  p, g = jax.value_and_grad(lambda c: jnp.sum(expected_collision(c, 8)))(c)
  assert np.isfinite(p) and np.all(np.isfinite(np.asarray(g)))


# ----------------------------------------------------------------------------------------------- arguments


def test_bad_arguments_raise_naming_the_argument():
  q, k, v = _inputs(10, length=4, d=6, dtype=jnp.float32)
  good = dict(rng=jax.random.key(0), num_hashes=2, tau=3)
  # Only YOSO-C has no causal form (yoso and yoso_e have one: tests/yoso/test_causal.py).
  with pytest.raises(ValueError, match="'causal'.*convolution"):
    yoso_c(q, k, v, causal=True, conv_kernel=jnp.ones((3,)), **good)
  with pytest.raises(ValueError, match="'causal'"):
    yoso(q, k, v, causal="yes", **good)
  with pytest.raises(ValueError, match="'hash'.*power-of-two head_dim"):
    yoso(q, k, v, hash="fast", **good)
  with pytest.raises(ValueError, match="'hash'"):
    yoso(q, k, v, hash="simhash", **good)
  with pytest.raises(ValueError, match="'num_hashes'"):
    yoso(q, k, v, rng=good["rng"], num_hashes=0, tau=3)
  with pytest.raises(ValueError, match="'tau'"):
    yoso(q, k, v, rng=good["rng"], num_hashes=2, tau=40)
  with pytest.raises(ValueError, match="'backward'"):
    yoso(q, k, v, backward="exact", **good)
  with pytest.raises(ValueError, match="'backward_features'"):
    yoso(q, k, v, backward_features=0, **good)
  with pytest.raises(ValueError, match="'formulation'"):
    yoso(q, k, v, formulation="gather", **good)
  with pytest.raises(TypeError, match="'rng'"):
    yoso(q, k, v, rng=None, num_hashes=2, tau=3)
  with pytest.raises(ValueError, match="'mask'"):
    yoso(q, k, v, mask=jnp.ones((1, 3), bool), **good)
