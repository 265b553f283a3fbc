"""Cached decoding of the exactly causal routing plans: a step equals the causal forward pass's row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core.norm import layer_norm
from routing import decode, kmeans
from routing.attention import routing_attention
from routing.local import local_attention


def _qkv(seed: int, batch: int, length: int, heads: int, dim: int):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(kk, (batch, length, heads, dim), jnp.float32) for kk in keys)


def _decode_all(dec, params, q, k, v, prompt: int = 0):
  """Prefills `prompt` positions, then steps through the rest (one compiled scan); the stepped outputs."""
  batch, length, heads, dim = q.shape

  @jax.jit
  def run(q, k, v):
    cache = dec.init_cache(batch, heads, length, dim, v.shape[-1], q.dtype, **params)
    if prompt:
      cache = dec.prefill(cache, q[:, :prompt], k[:, :prompt], v[:, :prompt], **params)

    def body(cache, t):
      def at(x):
        return jax.lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)

      out, cache = dec.step(cache, at(q), at(k), at(v), t, **params)
      return cache, out

    _, outs = jax.lax.scan(body, cache, jnp.arange(prompt, length))
    return jnp.swapaxes(outs, 0, 1)  # [batch, length - prompt, heads, value_dim]

  return run(q, k, v)


@pytest.mark.parametrize("mask_self,scale_logits", [pytest.param(False, True, marks=pytest.mark.slow),
                                                    (True, False)])  # one case fast
def test_routing_step_equals_nearest_forward(mask_self, scale_logits):
  """3 clusters, window 3 over 21 tokens: clusters overflow their rings, prompt of 5 prefilled."""
  length, heads, dim = 21, 2, 8
  q, k, v = _qkv(0, 2, length, heads, dim)
  centroids = kmeans.init_centroids(jax.random.key(7), heads, 3, dim)
  opts = {"window": 3, "scale_logits": scale_logits, "mask_self": mask_self}
  full, _ = routing_attention(q, k, v, centroids=centroids, causal=True, membership="nearest", **opts)
  stepped = _decode_all(decode.ROUTING, {"centroids": centroids, **opts}, q, k, v, prompt=5)
  np.testing.assert_allclose(stepped, full[:, 5:], rtol=1e-5, atol=1e-5)
  # The rings really wrap: some head's cluster receives more than `window` tokens.
  assign = kmeans.nearest_centroid(kmeans.scores(layer_norm(q), centroids))  # [batch, heads, length]
  assert int(jax.nn.one_hot(assign, 3).sum(axis=2).max()) > opts["window"]


@pytest.mark.parametrize("block_size,prompt", [(4, 6), (5, 0)])
def test_local_step_equals_forward(block_size, prompt):
  q, k, v = _qkv(1, 2, 19, 2, 8)
  full = local_attention(q, k, v, block_size=block_size, causal=True)
  stepped = _decode_all(decode.LOCAL, {"block_size": block_size}, q, k, v, prompt=prompt)
  np.testing.assert_allclose(stepped, full[:, prompt:], rtol=1e-5, atol=1e-5)


def _model(params: dict, *, seq_len: int = 20, attention: str = "routing", **fields):
  import ml_collections

  from models import transformer

  cfg = ml_collections.ConfigDict({
      "num_layers": 2, "features": 16, "num_heads": 2, "mlp_dim": 32, "dropout_rate": 0.0, "dtype": "float32",
      "attention": {"name": attention, "params": params, "dropout_rate": 0.0, **fields}})
  return transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=seq_len, seed=0)


@pytest.mark.slow
def test_model_decode_equals_forward(decoding_matches_forward):
  """One routing head next to one local head in the last layer, local heads only in the first; a prompt of 5
  tokens, then step by step: every position's logits equal the forward pass's."""
  length = 20
  model = _model({"num_clusters": 3, "window": 3, "block_size": 4}, routing_heads=1, routing_layers=[-1],
                 mask_self=True)
  decoding_matches_forward(model, length)


def test_decode_refuses_non_causal_memberships():
  with pytest.raises(ValueError, match="membership='nearest'"):
    _model({"num_clusters": 3}, membership="balanced").init_cache(1, 20)
  with pytest.raises(ValueError, match="chunk boundaries"):
    _model({"num_clusters": 3}, attention="combiner_routed").init_cache(1, 20)
