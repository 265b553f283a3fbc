"""Reformer (shared-QK LSH attention) against a float64 reference written from its paper, and its one-bucket
limit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.reformer import reformer, rotations
from tests.attention_baselines.definitions import (
  B,
  D,
  H,
  L,
  close_on_real,
  inputs_at,
  run_jit,
  softmax_rows,
)


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
        w, lse = softmax_rows(s, vis)
        lses.append(lse)
        outs.append(w @ vv)
      wr, _ = softmax_rows(np.stack(lses, -1), np.isfinite(np.stack(lses, -1)))  # [L, rounds]
      out[bi, :, hi] = sum(wr[:, r:r + 1] * outs[r] for r in range(n_hashes))
  return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_hashes,n_buckets,chunk", [(2, 4, 5), (3, 6, 3)])
def test_reformer_matches_definition(causal, n_hashes, n_buckets, chunk):
  with jax.enable_x64(True):
    length = L
    q, _, v, mask = inputs_at(length, length + n_hashes)
    rng = jax.random.key(3)
    got = run_jit(reformer, q, q, v, mask, causal=causal, rng=rng, n_hashes=n_hashes, n_buckets=n_buckets,
               chunk_size=chunk)
    assert got.dtype == jnp.float64
    close_on_real(got, reformer_reference(q, v, mask, rng, causal, n_hashes, n_buckets, chunk), mask)


@pytest.mark.parametrize("causal", [False, True])
def test_reformer_one_bucket_is_shared_qk_dense(causal):
  """One bucket and one chunk: every key is visible, so LSH attention is dense attention with keys q/|q|,
  each token seeing itself only when nothing else is visible (the first token of a decoder)."""
  with jax.enable_x64(True):
    length = L
    q, _, v, mask = inputs_at(length, 5)
    got = run_jit(reformer, q, q, v, mask, causal=causal, rng=jax.random.key(0), n_hashes=2, n_buckets=1,
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
        w, _ = softmax_rows(s, others | (eye & ~others.any(-1, keepdims=True)))
        want[bi, :, hi] = w @ vn[bi, :, hi]
    close_on_real(got, want, mask)
