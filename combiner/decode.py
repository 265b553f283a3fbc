"""Cached autoregressive decoding for the causal Combiner plans and their sparse counterparts.

Each plan gets a `Decoder`: `init_cache(...)` allocates the per-layer cache, `step(cache, q_t, k_t, v_t,
position)` attends the query at `position` to everything before it and returns `(out_t, cache)`, and
`prefill(cache, q, k, v)` fills the cache from a prompt. One step equals row `position` of the plan's causal
forward pass on the same tokens: the pieces are the same (the joint softmax, the same pooling), only laid
out for one query. Every span summary a query can read is complete when it is read, and each step writes
the summaries its token completes, so the per-token cost stays bounded without branching on the position:

- fixed: the current block's keys/values plus one (pooled key, in-span value) per block; the current block's
  summary is rewritten at every step (its span query q̄ is known only when the block completes, and the
  block is read only by later blocks): O(block + L/block) per token and O(block + L/block) cache.
- axial: the whole grid (the column piece reads a column). rowmajor/horizontal summaries of row r - 1 are
  computed one column per step during row r, exactly when the query of that column first needs them; vertical
  summaries of column c over rows <= r are written at (r, c) for the next row: O(rows + cols) per token.
- logsparse: one slot per dyadic level holding the last completed even-indexed block (the only one a query can
  read at that level); a level's summary is computed when its block completes (`lax.cond`), so the amortised
  cost is O(log L) per token.
- mixture: the vertical and horizontal caches together.

Layouts (head-major, one token): q_t, k_t, pool_q, pool_k: [batch, heads, head_dim]; v_t: [batch, heads,
value_dim]; `position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from combiner import pooling as pool_ops
from combiner.logsparse import num_levels
from core import blocks, contract
from core.combine import Piece, attend, joint_softmax, merge, partial_softmax
from core.combine import normalize as normalize_partial
from core.decode import Cache, Token, finish, keys_piece, make_decoder, read, token, write, zeros

Array = Any


def summary(pk: Array, pq: Array, k: Array, v: Array, valid: Array, scale: float, pooling: str
            ) -> tuple[Array, Array, Array]:
  """One span's abstraction: pooled key, in-span value and whether it is nonempty.

  pk, pq, k: [batch, heads, n, head_dim]; v: [batch, heads, n, value_dim]; valid: [n] members of the span.
  Returns k̄ [batch, heads, head_dim], ṽ = softmax_j(s(q̄, k_j)) v_j [batch, heads, value_dim], nonempty [1, 1].
  """
  member = valid[None, None, :]  # [1, 1, n]
  k_bar, nonempty = pool_ops.pool(pk, member, axis=2, kind=pooling)
  q_bar, _ = pool_ops.pool(pq, member, axis=2, kind=pooling)
  logits = jnp.einsum("bhd,bhnd->bhn", q_bar, k) * scale  # [batch, heads, n]
  return k_bar, attend(logits, member, v, "bhn,bhnd->bhd"), nonempty




# ----------------------------------------------------------------------------------------------------------
# fixed (Combiner) and sparse fixed


def _fixed_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
                block_size: int, sparse: bool, op: str) -> Cache:
  s = contract.check_positive_int(block_size, name="block_size", op=op)
  n = blocks.num_blocks(max_length, s)
  cache = {"k": zeros(batch, heads, s, head_dim, dtype), "v": zeros(batch, heads, s, value_dim, dtype),
           "span_k": zeros(batch, heads, n, head_dim, dtype),
           "span_v": zeros(batch, heads, n, value_dim, dtype)}
  if not sparse:
    cache.update(pool_q=zeros(batch, heads, s, head_dim, dtype),
                 pool_k=zeros(batch, heads, s, head_dim, dtype))
  return cache


def _fixed_step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, block_size: int,
                pool_q: Array | None, pool_k: Array | None, pooling: str | None,
                op: str) -> tuple[Array, Cache]:
  """pooling=None: the sparse counterpart (the span of a block is its last position)."""
  x = token(q, k, v, position, pool_q, pool_k, op=op)
  s = contract.check_positive_int(block_size, name="block_size", op=op)
  n, j = x.position // s, x.position % s
  cache = dict(cache)
  cache["k"], cache["v"] = write(cache["k"], x.k, j), write(cache["v"], x.v, j)
  valid = jnp.arange(s) <= j  # [size]: the own block up to and including the token
  if pooling is None:
    k_bar, v_tilde = x.k, x.v  # the block's last position, final once the block is complete
  else:
    cache["pool_q"] = write(cache["pool_q"], x.pool_q, j)
    cache["pool_k"] = write(cache["pool_k"], x.pool_k, j)
    k_bar, v_tilde, _ = summary(cache["pool_k"], cache["pool_q"], cache["k"], cache["v"], valid, x.scale,
                                pooling)
  cache["span_k"], cache["span_v"] = write(cache["span_k"], k_bar, n), write(cache["span_v"], v_tilde, n)
  blocks = cache["span_k"].shape[2]
  direct = keys_piece(x, cache["k"], cache["v"], valid)
  spans = keys_piece(x, cache["span_k"], cache["span_v"], jnp.arange(blocks) < n)  # completed blocks only
  return finish(joint_softmax([direct, spans]), x), cache


def fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, *, block_size: int,
               pooling: str = "max"):
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op="combiner.fixed")
  return _fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, block_size=block_size,
                     sparse=False, op="combiner.fixed")


def fixed_step(cache, q, k, v, position, *, block_size: int, pooling: str = "max", pool_q=None, pool_k=None):
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op="combiner.fixed")
  return _fixed_step(cache, q, k, v, position, block_size=block_size, pool_q=pool_q, pool_k=pool_k,
                     pooling=pooling, op="combiner.fixed")


def sparse_fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, *, block_size: int):
  return _fixed_init(batch, heads, max_length, head_dim, value_dim, dtype, block_size=block_size, sparse=True,
                     op="sparse.fixed")


def sparse_fixed_step(cache, q, k, v, position, *, block_size: int, pool_q=None, pool_k=None):
  del pool_q, pool_k
  return _fixed_step(cache, q, k, v, position, block_size=block_size, pool_q=None, pool_k=None, pooling=None,
                     op="sparse.fixed")


# ----------------------------------------------------------------------------------------------------------
# axial (rowmajor, vertical, horizontal), mixture and sparse axial on a grid of rows of length m


def _grid_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
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


class _GridStep(NamedTuple):
  x: Token
  cache: Cache
  r: Array
  c: Array
  rows: int
  cols: int


def _grid_write(cache: Cache, x: Token, row_length: int) -> _GridStep:
  m = row_length
  r, c = x.position // m, x.position % m
  cache = dict(cache)
  for name, val in (("k", x.k), ("v", x.v), ("pool_q", x.pool_q), ("pool_k", x.pool_k), ("q", x.q)):
    if name in cache:
      cache[name] = write(cache[name], val, r, c)
  return _GridStep(x, cache, r, c, cache["k"].shape[2], m)


def _row(g: _GridStep, name: str, r: Array) -> Array:
  return read(g.cache[name], r, 1, 2)[:, :, 0]  # [batch, heads, cols, dim]


def _column(g: _GridStep, name: str, c: Array) -> Array:
  return read(g.cache[name], c, 1, 3)[:, :, :, 0]  # [batch, heads, rows, dim]


def _row_piece(g: _GridStep) -> Piece:
  """Own row ∩ Ω_i."""
  return keys_piece(g.x, _row(g, "k", g.r), _row(g, "v", g.r), jnp.arange(g.cols) <= g.c)


def _column_piece(g: _GridStep) -> Piece:
  """Own column ∩ Ω_i without the token itself (it is in the row piece)."""
  return keys_piece(g.x, _column(g, "k", g.c), _column(g, "v", g.c), jnp.arange(g.rows) < g.r)


def _rowmajor_spans(g: _GridStep, pooling: str, span_key_fn: Callable | None) -> tuple[Piece, Cache]:
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


def _vertical_spans(g: _GridStep, pooling: str) -> tuple[Piece, Cache]:
  """Spans = column e ∩ rows < r for every other column e; column c over rows <= r is summarised now, for row
  r + 1 (index r + 1)."""
  cache = dict(g.cache)
  upto = jnp.arange(g.rows) <= g.r
  k_bar, v_tilde, _ = summary(_column(g, "pool_k", g.c), _column(g, "pool_q", g.c), _column(g, "k", g.c),
                              _column(g, "v", g.c), upto, g.x.scale, pooling)
  cache["col_k"] = write(cache["col_k"], k_bar, g.r + 1, g.c)
  cache["col_v"] = write(cache["col_v"], v_tilde, g.r + 1, g.c)
  valid = (jnp.arange(g.cols) != g.c) & (g.r > 0)
  col_k, col_v = (read(cache[n], g.r, 1, 2)[:, :, 0] for n in ("col_k", "col_v"))  # [batch, heads, cols, dim]
  piece = keys_piece(g.x, col_k, col_v, valid)
  return piece, cache


def _horizontal_spans(g: _GridStep, pooling: str) -> tuple[Piece, Cache]:
  """Spans = row s minus column c for every earlier row s; row r - 1's summary for column c is made now."""
  cache, prev = dict(g.cache), jnp.maximum(g.r - 1, 0)
  others = jnp.arange(g.cols) != g.c
  k_bar, v_tilde, nonempty = summary(_row(g, "pool_k", prev), _row(g, "pool_q", prev), _row(g, "k", prev),
                                     _row(g, "v", prev), others, g.x.scale, pooling)
  cache["hrow_k"] = write(cache["hrow_k"], k_bar, prev, g.c)
  cache["hrow_v"] = write(cache["hrow_v"], v_tilde, prev, g.c)
  valid = (jnp.arange(g.rows) < g.r) & nonempty[0]  # a row of one column has no span once c is removed
  row_k, row_v = (read(cache[n], g.c, 1, 3)[:, :, :, 0] for n in ("hrow_k", "hrow_v"))  # [b, h, rows, d]
  piece = keys_piece(g.x, row_k, row_v, valid)
  return piece, cache


def axial_init(batch, heads, max_length, head_dim, value_dim, dtype, *, row_length: int, direction: str,
               pooling: str = "max"):
  from combiner.axial import DIRECTIONS

  op = "combiner.axial"
  contract.check_choice(direction, name="direction", allowed=DIRECTIONS, op=op)
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op=op)
  return _grid_init(batch, heads, max_length, head_dim, value_dim, dtype, row_length=row_length,
                    families=(direction,), op=op)


def axial_step(cache, q, k, v, position, *, row_length: int, direction: str, pooling: str = "max",
               pool_q=None, pool_k=None, span_key_fn=None):
  op = "combiner.axial"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  if span_key_fn is not None and direction != "rowmajor":
    raise ValueError(f"{op}: argument 'span_key_fn' is only supported for direction='rowmajor', "
                     f"got {direction!r}")
  g = _grid_write(cache, token(q, k, v, position, pool_q, pool_k, op=op), m)
  if direction == "rowmajor":
    spans, cache = _rowmajor_spans(g, pooling, span_key_fn)
    pieces = [_row_piece(g), spans]
  else:
    spans, cache = (_vertical_spans if direction == "vertical" else _horizontal_spans)(g, pooling)
    pieces = [_row_piece(g), _column_piece(g), spans]
  return finish(joint_softmax(pieces), g.x), cache


def mixture_init(batch, heads, max_length, head_dim, value_dim, dtype, *, row_length: int,
                 pooling: str = "max", normalize: str = "mean"):
  del normalize
  return _grid_init(batch, heads, max_length, head_dim, value_dim, dtype, row_length=row_length,
                    families=("vertical", "horizontal"), op="combiner.mixture")


def mixture_step(cache, q, k, v, position, *, row_length: int, pooling: str = "max", normalize: str = "mean",
                 pool_q=None, pool_k=None):
  from combiner.mixture import NORMALIZE

  op = "combiner.mixture"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  contract.check_choice(normalize, name="normalize", allowed=NORMALIZE, op=op)
  g = _grid_write(cache, token(q, k, v, position, pool_q, pool_k, op=op), m)
  direct = [_row_piece(g), _column_piece(g)]
  vertical, cache = _vertical_spans(g, pooling)
  horizontal, cache = _horizontal_spans(g._replace(cache=cache), pooling)
  if normalize == "mean":
    shared = partial_softmax(direct)
    out = 0.5 * sum(normalize_partial(merge([shared, partial_softmax([s])])) for s in (vertical, horizontal))
  else:
    out = joint_softmax(direct + [vertical, horizontal])
  return finish(out, g.x), cache



def sparse_axial_init(batch, heads, max_length, head_dim, value_dim, dtype, *, row_length: int):
  return _grid_init(batch, heads, max_length, head_dim, value_dim, dtype, row_length=row_length, families=(),
                    op="sparse.axial")


def sparse_axial_step(cache, q, k, v, position, *, row_length: int, pool_q=None, pool_k=None):
  del pool_q, pool_k
  op = "sparse.axial"
  m = contract.check_positive_int(row_length, name="row_length", op=op)
  g = _grid_write(cache, token(q, k, v, position, None, None, op=op), m)
  return finish(joint_softmax([_row_piece(g), _column_piece(g)]), g.x), g.cache


# ----------------------------------------------------------------------------------------------------------
# logsparse (Combiner) and sparse logsparse


def _logsparse_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
                    sparse: bool) -> Cache:
  levels = num_levels(max(max_length, 1))
  cache = {"level_k": zeros(batch, heads, levels, head_dim, dtype),
           "level_v": zeros(batch, heads, levels, value_dim, dtype)}
  if not sparse:  # the keys of a completed block are pooled when it completes
    cache.update({name: zeros(batch, heads, max_length, dim, dtype) for name, dim in
                  (("k", head_dim), ("v", value_dim), ("pool_q", head_dim), ("pool_k", head_dim))})
  return cache


def _logsparse_step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None,
                    pool_k: Array | None, pooling: str | None, op: str) -> tuple[Array, Cache]:
  """Level l keeps the last completed block of size 2^l with an even index: the span a query with bit l set
  reads is exactly that block. pooling=None: the sparse counterpart (a span is its last position)."""
  x = token(q, k, v, position, pool_q, pool_k, op=op)
  t = x.position
  cache = dict(cache)
  levels = cache["level_k"].shape[2]
  done = t + 1
  if pooling is None:
    completes = [(done % (1 << lvl) == 0) & ((done >> lvl) % 2 == 1) for lvl in range(levels)]
    store = jnp.stack(completes)[None, None, :, None]  # [1, 1, levels, 1]
    cache["level_k"] = jnp.where(store, x.k[:, :, None], cache["level_k"])
    cache["level_v"] = jnp.where(store, x.v[:, :, None], cache["level_v"])
  else:
    for name, val in (("k", x.k), ("v", x.v), ("pool_q", x.pool_q), ("pool_k", x.pool_k)):
      cache[name] = write(cache[name], val, t)
    for lvl in range(levels):
      size = 1 << lvl

      def complete(lk_lv, size=size, lvl=lvl):
        start = jnp.maximum(done - size, 0)
        block = [read(cache[name], start, size, 2) for name in ("pool_k", "pool_q", "k", "v")]
        k_bar, v_tilde, _ = summary(*block, jnp.ones((size,), bool), x.scale, pooling)
        return write(lk_lv[0], k_bar, lvl), write(lk_lv[1], v_tilde, lvl)

      completes = (done % size == 0) & ((done >> lvl) % 2 == 1)
      cache["level_k"], cache["level_v"] = jax.lax.cond(completes, complete, lambda lk_lv: lk_lv,
                                                        (cache["level_k"], cache["level_v"]))
  self_piece = Piece(jnp.einsum("bhd,bhd->bh", x.q, x.k)[..., None] * x.scale, jnp.ones((1,), bool),
                     lambda w: w * x.v)
  bits = ((t >> jnp.arange(levels)) & 1) == 1  # [levels]: the spans of query t
  out = joint_softmax([self_piece, keys_piece(x, cache["level_k"], cache["level_v"], bits)])
  return finish(out, x), cache


def logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype, *, pooling: str = "max"):
  contract.check_choice(pooling, name="pooling", allowed=pool_ops.POOLINGS, op="combiner.logsparse")
  return _logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype, sparse=False)


def logsparse_step(cache, q, k, v, position, *, pooling: str = "max", pool_q=None, pool_k=None):
  return _logsparse_step(cache, q, k, v, position, pool_q=pool_q, pool_k=pool_k, pooling=pooling,
                         op="combiner.logsparse")


def sparse_logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype):
  return _logsparse_init(batch, heads, max_length, head_dim, value_dim, dtype, sparse=True)


def sparse_logsparse_step(cache, q, k, v, position, *, pool_q=None, pool_k=None):
  del pool_q, pool_k
  return _logsparse_step(cache, q, k, v, position, pool_q=None, pool_k=None, pooling=None,
                         op="sparse.logsparse")


FIXED = make_decoder(fixed_init, fixed_step)
AXIAL = make_decoder(axial_init, axial_step)
MIXTURE = make_decoder(mixture_init, mixture_step)
LOGSPARSE = make_decoder(logsparse_init, logsparse_step)
SPARSE_FIXED = make_decoder(sparse_fixed_init, sparse_fixed_step)
SPARSE_AXIAL = make_decoder(sparse_axial_init, sparse_axial_step)
SPARSE_LOGSPARSE = make_decoder(sparse_logsparse_init, sparse_logsparse_step)
