"""Adaptive span's derivative with respect to the spans where the soft mask has corners (whole-number
spans: a pair at x = z, where m leaves 1, or at x = z + R, where it leaves 0), against one-sided finite
differences of the float64 definition: the growing side at z = 0 and at every whole number below max_span,
the shrinking side at z = max_span, none outside the clamp; causal and bidirectional, with relative position
embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.adaptive_span import adaptive_span
from tests.attention_baselines.definitions import adaptive_span_reference as reference
from tests.attention_baselines.definitions import inputs

LENGTH, RAMP, MAX_SPAN, BLOCK = 16, 4.0, 8, 5  # blocks of 5: a ragged last one
OTHER = 2.7  # head 1's span: no pair on a corner


def _case(causal, seed):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(seed, length=LENGTH)
    w = jax.random.normal(jax.random.key(seed + 1), v.shape, jnp.float64)
    positions = jax.random.normal(jax.random.key(seed + 2), (2, 16, q.shape[-1]), jnp.float64) if causal \
        else None
  return q, k, v, mask, w, positions


def _loss_ref(case, spans, causal):
  q, k, v, mask, w, positions = case
  out = reference(q, k, v, mask, spans, positions, causal=causal, max_span=MAX_SPAN, ramp=RAMP)
  return float(np.sum(out * np.asarray(w)))


def _one_sided(case, spans, head, causal, side, h=1e-5):
  """Second-order one-sided difference of the definition's loss in spans[head]: side +1 growing, -1
  shrinking."""
  at = lambda dz: _loss_ref(case, np.asarray(spans) + dz * np.eye(2)[head], causal)  # noqa: E731
  return side * (-3 * at(0.0) + 4 * at(side * h) - at(2 * side * h)) / (2 * h)


@pytest.mark.parametrize("causal", [True, False])
def test_span_derivative_at_corners_is_the_documented_one_sided_one(causal):
  case = _case(causal, 3 if causal else 4)
  q, k, v, mask, w, positions = case
  with jax.enable_x64(True):
    grad = jax.jit(jax.grad(lambda z: jnp.sum(adaptive_span(
        q, k, v, mask=mask, spans=z, causal=causal, max_span=MAX_SPAN, ramp=RAMP, block_size=BLOCK,
        positions=positions) * w)))
    sides_differ = 0
    for z, side in ((0.0, 1), (1.0, 1), (2.0, 1), (RAMP, 1), (float(MAX_SPAN), -1)):
      spans = np.array([z, OTHER])
      got = np.asarray(grad(jnp.asarray(spans)))
      want = _one_sided(case, spans, 0, causal, side)
      np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-9, err_msg=f"z = {z}")
      if z > 0:  # the other side differs: the corners matter and the test can tell them apart
        sides_differ += abs(want - _one_sided(case, spans, 0, causal, -side)) > 1e-3 * abs(want)
      # head 1 sits between corners: both sides agree with the op
      np.testing.assert_allclose(got[1], _one_sided(case, spans, 1, causal, 1), rtol=1e-6, atol=1e-9)
    assert sides_differ >= 3
    # outside the clamp the span does not move the output
    np.testing.assert_array_equal(np.asarray(grad(jnp.array([-1.0, MAX_SPAN + 1.0]))), [0.0, 0.0])
