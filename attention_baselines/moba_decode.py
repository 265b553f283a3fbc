"""MoBA decoded with the whole key/value cache: a token scores the complete blocks before its own by their
mean keys (recomputed from the cache, O(L * d) per token, as dense decoding reads every key), keeps its own
block and the `top_k - 1` best others, and attends to their cached keys up to itself; equal to row `position`
of `attention_baselines.moba.moba` over the cache's length."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import num_blocks
from attention_core.decode import Cache, attend_cached, finish, make_decoder, token, write, zeros
from attention_core.selection import choose

Array = Any


def _plan(block_size: Any, top_k: Any, max_length: int) -> tuple[int, int, int]:
  """(block size, blocks, blocks per token) as the forward pass over max_length tokens chooses them (also
  from the cache's length, whole blocks: min(block_size, slots) is the same size)."""
  size = min(contract.check_positive_int(block_size, name="block_size", op="moba"), max_length)
  blocks = num_blocks(max_length, size)
  return size, blocks, min(contract.check_positive_int(top_k, name="top_k", op="moba"), blocks)


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               block_size: Any = 512, top_k: Any = 3, query_chunks: Any = None) -> Cache:
  del query_chunks
  size, blocks, _ = _plan(block_size, top_k, max_length)
  # The cache holds whole blocks: its length gives the forward pass's block size back (`_plan`).
  return {"k": zeros(batch, heads, blocks * size, head_dim, dtype),
          "v": zeros(batch, heads, blocks * size, value_dim, dtype)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None, block_size: Any = 512, top_k: Any = 3,
         query_chunks: Any = None) -> tuple[Array, Cache]:
  """Writes the token's key and value at its position and attends to its chosen blocks up to itself."""
  del pool_q, pool_k, query_chunks
  x = token(q, k, v, position, None, None, op="moba")
  size, blocks, count = _plan(block_size, top_k, cache["k"].shape[2])
  cache = {"k": write(cache["k"], x.k, x.position), "v": write(cache["v"], x.v, x.position)}
  batch, heads, slots, head_dim = cache["k"].shape
  kbar = jnp.mean(cache["k"].reshape(batch, heads, blocks, size, head_dim), axis=3)  # [batch, heads, n, d]
  scores = jnp.einsum("bhd,bhnd->bhn", x.q * x.scale, kbar)  # [batch, heads, blocks]
  own = x.position // size
  ids = jnp.arange(blocks)
  visible = jnp.broadcast_to((ids < own) | (ids == own), scores.shape)
  forced = jnp.broadcast_to((ids == own).astype(jnp.int32), scores.shape)
  index, chosen = choose(scores, visible, forced, count)  # [batch, heads, count]
  picked = jnp.any((index[..., None] == ids) & chosen[..., None], axis=-2)  # [batch, heads, blocks]
  pos = jnp.arange(slots)
  valid = jnp.repeat(picked, size, axis=-1) & (pos <= x.position)  # [batch, heads, slots]
  return finish(attend_cached(x, cache["k"], cache["v"], valid), x), cache


MOBA = make_decoder(init_cache, step)
