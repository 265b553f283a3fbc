"""The sparse attentions Combiner is derived from (the paper's Fixed / Logsparse / Axial baselines).

Each is its Combiner plan with the spans dropped: query i attends to D_i plus, for `fixed`, the summary
positions of Child et al. (j mod s = s - 1), for `logsparse`, the last position of each dyadic span. Same
contract and same pieces as the Combiner plans, so the two differ only by what the definition says.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import from_grid, num_blocks, to_grid
from attention_core.combine import Piece, joint_softmax, weighted_sum
from combiner import common, kernel_plans
from combiner.axial import Grid, Rows, column_piece, row_piece
from combiner.fixed import block_direct_piece, other_block_valid
from combiner.logsparse import logsparse_pieces

Array = Any


@common.per_platform
def fixed(q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None = None,
          implementation: str = "auto") -> Array:
  """Sparse Transformer "fixed": own block ∩ Ω_i plus the summary positions {j in Ω_i : j mod s = s-1}."""
  op = "sparse.fixed"
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal)
    return kernel_plans.fixed(*c, size=size, causal=causal, pooling=None, platform=contract.backend())
  x = common.prepare(q, k, v, mask, op=op, causal=causal)
  length = x.q.shape[2]
  blocks = num_blocks(length, size)
  qb, kb, vb = (to_grid(t, blocks, size, 2) for t in (x.q, x.k, x.v))  # [batch, heads, blocks, size, dim]
  mb = to_grid(x.mask, blocks, size, 1)[:, None]  # [batch, 1, blocks, size]
  # The own block's summary position is already in the direct piece; a ragged last block has none (padding).
  # k_sum, v_sum: [b, heads, blocks, dim]; m_sum: [b, 1, blocks]
  k_sum, v_sum, m_sum = kb[:, :, :, -1], vb[:, :, :, -1], mb[:, :, :, -1]
  logits = jnp.einsum("bhnqd,bhrd->bhnqr", qb, k_sum) * x.scale  # [batch, heads, blocks, size, blocks_r]
  valid = other_block_valid(blocks, causal)[:, None, :] & m_sum[:, :, None, None, :]
  summary = Piece(logits, valid, lambda w: weighted_sum("bhnqr,bhrd->bhnqd", w, v_sum))
  out = joint_softmax([block_direct_piece(qb, kb, vb, mb, x.scale, causal), summary])
  return common.finish(from_grid(out, length, 2), x)


@common.per_platform
def logsparse(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
              implementation: str = "auto") -> Array:
  """LogSparse: {i} plus the last position of each dyadic span of [0, i) (mirrored for (i, L) if
  bidirectional)."""
  op = "sparse.logsparse"
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal)
    return kernel_plans.logsparse(*c, causal=causal, pooling=None, platform=contract.backend())
  x = common.prepare(q, k, v, mask, op=op, causal=causal)
  return common.finish(joint_softmax(logsparse_pieces(x, causal, None)), x)


@common.per_platform
def axial(q: Array, k: Array, v: Array, *, row_length: int, causal: bool, mask: Array | None = None,
          implementation: str = "auto", query_chunks: int | None = None) -> Array:
  """Axial attention: (own row ∪ own column) ∩ Ω_i.

  query_chunks (XLA path): as in `combiner.axial`."""
  op = "sparse.axial"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  common.check_query_chunks(query_chunks, op=op)
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal)
    return kernel_plans.axial(*c, row_length=m, direction=None, causal=causal, pooling="max",
                              platform=contract.backend())
  x = common.prepare(q, k, v, mask, op=op, causal=causal)
  g = Grid(x, m)

  def attention(r: Rows) -> Array:  # [batch, heads, n, cols, value_dim]
    return joint_softmax([row_piece(g, r, causal), column_piece(g, r, causal)])

  out = common.map_rows(attention, g.query_rows(), g.chunks(query_chunks, op))
  return common.finish(from_grid(out, g.length, 2), x)
