"""Combiner-Axial (paper §4.3, Appendix C) on an n x m grid of rows of length m = row_length.

Positions are laid out as (row, col) = (i // m, i % m); the sequence is padded to whole rows with masked keys.
Each direction is built as a list of `Piece`s for the shared joint softmax so that
`mixture(normalize="joint")` can put several span families under one softmax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import from_grid, head_major, num_blocks, to_grid
from attention_core.combine import Piece, attend, joint_softmax, weighted_sum
from combiner import common, kernel_plans
from combiner import pooling as pool_ops
from combiner.fixed import block_direct_piece, block_logits

Array = Any
DIRECTIONS = ("rowmajor", "vertical", "horizontal")


class Grid:
  """The inputs laid out head-major as [batch, heads, rows, cols, dim] (mask [batch, 1, rows, cols])."""

  def __init__(self, x: common.Inputs, row_length: int):
    self.length = x.q.shape[2]
    self.cols = row_length
    self.rows = num_blocks(self.length, row_length)
    self.q, self.k, self.v, self.pool_q, self.pool_k = (
        to_grid(t, self.rows, self.cols, 2) for t in (x.q, x.k, x.v, x.pool_q, x.pool_k))
    self.mask = to_grid(x.mask, self.rows, self.cols, 1)[:, None]
    self.scale = x.scale
    self.itemsize = jnp.dtype(self.q.dtype).itemsize

  def column_mask(self) -> Array:
    """[batch, 1, 1, cols, rows]: mask[s, c] indexed as [..., c, s]."""
    return jnp.swapaxes(self.mask, 2, 3)[:, :, None]

  def row_bytes(self, n: int) -> int:
    """Bytes of one grid row's logits against n keys per query: [batch, heads, 1, cols, n]."""
    return self.q.shape[0] * self.q.shape[1] * self.cols * n * self.itemsize

  def chunks(self, query_chunks: int | None, op: str) -> int:
    """How many chunks of query rows the pieces run in (`common.map_rows`): their largest logits are
    [batch, heads, rows, cols, max(rows, cols)]."""
    return common.row_chunks(self.rows, self.row_bytes(max(self.rows, self.cols)), query_chunks, op=op)

  def query_rows(self, spans: Any = None) -> Rows:
    """All rows as queries (a chunk of them is a slice of every field along axis 2)."""
    return Rows(self.q, self.k, self.v, self.mask, jnp.arange(self.rows)[None, None], spans)


class Rows(NamedTuple):
  """A run of query rows of the grid and what each of them reads from its own row (rows on axis 2)."""

  q: Array  # [batch, heads, n, cols, head_dim]
  k: Array  # [batch, heads, n, cols, head_dim]: the rows' own keys
  v: Array  # [batch, heads, n, cols, value_dim]
  mask: Array  # [batch, 1, n, cols]
  ids: Array  # [1, 1, n]: the rows' indices in the grid
  spans: Any  # per-row span summaries of the plan (vertical: `VerticalSummaries`), or None


def rows_valid(r: Rows, rows: int, causal: bool) -> Array:
  """[n, rows_s]: which grid rows s are other rows for the query rows r (before r when causal)."""
  s = jnp.arange(rows)
  ids = r.ids[0, 0][:, None]
  return (s[None, :] < ids) if causal else (s[None, :] != ids)


def row_piece(g: Grid, r: Rows, causal: bool, logits: Array | None = None) -> Piece:
  """Own row ∩ Ω_i (the own row is a 'block' of the grid)."""
  return block_direct_piece(r.q, r.k, r.v, r.mask, g.scale, causal, logits)


def column_piece(g: Grid, r: Rows, causal: bool) -> Piece:
  """Own column ∩ Ω_i without i itself (i is already in the row piece)."""
  logits = jnp.einsum("bhrcd,bhscd->bhrcs", r.q, g.k) * g.scale  # [batch, heads, n, cols, rows_s]
  valid = rows_valid(r, g.rows, causal)[:, None, :] & g.column_mask()
  return Piece(logits, valid, lambda w: weighted_sum("bhrcs,bhscd->bhrcd", w, g.v))


class RowSummaries(NamedTuple):
  """Per grid row s: the pooled row, and per column c the value row s gives the query aligned with c."""

  k_bar: Array  # [batch, heads, rows_s, head_dim]
  nonempty: Array  # [batch, 1, rows_s]
  v_tilde: Array  # [batch, heads, rows_s, cols_c, value_dim]


def rowmajor_summaries(g: Grid, pooling: str, span_key_fn: Callable | None, chunks: int,
                       row_logits: Array | None = None) -> RowSummaries:
  """Span key: the pooled row; span query: the column-aligned token's own query q_(r', col(i)), falling back
  to the pooled row query where that token is masked or padding.

  row_logits: [batch, heads, rows, cols_q, cols_k], the in-row logits the direct piece uses too (one chunk);
  None: recomputed in `chunks` chunks of rows.
  """
  # k_bar: [b, heads, rows, dim]; nonempty: [b, 1, rows]
  k_bar, nonempty = pool_ops.pool(g.pool_k, g.mask, axis=3, kind=pooling)
  if span_key_fn is not None:
    k_bar = head_major(span_key_fn(head_major(k_bar)))  # the hook sees [batch, rows, heads, dim]
  q_bar, _ = pool_ops.pool(g.pool_q, g.mask, axis=3, kind=pooling)

  def expected_values(s: tuple[Array, ...]) -> Array:
    q_bar, q, k, v, mask, logits = s
    if logits is None:
      logits = block_logits(q, k, g.scale)
    # v_tilde[s, c]: the whole row s attended by the query aligned with column c: the direct piece's row
    # logits, except where that token is masked or padding and the pooled row query stands in.
    pooled_logits = jnp.einsum("bhsd,bhsed->bhse", q_bar, k) * g.scale  # [batch, heads, n, cols_e]
    # [b, heads, n, cols, cols_e]
    in_row = jnp.where(mask[..., None], logits, pooled_logits[:, :, :, None])
    return attend(in_row, mask[:, :, :, None, :], v, "bhsce,bhsed->bhscd")  # [b, heads, n, cols, dv]

  v_tilde = common.map_rows(expected_values, (q_bar, g.q, g.k, g.v, g.mask, row_logits), chunks)
  return RowSummaries(k_bar, nonempty, v_tilde)


def rowmajor_spans(g: Grid, r: Rows, causal: bool, spans: RowSummaries) -> Piece:
  """One span per other row (causal: rows before)."""
  logits = jnp.einsum("bhrcd,bhsd->bhrcs", r.q, spans.k_bar) * g.scale  # [batch, heads, n, cols, rows_s]
  valid = rows_valid(r, g.rows, causal)[:, None, :] & spans.nonempty[:, :, None, None, :]
  return Piece(logits, valid, lambda w: weighted_sum("bhrcs,bhscd->bhrcd", w, spans.v_tilde))


def _all_but_one(x: Array, valid: Array, axis: int, causal: bool, pooling: str) -> tuple[Array, Array]:
  """Pools, for every position t along `axis`, the members before t (causal) or all members except t."""
  if causal:
    stats = pool_ops.exclusive_scan_stats(x, valid, axis, pooling)
  else:
    stats = pool_ops.all_but_one_stats(x, valid, axis, pooling)
  return pool_ops.finalize(stats, pooling)


class VerticalSummaries(NamedTuple):
  """Per query (r, e): column e's rows s < r (causal) or s != r, pooled (rows on axis 2)."""

  k_bar: Array  # [batch, heads, rows, cols_e, head_dim]
  nonempty: Array  # [batch, 1, rows, cols_e]
  q_bar: Array  # [batch, heads, rows, cols_e, head_dim]


def vertical_summaries(g: Grid, causal: bool, pooling: str) -> VerticalSummaries:
  k_bar, nonempty = _all_but_one(g.pool_k, g.mask, 2, causal, pooling)
  q_bar, _ = _all_but_one(g.pool_q, g.mask, 2, causal, pooling)
  return VerticalSummaries(k_bar, nonempty, q_bar)


def vertical_spans(g: Grid, r: Rows, causal: bool) -> Piece:
  """For query (r, c) and every other column e: column e ∩ Ω_i minus D_i, i.e. rows s < r (causal)
  or s != r. r.spans: the rows' `VerticalSummaries`."""
  k_bar, nonempty, q_bar = r.spans
  # v_tilde[r, e] = softmax over rows s of column e (s < r or s != r) of s(q_bar[r, e], k[s, e]).
  in_col = jnp.einsum("bhred,bhsed->bhres", q_bar, g.k) * g.scale  # [batch, heads, n, cols_e, rows_s]
  col_valid = rows_valid(r, g.rows, causal)[:, None, :] & g.column_mask()
  v_tilde = attend(in_col, col_valid, g.v, "bhres,bhsed->bhred")  # [batch, heads, n, cols, value_dim]
  logits = jnp.einsum("bhrcd,bhred->bhrce", r.q, k_bar) * g.scale  # [batch, heads, n, cols_c, cols_e]
  valid = ~jnp.eye(g.cols, dtype=bool) & nonempty[:, :, :, None, :]
  return Piece(logits, valid, lambda w: weighted_sum("bhrce,bhred->bhrcd", w, v_tilde))


class HorizontalSummaries(NamedTuple):
  """Per row s and column c: row s minus column c, pooled, and the value it expects for its own query."""

  k_bar: Array  # [batch, heads, rows_s, cols_c, head_dim]
  nonempty: Array  # [batch, 1, rows_s, cols_c]
  v_tilde: Array  # [batch, heads, rows_s, cols_c, value_dim]


def horizontal_summaries(g: Grid, pooling: str, chunks: int) -> HorizontalSummaries:
  """The span summaries of every row, their in-row attention computed in `chunks` chunks of rows."""
  k_bar, nonempty = _all_but_one(g.pool_k, g.mask, 3, False, pooling)  # [b, heads, rows_s, cols_c, dim]
  q_bar, _ = _all_but_one(g.pool_q, g.mask, 3, False, pooling)

  def expected_values(s: tuple[Array, Array, Array, Array]) -> Array:
    q_bar, k, v, mask = s
    # v_tilde[s, c] = softmax over columns e != c of row s of s(q_bar[s, c], k[s, e]).
    in_row = jnp.einsum("bhscd,bhsed->bhsce", q_bar, k) * g.scale  # [batch, heads, n, cols_c, cols_e]
    row_valid = ~jnp.eye(g.cols, dtype=bool) & mask[:, :, :, None, :]
    return attend(in_row, row_valid, v, "bhsce,bhsed->bhscd")  # [batch, heads, n, cols, value_dim]

  v_tilde = common.map_rows(expected_values, (q_bar, g.k, g.v, g.mask), chunks)
  return HorizontalSummaries(k_bar, nonempty, v_tilde)


def horizontal_spans(g: Grid, r: Rows, causal: bool, spans: HorizontalSummaries) -> Piece:
  """For query (r, c) and every other row s (causal: s < r): row s ∩ Ω_i minus column c."""
  logits = jnp.einsum("bhrcd,bhscd->bhrcs", r.q, spans.k_bar) * g.scale  # [batch, heads, n, cols, rows_s]
  valid = rows_valid(r, g.rows, causal)[:, None, :] & jnp.swapaxes(spans.nonempty, 2, 3)[:, :, None]
  return Piece(logits, valid, lambda w: weighted_sum("bhrcs,bhscd->bhrcd", w, spans.v_tilde))


def axial_xla(x: common.Inputs, m: int, direction: str, causal: bool, pooling: str,
              span_key_fn: Callable | None, query_chunks: int | None, op: str) -> Array:
  """The einsum plan: [batch, heads, length, value_dim]."""
  g = Grid(x, m)
  chunks = g.chunks(query_chunks, op)
  r = g.query_rows()
  if direction == "rowmajor" and chunks == 1:
    # In one piece the in-row logits serve both the direct piece and the span summaries.
    logits = block_logits(g.q, g.k, g.scale)
    sums = rowmajor_summaries(g, pooling, span_key_fn, 1, logits)
    out = joint_softmax([row_piece(g, r, causal, logits), rowmajor_spans(g, r, causal, sums)])
    return from_grid(out, g.length, 2)  # [batch, heads, length, value_dim]
  if direction == "rowmajor":
    sums = rowmajor_summaries(g, pooling, span_key_fn, chunks)
    spans = functools.partial(rowmajor_spans, g, causal=causal, spans=sums)
  elif direction == "vertical":
    r = g.query_rows(vertical_summaries(g, causal, pooling))
    spans = functools.partial(vertical_spans, g, causal=causal)
  else:
    sums = horizontal_summaries(g, pooling, chunks)
    spans = functools.partial(horizontal_spans, g, causal=causal, spans=sums)

  def attention(r: Rows) -> Array:  # [batch, heads, n, cols, value_dim]
    direct = [row_piece(g, r, causal)]
    if direction != "rowmajor":
      direct.append(column_piece(g, r, causal))
    return joint_softmax(direct + [spans(r)])

  return from_grid(common.map_rows(attention, r, chunks), g.length, 2)  # [batch, heads, length, value_dim]


@common.per_platform
def axial(q: Array, k: Array, v: Array, *, row_length: int, direction: str, causal: bool,
          mask: Array | None = None, pooling: str = "max", pool_q: Array | None = None,
          pool_k: Array | None = None, span_key_fn: Callable[[Array], Array] | None = None,
          implementation: str = "auto", query_chunks: int | None = None) -> Array:
  """Combiner-Axial. q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim].

  direction: "rowmajor" (D_i = own row; one span per other row), "vertical" (D_i = own row ∪ own column; one
  span per other column), "horizontal" (D_i = own row ∪ own column; one span per other row).
  Cost O(L·(n + m)·d).
  span_key_fn (rowmajor only): maps the pooled span keys [batch, rows, heads, head_dim] to the keys used.
  implementation: "xla" (einsums), "pallas" (the kernels of `combiner.kernel_plans`), "auto" (pallas on
  GPU/TPU).
  query_chunks (XLA path): run the query rows in this many chunks, one after the other
  (`common.map_rows`); None: as many as keep each chunk's logits within `common.QUERY_CHUNK_BYTES`; 1: one
  piece.
  """
  op = "combiner.axial"
  contract.check_choice(direction, name="direction", allowed=DIRECTIONS, op=op)
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  common.check_query_chunks(query_chunks, op=op)
  if span_key_fn is not None and direction != "rowmajor":
    raise ValueError(f"{op}: argument 'span_key_fn' is only supported for direction='rowmajor', "
                     f"got {direction!r}")
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
    kbar = None if span_key_fn is None else span_key_fn(_row_keys(c, m, pooling))
    return kernel_plans.axial(*c, row_length=m, direction=direction, causal=causal, pooling=pooling,
                              platform=contract.backend(), kbar=kbar)
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
  return common.finish(axial_xla(x, m, direction, causal, pooling, span_key_fn, query_chunks, op), x)


def _row_keys(c: common.Checked, m: int, pooling: str) -> Array:
  """The pooled key of every grid row, [batch, rows, heads, head_dim] (the span keys a learned function of
  them replaces)."""
  batch, length, heads, _ = c.q.shape
  rows = num_blocks(length, m)
  mask = jnp.ones((batch, length), bool) if c.mask is None else c.mask
  pk = c.k if c.pool_k is None else c.pool_k
  kb = to_grid(pk.astype(contract.softmax_dtype(pk.dtype)), rows, m, 1)  # [batch, rows, m, heads, d]
  k_bar, _ = pool_ops.pool(kb, to_grid(mask, rows, m, 1)[..., None], axis=2, kind=pooling)
  return k_bar
