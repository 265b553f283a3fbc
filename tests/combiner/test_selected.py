"""Combiner-Fixed with selected spans (combiner.fixed(..., select=n)) against its definition in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.dense import dense
from combiner import fixed
from combiner.fixed import fixed_select
from combiner.selected_decode import SELECTED


@pytest.fixture(autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _inputs(seed: int, batch: int = 1, length: int = 13, heads: int = 2, dim: int = 4, value_dim: int = 3):
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k = (jax.random.normal(kk, (batch, length, heads, dim), jnp.float64) for kk in keys[:2])
  v = jax.random.normal(keys[2], (batch, length, heads, value_dim), jnp.float64)
  mask = jax.random.bernoulli(keys[3], 0.75, (batch, length)).at[:, 0].set(True)
  return q, k, v, mask


def reference(q, k, v, mask, *, size: int, causal: bool, pooling: str, select: int):
  """From the definition: query i attends to the items of its own block (tokens, up to i when causal), of
  its `select` best visible spans by q_i . k_bar_r (tokens) and of every other visible span (the summary
  k_bar_r, v_tilde_r), with one softmax over all of them. Written as masks over the L tokens and the spans."""
  batch, length, heads, dim = q.shape
  scale = 1.0 / np.sqrt(dim)
  blocks = -(-length // size)
  block_of = np.arange(length) // size
  m = np.asarray(mask)
  pool = jnp.max if pooling == "max" else jnp.mean
  out = []
  for b in range(batch):
    per_head = []
    for h in range(heads):
      qh, kh, vh = q[b, :, h], k[b, :, h], v[b, :, h]
      nonempty = np.array([m[b, block_of == r].any() for r in range(blocks)])
      k_bar, v_tilde = [], []
      for r in range(blocks):
        real = np.flatnonzero((block_of == r) & m[b]) if nonempty[r] else np.array([r * size])
        q_bar, kr = pool(qh[real], axis=0), pool(kh[real], axis=0)
        k_bar.append(kr)
        v_tilde.append(jax.nn.softmax(kh[real] @ q_bar * scale) @ vh[real])
      k_bar, v_tilde = jnp.stack(k_bar), jnp.stack(v_tilde)
      own = block_of[:, None]  # [L, 1]
      spans = np.arange(blocks)[None, :]
      visible = nonempty[None, :] & ((spans < own) if causal else (spans != own))  # [L, blocks]
      scores = np.asarray(jax.lax.stop_gradient(qh @ k_bar.T * scale))
      best = np.zeros_like(visible)
      for i in range(length):
        ranked = sorted(np.flatnonzero(visible[i]), key=lambda r, i=i: (-scores[i, r], r))[:select]
        best[i, ranked] = True
      tok_ok = m[b][None, :] & ((block_of[None, :] == own) | best[:, block_of])  # [L, L]
      if causal:
        pos = np.arange(length)
        tok_ok = tok_ok & ((block_of[None, :] != own) | (pos[None, :] <= pos[:, None]))
      sum_ok = visible & ~best
      logits = jnp.concatenate([qh @ kh.T * scale, qh @ k_bar.T * scale], axis=1)
      ok = np.concatenate([tok_ok, sum_ok], axis=1)
      weights = jax.nn.softmax(jnp.where(ok, logits, -jnp.inf), axis=1)
      weights = jnp.where(ok, weights, 0.0)
      per_head.append(weights @ jnp.concatenate([vh, v_tilde]))
    out.append(jnp.stack(per_head, axis=1))
  return jnp.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("causal,pooling,select", [(True, "max", 1), (False, "mean", 2)])
def test_matches_the_definition_forward_and_gradients(causal, pooling, select):
  q, k, v, mask = _inputs(seed=3 + select)
  args = dict(size=4, causal=causal, pooling=pooling, select=select)
  got = fixed(q, k, v, block_size=4, causal=causal, mask=mask, pooling=pooling, select=select, query_chunks=2)
  want = reference(q, k, v, mask, **args)
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
  cot = jax.random.normal(jax.random.key(9), got.shape, jnp.float64)
  grads = jax.grad(lambda *t: jnp.sum(fixed(*t, block_size=4, causal=causal, mask=mask, pooling=pooling,
                                            select=select) * cot), argnums=(0, 1, 2))(q, k, v)
  wants = jax.grad(lambda *t: jnp.sum(reference(*t, mask, **args) * cot), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(grads, wants, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_zero_is_combiner_fixed_and_every_span_is_dense(causal):
  q, k, v, mask = _inputs(seed=11, batch=2, length=37)
  plain = fixed(q, k, v, block_size=8, causal=causal, mask=mask, implementation="xla")
  np.testing.assert_array_equal(fixed(q, k, v, block_size=8, causal=causal, mask=mask, select=0), plain)
  every = fixed(q, k, v, block_size=8, causal=causal, mask=mask, select=5, query_chunks=3)
  np.testing.assert_allclose(every, dense(q, k, v, causal=causal, mask=mask, implementation="xla"),
                             rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_masked_and_future_keys_are_inert():
  """NaN/Inf behind the mask change nothing (outputs, gradients); the future changes no output, and its
  Jacobian is zero (the selection never picks a span ahead of the query)."""
  q, k, v, mask = _inputs(seed=5, length=16)
  masked = ~mask[0][None, :, None, None]
  future = (jnp.arange(16) >= 9)[None, :, None, None]  # queries 0..8 must not see these

  def f(q, k, v):
    return fixed(q, k, v, block_size=4, causal=True, mask=mask, select=2)

  clean = jax.grad(lambda *t: jnp.sum(f(*t)), argnums=(0, 1, 2))(q, k, v)
  k2, v2 = jnp.where(masked, jnp.nan, k), jnp.where(masked, jnp.inf, v)
  np.testing.assert_allclose(f(q, k2, v2), f(q, k, v), rtol=1e-12)
  for g, want in zip(jax.grad(lambda *t: jnp.sum(f(*t)), argnums=(0, 1, 2))(q, k2, v2), clean, strict=True):
    np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)
  k3, v3 = jnp.where(future, jnp.nan, k), jnp.where(future, jnp.inf, v)
  np.testing.assert_allclose(f(q, k3, v3)[:, :9], f(q, k, v)[:, :9], rtol=1e-12)
  jac = jax.jacrev(lambda k, v: f(q, k, v)[:, :9], argnums=(0, 1))(k, v)
  for j in jac:  # [1, 9, heads, e, 1, 16, heads, d]
    assert np.all(np.asarray(j)[:, :, :, :, :, 9:] == 0.0)


def test_bad_select_is_one_clear_error():
  q, k, v, mask = _inputs(seed=1)
  with pytest.raises(ValueError, match="'select' must be a positive integer"):
    fixed(q, k, v, block_size=4, causal=True, select=-1)
  with pytest.raises(ValueError, match="'implementation' must be one of"):
    fixed(q, k, v, block_size=4, causal=True, select=2, implementation="cuda")


@pytest.mark.parametrize("select,pooling,prompt", [(1, "mean", 6), (3, "max", 4)], ids=["one", "every-block"])
def test_decoder_equals_the_op_at_every_step(select, pooling, prompt):
  """Cached decoding (a prompt mid-block or at a block boundary, then one step per token, the spans chosen
  again for each token) equals the op's causal rows in float64; 3 blocks, so select=3 chooses every one."""
  q, k, v, _ = _inputs(seed=17 + select, length=11)
  pq, pk = (jax.random.normal(jax.random.key(s), q.shape, jnp.float64) for s in (21, 22))  # DeepSets-style
  params = dict(block_size=4, select=select, pooling=pooling)

  @jax.jit
  def run(q, k, v, pq, pk):
    full = fixed_select(q, k, v, causal=True, pool_q=pq, pool_k=pk, **params)  # [batch, length, heads, e]
    cache = SELECTED.init_cache(1, 2, 11, 4, 3, q.dtype, **params)
    cache = SELECTED.prefill(cache, *(x[:, :prompt] for x in (q, k, v)), pool_q=pq[:, :prompt],
                             pool_k=pk[:, :prompt], **params)

    def body(cache, t):
      q_t, k_t, v_t, pq_t, pk_t = (jax.lax.dynamic_index_in_dim(x, t, 1, False) for x in (q, k, v, pq, pk))
      out, cache = SELECTED.step(cache, q_t, k_t, v_t, t, pool_q=pq_t, pool_k=pk_t, **params)
      return cache, out

    _, outs = jax.lax.scan(body, cache, jnp.arange(prompt, 11))
    return full, jnp.swapaxes(outs, 0, 1)

  full, stepped = run(q, k, v, pq, pk)
  np.testing.assert_allclose(stepped, full[:, prompt:], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_model_decodes_and_samples(decoding_matches_forward):
  """A causal LM with combiner_fixed_select (DeepSets pooling) decodes from its cache to the forward pass's
  logits at every position, and greedy sampling picks the forward pass's argmax (float32 model)."""
  import ml_collections

  from models import transformer
  from models.generate import Decoder, generate

  with jax.enable_x64(False):
    cfg = ml_collections.ConfigDict({
        "num_layers": 2, "features": 16, "num_heads": 2, "mlp_dim": 32, "dropout_rate": 0.0,
        "dtype": "float32", "position_embedding": "learned",
        "attention": {"name": "combiner_fixed_select", "params": {"block_size": 4, "select": 2},
                      "dropout_rate": 0.0, "deepsets": True}})
    model = transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=20, seed=0)
    decoding_matches_forward(model, 20)
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]])
    greedy = generate(Decoder(model), jax.random.key(0), num_samples=2, length=20, prompt=prompt,
                      temperature=0)  # [2, 20]
    np.testing.assert_array_equal(greedy[:, :3], prompt)
    full = model({"inputs": greedy}, deterministic=True)  # [batch, length, vocab], position t predicts t
    np.testing.assert_array_equal(greedy[:, 3:], jnp.argmax(full, -1)[:, 3:])
