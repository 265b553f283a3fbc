"""Combiner-Axial (paper §4.3, Appendix C) on an n x m grid of rows of length m = row_length.

Positions are laid out as (row, col) = (i // m, i % m); the sequence is padded to whole rows with masked keys.
Each direction is built as a list of `Piece`s for the shared joint softmax so that
`mixture(normalize="joint")` can put several span families under one softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from combiner import common, fused
from combiner import pooling as pool_ops
from combiner.fixed import block_direct_piece, block_logits, other_block_valid
from core import contract
from core.blocks import from_grid, head_major, num_blocks, to_grid
from core.combine import Piece, attend, joint_softmax, weighted_sum

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

  def column_mask(self) -> Array:
    """[batch, 1, 1, cols, rows]: mask[s, c] indexed as [..., c, s]."""
    return jnp.swapaxes(self.mask, 2, 3)[:, :, None]


def row_piece(g: Grid, causal: bool, logits: Array | None = None) -> Piece:
  """Own row ∩ Ω_i (the own row is a 'block' of the grid)."""
  return block_direct_piece(g.q, g.k, g.v, g.mask, g.scale, causal, logits)


def column_piece(g: Grid, causal: bool) -> Piece:
  """Own column ∩ Ω_i without i itself (i is already in the row piece)."""
  logits = jnp.einsum("bhrcd,bhscd->bhrcs", g.q, g.k) * g.scale  # [batch, heads, rows, cols, rows_s]
  valid = other_block_valid(g.rows, causal)[:, None, :] & g.column_mask()
  return Piece(logits, valid, lambda w: weighted_sum("bhrcs,bhscd->bhrcd", w, g.v))


def rowmajor_spans(g: Grid, causal: bool, pooling: str, span_key_fn: Callable | None,
                   row_logits: Array) -> Piece:
  """One span per other row (causal: rows before). Span key: the pooled row; span query: the column-aligned
  token's own query q_(r', col(i)), falling back to the pooled row query where that token is masked or
  padding.

  row_logits: [batch, heads, rows, cols_q, cols_k], the in-row logits the direct piece uses too.
  """
  # k_bar: [b, heads, rows, dim]; nonempty: [b, 1, rows]
  k_bar, nonempty = pool_ops.pool(g.pool_k, g.mask, axis=3, kind=pooling)
  if span_key_fn is not None:
    k_bar = head_major(span_key_fn(head_major(k_bar)))  # the hook sees [batch, rows, heads, dim]
  q_bar, _ = pool_ops.pool(g.pool_q, g.mask, axis=3, kind=pooling)
  # v_tilde[s, c]: the whole row s attended by the query aligned with column c: the direct piece's row logits,
  # except where that token is masked or padding and the pooled row query stands in.
  pooled_logits = jnp.einsum("bhsd,bhsed->bhse", q_bar, g.k) * g.scale  # [batch, heads, rows, cols_e]
  # [b, heads, rows, cols, cols_e]
  in_row = jnp.where(g.mask[..., None], row_logits, pooled_logits[:, :, :, None])
  v_tilde = attend(in_row, g.mask[:, :, :, None, :], g.v, "bhsce,bhsed->bhscd")  # [b, heads, rows, cols, dv]
  logits = jnp.einsum("bhrcd,bhsd->bhrcs", g.q, k_bar) * g.scale  # [batch, heads, rows, cols, rows_s]
  valid = other_block_valid(g.rows, causal)[:, None, :] & nonempty[:, :, None, None, :]
  return Piece(logits, valid, lambda w: weighted_sum("bhrcs,bhscd->bhrcd", w, v_tilde))


def _all_but_one(x: Array, valid: Array, axis: int, causal: bool, pooling: str) -> tuple[Array, Array]:
  """Pools, for every position t along `axis`, the members before t (causal) or all members except t."""
  if causal:
    stats = pool_ops.exclusive_scan_stats(x, valid, axis, pooling)
  else:
    stats = pool_ops.all_but_one_stats(x, valid, axis, pooling)
  return pool_ops.finalize(stats, pooling)


def vertical_spans(g: Grid, causal: bool, pooling: str) -> Piece:
  """For query (r, c) and every other column e: column e ∩ Ω_i minus D_i, i.e. rows s < r (causal)
  or s != r."""
  k_bar, nonempty = _all_but_one(g.pool_k, g.mask, 2, causal, pooling)  # [b, heads, rows_r, cols_e, dim]
  q_bar, _ = _all_but_one(g.pool_q, g.mask, 2, causal, pooling)
  # v_tilde[r, e] = softmax over rows s of column e (s < r or s != r) of s(q_bar[r, e], k[s, e]).
  in_col = jnp.einsum("bhred,bhsed->bhres", q_bar, g.k) * g.scale  # [batch, heads, rows_r, cols_e, rows_s]
  col_valid = other_block_valid(g.rows, causal)[:, None, :] & g.column_mask()
  v_tilde = attend(in_col, col_valid, g.v, "bhres,bhsed->bhred")  # [batch, heads, rows, cols, value_dim]
  logits = jnp.einsum("bhrcd,bhred->bhrce", g.q, k_bar) * g.scale  # [batch, heads, rows, cols_c, cols_e]
  valid = ~jnp.eye(g.cols, dtype=bool) & nonempty[:, :, :, None, :]
  return Piece(logits, valid, lambda w: weighted_sum("bhrce,bhred->bhrcd", w, v_tilde))


def horizontal_spans(g: Grid, causal: bool, pooling: str) -> Piece:
  """For query (r, c) and every other row s (causal: s < r): row s ∩ Ω_i minus column c."""
  k_bar, nonempty = _all_but_one(g.pool_k, g.mask, 3, False, pooling)  # [b, heads, rows_s, cols_c, dim]
  q_bar, _ = _all_but_one(g.pool_q, g.mask, 3, False, pooling)
  # v_tilde[s, c] = softmax over columns e != c of row s of s(q_bar[s, c], k[s, e]).
  in_row = jnp.einsum("bhscd,bhsed->bhsce", q_bar, g.k) * g.scale  # [batch, heads, rows_s, cols_c, cols_e]
  row_valid = ~jnp.eye(g.cols, dtype=bool) & g.mask[:, :, :, None, :]
  v_tilde = attend(in_row, row_valid, g.v, "bhsce,bhsed->bhscd")  # [batch, heads, rows, cols, value_dim]
  logits = jnp.einsum("bhrcd,bhscd->bhrcs", g.q, k_bar) * g.scale  # [batch, heads, rows_r, cols, rows_s]
  valid = other_block_valid(g.rows, causal)[:, None, :] & jnp.swapaxes(nonempty, 2, 3)[:, :, None]
  return Piece(logits, valid, lambda w: weighted_sum("bhrcs,bhscd->bhrcd", w, v_tilde))


def axial_pieces(g: Grid, direction: str, causal: bool, pooling: str,
                 span_key_fn: Callable | None = None) -> list[Piece]:
  if direction == "rowmajor":
    logits = block_logits(g.q, g.k, g.scale)
    return [row_piece(g, causal, logits), rowmajor_spans(g, causal, pooling, span_key_fn, logits)]
  spans = vertical_spans if direction == "vertical" else horizontal_spans
  return [row_piece(g, causal), column_piece(g, causal), spans(g, causal, pooling)]


def axial(q: Array, k: Array, v: Array, *, row_length: int, direction: str, causal: bool,
          mask: Array | None = None, pooling: str = "max", pool_q: Array | None = None,
          pool_k: Array | None = None, span_key_fn: Callable[[Array], Array] | None = None,
          implementation: str = "auto") -> Array:
  """Combiner-Axial. q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim].

  direction: "rowmajor" (D_i = own row; one span per other row), "vertical" (D_i = own row ∪ own column; one
  span per other column), "horizontal" (D_i = own row ∪ own column; one span per other row).
  Cost O(L·(n + m)·d).
  span_key_fn (rowmajor only): maps the pooled span keys [batch, rows, heads, head_dim] to the keys used.
  implementation: "xla" (einsums), "pallas" (the fused kernel of `combiner.flash`),
  "auto" (pallas on GPU/TPU).
  """
  op = "combiner.axial"
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k,
                     implementation=implementation)
  contract.check_choice(direction, name="direction", allowed=DIRECTIONS, op=op)
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  if span_key_fn is not None and direction != "rowmajor":
    raise ValueError(f"{op}: argument 'span_key_fn' is only supported for direction='rowmajor', "
                     f"got {direction!r}")
  if x.kernel_dtype is not None:
    return fused.axial(x, m, direction, causal, pooling, span_key_fn)
  g = Grid(x, m)
  out = joint_softmax(axial_pieces(g, direction, causal, pooling, span_key_fn))  # [b, heads, rows, cols, dv]
  return common.finish(from_grid(out, g.length, 2), x)
