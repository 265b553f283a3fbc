"""Combiner-Fixed with selected spans: the top-n spans of each query attended exactly (NSA-style selection).

Combiner-Fixed gives each query direct attention inside its own block and one summary per other visible
block (k_bar_r, the pooled key; v_tilde_r, the in-span expectation). Here each query also ranks its visible
spans by their summary logits q_i . k_bar_r and, for its `select` best, replaces the summary by the span's
tokens: their exact logits q_i . k_j enter the one joint softmax in place of the summary's. Every visible
position is still covered once (through its block's summary or exactly), so each row sums to one; with
`select` >= the number of blocks the op is dense attention, with 0 it is Combiner-Fixed. The choice is made
without gradient (as NSA's and MoBA's). XLA only: each query's chosen blocks are gathered over chunks of
queries (`attention_core.selection`), O(L * select * block_size * d) time and O(chunk) memory.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import map_chunks, num_blocks
from attention_core.combine import Piece, flag_nonfinite, joint_softmax, weighted_sum
from attention_core.selection import choose, chosen_piece, num_query_chunks, pad_length
from combiner import common

Array = Any


def fixed_selected(x: common.Inputs, size: int, causal: bool, select: int, k_bar: Array, v_tilde: Array,
                   nonempty: Array, query_chunks: int | None = None) -> Array:
  """Combiner-Fixed over `x` (head-major, `common.prepare`) with each query's `select` best spans exact.

  k_bar [batch, heads, blocks, d], v_tilde [batch, heads, blocks, e], nonempty [batch, 1, blocks]: the span
  summaries of `combiner.common.span_summaries`. Returns [batch, heads, length, value_dim] in the softmax
  dtype (`common.finish` makes the contract's)."""
  batch, heads, length, head_dim = x.q.shape
  value_dim = x.v.shape[-1]
  rows = batch * heads
  blocks = num_blocks(length, size)
  padded = blocks * size
  count = min(select, blocks)
  k_bar = k_bar.reshape(rows, blocks, head_dim)  # [rows, blocks, d]
  v_tilde = v_tilde.reshape(rows, blocks, value_dim)  # [rows, blocks, e]
  filled = jnp.broadcast_to(nonempty, (batch, heads, blocks)).reshape(rows, blocks)  # [rows, blocks]

  # Rows layout [batch * heads, ...] for the per-query gathers; masked keys and values are zeros (prepare),
  # future values of the own block are flagged so that a NaN there stays out of the output.
  kb = pad_length(x.k.reshape(rows, length, head_dim), padded).reshape(rows, blocks, size, head_dim)
  vb = flag_nonfinite(pad_length(x.v.reshape(rows, length, value_dim), padded))
  vb = vb.reshape(rows, blocks, size, value_dim + 1)
  real = jnp.repeat(pad_length(x.mask, padded, False), heads, axis=0).reshape(rows, blocks, size)
  ids = jnp.arange(blocks)

  def attend_chunk(tree: tuple[Array, Array]) -> Array:
    qc, qpos = tree  # [rows, Q, d] (scaled), [1, Q]
    own = (qpos // size)[..., None]  # [1, Q, 1]
    visible = filled[:, None, :] & ((ids < own) if causal else (ids != own))  # [rows, Q, blocks]
    span_logits = jnp.einsum("gqd,gnd->gqn", qc, k_bar)  # [rows, Q, blocks]
    index, chosen = choose(span_logits, visible, jnp.zeros(visible.shape, jnp.int32), count)
    picked = jnp.any((index[..., None] == ids) & chosen[..., None], axis=-2)  # [rows, Q, blocks]
    own_index = jnp.broadcast_to(own, (rows, *own.shape[1:])).astype(jnp.int32)  # [rows, Q, 1]
    direct = chosen_piece(qc, kb, vb, real, own_index, jnp.ones(own_index.shape, bool), qpos, causal, 1.0)
    exact = chosen_piece(qc, kb, vb, real, index, chosen, qpos, causal, 1.0)
    summaries = Piece(span_logits, visible & ~picked, lambda w: weighted_sum("gqn,gne->gqe", w, v_tilde))
    return joint_softmax([direct, exact, summaries])  # [rows, Q, e]

  per_query = (count + 1) * size * (head_dim + value_dim + 2) + 3 * blocks
  chunks = query_chunks if query_chunks is not None else num_query_chunks(rows, padded, per_query)
  qp = pad_length(x.q.reshape(rows, length, head_dim) * x.scale, padded)
  qpos = jnp.arange(padded, dtype=jnp.int32)[None, :]
  out = map_chunks(attend_chunk, (qp, qpos), contract.check_positive_int(chunks, name="query_chunks",
                                                                           op="combiner.fixed"), axis=1)
  return out[:, :length].reshape(batch, heads, length, value_dim)

