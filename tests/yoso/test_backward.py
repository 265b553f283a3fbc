"""YOSO's custom backward: the dense surrogate gradient, the sampled estimator's bias and its definition with
the forward's hash codes, the float32 polynomial arccos, the per-feature tables, the backend's
formulation."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core import contract
from tests.yoso.definitions import grads_of, seeded_inputs, seeded_key, surrogate
from yoso import hashing
from yoso.attention import l2_normalize, yoso
from yoso.collision import arccos_poly, expected_collision


@pytest.mark.parametrize("normalize", [pytest.param(False, marks=pytest.mark.slow), True])  # one fast
def test_dense_backward_matches_surrogate_exactly(normalize):
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(7, b=2, length=6)
    mask = jnp.ones((2, 6), bool).at[0, 4].set(False)
    rng = seeded_key(11)
    sampled = yoso(q, k, v, rng=rng, num_hashes=5, tau=3, mask=mask, normalize_output=False)

    def reference(q, k, v):
      # The sampled forward value with the surrogate's gradient, then (maybe) the l2 normalisation.
      s = surrogate(q, k, v, mask, 3)
      y = jax.lax.stop_gradient(sampled) + s - jax.lax.stop_gradient(s)
      return l2_normalize(y) if normalize else y

    got = grads_of(lambda q, k, v: yoso(q, k, v, rng=rng, num_hashes=5, tau=3, mask=mask, backward="dense",
                                      normalize_output=normalize), q, k, v)
    want = grads_of(reference, q, k, v)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("features", [None, 1, pytest.param(3, marks=pytest.mark.slow)])
def test_sampled_backward_is_unbiased_for_surrogate_gradient(features):
  # The forward's codes are re-used; dV is exact in expectation, dQ/dK too (features=1, 3: unbiased sketches
  # through the segment-sum and the chunked implementation).
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(8, length=8, e=4)
    mask = jnp.ones((1, 8), bool).at[0, 5].set(False)
    tau, m, draws = 3, 8, 300
    want = grads_of(lambda q, k, v: surrogate(q, k, v, mask, tau), q, k, v)
    one = jax.jit(jax.vmap(lambda r: grads_of(
        lambda q, k, v: yoso(q, k, v, rng=r, num_hashes=m, tau=tau, mask=mask, normalize_output=False,
                             backward_features=features), q, k, v)))
    got = one(jax.random.split(seeded_key(12), draws))
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
    q, k, v = seeded_inputs(9, b=2, length=7)
    mask = jnp.ones((2, 7), bool).at[1, 3].set(False)
    rng, tau, m = seeded_key(2), 2, 6
    def fn(q, k, v):
      return yoso(q, k, v, rng=rng, num_hashes=m, tau=tau, mask=mask, normalize_output=False,
                  backward_features=None)

    got = jax.jit(lambda q, k, v: grads_of(fn, q, k, v))(q, k, v)
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
  q, k, v = seeded_inputs(3, length=5, dtype=jnp.float32)
  args = dict(rng=seeded_key(0), num_hashes=2, tau=3)
  yoso(q, k, v, **args)
  assert not used
  monkeypatch.setattr(contract, "backend", lambda: "gpu")
  yoso(q, k, v, **args)  # the kernels, interpreted on this CPU
  assert used
