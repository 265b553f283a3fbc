"""The Pallas kernel every Combiner plan runs on: one program per (batch row, head, group) of a frame.

A plan lays the sequence out as a frame of `rows` x `cols` positions (a Combiner-Fixed block or an axial row
per frame row) and runs a few *passes* over it. A pass reads the frame by rows (group g = frame row g) or by
columns (group c = frame column c). One program holds its group in VMEM and, in order:

  construct  builds the group's span summaries (`Construct`): pooled keys, and the in-span expected values of
             the pooled queries, an attention over the group's keys. "block": one summary per group; "last":
             the group's last position; "prefix": per position, the rows before it ("upto": and itself);
             "all_but_one": per position, every other row; "own": per position its own query (the group's
             pooled query where the position is masked) against the whole group, with one pooled key per
             group;
  attend     runs one online softmax of the group's queries over its own keys (`own`), per-position summaries
             of the group from another pass (`extra`) and summaries shared by all groups (`bank`, one row per
             group), merged with another pass's partial softmax of the same queries (`ext`).

The backward program reverses it: the attention's gradients (dq, the group's dk and dv, the gradients of the
summaries it read, from the plan's final log-sum-exp), then the construction's given its summaries'
gradients, routing pooled gradients to the rows that pooled into them. dq, dk and dv accumulate across the
passes of one view in place (input_output_aliases).

Frame arrays and programs are laid out by `combiner.frames`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from combiner import frames, tiles
from combiner.frames import (
  Frame,
  Pass,
  Rows,
  accumulates_banks,
  head_spec,
  row_spec,
  tok_in,
  tok_out,
  tok_shape,
  tok_spec,
)
from combiner.tiles import F32, Online

Array = Any


# ---------------------------------------------------------------------------------------------- layouts

def _bank_spec(f: Frame, n: int, dim: int) -> pl.BlockSpec:
  """All n rows of a per-head bank [.., n, 1, dim] (read in the kernel as ref[rows, 0, :])."""
  return head_spec(f, (n, 1, dim), lambda g: (0, 0, 0))


def _partial_spec(f: Frame, n: int, dim: int) -> pl.BlockSpec:
  """The group's partial sums [.., groups, n, 1, dim] of a bank's gradient (the plan sums them)."""
  return head_spec(f, (None, n, 1, dim), lambda g: (g, 0, 0, 0))


def _lse_spec(f: Frame, p: Pass) -> pl.BlockSpec:
  return head_spec(f, (None, 1, p.glen(f)), lambda g: (g, 0, 0))


def _valid_spec(n: int) -> pl.BlockSpec:
  """Per-batch validity (f32 0/1) of the group's positions or summaries: [batch, groups, 1, n]."""
  return pl.BlockSpec((None, None, 1, n), lambda b, h, g: (b, g, 0, 0))


def _bank_valid_spec(n: int) -> pl.BlockSpec:
  return pl.BlockSpec((None, 1, n), lambda b, h, g: (b, 0, 0))


def lse_shape(f: Frame, p: Pass) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((f.batch * f.heads, p.groups(f), 1, p.glen(f)), F32)


# --------------------------------------------------------------------------------------------- validity

def _key_valid(f: Frame, p: Pass, R: dict, g: Array, start: Any, n: int) -> Array:
  """[1, n] validity of the group's positions start..start+n."""
  local = start + lax.broadcasted_iota(jnp.int32, (1, n), 1)
  ok = f.valid(*p.ids(g, local))
  if f.masked:
    ok = ok & (R["mask"][:, pl.ds(start, n)] > 0)
  return ok


def _summary_valid(f: Frame, p: Pass, R: dict, g: Array, start: Any, n: int) -> Array:
  """[1, n] nonempty-ness of the `extra` summaries start..start+n of the group."""
  if f.masked:
    return R["extra_valid"][:, pl.ds(start, n)] > 0
  return summary_count(f, p, g, start + lax.broadcasted_iota(jnp.int32, (1, n), 1)) > 0


def summary_count(f: Frame, p: Pass, g: Array, local: Array) -> Array:
  """Real members of the `extra` summary at local id `local` of group g, from positions alone."""
  if p.extra_count.startswith("vertical"):  # rows view: column e = local, its rows before / except row g
    per_col = jnp.where(local < jnp.minimum(f.span, f.length),
                        lax.div(jnp.maximum(f.length - 1 - local, 0), jnp.int32(f.span)) + 1, 0)
    if p.extra_count == "vertical_causal":
      return jnp.minimum(per_col, g)
    return per_col - f.valid(g, local).astype(jnp.int32)
  per_row = jnp.clip(f.length - local * f.span, 0, f.span)  # cols view: frame row s = local
  if p.extra_count == "rows":
    return per_row
  return per_row - f.valid(local, g).astype(jnp.int32)  # "horizontal": row s without column g


def _bank_valid(f: Frame, p: Pass, R: dict, n: int) -> Array:
  if f.masked:
    return R["bank_valid"][...] > 0
  r = lax.broadcasted_iota(jnp.int32, (1, n), 1)
  return f.valid(r, f.span - 1) if p.bank_last else f.valid(r, 0)


# -------------------------------------------------------------------------------------------- arguments

def _names(f: Frame, p: Pass, backward: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(input names, output names) of a pass's kernel, in argument order."""
  c = p.construct
  ins = ["q", "k", "v"]
  if c is not None and c.pools:
    ins += ["pool_q", "pool_k"]
  if c is not None and c.given_keys:
    ins += ["kbar_in"]
  if p.extra:
    ins += ["xk_bank" if p.extra_bank_keys else "xk", "xv"]
  if p.bank:
    ins += ["bk", "bv"]
  if p.ext and not backward:
    ins += ["o_ext", "lse_ext"]
  if f.masked:
    ins += ["mask"] + (["extra_valid"] if p.extra else []) + (["bank_valid"] if p.bank else [])
  if not backward:
    outs = []
    if p.attend:
      outs += ["o", "lse"]
    if c is not None:
      outs += {"block": ["kbar_row", "vt_row"], "last": ["kbar_row", "vt_row"],
               "prefix": ["kbar_tok", "vt_tok"], "upto": ["kbar_tok", "vt_tok"],
               "all_but_one": ["kbar_tok", "vt_tok"],
               "own": ([] if c.given_keys else ["kbar_row"]) + ["vt_tok"]}[c.kind]
    return tuple(ins), tuple(outs)
  if p.attend:
    ins += ["do", "o_fin", "lse_fin"]
  if c is not None:
    ins += {"block": ["dkbar_row", "dvt_row"], "last": ["dkbar_row", "dvt_row"],
            "prefix": ["dkbar_tok", "dvt_tok"], "upto": ["dkbar_tok", "dvt_tok"],
            "all_but_one": ["dkbar_tok", "dvt_tok"],
            "own": ["dkbar_row", "dvt_tok"]}[c.kind]
  ins += ["dq_in", "dk_in", "dv_in"] + (["dpq_in", "dpk_in"] if c is not None and c.pools else [])
  outs = ["dq", "dk", "dv"] + (["dpq", "dpk"] if c is not None and c.pools else [])
  if p.attend and p.extra:
    outs += (["dxk_bank"] if p.extra_bank_keys else ["dxk"]) + ["dxv"]
  if p.attend and p.bank:
    outs += ["dbk", "dbv"]
  return tuple(ins), tuple(outs)


TOK_INPUTS = ("q", "k", "v", "pool_q", "pool_k", "xk", "xv", "o_ext", "do", "o_fin", "dkbar_tok", "dvt_tok",
              "dq_in", "dk_in", "dv_in", "dpq_in", "dpk_in")
TOK_OUTPUTS = ("o", "kbar_tok", "vt_tok", "dq", "dk", "dv", "dpq", "dpk", "dxk", "dxv")


def _in_specs(f: Frame, p: Pass, names: tuple[str, ...], bank_rows: int) -> list[pl.BlockSpec]:
  d, dv, glen = f.d, f.dv, p.glen(f)
  tok = functools.partial(tok_spec, f, p)
  table = {"q": tok(d), "k": tok(d), "v": tok(dv), "pool_q": tok(d), "pool_k": tok(d), "xk": tok(d),
           "xv": tok(dv), "xk_bank": _bank_spec(f, f.rows, d), "bk": _bank_spec(f, bank_rows, d),
           "bv": _bank_spec(f, bank_rows, dv), "o_ext": tok(dv), "lse_ext": _lse_spec(f, p),
           "kbar_in": row_spec(f, d), "mask": _valid_spec(glen), "extra_valid": _valid_spec(glen),
           "bank_valid": _bank_valid_spec(bank_rows), "do": tok(dv), "o_fin": tok(dv),
           "lse_fin": _lse_spec(f, p),
           "dkbar_row": row_spec(f, d), "dvt_row": row_spec(f, dv), "dkbar_tok": tok(d), "dvt_tok": tok(dv),
           "dq_in": tok(d), "dk_in": tok(d), "dv_in": tok(dv), "dpq_in": tok(d), "dpk_in": tok(d)}
  return [table[n] for n in names]


# ------------------------------------------------------------------------------------------- the kernel

def _loop(n: int, body, carry):
  """carry after body(i, carry) for i < n (n static or traced); one static call when n == 1."""
  if isinstance(n, int) and n == 1:
    return body(0, carry)
  return lax.fori_loop(0, n, body, carry)


def _start(i: Any, t: int) -> Any:
  return i * t if isinstance(i, int) else pl.multiple_of(i * t, t)


def _causal_tiles(rule: str | None, i: Any, n: int) -> Any:
  """Key tiles a query tile i must visit under a rule on local ids (equal tiles): up to its own."""
  return jnp.minimum(n, i + 1) if rule in ("le", "lt", "eq") and not isinstance(i, int) else (
      min(n, i + 1) if rule in ("le", "lt", "eq") else n)


def _pooled(f: Frame, p: Pass, R: dict, valid_col: Array):
  """The construction's pooled queries and keys: (queries [nq, d] f32, q stats, keys [nk, d] f32, k stats)."""
  c = p.construct
  pq = (R["pool_q"] if c.pools else R["q"])[...].astype(F32)
  pk = (R["pool_k"] if c.pools else R["k"])[...].astype(F32)
  if c.kind == "block":
    qbar, qcnt = tiles.pool_block(pq, valid_col, c.pooling)
    kbar, kcnt = tiles.pool_block(pk, valid_col, c.pooling)
    return tiles.rows_of(qbar, tiles.min_rows(f.platform)), qcnt, kbar, kcnt
  if c.kind in ("prefix", "upto"):
    pool = tiles.pool_upto if c.kind == "upto" else tiles.pool_prefix
    qbar, cnt = pool(pq, valid_col, c.pooling, f.platform)
    kbar, _ = pool(pk, valid_col, c.pooling, f.platform)
    return qbar, cnt, kbar, cnt
  if c.kind == "all_but_one":
    qbar, cnt = tiles.pool_all_but_one(pq, valid_col, c.pooling)
    kbar, _ = tiles.pool_all_but_one(pk, valid_col, c.pooling)
    return qbar, cnt, kbar, cnt
  # "own": each position's own query, the group's pooled query where the position is masked
  qbar, qcnt = tiles.pool_block(pq, valid_col, c.pooling)
  queries = jnp.where(valid_col, R["q"][...].astype(F32), qbar)
  if c.given_keys:
    return queries, qcnt, None, None
  kbar, kcnt = tiles.pool_block(pk, valid_col, c.pooling)
  return queries, qcnt, kbar, kcnt


def _span_softmax(f: Frame, p: Pass, R: dict, g: Array, queries: Array, ok_rows: Array):
  """The in-span attention of `queries` [nq, d] over the group's keys: (out [nq, dv] f32, lse [nq, 1])."""
  c, glen = p.construct, p.glen(f)
  nq = queries.shape[0]
  t = min(p.tile(f), glen)
  qk = queries.astype(R["k"].dtype)
  qid = lax.broadcasted_iota(jnp.int32, (nq, 1), 0)

  def body(j, st):
    s = _start(j, t)
    kid = s + lax.broadcasted_iota(jnp.int32, (1, t), 1)
    vis = _key_valid(f, p, R, g, s, t) & ok_rows
    rule = tiles.visible(c.rule, qid, kid)
    vis = vis if rule is None else vis & rule
    return tiles.online_step(st, qk, R["k"][pl.ds(s, t), :], R["v"][pl.ds(s, t), :], vis, f.scale)

  return tiles.finish(_loop(glen // t, body, Online.empty(nq, f.dv)))


def _construct(f: Frame, p: Pass, R: dict, g: Array) -> None:
  c, glen = p.construct, p.glen(f)
  valid_row = _key_valid(f, p, R, g, 0, glen)  # [1, glen]
  valid_col = tiles.column(valid_row) > 0  # [glen, 1]
  if c.kind == "last":
    last = f.span - 1
    ok = tiles.take_row(valid_col.astype(F32), last) > 0
    R["kbar_row"][...] = jnp.where(ok, R["k"][last:last + 1, :].astype(F32), 0.0)
    R["vt_row"][...] = jnp.where(ok, R["v"][last:last + 1, :].astype(F32), 0.0)
    return
  queries, _, kbar, _ = _pooled(f, p, R, valid_col)
  vt, _ = _span_softmax(f, p, R, g, queries, True)
  if c.kind == "block":
    R["kbar_row"][...] = kbar
    R["vt_row"][...] = tiles.take_row(vt, 0)
  elif c.kind == "own":
    if kbar is not None:
      R["kbar_row"][...] = kbar
    R["vt_tok"][...] = vt.astype(R["vt_tok"].dtype)
  else:
    R["kbar_tok"][...] = kbar.astype(R["kbar_tok"].dtype)
    R["vt_tok"][...] = vt.astype(R["vt_tok"].dtype)


def _sources(f: Frame, p: Pass, R: dict, g: Array, bank_rows: int):
  """The sources a query tile reads: (name, key ref, value ref, n, tile, rule, id kind, valid(start, n))."""
  out = []
  glen, t = p.glen(f), p.tile(f)
  if p.own:
    out.append(("own", R["k"], R["v"], glen, t, p.own, "local",
                lambda s, n: _key_valid(f, p, R, g, s, n)))
  if p.extra:
    keys = Rows(R["xk_bank"]) if p.extra_bank_keys else R["xk"]
    out.append(("extra", keys, R["xv"], glen, t, p.extra, "local",
                lambda s, n: _summary_valid(f, p, R, g, s, n)))
  if p.bank:
    out.append(("bank", Rows(R["bk"]), Rows(R["bv"]), bank_rows, bank_rows, p.bank, "group",
                lambda s, n: _bank_valid(f, p, R, n)))
  return out


def _visible(rule: str, kind: str, qid: Array, g: Array, kid: Array, valid: Array) -> Array:
  structural = tiles.visible(rule, qid if kind == "local" else g, kid)
  return valid if structural is None else valid & structural


def _tiles_for(rule: str, kind: str, i: Any, n: int, t: int, g: Array) -> Any:
  """How many key tiles a query tile i visits: causal rules stop after the last one they can see."""
  num = n // t
  if rule not in ("le", "lt", "eq") or num == 1:
    return num
  if kind == "group":  # bank rows before (or at) the group
    return jnp.minimum(num, lax.div(g + (t if rule == "le" else t - 1), jnp.int32(t)))
  return _causal_tiles(rule, i, num)


def _attend_tile(f: Frame, p: Pass, R: dict, g: Array, sources: list, i: Any, qs: Any, q: Array) -> Online:
  """One query tile's online softmax over every source."""
  t = q.shape[0]
  qid = qs + lax.broadcasted_iota(jnp.int32, (t, 1), 0)
  st = Online.empty(t, f.dv)
  for _, kref, vref, n, kt, rule, kind, valid in sources:
    def body(j, st, kref=kref, vref=vref, kt=kt, rule=rule, kind=kind, valid=valid):
      s = _start(j, kt)
      kid = s + lax.broadcasted_iota(jnp.int32, (1, kt), 1)
      vis = _visible(rule, kind, qid, g, kid, valid(s, kt))
      return tiles.online_step(st, q, kref[pl.ds(s, kt), :], vref[pl.ds(s, kt), :], vis, f.scale)
    st = _loop(_tiles_for(rule, kind, i, n, kt, g), body, st)
  return st


def _attend(f: Frame, p: Pass, R: dict, g: Array, bank_rows: int) -> None:
  glen, t = p.glen(f), p.tile(f)
  sources = _sources(f, p, R, g, bank_rows)

  def q_tile(i, carry):
    qs = _start(i, t)
    st = _attend_tile(f, p, R, g, sources, i, qs, R["q"][pl.ds(qs, t), :])
    if p.ext:
      st = tiles.merge_partial(st, R["o_ext"][pl.ds(qs, t), :], tiles.column(R["lse_ext"][:, pl.ds(qs, t)]))
    o, lse = tiles.finish(st)
    R["o"][pl.ds(qs, t), :] = o.astype(R["o"].dtype)
    R["lse"][:, pl.ds(qs, t)] = lse.T
    return carry

  _loop(glen // t, q_tile, 0)


HEAD_ARRAYS = ("lse", "lse_ext", "lse_fin", "bk", "bv", "xk_bank", "kbar_in", "dkbar_row", "dvt_row",
               "kbar_row", "vt_row", "dbk", "dbv", "dxk_bank")


def forward_program(b: Array, R: dict, g: Array, head: Array, *, f: Frame, p: Pass, bank_rows: int) -> None:
  if p.construct is not None:
    _construct(f, p, R, g)
  if p.attend:
    _attend(f, p, R, g, bank_rows)


def _attend_backward(f: Frame, p: Pass, R: dict, g: Array, bank_rows: int) -> dict[str, Any]:
  """The attention's gradients as values: dq [glen, d] and, per source, the gradients of its keys and values
  ({name: (dk, dv)}, the group's own and per-position summaries [glen, .], the shared rows [n, .]).
  The group's tiles run in static loops: its key tiles' gradients accumulate as values, no scratch."""
  glen, t = p.glen(f), p.tile(f)
  n = glen // t
  sources = _sources(f, p, R, g, bank_rows)
  key_grads = {name: [[jnp.zeros((kt, f.d), F32), jnp.zeros((kt, f.dv), F32)] for _ in range(num // kt)]
               for name, _, _, num, kt, *_ in sources}
  dq_tiles = []
  for i in range(n):
    qs = i * t
    q, do = R["q"][qs:qs + t, :], R["do"][qs:qs + t, :]
    if f.out_weight != 1.0:  # the softmax's share of the output's gradient
      do = (do.astype(F32) * f.out_weight).astype(do.dtype)
    delta = jnp.sum(do.astype(F32) * R["o_fin"][qs:qs + t, :].astype(F32), axis=1, keepdims=True)
    lse = tiles.column(R["lse_fin"][:, qs:qs + t])
    qid = qs + lax.broadcasted_iota(jnp.int32, (t, 1), 0)
    dq = jnp.zeros((t, f.d), F32)
    for name, kref, vref, num, kt, rule, kind, valid in sources:
      causal = kind == "local" and rule in ("le", "lt", "eq")
      for j in range(min(num // kt, i + 1) if causal else num // kt):
        s = j * kt
        kid = s + lax.broadcasted_iota(jnp.int32, (1, kt), 1)
        vis = _visible(rule, kind, qid, g, kid, valid(s, kt))
        k = kref[s:s + kt, :]
        pr, ds = tiles.grads(q, do, k, vref[s:s + kt, :], vis, lse, delta, f.scale)
        acc = key_grads[name][j]
        acc[0] = acc[0] + tiles.dot(ds.astype(q.dtype), q, ta=True) * f.scale
        acc[1] = acc[1] + tiles.dot(pr.astype(q.dtype), do.astype(q.dtype), ta=True)
        dq = dq + tiles.dot(ds.astype(q.dtype), tiles.finite(k).astype(q.dtype)) * f.scale
    dq_tiles.append(dq)
  out = {"dq": tiles.stack_rows(dq_tiles, f.platform)}
  for name, grads in key_grads.items():
    out[name] = (tiles.stack_rows([a for a, _ in grads], f.platform),
                 tiles.stack_rows([b for _, b in grads], f.platform))
  return out


def _construct_backward(f: Frame, p: Pass, R: dict, g: Array) -> dict[str, Array]:
  """The construction's gradients as values [glen, .]: "dq", "dk", "dv" (added to the group's) and "dpq",
  "dpk" (to the pools: q and k themselves unless DeepSets)."""
  c, glen = p.construct, p.glen(f)
  valid_row = _key_valid(f, p, R, g, 0, glen)
  valid_col = tiles.column(valid_row) > 0
  zero_d = jnp.zeros((glen, f.d), F32)
  if c.kind == "last":
    at = (lax.broadcasted_iota(jnp.int32, (glen, 1), 0) == f.span - 1) & valid_col
    return {"dq": zero_d, "dk": jnp.where(at, R["dkbar_row"][...], 0.0),
            "dv": jnp.where(at, R["dvt_row"][...], 0.0), "dpq": zero_d, "dpk": zero_d}
  queries, qcnt, kbar, kcnt = _pooled(f, p, R, valid_col)
  if c.kind == "block":  # one pooled query, repeated to fill a tile: only row 0 carries a gradient
    first = lax.broadcasted_iota(jnp.int32, (queries.shape[0], 1), 0) == 0
    dvt = jnp.where(first, tiles.rows_of(R["dvt_row"][...], queries.shape[0]), 0.0)
    dkbar = R["dkbar_row"][...]
  elif c.kind == "own":
    dvt, dkbar = R["dvt_tok"][...].astype(F32), R["dkbar_row"][...]
  else:
    dvt, dkbar = R["dvt_tok"][...].astype(F32), R["dkbar_tok"][...].astype(F32)
  vt, lse = _span_softmax(f, p, R, g, queries, True)
  delta = jnp.sum(dvt * vt, axis=1, keepdims=True)
  nq = queries.shape[0]
  qk = queries.astype(R["k"].dtype)
  qid = lax.broadcasted_iota(jnp.int32, (nq, 1), 0)
  t = min(p.tile(f), glen)
  dqbar = jnp.zeros((nq, f.d), F32)
  dks, dvs = [], []
  for j in range(glen // t):  # key tiles
    s = j * t
    kid = s + lax.broadcasted_iota(jnp.int32, (1, t), 1)
    rule = tiles.visible(c.rule, qid, kid)
    ok = _key_valid(f, p, R, g, s, t)
    k = R["k"][s:s + t, :]
    pr, ds = tiles.grads(qk, dvt, k, R["v"][s:s + t, :], ok if rule is None else ok & rule, lse, delta,
                         f.scale)
    dqbar = dqbar + tiles.dot(ds.astype(qk.dtype), tiles.finite(k).astype(qk.dtype)) * f.scale
    dks.append(tiles.dot(ds.astype(qk.dtype), qk, ta=True) * f.scale)
    dvs.append(tiles.dot(pr.astype(qk.dtype), dvt.astype(qk.dtype), ta=True))
  out = {"dq": zero_d, "dk": tiles.stack_rows(dks, f.platform), "dv": tiles.stack_rows(dvs, f.platform)}
  pq = (R["pool_q"] if c.pools else R["q"])[...].astype(F32)
  pk = (R["pool_k"] if c.pools else R["k"])[...].astype(F32)
  if c.kind == "block":
    out["dpq"] = tiles.route_block(pq, valid_col, c.pooling, tiles.take_row(queries, 0), qcnt,
                                   tiles.take_row(dqbar, 0))
    out["dpk"] = tiles.route_block(pk, valid_col, c.pooling, kbar, kcnt, dkbar)
  elif c.kind in ("prefix", "upto"):
    upto = c.kind == "upto"
    out["dpq"] = tiles.route_prefix(pq, valid_col, c.pooling, qcnt, dqbar, f.platform, upto)
    out["dpk"] = tiles.route_prefix(pk, valid_col, c.pooling, kcnt, dkbar, f.platform, upto)
  elif c.kind == "all_but_one":
    out["dpq"] = tiles.route_all_but_one(pq, valid_col, c.pooling, qcnt, dqbar)
    out["dpk"] = tiles.route_all_but_one(pk, valid_col, c.pooling, kcnt, dkbar)
  else:  # own: a real position's query is its own; masked ones take the group's pooled query
    out["dq"] = jnp.where(valid_col, dqbar, 0.0)
    qbar, _ = tiles.pool_block(pq, valid_col, c.pooling)
    to_pool = jnp.sum(jnp.where(valid_col, 0.0, dqbar), axis=0, keepdims=True)
    out["dpq"] = tiles.route_block(pq, valid_col, c.pooling, qbar, qcnt, to_pool)
    out["dpk"] = zero_d if c.given_keys else tiles.route_block(pk, valid_col, c.pooling, kbar, kcnt, dkbar)
  return out


def backward_program(b: Array, R: dict, g: Array, head: Array, *, f: Frame, p: Pass, bank_rows: int) -> None:
  glen = p.glen(f)
  dq, dk, dv = jnp.zeros((glen, f.d), F32), jnp.zeros((glen, f.d), F32), jnp.zeros((glen, f.dv), F32)
  dpq = dpk = jnp.zeros((glen, f.d), F32)
  if p.attend:
    a = _attend_backward(f, p, R, g, bank_rows)
    dq = a["dq"]
    if p.own:
      dk, dv = dk + a["own"][0], dv + a["own"][1]
    if p.extra:
      if p.extra_bank_keys:
        _add_shared(f, R, "dxk_bank", a["extra"][0], g)
      else:
        R["dxk"][...] = a["extra"][0].astype(R["dxk"].dtype)
      R["dxv"][...] = a["extra"][1].astype(R["dxv"].dtype)
    if p.bank:
      _add_shared(f, R, "dbk", a["bank"][0], g)
      _add_shared(f, R, "dbv", a["bank"][1], g)
  if p.construct is not None:
    c = _construct_backward(f, p, R, g)
    dq, dk, dv, dpq, dpk = dq + c["dq"], dk + c["dk"], dv + c["dv"], c["dpq"], c["dpk"]
    if not p.construct.pools:
      dq, dk = dq + dpq, dk + dpk
  for n, x in (("dq", dq), ("dk", dk), ("dv", dv), ("dpq", dpq), ("dpk", dpk)):
    if n in R:
      if n + "_in" in R:
        x = x + R[n + "_in"][...].astype(F32)
      R[n][...] = x.astype(R[n].dtype)


def _add_shared(f: Frame, R: dict, name: str, x: Array, g: Array) -> None:
  """Adds a group's gradient [n, dim] of rows shared by every group: in place over the groups where they
  accumulate (the first group zeroes them), else as the group's own partial sums."""
  ref = Rows(R[name])
  if accumulates_banks(f):
    @pl.when(g == 0)
    def _():
      R[name][...] = jnp.zeros_like(R[name])
    ref[:, :] = ref[:, :] + x
  else:
    ref[:, :] = x


# -------------------------------------------------------------------------------------------- the calls

def _call(f: Frame, p: Pass, kernel, names: tuple, outs: tuple, args: dict, in_specs: list, out_specs: list,
          out_shape: list, *, name: str, bank_rows: int, accumulate: bool = False,
          over: dict[str, str] | None = None) -> dict[str, Array]:
  """One kernel call of a pass (`frames.call_kernel`): frame arrays viewed as the pass reads them. over:
  {input: output} written over it besides `ALIASES`."""
  ins = [n for n in names if n not in outs]
  arrays = [tok_in(f, p, args[n]) if n in TOK_INPUTS else args[n] for n in ins]
  res = frames.call_kernel(
      f, functools.partial(kernel, f=f, p=p, bank_rows=bank_rows), name, p.groups(f), ins, in_specs, arrays,
      list(outs), out_specs, out_shape, tok=TOK_INPUTS + TOK_OUTPUTS, heads=HEAD_ARRAYS, glen=p.glen(f),
      aliases=frames.aliases_by_name(ins, outs, arrays, out_shape, {**ALIASES, **(over or {})}),
      accumulate=accumulate)
  return {n: tok_out(f, p, x) if n in TOK_OUTPUTS else x for n, x in res.items()}



# Outputs written over an input of the same shape and dtype: accumulated gradients, the merged output over the
# other pass's partial, the summaries' gradients over the summaries (each program reads its group first).
ALIASES = {"dq_in": "dq", "dk_in": "dk", "dv_in": "dv", "dpq_in": "dpq", "dpk_in": "dpk", "o_ext": "o",
           "xk": "dxk", "xv": "dxv"}


def forward(f: Frame, p: Pass, args: dict[str, Array], *, out_dtype: Any, tok_dtype: Any, bank_rows: int = 0,
            name: str = "combiner") -> dict[str, Array]:
  """Runs a pass forward. args: the named inputs of `_names` (frame arrays, per-head and per-batch arrays).
  Returns its named outputs: o (out_dtype if final, else tok_dtype), lse, and the construction's summaries
  (per-position ones in tok_dtype, per-group rows float32 [BH, groups, 1, dim])."""
  ins, outs = _names(f, p, backward=False)
  bh, groups = f.batch * f.heads, p.groups(f)
  shapes = {"o": tok_shape(f, p, f.dv, out_dtype if p.final else tok_dtype), "lse": lse_shape(f, p),
            "kbar_row": jax.ShapeDtypeStruct((bh, groups, 1, f.d), F32),
            "vt_row": jax.ShapeDtypeStruct((bh, groups, 1, f.dv), F32),
            "kbar_tok": tok_shape(f, p, f.d, tok_dtype), "vt_tok": tok_shape(f, p, f.dv, tok_dtype)}
  specs = {"o": tok_spec(f, p, f.dv), "lse": _lse_spec(f, p), "kbar_row": row_spec(f, f.d),
           "vt_row": row_spec(f, f.dv), "kbar_tok": tok_spec(f, p, f.d), "vt_tok": tok_spec(f, p, f.dv)}
  return _call(f, p, forward_program, ins + outs, outs, args, _in_specs(f, p, ins, bank_rows),
               [specs[n] for n in outs], [shapes[n] for n in outs], bank_rows=bank_rows, name=f"{name}_fwd")


def backward(f: Frame, p: Pass, args: dict[str, Array], *, dtypes: dict[str, Any], bank_rows: int = 0,
             name: str = "combiner", over: dict[str, str] | None = None) -> dict[str, Array]:
  """Runs a pass backward. args: the named inputs of `_names(backward=True)`; where dq_in, dk_in, dv_in
  (dpq_in, dpk_in) are given they are updated in place and returned as dq, dk, dv (dpq, dpk); also returns the
  gradients of the summaries the pass read: dxk/dxv (per position, in `dtypes`), dxk_bank, dbk/dbv (float32;
  per-group partial sums [BH, groups, n, 1, dim] where `accumulates_banks` is False). over: {input: output}
  written over it, for inputs the caller does not need after (each program reads its own group's)."""
  ins, outs = _names(f, p, backward=True)
  ins = tuple(n for n in ins if not n.endswith("_in") or n in args)
  bh, groups = f.batch * f.heads, p.groups(f)
  accumulate = accumulates_banks(f) and any(n in outs for n in ("dbk", "dxk_bank"))
  specs, shapes = [], []
  for n in outs:
    if n in ("dbk", "dbv", "dxk_bank"):
      rows, dim = {"dbk": (bank_rows, f.d), "dbv": (bank_rows, f.dv), "dxk_bank": (f.rows, f.d)}[n]
      if accumulates_banks(f):
        specs.append(_bank_spec(f, rows, dim))
        shapes.append(jax.ShapeDtypeStruct((bh, rows, 1, dim), F32))
      else:
        specs.append(_partial_spec(f, rows, dim))
        shapes.append(jax.ShapeDtypeStruct((bh, groups, rows, 1, dim), F32))
    else:
      dim = f.dv if n in ("dv", "dxv") else f.d
      specs.append(tok_spec(f, p, dim))
      shapes.append(tok_shape(f, p, dim, dtypes[n]))
  return _call(f, p, backward_program, ins + outs, outs, args, _in_specs(f, p, ins, bank_rows), specs, shapes,
               accumulate=accumulate, bank_rows=bank_rows, name=f"{name}_bwd", over=over)
