"""Transformer-XL attention: the op equals its definition written with the relative embedding of every
(query, key) pair materialised (float64; memory M > 0 and M = 0, clamp_len, key masks), one-hot values read
its attention matrix, outputs never depend on later positions, masked memory holding NaN changes nothing,
decoding one token at a time equals the op, and bad arguments are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.transformer_xl import rel_shift, sinusoid, transformer_xl
from attention_baselines.transformer_xl_decode import TRANSFORMER_XL

# One compiled program per shape and plan: op by op (eager) dispatch compiles every primitive on its own.
op = jax.jit(transformer_xl, static_argnames=("causal", "clamp_len"))


def _inputs(seed, *, batch=2, length=5, memory=3, heads=2, head_dim=4, value_dim=3, mask_rate=0.3):
  """Fresh float64 q [b, L, h, d], k [b, M + L, h, d], v [b, M + L, h, dv], mask [b, M + L] and weights
  r [M + L, h, d], u, v_bias [h, d]."""
  g = np.random.default_rng(seed)
  total = memory + length
  q = g.normal(size=(batch, length, heads, head_dim))
  k = g.normal(size=(batch, total, heads, head_dim))
  v = g.normal(size=(batch, total, heads, value_dim))
  mask = g.random((batch, total)) > mask_rate
  weights = dict(r=g.normal(size=(total, heads, head_dim)), u=g.normal(size=(heads, head_dim)),
                 v_bias=g.normal(size=(heads, head_dim)))
  return q, k, v, mask, weights


def reference_weights(q, k, mask, r, u, v_bias, clamp_len=-1):
  """The attention matrix from the definition, [batch, heads, L, M + L] float64: for each pair the relative
  embedding R_{(M+i)-j} (clamped) is looked up, s_ij = ((q_i + u).k_j + (q_i + v).R_{(M+i)-j}) / sqrt(d) over
  the real keys j <= M + i, one softmax; rows with no such key are zeros."""
  batch, length, heads, head_dim = q.shape
  total = k.shape[1]
  memory = total - length
  out = np.zeros((batch, heads, length, total))
  for b in range(batch):
    for h in range(heads):
      for i in range(length):
        logits = np.full(total, -np.inf)
        for j in range(memory + i + 1):
          if not mask[b, j]:
            continue
          d = memory + i - j
          rel = r[d if clamp_len < 0 else min(d, clamp_len), h]  # the materialised R_{i-j}
          logits[j] = ((q[b, i, h] + u[h]) @ k[b, j, h] + (q[b, i, h] + v_bias[h]) @ rel) / np.sqrt(head_dim)
        if np.isfinite(logits).any():
          w = np.exp(logits - logits.max())
          out[b, h, i] = w / w.sum()
  return out


def reference(q, k, v, mask, r, u, v_bias, clamp_len=-1):
  a = reference_weights(q, k, mask, r, u, v_bias, clamp_len)  # [batch, heads, L, M + L]
  return np.einsum("bhij,bjhd->bihd", a, v)  # [batch, L, heads, value_dim]


CASES = [  # (memory, length, clamp_len, masked)
    (3, 5, -1, True),  # memory, ragged masks (a row may see no real key)
    (0, 6, -1, False),  # no memory, no mask
    (4, 4, 2, True),  # clamp below the longest distance
    (2, 5, 0, False),  # every distance uses r_0
    (5, 1, -1, True),  # one query over a long memory
]


def test_op_equals_definition():
  with jax.enable_x64(True):
    for seed, (memory, length, clamp, masked) in enumerate(CASES):
      q, k, v, mask, w = _inputs(seed, memory=memory, length=length, mask_rate=0.3 if masked else 0.0)
      if masked:
        mask[1, :memory + 1] = False  # query 0 of row 1 sees no real key: its output is zeros
      got = op(q, k, v, causal=True, mask=mask if masked else None, clamp_len=clamp, **w)
      want = reference(q, k, v, mask, clamp_len=clamp, **w)
      assert got.dtype == jnp.float64 and got.shape == (2, length, 2, 3)
      np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"case {memory, length, clamp}")
      if masked:
        assert np.all(np.asarray(got)[1, 0] == 0.0)


def test_one_hot_values_read_the_attention_matrix():
  """With v_j = e_j the output row i is row i of the attention matrix: exactly zero on future and masked
  keys, summing to one, and the definition's weights."""
  with jax.enable_x64(True):
    memory, length = 3, 6
    q, k, _, mask, w = _inputs(11, memory=memory, length=length, heads=1)
    total = memory + length
    v = np.broadcast_to(np.eye(total)[None, :, None, :], (2, total, 1, total))
    got = np.asarray(op(q, k, v, mask=mask, **w))[:, :, 0]  # [batch, L, M + L]
    want = reference_weights(q, k, mask, **w)[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)
    future = np.arange(total)[None, :] > memory + np.arange(length)[:, None]  # [L, M + L]
    assert np.all(got[:, future] == 0.0)
    assert np.all(got.transpose(0, 2, 1)[~mask] == 0.0)  # masked keys: no weight from any query
    sees = (np.cumsum(mask, axis=1)[:, memory:] > 0)  # [batch, L]: some real key j <= M + i
    np.testing.assert_allclose(got.sum(-1), sees.astype(float), rtol=1e-12)


def test_segment_over_memory_equals_the_last_rows_of_the_whole_sequence():
  """The queries of the segment attending to [memory; segment] are the last L rows of the op over the whole
  M + L sequence with no memory (the relative positions are the same)."""
  with jax.enable_x64(True):
    memory, length = 4, 3
    _, k, v, mask, w = _inputs(12, memory=memory, length=length)
    q_all = np.random.default_rng(13).normal(size=k.shape)
    whole = op(q_all, k, v, mask=mask, **w)
    segment = op(q_all[:, memory:], k, v, mask=mask, **w)
    np.testing.assert_allclose(segment, np.asarray(whole)[:, memory:], rtol=1e-12, atol=1e-14)


def test_rel_shift_aligns_distances_to_keys():
  length, total = 3, 5
  by_distance = np.arange(total)[::-1][None, :] + 10.0 * np.arange(length)[:, None]  # column c: 4 - c
  got = np.asarray(rel_shift(jnp.asarray(by_distance)))
  for i in range(length):
    for j in range(total - length + i + 1):
      assert got[i, j] == (total - length + i - j) + 10.0 * i


def test_outputs_do_not_depend_on_later_positions():
  """d out[i] / d (q, k, v)[j] = 0 for every j > M + i (keys) and j > i (queries), and the past is read."""
  with jax.enable_x64(True):
    memory, length = 2, 5
    q, k, v, _, w = _inputs(14, batch=1, memory=memory, length=length)
    jac = jax.jit(jax.jacrev(lambda q, k, v: op(q, k, v, **w), argnums=(0, 1, 2)))(q, k, v)
    later = np.arange(memory + length)[None, :] > memory + np.arange(length)[:, None]  # [L, M + L]
    for name, j in zip("qkv", jac, strict=True):
      block = np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7))  # [L_out, L_in]
      if name == "q":
        assert np.all(block[np.triu(np.ones((length, length), bool), 1)] == 0.0)
      else:
        assert np.all(block[later] == 0.0)
        assert np.all(block[~later] > 0.0)  # every earlier key, memory included, is read


def test_masked_memory_holding_nan_changes_nothing():
  """A restarted stream's memory (mask False) holding NaN or Inf changes no output and gets no gradient."""
  q, k, v, mask, w = _inputs(15, memory=4, length=4, mask_rate=0.0)
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  mask[0, :4] = False  # row 0's memory is invalid
  mask[1, 2] = False
  bad = ~mask[:, :, None, None]

  def run(k, v):
    return op(q, k, v, mask=mask, **w)

  clean = run(k, v)
  dirty = run(jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v))
  assert np.all(np.isfinite(np.asarray(dirty)))
  np.testing.assert_allclose(dirty, clean, rtol=1e-6, atol=1e-6)
  grads = jax.jit(jax.grad(lambda k, v: jnp.sum(run(k, v) ** 2), argnums=(0, 1)))(
      jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g))) and not np.any(np.asarray(g)[bad[..., 0, 0]])


@pytest.mark.parametrize("clamp_len", [pytest.param(-1, marks=pytest.mark.slow), 3])  # -1: also the sweep's
def test_decoding_equals_the_op(clamp_len):
  """Prefill 4 tokens, then one step per token: each output equals the op's row (M = 0); per-head r."""
  length, heads, dim = 11, 2, 4
  q, k, v, _, w = _inputs(16, batch=2, memory=0, length=length, heads=heads, head_dim=dim, value_dim=dim)
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  w = {n: jnp.asarray(x, jnp.float32) for n, x in w.items()}
  full = op(q, k, v, clamp_len=clamp_len, **w)
  prompt = 4
  dec = TRANSFORMER_XL

  @jax.jit
  def run(q, k, v, w):
    cache = dec.init_cache(2, heads, length, dim, dim, q.dtype, clamp_len=clamp_len)
    cache = dec.prefill(cache, q[:, :prompt], k[:, :prompt], v[:, :prompt], clamp_len=clamp_len, **w)

    def body(cache, t):
      at = lambda x: jax.lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)  # noqa: E731
      out, cache = dec.step(cache, at(q), at(k), at(v), t, clamp_len=clamp_len, **w)
      return cache, out

    return jnp.swapaxes(jax.lax.scan(body, cache, jnp.arange(prompt, length))[1], 0, 1)

  np.testing.assert_allclose(run(q, k, v, w), full[:, prompt:], rtol=1e-5, atol=1e-5)


def test_sinusoid_is_the_papers_R():
  got = np.asarray(sinusoid(6, 8))
  inv_freq = 10000.0 ** (-np.arange(0, 8, 2) / 8)
  angle = np.arange(6)[:, None] * inv_freq
  np.testing.assert_allclose(got, np.concatenate([np.sin(angle), np.cos(angle)], -1), rtol=1e-6, atol=1e-7)
  assert sinusoid(3, 5).shape == (3, 5)


def test_bad_arguments():
  q, k, v, mask, w = _inputs(17, memory=2, length=3)
  with pytest.raises(ValueError, match="causal only"):
    transformer_xl(q, k, v, causal=False, **w)
  with pytest.raises(ValueError, match="'r'"):
    transformer_xl(q, k, v, **dict(w, r=w["r"][:4]))
  op(q, k, v, clamp_len=1, **dict(w, r=w["r"][:2]))  # a clamp needs clamp_len + 1 rows only
  with pytest.raises(ValueError, match="'u'"):
    transformer_xl(q, k, v, **dict(w, u=w["u"][:, :3]))
  with pytest.raises(ValueError, match="'clamp_len'"):
    transformer_xl(q, k, v, clamp_len=-2, **w)
  with pytest.raises(ValueError, match="'q'"):
    transformer_xl(k, q, v[:, :3], **w)  # more queries than keys
  with pytest.raises(ValueError, match="'mask'"):
    transformer_xl(q, k, v, mask=mask[:, :3], **w)
