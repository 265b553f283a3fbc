"""BigBird (ITC) decoded with a key/value cache of every earlier token: a token attends to the keys up to
itself in the key blocks its query block may see (`attention_baselines.bigbird.block_pattern`: window, global
and random
blocks; a global block's queries see every block up to their own), so a step costs O(length), as dense
decoding. The pattern is the one of a forward pass over the cache's length, and so is a prompt's forward pass
(`pad_prompt`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_baselines.bigbird import block_pattern
from attention_baselines.dense_decode import init_cache as dense_init_cache
from attention_baselines.dense_decode import prefill as dense_prefill
from attention_core import contract
from attention_core.blocks import num_blocks
from attention_core.decode import Cache, Decoder, attend_cached, finish, token, write

Array = Any


def _key_blocks(length: int, block_size: Any, global_blocks: Any, num_random_blocks: int, seed: int
                ) -> tuple[np.ndarray, int]:
  """(allowed [n, n] bool, query block -> key block: the causal pattern of `length` tokens; block size)."""
  size = min(contract.check_positive_int(block_size, name="block_size", op="bigbird"), length)
  allowed, _ = block_pattern(num_blocks(length, size), causal=True, global_blocks=global_blocks,
                             num_random_blocks=int(num_random_blocks), seed=int(seed))
  return allowed, size


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               block_size: Any = 64, global_blocks: Any = (0, -1), num_random_blocks: int = 3,
               seed: int = 0) -> Cache:
  """Dense decoding's k [batch, heads, max_length, head_dim] and v caches (the pattern checked here)."""
  _key_blocks(max_length, block_size, global_blocks, num_random_blocks, seed)
  return dense_init_cache(batch, heads, max_length, head_dim, value_dim, dtype)


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None, block_size: Any = 64, global_blocks: Any = (0, -1),
         num_random_blocks: int = 3, seed: int = 0) -> tuple[Array, Cache]:
  """Writes the token's key/value and attends to the keys of its row of the pattern, up to itself."""
  del pool_q, pool_k
  x = token(q, k, v, position, None, None, op="bigbird")
  length = cache["k"].shape[2]
  allowed, size = _key_blocks(length, block_size, global_blocks, num_random_blocks, seed)
  cache = {"k": write(cache["k"], x.k, x.position), "v": write(cache["v"], x.v, x.position)}
  j = jnp.arange(length)
  row = jnp.asarray(allowed)[x.position // size]  # [n]: the key blocks of the token's block
  valid = (j <= x.position) & row[j // size]  # [length]
  return finish(attend_cached(x, cache["k"], cache["v"], valid), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, *, pool_q: Array | None = None,
            pool_k: Array | None = None, block_size: Any = 64, global_blocks: Any = (0, -1),
            num_random_blocks: int = 3, seed: int = 0) -> Cache:
  """Writes the prompt's keys/values [batch, prompt_length, heads, dim] at positions [0, prompt_length)."""
  del block_size, global_blocks, num_random_blocks, seed
  return dense_prefill(cache, q, k, v, pool_q=pool_q, pool_k=pool_k)


BIGBIRD = Decoder(init_cache, step, prefill, pad_prompt=True)
