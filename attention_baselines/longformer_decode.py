"""Longformer decoded with a key/value cache of every earlier token: a token attends to the `window` keys
before it, itself and the global tokens before it; a global token attends to every key up to itself, which is
why the cache keeps all of them (O(length) per token, as dense decoding). Global positions are resolved for
the cache's length (negative ones count from its end), and a prompt's forward pass runs over that length
(`pad_prompt`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_baselines.dense_decode import init_cache as dense_init_cache
from attention_baselines.dense_decode import prefill as dense_prefill
from attention_baselines.longformer import global_indices
from attention_core import contract
from attention_core.decode import Cache, Decoder, attend_cached, finish, token, write

Array = Any


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               window: Any = 128, global_positions: Any = (0,)) -> Cache:
  """Dense decoding's k [batch, heads, max_length, head_dim] and v caches (the arguments checked here)."""
  contract.check_positive_int(window, name="window", op="longformer")
  global_indices(global_positions, max_length, op="longformer")
  return dense_init_cache(batch, heads, max_length, head_dim, value_dim, dtype)


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None, window: Any = 128, global_positions: Any = (0,)) -> tuple[Array, Cache]:
  """Writes the token's key/value and attends to the keys its row of the forward pass sees."""
  del pool_q, pool_k
  x = token(q, k, v, position, None, None, op="longformer")
  length = cache["k"].shape[2]
  is_global = np.zeros(length, bool)
  is_global[global_indices(global_positions, length, op="longformer")] = True
  cache = {"k": write(cache["k"], x.k, x.position), "v": write(cache["v"], x.v, x.position)}
  j = jnp.arange(length)
  near = (j >= x.position - window) | jnp.asarray(is_global) | jnp.asarray(is_global)[x.position]
  valid = (j <= x.position) & near  # [length]
  return finish(attend_cached(x, cache["k"], cache["v"], valid), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, *, pool_q: Array | None = None,
            pool_k: Array | None = None, window: Any = 128, global_positions: Any = (0,)) -> Cache:
  """Writes the prompt's keys/values [batch, prompt_length, heads, dim] at positions [0, prompt_length)."""
  del window, global_positions
  return dense_prefill(cache, q, k, v, pool_q=pool_q, pool_k=pool_k)


LONGFORMER = Decoder(init_cache, step, prefill, pad_prompt=True)
