"""Sinkhorn (sparse sinkhorn) attention against a float64 reference written from its paper."""

import jax
import numpy as np
import pytest

from attention_baselines.sinkhorn import sinkhorn
from tests.attention_baselines.definitions import (
  H,
  L,
  close_on_real,
  inputs_at,
  run_jit,
  sinkhorn_params,
  softmax_rows,
)


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
        w, _ = softmax_rows(logits, vis)
        out[bi, i * bs:(i + 1) * bs, hi] = w @ np.concatenate([vb[i], sv])
  return out[:, :length]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [3, 5])
def test_sinkhorn_matches_definition(causal, block):
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = inputs_at(length, length + block)
    p = sinkhorn_params(length, block)
    got = run_jit(sinkhorn, q, k, v, mask, causal=causal, **p)
    close_on_real(got, sinkhorn_reference(q, k, v, mask, causal, p), mask, tol=1e-9)
