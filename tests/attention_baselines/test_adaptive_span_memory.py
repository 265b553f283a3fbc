"""Adaptive attention span over [memory; segment] (attention_baselines/adaptive_span.py with keys M longer
than the queries, query i at position M + i) against its definition in numpy float64: forward and gradients
(q, k, v and the spans) with masked memory and segment keys, odd lengths, a memory not a whole number of
blocks and one longer than any span reaches; M = 0 through the same reference; keys beyond max z + R of every
query (memory keys dropped statically, then key blocks beyond the trip count) are never read."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.adaptive_span import adaptive_span
from tests.attention_baselines.definitions import adaptive_span_jax_reference as jax_reference
from tests.attention_baselines.definitions import adaptive_span_reference as reference

PLAN = dict(max_span=9, ramp=2.5)  # no key at distance >= ceil(9 + 2.5) = 12 is ever seen
SPANS = np.array([1.3, 6.6])  # two heads, max z + R = 9.1: keys at distance >= 10 unseen


def memory_inputs(seed, *, memory, length, batch=2, heads=2, head_dim=3, value_dim=2):
  """float64 q [batch, L, ...], k, v [batch, M + L, ...] and a key mask [batch, M + L]: row 0 all real,
  row 1 with its first memory keys invalid (a stream that restarted) and one segment key masked."""
  g = np.random.default_rng(seed)
  q = jnp.asarray(g.normal(size=(batch, length, heads, head_dim)))
  k = jnp.asarray(g.normal(size=(batch, memory + length, heads, head_dim)))
  v = jnp.asarray(g.normal(size=(batch, memory + length, heads, value_dim)))
  mask = np.ones((batch, memory + length), bool)
  mask[1, :memory // 2] = False
  mask[1, memory + length // 2] = False
  return q, k, v, jnp.asarray(mask)


@functools.cache
def _grads(fn, **kw):
  """jit((q, k, v, spans, mask, cot) -> (gradients of sum(out * cot) w.r.t. q, k, v, spans; out))."""

  def loss(q, k, v, z, mask, cot):
    out = fn(q, k, v, mask=mask, spans=z, causal=True, **PLAN, **kw)
    return jnp.sum(out * cot), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


# M = 20 > 11 = the farthest distance any span reaches: the first 9 memory keys are dropped before the loop,
# and the 11 kept (with 1 zero key in front) fill 3 blocks of 4. The other cases are slow: one compilation
# each (M = 0 is also the fast case of tests/attention_baselines/test_adaptive_span.py).
@pytest.mark.parametrize("memory,length,block", [(20, 11, 4), pytest.param(0, 11, 4, marks=pytest.mark.slow),
                                                 pytest.param(5, 7, 3, marks=pytest.mark.slow),
                                                 pytest.param(3, 9, 64, marks=pytest.mark.slow)])
def test_memory_forward_and_gradients_equal_the_definition(memory, length, block):
  with jax.enable_x64(True):
    q, k, v, mask = memory_inputs(memory + length, memory=memory, length=length)
    spans = jnp.asarray(SPANS)
    cot = jax.random.normal(jax.random.key(1), (*q.shape[:3], v.shape[-1]), jnp.float64)
    want = reference(q, k, v, mask, spans, causal=True, **PLAN)
    want_grads, want_out = _grads(jax_reference)(q, k, v, spans, mask, cot)
    np.testing.assert_allclose(want_out, want, rtol=1e-12, atol=1e-12)  # the two references agree
    assert np.all(np.abs(np.asarray(want_grads[3])) > 1e-3)  # every head's span is in the gradient
    if memory:
      assert np.any(np.asarray(want_grads[1])[:, :memory])  # the memory is read
    got_grads, got = _grads(adaptive_span, block_size=block)(q, k, v, spans, mask, cot)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_keys_beyond_the_largest_span_are_never_read():
  """M = 20, L = 11 (the fast case above, its compilation shared): keys 0 .. 10 are at distance >= 10 >
  max z + R = 9.1 from every query (0 .. 8 dropped statically; 9 and 10 in a key block the loop reaches,
  masked by the span). NaN and Inf planted there change no output, leave every gradient finite, and give
  them zero gradient."""
  with jax.enable_x64(True):
    q, k, v, mask = memory_inputs(31, memory=20, length=11)
    z = jnp.asarray(SPANS)
    cot = jax.random.normal(jax.random.key(2), (*q.shape[:3], v.shape[-1]), jnp.float64)
    far = jnp.arange(31)[None, :, None, None] <= 10
    run = _grads(adaptive_span, block_size=4)
    clean_grads, clean = run(q, k, v, z, mask, cot)
    grads, dirty = run(q, jnp.where(far, jnp.nan, k), jnp.where(far, jnp.inf, v), z, mask, cot)
    np.testing.assert_array_equal(dirty, clean)
    for g, c in zip(grads, clean_grads, strict=True):
      np.testing.assert_array_equal(g, c)
    assert not np.any(np.asarray(grads[1])[:, :11]) and not np.any(np.asarray(grads[2])[:, :11])
    assert np.any(np.asarray(grads[1])[:, 11])  # the nearest key a span reaches is read


def test_a_memory_needs_causal_and_queries_no_longer_than_keys():
  q = np.ones((1, 5, 2, 3), np.float32)
  k = np.ones((1, 8, 2, 3), np.float32)
  with pytest.raises(ValueError, match="causal=True"):
    adaptive_span(q, k, k, causal=False, spans=jnp.ones(2), max_span=4)
  with pytest.raises(ValueError, match="'q'"):
    adaptive_span(k, q, q, causal=True, spans=jnp.ones(2), max_span=4)
  with pytest.raises(ValueError, match="'mask'"):
    adaptive_span(q, k, k, causal=True, mask=np.ones((1, 5), bool), spans=jnp.ones(2), max_span=4)
