"""Performer (FAVOR+): the op against its estimator and the reference implementation's formulas, its
orthogonal random features, the estimate's bias and error as features grow."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.dense import dense
from attention_baselines.performer import orthogonal_features, performer, softmax_kernel_features
from tests.attention_baselines.definitions import (
  inputs,
  kernel_attention,
)


@pytest.mark.parametrize("causal,chunk", [(False, 3), (False, 64),
                                          *(pytest.param(True, c, marks=pytest.mark.slow) for c in (3, 64))])
def test_performer_equals_its_estimator(causal, chunk):
  """The op's stabilised computation equals the unstabilised FAVOR+ estimator of the definition."""
  with jax.enable_x64(True):
    q, k, v, mask = inputs(1)
    w = orthogonal_features(jax.random.key(7), 10, 4, jnp.float64)
    out = performer(q, k, v, causal=causal, mask=mask, features=w, chunk_size=chunk)
    scale = 4 ** -0.25
    ref = kernel_attention(softmax_kernel_features(q * scale, w), softmax_kernel_features(k * scale, w), v,
                            causal, mask)
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-12)


def _google_style(q, k, v, w, causal, eps):
  """FAVOR+ with the feature-map stabilisation of google-research's `performer/fast_attention` (jax), written
  here from its formulas: queries exp(Wq' - |q'|^2/2 - max over features of Wq'), keys exp(Wk' - |k'|^2/2 -
  max over keys and features of Wk'), each plus `eps`, times m^-1/2; causal by a prefix sum over positions."""
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  d, m = q.shape[-1], w.shape[0]
  qs, ks = q * d ** -0.25, k * d ** -0.25
  qd, kd = np.einsum("blhd,md->blhm", qs, w), np.einsum("blhd,md->blhm", ks, w)
  qdiag, kdiag = (0.5 * np.sum(x * x, -1, keepdims=True) for x in (qs, ks))
  phi_q = (np.exp(qd - qdiag - qd.max(-1, keepdims=True)) + eps) / np.sqrt(m)
  phi_k = (np.exp(kd - kdiag - kd.max(axis=(1, 3), keepdims=True)) + eps) / np.sqrt(m)
  if causal:
    kv = np.cumsum(np.einsum("blhm,blhd->blhmd", phi_k, v), axis=1)
    num = np.einsum("blhm,blhmd->blhd", phi_q, kv)
    den = np.einsum("blhm,blhm->blh", phi_q, np.cumsum(phi_k, axis=1))
  else:
    num = np.einsum("blhm,bhmd->blhd", phi_q, np.einsum("blhm,blhd->bhmd", phi_k, v))
    den = np.einsum("blhm,bhm->blh", phi_q, phi_k.sum(1))
  return num / den[..., None]


@pytest.mark.parametrize("causal", [True, False])
def test_performer_agrees_with_the_reference_implementation_formulas(causal):
  with jax.enable_x64(True):
    q, k, v, _ = inputs(2, length=9)
    w = orthogonal_features(jax.random.key(3), 16, 4, jnp.float64)
    out = performer(q, k, v, causal=causal, features=w)
    np.testing.assert_allclose(out, _google_style(q, k, v, w, causal, eps=0.0), rtol=1e-9, atol=1e-12)
    # Its numerical stabiliser (a small constant added to every feature) moves the output only a little.
    np.testing.assert_allclose(out, _google_style(q, k, v, w, causal, eps=1e-6), atol=1e-3)


def test_orthogonal_features_are_orthogonal_gaussian_rows():
  w = np.asarray(orthogonal_features(jax.random.key(0), 10, 4))
  assert w.shape == (10, 4)
  for block in (w[0:4], w[4:8]):
    gram = block @ block.T
    np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-5)
  with pytest.raises(ValueError, match="num_features"):
    orthogonal_features(jax.random.key(0), 0, 4)


@pytest.mark.slow
def test_performer_kernel_estimate_is_unbiased_and_improves_with_features():
  with jax.enable_x64(True):
    ka, kb = jax.random.split(jax.random.key(5))
    a = 0.4 * jax.random.normal(ka, (5, 8), jnp.float64)
    b = 0.4 * jax.random.normal(kb, (5, 8), jnp.float64)
    exact = np.exp(np.asarray(a) @ np.asarray(b).T)  # [5, 5]

    @functools.partial(jax.jit, static_argnums=1)
    def estimates(keys, m):
      def draw(key):
        w = orthogonal_features(key, m, 8, jnp.float64)
        return softmax_kernel_features(a, w) @ softmax_kernel_features(b, w).T

      return jax.vmap(draw)(keys)  # [draws, 5, 5]

    keys = jax.random.split(jax.random.key(11), 1000)
    errors = []
    for m in (8, 32, 128):
      est = np.asarray(estimates(keys, m))
      mean, sem = est.mean(0), est.std(0) / np.sqrt(est.shape[0])
      assert np.all(np.abs(mean - exact) < 5 * sem + 1e-12)  # unbiased: within 5 standard errors everywhere
      errors.append(np.median(np.abs(est - exact)))  # the median: the estimate's tails are heavy
    assert errors[0] > 1.5 * errors[1] and errors[1] > 1.5 * errors[2]  # falls about as 1/sqrt(m)


@pytest.mark.slow
def test_performer_output_error_falls_with_features():
  q, k, v, mask = inputs(3, batch=1, length=32, head_dim=8, dtype=jnp.float32, scale=0.5)
  exact = dense(q, k, v, causal=False, mask=mask)
  err = []
  for m in (8, 64, 512):
    outs = [performer(q, k, v, causal=False, mask=mask, rng=jax.random.key(s), num_features=m)
            for s in range(4)]
    err.append(np.mean([float(jnp.mean((o - exact) ** 2)) for o in outs]))
  assert err[0] > err[1] > err[2]


def test_performer_rejects_bad_features():
  q, k, v, _ = inputs(0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="'rng'"):
    performer(q, k, v, causal=True)
  with pytest.raises(ValueError, match="'features'"):
    performer(q, k, v, causal=True, features=jnp.ones((8, 5)))
