"""Shared by the baseline tests: random inputs, and attention written from its definition in numpy float64
(softmax attention under a visibility pattern; kernel attention with explicit feature maps)."""

import math

import jax
import jax.numpy as jnp
import numpy as np


def inputs(key, batch=2, length=11, heads=2, head_dim=4, value_dim=3, dtype=jnp.float64, scale=1.0):
  ks = jax.random.split(jax.random.key(key), 4)
  q, k = (scale * jax.random.normal(kk, (batch, length, heads, head_dim), dtype) for kk in ks[:2])
  v = jax.random.normal(ks[2], (batch, length, heads, value_dim), dtype)
  mask = jax.random.bernoulli(ks[3], 0.75, (batch, length)).at[:, 0].set(True)
  return q, k, v, mask


def causal_allowed(n, causal):
  """[n, n] bool: which keys query i may see, by direction alone."""
  return np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)


def masked_softmax(q, k, v, allowed, mask):
  """Softmax attention in numpy float64 where `allowed[i, j]` (ANDed with the key mask) says i may see j."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, n, h, d = q.shape
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      s = q[bi, :, hi] @ k[bi, :, hi].T / np.sqrt(d)
      keep = allowed & np.asarray(mask[bi])[None, :]
      s = np.where(keep, s, -np.inf)
      m = np.max(s, axis=-1, keepdims=True)
      w = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
      den = w.sum(-1, keepdims=True)
      out[bi, :, hi] = (w / np.where(den > 0, den, 1.0)) @ v[bi, :, hi]
  return out


def kernel_attention(phi_q, phi_k, v, causal, mask):
  """out_i = sum_j K_ij v_j / sum_j K_ij with K_ij = phi(q_i).phi(k_j) over visible j, from the definition."""
  phi_q, phi_k, v = (np.asarray(x, np.float64) for x in (phi_q, phi_k, v))
  b, n, h, _ = phi_q.shape
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      kern = phi_q[bi, :, hi] @ phi_k[bi, :, hi].T  # [n, n]
      keep = np.asarray(mask[bi])[None, :] & (np.tril(np.ones((n, n), bool)) if causal else True)
      kern = np.where(keep, kern, 0.0)
      out[bi, :, hi] = kern @ v[bi, :, hi] / kern.sum(-1, keepdims=True)
  return out


def causal_tril(n):
  return np.tril(np.ones((n, n), bool))


# The tests of the ops whose parameters are sized to the sequence (Linformer, Sinkhorn, Synthesizer) or hashed
# (Reformer) run at one shape, so compilations are shared.
B, H, D, DV = 2, 2, 4, 3
L = 12  # one length for most tests, so compilations are shared


def run_jit(op, q, k, v, mask, **kwargs):
  """op under jit (one compilation instead of one per primitive); array arguments become constants."""
  return jax.jit(lambda q, k, v, mask: op(q, k, v, mask=mask, **kwargs))(q, k, v, mask)


def inputs_at(length, seed, dtype=jnp.float64, p_mask=0.75):
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k = (jax.random.normal(kk, (B, length, H, D), dtype) for kk in ks[:2])
  v = jax.random.normal(ks[2], (B, length, H, DV), dtype)
  mask = jax.random.bernoulli(ks[3], p_mask, (B, length)).at[:, 0].set(True)
  return q, k, v, mask


def softmax_rows(s, vis):
  """Masked softmax rows (zeros where nothing is visible) and their log-sum-exp (-inf there)."""
  s = np.where(vis, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  w = np.exp(s - m)
  den = w.sum(-1, keepdims=True)
  lse = np.where(den[..., 0] > 0, np.log(np.where(den > 0, den, 1.0))[..., 0] + m[..., 0], -np.inf)
  return w / np.where(den > 0, den, 1.0), lse


def close_on_real(got, want, mask, tol=1e-10):
  m = np.asarray(mask)[:, :, None, None]
  np.testing.assert_allclose(np.where(m, got, 0.0), np.where(m, want, 0.0), rtol=tol, atol=tol)


def sinkhorn_params(length, block, seed=9, hidden=5):
  ks = jax.random.split(jax.random.key(seed), 4)
  n = -(-length // block) + 1  # one spare output: only the first ceil(L / block) are used
  return dict(block_size=block, sort_w1=jax.random.normal(ks[0], (H, D, hidden), float),
              sort_b1=jax.random.normal(ks[1], (1, hidden), float),
              sort_w2=jax.random.normal(ks[2], (1, hidden, n), float),
              sort_b2=jax.random.normal(ks[3], (H, n), float), sinkhorn_iters=4, temperature=0.75)


def synth_params(length, seed=11, hidden=6):
  ks = jax.random.split(jax.random.key(seed), 5)
  return (dict(w1=jax.random.normal(ks[0], (H, D, hidden), jnp.float64),
               b1=jax.random.normal(ks[1], (H, hidden), jnp.float64),
               w2=jax.random.normal(ks[2], (1, hidden, length + 2), jnp.float64),
               b2=jax.random.normal(ks[3], (H, length + 2), jnp.float64)),
          dict(logits=jax.random.normal(ks[4], (H, length + 1, length + 1), jnp.float64)))


def assert_masked_nonfinite_inert(fn, k, v, mask):
  """fn(k, v) with NaN keys and Inf values at masked positions equals fn on the clean inputs, and its
  gradients are finite and zero at the masked positions. mask: [batch, length] bool, True = real."""
  bad = ~mask[:, :, None, None]
  kn, vn = jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v)
  np.testing.assert_allclose(fn(kn, vn), fn(k, v), rtol=1e-6, atol=1e-6)
  grads = jax.jit(jax.grad(lambda k, v: jnp.sum(fn(k, v) ** 2), argnums=(0, 1)))(kn, vn)
  for g in grads:
    g = np.asarray(g)
    assert np.all(np.isfinite(g)) and not np.any(g[~np.asarray(mask)])


def adaptive_span_reference(q, k, v, mask, spans, positions=None, *, causal, max_span, ramp):
  """Adaptive span over [memory; segment] from its definition, explicit loops in numpy float64:
  a_ij = m_z(x) exp(s_ij) / sum_k m_z(x_ik) exp(s_ik), m_z(x) = clip((R + z - x) / R, 0, 1), over the real
  keys j <= M + i (causal) or every j, x = (M + i) - j or |i - j|; s_ij = q_i . (k_j + p_x) / sqrt(d) with
  positions p [heads or 1, P, head_dim], or q_i . k_j / sqrt(d) without; a row with no key is zeros."""
  q, k, v, spans = (np.asarray(x, np.float64) for x in (q, k, v, spans))
  p = None if positions is None else np.asarray(positions, np.float64)
  mask = np.asarray(mask, bool)
  b_, n, h_, d = q.shape
  total = k.shape[1]
  memory = total - n
  out = np.zeros((b_, n, h_, v.shape[-1]))
  for b in range(b_):
    for h in range(h_):
      z = min(max(spans[h], 0.0), max_span)
      for i in range(n):
        w = np.zeros(total)
        logits = {}
        for j in range(total):
          x = memory + i - j
          if (causal and x < 0) or not mask[b, j]:
            continue
          x = abs(x)
          m = min(max((ramp + z - x) / ramp, 0.0), 1.0)
          if m > 0:
            key = k[b, j, h] if p is None else k[b, j, h] + p[h % p.shape[0], x]
            logits[j] = (m, q[b, i, h] @ key / math.sqrt(d))
        if logits:
          top = max(s for _, s in logits.values())
          for j, (m, s) in logits.items():
            w[j] = m * math.exp(s - top)
          out[b, i, h] = w @ v[b, :, h] / w.sum()
  return out


def adaptive_span_jax_reference(q, k, v, mask, spans, positions=None, *, causal, max_span, ramp):
  """adaptive_span_reference as one dense jnp expression (p gathered per pair), for float64 autodiff."""
  n, total, d = q.shape[1], k.shape[1], q.shape[-1]
  z = jnp.clip(spans, 0.0, max_span)
  dist = (total - n + jnp.arange(n)[:, None]) - jnp.arange(total)[None, :]  # (M + i) - j: [L, M + L]
  x = dist if causal else jnp.abs(dist)
  s = jnp.einsum("bihd,bjhd->bhij", q, k)  # [batch, heads, L, M + L]
  if positions is not None:
    p = jnp.broadcast_to(positions, (q.shape[2], *positions.shape[1:]))  # [heads, P, head_dim]
    pair = p[:, jnp.clip(x, 0, p.shape[1] - 1)]  # [heads, L, M + L, head_dim]
    s = s + jnp.einsum("bihd,hijd->bhij", q, pair)
  s = s / math.sqrt(d)
  m = jnp.clip((ramp + z[:, None, None] - x) / ramp, 0.0, 1.0)  # [heads, L, M + L]
  ok = mask[:, None, None, :] & (m > 0)[None]
  if causal:
    ok = ok & (dist >= 0)
  s = jnp.where(ok, s, -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
  w = jnp.where(ok, m[None] * jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  total_w = jnp.sum(w, -1, keepdims=True)
  return jnp.einsum("bhij,bjhd->bihd", w / jnp.where(total_w > 0, total_w, 1.0), v)
