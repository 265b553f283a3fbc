"""Cached decoding for Combiner-Axial (`combiner.axial`: rowmajor, vertical, horizontal) and its sparse
counterpart (`combiner.sparse.axial`), on a grid of rows of length m (`combiner.mixture_decode` reuses it).

A `attention_core.decode.Decoder` (its docstring gives the protocol) whose step equals row `position` of the
plan's
causal forward pass: the same pieces and pooling laid out for one query. Each step writes the span summaries
its token completes, so every summary a query reads is complete and the per-token cost stays bounded.

The cache holds the whole grid (the column piece reads a column). rowmajor/horizontal summaries of row r - 1
are computed one column per step during row r, exactly when the query of that column first needs them;
vertical summaries of column c over rows <= r are written at (r, c) for the next row: O(rows + cols) per
token.

Layouts (head-major, one token): q_t, k_t, pool_q, pool_k: [batch, heads, head_dim]; v_t: [batch, heads,
value_dim]; `position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from attention_core import blocks, contract
from attention_core.combine import Piece, attend, joint_softmax
from attention_core.decode import Cache, Token, finish, keys_piece, make_decoder, read, token, write, zeros
from combiner import pooling as pool_ops
from combiner.axial import DIRECTIONS
from combiner.common import span_summaries

Array = Any


def grid_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               row_length: int, families: tuple[str, ...], op: str) -> Cache:
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  rows = blocks.num_blocks(max_length, m)
  grid = (rows, m)
  cache = {"k": zeros(batch, heads, grid, head_dim, dtype), "v": zeros(batch, heads, grid, value_dim, dtype)}
  if any(f in families for f in ("rowmajor", "vertical", "horizontal")):
    cache.update(pool_q=zeros(batch, heads, grid, head_dim, dtype),
                 pool_k=zeros(batch, heads, grid, head_dim, dtype))
  if "rowmajor" in families:
    cache.update(q=zeros(batch, heads, grid, head_dim, dtype),
                 row_k=zeros(batch, heads, rows, head_dim, dtype),
                 row_v=zeros(batch, heads, grid, value_dim, dtype))
  if "vertical" in families:  # index r + 1 holds column summaries over rows <= r
    cache.update(col_k=zeros(batch, heads, (rows + 1, m), head_dim, dtype),
                 col_v=zeros(batch, heads, (rows + 1, m), value_dim, dtype))
  if "horizontal" in families:
    cache.update(hrow_k=zeros(batch, heads, grid, head_dim, dtype),
                 hrow_v=zeros(batch, heads, grid, value_dim, dtype))
  return cache


class GridStep(NamedTuple):
  x: Token
  cache: Cache
  r: Array
  c: Array
  rows: int
  cols: int


def grid_write(cache: Cache, x: Token, row_length: int) -> GridStep:
  m = row_length
  r, c = x.position // m, x.position % m
  cache = dict(cache)
  for name, val in (("k", x.k), ("v", x.v), ("pool_q", x.pool_q), ("pool_k", x.pool_k), ("q", x.q)):
    if name in cache:
      cache[name] = write(cache[name], val, r, c)
  return GridStep(x, cache, r, c, cache["k"].shape[2], m)


def _row(g: GridStep, name: str, r: Array) -> Array:
  return read(g.cache[name], r, 1, 2)[:, :, 0]  # [batch, heads, cols, dim]


def _column(g: GridStep, name: str, c: Array) -> Array:
  return read(g.cache[name], c, 1, 3)[:, :, :, 0]  # [batch, heads, rows, dim]


def row_piece(g: GridStep) -> Piece:
  """Own row ∩ Ω_i."""
  return keys_piece(g.x, _row(g, "k", g.r), _row(g, "v", g.r), jnp.arange(g.cols) <= g.c)


def column_piece(g: GridStep) -> Piece:
  """Own column ∩ Ω_i without the token itself (it is in the row piece)."""
  return keys_piece(g.x, _column(g, "k", g.c), _column(g, "v", g.c), jnp.arange(g.rows) < g.r)


def _rowmajor_spans(g: GridStep, pooling: str, span_key_fn: Callable | None) -> tuple[Piece, Cache]:
  """Spans = earlier rows; the summary of row r - 1 for this column is made now (all of row r - 1 is known),
  the first time a query of this column needs it. Its span query is the column-aligned token's own query."""
  cache, prev = dict(g.cache), jnp.maximum(g.r - 1, 0)
  everything = jnp.ones((g.cols,), bool)
  pk, k, v = _row(g, "pool_k", prev), _row(g, "k", prev), _row(g, "v", prev)  # [batch, heads, cols, dim]
  k_bar, _ = pool_ops.pool(pk, everything[None, None], axis=2, kind=pooling)  # [batch, heads, head_dim]
  if span_key_fn is not None:
    k_bar = span_key_fn(k_bar[:, None])[:, 0]  # the hook sees [batch, rows, heads, head_dim]
  q_aligned = read(_row(g, "q", prev), g.c, 1, 2)[:, :, 0]  # [batch, heads, head_dim]
  v_tilde = attend(jnp.einsum("bhd,bhed->bhe", q_aligned, k) * g.x.scale, everything, v, "bhe,bhed->bhd")
  # At r = 0 these writes fill slots no query reads before row 1 rewrites them.
  cache["row_k"] = write(cache["row_k"], k_bar, prev)
  cache["row_v"] = write(cache["row_v"], v_tilde, prev, g.c)
  row_v = read(cache["row_v"], g.c, 1, 3)[:, :, :, 0]  # [batch, heads, rows, value_dim]
  piece = keys_piece(g.x, cache["row_k"], row_v, jnp.arange(g.rows) < g.r)
  return piece, cache


def vertical_spans(g: GridStep, pooling: str) -> tuple[Piece, Cache]:
  """Spans = column e ∩ rows < r for every other column e; column c over rows <= r is summarised now, for row
  r + 1 (index r + 1)."""
  cache = dict(g.cache)
  upto = jnp.arange(g.rows) <= g.r
  k_bar, v_tilde, _ = span_summaries(_column(g, "pool_q", g.c), _column(g, "pool_k", g.c),
                                     _column(g, "k", g.c), _column(g, "v", g.c), upto, g.x.scale, pooling)
  cache["col_k"] = write(cache["col_k"], k_bar, g.r + 1, g.c)
  cache["col_v"] = write(cache["col_v"], v_tilde, g.r + 1, g.c)
  valid = (jnp.arange(g.cols) != g.c) & (g.r > 0)
  col_k, col_v = (read(cache[n], g.r, 1, 2)[:, :, 0] for n in ("col_k", "col_v"))  # [batch, heads, cols, dim]
  piece = keys_piece(g.x, col_k, col_v, valid)
  return piece, cache


def horizontal_spans(g: GridStep, pooling: str) -> tuple[Piece, Cache]:
  """Spans = row s minus column c for every earlier row s; row r - 1's summary for column c is made now."""
  cache, prev = dict(g.cache), jnp.maximum(g.r - 1, 0)
  others = jnp.arange(g.cols) != g.c
  pq, pk, k, v = (_row(g, name, prev) for name in ("pool_q", "pool_k", "k", "v"))
  k_bar, v_tilde, nonempty = span_summaries(pq, pk, k, v, others, g.x.scale, pooling)
  cache["hrow_k"] = write(cache["hrow_k"], k_bar, prev, g.c)
  cache["hrow_v"] = write(cache["hrow_v"], v_tilde, prev, g.c)
  valid = (jnp.arange(g.rows) < g.r) & nonempty[0]  # a row of one column has no span once c is removed
  row_k, row_v = (read(cache[n], g.c, 1, 3)[:, :, :, 0] for n in ("hrow_k", "hrow_v"))  # [b, h, rows, d]
  piece = keys_piece(g.x, row_k, row_v, valid)
  return piece, cache


def axial_init(batch, heads, max_length, head_dim, value_dim, dtype, *, row_length: int, direction: str,
               pooling: str = "max"):
  op = "combiner.axial"
  contract.check_choice(direction, name="direction", allowed=DIRECTIONS, op=op)
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op=op)
  return grid_init(batch, heads, max_length, head_dim, value_dim, dtype, row_length=row_length,
                    families=(direction,), op=op)


def axial_step(cache, q, k, v, position, *, row_length: int, direction: str, pooling: str = "max",
               pool_q=None, pool_k=None, span_key_fn=None):
  op = "combiner.axial"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  if span_key_fn is not None and direction != "rowmajor":
    raise ValueError(f"{op}: argument 'span_key_fn' is only supported for direction='rowmajor', "
                     f"got {direction!r}")
  g = grid_write(cache, token(q, k, v, position, pool_q, pool_k, op=op), m)
  if direction == "rowmajor":
    spans, cache = _rowmajor_spans(g, pooling, span_key_fn)
    pieces = [row_piece(g), spans]
  else:
    spans, cache = (vertical_spans if direction == "vertical" else horizontal_spans)(g, pooling)
    pieces = [row_piece(g), column_piece(g), spans]
  return finish(joint_softmax(pieces), g.x), cache


def sparse_axial_init(batch, heads, max_length, head_dim, value_dim, dtype, *, row_length: int):
  return grid_init(batch, heads, max_length, head_dim, value_dim, dtype, row_length=row_length, families=(),
                    op="sparse.axial")


def sparse_axial_step(cache, q, k, v, position, *, row_length: int, pool_q=None, pool_k=None):
  del pool_q, pool_k
  op = "sparse.axial"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  g = grid_write(cache, token(q, k, v, position, None, None, op=op), m)
  return finish(joint_softmax([row_piece(g), column_piece(g)]), g.x), g.cache


AXIAL = make_decoder(axial_init, axial_step)
SPARSE_AXIAL = make_decoder(sparse_axial_init, sparse_axial_step)
