"""Causal YOSO: the sampled estimator restricted to keys j <= i, out_i = 1/m sum_t sum_{j <= i} B^t_ij v_j.

Checked against the definition built from the op's own hash codes (an explicit collision matrix with the
causal mask), for the forward and for every backward (exact per-feature sums through counts and through
running sums, sketched, dense), plus causality (zero Jacobian on the future, non-finite future values) and
YOSO-E's causal expectation. Statistical checks follow tests/yoso/test_attention.py (>= 6 measured standard
errors).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.yoso.definitions import grads_of, reference_yoso_e, seeded_inputs, seeded_key, surrogate
from yoso import hashing
from yoso.attention import l2_normalize, yoso, yoso_e
from yoso.backward import sketch_directions


def _heads_major(x):  # [batch, length, heads, ...] <-> [batch, heads, length, ...]
  return jnp.swapaxes(x, 1, 2)


def _collisions(q, k, mask, rng, m, tau):
  """B^t_ij [batch, L_q, L_k, heads, m] from the op's own codes, 0 for masked keys and for j > i."""
  hash_rng = jax.random.split(rng)[0]
  codes = [np.asarray(_heads_major(hashing.hash_codes(_heads_major(l2_normalize(x)), hash_rng, num_hashes=m,
                                                      tau=tau))) for x in (q, k)]  # [b, L, h, m] each
  length = q.shape[1]
  visible = np.asarray(mask)[:, None, :] & np.tri(length, dtype=bool)  # [b, L_q, L_k]
  return (codes[0][:, :, None] == codes[1][:, None, :]) & visible[..., None, None]


def test_bucket_prefix_sums_match_their_definition_and_stop_at_the_reader():
  # The running sums alone, both directions, with an extra bucket no reader sees and non-finite rows there
  # and after the readers; the second case's packed keys overflow int32 (the argsort form).
  from yoso import tables as ya
  for length, buckets in ((40, 4), (70, 1 << 24)):
    rng = np.random.default_rng(length)
    read = rng.integers(0, min(buckets, 5), size=length)
    write = np.where(rng.random(length) < 0.2, buckets, rng.integers(0, min(buckets, 5), size=length))
    rows = rng.normal(size=(length, 3))
    fn = jax.jit(ya._bucket_prefix_sums, static_argnums=(3, 4))
    for reverse in (False, True):
      pos = np.arange(length)
      seen = (read[:, None] == write[None, :]) & ((pos[None] >= pos[:, None]) if reverse
                                                   else (pos[None] <= pos[:, None]))  # [reader, writer]
      codes = jnp.asarray(read, jnp.int32), jnp.asarray(write, jnp.int32)
      np.testing.assert_allclose(fn(*codes, jnp.asarray(rows), buckets, reverse), seen @ rows, rtol=1e-5,
                                 atol=1e-5)
      # A NaN in the unread bucket and an Inf at the last writer in scan order reach no other reader.
      last = length - 1 if not reverse else 0
      bad = rows.copy()
      bad[write == buckets] = np.nan
      bad[last] = np.inf
      got = np.asarray(fn(*codes, jnp.asarray(bad), buckets, reverse))
      hit = seen[:, last] & (write[last] != buckets)
      assert np.all(np.isfinite(got[~hit])) and np.all(~np.isfinite(got[hit]).all(-1))
      np.testing.assert_allclose(got[~hit], (seen @ rows)[~hit], rtol=1e-5, atol=1e-5)


def test_causal_forward_matches_collision_definition():
  # The causal sums are the same running sums whatever the formulation.
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(20, b=2, length=11)
    mask = jnp.ones((2, 11), bool).at[1, 3].set(False).at[0, 10].set(False)
    for m, tau, formulation in ((6, 2, "sorted"), (3, 5, "onehot")):
      rng = seeded_key(m)
      raw, out = jax.jit(lambda q, k, v, rng=rng, m=m, tau=tau, formulation=formulation: [
          yoso(q, k, v, rng=rng, num_hashes=m, tau=tau, mask=mask, causal=True, normalize_output=n,
               formulation=formulation) for n in (False, True)])(q, k, v)
      bmat = _collisions(q, k, mask, rng, m, tau).mean(-1)  # [b, L_q, L_k, h]
      want = np.einsum("bqkh,bkhe->bqhe", bmat, v)
      assert np.count_nonzero(bmat) > 20  # not vacuous: many collisions below the diagonal
      np.testing.assert_allclose(raw, want, rtol=1e-12, atol=1e-12)
      np.testing.assert_allclose(out, l2_normalize(jnp.asarray(want)), rtol=1e-12, atol=1e-12)


def test_causal_outputs_ignore_the_future():
  # Zero Jacobian of out_i on q, k, v at j > i through the custom backward (exact, sketched and dense), and a
  # non-finite future or masked value changes no earlier output (yoso and yoso_e).
  q, k, v = seeded_inputs(21, length=8, h=1, d=4, e=3, dtype=jnp.float32)
  mask = jnp.ones((1, 8), bool).at[0, 2].set(False)
  fns = {"exact": dict(), "sketch": dict(backward_features=1), "dense": dict(backward="dense")}
  later = np.triu(np.ones((8, 8), bool), 1)  # [i, j]: j > i

  @jax.jit
  def jacobians(q, k, v):
    key = seeded_key(4)
    return {name: jax.jacrev(lambda q, k, v, kw=kw: yoso(q, k, v, rng=key, num_hashes=4, tau=2, mask=mask,
                                                           causal=True, **kw), argnums=(0, 1, 2))(q, k, v)
            for name, kw in fns.items()}

  for name, jac in jacobians(q, k, v).items():
    for x, j in zip("qkv", jac, strict=True):  # [b, L, h, e, b, L, h, d]
      per_pos = np.abs(np.asarray(j))[0, :, 0, :, 0, :, 0].sum(axis=(1, 3))  # [i, j]
      assert np.all(per_pos[later] == 0), (name, x)
      assert np.any(per_pos[~later] != 0), (name, x)

  def ops(v):
    return (yoso(q, k, v, rng=seeded_key(4), num_hashes=4, tau=2, mask=mask, causal=True),
            yoso_e(q, k, v, tau=2, mask=mask, causal=True))

  ops = jax.jit(ops)
  clean = ops(v)
  for value in (jnp.nan, jnp.inf):
    poisoned = ops(v.at[0, 5].set(value).at[0, 2].set(value))  # position 5 is the future of 0..4; 2 masked
    for c, p in zip(clean, poisoned, strict=True):
      np.testing.assert_array_equal(np.asarray(p)[:, :5], np.asarray(c)[:, :5])


def test_causal_dense_backward_matches_surrogate_exactly():
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(22, b=2, length=6)
    mask = jnp.ones((2, 6), bool).at[0, 4].set(False)
    kw = dict(rng=seeded_key(11), num_hashes=5, tau=3, mask=mask, causal=True)
    sampled = yoso(q, k, v, normalize_output=False, **kw)

    def reference(q, k, v):
      # The sampled forward value with the causal surrogate's gradient, then the l2 normalisation.
      s = surrogate(q, k, v, mask, 3, causal=True)
      y = jax.lax.stop_gradient(sampled) + s - jax.lax.stop_gradient(s)
      return l2_normalize(y)

    got, want = jax.jit(lambda q, k, v: (grads_of(lambda *a: yoso(*a, backward="dense", **kw), q, k, v),
                                         grads_of(reference, q, k, v)))(q, k, v)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path,features", [("counts", None), ("tables", None), ("tables", 1)])
def test_causal_sampled_backward_matches_definition_with_forward_codes(path, features, monkeypatch):
  # With the forward's codes B^t and sketch directions R_t (R_t = I when exact): dV_j = 1/m sum_t
  # sum_{i >= j} B^t_ij dY_i, dQn_i = (tau/2)/m sum_t sum_{j <= i} B^t_ij (dY_i R_t . v_j R_t) kn_j, dKn_j
  # alike over i >= j; then the normalisations of q and k by autodiff. Short sequences take the counts when
  # exact; the running sums are forced by lowering the threshold (sketches always take them).
  from yoso import backward as ya
  if path == "tables":
    monkeypatch.setattr(ya, "CAUSAL_COUNTS_MAX_LENGTH", 0)
  with jax.enable_x64(True):
    b, length, h, e = 2, 9, 2, 5
    q, k, v = seeded_inputs(23, b=b, length=length, h=h, e=e)
    mask = jnp.ones((b, length), bool).at[1, 3].set(False)
    rng, tau, m = seeded_key(2), 2, 6

    def fn(q, k, v):
      return yoso(q, k, v, rng=rng, num_hashes=m, tau=tau, mask=mask, causal=True, normalize_output=False,
                  backward_features=features)

    got = jax.jit(lambda q, k, v: grads_of(fn, q, k, v))(q, k, v)
    bmat = _collisions(q, k, mask, rng, m, tau)  # [b, Lq, Lk, h, m]
    dirs = sketch_directions(jax.random.split(rng)[1], b, h, m, e, features, jnp.float64)
    r = np.broadcast_to(np.eye(e), (m, b * h, e, e)) if dirs is None else np.asarray(dirs)
    r = r.reshape(m, b, h, e, -1)  # groups are heads-major: g = batch * heads + head
    dy = np.broadcast_to(np.cos(np.arange(e)), v.shape)
    a, c = np.einsum("bqhe,mbhes->bqhms", dy, r), np.einsum("bkhe,mbhes->bkhms", np.asarray(v), r)
    w = bmat * np.einsum("bqhms,bkhms->bqkhm", a, c)  # B^t_ij (dY_i R_t . v_j R_t)
    qn, kn = l2_normalize(q), l2_normalize(k)
    dqn = (tau / 2) / m * np.einsum("bqkhm,bkhd->bqhd", w, kn)
    dkn = (tau / 2) / m * np.einsum("bqkhm,bqhd->bkhd", w, qn)
    np.testing.assert_allclose(got[2], np.einsum("bqkhm,bqhe->bkhe", bmat, dy) / m, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[0], jax.vjp(l2_normalize, q)[1](dqn)[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], jax.vjp(l2_normalize, k)[1](dkn)[0], rtol=1e-10, atol=1e-12)


def test_causal_yoso_e_matches_definition_and_is_the_sampled_mean():
  with jax.enable_x64(True):
    q, k, v = seeded_inputs(24, b=2, length=8)
    mask = jnp.ones((2, 8), bool).at[1, 2].set(False)
    tau, m, draws = 3, 8, 200
    outs = jax.jit(lambda q, k, v: [yoso_e(q, k, v, tau=tau, mask=mask, normalize_output=n, causal=True)
                                    for n in (True, False)])(q, k, v)
    for out, normalize in zip(outs, (True, False), strict=True):
      want = reference_yoso_e(q, k, v, mask, tau, normalize, causal=True)
      np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    expect = outs[1]
    # The causal sampled op is unbiased for it, and its sampled gradient for the causal surrogate's.
    want_grads = jax.jit(lambda q, k, v: grads_of(lambda *a: surrogate(*a, mask, tau, causal=True), q, k, v))(
        q, k, v)
    draw = jax.jit(jax.vmap(lambda r: (
        yoso(q, k, v, rng=r, num_hashes=m, tau=tau, mask=mask, causal=True, normalize_output=False),
        grads_of(lambda q, k, v: yoso(q, k, v, rng=r, num_hashes=m, tau=tau, mask=mask, causal=True,
                                    normalize_output=False), q, k, v))))
    outs, grads = draw(jax.random.split(seeded_key(25), draws))
    for name, samples, w in zip(["out", "dq", "dk", "dv"], [outs, *grads], [expect, *want_grads],
                                strict=True):
      mean, se = samples.mean(0), samples.std(0) / np.sqrt(draws)
      err = np.abs(np.asarray(mean - w))
      assert np.all(err < 6 * se + 1e-9), (name, float(np.max(err / (se + 1e-9))))
      assert float(jnp.max(se)) < 0.2 * float(jnp.max(jnp.abs(w))), name
