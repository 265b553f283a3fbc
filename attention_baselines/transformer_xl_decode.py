"""Transformer-XL attention decoded with a key/value cache: the token at `position` attends to the cached
positions j <= position with the relative-position logit ((q + u) . k_j + (q + v) . r_{position - j}) /
sqrt(d), O(L * d) per token; it equals row `position` of the causal op over the sequence from position 0
(no memory: M = 0). Step arguments besides the plan: `r` [>= max_length distances, heads or 1, head_dim],
`u` and `v_bias` [heads or 1, head_dim], as for the op (the module's projected embeddings and biases)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_baselines.transformer_xl import OP, check_clamp_len, check_weights, distance_rows
from attention_core.combine import Piece, joint_softmax, weighted_sum
from attention_core.decode import Cache, Decoder, finish, token, write, zeros

Array = Any


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any,
               **unused: Any) -> Cache:
  """Keys and values of every position: [batch, heads, max_length, dim]."""
  del unused
  return {"k": zeros(batch, heads, max_length, head_dim, dtype),
          "v": zeros(batch, heads, max_length, value_dim, dtype)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, r: Array, u: Array, v_bias: Array,
         clamp_len: int = -1, pool_q: Array | None = None, pool_k: Array | None = None,
         **unused: Any) -> tuple[Array, Cache]:
  """Writes the token's key/value at `position` and attends to positions <= position."""
  del pool_q, pool_k, unused
  x = token(q, k, v, position, None, None, op=OP)
  cache = {"k": write(cache["k"], x.k, x.position), "v": write(cache["v"], x.v, x.position)}
  heads, n = q.shape[1], cache["k"].shape[2]
  clamp_len = check_clamp_len(clamp_len)
  r, u, v_bias = check_weights(r, u, v_bias, heads=heads, head_dim=q.shape[-1],
                               distances=distance_rows(n, clamp_len))
  distance = x.position - jnp.arange(n)  # [max_length]: position - j
  valid = distance >= 0
  index = jnp.clip(distance, 0, distance_rows(n, clamp_len) - 1)  # the clamp; 0 for the unused j > position
  rel = r[index].astype(x.q.dtype)  # [max_length, heads, head_dim]: r_{position - j}
  content = jnp.einsum("bhd,bhnd->bhn", x.q + u.astype(x.q.dtype), cache["k"])  # [batch, heads, max_length]
  pos = jnp.einsum("bhd,nhd->bhn", x.q + v_bias.astype(x.q.dtype), rel)  # [batch, heads, max_length]
  logits = (content + pos) * x.scale
  out = joint_softmax([Piece(logits, valid, lambda w: weighted_sum("bhn,bhnd->bhd", w, cache["v"]))])
  return finish(out, x), cache  # [batch, heads, value_dim]


def prefill(cache: Cache, q: Array, k: Array, v: Array, **unused: Any) -> Cache:
  """Writes the prompt's keys/values [batch, prompt_length, heads, dim] at positions [0, prompt_length)."""
  del q, unused
  out = {}
  for name, x in (("k", k), ("v", v)):
    buf = cache[name]
    out[name] = buf.at[:, :, :x.shape[1]].set(jnp.swapaxes(x, 1, 2).astype(buf.dtype))
  return out


TRANSFORMER_XL = Decoder(init_cache, step, prefill)
