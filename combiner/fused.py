"""The Combiner plans and their sparse counterparts on the Pallas kernel of `combiner.flash`.

Each plan is a few `flash.attend` calls on two layouts of the same tensors, merged by log-sum-exp:

  fixed:     groups = blocks; sources = own block ("le") + the span summaries (shared, "lt"/"ne" by block).
  axial:     row-major layout (groups = rows) and column-major layout (groups = columns, q transposed): own
             row ("le"), own column without the query ("lt"/"ne" by row), and the span family: rowmajor
             summaries are read column-major (their in-span value depends on the query's column), vertical
             ones row-major, horizontal ones column-major.
  mixture:   the axial pieces, merged per plan ("mean") or all at once ("joint").
  logsparse: groups of up to 128 queries; one "range" source: the group's own positions (D_i = {i}) and each
             level's span keys, key u of level l seen by the rows [u·2^l, (u+1)·2^l) of the group. The
             bidirectional plan adds the same call on the reversed sequence.

In-span expectations of the axial summaries are flash calls too (a pooled query against its span's keys), so
no [L, sqrt(L)] logits exist; pooling (max/mean, prefix scans) and the O(L)-sized summaries of fixed and
logsparse stay in XLA. Semantics are the XLA plans': the same pooling, masks, padding and empty-span rules;
matmul inputs keep the caller's 16-bit float dtype (float32 otherwise), softmax statistics are float32.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from attention_core.blocks import from_grid, head_major, num_blocks, to_grid
from combiner import common, flash
from combiner import pooling as pool_ops
from combiner.dyadic import flipped, level_summaries

Array = Any
SPAN_CHUNK = 256  # keys per partial reduction of a long span's in-span expectation


def _bh(x: Array) -> Array:
  """[batch, heads, groups, n, dim] -> [batch * heads, groups, n, dim]."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _unbh(x: Array, batch: int) -> Array:
  return x.reshape(batch, x.shape[0] // batch, *x.shape[1:])


def _direct_rule(causal: bool) -> str:
  return "le" if causal else "all"


def _other_rule(causal: bool) -> str:
  return "lt" if causal else "ne"


def span_expectation(q_bar: Array, kb: Array, vb: Array, valid: Array, scale: float, axis: int = 3) -> Array:
  """In-span expected values: softmax(q_bar . k / sqrt(d)) over each span's real keys, times their values.

  kb: a span's keys on `axis`, [..., s, ..., head_dim] (head-major [batch, heads, n, s, d]: axis 3; heads-last
  [batch, n, s, heads, d]: axis 2); vb: the same with value_dim; q_bar: kb's shape without `axis`; valid:
  [batch, ...] like kb.shape[:-1] (heads may be 1). Returns q_bar's shape with value_dim, float32 (0 for an
  empty span, dropped by the caller). Both products are matmuls in kb's and vb's dtype (the kernel dtype:
  q_bar and the weights are cast to it) with float32 accumulation, like the kernel's, so no float32 copy
  of the keys or values and no broadcast query is written. Spans longer than SPAN_CHUNK are reduced in
  chunks of it, which keeps many reductions in flight when a few spans hold thousands of keys (logsparse's
  top levels). Masked keys and values are zeros (`common.prepare` selects
  them), so no product needs a select.
  """
  s = kb.shape[axis]
  c = SPAN_CHUNK if s > SPAN_CHUNK and s % SPAN_CHUNK == 0 else s

  def split(t):  # the span axis -> the last two before the features: [..., s // c, c, dim]
    t = jnp.moveaxis(t, axis, -2)
    return t.reshape(t.shape[:-2] + (s // c, c, t.shape[-1]))

  f32 = jnp.promote_types(jnp.float32, kb.dtype)
  logits = jnp.einsum("...d,...jcd->...jc", q_bar.astype(kb.dtype), split(kb),
                      preferred_element_type=f32) * scale  # [..., s // c, c]
  ok = split(valid[..., None])[..., 0]
  logits = jnp.where(ok, logits, -jnp.inf)
  top = lax.stop_gradient(jnp.max(logits, axis=(-2, -1), keepdims=True))
  p = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))  # exactly 0 where masked
  den = jnp.sum(p, axis=(-2, -1))
  num = jnp.einsum("...jc,...jcd->...d", p.astype(vb.dtype), split(vb), preferred_element_type=f32)
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def fixed(x: common.Inputs, size: int, causal: bool, pooling: str | None) -> Array:
  """Combiner-Fixed (pooling = "max"/"mean") or Sparse-Fixed (pooling None: each block's last position).

  Head-major inputs ([batch, heads, L, d]) or, with x.heads_last, the contract's [batch, L, heads, d], which
  the kernel reads heads-packed; either way only the O(L/size)-sized summaries are rearranged.
  """
  axis = 1 if x.heads_last else 2  # the position axis
  batch, heads = (x.q.shape[0], x.q.shape[2]) if x.heads_last else x.q.shape[:2]
  length = x.q.shape[axis]
  blocks = num_blocks(length, size)
  # [batch, blocks, size, heads, d] (heads-last) or [batch, heads, blocks, size, d]
  qb, kb, vb = (to_grid(t, blocks, size, axis) for t in (x.q, x.k, x.v))
  mb = to_grid(x.mask, blocks, size, 1)  # [batch, blocks, size]
  pool_valid = mb[..., None] if x.heads_last else mb[:, None]  # broadcasts against qb.shape[:-1]

  def summaries(t):  # [batch, blocks, heads, dim] or [batch, heads, blocks, dim] -> [bh, 1, blocks, dim]
    return _bh((jnp.swapaxes(t, 1, 2) if x.heads_last else t)[:, :, None]).astype(x.kernel_dtype)

  def keys(t):  # the kernel's layout: [batch, blocks, size, heads * dim] or [bh, blocks, size, dim]
    return (t.reshape(*t.shape[:3], -1) if x.heads_last else _bh(t)).astype(x.kernel_dtype)

  block_keys = flash.Source(keys(kb), keys(vb), mb, _direct_rule(causal), "row", packed=x.heads_last)
  if pooling is None:
    k_sum, v_sum = (lax.index_in_dim(t, -1, axis + 1, keepdims=False) for t in (kb, vb))
    ok_sum = mb[:, :, -1]  # [batch, blocks]
  else:
    pqb, pkb = (to_grid(t, blocks, size, axis) for t in (x.pool_q, x.pool_k))
    k_sum, ok_sum = pool_ops.pool(pkb, pool_valid, axis=axis + 1, kind=pooling)
    q_bar, _ = pool_ops.pool(pqb, pool_valid, axis=axis + 1, kind=pooling)  # qb.shape without the size axis
    # In-block expected values: the pooled query of each block against the block's real keys, one flash call
    # over groups = blocks of one query each (no [blocks, size] logits, no float32 copy of keys or values).
    qg = (q_bar.reshape(batch, blocks, 1, -1) if x.heads_last else _bh(q_bar[:, :, :, None]))
    v_sum, _ = flash.attend(qg.astype(x.kernel_dtype), [block_keys._replace(rule="all")], heads=heads,
                            scale=x.scale, packed=x.heads_last, out_dtype=x.kernel_dtype)
    # [batch, blocks, heads, dv] (heads-last) or [batch, heads, blocks, dv]
    v_sum = (v_sum.reshape(batch, blocks, heads, -1) if x.heads_last else _unbh(v_sum[:, :, 0], batch))
    ok_sum = ok_sum[..., 0] if x.heads_last else ok_sum[:, 0]  # [batch, blocks]

  sources = [block_keys,
             flash.Source(summaries(k_sum), summaries(v_sum), ok_sum[:, None], _other_rule(causal), "group")]
  out, _ = flash.attend(keys(qb), sources, heads=heads, scale=x.scale, packed=x.heads_last,
                        out_dtype=x.out_dtype)  # one call: its output is final
  if x.heads_last:  # [batch, blocks, size, heads * dv]
    return out.reshape(batch, blocks * size, heads, -1)[:, :length].astype(x.out_dtype)
  return common.finish(from_grid(_unbh(out, batch), length, 2), x)  # out: [bh, blocks, size, dv]


class _Layout:
  """One sequence on an n x m grid in the kernel's two layouts: row-major [bh, rows, cols, dim] (groups =
  rows) and column-major [bh, cols, rows, dim] (groups = columns)."""

  def __init__(self, x: common.Inputs, cols: int):
    self.batch, self.heads, self.length, _ = x.q.shape
    self.rows, self.cols = num_blocks(self.length, cols), cols
    self.dtype, self.scale = x.kernel_dtype, x.scale
    # [batch, heads, rows, cols, dim]: q, k, v in the kernel dtype, the pools in the softmax dtype (pooling
    # and summaries run there).
    self.q, self.k, self.v, self.pool_q, self.pool_k = (
        to_grid(t, self.rows, self.cols, 2) for t in (x.q, x.k, x.v, x.pool_q, x.pool_k))
    self.mask = to_grid(x.mask, self.rows, self.cols, 1)  # [batch, rows, cols]

  def row(self, t: Array) -> Array:  # [batch, heads, rows, cols, d] -> [bh, rows, cols, d] (kernel dtype)
    return _bh(t).astype(self.dtype)

  def col(self, t: Array) -> Array:  # [batch, heads, rows, cols, d] -> [bh, cols, rows, d]
    return jnp.swapaxes(_bh(t), 1, 2).astype(self.dtype)

  def row_keys(self, rule: str) -> flash.Source:
    return flash.Source(self.row(self.k), self.row(self.v), self.mask, rule)

  def col_keys(self, rule: str) -> flash.Source:
    return flash.Source(self.col(self.k), self.col(self.v), jnp.swapaxes(self.mask, 1, 2), rule)

  def attend_rows(self, q: Array, sources: list) -> tuple[Array, Array]:
    """Row-major flash call; q [batch, heads, rows, cols, d] -> ([bh, rows, cols, dv], [bh, rows, cols])."""
    return flash.attend(self.row(q), sources, heads=self.heads, scale=self.scale)

  def attend_cols(self, q: Array, sources: list) -> tuple[Array, Array]:
    """Column-major flash call, returned in the row-major layout."""
    o, lse = flash.attend(self.col(q), sources, heads=self.heads, scale=self.scale)
    return jnp.swapaxes(o, 1, 2), jnp.swapaxes(lse, 1, 2)

  def unbh(self, t: Array) -> Array:  # [bh, rows, cols, d] -> [batch, heads, rows, cols, d]
    return _unbh(t, self.batch)

  def finish(self, out: Array, x: common.Inputs) -> Array:
    return common.finish(from_grid(self.unbh(out), self.length, 2), x)


def _all_but_one(x: Array, valid: Array, axis: int, causal: bool, pooling: str) -> tuple[Array, Array]:
  """Pools, for every position t along `axis`, the members before t (causal) or all members except t."""
  if causal:
    stats = pool_ops.exclusive_scan_stats(x, valid, axis, pooling)
  else:
    stats = pool_ops.all_but_one_stats(x, valid, axis, pooling)
  return pool_ops.finalize(stats, pooling)


def _rowmajor_spans(g: _Layout, causal: bool, pooling: str, span_key_fn: Any) -> flash.Source:
  """Column-major: for query (r, c) the pooled key of row s and the in-row expectation v_tilde[s, c]."""
  mask = g.mask[:, None]  # [batch, 1, rows, cols]
  k_bar, nonempty = pool_ops.pool(g.pool_k, mask, axis=3, kind=pooling)  # [b, heads, rows, d], [b, 1, rows]
  if span_key_fn is not None:
    k_bar = head_major(span_key_fn(head_major(k_bar)))  # hook sees [batch, rows, heads, dim]
  q_bar, _ = pool_ops.pool(g.pool_q, mask, axis=3, kind=pooling)
  # v_tilde[s, c]: row s attended by the column-c token's query, or by the pooled row query where that token
  # is masked or padding: one row-major flash call.
  q_sub = jnp.where(mask[..., None], g.q, q_bar[:, :, :, None])  # [batch, heads, rows, cols, d]
  v_tilde, _ = g.attend_rows(q_sub, [g.row_keys("all")])  # [bh, rows, cols, dv]
  k_bar = jnp.broadcast_to(k_bar[:, :, :, None], g.q.shape[:4] + k_bar.shape[-1:])  # [b, h, rows, cols, d]
  valid = jnp.broadcast_to(nonempty[:, 0, None, :], (g.batch, g.cols, g.rows))
  return flash.Source(g.col(k_bar), jnp.swapaxes(v_tilde, 1, 2).astype(g.dtype), valid, _other_rule(causal))


def _vertical_spans(g: _Layout, causal: bool, pooling: str) -> flash.Source:
  """Row-major source: for query (r, c) and column e != c, the pooled rows of column e before r (or != r)."""
  mask = g.mask[:, None]
  k_bar, nonempty = _all_but_one(g.pool_k, mask, 2, causal, pooling)  # [b, h, rows, cols, d], [b, 1, r, c]
  q_bar, _ = _all_but_one(g.pool_q, mask, 2, causal, pooling)
  v_tilde, _ = g.attend_cols(q_bar, [g.col_keys(_other_rule(causal))])  # [bh, rows, cols, dv]
  return flash.Source(g.row(k_bar), v_tilde.astype(g.dtype), nonempty[:, 0], "ne")


def _horizontal_spans(g: _Layout, causal: bool, pooling: str) -> flash.Source:
  """Column-major source: for query (r, c) and row s before r (or != r), row s without column c."""
  mask = g.mask[:, None]
  k_bar, nonempty = _all_but_one(g.pool_k, mask, 3, False, pooling)  # [b, h, rows, cols, d], [b, 1, r, c]
  q_bar, _ = _all_but_one(g.pool_q, mask, 3, False, pooling)
  v_tilde, _ = g.attend_rows(q_bar, [g.row_keys("ne")])  # [bh, rows, cols, dv]
  return flash.Source(g.col(k_bar), jnp.swapaxes(v_tilde, 1, 2).astype(g.dtype),
                      jnp.swapaxes(nonempty[:, 0], 1, 2), _other_rule(causal))


def axial(x: common.Inputs, row_length: int, direction: str | None, causal: bool, pooling: str,
          span_key_fn: Any = None) -> Array:
  """Combiner-Axial in `direction`, or Sparse-Axial (direction None: own row and column only)."""
  g = _Layout(x, row_length)
  rows = [g.row_keys(_direct_rule(causal))]
  cols = [g.col_keys(_other_rule(causal))] if direction != "rowmajor" else []
  if direction == "rowmajor":
    cols.append(_rowmajor_spans(g, causal, pooling, span_key_fn))
  elif direction == "vertical":
    rows.append(_vertical_spans(g, causal, pooling))
  elif direction == "horizontal":
    cols.append(_horizontal_spans(g, causal, pooling))
  out, _ = flash.merge([g.attend_rows(g.q, rows), g.attend_cols(g.q, cols)])
  return g.finish(out, x)


def mixture(x: common.Inputs, row_length: int, causal: bool, pooling: str, normalize: str) -> Array:
  """Combiner-Mixture: the vertical and horizontal plans averaged ("mean") or under one softmax ("joint")."""
  g = _Layout(x, row_length)
  row_d, col_d = g.row_keys(_direct_rule(causal)), g.col_keys(_other_rule(causal))
  vertical, horizontal = _vertical_spans(g, causal, pooling), _horizontal_spans(g, causal, pooling)
  if normalize == "joint":
    out, _ = flash.merge([g.attend_rows(g.q, [row_d, vertical]), g.attend_cols(g.q, [col_d, horizontal])])
  else:
    direct = [g.attend_rows(g.q, [row_d]), g.attend_cols(g.q, [col_d])]
    out_v, _ = flash.merge(direct + [g.attend_rows(g.q, [vertical])])
    out_h, _ = flash.merge(direct + [g.attend_cols(g.q, [horizontal])])
    out = 0.5 * (out_v + out_h)
  return g.finish(out, x)


def _logsparse_call(x: common.Inputs, pooling: str | None, with_self: bool) -> tuple[Array, Array]:
  """Prefix spans of every query (and D_i = {i} when `with_self`) as one flash call over groups of G queries.

  The keys of a group: its own G positions ("range" [j, j+1): the query itself), then per level l the span
  keys of the level's blocks inside the group (G / 2^l of them, key u seen by rows [u·2^l, (u+1)·2^l)) or,
  once a block holds the whole group, its one key (seen by all rows). Returns (out [batch, heads, L, dv],
  lse [batch, heads, L]) in the frame of `x`.
  """
  batch, heads, length, _ = x.q.shape
  dtype = x.kernel_dtype
  glen = flash.group_length(length)
  groups = num_blocks(length, glen)
  keys, values, valid, first, end = [], [], [], [], []
  if with_self:
    keys.append(to_grid(x.k, groups, glen, 2))  # [batch, heads, groups, glen, d]
    values.append(to_grid(x.v, groups, glen, 2))
    valid.append(to_grid(x.mask, groups, glen, 1))  # [batch, groups, glen]
    first.append(np.arange(glen))
    end.append(np.arange(glen) + 1)
  for level, (k_prev, v_prev, ok_prev) in enumerate(level_summaries(x, pooling, span_expectation)):
    size = 1 << level
    if size <= glen:
      per = glen // size
      keys.append(to_grid(k_prev, groups, per, 2))  # [batch, heads, groups, per, d]
      values.append(to_grid(v_prev, groups, per, 2))
      valid.append(to_grid(ok_prev[:, 0], groups, per, 1))  # [batch, groups, per]
      first.append(np.arange(per) * size)
      end.append(np.arange(per) * size + size)
    else:
      block = (np.arange(groups) * glen) >> level  # the level block holding each group
      keys.append(k_prev[:, :, block, None])  # [batch, heads, groups, 1, d]
      values.append(v_prev[:, :, block, None])
      valid.append(ok_prev[:, 0, block, None])  # [batch, groups, 1]
      first.append(np.zeros(1, np.int64))
      end.append(np.full(1, glen))
  cat = lambda ts: jnp.concatenate(ts, axis=-2)  # noqa: E731
  source = flash.Source(_bh(cat(keys)).astype(dtype), _bh(cat(values)).astype(dtype),
                        jnp.concatenate(valid, axis=-1), "range", "row",
                        (np.concatenate(first), np.concatenate(end)))
  out, lse = flash.attend(_bh(to_grid(x.q, groups, glen, 2)).astype(dtype), [source], heads=heads,
                          scale=x.scale)  # [bh, groups, glen, dv], [bh, groups, glen]
  out = from_grid(_unbh(out, batch), length, 2)  # [batch, heads, L, dv]
  return out, from_grid(_unbh(lse, batch), length, 2)


def logsparse_plan(x: common.Inputs, causal: bool, pooling: str | None) -> Array:
  """Combiner-Logsparse (pooling "max"/"mean") or LogSparse (pooling None: each span's last position)."""
  parts = [_logsparse_call(x, pooling, True)]
  if not causal and x.q.shape[2] > 1:  # suffix spans = prefix spans of the reversed sequence (none at L = 1)
    out, lse = _logsparse_call(flipped(x), pooling, False)
    parts.append((jnp.flip(out, axis=2), jnp.flip(lse, axis=2)))
  out, _ = flash.merge(parts)
  return common.finish(out, x)
