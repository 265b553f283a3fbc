"""The dyadic spans of Combiner-Logsparse and LogSparse as the kernels of `combiner.dyadic_kernels` hold
them: a direction's static description and the pieces a tile computes.

Query i reads, for each bit l set in i, the span [p, p + 2^l) with p = (i >> (l+1)) << (l+1). With the
sequence in tiles of T = 2^t positions, a span of level l < t ("low") lies in the query's own tile and is
built there: every aligned span of 2^l rows pooled at once, its in-span expected value one online softmax of
the pooled queries over the tile. A span of level l >= t ("high") is 2^(l-t) whole tiles: tile g reads, for
each bit j set in g, the span of level t + j starting at tile [(g >> j) - 1] * 2^j, one bank row per span
(`Dyadic.offsets`). The visibility rules here are exact integer tests on positions; sums of one-hot
selections run at full precision, so a routed value is the value itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from combiner import tiles
from combiner.frames import Frame
from combiner.tiles import F32, NEG, Online

Array = Any
STATS = 8  # lanes of a span's statistics row: 0 = real members, 1 = in-span log-sum-exp, 2 = delta


@dataclasses.dataclass(frozen=True)
class Dyadic:
  """The static description of one direction of a logsparse plan."""

  frame: Frame  # rows = tiles, cols = span = T
  levels: int  # (length - 1).bit_length()
  pooling: str | None  # None: the sparse counterpart
  pools: bool  # DeepSets pools given
  with_self: bool  # D_i = {i} (the reversed half of a bidirectional plan leaves it to the forward half)
  ext: bool  # merge the other half's partial softmax

  @property
  def t(self) -> int:
    return self.frame.cols.bit_length() - 1

  @property
  def low(self) -> int:
    return min(self.levels, self.t)

  @property
  def high(self) -> int:
    return max(self.levels - self.t, 0)

  @property
  def high_rows(self) -> int:
    """Rows of a tile's high bank rows as the kernels hold them (at least a matmul's smallest tile)."""
    return max(self.high, tiles.min_rows(self.frame.platform))

  def span_counts(self) -> list[int]:
    """Spans of each high level j that some tile reads (u even; the odd sibling reads them)."""
    g = self.frame.rows
    return [_ceil(_ceil(g, 1 << j), 2) for j in range(self.high)]

  def offsets(self) -> list[int]:
    out, o = [], 0
    for n in self.span_counts():
      out.append(o)
      o += n
    return out

  @property
  def num_spans(self) -> int:
    return sum(self.span_counts())


def _ceil(a: int, b: int) -> int:
  return -(-a // b)


# -------------------------------------------------------------------------------------------- in a tile


def shr(x: Array, n: Any) -> Array:
  return lax.shift_right_logical(x, jnp.asarray(n, x.dtype) if isinstance(n, int) else n)


def tile_valid(f: Frame, R: dict, g: Any, shape: tuple[int, int]) -> Array:
  """Validity of the tile's positions as a row [1, T] or a column [T, 1]."""
  axis = 1 if shape[0] == 1 else 0
  local = lax.broadcasted_iota(jnp.int32, shape, axis)
  ok = f.valid(g, local)
  if f.masked:
    m = R["mask"][...] > 0  # [1, T]
    ok = ok & (m if axis == 1 else tiles.column(m.astype(F32)) > 0)
  return ok


def low_pools(x: Array, valid_col: Array, kind: str, level: int) -> tuple[Array, Array]:
  """Pools of every aligned span of 2^level rows of a tile: ([T >> level, d], counts [T >> level, 1])."""
  n, d = x.shape[0] >> level, x.shape[1]
  cnt = jnp.sum(valid_col.astype(F32).reshape(n, 1 << level, 1), axis=1)
  if kind == "max":
    top = jnp.max(jnp.where(valid_col, x, NEG).reshape(n, 1 << level, d), axis=1)
    return jnp.where(cnt > 0, top, 0.0), cnt
  return jnp.sum(jnp.where(valid_col, x, 0.0).reshape(n, 1 << level, d), axis=1) / jnp.maximum(cnt, 1.0), cnt


def members(T: int, n: int, level: int) -> Array:
  """[T, n] float32 one-hot: position i belongs to span i >> level (n >= T >> level rows of spans)."""
  pos = lax.broadcasted_iota(jnp.int32, (T, n), 0)
  span = lax.broadcasted_iota(jnp.int32, (T, n), 1)
  return (shr(pos, level) == span).astype(F32)


def exact(a: Array, b: Array, ta: bool = False) -> Array:
  """a @ b (a^T @ b) in float32 at full precision: sums of one-hot selections stay exact."""
  dims = (((0,), (0,)), ((), ())) if ta else (((1,), (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=F32, precision=lax.Precision.HIGHEST)


def expand(x: Array, level: int, T: int) -> Array:
  """[n, w] -> [T, w]: each span's row over its 2^level positions."""
  return tiles.select_rows(members(T, x.shape[0], level), x)


def low_level(f: Frame, dy: Dyadic, R: dict, level: int, valid_row: Array, valid_col: Array):
  """A low level's summaries in the tile: (k_bar [n, d] f32, v_tilde [n, dv] f32, lse [n, 1], q_bar
  [n, d] f32, counts [n, 1], membership [n, T]), n = T >> level (padded to a matmul's smallest tile), every
  span, even or odd."""
  pq = (R["pool_q"] if dy.pools else R["q"])[...].astype(F32)
  pk = (R["pool_k"] if dy.pools else R["k"])[...].astype(F32)
  qbar, cnt = low_pools(pq, valid_col, dy.pooling, level)
  kbar, _ = low_pools(pk, valid_col, dy.pooling, level)
  rows = tiles.min_rows(f.platform)
  qbar8, kbar8, cnt8 = tiles.pad_rows(qbar, rows), tiles.pad_rows(kbar, rows), tiles.pad_rows(cnt, rows)
  n = qbar8.shape[0]
  span = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
  kid = lax.broadcasted_iota(jnp.int32, (1, f.cols), 1)
  member = (shr(kid, level) == span) & valid_row  # [n, T]
  st = tiles.online_step(Online.empty(n, f.dv), qbar8.astype(R["k"].dtype), R["k"][...], R["v"][...], member,
                         f.scale)
  vt, lse = tiles.finish(st)
  return kbar8, vt, lse, qbar8, cnt8, member


def low_visible(level: int, n: int, cnt: Array, T: int) -> Array:
  """[T, n]: query i reads span s of the level iff bit `level` of i is set and s = (i >> level) - 1."""
  qid = lax.broadcasted_iota(jnp.int32, (T, 1), 0)
  s = lax.broadcasted_iota(jnp.int32, (1, n), 1)
  up = shr(qid, level)
  return ((up & 1) == 1) & (s == up - 1) & (cnt.astype(F32).T > 0)


def sparse_visible(T: int) -> Array:
  """[T, T]: key j is the last position of a span of query i inside the tile: j + 1 = i with its bits below
  the lowest set bit of j + 1 cleared."""
  qid = lax.broadcasted_iota(jnp.int32, (T, 1), 0)
  x = lax.broadcasted_iota(jnp.int32, (1, T), 1) + 1
  low = x & (-x)
  return (qid & ~(low - 1)) == x


def level0_visible(T: int) -> Array:
  qid = lax.broadcasted_iota(jnp.int32, (T, 1), 0)
  kid = lax.broadcasted_iota(jnp.int32, (1, T), 1)
  return (kid == qid - 1) & ((qid & 1) == 1)


def high_rows(dy: Dyadic, R: dict, g: Array) -> tuple[Array, Array, Array]:
  """The bank rows tile g reads, one per high level, in `high_rows` rows: (k [n, d] f32, v [n, dv] f32,
  visible [1, n]). Assembled by selects (Triton concatenates two arrays at a time)."""
  n = dy.high_rows
  f = dy.frame
  rows = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
  lanes = lax.broadcasted_iota(jnp.int32, (1, n), 1)
  k, v, ok = jnp.zeros((n, f.d), F32), jnp.zeros((n, f.dv), F32), jnp.zeros((1, n), F32)
  for j, off in enumerate(dy.offsets()):
    idx = off + shr(g, j + 1)
    k = jnp.where(rows == j, R["bk"][pl.ds(idx, 1), 0, :], k)
    v = jnp.where(rows == j, R["bv"][pl.ds(idx, 1), 0, :], v)
    read = ((shr(g, j) & 1) == 1) & (R["bstats"][pl.ds(idx, 1), 0, 0:1] > 0)  # [1, 1]
    ok = jnp.where((lanes == j) & read, 1.0, ok)
  return k, v, ok > 0



def main_sources(f: Frame, dy: Dyadic, R: dict, g: Array):
  """Every (keys, values, visible [T, n]) a tile's queries read, the low levels' construction included."""
  T = f.cols
  valid_row = tile_valid(f, R, g, (1, T))
  valid_col = tile_valid(f, R, g, (T, 1))
  qid = lax.broadcasted_iota(jnp.int32, (T, 1), 0)
  kid = lax.broadcasted_iota(jnp.int32, (1, T), 1)
  out = []
  if dy.pooling is None:  # D_i and the last positions of the in-tile spans
    vis = sparse_visible(T) & (kid < qid)
    if dy.with_self:
      vis = vis | (kid == qid)
    out.append(("own", R["k"][...], R["v"][...], vis & valid_row, None))
  else:
    if dy.with_self:
      out.append(("own", R["k"][...], R["v"][...], (kid == qid) & valid_row, None))
    pk = R["pool_k"][...] if dy.pools else R["k"][...]
    out.append(("level0", pk, R["v"][...], level0_visible(T) & valid_row, None))
    for level in range(1, dy.low):
      kbar, vt, lse, qbar, cnt, member = low_level(f, dy, R, level, valid_row, valid_col)
      out.append((("low", level), kbar, vt, low_visible(level, kbar.shape[0], cnt, T),
                  (lse, qbar, cnt, member)))
  if dy.high:
    k, v, ok = high_rows(dy, R, g)
    out.append(("high", k, v, jnp.broadcast_to(ok, (T, ok.shape[1])), None))
  return out


# ------------------------------------------------------------------------------------------- high spans

def span_of(dy: Dyadic, s: Array) -> tuple[Array, Array, Array]:
  """(level j, first tile, tiles) of high span s."""
  j = jnp.int32(0)
  base = jnp.int32(0)
  for jj, off in enumerate(dy.offsets()):
    later = s >= off
    j = jnp.where(later, jj, j)
    base = jnp.where(later, off, base)
  start = lax.shift_left(s - base, j + 1)
  n = jnp.minimum(lax.shift_left(jnp.int32(1), j), dy.frame.rows - start)
  return j, start, n
