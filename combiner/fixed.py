"""Combiner-Fixed (paper §4.1): direct attention inside the own block, one pooled span per other block."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import from_grid, num_blocks, to_grid
from attention_core.combine import Piece, joint_softmax, weighted_sum
from combiner import common, kernel_plans, selected

Array = Any


def block_logits(qb: Array, kb: Array, scale: float) -> Array:
  """[batch, heads, blocks, size_q, size_k] logits of every query against its own block."""
  return jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kb) * scale


def block_direct_piece(qb: Array, kb: Array, vb: Array, mb: Array, scale: float, causal: bool,
                       logits: Array | None = None) -> Piece:
  """Attention to the own block ∩ Ω_i. qb, kb: [batch, heads, blocks, size, dim];
  mb: [batch, 1, blocks, size]."""
  size = qb.shape[3]
  if logits is None:
    logits = block_logits(qb, kb, scale)
  valid = mb[:, :, :, None, :]
  if causal:
    valid = valid & jnp.tril(jnp.ones((size, size), dtype=bool))
  return Piece(logits, valid, lambda w: weighted_sum("bhnqk,bhnkd->bhnqd", w, vb))


def other_block_valid(blocks: int, causal: bool) -> Array:
  """[blocks_q, blocks_r]: which blocks r are spans for queries of block n (before n when causal)."""
  n = jnp.arange(blocks)
  return (n[None, :] < n[:, None]) if causal else (n[None, :] != n[:, None])


@common.per_platform
def fixed(q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None = None,
          pooling: str = "max", pool_q: Array | None = None, pool_k: Array | None = None,
          implementation: str = "auto", select: int = 0, query_chunks: int | None = None) -> Array:
  """Combiner-Fixed. q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim].

  D_i = own block ∩ Ω_i; spans = every other block ∩ Ω_i (causal: the blocks before b(i)). Cost
  O(L·(s + L/s)·d), i.e. O(L·sqrt(L)·d) at s ~ sqrt(L).
  implementation: "xla" (einsums), "pallas" (the kernels of `combiner.kernel_plans`), "auto" (pallas on
  GPU/TPU).
  select: beyond the paper, each query's `select` best spans by summary logit are attended exactly in place
  of their summaries (`combiner.selected`; the XLA path runs its queries in `query_chunks` chunks, None =
  automatic).
  """
  op = "combiner.fixed"
  select = select and contract.check_positive_int(select, name="select", op=op)  # 0: the paper's plan
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  common.check_query_chunks(query_chunks, op=op)
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
    return kernel_plans.fixed(*c, size=size, causal=causal, pooling=pooling, platform=contract.backend(),
                              select=select)
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
  if select:
    length = x.q.shape[2]
    blocks = num_blocks(length, size)
    grids = (to_grid(t, blocks, size, 2) for t in (x.pool_q, x.pool_k, x.k, x.v))
    summaries = common.span_summaries(*grids, to_grid(x.mask, blocks, size, 1)[:, None], x.scale, pooling)
    return common.finish(selected.fixed_selected(x, size, causal, select, *summaries, query_chunks), x)
  length = x.q.shape[2]
  blocks = num_blocks(length, size)
  qb, kb, vb, pqb, pkb = (to_grid(t, blocks, size, 2) for t in (x.q, x.k, x.v, x.pool_q, x.pool_k))
  mb = to_grid(x.mask, blocks, size, 1)[:, None]  # [batch, 1, blocks, size]

  k_bar, v_tilde, nonempty = common.span_summaries(pqb, pkb, kb, vb, mb, x.scale, pooling)
  direct = block_direct_piece(qb, kb, vb, mb, x.scale, causal)
  logits = jnp.einsum("bhnqd,bhrd->bhnqr", qb, k_bar) * x.scale  # [batch, heads, blocks, size, blocks_r]
  valid = other_block_valid(blocks, causal)[:, None, :] & nonempty[:, :, None, None, :]
  spans = Piece(logits, valid, lambda w: weighted_sum("bhnqr,bhrd->bhnqd", w, v_tilde))
  out = joint_softmax([direct, spans])  # [batch, heads, blocks, size, value_dim]
  return common.finish(from_grid(out, length, 2), x)


SELECT = 4  # spans per query attended exactly by default (`combiner_fixed_select`)


@common.per_platform
def fixed_select(q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None = None,
                 pooling: str = "max", pool_q: Array | None = None, pool_k: Array | None = None,
                 select: int = SELECT, implementation: str = "auto",
                 query_chunks: int | None = None) -> Array:
  """`fixed(..., select=select)` as its own registered attention: Combiner-Fixed whose `select` best spans
  per query are attended exactly. q, k: [batch, length, heads, head_dim]; v: [..., value_dim] -> [batch,
  length, heads, value_dim]."""
  return fixed(q, k, v, block_size=block_size, causal=causal, mask=mask, pooling=pooling, pool_q=pool_q,
               pool_k=pool_k, implementation=implementation, select=select, query_chunks=query_chunks)
