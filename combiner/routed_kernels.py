"""The causal Combiner-routed plan on kernels: a slot-layout pass of `combiner.passes` and a position-layout
summary kernel, merged by log-sum-exp inside one custom_vjp.

Causal routed attention (paper eq. 12, `combiner.routed`) has two halves living in two orders:

  slot layout      tokens sorted by (chunk, padding, position), one frame row per chunk of w. Query i
                   attends its own chunk's real tokens at positions <= i (rule "le" in this order), and the
                   pass builds every chunk's prefix states ("upto": slot t pools the chunk's real slots 0..t,
                   its value the pooled query's softmax over them): one partial softmax per query;
  position layout  positions in blocks of w. Query i sees every other chunk r in the state ended by r's last
                   real token at a position <= i: a block-start "base" state of r (one per block and chunk,
                   gathered from the prefix states) unless a token of r inside the block at or before i
                   advanced it, then the state that token ended (one per position). `_summary_forward` runs
                   that softmax over [base states of the block ; states of the block's tokens], its masks
                   built in the kernel from the block's chunk ids, and merges the slot pass's partial.

Gradients come from the final log-sum-exp: the summary kernel's backward gives dq and the states'
gradients, which flow back to slot layout (a scatter-add of the base states', a permutation of the
per-token ones) into the slot pass's backward (its own-chunk attention and the prefix states'
construction). Between forward and backward the output, its log-sum-exp and the prefix states are kept; the
backward gathers from them again (in one program with its forward, XLA shares those gathers).
Padded query rows are don't-care (they see every base state), as the op contract allows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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


def _summary_backward(b: Array, R: dict, g: Array, head: Array, *, f: Frame, bank: int) -> None:
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
  for j in range(n):
    R["dku"][j * t:(j + 1) * t, :] = dku[j].astype(R["dku"].dtype)
    R["dvu"][j * t:(j + 1) * t, :] = dvu[j].astype(R["dvu"].dtype)
  R["dkb"][...] = dkb.astype(R["dkb"].dtype)
  R["dvb"][...] = dvb.astype(R["dvb"].dtype)


_TOK = ("q", "ku", "vu", "o_ext", "do", "o_fin", "o", "dq", "dku", "dvu")
_HEADS = ("lse_ext", "lse", "lse_fin", "cid", "bvalid", "kb", "vb", "dkb", "dvb")


def _summary_call(plan: _Plan, program, args: dict[str, Array], outs: dict[str, Any], name: str) -> dict:
  """One call of a summary kernel over the position frame's blocks. outs: name -> dtype."""
  f, bank = plan.blocks, plan.bank
  bh = f.batch * f.heads
  dims = {"q": f.d, "ku": f.d, "vu": f.dv, "o_ext": f.dv, "do": f.dv, "o_fin": f.dv, "o": f.dv, "dq": f.d,
          "dku": f.d, "dvu": f.dv, "kb": f.d, "vb": f.dv, "dkb": f.d, "dvb": f.dv}

  def spec(n: str):
    if n in ("lse_ext", "lse", "lse_fin", "cid"):
      return frames.head_spec(f, (None, 1, f.cols), lambda g: (g, 0, 0))
    if n == "bvalid":
      return frames.head_spec(f, (None, 1, bank), lambda g: (g, 0, 0))
    if n in ("kb", "vb", "dkb", "dvb"):
      return frames.head_spec(f, (None, bank, dims[n]), lambda g: (g, 0, 0))
    return frames.tok_spec(f, _ROWS, dims[n])

  def shape(n: str, dtype: Any):
    if n == "lse":
      return jax.ShapeDtypeStruct((bh, f.rows, 1, f.cols), F32)
    if n in ("dkb", "dvb"):
      return jax.ShapeDtypeStruct((bh, f.rows, bank, dims[n]), dtype)
    return frames.tok_shape(f, _ROWS, dims[n], dtype)

  ins = list(args)
  return frames.call_kernel(
      f, functools.partial(program, f=f, bank=bank), name, f.rows, ins, [spec(n) for n in ins],
      [args[n] for n in ins], list(outs), [spec(n) for n in outs], [shape(n, dt) for n, dt in outs.items()],
      tok=_TOK, heads=_HEADS, glen=f.cols)


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
  state (a position frame array) and the base states per block [BH, blocks, bank, dim]."""
  fs, fb = plan.slots, plan.blocks
  out = {}
  for name, x, dim in (("k", kbar, fs.d), ("v", vt, fs.dv)):
    out[name + "u"] = kernel_plans.to_frame(_to_positions(plan, a, x, dim), fb)
    base = _gather(x.reshape(-1, dim), a["base_rows"], (fb.batch * fb.heads, fb.rows, fs.rows, dim))
    out[name + "b"] = jnp.pad(base, ((0, 0), (0, 0), (0, plan.bank - fs.rows), (0, 0)))
  return out


def _forward(plan: _Plan, a: dict):
  """(output [batch, length, heads, dv], (its log-sum-exp [BH, blocks, 1, cols] in the position frame, the
  prefix states' keys and values: slot frame arrays))."""
  fs, fb = plan.slots, plan.blocks
  kdt = a["q"].dtype
  sa = _slot_arrays(plan, a)
  s = passes.forward(fs, plan.spans, sa, out_dtype=kdt, tok_dtype=kdt, name="combiner_routed_spans")
  st = _states(plan, a, s["kbar_tok"], s["vt_tok"])
  args = {"q": kernel_plans.to_frame(a["q"], fb), **st,
          "o_ext": kernel_plans.to_frame(_to_positions(plan, a, s["o"], fs.dv), fb),
          "lse_ext": _row_frame(_gather(s["lse"], a["lse_rows"], (fb.batch * fb.heads, fb.length), True), fb),
          "cid": a["cid"], "bvalid": a["bvalid"]}
  m = _summary_call(plan, _summary_forward, args, {"o": plan.out_dtype, "lse": F32},
                    "combiner_routed_summaries_fwd")
  return kernel_plans.from_frame(m["o"], fb, fb.dv), (m["lse"], s["kbar_tok"], s["vt_tok"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run(plan: _Plan, a: dict) -> Array:
  return _forward(plan, a)[0]


def _run_fwd(plan: _Plan, a: dict):
  out, res = _forward(plan, a)
  return out, (a, out, *res)


def _run_bwd(plan: _Plan, residuals: tuple, do: Array):
  a, out, lse, kbar, vt = residuals
  fs, fb = plan.slots, plan.blocks
  sa = _slot_arrays(plan, a)
  st = _states(plan, a, kbar, vt)
  args = {"q": kernel_plans.to_frame(a["q"], fb), **st, "cid": a["cid"], "bvalid": a["bvalid"],
          "do": kernel_plans.to_frame(do, fb), "o_fin": kernel_plans.to_frame(out, fb), "lse_fin": lse}
  # The states' gradients in the inputs' dtype (each one float32 sum, rounded once): float32 only for the
  # sum over the blocks sharing a block-start state, which halves the largest temporaries.
  outs = {n: a["q"].dtype for n in ("dq", "dku", "dvu", "dkb", "dvb")}
  m = _summary_call(plan, _summary_backward, args, outs, "combiner_routed_summaries_bwd")

  def state_grads(tok: Array, bank: Array, dim: int) -> Array:  # -> the prefix states' gradients (f32)
    x = _to_slots(plan, a, kernel_plans.from_frame(tok, fb, dim)).astype(F32)
    bank = bank[:, :, :fs.rows].reshape(-1, dim).astype(F32)
    return _scatter_add(x.reshape(-1, dim), a["base_rows"], bank).reshape(x.shape)

  lse_slots = _row_frame(_gather(lse, a["lse_slot_rows"], (fs.batch * fs.heads, fs.length), True), fs)
  g = passes.backward(fs, plan.spans, {
      **sa, "do": _to_slots(plan, a, do), "o_fin": _to_slots(plan, a, out), "lse_fin": lse_slots,
      "dkbar_tok": state_grads(m["dku"], m["dkb"], fs.d), "dvt_tok": state_grads(m["dvu"], m["dvb"], fs.dv),
      "dq_in": _to_slots(plan, a, kernel_plans.from_frame(m["dq"], fb, fb.d))},
      dtypes=kernel_plans.grad_dtypes(a), name="combiner_routed_spans")
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
  slots_n = chunks * cols
  bh_major = bh[:, 0, :]  # [b, h]
  return {
      "slot_rows": ((b_ix * length + to_slot) * heads + h_ix).reshape(-1, 1),
      "pos_rows": ((b_ix * slots_n + frame_at) * heads + h_ix).reshape(-1, 1),
      "base_rows": ((b_ix[:, :, :, None] * slots_n + base_at) * heads
                    + np.arange(heads, dtype=np.int32)[None, :, None, None]).reshape(-1, 1),
      "lse_rows": (bh_major[:, :, None] * slots_n + frame_at.transpose(0, 2, 1)).reshape(-1, 1),
      "lse_slot_rows": (bh_major[:, :, None] * (fb.rows * fb.cols)
                        + ((to_slot // w) * fb.cols + to_slot % w).transpose(0, 2, 1)).reshape(-1, 1),
      "cid": _row_frame(jnp.where(real[:, :, None], chunk, -1).transpose(0, 2, 1).reshape(batch * heads, -1),
                        fb, fill=-1),
      "bvalid": jnp.pad((before > 0).astype(F32), ((0, 0), (0, 0), (0, 0), (0, plan.bank - chunks))).reshape(
          batch * heads, chunks, 1, plan.bank),
  }
