"""The linear transformer (elu + 1 features) against its quadratic formula in float64, its hand-written
backwards against autodiff of the definition, its prefix sums and dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.linear import elu_feature_map, exclusive_prefix_sum, linear
from tests.attention_baselines.definitions import inputs, kernel_attention


def _elu_plus_one(x):
  x = np.asarray(x)
  return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


# Causal over several chunks is the slowest to compile: those cases run with the slow tests.
@pytest.mark.parametrize("length,chunk,causal", [
    pytest.param(length, chunk, causal, marks=pytest.mark.slow if causal and length > 1 else ())
    for length, chunk in [(1, 4), (11, 4), (12, 3)] for causal in (True, False)])
def test_linear_equals_its_quadratic_formula(causal, length, chunk):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(length, length=length)
    out = linear(q, k, v, causal=causal, mask=mask, chunk_size=chunk)
    assert out.dtype == jnp.float64 and out.shape == v.shape
    ref = kernel_attention(_elu_plus_one(q), _elu_plus_one(k), v, causal, mask)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)


def _linear_definition(q, k, v, mask, causal):
  """Linear attention from the definition, in jax (for autodiff): [b, n, h, *] in and out."""
  phi_q, phi_k = (jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0))) for x in (q, k))
  kern = jnp.einsum("bihd,bjhd->bhij", phi_q, phi_k) * mask[:, None, None, :]
  if causal:
    kern = kern * jnp.tril(jnp.ones(kern.shape[-2:]))
  return jnp.einsum("bhij,bjhe->bihe", kern, v) / jnp.sum(kern, -1).transpose(0, 2, 1)[..., None]


# Pairs of heads and a ragged causal chunk run with the fast tests, the other layouts with the slow ones.
LINEAR_GRADIENT_CASES = [
    pytest.param(*case, marks=() if case in {(False, 3, 4), (True, 3, 3)} else pytest.mark.slow)
    for case in [(False, 1, 4), (False, 2, 4), (False, 3, 4), (False, 8, 4), (True, 1, 4), (True, 3, 3),
                 (True, 1, 16)]]


@pytest.mark.parametrize("causal,row_chunks,chunk", LINEAR_GRADIENT_CASES)
def test_linear_gradients_equal_the_definitions(causal, row_chunks, chunk):
  """The op's hand-written backwards equal autodiff of the definition: bidirectionally in every block layout
  of batch x heads (one block; whole batches; pairs of heads; single rows), causally with ragged and single
  chunks; a masked key's NaN changes nothing and its k, v get zero gradient."""
  with jax.enable_x64(True):
    q, k, v, mask = inputs(5, batch=2, length=9, heads=4, head_dim=3, value_dim=2)
    cot = jax.random.normal(jax.random.key(6), v.shape, jnp.float64)
    clean_k, clean_v = (jnp.where(mask[:, :, None, None], x, 0.0) for x in (k, v))
    nan_k, nan_v = (jnp.where(mask[:, :, None, None], x, jnp.nan) for x in (k, v))

    def reference(q, k, v):
      return jnp.sum(_linear_definition(q, k, v, mask, causal) * cot)

    def loss(q, k, v):
      return jnp.sum(linear(q, k, v, causal=causal, mask=mask, row_chunks=row_chunks, chunk_size=chunk) * cot)

    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, clean_k, clean_v)
    got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, nan_k, nan_v)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for g, w in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert not np.any(grads[1][~np.asarray(mask)]) and not np.any(grads[2][~np.asarray(mask)])


def test_elu_feature_map_derivatives_equal_elu():
  """phi' = min(phi, 1) is elu's derivative (1 above zero, exp(x) at or below it, so 1 at zero), and its own
  derivative is elu's second (0 above zero, exp(x) below)."""
  with jax.enable_x64(True):
    x = jnp.array([-30.0, -2.0, -1e-9, 0.0, 1e-9, 0.5, 3.0])
    first = jax.vmap(jax.grad(elu_feature_map))(x)
    np.testing.assert_allclose(first, np.where(x > 0, 1.0, np.exp(x)), rtol=1e-15, atol=0)
    second = jax.vmap(jax.grad(jax.grad(elu_feature_map)))(x)
    np.testing.assert_allclose(second[x != 0], np.where(x > 0, 0.0, np.exp(x))[x != 0], rtol=1e-15, atol=0)


def test_exclusive_prefix_sum_is_exact_and_reads_no_later_slice():
  """out[:, i] = the sum of the slices before i (after i when reversed), for any count of slices; a NaN or
  Inf slice reaches only the outputs after it (before it when reversed), never through a zero weight."""
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 13, 3, 2)))
    forward = np.concatenate([np.zeros_like(x[:, :1]), np.cumsum(x, axis=1)[:, :-1]], axis=1)
    later = np.cumsum(x[:, ::-1], axis=1)[:, ::-1]
    backward = np.concatenate([later[:, 1:], np.zeros_like(x[:, :1])], axis=1)
    np.testing.assert_allclose(exclusive_prefix_sum(x), forward, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(exclusive_prefix_sum(x, reverse=True), backward, rtol=1e-12, atol=1e-12)
    bad = x.at[:, 7, 0, 0].set(jnp.inf).at[:, 7, 1, 1].set(jnp.nan)
    assert np.all(np.isfinite(exclusive_prefix_sum(bad)[:, :8]))
    assert np.all(np.isfinite(exclusive_prefix_sum(bad, reverse=True)[:, 7:]))
    assert np.all(np.isinf(exclusive_prefix_sum(bad)[:, 8:, 0, 0]))


def test_causal_linear_non_finite_value_shows_from_its_position_on():
  """A real key's NaN value: outputs before it are unchanged, outputs from it on are NaN (it is visible)."""
  q, k, v, _ = inputs(8, batch=1, length=11, heads=1, dtype=jnp.float32)
  out = linear(q, k, v, causal=True, chunk_size=4)
  bad = linear(q, k, v.at[0, 5, 0, 1].set(jnp.nan), causal=True, chunk_size=4)
  np.testing.assert_array_equal(bad[0, :5], out[0, :5])
  assert np.all(np.isnan(bad[0, 5:]))


@pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=pytest.mark.slow), jnp.float32])
def test_linear_bidirectional_keeps_input_dtypes(dtype):
  q, k, v, mask = inputs(3, dtype=dtype)
  out, vjp = jax.vjp(lambda q, k, v: linear(q, k, v, causal=False, mask=mask), q, k, v)
  assert out.dtype == dtype and all(g.dtype == dtype for g in vjp(out))
  want = linear(*(x.astype(jnp.float32) for x in (q, k, v)), causal=False, mask=mask)
  np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-6,
                             atol=2e-2 if dtype == jnp.bfloat16 else 1e-6)
