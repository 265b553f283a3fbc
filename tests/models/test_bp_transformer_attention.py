"""The BP-Transformer in the model: span-node states carried through every block beside the tokens (their
initial states, the tokens the encoder returns), forward and backward of a two-layer decoder whose first
layer's span outputs reach the loss, causality through the decoder; cached decoding equal to the forward
pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from models import metrics, transformer
from models.bp_transformer_attention import SpanNodes

LENGTH, VOCAB = 11, 13  # 11 tokens: padded to n = 16, 15 span nodes


def _cfg(layers=2, scan=False):
  c = base.base_config().model
  c.num_layers, c.features, c.num_heads, c.mlp_dim, c.scan_layers = layers, 16, 2, 32, scan
  c.attention = base.attention_config("bp_transformer")
  c.attention.params.context = 1
  return c


def test_span_nodes_start_as_token_means_plus_a_level_vector():
  nodes = SpanNodes(4, LENGTH, dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = np.random.default_rng(1).normal(size=(2, LENGTH, 4)).astype(np.float32)
  mask = np.ones((2, LENGTH), bool)
  mask[1, 7:] = False
  poisoned = np.where(mask[..., None], x, np.nan)  # masked tokens' contents never count
  both, real = nnx.jit(lambda m, x, mask: m(x, mask))(nodes, jnp.asarray(poisoned), jnp.asarray(mask))
  both, real = np.asarray(both), np.asarray(real)
  assert both.shape == (2, LENGTH + 15, 4) and real.shape == (2, LENGTH + 15)
  level = np.asarray(nodes.level[...])
  # Span (2, 1) covers tokens 4..7; in row 1 token 7 is masked. Level 4 (the root) is the table's last row.
  at = SpanNodes.span_index(LENGTH, 2, 1)
  np.testing.assert_allclose(both[0, at], x[0, 4:8].mean(0) + level[1], rtol=1e-6)
  np.testing.assert_allclose(both[1, at], x[1, 4:7].mean(0) + level[1], rtol=1e-6)
  assert not real[1, SpanNodes.span_index(LENGTH, 1, 4)] and real[0, SpanNodes.span_index(LENGTH, 1, 4)]
  assert not real[0, SpanNodes.span_index(LENGTH, 2, 3)]  # tokens 12..15: padding only
  np.testing.assert_array_equal(SpanNodes.tokens(both), both[:, :LENGTH])


def test_decoder_forward_backward_carries_span_nodes_and_is_causal():
  model = transformer.build_model(_cfg(), task="lm", vocab_size=VOCAB, seq_len=LENGTH)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, VOCAB, size=(2, LENGTH)), jnp.int32)
  mask = np.ones((2, LENGTH), bool)
  mask[1, 8:] = False
  batch = {"inputs": ids, "targets": ids, "mask": jnp.asarray(mask),
           "weights": jnp.asarray(mask, jnp.float32)}
  j = 5
  changed = dict(batch, inputs=ids.at[:, j].set((ids[:, j] + 1) % VOCAB))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, batch):
    logits = nnx.merge(graphdef, params, rest, copy=True)(batch, deterministic=True)
    return metrics.loss_and_sums("lm", logits, batch)[0], logits

  run = jax.jit(jax.value_and_grad(loss, has_aux=True))  # one compile, run on both batches
  (value, a), grads = run(params, batch)
  (_, b), _ = run(params, changed)
  assert a.shape == (2, LENGTH, VOCAB) and np.isfinite(float(value))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  # The first layer's span-node outputs reach the loss only through the second layer: their relative vector
  # has a gradient only because the span nodes are carried through the blocks.
  assert float(jnp.abs(grads["encoder"]["blocks"][0]["attention"]["rel_anc"][...]).sum()) > 0
  assert float(jnp.abs(grads["encoder"]["graph_nodes"]["level"][...]).sum()) > 0
  np.testing.assert_allclose(a[:, :j + 1], b[:, :j + 1], atol=1e-5, rtol=1e-5)  # position t reads t - 1
  assert float(jnp.abs(a[:, j + 1:] - b[:, j + 1:]).max()) > 1e-6


@pytest.mark.slow  # three compiles (forward, prefill's scan, a step): ~10 s
@pytest.mark.parametrize("scan", [False, True])  # blocks stacked: decoded by one scan over the layers
def test_cached_decoding_equals_the_forward_pass(scan):
  """Prefill of a 3-token prompt, then one step per token: every position's logits equal the forward pass's
  over max_length = 11 tokens (span nodes completed on the way are cached per layer)."""
  model = transformer.build_model(_cfg(scan=scan), task="lm", vocab_size=VOCAB, seq_len=LENGTH)
  ids = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, size=(2, LENGTH)), jnp.int32)
  want = model({"inputs": ids}, deterministic=True)  # [2, L, vocab]
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda s, c, p: nnx.merge(graphdef, s).prefill(c, p))
  step = jax.jit(lambda s, c, t, pos: nnx.merge(graphdef, s).decode(c, t, pos))
  got, cache = prefill(state, model.init_cache(2, LENGTH), ids[:, :3])  # positions 0..3
  rows = [got]
  for pos in range(4, LENGTH):
    logits, cache = step(state, cache, ids[:, pos - 1], pos)
    rows.append(logits[:, None])
  np.testing.assert_allclose(jnp.concatenate(rows, 1), want, atol=2e-5, rtol=2e-5)
