"""The dyadic levels of Combiner-Logsparse's XLA plan (combiner/logsparse.py) and its sequence-parallel
form: at level l the blocks of size 2^l tile the sequence and query block t reads span block t - 1 when t is
odd. The bidirectional plan runs the same levels on the reversed sequence (`flipped`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core.blocks import num_blocks, shift, to_grid
from attention_core.combine import attend
from combiner import common
from combiner import pooling as pool_ops

Array = Any


def num_levels(length: int) -> int:
  # (L-1).bit_length(), not ceil(log2(L)) - 1: the latter loses the top span when L = 2^k + 1.
  return (length - 1).bit_length()


def level_summaries(x: common.Inputs, pooling: str | None) -> list[tuple[Array, Array, Array]]:
  """Per level l, the span each block of size 2^l reads: (k_prev [batch, heads, blocks, head_dim], v_prev
  [batch, heads, blocks, value_dim], ok_prev [batch, 1, blocks]); block t reads block t - 1 when t is odd.

  pooling=None gives the sparse counterpart: the span is represented by its last position (the suffix sums of
  i's binary expansion) instead of pooled abstractions.
  """
  length = x.q.shape[2]
  out = []
  # Level-0 statistics are the tokens themselves; level l+1 pools pairs of level-l blocks, so all pooling
  # costs O(L·d) in total (and its max-gradient touches full-length tensors only once).
  stats_k = pool_ops.Stats(pool_ops.masked(x.pool_k, x.mask[:, None], pooling or "max"), x.mask[:, None])
  stats_q = pool_ops.Stats(pool_ops.masked(x.pool_q, x.mask[:, None], pooling or "max"), x.mask[:, None])
  for level in range(num_levels(length)):
    size = 1 << level
    blocks = num_blocks(length, size)
    kb, vb = (to_grid(t, blocks, size, 2) for t in (x.k, x.v))  # [batch, heads, blocks, size, d]
    mb = to_grid(x.mask, blocks, size, 1)[:, None]  # [batch, 1, blocks, size]
    if pooling is None:
      k_bar, v_tilde, nonempty = kb[:, :, :, -1], vb[:, :, :, -1], mb[:, :, :, -1]
    else:
      if level:
        stats_k, stats_q = (pool_ops.pair_stats(s, blocks, pooling) for s in (stats_k, stats_q))
      # k_bar: [batch, heads, blocks, head_dim]; nonempty: [batch, 1, blocks]
      k_bar, nonempty = pool_ops.finalize(stats_k, pooling)
      q_bar, _ = pool_ops.finalize(stats_q, pooling)
      in_span = jnp.einsum("bhnd,bhnkd->bhnk", q_bar, kb) * x.scale  # [batch, heads, blocks, size]
      v_tilde = attend(in_span, mb, vb, "bhnk,bhnkd->bhnd")  # [batch, heads, blocks, value_dim]
    # Query block t reads span block t - 1, and only when t is odd (bit `level` of i is set).
    k_prev = shift(k_bar, 2, False, 0.0)
    v_prev = shift(v_tilde, 2, False, 0.0)
    ok_prev = shift(nonempty, 2, False, False) & (jnp.arange(blocks) % 2 == 1)  # [batch, 1, blocks]
    out.append((k_prev, v_prev, ok_prev))
  return out


def flipped(x: common.Inputs) -> common.Inputs:
  def f(t):
    return jnp.flip(t, axis=2)

  return x._replace(q=f(x.q), k=f(x.k), v=f(x.v), mask=jnp.flip(x.mask, axis=1), pool_q=f(x.pool_q),
                    pool_k=f(x.pool_k))
