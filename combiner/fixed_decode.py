"""Cached decoding for Combiner-Fixed (`combiner.fixed`) and its sparse counterpart (`combiner.sparse.fixed`).

A `attention_core.decode.Decoder` (its docstring gives the protocol) whose step equals row `position` of the
plan's
causal forward pass: the same pieces and pooling laid out for one query. Each step writes the span summaries
its token completes, so every summary a query reads is complete and the per-token cost stays bounded.

The current block's keys/values plus one (pooled key, in-span value) per block; the current block's summary is
rewritten at every step (its span query q̄ is known only when the block completes, and the block is read only
by later blocks): O(block + L/block) per token and O(block + L/block) cache.

Layouts (head-major, one token): q_t, k_t, pool_q, pool_k: [batch, heads, head_dim]; v_t: [batch, heads,
value_dim]; `position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import blocks, contract
from attention_core.combine import joint_softmax
from attention_core.decode import Cache, finish, keys_piece, make_decoder, token, write, zeros
from combiner import pooling as pool_ops
from combiner.common import span_summaries

Array = Any


def _fixed_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
                block_size: int, sparse: bool, op: str) -> Cache:
  s = contract.check_positive_int(block_size, name="block_size", op=op)
  n = blocks.num_blocks(max_length, s)
  cache = {"k": zeros(batch, heads, s, head_dim, dtype), "v": zeros(batch, heads, s, value_dim, dtype),
           "span_k": zeros(batch, heads, n, head_dim, dtype),
           "span_v": zeros(batch, heads, n, value_dim, dtype)}
  if not sparse:
    cache.update(pool_q=zeros(batch, heads, s, head_dim, dtype),
                 pool_k=zeros(batch, heads, s, head_dim, dtype))
  return cache


def _fixed_step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, block_size: int,
                pool_q: Array | None, pool_k: Array | None, pooling: str | None,
                op: str) -> tuple[Array, Cache]:
  """pooling=None: the sparse counterpart (the span of a block is its last position)."""
  x = token(q, k, v, position, pool_q, pool_k, op=op)
  s = contract.check_positive_int(block_size, name="block_size", op=op)
  n, j = x.position // s, x.position % s
  cache = dict(cache)
  cache["k"], cache["v"] = write(cache["k"], x.k, j), write(cache["v"], x.v, j)
  valid = jnp.arange(s) <= j  # [size]: the own block up to and including the token
  if pooling is None:
    k_bar, v_tilde = x.k, x.v  # the block's last position, final once the block is complete
  else:
    cache["pool_q"] = write(cache["pool_q"], x.pool_q, j)
    cache["pool_k"] = write(cache["pool_k"], x.pool_k, j)
    k_bar, v_tilde, _ = span_summaries(cache["pool_q"], cache["pool_k"], cache["k"], cache["v"], valid,
                                     x.scale, pooling)
  cache["span_k"], cache["span_v"] = write(cache["span_k"], k_bar, n), write(cache["span_v"], v_tilde, n)
  blocks = cache["span_k"].shape[2]
  direct = keys_piece(x, cache["k"], cache["v"], valid)
  spans = keys_piece(x, cache["span_k"], cache["span_v"], jnp.arange(blocks) < n)  # completed blocks only
  return finish(joint_softmax([direct, spans]), x), cache


def fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, *, block_size: int,
               pooling: str = "max"):
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op="combiner.fixed")
  return _fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, block_size=block_size,
                     sparse=False, op="combiner.fixed")


def fixed_step(cache, q, k, v, position, *, block_size: int, pooling: str = "max", pool_q=None, pool_k=None):
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op="combiner.fixed")
  return _fixed_step(cache, q, k, v, position, block_size=block_size, pool_q=pool_q, pool_k=pool_k,
                     pooling=pooling, op="combiner.fixed")


def sparse_fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, *, block_size: int):
  return _fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, block_size=block_size, sparse=True,
                     op="sparse.fixed")


def sparse_fixed_step(cache, q, k, v, position, *, block_size: int, pool_q=None, pool_k=None):
  del pool_q, pool_k
  return _fixed_step(cache, q, k, v, position, block_size=block_size, pool_q=None, pool_k=None, pooling=None,
                     op="sparse.fixed")


FIXED = make_decoder(fixed_init, fixed_step)
SPARSE_FIXED = make_decoder(sparse_fixed_init, sparse_fixed_step)
