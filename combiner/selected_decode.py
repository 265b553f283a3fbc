"""Cached decoding for Combiner-Fixed with selected spans (`combiner.fixed.fixed_select`, `.selected`).

A `attention_core.decode.Decoder` (its docstring gives the protocol) whose step equals row `position` of the
op's causal forward pass. The token attends to its own block's tokens up to itself, and to one summary
(k̄_r, ṽ_r) per completed earlier block, except for the `select` of those blocks it ranks highest by q·k̄_r,
whose cached tokens it attends exactly in their place; one joint softmax over the three pieces. The choice is
made again for every token, as the forward pass makes it per query.

Unlike Combiner-Fixed's decoder (`combiner.fixed_decode`), which keeps only the current block's tokens, any
completed block may be chosen later, so the cache keeps every token's key and value as [blocks, block_size]
(as dense decoding does), plus one summary per block and the current block's pooled inputs; the current
block's summary is rewritten at every step, so the summaries a token reads are complete. Per token: O((select
+ 1) * block_size + L / block_size) keys read (the chosen blocks are gathered, not the whole cache).

Layouts (head-major, one token): q_t, k_t, pool_q, pool_k: [batch, heads, head_dim]; v_t: [batch, heads,
value_dim]; `position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_core import blocks, contract
from attention_core.blocks import head_major
from attention_core.combine import Piece, joint_softmax, weighted_sum
from attention_core.decode import Cache, Decoder, finish, read, token, write, zeros
from attention_core.selection import choose
from combiner import pooling as pool_ops
from combiner.common import span_summaries
from combiner.fixed import SELECT

Array = Any
OP = "combiner.fixed"


def _plan(block_size: Any, select: Any, pooling: Any) -> tuple[int, int]:
  """(block size, select) checked as the op checks them; select 0 is Combiner-Fixed."""
  size = contract.check_positive_int(block_size, name="block_size", op=OP)
  select = select and contract.check_positive_int(select, name="select", op=OP)
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op=OP)
  return size, select


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               block_size: Any, select: Any = SELECT, pooling: str = "max",
               query_chunks: Any = None) -> Cache:
  del query_chunks  # the forward pass's memory plan only
  size, _ = _plan(block_size, select, pooling)
  n = blocks.num_blocks(max_length, size)
  return {"k": zeros(batch, heads, (n, size), head_dim, dtype),  # every token, by (block, offset)
          "v": zeros(batch, heads, (n, size), value_dim, dtype),
          "span_k": zeros(batch, heads, n, head_dim, dtype),  # k̄_r, one per block
          "span_v": zeros(batch, heads, n, value_dim, dtype),  # ṽ_r
          "pool_q": zeros(batch, heads, size, head_dim, dtype),  # the current block's pooled inputs
          "pool_k": zeros(batch, heads, size, head_dim, dtype)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, block_size: Any, select: Any = SELECT,
         pooling: str = "max", query_chunks: Any = None, pool_q: Array | None = None,
         pool_k: Array | None = None) -> tuple[Array, Cache]:
  """Writes the token and its block's summary, then attends: own block exactly, the chosen completed blocks
  exactly, every other completed block through its summary."""
  del query_chunks
  size, select = _plan(block_size, select, pooling)
  x = token(q, k, v, position, pool_q, pool_k, op=OP)
  n, j = x.position // size, x.position % size
  cache = dict(cache)
  cache["k"], cache["v"] = write(cache["k"], x.k, n, j), write(cache["v"], x.v, n, j)
  cache["pool_q"], cache["pool_k"] = write(cache["pool_q"], x.pool_q, j), write(cache["pool_k"], x.pool_k, j)
  own_k = read(cache["k"], n, 1, axis=2)[:, :, 0]  # [batch, heads, size, head_dim]
  own_v = read(cache["v"], n, 1, axis=2)[:, :, 0]  # [batch, heads, size, value_dim]
  valid = jnp.arange(size) <= j  # [size]: the own block up to and including the token
  k_bar, v_tilde, _ = span_summaries(cache["pool_q"], cache["pool_k"], own_k, own_v, valid, x.scale, pooling)
  cache["span_k"], cache["span_v"] = write(cache["span_k"], k_bar, n), write(cache["span_v"], v_tilde, n)

  qs = x.q * x.scale  # [batch, heads, head_dim], scaled as the forward pass scales its queries
  num = cache["k"].shape[2]
  direct = Piece(jnp.einsum("bhd,bhsd->bhs", qs, own_k), valid,
                 lambda w: weighted_sum("bhs,bhse->bhe", w, own_v))
  span_logits = jnp.einsum("bhd,bhnd->bhn", qs, cache["span_k"])  # [batch, heads, blocks]
  ids = jnp.arange(num)
  visible = jnp.broadcast_to(ids < n, span_logits.shape)  # completed blocks only
  pieces = [direct]
  count = min(select, num)
  if count:
    index, chosen = choose(span_logits, visible, jnp.zeros(visible.shape, jnp.int32), count)  # [b, h, count]
    picked = jnp.any((index[..., None] == ids) & chosen[..., None], axis=-2)  # [batch, heads, blocks]
    at = index[..., None, None]  # [batch, heads, count, 1, 1]
    keys = jnp.take_along_axis(cache["k"], at, axis=2).reshape(*index.shape[:2], count * size, -1)
    values = jnp.take_along_axis(cache["v"], at, axis=2).reshape(*index.shape[:2], count * size, -1)
    # keys [batch, heads, count * size, head_dim], values [..., value_dim]. A chosen block is complete and
    # before the token: all its tokens are visible.
    pieces.append(Piece(jnp.einsum("bhd,bhsd->bhs", qs, keys), jnp.repeat(chosen, size, axis=-1),
                        lambda w: weighted_sum("bhs,bhse->bhe", w, values)))
    visible = visible & ~picked
  pieces.append(Piece(span_logits, visible, lambda w: weighted_sum("bhn,bhne->bhe", w, cache["span_v"])))
  return finish(joint_softmax(pieces), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, *, block_size: Any, select: Any = SELECT,
            pooling: str = "max", query_chunks: Any = None, pool_q: Array | None = None,
            pool_k: Array | None = None) -> Cache:
  """The cache after positions [0, prompt_length), in one pass: the prompt's tokens, every prompt block's
  summary (the last one over its prompt tokens, as `step` leaves it) and the current block's pooled inputs.
  q, k, pool_q, pool_k: [batch, prompt_length, heads, head_dim]; v: [..., value_dim]."""
  del query_chunks
  size, _ = _plan(block_size, select, pooling)
  length = q.shape[1]
  if length == 0:
    return cache
  ct = cache["k"].dtype
  scale = contract.logit_scale(q.shape[-1])
  num = blocks.num_blocks(length, size)
  pad = num * size - length

  def grid(x: Array) -> Array:  # [batch, length, heads, dim] -> [batch, heads, num, size, dim]
    x = jnp.pad(head_major(x.astype(ct)), [(0, 0), (0, 0), (0, pad), (0, 0)])
    return x.reshape(*x.shape[:2], num, size, x.shape[-1])

  pooled = (q if pool_q is None else pool_q, k if pool_k is None else pool_k)
  kb, vb, pqb, pkb = (grid(x) for x in (k, v, *pooled))
  mb = (jnp.arange(num * size) < length).reshape(1, 1, num, size)  # [1, 1, num, size]: the prompt's tokens
  k_bar, v_tilde, _ = span_summaries(pqb, pkb, kb, vb, mb, scale, pooling)  # [batch, heads, num, dim]
  zero = jnp.zeros((), jnp.int32)
  cache = dict(cache)
  cache["k"] = jax.lax.dynamic_update_slice(cache["k"], kb, (zero,) * 5)
  cache["v"] = jax.lax.dynamic_update_slice(cache["v"], vb, (zero,) * 5)
  cache["span_k"] = jax.lax.dynamic_update_slice(cache["span_k"], k_bar, (zero,) * 4)
  cache["span_v"] = jax.lax.dynamic_update_slice(cache["span_v"], v_tilde, (zero,) * 4)
  if length % size:  # the prompt ends inside a block: its pooled inputs so far; else the next block is empty
    cache["pool_q"] = cache["pool_q"].at[:, :, :size - pad].set(pqb[:, :, -1, :size - pad])
    cache["pool_k"] = cache["pool_k"].at[:, :, :size - pad].set(pkb[:, :, -1, :size - pad])
  return cache


SELECTED = Decoder(init_cache, step, prefill)
