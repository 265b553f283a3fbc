"""The causal Combiner-routed plan on kernels: a slot-layout pass of `combiner.passes` and a position-layout
summary kernel, merged by log-sum-exp inside one custom_vjp.

Causal routed attention (paper eq. 12, `combiner.routed`) has two halves living in two orders:

  slot layout      tokens sorted by (chunk, padding, position), one frame row per chunk of w. Query i
                   attends its own chunk's real tokens at positions <= i (rule "le" in this order), and the
                   pass builds every chunk's prefix states ("upto": slot t pools the chunk's real slots 0..t,
                   its value the pooled query's softmax over them): one partial softmax per query;
  position layout  positions in blocks of w. Query i sees every other chunk r in the state ended by r's last
                   real token at a position <= i: a block-start "base" state of r (one per block and chunk)
                   unless a token of r inside the block at or before i advanced it, then the state that
                   token ended (one per position). `_summary_forward` runs that softmax over [base states of
                   the block ; states of the block's tokens], its masks built in the kernel from the block's
                   chunk ids, and merges the slot pass's partial.

Where a head's blocks run in order (a TPU core, the interpreter) the summary kernel carries the base states
from block to block (the next block's are this one's, advanced by the chunks' last tokens in it), and its
backward, over the blocks in reverse, hands each base state's gradient to the token that ended it. On GPUs,
whose programs run in parallel, the base states are gathered per block from the prefix states and their
gradients scatter-added back. Either way gradients come from the final log-sum-exp: the summary kernel's
backward gives dq and the states' gradients, which flow back to slot layout (a permutation of the per-token
ones) into the slot pass's backward (its own-chunk attention and the prefix states' construction), which
writes dk and dv over its own slot-order copies of the cotangent and the output. Between
forward and backward the output, its log-sum-exp, the prefix states and (carried) the base states each block
used are kept; the backward gathers the per-token states again (in one program with its forward, XLA shares
those gathers). Padded query rows are don't-care (they see every base state), as the op contract allows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from combiner import frames, kernel_plans, passes, tiles
from combiner.frames import Construct, Frame, Pass
from combiner.tiles import F32, Online

Array = Any
_ROWS = Pass("rows")  # the summary kernel's view of its frame: one program per block of positions


@dataclasses.dataclass(frozen=True)
class _Plan:
  slots: Frame  # slot layout: rows = chunks, span = w
  blocks: Frame  # position layout: rows = blocks of w positions
  bank: int  # base states per block: the chunks, padded to a frame row length
  pooling: str
  pools: bool  # DeepSets pools given
  out_dtype: Any

  @property
  def carried(self) -> bool:
    """Base states carried over a head's blocks (its programs run in order), else gathered per block."""
    return frames.accumulates_banks(self.blocks)

  @property
  def spans(self) -> Pass:
    return Pass("rows", own="le", construct=Construct("upto", self.pooling, "le", pools=self.pools),
                final=False)



# ------------------------------------------------------------------------------------- the summary kernel

def _chunk_ids(R: dict, start: int, n: int) -> Array:
  """[1, n] chunk ids (float32; -1: no real token) of the block's positions start..start+n."""
  return R["cid"][:, start:start + n].astype(F32)


def _visibility(f: Frame, R: dict, bank: int):
  """Per query tile (qs, t): the base states' visibility [t, bank] and, per key tile (ks, t), the block
  tokens' states' [t, t]."""
  cols = f.cols
  cid_col = tiles.column(R["cid"][...])  # [cols, 1]
  jid = lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
  rid = lax.broadcasted_iota(jnp.int32, (1, bank), 1).astype(F32)
  first = jnp.min(jnp.where(cid_col == rid, jid, cols), axis=0, keepdims=True)  # [1, bank] chunk r first seen
  base_ok = R["bvalid"][...] > 0  # [1, bank]

  def base(qs: int, t: int) -> Array:
    qid = qs + lax.broadcasted_iota(jnp.int32, (t, 1), 0)
    qc = tiles.column(_chunk_ids(R, qs, t))
    return base_ok & (rid != qc) & (first > qid)  # not own chunk, not advanced inside the block by i

  def tokens(qs: int, ks: int, t: int) -> Array:
    qid = qs + lax.broadcasted_iota(jnp.int32, (t, 1), 0)
    kid = ks + lax.broadcasted_iota(jnp.int32, (1, t), 1)
    qc, kc = tiles.column(_chunk_ids(R, qs, t)), _chunk_ids(R, ks, t)
    later = (cid_col == kc) & (jid > kid)  # [cols, t]: a later token of key j's chunk
    nxt = jnp.min(jnp.where(later, jid, cols), axis=0, keepdims=True)  # [1, t]
    return (kc >= 0) & (kid <= qid) & (nxt > qid) & (kc != qc)  # j is its chunk's last at or before i

  return base, tokens


def _summary_forward(b: Array, R: dict, g: Array, head: Array, *, f: Frame, bank: int) -> None:
  t = min(f.cols, f.tile)
  base, tokens = _visibility(f, R, bank)
  kb, vb = R["kb"][...], R["vb"][...]
  for i in range(f.cols // t):
    qs = i * t
    q = R["q"][qs:qs + t, :]
    st = tiles.online_step(Online.empty(t, f.dv), q, kb, vb, base(qs, t), f.scale)
    for j in range(i + 1):
      ks = j * t
      st = tiles.online_step(st, q, R["ku"][ks:ks + t, :], R["vu"][ks:ks + t, :], tokens(qs, ks, t), f.scale)
    st = tiles.merge_partial(st, R["o_ext"][qs:qs + t, :], tiles.column(R["lse_ext"][:, qs:qs + t]))
    o, lse = tiles.finish(st)
    R["o"][qs:qs + t, :] = o.astype(R["o"].dtype)
    R["lse"][:, qs:qs + t] = lse.T


def _block_backward(R: dict, f: Frame, bank: int) -> tuple[Array, Array, list, list]:
  """The summary softmax's backward over one block: writes dq, returns the base states' gradients
  (dkb [bank, d], dvb [bank, dv]) and the block tokens' states' per key tile (lists of [t, d|dv]), float32."""
  t = min(f.cols, f.tile)
  n = f.cols // t
  base, tokens = _visibility(f, R, bank)
  kb, vb = R["kb"][...], R["vb"][...]
  dkb, dvb = jnp.zeros((bank, f.d), F32), jnp.zeros((bank, f.dv), F32)
  dku = [jnp.zeros((t, f.d), F32) for _ in range(n)]
  dvu = [jnp.zeros((t, f.dv), F32) for _ in range(n)]
  for i in range(n):
    qs = i * t
    q, do = R["q"][qs:qs + t, :], R["do"][qs:qs + t, :]
    delta = jnp.sum(do.astype(F32) * R["o_fin"][qs:qs + t, :].astype(F32), axis=1, keepdims=True)
    lse = tiles.column(R["lse_fin"][:, qs:qs + t])
    keys = [(kb, vb, base(qs, t), None)] + [
        (R["ku"][j * t:(j + 1) * t, :], R["vu"][j * t:(j + 1) * t, :], tokens(qs, j * t, t), j)
        for j in range(i + 1)]
    dq = jnp.zeros((t, f.d), F32)
    for k, v, vis, j in keys:
      pr, ds = tiles.grads(q, do, k, v, vis, lse, delta, f.scale)
      dk_part = tiles.dot(ds.astype(q.dtype), q, ta=True) * f.scale
      dv_part = tiles.dot(pr.astype(q.dtype), do.astype(q.dtype), ta=True)
      if j is None:
        dkb, dvb = dkb + dk_part, dvb + dv_part
      else:
        dku[j], dvu[j] = dku[j] + dk_part, dvu[j] + dv_part
      dq = dq + tiles.dot(ds.astype(q.dtype), tiles.finite(k).astype(q.dtype)) * f.scale
    R["dq"][qs:qs + t, :] = dq.astype(R["dq"].dtype)
  return dkb, dvb, dku, dvu


def _write_tokens(R: dict, f: Frame, dku: list, dvu: list) -> None:
  t = min(f.cols, f.tile)
  for j in range(len(dku)):
    R["dku"][j * t:(j + 1) * t, :] = dku[j].astype(R["dku"].dtype)
    R["dvu"][j * t:(j + 1) * t, :] = dvu[j].astype(R["dvu"].dtype)


def _summary_backward(b: Array, R: dict, g: Array, head: Array, *, f: Frame, bank: int) -> None:
  dkb, dvb, dku, dvu = _block_backward(R, f, bank)
  _write_tokens(R, f, dku, dvu)
  R["dkb"][...] = dkb.astype(R["dkb"].dtype)
  R["dvb"][...] = dvb.astype(R["dvb"].dtype)


# The base states carried from block to block (a TPU core and the interpreter run a head's blocks in order):
# the next block's base state of chunk r is the state ended by r's last token in this block, or this block's
# where no token of r is in it. So the forward needs no gathered base states, and the backward, run over the
# blocks in reverse, hands each base state's gradient to the token that ended it or on to the block before,
# instead of a scatter-add over the blocks sharing a state.

def _last_tokens(f: Frame, R: dict, bank: int) -> tuple[Array, Array, Array]:
  """(sel [bank, cols]: chunk r's last real token in the block, has [bank, 1] and has_row [1, bank]: chunk r
  has a real token in it)."""
  cols = f.cols
  cid_row = _chunk_ids(R, 0, cols)  # [1, cols]
  cid_col = tiles.column(R["cid"][...])  # [cols, 1]
  jid_col = lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
  jid_row = lax.broadcasted_iota(jnp.int32, (1, cols), 1)
  later = (cid_col == cid_row) & (jid_col > jid_row)  # [cols(j'), cols(j)]: j' a later token of j's chunk
  last = (jnp.min(jnp.where(later, jid_col, cols), axis=0, keepdims=True) == cols) & (cid_row >= 0)
  rid_col = lax.broadcasted_iota(jnp.int32, (bank, 1), 0).astype(F32)
  rid_row = lax.broadcasted_iota(jnp.int32, (1, bank), 1).astype(F32)
  sel = (rid_col == cid_row) & last  # [bank, cols]
  has = jnp.max(jnp.where(sel, 1.0, 0.0), axis=1, keepdims=True) > 0  # [bank, 1]
  has_row = jnp.min(jnp.where(cid_col == rid_row, jid_col, cols), axis=0, keepdims=True) < cols  # [1, bank]
  return sel, has, has_row


def _pick(sel: Array, x: Array) -> Array:
  """Rows of x [cols, e] chosen by a one-hot sel [bank, cols] -> [bank, e] float32; a row with a non-finite
  entry comes out NaN (and poisons no other row)."""
  bad = jnp.max(jnp.where(jnp.isfinite(x.astype(F32)), 0.0, 1.0), axis=1, keepdims=True)  # [cols, 1]
  bad = jnp.max(jnp.where(sel, bad.T, 0.0), axis=1, keepdims=True) > 0  # [bank, 1]
  return jnp.where(bad, jnp.nan, tiles.dot(sel.astype(x.dtype), tiles.finite(x)))


def _summary_forward_carried(b: Array, R: dict, g: Array, head: Array, *, f: Frame, bank: int) -> None:
  """`_summary_forward` with the block's base states from the carry (kc, vc, okc: resident over a head's
  blocks), written out (kb, vb, bvalid) for the backward."""
  @pl.when(g == 0)
  def _():
    R["kc"][...] = jnp.zeros(R["kc"].shape, R["kc"].dtype)
    R["vc"][...] = jnp.zeros(R["vc"].shape, R["vc"].dtype)
    R["okc"][...] = jnp.zeros(R["okc"].shape, F32)

  R["kb"][...], R["vb"][...], R["bvalid"][...] = R["kc"][...], R["vc"][...], R["okc"][...]
  _summary_forward(b, R, g, head, f=f, bank=bank)
  sel, has, has_row = _last_tokens(f, R, bank)
  R["kc"][...] = jnp.where(has, _pick(sel, R["ku"][...]), R["kc"][...].astype(F32)).astype(R["kc"].dtype)
  R["vc"][...] = jnp.where(has, _pick(sel, R["vu"][...]), R["vc"][...].astype(F32)).astype(R["vc"].dtype)
  R["okc"][...] = jnp.where(has_row, 1.0, R["okc"][...])


def _summary_backward_carried(b: Array, R: dict, g: Array, head: Array, *, f: Frame, bank: int) -> None:
  """`_summary_backward` over the blocks in reverse: the gradient carried in (gk, gv: the next block's base
  states', float32) goes to the block's last token of each chunk, or on with this block's own."""
  @pl.when(g == 0)
  def _():
    R["gk"][...] = jnp.zeros(R["gk"].shape, F32)
    R["gv"][...] = jnp.zeros(R["gv"].shape, F32)

  dkb, dvb, dku, dvu = _block_backward(R, f, bank)
  sel, has, _ = _last_tokens(f, R, bank)
  gk, gv = R["gk"][...], R["gv"][...]
  t = min(f.cols, f.tile)
  onehot = sel.astype(F32)
  for j in range(len(dku)):
    part = onehot[:, j * t:(j + 1) * t]  # [bank, t]
    dku[j] = dku[j] + tiles.dot(part, gk, ta=True)
    dvu[j] = dvu[j] + tiles.dot(part, gv, ta=True)
  _write_tokens(R, f, dku, dvu)
  R["gk"][...] = dkb + jnp.where(has, 0.0, gk)
  R["gv"][...] = dvb + jnp.where(has, 0.0, gv)


_TOK = ("q", "ku", "vu", "o_ext", "do", "o_fin", "o", "dq", "dku", "dvu")
_CARRIES = ("kc", "vc", "okc", "gk", "gv")  # one block per head, resident over its blocks
_HEADS = ("lse_ext", "lse", "lse_fin", "cid", "bvalid", "kb", "vb", "dkb", "dvb") + _CARRIES


def _summary_call(plan: _Plan, program, args: dict[str, Array], outs: dict[str, Any], name: str,
                  reverse: bool = False, aliases: dict[str, str] | None = None) -> dict:
  """One call of a summary kernel over the position frame's blocks (in reverse order if `reverse`).
  outs: name -> dtype. aliases: {input: output} written over it (each program reads its block of the input
  before it writes the output's)."""
  f, bank = plan.blocks, plan.bank
  bh = f.batch * f.heads
  d, dv = f.d, f.dv
  dims = {"q": d, "ku": d, "vu": dv, "o_ext": dv, "do": dv, "o_fin": dv, "o": dv, "dq": d, "dku": d,
          "dvu": dv, "kb": d, "vb": dv, "dkb": d, "dvb": dv, "kc": d, "vc": dv, "gk": d, "gv": dv}

  def spec(n: str):
    if n in ("lse_ext", "lse", "lse_fin", "cid"):
      s = frames.head_spec(f, (None, 1, f.cols), lambda g: (g, 0, 0))
    elif n == "bvalid":
      s = frames.head_spec(f, (None, 1, bank), lambda g: (g, 0, 0))
    elif n == "okc":
      s = frames.head_spec(f, (None, 1, bank), lambda g: (0, 0, 0))
    elif n in _CARRIES:
      s = frames.head_spec(f, (None, bank, dims[n]), lambda g: (0, 0, 0))
    elif n in ("kb", "vb", "dkb", "dvb"):
      s = frames.head_spec(f, (None, bank, dims[n]), lambda g: (g, 0, 0))
    else:
      s = frames.tok_spec(f, _ROWS, dims[n])
    if not reverse:
      return s
    return pl.BlockSpec(s.block_shape, lambda b, h, g, s=s: s.index_map(b, h, f.rows - 1 - g))

  def shape(n: str, dtype: Any):
    if n in ("lse", "bvalid"):
      return jax.ShapeDtypeStruct((bh, f.rows, 1, f.cols if n == "lse" else bank), F32)
    if n == "okc":
      return jax.ShapeDtypeStruct((bh, 1, 1, bank), F32)
    if n in _CARRIES:
      return jax.ShapeDtypeStruct((bh, 1, bank, dims[n]), dtype)
    if n in ("kb", "vb", "dkb", "dvb"):
      return jax.ShapeDtypeStruct((bh, f.rows, bank, dims[n]), dtype)
    return frames.tok_shape(f, _ROWS, dims[n], dtype)

  ins, shapes, arrays = list(args), [shape(n, dt) for n, dt in outs.items()], list(args.values())
  return frames.call_kernel(
      f, functools.partial(program, f=f, bank=bank), name, f.rows, ins, [spec(n) for n in ins], arrays,
      list(outs), [spec(n) for n in outs], shapes, tok=_TOK, heads=_HEADS, glen=f.cols,
      aliases=frames.aliases_by_name(ins, list(outs), arrays, shapes, aliases or {}), accumulate=plan.carried)


# -------------------------------------------------------------------------------------------- layouts
# Every move between the two orders is one row gather (or scatter-add) over a flattened array, by a table of
# flat row numbers `_orders` builds once: a frame array [batch, n, heads, dim] as rows [batch * n * heads,
# dim], a per-head one [BH, n] as [BH * n].

_ROW_DIMS = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
_ELEMENT_DIMS = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,))


def _gather(x: Array, rows: Array, shape: tuple[int, ...], elements: bool = False) -> Array:
  """Rows `rows` [m, 1] of x as [-1, dim] (its elements, as [-1], if `elements`), reshaped to `shape`. The
  tables are in bounds by construction: no index clamping or wrapping."""
  if elements:
    flat, dims, sizes = x.reshape(-1), _ELEMENT_DIMS, (1,)
  else:
    flat, dims, sizes = x.reshape(-1, x.shape[-1]), _ROW_DIMS, (1, x.shape[-1])
  return lax.gather(flat, rows, dims, sizes, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS).reshape(shape)


def _scatter_add(x: Array, rows: Array, updates: Array) -> Array:
  """x [n, dim] with updates [m, dim] added at rows `rows` [m, 1]."""
  dims = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                     scatter_dims_to_operand_dims=(0,))
  return lax.scatter_add(x, rows, updates, dims, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _row_frame(x: Array, f: Frame, fill: Any = -jnp.inf) -> Array:
  """Per-position values [BH, length] -> per-head rows [BH, rows, 1, cols] (padding `fill`; a log-sum-exp's
  -inf: no key)."""
  x = jnp.pad(x, ((0, 0), (0, f.rows * f.span - f.length)), constant_values=fill)
  x = jnp.pad(x.reshape(f.batch * f.heads, f.rows, f.span), ((0, 0), (0, 0), (0, f.cols - f.span)),
              constant_values=fill)
  return x[:, :, None, :]


# ------------------------------------------------------------------------------------------ the plan

def _to_slots(plan: _Plan, a: dict, x: Array) -> Array:
  """[batch, length, heads, dim] in position order -> a slot frame array."""
  b, length, h, dim = x.shape
  return kernel_plans.to_frame(_gather(x, a["slot_rows"], (b, length, h, dim)), plan.slots)


def _to_positions(plan: _Plan, a: dict, x: Array, dim: int) -> Array:
  """A slot frame array -> [batch, length, heads, dim] in position order."""
  f = plan.slots
  return _gather(x.reshape(-1, dim), a["pos_rows"], (f.batch, f.length, f.heads, dim))


def _slot_arrays(plan: _Plan, a: dict) -> dict[str, Array]:
  """q, k, v (and the pools) in slot layout, as frame arrays of the slot frame."""
  out = {n: _to_slots(plan, a, a[n]) for n in ("q", "k", "v", "pool_q", "pool_k") if n in a}
  if "mask" in a:
    out["mask"] = a["mask"]
  return out


def _states(plan: _Plan, a: dict, kbar: Array, vt: Array) -> dict[str, Array]:
  """The summary kernel's states from the slot pass's prefix states (slot frame arrays): each position's own
  state (a position frame array) and, unless the kernel carries them, the base states per block
  [BH, blocks, bank, dim]."""
  fs, fb = plan.slots, plan.blocks
  out = {}
  for name, x, dim in (("k", kbar, fs.d), ("v", vt, fs.dv)):
    out[name + "u"] = kernel_plans.to_frame(_to_positions(plan, a, x, dim), fb)
    if plan.carried:
      continue
    base = _gather(x.reshape(-1, dim), a["base_rows"], (fb.batch * fb.heads, fb.rows, fs.rows, dim))
    out[name + "b"] = jnp.pad(base, ((0, 0), (0, 0), (0, plan.bank - fs.rows), (0, 0)))
  return out


def _forward(plan: _Plan, a: dict):
  """(output [batch, length, heads, dv], (its log-sum-exp [BH, blocks, 1, cols] in the position frame, the
  prefix states' keys and values: slot frame arrays, and where carried the base states the kernel used:
  {kb, vb, bvalid})."""
  fs, fb = plan.slots, plan.blocks
  kdt = a["q"].dtype
  sa = _slot_arrays(plan, a)
  s = passes.forward(fs, plan.spans, sa, out_dtype=kdt, tok_dtype=kdt, name="combiner_routed_spans")
  st = _states(plan, a, s["kbar_tok"], s["vt_tok"])
  args = {"q": kernel_plans.to_frame(a["q"], fb), **st,
          "o_ext": kernel_plans.to_frame(_to_positions(plan, a, s["o"], fs.dv), fb),
          "lse_ext": _row_frame(_gather(s["lse"], a["lse_rows"], (fb.batch * fb.heads, fb.length), True), fb),
          "cid": a["cid"]}
  outs = {"o": plan.out_dtype, "lse": F32}
  if plan.carried:
    outs.update(kb=kdt, vb=kdt, bvalid=F32, kc=kdt, vc=kdt, okc=F32)
  else:
    args["bvalid"] = a["bvalid"]
  m = _summary_call(plan, _summary_forward_carried if plan.carried else _summary_forward, args, outs,
                    "combiner_routed_summaries_fwd")
  base = {n: m[n] for n in ("kb", "vb", "bvalid")} if plan.carried else {}
  return kernel_plans.from_frame(m["o"], fb, fb.dv), (m["lse"], s["kbar_tok"], s["vt_tok"], base)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run(plan: _Plan, a: dict) -> Array:
  return _forward(plan, a)[0]


def _run_fwd(plan: _Plan, a: dict):
  out, res = _forward(plan, a)
  return out, (a, out, *res)


def _run_bwd(plan: _Plan, residuals: tuple, do: Array):
  a, out, lse, kbar, vt, base = residuals
  fs, fb = plan.slots, plan.blocks
  sa = _slot_arrays(plan, a)
  st = _states(plan, a, kbar, vt)
  args = {"q": kernel_plans.to_frame(a["q"], fb), **st, **base, "cid": a["cid"],
          "do": kernel_plans.to_frame(do, fb), "o_fin": kernel_plans.to_frame(out, fb), "lse_fin": lse}
  # The states' gradients in the inputs' dtype (each one float32 sum, rounded once). Gathered base states'
  # gradients are float32 only for the sum over the blocks sharing a block-start state, which halves the
  # largest temporaries; carried ones are in the tokens' own.
  outs = {n: a["q"].dtype for n in ("dq", "dku", "dvu")}
  if plan.carried:
    outs.update(gk=F32, gv=F32)
  else:
    args["bvalid"] = a["bvalid"]
    outs.update(dkb=a["q"].dtype, dvb=a["q"].dtype)
  m = _summary_call(plan, _summary_backward_carried if plan.carried else _summary_backward, args, outs,
                    "combiner_routed_summaries_bwd", reverse=plan.carried, aliases={"ku": "dku", "vu": "dvu"})

  def state_grads(tok: Array, bank: Array | None, dim: int) -> Array:  # -> the prefix states' gradients
    x = _to_slots(plan, a, kernel_plans.from_frame(tok, fb, dim))
    if bank is None:
      return x
    bank = bank[:, :, :fs.rows].reshape(-1, dim).astype(F32)
    return _scatter_add(x.astype(F32).reshape(-1, dim), a["base_rows"], bank).reshape(x.shape)

  lse_slots = _row_frame(_gather(lse, a["lse_slot_rows"], (fs.batch * fs.heads, fs.length), True), fs)
  g = passes.backward(fs, plan.spans, {
      **sa, "do": _to_slots(plan, a, do), "o_fin": _to_slots(plan, a, out), "lse_fin": lse_slots,
      "dkbar_tok": state_grads(m["dku"], m.get("dkb"), fs.d),
      "dvt_tok": state_grads(m["dvu"], m.get("dvb"), fs.dv),
      "dq_in": _to_slots(plan, a, kernel_plans.from_frame(m["dq"], fb, fb.d))},
      dtypes=kernel_plans.grad_dtypes(a), name="combiner_routed_spans", over={"do": "dk", "o_fin": "dv"})
  grads = {"q": _to_positions(plan, a, g["dq"], fs.d), "k": _to_positions(plan, a, g["dk"], fs.d),
           "v": _to_positions(plan, a, g["dv"], fs.dv)}
  if "dpq" in g:
    grads.update(pool_q=_to_positions(plan, a, g["dpq"], fs.d), pool_k=_to_positions(plan, a, g["dpk"], fs.d))
  return ({n: grads.get(n) for n in a},)


_run.defvjp(_run_fwd, _run_bwd)


def causal(q: Array, k: Array, v: Array, mask: Array | None, pool_q: Array | None, pool_k: Array | None,
           cluster_ids: Array, *, num_clusters: int, pooling: str, platform: str) -> Array:
  """The causal routed plan on the kernels. q, k: [batch, length, heads, head_dim]; v: [..., value_dim];
  cluster_ids: int32 [batch, length, heads] -> [batch, length, heads, value_dim] in v's dtype."""
  batch, length, heads, _ = q.shape
  w = -(-length // num_clusters)
  chunks = -(-length // w)  # also the number of position blocks of w
  slots = kernel_plans.make_frame(q, v, mask, w, chunks, platform)
  blocks = dataclasses.replace(slots, masked=False)
  plan = _Plan(slots, blocks, kernel_plans.frame_cols(chunks, platform), pooling, pool_q is not None,
               jnp.dtype(v.dtype))
  a = kernel_plans.inputs(q, k, v, pool_q, pool_k, kernel_plans.kernel_dtype(q, k, v))
  a.update(_orders(plan, jax.lax.stop_gradient(cluster_ids), mask, num_clusters))
  if mask is not None:
    real = jnp.arange(length) < jnp.sum(mask, axis=1, keepdims=True)  # slot layout: real tokens first
    a["mask"] = kernel_plans.view_rows(kernel_plans.mask_frame(real, slots), "rows")
  return _run(plan, a)


def _orders(plan: _Plan, ids: Array, mask: Array | None, n: int) -> dict[str, Array]:
  """The plan's integer tables from cluster ids [b, L, h]: the flat row numbers of its moves between the
  orders, each position's chunk id (the summary kernel's masks) and the base states' validity.

  Tokens are ranked by (cluster, position), padding last (as `routed._partition`); rank r is in chunk r // w.
  The slot order sorts by (chunk, padding, position): one two-key sort of the ranked positions."""
  fs, fb = plan.slots, plan.blocks
  batch, length, heads = ids.shape
  w, chunks, cols = fs.span, fs.rows, fs.cols
  real = jnp.ones((batch, length), bool) if mask is None else mask
  ids = jnp.where(real[:, :, None], ids, n)
  iota = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :, None], ids.shape)
  sorted_ids, ranked = jax.lax.sort((ids, iota), dimension=1, num_keys=1)  # rank -> position (stable)
  # Static index arithmetic in numpy: constants of the program, not device ops.
  rank_chunk = np.arange(length, dtype=np.int32)[None, :, None] // w  # [1, L, 1]
  key = 2 * rank_chunk + (sorted_ids == n).astype(jnp.int32)  # 2 * chunk + padding, per rank
  _, to_slot = jax.lax.sort((key, ranked), dimension=1, num_keys=2)  # [b, L(slot), h] -> position
  to_pos = jnp.argsort(to_slot, axis=1).astype(jnp.int32)  # [b, L(position), h] -> slot
  chunk = to_pos // w  # [b, L, h]
  b_ix = np.arange(batch, dtype=np.int32)[:, None, None]
  h_ix = np.arange(heads, dtype=np.int32)[None, None, :]
  bh = b_ix * heads + h_ix  # [b, 1, h]
  frame_at = chunk * cols + to_pos % w  # [b, L, h]: each position's token in the slot frame
  slots_n = chunks * cols
  bh_major = bh[:, 0, :]  # [b, h]
  out = {
      "slot_rows": ((b_ix * length + to_slot) * heads + h_ix).reshape(-1, 1),
      "pos_rows": ((b_ix * slots_n + frame_at) * heads + h_ix).reshape(-1, 1),
      "lse_rows": (bh_major[:, :, None] * slots_n + frame_at.transpose(0, 2, 1)).reshape(-1, 1),
      "lse_slot_rows": (bh_major[:, :, None] * (fb.rows * fb.cols)
                        + ((to_slot // w) * fb.cols + to_slot % w).transpose(0, 2, 1)).reshape(-1, 1),
      "cid": _row_frame(jnp.where(real[:, :, None], chunk, -1).transpose(0, 2, 1).reshape(batch * heads, -1),
                        fb, fill=-1),
  }
  if plan.carried:
    return out
  # base states: the real members of each chunk before each block (real ones come first in their chunk)
  member_block = jnp.pad(to_slot, ((0, 0), (0, chunks * w - length), (0, 0)), constant_values=length) // w
  if mask is None:
    real_slot = np.arange(chunks * w)[None] < length  # [1, slots]
  else:
    real_slot = np.arange(chunks * w)[None] < jnp.sum(real, axis=1, keepdims=True)  # [b, slots]
  member_block = jnp.where(real_slot[:, :, None], member_block, chunks).reshape(batch, chunks, w, heads)
  before = jnp.sum(member_block[:, None] < np.arange(chunks)[None, :, None, None, None], axis=3)
  before = before.transpose(0, 3, 1, 2).astype(jnp.int32)  # [b, h, block, chunk]
  base_at = np.arange(chunks, dtype=np.int32) * cols + jnp.maximum(before - 1, 0)
  out["base_rows"] = ((b_ix[:, :, :, None] * slots_n + base_at) * heads
                      + np.arange(heads, dtype=np.int32)[None, :, None, None]).reshape(-1, 1)
  valid = jnp.pad((before > 0).astype(F32), ((0, 0), (0, 0), (0, 0), (0, plan.bank - chunks)))
  out["bvalid"] = valid.reshape(batch * heads, chunks, 1, plan.bank)
  return out
