"""YOSO attention: hashing statistics, convergence to YOSO-E, the custom backward, masking and bad arguments.

Statistical checks are seeded and compare against the Monte-Carlo standard error they measure themselves, with
margins (>= 6 standard errors) that a correct implementation passes for any seed, while a wrong expectation
(an off-by-one tau, a dropped hash, a biased backward) misses by tens of standard errors.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.yoso.definitions import reference_yoso_e, seeded_inputs, seeded_key
from yoso import hashing
from yoso.attention import yoso, yoso_c, yoso_e


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
      jax.random.split(seeded_key(1), draws))  # [draws, 2, 1, pairs, m]
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
  a, b, c = codes(x, seeded_key(7)), codes(x[1:, :, 2:], seeded_key(7)), codes(x, seeded_key(8))
  for same, part, other in zip(a, b, c, strict=True):
    np.testing.assert_array_equal(same[1:, :, 2:], part)
    assert np.mean(np.asarray(same) != np.asarray(other)) > 0.5


def test_yoso_e_matches_definition():
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(0, b=2, length=7)
    mask = jnp.ones((2, 7), bool).at[1, 2:4].set(False)
    for normalize in (True, False):
      out = yoso_e(q, k, v, tau=3, mask=mask, normalize_output=normalize)
      assert out.dtype == jnp.float64
      np.testing.assert_allclose(out, reference_yoso_e(q, k, v, mask, 3, normalize), rtol=1e-10, atol=1e-12)


def test_sampled_mean_converges_to_yoso_e_and_variance_falls_as_one_over_m():
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(1)
    mask = jnp.ones((1, 10), bool).at[0, 6].set(False)
    tau, draws = 3, 400
    expect = yoso_e(q, k, v, tau=tau, mask=mask, normalize_output=False)
    total_var = {}
    for m in (4, 16):
      f = jax.jit(jax.vmap(lambda r, m=m: yoso(q, k, v, rng=r, num_hashes=m, tau=tau, mask=mask,
                                               normalize_output=False)))
      samples = f(jax.random.split(seeded_key(m), draws))  # [draws, b, L, h, e]
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
    q, k, v = seeded_inputs(2, length=9)
    f = jax.jit(lambda r: (yoso(q, k, v, rng=r, num_hashes=8, tau=2, normalize_output=False),
                           yoso(q, k, v, rng=r, num_hashes=8, tau=2)))
    raw, out = f(seeded_key(3))
    norms = np.linalg.norm(np.asarray(raw), axis=-1, keepdims=True)
    assert np.all(norms > 1e-3)
    np.testing.assert_allclose(out, np.asarray(raw) / norms, rtol=1e-12)


@pytest.mark.parametrize("path", ["counts", "tables"])
def test_masked_keys_contribute_nothing_and_padding_is_invariant(path, monkeypatch):
  from yoso import backward as ya
  if path == "tables":  # short sequences take dense collision counts unless the threshold is lowered
    monkeypatch.setattr(ya, "COUNTS_MAX_LENGTH", 0)
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(4, length=8)
    mask = jnp.array([[True, True, False, True, True, False, True, False]])
    real = np.flatnonzero(np.asarray(mask[0]))
    junk = jnp.asarray(np.random.default_rng(9).normal(size=q.shape)) * 100
    k2 = jnp.where(mask[..., None, None], k, junk)
    v2 = jnp.where(mask[..., None, None], v, junk[..., :5])
    rng = seeded_key(5)
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
  q, k, v = seeded_inputs(5, b=2, length=6, dtype=jnp.float32)
  q = q.at[0, 1].set(0.0)
  k = k.at[0, 2].set(0.0)
  v = v.at[0, 3].set(0.0)
  mask = jnp.ones((2, 6), bool).at[1].set(False)  # a batch row with no real key at all
  fns = (lambda q, k, v: yoso(q, k, v, rng=seeded_key(0), num_hashes=4, tau=4, mask=mask),
         lambda q, k, v: yoso_e(q, k, v, tau=4, mask=mask),
         lambda q, k, v: yoso(q, q, v, rng=seeded_key(0), num_hashes=4, tau=4, backward="dense"))

  @jax.jit
  def all_grads(q, k, v):
    return [jax.value_and_grad(lambda *a, fn=fn: jnp.sum(fn(*a) * v), argnums=(0, 1, 2))(q, k, v)
            for fn in fns]

  for out, grads in all_grads(q, k, v):
    assert np.isfinite(out)
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g)))


def test_dtype_jit_length_one_and_key_kinds():
  q, k, v = seeded_inputs(6, length=5, dtype=jnp.bfloat16)

  @jax.jit
  def run(q, k, v):
    return (yoso(q, k, v, rng=jax.random.key(0), num_hashes=4, tau=3, hash="fast"),
            yoso_e(q, k, v, tau=3),
            yoso(q[:, :1], k[:, :1], v[:, :1], rng=seeded_key(0), num_hashes=3, tau=2),
            # Old-style uint32 keys are accepted and equal to the typed key with the same data.
            yoso(q, k, v, rng=jax.random.PRNGKey(0), num_hashes=4, tau=3, hash="fast"))

  out, expect, one, old = run(q, k, v)
  assert out.dtype == jnp.bfloat16 and out.shape == v.shape and expect.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(one, np.float32)))
  np.testing.assert_array_equal(np.asarray(old, np.float32), np.asarray(out, np.float32))


def test_bad_arguments_raise_naming_the_argument():
  q, k, v = seeded_inputs(10, length=4, d=6, dtype=jnp.float32)
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
