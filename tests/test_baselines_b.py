"""Reformer, Linformer, Sinkhorn, Synthesizer and Nystromformer against float64 references written from their
papers, their limiting cases, exact causality (zero Jacobian blocks) and NaN in masked positions."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from baselines.dense import dense
from baselines.linformer import linformer
from baselines.nystromformer import nystromformer
from baselines.reformer import reformer, rotations
from baselines.sinkhorn import sinkhorn
from baselines.synthesizer import synthesizer_dense, synthesizer_random
from core import registry as ops_registry

B, H, D, DV = 2, 2, 4, 3
L = 12  # one length for most tests, so compilations are shared


def _run(op, q, k, v, mask, **kwargs):
  """op under jit (one compilation instead of one per primitive); array arguments become constants."""
  return jax.jit(lambda q, k, v, mask: op(q, k, v, mask=mask, **kwargs))(q, k, v, mask)


def _inputs(length, seed, dtype=jnp.float64, p_mask=0.75):
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k = (jax.random.normal(kk, (B, length, H, D), dtype) for kk in ks[:2])
  v = jax.random.normal(ks[2], (B, length, H, DV), dtype)
  mask = jax.random.bernoulli(ks[3], p_mask, (B, length)).at[:, 0].set(True)
  return q, k, v, mask


def _softmax_rows(s, vis):
  """Masked softmax rows (zeros where nothing is visible) and their log-sum-exp (-inf there)."""
  s = np.where(vis, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  w = np.exp(s - m)
  den = w.sum(-1, keepdims=True)
  lse = np.where(den[..., 0] > 0, np.log(np.where(den > 0, den, 1.0))[..., 0] + m[..., 0], -np.inf)
  return w / np.where(den > 0, den, 1.0), lse


def _close_on_real(got, want, mask, tol=1e-10):
  m = np.asarray(mask)[:, :, None, None]
  np.testing.assert_allclose(np.where(m, got, 0.0), np.where(m, want, 0.0), rtol=tol, atol=tol)


def _sinkhorn_params(length, block, seed=9, hidden=5):
  ks = jax.random.split(jax.random.key(seed), 4)
  n = -(-length // block) + 1  # one spare output: only the first ceil(L / block) are used
  return dict(block_size=block, sort_w1=jax.random.normal(ks[0], (H, D, hidden), jnp.float64),
              sort_b1=jax.random.normal(ks[1], (1, hidden), jnp.float64),
              sort_w2=jax.random.normal(ks[2], (1, hidden, n), jnp.float64),
              sort_b2=jax.random.normal(ks[3], (H, n), jnp.float64), sinkhorn_iters=4, temperature=0.75)


def _synth_params(length, seed=11, hidden=6):
  ks = jax.random.split(jax.random.key(seed), 5)
  return (dict(w1=jax.random.normal(ks[0], (H, D, hidden), jnp.float64),
               b1=jax.random.normal(ks[1], (H, hidden), jnp.float64),
               w2=jax.random.normal(ks[2], (1, hidden, length + 2), jnp.float64),
               b2=jax.random.normal(ks[3], (H, length + 2), jnp.float64)),
          dict(logits=jax.random.normal(ks[4], (H, length + 1, length + 1), jnp.float64)))


# ---------------------------------------------------------------- references, written from the papers

def reformer_reference(q, v, mask, rng, causal, n_hashes, n_buckets, chunk):
  """Per round: angular LSH buckets, sort by (bucket, position), chunks of `chunk`, own + previous (cyclic)
  chunk, self only when alone; rounds combined by their log-sum-exps."""
  q, v, mask = np.asarray(q, np.float64), np.asarray(v, np.float64), np.asarray(mask)
  b, length, h, d = q.shape
  rot = rotations(rng, heads=h, n_hashes=n_hashes, head_dim=d, n_buckets=max(n_buckets, 2))
  rot = np.asarray(rot, np.float64)
  n_chunks = -(-length // chunk)
  padded = n_chunks * chunk
  out = np.zeros(v.shape)
  eye = np.eye(length, dtype=bool)
  for bi in range(b):
    for hi in range(h):
      x = np.where(mask[bi][:, None], q[bi, :, hi], 0.0)
      vv = np.where(mask[bi][:, None], v[bi, :, hi], 0.0)
      unit = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-300)
      s = x @ unit.T / np.sqrt(d)
      lses, outs = [], []
      for r in range(n_hashes):
        rr = x @ rot[hi, r]
        bucket = np.argmax(np.concatenate([rr, -rr], -1), -1) if n_buckets > 1 else np.zeros(length, int)
        bucket = np.concatenate([np.where(mask[bi], bucket, n_buckets), np.full(padded - length, n_buckets)])
        order = np.argsort(bucket * padded + np.arange(padded), kind="stable")
        chunk_of = np.empty(padded, int)
        chunk_of[order] = np.arange(padded) // chunk
        c = chunk_of[:length]
        vis = c[:, None] == c[None, :]
        if n_chunks > 1:
          vis |= (c[:, None] - 1) % n_chunks == c[None, :]
        vis &= mask[bi][None, :]
        if causal:
          vis &= np.tril(np.ones((length, length), bool))
        others = vis & ~eye
        vis = others | (eye & ~others.any(-1, keepdims=True))
        w, lse = _softmax_rows(s, vis)
        lses.append(lse)
        outs.append(w @ vv)
      wr, _ = _softmax_rows(np.stack(lses, -1), np.isfinite(np.stack(lses, -1)))  # [L, rounds]
      out[bi, :, hi] = sum(wr[:, r:r + 1] * outs[r] for r in range(n_hashes))
  return out


def linformer_reference(q, k, v, mask, e, f):
  q, k, v, e, f = (np.asarray(x, np.float64) for x in (q, k, v, e, f))
  m = np.asarray(mask)[:, :, None, None]
  k, v = np.where(m, k, 0.0), np.where(m, v, 0.0)
  length, d = q.shape[1], q.shape[-1]
  out = np.zeros(v.shape)
  for bi in range(q.shape[0]):
    for hi in range(q.shape[2]):
      ek = e[:, :length] @ k[bi, :, hi]
      fv = f[:, :length] @ v[bi, :, hi]
      w, _ = _softmax_rows(q[bi, :, hi] @ ek.T / np.sqrt(d), True)
      out[bi, :, hi] = w @ fv
  return out


def nystrom_reference(q, k, v, mask, m, iters):
  """Segment-mean landmarks (over real tokens), the paper's iterative pinv, three softmax kernels."""
  q, k, v, mask = (np.asarray(x) for x in (q, k, v, mask))
  b, length, h, d = q.shape
  seg = -(-length // m)
  m = -(-length // seg)
  out = np.zeros(v.shape)
  for bi in range(b):
    real = mask[bi]
    groups = [np.arange(i * seg, min((i + 1) * seg, length)) for i in range(m)]
    groups = [g[real[g]] for g in groups]
    groups = [g for g in groups if len(g)]  # landmarks of segments with no real token are dropped
    for hi in range(h):
      qq, kk, vv = q[bi, :, hi], k[bi, :, hi], v[bi, real, hi]
      ql = np.stack([qq[g].mean(0) for g in groups])
      kl = np.stack([kk[g].mean(0) for g in groups])
      k1, _ = _softmax_rows(qq @ kl.T / np.sqrt(d), True)
      a, _ = _softmax_rows(ql @ kl.T / np.sqrt(d), True)
      k3, _ = _softmax_rows(ql @ kk[real].T / np.sqrt(d), True)
      z = a.T / (np.abs(a).sum(0).max() * np.abs(a).sum(1).max())
      eye = np.eye(len(groups))
      for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
      out[bi, :, hi] = k1 @ z @ k3 @ vv
  return out


def sinkhorn_reference(q, k, v, mask, causal, p):
  """Blocks; summaries (sum of real keys, or the first key when causal); MLP sort logits; Sinkhorn balancing
  (causal: past blocks only, column sums over rows <= i); own block + sorted block in one softmax."""
  q, k, v, mask = (np.asarray(x) for x in (q, k, v, mask))
  w1, b1, w2, b2 = (np.broadcast_to(np.asarray(p[n]), (H, *np.shape(p[n])[1:]))
                    for n in ("sort_w1", "sort_b1", "sort_w2", "sort_b2"))
  bs, iters, temp = p["block_size"], p["sinkhorn_iters"], p["temperature"]
  b, length, h, d = q.shape
  n = -(-length // bs)
  pad = n * bs - length
  real = np.concatenate([mask, np.zeros((b, pad), bool)], 1)
  padz = lambda x: np.concatenate([x, np.zeros((b, pad, *x.shape[2:]))], 1)  # noqa: E731
  q, k, v = padz(q), padz(np.where(mask[..., None, None], k, 0)), padz(np.where(mask[..., None, None], v, 0))
  pos = np.arange(n * bs)
  allowed = np.tril(np.ones((n, n), bool), -1) if causal else np.ones((n, n), bool)
  out = np.zeros((b, n * bs, h, v.shape[-1]))
  for bi in range(b):
    for hi in range(h):
      kb, vb = k[bi, :, hi].reshape(n, bs, d), v[bi, :, hi].reshape(n, bs, -1)
      summ = kb[:, 0] if causal else kb.sum(1)
      r = (np.maximum(summ @ w1[hi] + b1[hi], 0) @ w2[hi][:, :n] + b2[hi][:n]) / temp
      pm = np.where(allowed, np.exp(r - r.max()), 0.0)  # Sinkhorn in the probability domain
      for _ in range(iters):
        pm = pm / np.where(pm.sum(1, keepdims=True) > 0, pm.sum(1, keepdims=True), 1)
        if causal:
          col = np.array([[pm[: i + 1, j].sum() for j in range(n)] for i in range(n)])
        else:
          col = np.broadcast_to(pm.sum(0, keepdims=True), pm.shape)
        pm = pm / np.where(col > 0, col, 1)
      rb = real[bi].reshape(n, bs)
      for i in range(n):
        sk = np.einsum("j,jcd->cd", pm[i], kb)
        sv = np.einsum("j,jcd->cd", pm[i], vb)
        svalid = (allowed[i][:, None] & rb).any(0)
        qi = q[bi, i * bs:(i + 1) * bs, hi]
        logits = np.concatenate([qi @ kb[i].T, qi @ sk.T], 1) / np.sqrt(d)
        own = rb[i][None, :] & ((pos[i * bs:(i + 1) * bs][None, :] <= pos[i * bs:(i + 1) * bs][:, None])
                                if causal else True)
        vis = np.concatenate([np.broadcast_to(own, (bs, bs)), np.broadcast_to(svalid, (bs, bs))], 1)
        w, _ = _softmax_rows(logits, vis)
        out[bi, i * bs:(i + 1) * bs, hi] = w @ np.concatenate([vb[i], sv])
  return out[:, :length]


def synthesizer_reference(q, v, mask, causal, logits_fn):
  q, v, mask = (np.asarray(x) for x in (q, v, mask))
  b, length, h, _ = q.shape
  vis = mask[:, None, :] & (np.tril(np.ones((length, length), bool)) if causal else True)
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      w, _ = _softmax_rows(logits_fn(q[bi, :, hi], hi), vis[bi])
      out[bi, :, hi] = w @ v[bi, :, hi]
  return out


# ---------------------------------------------------------------- tests against the references

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_hashes,n_buckets,chunk", [(2, 4, 5), (3, 6, 3)])
def test_reformer_matches_definition(causal, n_hashes, n_buckets, chunk):
  with jax.enable_x64(True):
    length = L
    q, _, v, mask = _inputs(length, length + n_hashes)
    rng = jax.random.key(3)
    got = _run(reformer, q, q, v, mask, causal=causal, rng=rng, n_hashes=n_hashes, n_buckets=n_buckets,
               chunk_size=chunk)
    assert got.dtype == jnp.float64
    _close_on_real(got, reformer_reference(q, v, mask, rng, causal, n_hashes, n_buckets, chunk), mask)


@pytest.mark.parametrize("causal", [False, True])
def test_reformer_one_bucket_is_shared_qk_dense(causal):
  """One bucket and one chunk: every key is visible, so LSH attention is dense attention with keys q/|q|,
  each token seeing itself only when nothing else is visible (the first token of a decoder)."""
  with jax.enable_x64(True):
    length = L
    q, _, v, mask = _inputs(length, 5)
    got = _run(reformer, q, q, v, mask, causal=causal, rng=jax.random.key(0), n_hashes=2, n_buckets=1,
               chunk_size=length)
    qn, vn, mk = np.asarray(q), np.asarray(v), np.asarray(mask)
    want = np.zeros(vn.shape)
    eye = np.eye(length, dtype=bool)
    for bi in range(B):
      for hi in range(H):
        x = qn[bi, :, hi]
        s = x @ (x / np.linalg.norm(x, axis=-1, keepdims=True)).T / np.sqrt(D)
        vis = mk[bi][None, :] & (np.tril(np.ones((length, length), bool)) if causal else True)
        others = vis & ~eye
        w, _ = _softmax_rows(s, others | (eye & ~others.any(-1, keepdims=True)))
        want[bi, :, hi] = w @ vn[bi, :, hi]
    _close_on_real(got, want, mask)


def test_linformer_matches_definition_and_is_bidirectional_only():
  with jax.enable_x64(True):
    q, k, v, mask = _inputs(L, 1)
    e, f = (jax.random.normal(jax.random.key(s), (4, 14), jnp.float64) for s in (7, 8))
    got = _run(linformer, q, k, v, mask, causal=False, proj_k=e, proj_v=f)
    np.testing.assert_allclose(got, linformer_reference(q, k, v, mask, e, f), rtol=1e-10, atol=1e-10)
    e2, f2 = jnp.stack([e, e]), jnp.stack([f, f])
    per_head = _run(linformer, q, k, v, mask, causal=False, proj_k=e2, proj_v=f2)
    np.testing.assert_allclose(per_head, got, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="'causal'"):
      linformer(q, k, v, causal=True, proj_k=e, proj_v=f)
    with pytest.raises(ValueError, match="'proj_k'"):
      linformer(q, k, v, causal=False, proj_k=e[:, :5], proj_v=f)


@pytest.mark.parametrize("m", [4, 5])
def test_nystromformer_matches_definition(m):
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = _inputs(length, length + m)
    got = _run(nystromformer, q, k, v, mask, causal=False, num_landmarks=m)
    _close_on_real(got, nystrom_reference(q, k, v, mask, m, 6), mask, tol=1e-9)


def test_nystromformer_with_a_landmark_per_token_is_dense():
  with jax.enable_x64(True):
    q, k, v, _ = _inputs(8, 2)
    got = _run(nystromformer, q, k, v, None, causal=False, num_landmarks=8, pinv_iterations=40)
    np.testing.assert_allclose(got, dense(q, k, v, causal=False), rtol=1e-8, atol=1e-8)
    with pytest.raises(ValueError, match="'causal'"):
      nystromformer(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [3, 5])
def test_sinkhorn_matches_definition(causal, block):
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = _inputs(length, length + block)
    p = _sinkhorn_params(length, block)
    got = _run(sinkhorn, q, k, v, mask, causal=causal, **p)
    _close_on_real(got, sinkhorn_reference(q, k, v, mask, causal, p), mask, tol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_synthesizers_match_definition(causal):
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = _inputs(length, 4)
    dense_p, random_p = _synth_params(length)
    w1, b1, w2, b2 = (np.broadcast_to(np.asarray(dense_p[n]), (H, *np.shape(dense_p[n])[1:]))
                      for n in ("w1", "b1", "w2", "b2"))
    got = _run(synthesizer_dense, q, k, v, mask, causal=causal, **dense_p)
    want = synthesizer_reference(
        q, v, mask, causal, lambda x, h: (np.maximum(x @ w1[h] + b1[h], 0) @ w2[h] + b2[h])[:, :length])
    _close_on_real(got, want, mask)
    logits = np.asarray(random_p["logits"])
    got = _run(synthesizer_random, q, k, v, mask, causal=causal, **random_p)
    want = synthesizer_reference(q, v, mask, causal, lambda x, h: logits[h, :length, :length])
    _close_on_real(got, want, mask)
    with pytest.raises(ValueError, match="'w2'"):
      synthesizer_dense(q, k, v, causal=causal, **dict(dense_p, w2=dense_p["w2"][:, :, :4]))


# ---------------------------------------------------------------- contract properties, every op

OPS = ("linformer", "nystromformer", "reformer", "sinkhorn", "synthesizer", "synthesizer_random")


def _op(name, length):
  """(op with its parameters bound, supports causal) for the contract tests."""
  dense_p, random_p = _synth_params(length)
  e, f = (jax.random.normal(jax.random.key(s), (4, length), jnp.float64) for s in (7, 8))
  shared_qk = lambda q, k, v, **kw: reformer(q, q, v, **kw)  # noqa: E731
  return {
      "reformer": (shared_qk, dict(rng=jax.random.key(1), n_hashes=2, n_buckets=4, chunk_size=3), True),
      "linformer": (linformer, dict(proj_k=e, proj_v=f), False),
      "nystromformer": (nystromformer, dict(num_landmarks=3), False),
      "sinkhorn": (sinkhorn, _sinkhorn_params(length, 3), True),
      "synthesizer": (synthesizer_dense, dense_p, True),
      "synthesizer_random": (synthesizer_random, random_p, True),
  }[name]


@pytest.mark.parametrize("name", OPS)
def test_nan_in_masked_positions_changes_nothing(name):
  with jax.enable_x64(True):
    q, k, v, _ = _inputs(L, 6)
    mask = jnp.array([[True] * 9 + [False] * 3, [True, False, True, True, False, True] * 2])
    fn, params, has_causal = _op(name, L)
    bad = ~mask[:, :, None, None]
    qn, kn, vn = (jnp.where(bad, jnp.nan, x) for x in (q, k, v))
    real = np.asarray(mask)[:, :, None, None]
    for causal in ([False, True] if has_causal else [False]):
      run = jax.jit(lambda q, k, v, causal=causal: fn(q, k, v, causal=causal, mask=mask, **params))
      clean, dirty = np.where(real, run(q, k, v), 0.0), np.where(real, run(qn, kn, vn), 0.0)
      assert np.all(np.isfinite(dirty))
      np.testing.assert_allclose(dirty, clean, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["reformer", "sinkhorn", "synthesizer", "synthesizer_random"])
def test_causal_ops_read_no_future(name):
  """d out[i] / d (q, k, v)[j] = 0 for every j > i."""
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = _inputs(length, 8, p_mask=1.0)
    fn, params, _ = _op(name, length)
    out = lambda q, k, v: fn(q, k, v, causal=True, mask=mask, **params)  # noqa: E731
    jac = jax.jit(jax.jacrev(out, argnums=(0, 1, 2)))(q, k, v)
    future = np.triu(np.ones((length, length), bool), 1)  # [i, j]: j > i
    for j in jac:  # [B, L, H, DV, B, L, H, D]
      block = np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7))  # [L_out, L_in]
      assert np.all(block[future] == 0.0)
    dv = np.abs(np.asarray(jac[2])).sum(axis=(0, 2, 3, 4, 6, 7))
    assert dv[np.tril(np.ones((length, length), bool), -1)].sum() > 0  # the past is read


def test_registry_and_bad_arguments():
  for name in OPS:
    spec = ops_registry.get(name)
    assert spec.bidirectional and spec.causal == (name not in ("linformer", "nystromformer"))
    assert set(inspect.signature(spec.params).parameters) <= {"length", "head_dim"}
  q, k, v, _ = _inputs(8, 0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="'n_buckets'"):
    reformer(q, q, v, causal=False, rng=jax.random.key(0), n_buckets=3)
  with pytest.raises(ValueError, match="'chunk_size'"):
    reformer(q, q, v, causal=False, rng=jax.random.key(0), chunk_size=0)
  with pytest.raises(ValueError, match="'num_landmarks'"):
    nystromformer(q, k, v, causal=False, num_landmarks=0)
  with pytest.raises(ValueError, match="'sort_w2'"):
    sinkhorn(q, k, v, causal=False, **dict(_sinkhorn_params(8, 2), sort_w2=jnp.ones((1, 5, 2))))
  with pytest.raises(ValueError, match="'temperature'"):
    sinkhorn(q, k, v, causal=False, **dict(_sinkhorn_params(8, 2), temperature=0.0))
