"""Dense baseline: matches a from-definition softmax in float64, causal and key masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from baselines.dense import dense


def _reference(q, k, v, causal, mask):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h, d = q.shape
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      s = q[bi, :, hi] @ k[bi, :, hi].T / np.sqrt(d)
      keep = np.asarray(mask[bi])[None, :] & (np.tril(np.ones((n, n), bool)) if causal else True)
      s = np.where(keep, s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      w = w / w.sum(-1, keepdims=True)
      out[bi, :, hi] = w @ v[bi, :, hi]
  return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 3, 8])
def test_dense_matches_definition(causal, length):
  with jax.enable_x64(True):
    ks = jax.random.split(jax.random.key(length), 4)
    q, k = (jax.random.normal(kk, (2, length, 3, 4), jnp.float64) for kk in ks[:2])
    v = jax.random.normal(ks[2], (2, length, 3, 5), jnp.float64)
    mask = jax.random.bernoulli(ks[3], 0.7, (2, length)).at[:, 0].set(True)
    out = dense(q, k, v, causal=causal, mask=mask)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, _reference(q, k, v, causal, mask), rtol=1e-10, atol=1e-12)


def test_dense_rejects_bad_input():
  q = jnp.ones((1, 4, 2, 3))
  with pytest.raises(ValueError, match="'v'"):
    dense(q, q, jnp.ones((1, 5, 2, 3)), causal=True)
  with pytest.raises(ValueError, match="'mask'"):
    dense(q, q, q, causal=True, mask=jnp.ones((1, 3), bool))
  with pytest.raises(TypeError, match="'q'"):
    dense([1, 2], q, q, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_xla_matches_dense(causal):
  from baselines.dense import dense_xla
  ks = jax.random.split(jax.random.key(7), 4)
  q, k, v = (jax.random.normal(kk, (2, 6, 2, 4)) for kk in ks[:3])
  mask = jnp.array([[True] * 6, [True, True, False, True, False, False]])
  np.testing.assert_allclose(dense_xla(q, k, v, causal=causal, mask=mask), dense(q, k, v, causal=causal, mask=mask),
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="'v'"):
    dense_xla(q, k, jnp.ones((2, 6, 2, 5)), causal=causal)
