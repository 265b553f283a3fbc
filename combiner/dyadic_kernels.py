"""Combiner-Logsparse and LogSparse on Pallas kernels: the dyadic spans, low levels in a tile, high levels
as one summary row per span.

Query i reads, for each bit l set in i, the span [p, p + 2^l) with p = (i >> (l+1)) << (l+1), and D_i =
{i}. With the sequence in tiles of T = 2^t positions (a frame of `rows` tiles), a span of level l < t lies in
the query's own tile, and a span of level l >= t is 2^(l-t) whole tiles: tile g reads, for each bit j set in
g, the span of level t + j made of the tiles [(g >> j) - 1] * 2^j onwards. So:

  spans  one program per high span (levels >= t, the spans some tile reads): its pooled key and query and its
         in-span expected value, looping over its tiles (copied in from HBM on TPU) -> one bank row each;
  main   one program per tile: D_i, level 0 (the previous position's pooled key and value), the low levels'
         summaries built in the tile (pool, then the pooled queries' attention over the tile's keys), and
         the tile's few bank rows, under one online softmax;

backward: the main program's gradients (the low levels' construction included: it is tile-local) and of the
bank rows it read, per reading tile; one program per span sums them and computes the pooled query's gradient
over its tiles; one program per tile adds the high spans' in-span gradients and routes the pooled gradients
to its rows. The sparse counterpart (pooling None) takes each span's last position as its summary: in a tile
that is the rule "j + 1 = i with its low bits cleared at a set bit", for a high span a copied row.
The bidirectional plan runs the same kernels, without D_i, on the reversed sequence and merges the two: the
reversed direction's kernels read and write the arrays themselves, tiles in reverse order and rows flipped in
VMEM (`Frame.reverse`), and add their gradients to the forward direction's in place.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from combiner import dyadic_levels as levels
from combiner import frames, tiles
from combiner.dyadic_levels import Dyadic
from combiner.frames import Frame
from combiner.tiles import F32, NEG, Online

Array = Any


# ------------------------------------------------------------------------------------------------ specs
# Frame arrays are read a tile (and a block of heads) at a time by the per-tile kernels, tile by tile from
# HBM by the per-span ones; per-head arrays ([batch * heads, ...]) at the program's heads
# (`frames.head_spec`).

GRADS = ("dq", "dk", "dv", "dpq", "dpk")
TOK = ("q", "k", "v", "pool_q", "pool_k", "o_ext", "do", "o_fin", *(n + "_in" for n in GRADS),
       *(n + "_acc" for n in GRADS), "o", *GRADS)
HEADS = ("lse", "lse_ext", "lse_fin", "bk", "bv", "bstats", "dhk", "dhv", "kbar", "vt", "qbar", "stats",
         "dkbar", "dvt", "dqbar", "ties_q", "ties_k", "stats2")


def _tile_spec(f: Frame, dim: int) -> pl.BlockSpec:
  if f.packed:
    return pl.BlockSpec((None, f.cols, dim), lambda b, h, g: (b, g, h))
  if f.reverse:  # the reversed sequence's tile g is the array's tile rows-1-g (rows flipped in VMEM)
    return frames.head_block_spec(f, (None, f.cols), dim, lambda b, h, g: (b, f.rows - 1 - g, h))
  return frames.head_block_spec(f, (None, f.cols), dim, lambda b, h, g: (b, g, h))


def _full(f: Frame, shape: tuple[int, ...]) -> pl.BlockSpec:
  """A per-head array [BH, *shape], whole for each of the program's heads."""
  return frames.head_spec(f, shape, lambda g: (0,) * len(shape))


def _row(f: Frame, dim: int) -> pl.BlockSpec:
  """The program's own row (tile or span) of a per-head [BH, n, 1, dim]."""
  return frames.row_spec(f, dim)


def _lse(f: Frame) -> pl.BlockSpec:
  return frames.head_spec(f, (None, 1, f.cols), lambda g: (g, 0, 0))


def _mask(f: Frame) -> pl.BlockSpec:
  return pl.BlockSpec((None, None, 1, f.cols), lambda b, h, g: (b, g, 0, 0))


def _main_kernel_body(b: Array, R: dict, g: Array, head: Array, *, f: Frame, dy: Dyadic) -> None:
  q = R["q"][...]
  st = Online.empty(f.cols, f.dv)
  for _, k, v, vis, _ in levels.main_sources(f, dy, R, g):
    st = tiles.online_step(st, q, k, v, vis, f.scale)
  if dy.ext:
    st = tiles.merge_partial(st, R["o_ext"][...], tiles.column(R["lse_ext"][...]))
  o, lse = tiles.finish(st)
  R["o"][...] = o.astype(R["o"].dtype)
  R["lse"][...] = lse.T


def _route_low(x: Array, valid_col: Array, kind: str, level: int, pooled: Array, cnt: Array,
               g: Array) -> Array:
  """Gradient [T, d] of `levels.low_pools` for the pooled gradients g [n, d] (n >= T >> level rows of
  spans)."""
  T = x.shape[0]
  if kind == "mean":
    return jnp.where(valid_col, levels.expand(g / jnp.maximum(cnt, 1.0), level, T), 0.0)
  hit = (x == levels.expand(pooled, level, T)) & valid_col
  ties = levels.exact(levels.members(T, pooled.shape[0], level), hit.astype(F32), ta=True)  # [n, d]
  return jnp.where(hit, levels.expand(g / jnp.maximum(ties, 1.0), level, T), 0.0)


def _main_backward_kernel_body(b: Array, R: dict, g: Array, head: Array, *, f: Frame, dy: Dyadic) -> None:
  T = f.cols
  q, do = R["q"][...], R["do"][...]
  kdt = q.dtype
  delta = jnp.sum(do.astype(F32) * R["o_fin"][...].astype(F32), axis=1, keepdims=True)
  lse = tiles.column(R["lse_fin"][...])
  valid_col = levels.tile_valid(f, R, g, (T, 1))
  dq = jnp.zeros((T, f.d), F32)
  dk = jnp.zeros((T, f.d), F32)
  dv = jnp.zeros((T, f.dv), F32)
  dpq = dpk = jnp.zeros((T, f.d), F32)
  for name, k, v, vis, low in levels.main_sources(f, dy, R, g):
    pr, ds = tiles.grads(q, do, k, v, vis, lse, delta, f.scale)
    dq = dq + tiles.dot(ds.astype(kdt), tiles.finite(k).astype(kdt)) * f.scale
    dkeys = tiles.dot(ds.astype(kdt), q, ta=True) * f.scale  # [n, d]
    dvals = tiles.dot(pr.astype(kdt), do.astype(kdt), ta=True)  # [n, dv]
    if name in ("own",):
      dk, dv = dk + dkeys, dv + dvals
    elif name == "level0":
      dv = dv + dvals
      if dy.pools:
        dpk = dpk + jnp.where(valid_col, dkeys, 0.0)
      else:
        dk = dk + dkeys
    elif name == "high":
      R["dhk"][...] = dkeys  # [high rows padded, d]
      R["dhv"][...] = dvals
    else:  # a low level: the summaries' gradients through their construction in the tile
      level = name[1]
      slse, qbar, cnt, member = low
      dvt, dkbar = dvals, dkeys
      sdelta = jnp.sum(dvt * v, axis=1, keepdims=True)
      qk = qbar.astype(kdt)
      spr, sds = tiles.grads(qk, dvt, R["k"][...], R["v"][...], member, slse, sdelta, f.scale)
      dqbar = tiles.dot(sds.astype(kdt), tiles.finite(R["k"][...]).astype(kdt)) * f.scale
      dk = dk + tiles.dot(sds.astype(kdt), qk, ta=True) * f.scale
      dv = dv + tiles.dot(spr.astype(kdt), dvt.astype(kdt), ta=True)
      pq = (R["pool_q"] if dy.pools else R["q"])[...].astype(F32)
      pk = (R["pool_k"] if dy.pools else R["k"])[...].astype(F32)
      dpq = dpq + _route_low(pq, valid_col, dy.pooling, level, qbar, cnt, dqbar)
      dpk = dpk + _route_low(pk, valid_col, dy.pooling, level, k, cnt, dkbar)
  if not dy.pools:
    dq, dk = dq + dpq, dk + dpk
  out = {"dq": dq, "dk": dk, "dv": dv, **({"dpq": dpq, "dpk": dpk} if dy.pools else {})}
  for n, x in out.items():
    if n + "_acc" in R:  # the other direction's gradients, added in place
      x = x + R[n + "_acc"][...].astype(F32)
    R[n][...] = x.astype(R[n].dtype)


# ------------------------------------------------------------------------------------------- high spans

def _spans_kernel_body(b: Array, R: dict, s: Array, head: Array, *, f: Frame, dy: Dyadic) -> None:
  j, start, n = levels.span_of(dy, s)
  load = frames.TileLoader(f, R, b, head)
  if dy.pooling is None:  # the span's last position
    last = start + lax.shift_left(jnp.int32(1), j) - 1
    tile = jnp.minimum(last, f.rows - 1)
    end = f.cols - 1
    ok = (last < f.rows) & (tiles.take_row(load.valid(tile, b, (f.cols, 1)).astype(F32), end) > 0)
    R["kbar"][...] = jnp.where(ok, tiles.take_row(load("k", tile, f.d).astype(F32), end), 0.0)
    R["vt"][...] = jnp.where(ok, tiles.take_row(load("v", tile, f.dv).astype(F32), end), 0.0)
    lane = lax.broadcasted_iota(jnp.int32, (1, levels.STATS), 1)
    R["stats"][...] = jnp.where(lane == 0, ok.astype(F32), 0.0)
    return
  qname, kname = ("pool_q", "pool_k") if dy.pools else ("q", "k")
  mx = dy.pooling == "max"
  init = (jnp.full((1, f.d), NEG if mx else 0.0, F32),) * 2 + (jnp.zeros((1, 1), F32),)

  def pool(i, carry):
    qa, ka, cnt = carry
    tile = start + i
    valid = load.valid(tile, b, (f.cols, 1))
    pq = jnp.where(valid, load(qname, tile, f.d).astype(F32), NEG if mx else 0.0)
    pk = jnp.where(valid, load(kname, tile, f.d).astype(F32), NEG if mx else 0.0)
    red = functools.partial(jnp.max if mx else jnp.sum, axis=0, keepdims=True)
    comb = jnp.maximum if mx else jnp.add
    return comb(qa, red(pq)), comb(ka, red(pk)), cnt + jnp.sum(valid.astype(F32), axis=0, keepdims=True)

  qa, ka, cnt = lax.fori_loop(0, n, pool, init)
  qbar = jnp.where(cnt > 0, qa if mx else qa / jnp.maximum(cnt, 1.0), 0.0)
  kbar = jnp.where(cnt > 0, ka if mx else ka / jnp.maximum(cnt, 1.0), 0.0)
  kdt = R["k"].dtype

  rows = tiles.min_rows(f.platform)

  def attend(i, st):
    tile = start + i
    vis = jnp.broadcast_to(load.valid(tile, b, (1, f.cols)), (rows, f.cols))
    return tiles.online_step(st, tiles.rows_of(qbar, rows).astype(kdt), load("k", tile, f.d),
                             load("v", tile, f.dv), vis, f.scale)

  vt, lse = tiles.finish(lax.fori_loop(0, n, attend, Online.empty(rows, f.dv)))
  R["kbar"][...] = kbar
  R["qbar"][...] = qbar
  R["vt"][...] = tiles.take_row(vt, 0)
  lane = lax.broadcasted_iota(jnp.int32, (1, levels.STATS), 1)
  R["stats"][...] = jnp.where(lane == 0, cnt, jnp.where(lane == 1, tiles.take_row(lse, 0), 0.0))


def _span_backward_kernel_body(b: Array, R: dict, s: Array, head: Array, *, f: Frame, dy: Dyadic) -> None:
  """Per span: the gradients of its summary summed over the tiles that read it; the pooled query's gradient
  over the span's keys, and the counts of tied maxima (the rows its pooled gradients are shared by)."""
  j, start, n = levels.span_of(dy, s)
  size = lax.shift_left(jnp.int32(1), j)
  first = start + size
  readers = jnp.clip(f.rows - first, 0, size)

  def gather(i, acc):
    dk, dv = acc
    g = first + i
    return (dk + R["dhk"][pl.ds(g, 1), pl.ds(j, 1), :].reshape(1, f.d),
            dv + R["dhv"][pl.ds(g, 1), pl.ds(j, 1), :].reshape(1, f.dv))

  dkbar, dvt = lax.fori_loop(0, readers, gather, (jnp.zeros((1, f.d), F32), jnp.zeros((1, f.dv), F32)))
  R["dkbar"][...] = dkbar
  R["dvt"][...] = dvt
  if dy.pooling is None:
    return
  load = frames.TileLoader(f, R, b, head)
  qbar, kbar, vt = R["qbar"][...], R["kbar"][...], R["vt"][...]
  lse = R["stats"][:, 1:2]
  delta = jnp.sum(dvt * vt, axis=1, keepdims=True)
  kdt = R["k"].dtype
  rows = tiles.min_rows(f.platform)
  first_row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) == 0
  dvt8 = jnp.where(first_row, tiles.rows_of(dvt, rows), 0.0)
  qname, kname = ("pool_q", "pool_k") if dy.pools else ("q", "k")

  def body(i, acc):
    dq, tq, tk = acc
    tile = start + i
    vis = jnp.broadcast_to(load.valid(tile, b, (1, f.cols)), (rows, f.cols))
    k = load("k", tile, f.d)
    _, ds = tiles.grads(tiles.rows_of(qbar, rows).astype(kdt), dvt8, k, load("v", tile, f.dv), vis,
                        jnp.broadcast_to(lse, (rows, 1)), jnp.where(first_row, delta, 0.0), f.scale)
    dq = dq + tiles.take_row(tiles.dot(ds.astype(kdt), tiles.finite(k).astype(kdt)), 0) * f.scale
    valid = load.valid(tile, b, (f.cols, 1))
    hit_q = (load(qname, tile, f.d).astype(F32) == qbar) & valid
    hit_k = (load(kname, tile, f.d).astype(F32) == kbar) & valid
    return (dq, tq + jnp.sum(hit_q.astype(F32), axis=0, keepdims=True),
            tk + jnp.sum(hit_k.astype(F32), axis=0, keepdims=True))

  zero = jnp.zeros((1, f.d), F32)
  dqbar, ties_q, ties_k = lax.fori_loop(0, n, body, (zero, zero, zero))
  R["dqbar"][...] = dqbar
  R["ties_q"][...] = ties_q
  R["ties_k"][...] = ties_k
  lane = lax.broadcasted_iota(jnp.int32, (1, levels.STATS), 1)
  R["stats2"][...] = jnp.where(lane == 0, delta, 0.0)


def _tile_backward_kernel_body(b: Array, R: dict, tau: Array, head: Array, *, f: Frame, dy: Dyadic) -> None:
  """Per tile: the in-span gradients of the high spans holding it, and their pooled gradients routed to its
  rows; added to the main backward's dq, dk, dv in place."""
  T = f.cols
  valid_row = levels.tile_valid(f, R, tau, (1, T))
  valid_col = levels.tile_valid(f, R, tau, (T, 1))
  kdt = R["k"].dtype
  k, v = R["k"][...], R["v"][...]
  dk = jnp.zeros((T, f.d), F32)
  dv = jnp.zeros((T, f.dv), F32)
  dpq = dpk = jnp.zeros((T, f.d), F32)
  nrow = tiles.min_rows(f.platform)
  first_row = lax.broadcasted_iota(jnp.int32, (nrow, 1), 0) == 0
  rows = lax.broadcasted_iota(jnp.int32, (T, 1), 0)
  for j, off in enumerate(dy.offsets()):
    reads = (levels.shr(tau, j) & 1) == 0  # the span of level t + j holding this tile is one a tile reads
    idx = off + levels.shr(tau, j + 1)
    row = lambda name, width, idx=idx: R[name][pl.ds(idx, 1), 0, :width]  # noqa: E731
    dvt, dkbar = row("dvt", f.dv), row("dkbar", f.d)
    if dy.pooling is None:  # the span's last position is this tile's last row when the tile ends the span
      ends = reads & ((tau & ((1 << j) - 1)) == (1 << j) - 1)
      at = (rows == T - 1) & valid_col & ends
      dk = dk + jnp.where(at, dkbar, 0.0)
      dv = dv + jnp.where(at, dvt, 0.0)
      continue
    qbar, kbar = row("qbar", f.d), row("kbar", f.d)
    stats = R["stats"][pl.ds(idx, 1), 0, :]
    cnt, lse = tiles.take_lane(stats, 0), tiles.take_lane(stats, 1)
    delta = R["stats2"][pl.ds(idx, 1), 0, 0:1]
    vis = jnp.broadcast_to(valid_row & reads, (nrow, T))
    qk = tiles.rows_of(qbar, nrow).astype(kdt)
    dvt_rows = jnp.where(first_row, tiles.rows_of(dvt, nrow), 0.0)
    pr, ds = tiles.grads(qk, dvt_rows, k, v, vis, jnp.broadcast_to(lse, (nrow, 1)),
                         jnp.where(first_row, delta, 0.0), f.scale)
    dk = dk + tiles.dot(ds.astype(kdt), qk, ta=True) * f.scale
    dv = dv + tiles.dot(pr.astype(kdt), dvt_rows.astype(kdt), ta=True)
    dqbar = row("dqbar", f.d)
    pq = (R["pool_q"] if dy.pools else R["q"])[...].astype(F32)
    pk = (R["pool_k"] if dy.pools else R["k"])[...].astype(F32)
    member = valid_col & reads
    if dy.pooling == "max":
      dpq = dpq + jnp.where((pq == qbar) & member, dqbar / jnp.maximum(row("ties_q", f.d), 1.0), 0.0)
      dpk = dpk + jnp.where((pk == kbar) & member, dkbar / jnp.maximum(row("ties_k", f.d), 1.0), 0.0)
    else:
      dpq = dpq + jnp.where(member, dqbar / jnp.maximum(cnt, 1.0), 0.0)
      dpk = dpk + jnp.where(member, dkbar / jnp.maximum(cnt, 1.0), 0.0)
  dq = R["dq_in"][...].astype(F32)
  if dy.pools:
    R["dpq"][...] = (R["dpq_in"][...].astype(F32) + dpq).astype(R["dpq"].dtype)
    R["dpk"][...] = (R["dpk_in"][...].astype(F32) + dpk).astype(R["dpk"].dtype)
  else:
    dq, dk = dq + dpq, dk + dpk
  R["dq"][...] = dq.astype(R["dq"].dtype)
  R["dk"][...] = (R["dk_in"][...].astype(F32) + dk).astype(R["dk"].dtype)
  R["dv"][...] = (R["dv_in"][...].astype(F32) + dv).astype(R["dv"].dtype)


# ------------------------------------------------------------------------------------------------ calls

def _call(f: Frame, kernel, *args, **kw) -> dict[str, Array]:
  return frames.call_kernel(f, kernel, *args, tok=TOK, heads=HEADS, **kw)


def _tok_shape(f: Frame, dim: int, dtype: Any) -> jax.ShapeDtypeStruct:
  if f.packed:
    return jax.ShapeDtypeStruct((f.batch, f.rows * f.cols, f.heads * dim), dtype)
  return jax.ShapeDtypeStruct((f.batch, f.rows * f.cols, f.heads, dim), dtype)


def _head_shape(f: Frame, *shape: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((f.batch * f.heads, *shape), F32)


def _tile_inputs(f: Frame, dy: Dyadic, a: dict) -> tuple[list[str], list[pl.BlockSpec], list[Array]]:
  names = ["q", "k", "v"] + (["pool_q", "pool_k"] if dy.pools else []) + (["mask"] if f.masked else [])
  dims = {"q": f.d, "k": f.d, "v": f.dv, "pool_q": f.d, "pool_k": f.d}
  return names, [_mask(f) if n == "mask" else _tile_spec(f, dims[n]) for n in names], [a[n] for n in names]


def _spans_inputs(f: Frame, dy: Dyadic, a: dict) -> tuple[list[str], list[pl.BlockSpec], list[Array]]:
  names = ["q", "k", "v"] + (["pool_q", "pool_k"] if dy.pools else []) + (["mask"] if f.masked else [])
  specs = [pl.BlockSpec(a["mask"].shape, lambda b, h, g: (0, 0, 0, 0)) if n == "mask"
           else frames.whole_spec(f, a[n]) for n in names]
  return names, specs, [a[n] for n in names]


_DIMS = {"kbar": "d", "vt": "dv", "stats": levels.STATS, "qbar": "d", "dqbar": "d", "dkbar": "d", "dvt": "dv",
         "ties_q": "d", "ties_k": "d", "stats2": levels.STATS}


def _dim(f: Frame, name: str) -> int:
  d = _DIMS[name]
  return {"d": f.d, "dv": f.dv}.get(d, d) if isinstance(d, str) else d


def spans_forward(f: Frame, dy: Dyadic, a: dict) -> dict[str, Array]:
  """Bank rows of the high spans: kbar, vt, qbar [BH, spans, 1, dim], stats [BH, spans, 1, levels.STATS]."""
  ins, specs, args = _spans_inputs(f, dy, a)
  outs = ["kbar", "vt", "stats"] + ([] if dy.pooling is None else ["qbar"])
  return _call(f, functools.partial(_spans_kernel_body, f=f, dy=dy), "combiner_dyadic_spans_fwd",
               dy.num_spans,
               ins, specs, args, outs, [_row(f, _dim(f, n)) for n in outs],
               [_head_shape(f, dy.num_spans, 1, _dim(f, n)) for n in outs],
               loads=tuple(n for n in ins if n in frames.FRAME_INPUTS))


def main_forward(f: Frame, dy: Dyadic, a: dict, bank: dict, out_dtype: Any, ext: tuple | None) -> tuple:
  ins, specs, args = _tile_inputs(f, dy, a)
  if dy.high:
    ins += ["bk", "bv", "bstats"]
    specs += [_full(f, (dy.num_spans, 1, n)) for n in (f.d, f.dv, levels.STATS)]
    args += [bank["kbar"], bank["vt"], bank["stats"]]
  if ext is not None:
    ins += ["o_ext", "lse_ext"]
    specs += [_tile_spec(f, f.dv), _lse(f)]
    args += list(ext)
  r = _call(f, functools.partial(_main_kernel_body, f=f, dy=dy), "combiner_dyadic_fwd", f.rows, ins, specs,
            args, ["o", "lse"], [_tile_spec(f, f.dv), _lse(f)],
            [_tok_shape(f, f.dv, out_dtype), _head_shape(f, f.rows, 1, f.cols)])
  return r["o"], r["lse"]


def main_backward(f: Frame, dy: Dyadic, a: dict, bank: dict, do: Array, o: Array, lse: Array,
                  acc: dict | None = None) -> dict:
  """The main program's gradients; `acc` (dq, dk, dv[, dpq, dpk]) are added to them in place."""
  ins, specs, args = _tile_inputs(f, dy, a)
  if dy.high:
    ins += ["bk", "bv", "bstats"]
    specs += [_full(f, (dy.num_spans, 1, n)) for n in (f.d, f.dv, levels.STATS)]
    args += [bank["kbar"], bank["vt"], bank["stats"]]
  ins += ["do", "o_fin", "lse_fin"]
  specs += [_tile_spec(f, f.dv), _tile_spec(f, f.dv), _lse(f)]
  args += [do, o, lse]
  grads = ["dq", "dk", "dv"] + (["dpq", "dpk"] if dy.pools else [])
  outs = grads + (["dhk", "dhv"] if dy.high else [])
  dims = {"dq": f.d, "dk": f.d, "dv": f.dv, "dpq": f.d, "dpk": f.d}
  if acc is not None:
    ins += [n + "_acc" for n in grads]
    specs += [_tile_spec(f, dims[n]) for n in grads]
    args += [acc[n] for n in grads]
  dtypes = {"dq": a["q"].dtype, "dk": a["k"].dtype, "dv": a["v"].dtype,
            "dpq": a.get("pool_q", a["q"]).dtype, "dpk": a.get("pool_k", a["k"]).dtype}
  out_specs, shapes = [], []
  for n in outs:
    if n in dims:
      out_specs.append(_tile_spec(f, dims[n]))
      shapes.append(_tok_shape(f, dims[n], dtypes[n]))
    else:
      dim = f.d if n == "dhk" else f.dv
      out_specs.append(frames.head_spec(f, (None, dy.high_rows, dim), lambda g: (g, 0, 0)))
      shapes.append(_head_shape(f, f.rows, dy.high_rows, dim))
  aliases = None if acc is None else {ins.index(n + "_acc"): i for i, n in enumerate(grads)}
  return _call(f, functools.partial(_main_backward_kernel_body, f=f, dy=dy), "combiner_dyadic_bwd", f.rows,
               ins, specs, args, outs, out_specs, shapes, aliases=aliases)


def spans_backward(f: Frame, dy: Dyadic, a: dict, bank: dict, main: dict) -> dict:
  ins, specs, args = _spans_inputs(f, dy, a)
  ins += ["dhk", "dhv"]
  specs += [_full(f, (f.rows, dy.high_rows, f.d)), _full(f, (f.rows, dy.high_rows, f.dv))]
  args += [main["dhk"], main["dhv"]]
  rows = ["kbar", "vt", "stats"] + ([] if dy.pooling is None else ["qbar"])
  ins += rows
  specs += [_row(f, _dim(f, n)) for n in rows]
  args += [bank[n] for n in rows]
  outs = ["dkbar", "dvt"] + ([] if dy.pooling is None else ["dqbar", "ties_q", "ties_k", "stats2"])
  return _call(f, functools.partial(_span_backward_kernel_body, f=f, dy=dy), "combiner_dyadic_spans_bwd",
               dy.num_spans, ins, specs, args, outs, [_row(f, _dim(f, n)) for n in outs],
               [_head_shape(f, dy.num_spans, 1, _dim(f, n)) for n in outs],
               loads=tuple(n for n in ins if n in frames.FRAME_INPUTS))


def tiles_backward(f: Frame, dy: Dyadic, a: dict, bank: dict, sb: dict, main: dict) -> dict:
  ins, specs, args = _tile_inputs(f, dy, a)
  rows = {**bank, **sb}
  names = [n for n in ("dvt", "dkbar", "qbar", "kbar", "stats", "stats2", "dqbar", "ties_q", "ties_k")
           if n in rows]
  ins += names
  specs += [_full(f, (dy.num_spans, 1, _dim(f, n))) for n in names]
  args += [rows[n] for n in names]
  grads = ["dq", "dk", "dv"] + (["dpq", "dpk"] if dy.pools else [])
  gdims = {"dq": f.d, "dk": f.d, "dv": f.dv, "dpq": f.d, "dpk": f.d}
  ins += [n + "_in" for n in grads]
  specs += [_tile_spec(f, gdims[n]) for n in grads]
  args += [main[n] for n in grads]
  return _call(f, functools.partial(_tile_backward_kernel_body, f=f, dy=dy), "combiner_dyadic_tiles_bwd",
               f.rows, ins, specs, args, grads, [_tile_spec(f, gdims[n]) for n in grads],
               [jax.ShapeDtypeStruct(main[n].shape, main[n].dtype) for n in grads],
               aliases={ins.index(n + "_in"): i for i, n in enumerate(grads)})


def direction_forward(f: Frame, dy: Dyadic, a: dict, out_dtype: Any, ext: tuple | None = None):
  bank = spans_forward(f, dy, a) if dy.high else {}
  o, lse = main_forward(f, dy, a, bank, out_dtype, ext)
  return o, lse, bank


def direction_backward(f: Frame, dy: Dyadic, a: dict, bank: dict, do: Array, o: Array, lse: Array,
                       acc: dict | None = None) -> dict:
  """Gradients of one direction given the plan's final output and log-sum-exp (in this direction's frame),
  added in place to `acc` (the other direction's) where given."""
  main = main_backward(f, dy, a, bank, do, o, lse, acc)
  if not dy.high:
    return main
  sb = spans_backward(f, dy, a, bank, main)
  return tiles_backward(f, dy, a, bank, sb, main)
