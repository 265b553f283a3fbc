"""Combiner-Mixture (paper §3.3): the vertical and horizontal axial plans combined."""

from __future__ import annotations

from typing import Any

from attention_core import combine, contract
from attention_core.blocks import from_grid
from attention_core.combine import joint_softmax, merge, partial_softmax
from combiner import common, kernel_plans
from combiner.axial import (
  Grid,
  Rows,
  column_piece,
  horizontal_spans,
  horizontal_summaries,
  row_piece,
  vertical_spans,
  vertical_summaries,
)

Array = Any
NORMALIZE = ("mean", "joint")


@common.per_platform
def mixture(q: Array, k: Array, v: Array, *, row_length: int, causal: bool, mask: Array | None = None,
            pooling: str = "max", normalize: str = "mean", pool_q: Array | None = None,
            pool_k: Array | None = None, implementation: str = "auto",
            query_chunks: int | None = None) -> Array:
  """Combiner-Mixture. q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim].

  normalize="mean": the mean of the axial-vertical and axial-horizontal outputs (the paper's mixture of two
    plans).
  normalize="joint": D_i once and both span families under one softmax, as in the authors' released JAX code
    (the two families cover the same keys twice, so this is a different, still row-stochastic, attention).
  implementation: "xla" (einsums), "pallas" (the kernels of `combiner.kernel_plans`), "auto" (pallas on
    GPU/TPU).
  query_chunks (XLA path): run the query rows in this many chunks, one after the other (`common.map_rows`);
    None: as many as keep each chunk's logits within `common.QUERY_CHUNK_BYTES`; 1: one piece.
  """
  op = "combiner.mixture"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  contract.check_choice(normalize, name="normalize", allowed=NORMALIZE, op=op)
  common.check_query_chunks(query_chunks, op=op)
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
    return kernel_plans.axial(*c, row_length=m, direction="mixture", normalize=normalize, causal=causal,
                              pooling=pooling, platform=contract.backend())
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
  g = Grid(x, m)
  chunks = g.chunks(query_chunks, op)
  horizontal_sums = horizontal_summaries(g, pooling, chunks)

  def attention(r: Rows) -> Array:  # [batch, heads, n, cols, value_dim]
    direct = [row_piece(g, r, causal), column_piece(g, r, causal)]
    vertical, horizontal = vertical_spans(g, r, causal), horizontal_spans(g, r, causal, horizontal_sums)
    if normalize == "joint":
      return joint_softmax(direct + [vertical, horizontal])
    # Both plans share D_i: its exponentials and value sums are computed once and merged into each softmax.
    shared = partial_softmax(direct)
    return 0.5 * sum(combine.normalize(merge([shared, partial_softmax([spans])]))
                     for spans in (vertical, horizontal))

  out = common.map_rows(attention, g.query_rows(vertical_summaries(g, causal, pooling)), chunks)
  return common.finish(from_grid(out, g.length, 2), x)
