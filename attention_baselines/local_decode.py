"""Block-local attention decoded with a one-block ring of keys and values: a token attends to its block's
earlier tokens and itself, so the cache holds block_size entries whatever the length (O(block_size) per
token). Slot t % block_size holds token t; a slot is visible while it is at or before the token's own slot
(the ones after it still hold the previous block's tokens)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.decode import Cache, Decoder, attend_cached, finish, token, write, zeros

Array = Any


def _slots(block_size: Any, max_length: int) -> int:
  """The ring's size: the forward pass's block, min(block_size, length)."""
  return min(contract.check_positive_int(block_size, name="block_size", op="local"), max_length)


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               block_size: Any = 128) -> Cache:
  slots = _slots(block_size, max_length)
  return {"k": zeros(batch, heads, slots, head_dim, dtype), "v": zeros(batch, heads, slots, value_dim, dtype)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None, block_size: Any = 128) -> tuple[Array, Cache]:
  """Writes the token's key/value at its slot and attends to the slots up to it."""
  del pool_q, pool_k, block_size  # the ring's size is the block
  x = token(q, k, v, position, None, None, op="local")
  slots = cache["k"].shape[2]
  slot = x.position % slots
  cache = {"k": write(cache["k"], x.k, slot), "v": write(cache["v"], x.v, slot)}
  valid = jnp.arange(slots) <= slot  # [slots]
  return finish(attend_cached(x, cache["k"], cache["v"], valid), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, *, pool_q: Array | None = None,
            pool_k: Array | None = None, block_size: Any = 128) -> Cache:
  """Fills the ring with the prompt's last tokens (k [batch, prompt_length, heads, head_dim]): slot s gets the
  latest prompt token t with t % slots == s (zeros where none)."""
  del q, pool_q, pool_k, block_size
  slots, length = cache["k"].shape[2], k.shape[1]
  s = jnp.arange(slots)
  latest = s + (length - 1 - s) // slots * slots  # [slots]; negative where the prompt is shorter than s + 1
  out = {}
  for name, x in (("k", k), ("v", v)):
    rows = jnp.take(x, jnp.maximum(latest, 0), axis=1)  # [batch, slots, heads, dim]
    rows = jnp.where((latest >= 0)[None, :, None, None], rows, 0)
    out[name] = jnp.swapaxes(rows, 1, 2).astype(cache[name].dtype)  # [batch, heads, slots, dim]
  return out


LOCAL = Decoder(init_cache, step, prefill)
