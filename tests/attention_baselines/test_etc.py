"""ETC global-local attention: the four pieces against their definition in float64 (relative position
biases, ragged segments and blocks, hard and full g2l), the full-radius case as dense attention over
[long; global] keys, the segment-mean global tokens, and the argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.etc import etc, segment_means
from tests.attention_baselines.definitions import masked_softmax


def _softmax_rows(logits, keep, values):
  logits = np.where(keep, logits, -np.inf)
  m = np.max(logits, axis=-1, keepdims=True)
  w = np.where(keep, np.exp(logits - np.where(np.isfinite(m), m, 0.0)), 0.0)
  den = w.sum(-1, keepdims=True)
  return (w / np.where(den > 0, den, 1.0)) @ values


def _reference(q, k, v, mask, gq, gk, gv, s, r, kd, bias, hard):
  """Both outputs from the definition: per (batch, head), the [L + g] graph's two softmaxes."""
  q, k, v, gq, gk, gv, bias = (np.asarray(x, np.float64) for x in (q, k, v, gq, gk, gv, bias))
  mask = np.asarray(mask)
  b, length, h, d = q.shape
  g = gk.shape[1]
  seg = np.arange(length) // s
  rel = lambda delta: np.clip(delta, -kd, kd) + kd  # noqa: E731
  pos, tpos = np.arange(length), np.arange(g)
  long_out, global_out = np.zeros(v.shape), np.zeros(gv.shape)
  for bi in range(b):
    seg_real = np.array([mask[bi][seg == t].any() for t in range(g)])
    for hi in range(h):
      bh = bias[hi if bias.shape[0] > 1 else 0]
      keys = np.concatenate([k[bi, :, hi], gk[bi, :, hi]])
      vals = np.concatenate([v[bi, :, hi], gv[bi, :, hi]])
      own = seg[:, None] == tpos[None, :]  # [L, g]
      lb = np.concatenate([bh[rel(pos[None, :] - pos[:, None])],
                           np.where(own, bh[2 * kd + 2], bh[2 * kd + 1])], axis=1)
      lkeep = np.concatenate([(np.abs(pos[None, :] - pos[:, None]) <= r) & mask[bi][None, :],
                              np.broadcast_to(seg_real[None, :], (length, g))], axis=1)
      long_out[bi, :, hi] = _softmax_rows(q[bi, :, hi] @ keys.T / np.sqrt(d) + lb, lkeep, vals)
      gb = np.concatenate([bh[rel(tpos[None, :] - tpos[:, None])], np.where(own.T, bh[2 * kd + 2],
                                                                            bh[2 * kd + 1])], axis=1)
      gkeep = np.concatenate([np.broadcast_to(seg_real[None, :], (g, g)),
                              (own.T if hard else np.ones((g, length), bool)) & mask[bi][None, :]],
                             axis=1)
      gkeys = np.concatenate([gk[bi, :, hi], k[bi, :, hi]])
      gvals = np.concatenate([gv[bi, :, hi], v[bi, :, hi]])
      global_out[bi, :, hi] = _softmax_rows(gq[bi, :, hi] @ gkeys.T / np.sqrt(d) + gb, gkeep, gvals)
  return long_out, global_out


def _inputs(seed, length, g, heads=2):
  """Long q, k [2, L, heads, 4], v [.., 3], a key mask (position 0 real), and global q, k, v for g
  tokens: numpy float64 (no random-number programs to compile)."""
  rng = np.random.default_rng(seed)
  q, k, gq, gk = (rng.normal(size=(2, n, heads, 4)) for n in (length, length, g, g))
  v, gv = (rng.normal(size=(2, n, heads, 3)) for n in (length, g))
  mask = rng.random((2, length)) < 0.75
  mask[:, 0] = True
  return q, k, v, mask, gq, gk, gv


# One case runs fast; full g2l and radius 0 run with the slow tests.
@pytest.mark.parametrize("length,s,r,kd,hard", [
    (13, 4, 2, 3, True),
    pytest.param(11, 3, 3, 1, False, marks=pytest.mark.slow),
    pytest.param(9, 2, 0, 2, True, marks=pytest.mark.slow)])
def test_etc_matches_definition(length, s, r, kd, hard):
  with jax.enable_x64(True):
    g = -(-length // s)
    q, k, v, mask, gq, gk, gv = _inputs(length + s, length, g)
    mask[1, :s] = False  # a segment without a real token: its global token is masked
    bias = np.random.default_rng(5).normal(size=(2, 2 * kd + 3))
    run = jax.jit(lambda q, k, v, m, gq, gk, gv, b: etc(
        q, k, v, causal=False, mask=m, segment_length=s, radius=r, max_distance=kd, rel_bias=b,
        global_q=gq, global_k=gk, global_v=gv, hard_g2l=hard, return_global=True))
    long_out, global_out = run(q, k, v, mask, gq, gk, gv, bias)
    want_long, want_global = _reference(q, k, v, mask, gq, gk, gv, s, r, kd, bias, hard)
    real = np.asarray(mask)[:, :, None, None]  # padded query rows are don't-care
    np.testing.assert_allclose(np.where(real, long_out, 0), np.where(real, want_long, 0), rtol=1e-10,
                               atol=1e-12)
    seg_real = np.array([[np.asarray(mask)[b, t * s:(t + 1) * s].any() for t in range(g)] for b in range(2)])
    np.testing.assert_allclose(np.where(seg_real[:, :, None, None], global_out, 0),
                               np.where(seg_real[:, :, None, None], want_global, 0), rtol=1e-10, atol=1e-12)


def test_etc_full_radius_is_dense_attention_over_long_and_global_keys():
  """r >= L, no bias, no global inputs: each long token's output is one softmax over every real long key and
  every global key (l2l + l2g), i.e. dense attention on the concatenated keys, whose global keys and values
  are the segments' masked means."""
  with jax.enable_x64(True):
    length, s = 10, 3
    q, k, v, mask, _, _, _ = _inputs(7, length, 0)
    mask[:, ::3] = True  # every segment keeps a real token
    out, got_means = jax.jit(lambda q, k, v, m: (
        etc(q, k, v, causal=False, mask=m, segment_length=s, radius=length, max_distance=2),
        segment_means(k, m, s)))(q, k, v, mask)
    real = np.asarray(mask)
    means = [np.stack([x[b, t:t + s][real[b, t:t + s]].mean(0) for t in range(0, length, s)])
             for x in (np.asarray(k), np.asarray(v)) for b in range(2)]
    gk, gv = np.stack(means[:2]), np.stack(means[2:])  # [batch, 4, heads, dim]
    keys, vals = np.concatenate([k, gk], axis=1), np.concatenate([v, gv], axis=1)
    qq = np.concatenate([q, np.zeros_like(gk)], axis=1)
    allowed = np.ones((length + 4, length + 4), bool)
    want = masked_softmax(qq, keys, vals, allowed, np.concatenate([real, np.ones((2, 4), bool)], axis=1))
    np.testing.assert_allclose(out, want[:, :length], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_means, gk, rtol=1e-12)


def test_etc_rejects_bad_arguments():
  q = k = v = jnp.zeros((2, 8, 2, 4))  # the checks fail before any compute
  with pytest.raises(ValueError, match="causal"):
    etc(q, k, v, causal=True)
  with pytest.raises(ValueError, match="segment_length"):
    etc(q, k, v, causal=False, segment_length=0)
  with pytest.raises(ValueError, match="radius"):
    etc(q, k, v, causal=False, radius=-1)
  with pytest.raises(ValueError, match="rel_bias"):
    etc(q, k, v, causal=False, max_distance=2, rel_bias=jnp.zeros((2, 5)))
  with pytest.raises(ValueError, match="global_k"):
    etc(q, k, v, causal=False, segment_length=4, global_k=jnp.zeros((2, 3, 2, 4)))


@pytest.mark.slow
def test_etc_module_attends_to_its_projected_segment_summaries():
  """The module's global keys and values are its own projections of the segments' masked mean inputs, and
  its bias table (zeros at first) reaches the op."""
  from flax import nnx

  from configs import base
  from models import registry

  cfg = base.attention_config("etc")
  cfg.params.update(segment_length=3, radius=2, max_distance=2)
  m = registry.build(cfg, features=8, num_heads=2, head_dim=4, causal=False, dtype=jnp.float32,
                     rngs=nnx.Rngs(0))
  assert m.rel_bias[...].shape == (2, 7)
  m.rel_bias[...] = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7)), jnp.float32)
  x = np.random.default_rng(0).normal(size=(2, 10, 8)).astype(np.float32)
  mask = np.ones((2, 10), bool)
  mask[1, 7:] = False

  @nnx.jit
  def both(m, x, mask):
    q, k, v = m.project(x)
    summary = segment_means(x, mask, 3)  # [batch, 4, features]
    want = m.out(etc(q, k, v, causal=False, mask=mask, segment_length=3, radius=2, max_distance=2,
                     rel_bias=m.rel_bias[...], global_k=m.global_key(summary),
                     global_v=m.global_value(summary)))
    return m(x, mask, deterministic=True), want

  got, want = both(m, x, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_etc_masked_keys_get_no_gradient():
  q, k, v, mask, _, _, _ = (np.asarray(x, np.float32) if x.dtype == np.float64 else x
                            for x in _inputs(2, 10, 0))
  bad = ~mask[:, :, None, None]

  def fn(k, v):
    long_out, global_out = etc(q, k, v, causal=False, mask=mask, segment_length=3, radius=2, max_distance=2,
                               hard_g2l=False, return_global=True)
    return jnp.sum(long_out ** 2) + jnp.sum(global_out ** 2)

  for g in jax.jit(jax.grad(fn, argnums=(0, 1)))(np.where(bad, np.nan, k), np.where(bad, np.inf, v)):
    assert np.all(np.isfinite(np.asarray(g)))
    assert not np.any(np.asarray(g)[bad[..., 0, 0]])
