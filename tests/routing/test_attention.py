"""Routing attention: k-means statistics, EMA, balanced membership, attention vs NumPy,
causality."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core.norm import layer_norm
from routing import kmeans
from routing.attention import routing_attention
from routing.local import local_attention


@functools.partial(jax.jit, static_argnames=("window", "causal", "share_qk", "scale_logits", "mask_self",
                                             "membership"))
def _routing(q, k, v, mu, mask, *, window, causal, share_qk=True, scale_logits=True, mask_self=False,
             membership="balanced_leaky"):
  """Jitted once per option set: eager dispatch compiles every primitive per shape, which is slower here."""
  return routing_attention(q, k, v, centroids=mu, window=window, causal=causal, mask=mask, share_qk=share_qk,
                           scale_logits=scale_logits, mask_self=mask_self, membership=membership)


def _ln(x):
  x = np.asarray(x, np.float64)
  c = x - x.mean(-1, keepdims=True)
  return c / np.sqrt((c ** 2).mean(-1, keepdims=True) + 1e-6)


def _softmax_rows(s, keep):
  s = np.where(keep, s, -np.inf)
  m = np.max(s, -1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(keep, np.exp(s - m), 0.0)
  d = e.sum(-1, keepdims=True)
  return e / np.where(d > 0, d, 1.0)


def _inputs(key, b, n, h, d, dv=None, mask_p=0.7):
  """float: float64 inside jax.enable_x64 (the reference checks), float32 outside."""
  ks = jax.random.split(jax.random.key(key), 5)
  q = jax.random.normal(ks[0], (b, n, h, d), float)
  k = jax.random.normal(ks[1], (b, n, h, d), float)
  v = jax.random.normal(ks[2], (b, n, h, dv or d), float)
  mask = jax.random.bernoulli(ks[3], mask_p, (b, n)).at[:, 0].set(True)
  mu = kmeans.init_centroids(ks[4], h, 3, d, float)
  return q, k, v, mask, mu


def _routing_numpy(q, k, v, mu, mask, window, causal, share_qk, scale_logits, mask_self):
  """Algorithm 1 with explicit loops: per centroid top-window tokens, attention inside, scatter-mean back."""
  q, k, v, mu, mask = (np.asarray(x) for x in (q, k, v, mu, mask))
  b, n, h, d = q.shape
  qn = _ln(q)
  kn = qn if share_qk else _ln(k)
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      total, count = np.zeros((n, v.shape[-1])), np.zeros(n)
      for c in range(mu.shape[1]):
        def members(x, bi=bi, hi=hi, c=c):
          s = np.where(mask[bi], x[bi, :, hi] @ mu[hi, c], -np.inf)
          return np.sort(np.argsort(-s, kind="stable")[:window])
        qi = members(qn)
        ki = qi if share_qk else members(kn)
        s = qn[bi, qi, hi] @ kn[bi, ki, hi].T
        if scale_logits:
          s = s / np.sqrt(d)
        keep = np.broadcast_to(mask[bi, ki][None, :], s.shape).copy()
        if causal:
          keep &= qi[:, None] >= ki[None, :]
        if mask_self:
          other = keep & (qi[:, None] != ki[None, :])
          keep = np.where(other.any(-1, keepdims=True), other, keep)
        total[qi] += _softmax_rows(s, keep) @ v[bi, ki, hi]
        count[qi] += 1
      out[bi, :, hi] = total / np.maximum(count, 1)[:, None]
  return out


def test_kmeans_statistics_and_ema_match_numpy():
  with jax.enable_x64(True):
    q, _, _, mask, mu = _inputs(0, 2, 9, 2, 4)
    qn = layer_norm(q)
    np.testing.assert_allclose(qn, _ln(q), rtol=1e-12, atol=1e-12)
    sc = kmeans.scores(qn, mu)  # [b, h, c, n]
    ids = kmeans.nearest_centroid(sc)
    stats = kmeans.centroid_stats(qn, ids, mask, 3)
    want_sums, want_counts = np.zeros((2, 3, 4)), np.zeros((2, 3))
    x, m = _ln(q), np.asarray(mask)
    for bi in range(2):
      for j in range(9):
        for hi in range(2):
          c = int(np.argmax(np.asarray(mu)[hi] @ x[bi, j, hi]))
          assert ids[bi, hi, j] == c
          if m[bi, j]:
            want_sums[hi, c] += x[bi, j, hi]
            want_counts[hi, c] += 1
    np.testing.assert_allclose(stats.sums, want_sums, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stats.counts, want_counts)
    new = kmeans.ema_update(mu, stats, decay=0.9, smoothing=1.0)
    mu_np = np.asarray(mu)
    target = (want_sums + mu_np) / (want_counts + 1.0)[..., None]
    np.testing.assert_allclose(new, 0.9 * mu_np + 0.1 * target, rtol=1e-12, atol=1e-12)
    # A centroid with no assigned vector does not move.
    empty = kmeans.CentroidStats(jnp.zeros_like(mu), jnp.zeros(mu.shape[:2]))
    np.testing.assert_allclose(kmeans.ema_update(mu, empty), mu, rtol=1e-12)
    with pytest.raises(ValueError, match="decay"):
      kmeans.ema_update(mu, stats, decay=1.5)


def test_balanced_membership_has_window_sorted_members():
  with jax.enable_x64(True):
    q, _, _, mask, mu = _inputs(1, 2, 12, 2, 4, mask_p=0.8)
    sc = kmeans.scores(layer_norm(q), mu)
    idx = np.asarray(kmeans.balanced_membership(sc, 4, mask))
    assert idx.shape == (2, 2, 3, 4)
    assert (np.diff(idx, axis=-1) > 0).all()  # exactly `window` distinct members, sorted by position
    sc, m = np.asarray(sc), np.asarray(mask)
    for bi in range(2):
      assert m[bi].sum() >= 4
      for hi in range(2):
        for c in range(3):
          s = np.where(m[bi], sc[bi, hi, c], -np.inf)
          np.testing.assert_array_equal(idx[bi, hi, c], np.sort(np.argsort(-s)[:4]))
          assert m[bi, idx[bi, hi, c]].all()  # padding is never chosen while real tokens remain
    with pytest.raises(ValueError, match="window"):
      kmeans.balanced_membership(jnp.asarray(sc), 13)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("share_qk", [True, False])
def test_routing_attention_matches_numpy(causal, share_qk):
  with jax.enable_x64(True):
    q, k, v, mask, mu = _inputs(2, 2, 11, 2, 4, dv=3)
    # The two options where the reference codes disagree, spread over the cases (each compile costs seconds).
    options = ((True, False), (True, True)) if causal and share_qk else ((share_qk, not share_qk),)
    for scale_logits, mask_self in options:
      out, aux = _routing(q, k, v, mu, mask, window=4, causal=causal, share_qk=share_qk,
                          scale_logits=scale_logits, mask_self=mask_self)
      assert out.dtype == jnp.float64 and out.shape == v.shape
      want = _routing_numpy(q, k, v, mu, mask, 4, causal, share_qk, scale_logits, mask_self)
      np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    # Statistics: queries and keys assigned to their nearest centroid, real tokens only.
    m = np.asarray(mask)
    assert float(aux.stats.counts.sum()) == 2 * 2 * m.sum()  # q and k, each head
    x = _ln(q) if share_qk else None
    if x is not None:
      err = []
      for bi in range(2):
        for j in range(11):
          for hi in range(2):
            if m[bi, j]:
              c = np.argmax(np.asarray(mu)[hi] @ x[bi, j, hi])
              err.append(np.mean((x[bi, j, hi] - np.asarray(mu)[hi, c]) ** 2))
      np.testing.assert_allclose(aux.commit_loss, np.mean(err), rtol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_one_cluster_full_window_equals_dense(causal):
  with jax.enable_x64(True):
    q, _, v, mask, _ = _inputs(3, 2, 7, 2, 4)
    mu = kmeans.init_centroids(jax.random.key(5), 2, 1, 4, jnp.float64)
    qn = _ln(q)
    n = 7
    for scale_logits, mask_self in ((True, False), (False, True)):
      out, _ = _routing(q, q, v, mu, mask, window=n, causal=causal, scale_logits=scale_logits,
                        mask_self=mask_self)
      s = np.einsum("bqhd,bkhd->bhqk", qn, qn) / (2.0 if scale_logits else 1.0)  # sqrt(head_dim=4) = 2
      keep = np.broadcast_to(np.asarray(mask)[:, None, None, :], s.shape)
      if causal:
        keep = keep & np.tril(np.ones((n, n), bool))
      if mask_self:
        other = keep & ~np.eye(n, dtype=bool)
        keep = np.where(other.any(-1, keepdims=True), other, keep)
      want = np.einsum("bhqk,bkhd->bqhd", _softmax_rows(s, keep), np.asarray(v))
      np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)


def test_padding_never_moves_centroids_or_real_outputs():
  with jax.enable_x64(True):
    q, k, v, mask, mu = _inputs(4, 2, 11, 2, 4, dv=3)
    noise = jax.random.normal(jax.random.key(9), q.shape, jnp.float64) * 10
    pad = ~mask[:, :, None, None]
    out1, aux1 = _routing(q, k, v, mu, mask, window=4, causal=True)
    out2, aux2 = _routing(jnp.where(pad, noise, q), k, jnp.where(pad, noise[..., :3], v), mu, mask,
                          window=4, causal=True)
    np.testing.assert_allclose(aux1.stats.sums, aux2.stats.sums, rtol=1e-12)
    np.testing.assert_allclose(aux1.stats.counts, aux2.stats.counts)
    np.testing.assert_allclose(aux1.commit_loss, aux2.commit_loss, rtol=1e-12)
    real = np.asarray(mask)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, out1, 0), np.where(real, out2, 0), rtol=1e-12, atol=1e-12)
    assert bool(jnp.isfinite(out2).all())


def test_causal_jacobian_has_exact_zeros():
  with jax.enable_x64(True):
    q, k, v, _, mu = _inputs(5, 1, 8, 1, 4)

    def f(v_):
      return routing_attention(q, k, v_, centroids=mu, window=4, causal=True)[0][0, :, 0, 0]

    jac = np.asarray(jax.jit(jax.jacrev(f))(v))[:, 0, :, 0, :]  # [out position, in position, value dim]
    future = np.triu(np.ones((8, 8), bool), 1)
    assert np.all(jac[future] == 0.0)
    assert np.any(jac[~future] != 0.0)


def test_gradients_finite_and_bf16_close():
  q, k, v, mask, mu = (x.astype(jnp.float32) if x.dtype != bool else x for x in _inputs(6, 1, 16, 2, 8))

  def loss(q_, v_):
    out, aux = routing_attention(q_, k, v_, centroids=mu, window=4, causal=True, mask=mask)
    return jnp.sum(out ** 2) + aux.commit_loss

  gq, gv = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, v)
  assert bool(jnp.isfinite(gq).all() and jnp.isfinite(gv).all()) and float(jnp.abs(gq).sum()) > 0
  f32, _ = _routing(q, k, v, mu, mask, window=4, causal=True)
  b16, _ = _routing(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mu, mask,
                    window=4, causal=True)
  assert b16.dtype == jnp.bfloat16
  real = np.asarray(mask)[:, :, None, None]
  np.testing.assert_allclose(np.where(real, np.asarray(b16, np.float32), 0), np.where(real, f32, 0), atol=0.1)


def test_rejects_bad_arguments():
  q = jnp.ones((1, 4, 2, 3))
  mu = kmeans.init_centroids(jax.random.key(0), 2, 2, 3)
  with pytest.raises(ValueError, match="centroids"):
    routing_attention(q, q, q, centroids=mu[:1], window=2, causal=True)
  with pytest.raises(ValueError, match="window"):
    routing_attention(q, q, q, centroids=mu, window=0, causal=True)
  with pytest.raises(ValueError, match="causal"):
    routing_attention(q, q, q, centroids=mu, window=2, causal="yes")
  with pytest.raises(ValueError, match="block_size"):
    local_attention(q, q, q, block_size=0, causal=True)


def _local_numpy(q, k, v, mask, size, causal):
  q, k, v, mask = (np.asarray(x) for x in (q, k, v, mask))
  b, n, h, d = q.shape
  blk = np.arange(n) // size
  keep = (blk[None, :] >= blk[:, None] - 1) & (blk[None, :] <= blk[:, None] + (0 if causal else 1))
  if causal:
    keep &= np.tril(np.ones((n, n), bool))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
  keep = keep[None, None] & mask[:, None, None, :]
  return np.einsum("bhqk,bkhd->bqhd", _softmax_rows(s, keep), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,size", [(1, 3), (10, 3)])
def test_local_attention_matches_numpy(causal, n, size):
  with jax.enable_x64(True):
    q, k, v, mask, _ = _inputs(7 + n, 2, n, 2, 4, dv=3)
    out = jax.jit(functools.partial(local_attention, block_size=size, causal=causal))(q, k, v, mask=mask)
    np.testing.assert_allclose(out, _local_numpy(q, k, v, mask, size, causal), rtol=1e-10, atol=1e-12)


def _nearest_numpy(q, v, mu, mask, window, causal):
  """Nearest-centroid membership: each token attends to its `window` most recent cluster-mates (self
  included), or to those within `window - 1` cluster-mates on either side when bidirectional."""
  qn, v, mu, mask = _ln(q), np.asarray(v), np.asarray(mu), np.asarray(mask)
  b, n, h, d = qn.shape
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      cid = np.argmax(qn[bi, :, hi] @ mu[hi].T, axis=-1)
      for i in range(n):
        mates = [j for j in range(n) if cid[j] == cid[i]]
        r = mates.index(i)
        sel = [j for j in mates[max(0, r - window + 1):r + (1 if causal else window)] if mask[bi, j]]
        if not sel:  # a padded query with no real key in reach: don't-care
          continue
        s = qn[bi, i, hi] @ qn[bi, sel, hi].T / np.sqrt(d)
        out[bi, i, hi] = _softmax_rows(s[None], np.ones((1, len(sel)), bool))[0] @ v[bi, sel, hi]
  return out


@pytest.mark.parametrize("causal", [True, False])
def test_nearest_membership_matches_numpy_and_is_exactly_causal(causal):
  with jax.enable_x64(True):
    q, _, v, mask, mu = _inputs(2, 2, 11, 2, 4, dv=3)
    out, aux = _routing(q, q, v, mu, mask, window=3, causal=causal, membership="nearest")
    real = np.asarray(mask)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, out, 0),
                               np.where(real, _nearest_numpy(q, v, mu, mask, 3, causal), 0),
                               rtol=1e-10, atol=1e-12)
    assert float(aux.stats.counts.sum()) == 2 * 2 * np.asarray(mask).sum()
    if causal:  # changing tokens >= 6 (queries, keys and values) moves no output before 6
      q2 = q.at[:, 6:].set(3.0 * jax.random.normal(jax.random.key(1), q[:, 6:].shape, jnp.float64))
      out2, _ = _routing(q2, q2, v.at[:, 6:].add(5.0), mu, mask, window=3, causal=True, membership="nearest")
      # (equal up to summation order: the sorted layout, hence the order of a row's keys, may shift)
      np.testing.assert_allclose(np.asarray(out2)[:, :6], np.asarray(out)[:, :6], rtol=1e-12, atol=1e-13)
  with pytest.raises(ValueError, match="membership"):
    routing_attention(q, q, v, centroids=mu, window=3, causal=causal, share_qk=False, membership="nearest")


@pytest.mark.slow
def test_default_membership_is_exactly_causal_and_the_balanced_opt_in_leaks():
  """The decision documented in `routing.attention`: decoders (causal, shared QK) default to "nearest"; the
  paper's top-k stays an explicit opt-in ("balanced_leaky"), and in a decoder it leaks: changing only
  tokens >= 8 moves outputs before 8 (a later token pushes an earlier one out of a centroid's
  top-`window`)."""
  with jax.enable_x64(True):
    q, k, v, _, mu = _inputs(5, 2, 16, 2, 4, mask_p=1.0)
    mask = jnp.ones((2, 16), bool)
    for causal, share_qk, want in [(True, True, "nearest"), (False, True, "balanced"),
                                   (False, False, "balanced")]:
      got = _routing(q, k, v, mu, mask, window=4, causal=causal, share_qk=share_qk, membership=None)[0]
      ref = _routing(q, k, v, mu, mask, window=4, causal=causal, share_qk=share_qk, membership=want)[0]
      np.testing.assert_array_equal(got, ref)
    # A decoder is never given the leaking top-k silently: "balanced" (asked for, or the default without
    # shared QK) is refused with the way out named.
    for share_qk, membership in [(True, "balanced"), (False, None), (False, "balanced")]:
      with pytest.raises(ValueError, match="membership='nearest'"):
        routing_attention(q, k, v, centroids=mu, window=4, causal=True, mask=mask, share_qk=share_qk,
                          membership=membership)
    q2 = q.at[:, 8:].set(3.0 * jax.random.normal(jax.random.key(9), q[:, 8:].shape, jnp.float64))
    v2 = v.at[:, 8:].add(5.0)
    for membership, leaks in [("nearest", False), ("balanced_leaky", True)]:
      a = _routing(q, q, v, mu, mask, window=4, causal=True, membership=membership)[0][:, :8]
      b = _routing(q2, q2, v2, mu, mask, window=4, causal=True, membership=membership)[0][:, :8]
      assert (float(jnp.max(jnp.abs(a - b))) > 1e-3) == leaks, membership


@pytest.mark.parametrize("share_qk", [True, False])
def test_gradients_match_finite_differences(share_qk):
  """The cluster attention has a hand-written VJP (shared-QK and general forms): check it numerically
  (float64; membership is piecewise constant, so the tiny steps of the check keep it fixed)."""
  from jax.test_util import check_grads

  with jax.enable_x64(True):
    q, k, v, mask, mu = _inputs(11, 1, 9, 2, 4, dv=3)

    @jax.jit
    def f(q, k, v):
      return routing_attention(q, k, v, centroids=mu, window=4, causal=True, mask=mask, share_qk=share_qk,
                               mask_self=True, membership="balanced_leaky")[0]

    check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["routing", "combiner_routed"])
def test_registered_ops_check_q_and_num_clusters_before_making_centroids(name):
  """The registered ops make their fixed centroids from q's shape and num_clusters: both are checked first,
  with the op's own words (not an IndexError, a silent int() or an argmax of nothing)."""
  from attention_core import registry

  spec = registry.get(name)
  q = jnp.ones((1, 16, 2, 8))
  extra = {"window": 4} if name == "routing" else {}
  for clusters in (8.5, 0):
    with pytest.raises(ValueError, match=f"{name}: argument 'num_clusters' must be a positive integer"):
      spec.fn(q, q, q, causal=True, num_clusters=clusters, **extra)
  with pytest.raises(ValueError, match=f"{name}: argument 'q' must have rank 4"):
    spec.fn(q[..., 0], q[..., 0], q[..., 0], causal=True, num_clusters=4, **extra)
