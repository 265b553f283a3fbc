"""Cached decoding for Combiner-Logsparse (`combiner.logsparse`) and its sparse counterpart
(`combiner.sparse.logsparse`).

A `attention_core.decode.Decoder` (its docstring gives the protocol) whose step equals row `position` of the
plan's
causal forward pass: the same pieces and pooling laid out for one query. Each step writes the span summaries
its token completes, so every summary a query reads is complete and the per-token cost stays bounded.

One slot per dyadic level holding the last completed even-indexed block (the only one a query can read at that
level); a level's summary is computed when its block completes (`lax.cond`), so the amortised cost is
O(log L) per token.

Layouts (head-major, one token): q_t, k_t, pool_q, pool_k: [batch, heads, head_dim]; v_t: [batch, heads,
value_dim]; `position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_core import contract
from attention_core.combine import Piece, joint_softmax
from attention_core.decode import Cache, finish, keys_piece, make_decoder, read, token, write, zeros
from combiner import pooling as pool_ops
from combiner.common import span_summaries
from combiner.dyadic import num_levels

Array = Any


def _logsparse_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
                    sparse: bool) -> Cache:
  levels = num_levels(max(max_length, 1))
  cache = {"level_k": zeros(batch, heads, levels, head_dim, dtype),
           "level_v": zeros(batch, heads, levels, value_dim, dtype)}
  if not sparse:  # the keys of a completed block are pooled when it completes
    cache.update({name: zeros(batch, heads, max_length, dim, dtype) for name, dim in
                  (("k", head_dim), ("v", value_dim), ("pool_q", head_dim), ("pool_k", head_dim))})
  return cache


def _logsparse_step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None,
                    pool_k: Array | None, pooling: str | None, op: str) -> tuple[Array, Cache]:
  """Level l keeps the last completed block of size 2^l with an even index: the span a query with bit l set
  reads is exactly that block. pooling=None: the sparse counterpart (a span is its last position)."""
  x = token(q, k, v, position, pool_q, pool_k, op=op)
  t = x.position
  cache = dict(cache)
  levels = cache["level_k"].shape[2]
  done = t + 1
  if pooling is None:
    completes = [(done % (1 << lvl) == 0) & ((done >> lvl) % 2 == 1) for lvl in range(levels)]
    store = jnp.stack(completes)[None, None, :, None]  # [1, 1, levels, 1]
    cache["level_k"] = jnp.where(store, x.k[:, :, None], cache["level_k"])
    cache["level_v"] = jnp.where(store, x.v[:, :, None], cache["level_v"])
  else:
    for name, val in (("k", x.k), ("v", x.v), ("pool_q", x.pool_q), ("pool_k", x.pool_k)):
      cache[name] = write(cache[name], val, t)
    for lvl in range(levels):
      size = 1 << lvl

      def complete(lk_lv, size=size, lvl=lvl):
        start = jnp.maximum(done - size, 0)
        block = [read(cache[name], start, size, 2) for name in ("pool_q", "pool_k", "k", "v")]
        k_bar, v_tilde, _ = span_summaries(*block, jnp.ones((size,), bool), x.scale, pooling)
        return write(lk_lv[0], k_bar, lvl), write(lk_lv[1], v_tilde, lvl)

      completes = (done % size == 0) & ((done >> lvl) % 2 == 1)
      cache["level_k"], cache["level_v"] = jax.lax.cond(completes, complete, lambda lk_lv: lk_lv,
                                                        (cache["level_k"], cache["level_v"]))
  self_piece = Piece(jnp.einsum("bhd,bhd->bh", x.q, x.k)[..., None] * x.scale, jnp.ones((1,), bool),
                     lambda w: w * x.v)
  bits = ((t >> jnp.arange(levels)) & 1) == 1  # [levels]: the spans of query t
  out = joint_softmax([self_piece, keys_piece(x, cache["level_k"], cache["level_v"], bits)])
  return finish(out, x), cache


def logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype, *, pooling: str = "max"):
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op="combiner.logsparse")
  return _logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype, sparse=False)


def logsparse_step(cache, q, k, v, position, *, pooling: str = "max", pool_q=None, pool_k=None):
  return _logsparse_step(cache, q, k, v, position, pool_q=pool_q, pool_k=pool_k, pooling=pooling,
                         op="combiner.logsparse")


def sparse_logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype):
  return _logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype, sparse=True)


def sparse_logsparse_step(cache, q, k, v, position, *, pool_q=None, pool_k=None):
  del pool_q, pool_k
  return _logsparse_step(cache, q, k, v, position, pool_q=None, pool_k=None, pooling=None,
                         op="sparse.logsparse")


LOGSPARSE = make_decoder(logsparse_init, logsparse_step)
SPARSE_LOGSPARSE = make_decoder(sparse_logsparse_init, sparse_logsparse_step)
