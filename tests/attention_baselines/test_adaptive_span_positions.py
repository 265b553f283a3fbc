"""Adaptive attention span with the paper's learned relative position embeddings (`positions`, p_x for
distance x: s_ij = q_i . (k_j + p_{x_ij}) / sqrt(d)) against its definition in numpy float64: forward and
gradients (q, k, v, the spans and p) with key masks, odd lengths, ragged blocks, a memory, causal and
bidirectional (p_{|i - j|}); keys and embeddings beyond max z + R are never read; decoding with p equals the
forward pass; the module's `relative_positions` (its p reaches the op, receives gradient, the span penalty
is unchanged)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_baselines.adaptive_span import adaptive_span
from attention_baselines.adaptive_span_decode import ADAPTIVE_SPAN
from configs import adaptive_span as paper
from configs import base
from models import registry, transformer
from tests.attention_baselines.definitions import adaptive_span_jax_reference as jax_reference
from tests.attention_baselines.definitions import adaptive_span_reference as reference

PLAN = dict(max_span=9, ramp=2.5)  # distances 0 .. ceil(9 + 2.5) - 1 = 11 have an embedding
DISTANCES = 12
SPANS = np.array([1.3, 6.6])  # two heads, max z + R = 9.1: keys at distance >= 10 unseen


def _inputs(seed, *, memory, length, shared, batch=2, heads=2, head_dim=3, value_dim=2):
  """float64 q [batch, L, ...], k, v [batch, M + L, ...], a key mask (row 1: its first memory keys and one
  segment key invalid) and positions [1 or heads, DISTANCES, head_dim]."""
  g = np.random.default_rng(seed)
  q = jnp.asarray(g.normal(size=(batch, length, heads, head_dim)))
  k = jnp.asarray(g.normal(size=(batch, memory + length, heads, head_dim)))
  v = jnp.asarray(g.normal(size=(batch, memory + length, heads, value_dim)))
  p = jnp.asarray(g.normal(size=(1 if shared else heads, DISTANCES, head_dim)))
  mask = np.ones((batch, memory + length), bool)
  mask[1, :memory // 2] = False
  mask[1, memory + length // 2] = False
  return q, k, v, jnp.asarray(mask), p


@functools.cache
def _grads(fn, causal, **kw):
  """jit((q, k, v, spans, positions, mask, cot) -> (gradients of sum(out * cot) w.r.t. q, k, v, spans,
  positions; out))."""

  def loss(q, k, v, z, p, mask, cot):
    out = fn(q, k, v, mask=mask, spans=z, positions=p, causal=causal, **PLAN, **kw)
    return jnp.sum(out * cot), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


# The fast case has a memory longer than any span reaches (M = 20: 9 keys dropped before the loop, 1 zero
# key in front of the rest), odd L and ragged blocks of 4; the others are one compilation each.
@pytest.mark.parametrize("causal,memory,length,block,shared", [
    (True, 20, 11, 4, True),
    pytest.param(True, 0, 13, 5, False, marks=pytest.mark.slow),
    pytest.param(False, 0, 13, 4, True, marks=pytest.mark.slow),
    pytest.param(True, 5, 7, 3, False, marks=pytest.mark.slow),
    pytest.param(True, 3, 9, 64, True, marks=pytest.mark.slow)])
def test_forward_and_gradients_with_positions_equal_the_definition(causal, memory, length, block, shared):
  with jax.enable_x64(True):
    q, k, v, mask, p = _inputs(memory + length, memory=memory, length=length, shared=shared)
    spans = jnp.asarray(SPANS)
    cot = jax.random.normal(jax.random.key(1), (*q.shape[:3], v.shape[-1]), jnp.float64)
    cot = cot * mask[:, memory:, None, None]  # real query rows only (padded rows are don't-care)
    want = reference(q, k, v, mask, spans, p, causal=causal, **PLAN)
    want_grads, want_out = _grads(jax_reference, causal)(q, k, v, spans, p, mask, cot)
    real = np.asarray(mask)[:, memory:, None, None]
    np.testing.assert_allclose(np.where(real, want_out, 0), np.where(real, want, 0), rtol=1e-12, atol=1e-12)
    assert np.all(np.abs(np.asarray(want_grads[3])) > 1e-3)  # every head's span is in the gradient
    reach = [10] if shared else [4, 10]  # distances x < z + R: 3.8 and 9.1
    for h, r in enumerate(reach):  # so is every distance a span reaches
      assert np.all(np.abs(np.asarray(want_grads[4])[h, :r]) > 0)
    got_grads, got = _grads(adaptive_span, causal, block_size=block)(q, k, v, spans, p, mask, cot)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_keys_and_embeddings_beyond_the_largest_span_are_never_read():
  """The fast case above (its compilation shared): keys 0 .. 10 are at distance >= 10 > max z + R = 9.1 from
  every query, and so are the embeddings of distances >= 10. NaN and Inf planted there change no output,
  leave every gradient finite, and get zero gradient."""
  with jax.enable_x64(True):
    q, k, v, mask, p = _inputs(31, memory=20, length=11, shared=True)
    z = jnp.asarray(SPANS)
    cot = jax.random.normal(jax.random.key(2), (*q.shape[:3], v.shape[-1]), jnp.float64)
    far = jnp.arange(31)[None, :, None, None] <= 10
    run = _grads(adaptive_span, True, block_size=4)
    clean_grads, clean = run(q, k, v, z, p, mask, cot)
    dirty_p = p.at[:, 10:].set(jnp.nan)
    grads, dirty = run(q, jnp.where(far, jnp.nan, k), jnp.where(far, jnp.inf, v), z, dirty_p, mask, cot)
    np.testing.assert_array_equal(dirty, clean)
    for g, c in zip(grads, clean_grads, strict=True):
      np.testing.assert_array_equal(g, c)
    assert not np.any(np.asarray(grads[1])[:, :11]) and not np.any(np.asarray(grads[2])[:, :11])
    assert not np.any(np.asarray(grads[4])[:, 10:]) and np.all(np.asarray(grads[4])[:, :10] != 0)


@pytest.mark.slow  # fast: tests/attention_core/test_decode.py steps the decoder with the registry's p
def test_decoding_with_positions_equals_the_forward_pass():
  """A ring of 12 slots, fewer than the 19 tokens; positions per head; prefill 7, then step."""
  g = np.random.default_rng(5)
  q, k, v = (jnp.asarray(g.normal(size=(2, 19, 2, d)), jnp.float32) for d in (4, 4, 3))
  p = jnp.asarray(g.normal(size=(2, DISTANCES, 4)), jnp.float32)
  z = jnp.array([7.9, 2.2])
  kw = dict(spans=z, positions=p, **PLAN)

  @jax.jit
  def run(q, k, v):
    full = adaptive_span(q, k, v, causal=True, block_size=4, **kw)
    cache = ADAPTIVE_SPAN.init_cache(2, 2, 19, 4, 3, jnp.float32, **PLAN)
    cache = ADAPTIVE_SPAN.prefill(cache, q[:, :7], k[:, :7], v[:, :7], **kw)

    def body(cache, t):
      at = lambda x: jax.lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)  # noqa: E731
      out, cache = ADAPTIVE_SPAN.step(cache, at(q), at(k), at(v), t, **kw)
      return cache, out

    _, outs = jax.lax.scan(body, cache, jnp.arange(7, 19))
    return full, jnp.swapaxes(outs, 0, 1)

  full, stepped = run(q, k, v)
  np.testing.assert_allclose(stepped, full[:, 7:], rtol=1e-5, atol=1e-5)


def test_bad_positions_are_named():
  q = k = v = np.ones((1, 5, 2, 3), np.float32)
  for p in (np.ones((2, 7, 3)), np.ones((3, 8, 3)), np.ones((2, 8, 4)), np.ones((8, 3))):  # window 4 + 4 = 8
    with pytest.raises(ValueError, match="'positions'"):
      adaptive_span(q, k, v, causal=True, spans=jnp.ones(2), max_span=4, ramp=4, positions=p)


# -- the module ------------------------------------------------------------------------------------------


def test_module_passes_its_positions_and_they_receive_gradient():
  """relative_positions: p [ceil(max_span + R), head_dim] shared by the heads; the module (with a memory) is
  the op called with its weights, spans and p; p, the spans and the projections receive gradient; the sown
  penalty is still span_loss * mean_h z_h."""
  cfg = base.attention_config("adaptive_span")
  cfg.params.max_span, cfg.params.ramp = 6, 2
  cfg.span_init, cfg.span_loss, cfg.relative_positions = 0.7, 1e-3, True
  m = registry.build(cfg, features=8, num_heads=2, head_dim=4, causal=True, dtype=jnp.float32,
                     rngs=nnx.Rngs(0), seq_len=5)
  assert m.positions[...].shape == (8, 4)
  m.span_ratio[...] = jnp.asarray([0.3, 0.8])  # spans 1.8 and 4.8
  g = np.random.default_rng(2)
  x = jnp.asarray(g.normal(size=(2, 5, 8)), jnp.float32)
  memory = jnp.asarray(g.normal(size=(2, 4, 8)), jnp.float32)
  mask = jnp.asarray([[True] * 5, [True] * 3 + [False] * 2])
  graphdef, params, rest = nnx.split(m, nnx.Param, ...)

  @jax.jit
  def both(params):
    def loss(params):
      m = nnx.merge(graphdef, params, rest, copy=True)
      y = m(x, mask, deterministic=True, memory=memory)  # [batch, L, features]
      (penalty,) = jax.tree.leaves(nnx.pop(m, nnx.Intermediate))
      return jnp.sum(y[0] ** 2) + jnp.sum(y[1, :3] ** 2), (y, penalty)

    m = nnx.merge(graphdef, params, rest, copy=True)
    context = jnp.concatenate([memory, x], axis=1)  # [batch, M + L, features]
    keys = jnp.concatenate([jnp.ones((2, 4), bool), mask], axis=1)
    p = jnp.broadcast_to(m.positions[...][None], (2, 8, 4))
    o = adaptive_span(m.query(x), m.key(context), m.value(context), causal=True, mask=keys, spans=m.spans(),
                      positions=p, max_span=6, ramp=2.0)  # [batch, L, heads, head_dim]
    return jax.grad(loss, has_aux=True)(params), m.out(o)

  (grads, (got, penalty)), want = both(params)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(penalty, 1e-3 * (1.8 + 4.8) / 2, rtol=1e-6)
  assert np.all(np.abs(np.asarray(grads["positions"][...])[:6]) > 0)  # distances up to max z + R = 6.8
  assert np.all(np.abs(np.asarray(grads["span_ratio"][...])) > 0)


def test_relative_positions_are_off_by_default_and_on_in_the_paper_config():
  cfg = base.attention_config("adaptive_span")
  m = registry.build(cfg, features=8, num_heads=2, head_dim=4, causal=True, dtype=jnp.float32,
                     rngs=nnx.Rngs(0), seq_len=5)
  assert not m.relative_positions and not hasattr(m, "positions")
  c = paper.get_config("smoke")
  assert c.model.attention.relative_positions and c.model.position_embedding == "none"


@pytest.mark.slow  # a whole model compiled twice and decoded token by token
def test_model_with_positions_decodes_as_it_runs_forward(decoding_matches_forward):
  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 1, 16, 2, 32
  cfg.position_embedding = "none"
  cfg.attention = base.attention_config("adaptive_span")
  cfg.attention.params.max_span, cfg.attention.params.ramp, cfg.attention.params.block_size = 5, 2, 4
  cfg.attention.span_init, cfg.attention.relative_positions = 0.6, True
  model = transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=12)
  decoding_matches_forward(model, 12)
