"""Sequence parallelism for the grid plans: Combiner-Axial (rowmajor, vertical, horizontal), Combiner-Mixture
and sparse Axial, with the sequence split over a mesh axis ("seq") under `shard_map`.

Each device holds a contiguous run of whole grid rows (the row layout). What a query reads from its own row,
and every per-row summary, is local there. Its own column, though, runs through every device: the column
direct keys of a device's queries are all of K and V. Rather than gather those, the plans move to a column
layout for what is per column: one all-to-all gives each device every row of m / P columns (each device
sends (P - 1) / P of its own run, where an all-gather of K and V would bring it P - 1 other runs). There the
own-column piece and the per-column span pieces are computed as unnormalised partial softmaxes (numerator,
denominator, max: `attention_core.combine.Partial`), which a second all-to-all brings back to the queries'
devices, where they are merged with the row-layout pieces into the one softmax of the plan:

  rowmajor    row piece local; per-row summaries local (k̄_s all-gathered: rows x head_dim, ṽ[s, c] moved to
              the column layout), span pieces in the column layout
  vertical    row piece and span logits local; own column and the per-column summaries (prefix pools of
              every column, ṽ[r, e]) in the column layout, the summaries moved back
  horizontal  row piece and per-row summaries local, moved to the column layout for the span pieces and the
              own column
  mixture     vertical and horizontal together, "mean" or "joint"
  sparse      row piece local, own column in the column layout

Every piece is the single-device op's own (combiner/axial.py) on the local grid; only the split into two
layouts is new. Each device must hold whole rows (length a multiple of devices x row_length) and the
columns must split evenly (row_length a multiple of the devices). Plain autodiff through `shard_map` gives
the backward pass (the all-to-alls transpose to all-to-alls, the all-gather to a reduce-scatter).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attention_core import contract, sharding
from attention_core.blocks import from_grid
from attention_core.combine import Partial, Piece, attend, merge, normalize, partial_softmax, weighted_sum
from combiner import common
from combiner.axial import (
  DIRECTIONS,
  Grid,
  HorizontalSummaries,
  RowSummaries,
  column_piece,
  horizontal_spans,
  horizontal_summaries,
  row_piece,
  rowmajor_spans,
  rowmajor_summaries,
  rows_valid,
  vertical_summaries,
)
from combiner.mixture import NORMALIZE
from combiner.pooling import POOLINGS

Array = Any


class _Layouts:
  """The local row grid and, built on demand, the column grid of one device; the all-to-alls between them."""

  def __init__(self, x: common.Inputs, row_length: int, axis: str, pools: tuple[str, ...],
               query_chunks: int | None, op: str):
    self.x, self.axis, self.pools = x, axis, pools
    self.rows = Grid(x, row_length)  # [batch, heads, local rows, row_length, dim]
    self.chunks = self.rows.chunks(query_chunks, op)  # chunks of local rows for the per-row summaries

  def to_cols(self, t: Array) -> Array:
    """[batch, heads, local rows, cols, ...] -> [batch, heads, rows, local cols, ...] (one all-to-all)."""
    return jax.lax.all_to_all(t, self.axis, 3, 2, tiled=True)

  def to_rows(self, t: Array) -> Array:
    """[batch, heads, rows, local cols, ...] -> [batch, heads, local rows, cols, ...] (one all-to-all)."""
    return jax.lax.all_to_all(t, self.axis, 2, 3, tiled=True)

  def partial_to_rows(self, p: Partial) -> Partial:
    """A partial softmax of the column layout's queries, brought to the queries' own devices."""
    return Partial(*(self.to_rows(t) for t in p))

  def cols(self, *, keys: bool = True, pooled: bool = False) -> Grid:
    """The column grid [batch, heads, rows, local cols, dim]: the queries always, keys, values and mask if
    `keys`, the pooled inputs if `pooled` (only those given apart from q and k travel). Fields not moved
    hold the queries and must not be read."""
    g = self.rows
    q = self.to_cols(g.q)
    k, v, mask = (self.to_cols(t) for t in (g.k, g.v, g.mask)) if keys else (q, q, None)
    pool_q = self.to_cols(g.pool_q) if pooled and "pool_q" in self.pools else q
    pool_k = self.to_cols(g.pool_k) if pooled and "pool_k" in self.pools else k

    def flat(t: Array) -> Array:  # [batch, heads, rows, cols, d] -> [batch, heads, rows * cols, d]
      return t.reshape(*t.shape[:2], -1, *t.shape[4:])

    cols = q.shape[3]
    mask = jnp.ones(q.shape[:1] + (q.shape[2] * cols,), bool) if mask is None else flat(mask)[:, 0]
    xc = self.x._replace(q=flat(q), k=flat(k), v=flat(v), mask=mask, pool_q=flat(pool_q),
                         pool_k=flat(pool_k))
    return Grid(xc, cols)


def _rowmajor(lay: _Layouts, causal: bool, pooling: str, span_key_fn: Callable | None) -> Array:
  """Axial rowmajor: output [batch, heads, local rows, m, value_dim]; the own row here, the spans (one per
  other row, valued per column) in the column layout."""
  g = lay.rows
  sums = rowmajor_summaries(g, pooling, span_key_fn, lay.chunks)
  # The spans' keys are one row per grid row (all-gathered); their values are per column (all-to-all).
  k_all, ne_all = (jax.lax.all_gather(t, lay.axis, axis=2, tiled=True) for t in (sums.k_bar, sums.nonempty))
  gc = lay.cols(keys=False)
  spans = rowmajor_spans(gc, gc.query_rows(), causal, RowSummaries(k_all, ne_all, lay.to_cols(sums.v_tilde)))
  own = partial_softmax([row_piece(g, g.query_rows(), causal)])
  return normalize(merge([own, lay.partial_to_rows(partial_softmax([spans]))]))


def _vertical_piece(lay: _Layouts, gc: Grid, causal: bool, pooling: str) -> Piece:
  """The vertical span piece of the local queries (row layout); its summaries come from the column layout.

  Split of `combiner.axial.vertical_spans`: k̄[r, e], q̄[r, e] pool column e's rows s < r (causal) or s != r,
  ṽ[r, e] attends over them (all per column), and query (r, c) scores k̄[r, e] for every column e != c.
  """
  g, rc = lay.rows, gc.query_rows()
  k_bar, nonempty, q_bar = vertical_summaries(gc, causal, pooling)  # [b, h, rows, local cols, d], [b, 1, ...]
  in_col = jnp.einsum("bhred,bhsed->bhres", q_bar, gc.k) * gc.scale  # [batch, heads, rows, cols_e, rows_s]
  col_valid = rows_valid(rc, gc.rows, causal)[:, None, :] & gc.column_mask()
  v_tilde = attend(in_col, col_valid, gc.v, "bhres,bhsed->bhred")  # [batch, heads, rows, cols_e, value_dim]
  k_bar, v_tilde, nonempty = (lay.to_rows(t) for t in (k_bar, v_tilde, nonempty))  # [b, h, local rows, m, .]
  logits = jnp.einsum("bhrcd,bhred->bhrce", g.q, k_bar) * g.scale  # [batch, heads, local rows, m_c, m_e]
  valid = ~jnp.eye(g.cols, dtype=bool) & nonempty[:, :, :, None, :]
  return Piece(logits, valid, lambda w: weighted_sum("bhrce,bhred->bhrcd", w, v_tilde))


def _horizontal_piece(lay: _Layouts, gc: Grid, causal: bool, pooling: str) -> Piece:
  """The horizontal span piece in the column layout: per-row summaries made locally, moved per column."""
  g = lay.rows
  sums = horizontal_summaries(g, pooling, lay.chunks)  # [b, h, local rows, m, .]
  return horizontal_spans(gc, gc.query_rows(), causal, HorizontalSummaries(*(lay.to_cols(t) for t in sums)))


def _grid_plan(lay: _Layouts, plan: str, causal: bool, pooling: str, normalize_kind: str) -> Array:
  """vertical, horizontal, mixture or sparse: output [batch, heads, local rows, m, value_dim]."""
  g = lay.rows
  gc = lay.cols(pooled=plan in ("vertical", "mixture"))
  rc = gc.query_rows()
  row = row_piece(g, g.query_rows(), causal)
  column = column_piece(gc, rc, causal)
  if plan == "sparse":
    return normalize(merge([partial_softmax([row]), lay.partial_to_rows(partial_softmax([column]))]))
  if plan == "vertical":
    local = partial_softmax([row, _vertical_piece(lay, gc, causal, pooling)])
    return normalize(merge([local, lay.partial_to_rows(partial_softmax([column]))]))
  if plan == "horizontal":
    far = partial_softmax([column, _horizontal_piece(lay, gc, causal, pooling)])
    return normalize(merge([partial_softmax([row]), lay.partial_to_rows(far)]))
  vertical = partial_softmax([_vertical_piece(lay, gc, causal, pooling)])
  horizontal = _horizontal_piece(lay, gc, causal, pooling)
  if normalize_kind == "joint":
    far = lay.partial_to_rows(partial_softmax([column, horizontal]))
    return normalize(merge([partial_softmax([row]), far, vertical]))
  # Both plans share D_i (row and column), merged once into each plan's softmax (as `combiner.mixture`).
  shared = merge([partial_softmax([row]), lay.partial_to_rows(partial_softmax([column]))])
  horizontal = lay.partial_to_rows(partial_softmax([horizontal]))
  return 0.5 * (normalize(merge([shared, vertical])) + normalize(merge([shared, horizontal])))


def _local(plan: str, op: str, row_length: int, causal: bool, pooling: str, normalize_kind: str, axis: str,
           pools: tuple[str, ...], span_key_fn: Callable | None, query_chunks: int | None, q: Array, k: Array,
           v: Array, mask: Array, *pooled: Array) -> Array:
  """One device's run [batch, local_length, heads, dim] -> its output, same layout."""
  given = dict(zip(pools, pooled, strict=True))
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, **given)
  lay = _Layouts(x, row_length, axis, pools, query_chunks, op)
  if plan == "rowmajor":
    out = _rowmajor(lay, causal, pooling, span_key_fn)
  else:
    out = _grid_plan(lay, plan, causal, pooling, normalize_kind)
  return common.finish(from_grid(out, q.shape[1], 2), x)  # [batch, local_length, heads, value_dim]


def _run(plan: str, op: str, q: Array, k: Array, v: Array, *, row_length: int, causal: bool,
         mask: Array | None, pooling: str, pool_q: Array | None, pool_k: Array | None,
         span_key_fn: Callable | None, normalize_kind: str, mesh: Any, axis: str,
         query_chunks: int | None) -> Array:
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  contract.check_choice(pooling, name="pooling", allowed=POOLINGS, op=op)
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  mesh = sharding.resolve_mesh(mesh, axis, op)
  parts = int(mesh.shape[axis])
  batch, length, heads, _ = q.shape
  sharding.check_seq_length(length, parts, m, op, f"row_length {m}")
  if m % parts:
    raise ValueError(f"{op}: argument 'row_length' ({m}) must be a multiple of the {parts} devices along the "
                     "sequence axis (each device takes an equal share of every row's columns)")
  pools = {name: x for name, x in (("pool_q", pool_q), ("pool_k", pool_k)) if x is not None}
  for name, x in pools.items():
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
  spec, mspec = sharding.seq_specs(mesh, axis, batch, heads)
  local = functools.partial(_local, plan, op, m, bool(causal), pooling, normalize_kind, axis, tuple(pools),
                            span_key_fn, common.check_query_chunks(query_chunks, op=op))
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (mspec,) + (spec,) * len(pools),
                       out_specs=spec)(q, k, v, mask, *pools.values())


def axial(q: Array, k: Array, v: Array, *, row_length: int, direction: str, causal: bool,
          mask: Array | None = None, pooling: str = "max", pool_q: Array | None = None,
          pool_k: Array | None = None, span_key_fn: Callable[[Array], Array] | None = None,
          query_chunks: int | None = None, mesh: Any = None, axis: str = sharding.SEQ_AXIS) -> Array:
  """Combiner-Axial with the sequence split over mesh axis `axis`; equals `combiner.axial` (same arguments).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; length must be a multiple of
  (devices along `axis`) x row_length, and row_length a multiple of the devices. query_chunks: chunks of each
  device's rows for the per-row span summaries (None: as the op chooses for the local grid).
  """
  op = "combiner.seq_parallel_axial.axial"
  contract.check_choice(direction, name="direction", allowed=DIRECTIONS, op=op)
  if span_key_fn is not None and direction != "rowmajor":
    raise ValueError(f"{op}: argument 'span_key_fn' is only supported for direction='rowmajor', "
                     f"got {direction!r}")
  return _run(direction, op, q, k, v, row_length=row_length, causal=causal, mask=mask, pooling=pooling,
              pool_q=pool_q, pool_k=pool_k, span_key_fn=span_key_fn, normalize_kind="mean", mesh=mesh,
              axis=axis, query_chunks=query_chunks)


def mixture(q: Array, k: Array, v: Array, *, row_length: int, causal: bool, mask: Array | None = None,
            pooling: str = "max", normalize: str = "mean", pool_q: Array | None = None,
            pool_k: Array | None = None, query_chunks: int | None = None, mesh: Any = None,
            axis: str = sharding.SEQ_AXIS) -> Array:
  """Combiner-Mixture with the sequence split over mesh axis `axis`; equals `combiner.mixture` (same
  arguments; lengths as for `axial`)."""
  op = "combiner.seq_parallel_axial.mixture"
  contract.check_choice(normalize, name="normalize", allowed=NORMALIZE, op=op)
  return _run("mixture", op, q, k, v, row_length=row_length, causal=causal, mask=mask, pooling=pooling,
              pool_q=pool_q, pool_k=pool_k, span_key_fn=None, normalize_kind=normalize, mesh=mesh, axis=axis,
              query_chunks=query_chunks)


def sparse_axial(q: Array, k: Array, v: Array, *, row_length: int, causal: bool, mask: Array | None = None,
                 query_chunks: int | None = None, mesh: Any = None, axis: str = sharding.SEQ_AXIS) -> Array:
  """Sparse axial attention with the sequence split over mesh axis `axis`; equals `combiner.sparse.axial`
  (same arguments; lengths as for `axial`)."""
  return _run("sparse", "combiner.seq_parallel_axial.sparse_axial", q, k, v, row_length=row_length,
              causal=causal, mask=mask, pooling="max", pool_q=None, pool_k=None, span_key_fn=None,
              normalize_kind="mean", mesh=mesh, axis=axis, query_chunks=query_chunks)
