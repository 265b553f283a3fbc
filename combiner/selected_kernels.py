"""Combiner-Fixed with selected spans (combiner/selected.py) on Pallas kernels.

Every query attends its own block directly, the summaries of the visible blocks it does not select, and the
tokens of the `select` blocks whose summaries score highest for it (`q_i . k_bar_r`, ties to the lower
block), all under one softmax. A frame row is a block (`combiner.passes`):

  spans      the blocks' summaries (the "block" construction of combiner.passes);
  main       per block: the own block, the bank of summaries less each query's choice, and the chosen blocks'
             tokens, copied in from HBM (on TPU) for the blocks some query of the block chose; the choices
             are written out, int32 per slot and query (-1 for an unused slot; queries on the lanes, so the
             keys' backward can hold a head's whole table in VMEM);
  main bwd   per block: dq from all three, the own block's dk and dv, the summaries' gradients;
  keys bwd   per block of keys: dk and dv from the queries that chose it (read from the choices);
  spans bwd  the construction's gradients (combiner.passes).

The choice carries no gradient (as NSA's and MoBA's).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from combiner import frames, tiles
from combiner.frames import Frame
from combiner.tiles import F32, NEG, Online

Array = Any
TOK = ("q", "k", "v", "do", "o_fin", "dq_in", "dk_in", "dv_in", "o", "dq", "dk", "dv")
HEADS = ("bk", "bv", "lse", "lse_fin", "lse_all", "sel", "sel_all", "delta", "delta_all", "dbk", "dbv")
TOK_ALL = ("k_all", "v_all", "q_all", "do_all")


def _lane(x: Array, i: Any) -> Array:
  """Column i [n, 1] of x [n, w] at a traced index (a masked reduction: no dynamic lane slices)."""
  lanes = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(lanes == i, x, jnp.zeros_like(x)), axis=1, keepdims=True)


def _choose(f: Frame, q: Array, kbar: Array, visible: Array, count: int) -> tuple[Array, Array]:
  """Each query's `count` best visible blocks by summary logit: (picked [t, nb] bool, sel [t, count] int32,
  -1 for a slot no visible block fills). Ties go to the lower block."""
  s = tiles.dot(q, kbar.astype(q.dtype), tb=True) * f.scale  # [t, nb]
  nb = s.shape[1]
  ids = lax.broadcasted_iota(jnp.int32, s.shape, 1)
  slots = lax.broadcasted_iota(jnp.int32, (s.shape[0], count), 1)
  picked = jnp.zeros(s.shape, bool)
  sel = jnp.full((s.shape[0], count), -1, jnp.int32)
  for t in range(count):
    key = jnp.where(visible & ~picked, s, NEG)
    top = jnp.max(key, axis=1, keepdims=True)
    idx = jnp.min(jnp.where((key == top) & (top > NEG), ids, nb), axis=1, keepdims=True)  # [t, 1]
    picked = picked | (ids == idx)
    sel = jnp.where(slots == t, jnp.where(idx < nb, idx, -1), sel)
  return picked, sel


def _slot_rows(sel: Array) -> Array:
  """sel [t, count] int32 -> [count, t]: queries on the lanes (a [t, count] table pads count to 128 lanes)."""
  x = sel.astype(F32)  # block indices are exact in float32
  rows = lax.broadcasted_iota(jnp.int32, (sel.shape[1], sel.shape[0]), 0)
  out = jnp.zeros(rows.shape, F32)
  for s in range(sel.shape[1]):
    out = jnp.where(rows == s, _lane(x, s).T, out)
  return out.astype(jnp.int32)


def _bank_visible(f: Frame, R: dict, g: Array, t: int, causal: bool) -> Array:
  """[t, nb]: the summaries the group's queries see (before the own block when causal; nonempty)."""
  ids = lax.broadcasted_iota(jnp.int32, (t, f.rows), 1)
  vis = (ids < g) if causal else (ids != g)
  if f.masked:
    return vis & (R["bank_valid"][...] > 0)
  return vis & f.valid(ids, 0)


def _sources(f: Frame, R: dict, g: Array, head: Array, b: Array, qs: int, t: int, causal: bool, count: int):
  """The query tile's pieces: (own-block key tiles, summaries less the chosen, picked [t, nb], sel)."""
  q = R["q"][qs:qs + t, :]
  kbar, vt = R["bk"][:, 0, :], R["bv"][:, 0, :]
  visible = _bank_visible(f, R, g, t, causal)
  picked, sel = _choose(f, q, kbar, visible, count)
  return q, kbar, vt, visible & ~picked, picked, sel


def _own_visible(f: Frame, R: dict, g: Array, qs: int, t: int, ks: int, kt: int, causal: bool) -> Array:
  qid = qs + lax.broadcasted_iota(jnp.int32, (t, 1), 0)
  kid = ks + lax.broadcasted_iota(jnp.int32, (1, kt), 1)
  ok = f.valid(g, kid)
  if f.masked:
    ok = ok & (R["mask"][:, ks:ks + kt] > 0)
  return ok & (kid <= qid) if causal else ok


def _main_body(b: Array, R: dict, g: Array, head: Array, *, f: Frame, causal: bool, count: int) -> None:
  T = f.cols
  t = min(T, f.tile)
  load = frames.TileLoader(f, R, b, head, mask="mask_all")
  for i in range(T // t):
    qs = i * t
    q, kbar, vt, summary_vis, picked, sel = _sources(f, R, g, head, b, qs, t, causal, count)
    st = Online.empty(t, f.dv)
    for j in range(min(T // t, i + 1) if causal else T // t):  # the own block
      ks = j * t
      st = tiles.online_step(st, q, R["k"][ks:ks + t, :], R["v"][ks:ks + t, :],
                             _own_visible(f, R, g, qs, t, ks, t, causal), f.scale)
    st = tiles.online_step(st, q, kbar, vt, summary_vis, f.scale)
    union = jnp.max(picked.astype(F32), axis=0, keepdims=True)  # [1, nb]: blocks some query chose

    def block(r, st, q=q, picked=picked, union=union):
      def attend(st):
        vis = (_lane(picked.astype(F32), r) > 0) & load.valid(r, b, (1, T))  # [t, T]
        return tiles.online_step(st, q, load("k_all", r, f.d), load("v_all", r, f.dv), vis, f.scale)
      return lax.cond(_lane(union, r)[0, 0] > 0, attend, lambda st: st, st)

    st = lax.fori_loop(0, g if causal else f.rows, block, st)
    o, lse = tiles.finish(st)
    R["o"][qs:qs + t, :] = o.astype(R["o"].dtype)
    R["lse"][:, qs:qs + t] = lse.T
    R["sel"][:, qs:qs + t] = _slot_rows(sel)


def _main_backward_body(b: Array, R: dict, g: Array, head: Array, *, f: Frame, causal: bool,
                        count: int) -> None:
  T = f.cols
  t = min(T, f.tile)
  load = frames.TileLoader(f, R, b, head, mask="mask_all")
  dk_own = [jnp.zeros((t, f.d), F32) for _ in range(T // t)]
  dv_own = [jnp.zeros((t, f.dv), F32) for _ in range(T // t)]
  dbk, dbv = jnp.zeros((f.rows, f.d), F32), jnp.zeros((f.rows, f.dv), F32)
  for i in range(T // t):
    qs = i * t
    q, kbar, vt, summary_vis, picked, _ = _sources(f, R, g, head, b, qs, t, causal, count)
    do = R["do"][qs:qs + t, :]
    delta = jnp.sum(do.astype(F32) * R["o_fin"][qs:qs + t, :].astype(F32), axis=1, keepdims=True)
    lse = tiles.column(R["lse_fin"][:, qs:qs + t])
    R["delta"][:, qs:qs + t] = delta.T
    kdt = q.dtype
    dq = jnp.zeros((t, f.d), F32)
    for j in range(min(T // t, i + 1) if causal else T // t):
      ks = j * t
      k = R["k"][ks:ks + t, :]
      pr, ds = tiles.grads(q, do, k, R["v"][ks:ks + t, :], _own_visible(f, R, g, qs, t, ks, t, causal), lse,
                           delta, f.scale)
      dq = dq + tiles.dot(ds.astype(kdt), tiles.finite(k).astype(kdt)) * f.scale
      dk_own[j] = dk_own[j] + tiles.dot(ds.astype(kdt), q, ta=True) * f.scale
      dv_own[j] = dv_own[j] + tiles.dot(pr.astype(kdt), do.astype(kdt), ta=True)
    pr, ds = tiles.grads(q, do, kbar, vt, summary_vis, lse, delta, f.scale)
    dq = dq + tiles.dot(ds.astype(kdt), tiles.finite(kbar).astype(kdt)) * f.scale
    dbk = dbk + tiles.dot(ds.astype(kdt), q, ta=True) * f.scale
    dbv = dbv + tiles.dot(pr.astype(kdt), do.astype(kdt), ta=True)
    union = jnp.max(picked.astype(F32), axis=0, keepdims=True)

    def block(r, dq, q=q, do=do, picked=picked, union=union, lse=lse, delta=delta):
      def grad(dq):
        vis = (_lane(picked.astype(F32), r) > 0) & load.valid(r, b, (1, T))
        k = load("k_all", r, f.d)
        _, ds = tiles.grads(q, do, k, load("v_all", r, f.dv), vis, lse, delta, f.scale)
        return dq + tiles.dot(ds.astype(q.dtype), tiles.finite(k).astype(q.dtype)) * f.scale
      return lax.cond(_lane(union, r)[0, 0] > 0, grad, lambda dq: dq, dq)

    dq = lax.fori_loop(0, g if causal else f.rows, block, dq)
    R["dq"][qs:qs + t, :] = dq.astype(R["dq"].dtype)
  R["dk"][...] = tiles.stack_rows(dk_own, f.platform).astype(R["dk"].dtype)
  R["dv"][...] = tiles.stack_rows(dv_own, f.platform).astype(R["dv"].dtype)
  for name, x in (("dbk", dbk), ("dbv", dbv)):
    ref = frames.Rows(R[name])
    if frames.accumulates_banks(f):
      @pl.when(g == 0)
      def _(name=name):
        R[name][...] = jnp.zeros_like(R[name])
      ref[:, :] = ref[:, :] + x
    else:
      ref[:, :] = x


def _keys_backward_body(b: Array, R: dict, r: Array, head: Array, *, f: Frame, causal: bool,
                        count: int) -> None:
  """dk, dv of key block r from the queries of every other block that chose it."""
  T = f.cols
  load = frames.TileLoader(f, R, b, head, mask="mask_all")
  k, v = R["k"][...], R["v"][...]
  kdt = k.dtype
  valid = load.valid(r, b, (1, T))

  def group(g, acc):
    sel = R["sel_all"][g]  # [count, T]
    chose = tiles.column(jnp.max(jnp.where(sel == r, 1.0, 0.0), axis=0, keepdims=True))  # [T, 1]
    seen = (g > r) if causal else (g != r)

    def grad(acc):
      dk, dv = acc
      q, do = load("q_all", g, f.d), load("do_all", g, f.dv)
      lse, delta = tiles.column(R["lse_all"][g]), tiles.column(R["delta_all"][g])
      pr, ds = tiles.grads(q, do, k, v, (chose > 0) & valid, lse, delta, f.scale)
      return (dk + tiles.dot(ds.astype(kdt), q, ta=True) * f.scale,
              dv + tiles.dot(pr.astype(kdt), do.astype(kdt), ta=True))

    return lax.cond(seen & (jnp.max(chose) > 0), grad, lambda acc: acc, acc)

  dk, dv = lax.fori_loop(0, f.rows, group, (jnp.zeros((T, f.d), F32), jnp.zeros((T, f.dv), F32)))
  R["dk"][...] = (R["dk_in"][...].astype(F32) + dk).astype(R["dk"].dtype)
  R["dv"][...] = (R["dv_in"][...].astype(F32) + dv).astype(R["dv"].dtype)


# ------------------------------------------------------------------------------------------------ calls

def _tile_spec(f: Frame, dim: int) -> pl.BlockSpec:
  if f.packed:
    return pl.BlockSpec((None, f.cols, dim), lambda b, h, g: (b, g, h))
  return frames.head_block_spec(f, (None, f.cols), dim, lambda b, h, g: (b, g, h))


def _head_rows(f: Frame, dim: int) -> pl.BlockSpec:
  """The group's row [.., 1, cols] of a per-head [BH, groups, 1, cols]."""
  return frames.head_spec(f, (None, 1, dim), lambda g: (g, 0, 0))


def _head_whole(f: Frame, shape: tuple) -> pl.BlockSpec:
  return frames.head_spec(f, shape, lambda g: (0,) * len(shape))


def _masks(f: Frame, a: dict) -> tuple[list[str], list, list]:
  if not f.masked:
    return [], [], []
  return (["mask", "mask_all", "bank_valid"],
          [pl.BlockSpec((None, None, 1, f.cols), lambda b, h, g: (b, g, 0, 0)),
           pl.BlockSpec(a["mask"].shape, lambda b, h, g: (0, 0, 0, 0)),
           pl.BlockSpec((None, 1, f.rows), lambda b, h, g: (b, 0, 0))],
          [a["mask"], a["mask"], a["bank_valid"]])


def _call(f: Frame, kernel, *args, **kw) -> dict[str, Array]:
  return frames.call_kernel(f, kernel, *args, tok=TOK, heads=HEADS, **kw)


def _whole_frames(f: Frame, a: dict, names: tuple[str, ...]) -> tuple[list[str], list, list]:
  return list(names), [frames.whole_spec(f, a[n]) for n in names], [a[n] for n in names]


def main_forward(f: Frame, a: dict, bank: tuple, out_dtype: Any, causal: bool, count: int) -> dict:
  """o [frame], lse [BH, blocks, 1, cols], sel [BH, blocks, count, cols] int32."""
  ins = ["q", "k", "v", "bk", "bv"]
  specs = [_tile_spec(f, f.d), _tile_spec(f, f.d), _tile_spec(f, f.dv), _head_whole(f, (f.rows, 1, f.d)),
           _head_whole(f, (f.rows, 1, f.dv))]
  args = [a["q"], a["k"], a["v"], *bank]
  n, s_, x = _masks(f, a)
  ins, specs, args = ins + n, specs + s_, args + x
  n, s_, x = _whole_frames(f, a, ("k_all", "v_all"))
  ins, specs, args = ins + n, specs + s_, args + x
  outs = ["o", "lse", "sel"]
  shapes = [jax.ShapeDtypeStruct(a["v"].shape, out_dtype),
            jax.ShapeDtypeStruct((f.batch * f.heads, f.rows, 1, f.cols), F32),
            jax.ShapeDtypeStruct((f.batch * f.heads, f.rows, count, f.cols), jnp.int32)]
  out_specs = [_tile_spec(f, f.dv), _head_rows(f, f.cols),
               frames.head_spec(f, (None, count, f.cols), lambda g: (g, 0, 0))]
  return _call(f, functools.partial(_main_body, f=f, causal=causal, count=count), "combiner_selected_fwd",
               f.rows, ins, specs, args, outs, out_specs, shapes, loads=("k_all", "v_all"))


def main_backward(f: Frame, a: dict, bank: tuple, res: dict, do: Array, causal: bool, count: int) -> dict:
  """dq, the own blocks' dk/dv, the summaries' gradients dbk/dbv [BH, blocks, 1, dim] and delta."""
  ins = ["q", "k", "v", "bk", "bv", "do", "o_fin", "lse_fin"]
  specs = [_tile_spec(f, f.d), _tile_spec(f, f.d), _tile_spec(f, f.dv), _head_whole(f, (f.rows, 1, f.d)),
           _head_whole(f, (f.rows, 1, f.dv)), _tile_spec(f, f.dv), _tile_spec(f, f.dv), _head_rows(f, f.cols)]
  args = [a["q"], a["k"], a["v"], *bank, do, res["o"], res["lse"]]
  n, s_, x = _masks(f, a)
  ins, specs, args = ins + n, specs + s_, args + x
  n, s_, x = _whole_frames(f, a, ("k_all", "v_all"))
  ins, specs, args = ins + n, specs + s_, args + x
  bh = f.batch * f.heads
  outs = ["dq", "dk", "dv", "dbk", "dbv", "delta"]
  if frames.accumulates_banks(f):
    bank_specs = [_head_whole(f, (f.rows, 1, dim)) for dim in (f.d, f.dv)]
    bank_shapes = [jax.ShapeDtypeStruct((bh, f.rows, 1, dim), F32) for dim in (f.d, f.dv)]
  else:
    bank_specs = [frames.head_spec(f, (None, f.rows, 1, dim), lambda g: (g, 0, 0, 0))
                  for dim in (f.d, f.dv)]
    bank_shapes = [jax.ShapeDtypeStruct((bh, f.rows, f.rows, 1, dim), F32) for dim in (f.d, f.dv)]
  out_specs = [_tile_spec(f, f.d), _tile_spec(f, f.d), _tile_spec(f, f.dv), *bank_specs,
               _head_rows(f, f.cols)]
  shapes = [jax.ShapeDtypeStruct(a[n].shape, a[n].dtype) for n in ("q", "k", "v")] + [*bank_shapes,
            jax.ShapeDtypeStruct((bh, f.rows, 1, f.cols), F32)]
  return _call(f, functools.partial(_main_backward_body, f=f, causal=causal, count=count),
               "combiner_selected_bwd", f.rows, ins, specs, args, outs, out_specs, shapes,
               loads=("k_all", "v_all"), accumulate=frames.accumulates_banks(f))


def keys_backward(f: Frame, a: dict, res: dict, main: dict, do: Array, causal: bool, count: int) -> dict:
  """dk, dv of each block from the queries that chose it, added to the main backward's."""
  ins = ["k", "v", "sel_all", "lse_all", "delta_all", "dk_in", "dv_in"]
  specs = [_tile_spec(f, f.d), _tile_spec(f, f.dv), _head_whole(f, (f.rows, count, f.cols)),
           _head_whole(f, (f.rows, 1, f.cols)), _head_whole(f, (f.rows, 1, f.cols)), _tile_spec(f, f.d),
           _tile_spec(f, f.dv)]
  args = [a["k"], a["v"], res["sel"], res["lse"], main["delta"], main["dk"], main["dv"]]
  n, s_, x = _masks(f, a)
  ins, specs, args = ins + n, specs + s_, args + x
  ins += ["q_all", "do_all"]
  specs += [frames.whole_spec(f, a["q"]), frames.whole_spec(f, do)]
  args += [a["q"], do]
  outs = ["dk", "dv"]
  return _call(f, functools.partial(_keys_backward_body, f=f, causal=causal, count=count),
               "combiner_selected_keys_bwd", f.rows, ins, specs, args, outs,
               [_tile_spec(f, f.d), _tile_spec(f, f.dv)],
               [jax.ShapeDtypeStruct(main["dk"].shape, main["dk"].dtype),
                jax.ShapeDtypeStruct(main["dv"].shape, main["dv"].dtype)],
               loads=("q_all", "do_all"), aliases={ins.index("dk_in"): 0, ins.index("dv_in"): 1})
