"""Dense softmax attention decoded with a key/value cache: O(L) per token, the cached-decoding baseline."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core.combine import joint_softmax
from attention_core.decode import Cache, Decoder, finish, keys_piece, token, write, zeros

Array = Any


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any) -> Cache:
  return {"k": zeros(batch, heads, max_length, head_dim, dtype),
          "v": zeros(batch, heads, max_length, value_dim, dtype)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None) -> tuple[Array, Cache]:
  """Writes the token's key/value at `position` and attends to positions <= position."""
  del pool_q, pool_k
  x = token(q, k, v, position, None, None, op="dense")
  cache = {"k": write(cache["k"], x.k, x.position), "v": write(cache["v"], x.v, x.position)}
  valid = jnp.arange(cache["k"].shape[2]) <= x.position  # [max_length]
  return finish(joint_softmax([keys_piece(x, cache["k"], cache["v"], valid)]), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, *, pool_q: Array | None = None,
            pool_k: Array | None = None) -> Cache:
  """Writes the prompt's keys/values [batch, prompt_length, heads, dim] at positions [0, prompt_length)."""
  del q, pool_q, pool_k
  out = {}
  for name, x in (("k", k), ("v", v)):
    buf = cache[name]
    out[name] = buf.at[:, :, :x.shape[1]].set(jnp.swapaxes(x, 1, 2).astype(buf.dtype))
  return out


DENSE = Decoder(init_cache, step, prefill)
