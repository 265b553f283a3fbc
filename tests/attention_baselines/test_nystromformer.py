"""Nystromformer against a float64 reference written from its paper, and its landmark-per-token limit."""

import jax
import numpy as np
import pytest

from attention_baselines.dense import dense
from attention_baselines.nystromformer import nystromformer
from tests.attention_baselines.definitions import L, close_on_real, inputs_at, run_jit, softmax_rows


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
      k1, _ = softmax_rows(qq @ kl.T / np.sqrt(d), True)
      a, _ = softmax_rows(ql @ kl.T / np.sqrt(d), True)
      k3, _ = softmax_rows(ql @ kk[real].T / np.sqrt(d), True)
      z = a.T / (np.abs(a).sum(0).max() * np.abs(a).sum(1).max())
      eye = np.eye(len(groups))
      for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
      out[bi, :, hi] = k1 @ z @ k3 @ vv
  return out


@pytest.mark.parametrize("m", [4, 5])
def test_nystromformer_matches_definition(m):
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = inputs_at(length, length + m)
    got = run_jit(nystromformer, q, k, v, mask, causal=False, num_landmarks=m)
    close_on_real(got, nystrom_reference(q, k, v, mask, m, 6), mask, tol=1e-9)


def test_nystromformer_with_a_landmark_per_token_is_dense():
  with jax.enable_x64(True):
    q, k, v, _ = inputs_at(8, 2)
    got = run_jit(nystromformer, q, k, v, None, causal=False, num_landmarks=8, pinv_iterations=40)
    np.testing.assert_allclose(got, dense(q, k, v, causal=False), rtol=1e-8, atol=1e-8)
    with pytest.raises(ValueError, match="'causal'"):
      nystromformer(q, k, v, causal=True)
