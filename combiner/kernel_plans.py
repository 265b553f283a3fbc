"""The Combiner plans and their sparse counterparts on the kernel of `combiner.passes`.

Each plan is a short sequence of passes over a frame of the sequence (rows of `cols` positions), forward and
backward inside one custom_vjp, so every pass's gradients come from the plan's final log-sum-exp and no
partial output is differentiated on its own:

  fixed      frame rows = blocks. A rows pass builds one summary per block ("block"; sparse: "last"), a
             rows pass attends the own block and the summaries of other blocks.
  axial      frame rows = grid rows. vertical: a column pass builds the per-position column spans ("prefix";
             bidirectional "all_but_one") and attends the own column, a row pass attends the own row and the
             spans and merges the column part. horizontal: a row pass builds the row spans ("all_but_one")
             and attends the own row, a column pass attends the own column and the spans. rowmajor: a row
             pass builds each position's in-row expectation ("own") and attends the own row, a column pass
             attends the pooled rows. Sparse axial: own row, then own column.
  mixture    joint: column pass (vertical spans), row pass (own row, vertical spans, horizontal spans built),
             column pass (own column, horizontal spans); its row pass's backward runs in two parts (own row
             and horizontal construction, then the vertical spans) so the two summary families are never
             held together; mean: the vertical and horizontal plans averaged, their backwards adding to the
             same gradients.

The axial plans keep only their output and log-sum-exp for the backward: the per-position span summaries
(as large as the keys and values) are built again there by the passes that built them, construction only, so
a layer holds as little as dense attention between its forward and backward. Frame arrays keep the op
contract's layout (`combiner.frames`). Masks become per-view validity rows; without a mask validity is
computed from positions inside the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from attention_core import contract
from combiner import dyadic_kernels, frames, passes, selected_kernels
from combiner.frames import Construct, Frame, Pass

Array = Any
F32 = jnp.float32


def packs_heads(platform: str) -> bool:
  """Heads-packed frames on GPUs (Triton reads strided tiles); head-major copies elsewhere (Mosaic wants a
  block's last two dims whole or (8, 128)-aligned)."""
  return platform == "gpu"


def partial_banks(platform: str) -> bool:
  """Gradients of rows shared by all groups as per-group partial sums where programs run concurrently
  (GPUs); TPU cores and the interpreter accumulate them in place."""
  return platform == "gpu"


def frame_cols(span: int, platform: str) -> int:
  """A frame row's length for a real row length `span`: a power of two (at least 8; 16 on TPU, for
  bfloat16 sublane packing, and on GPUs, for Triton's dots) up to the tile cap, whole tiles beyond it (GPUs:
  always a power of two, as Triton's blocks are)."""
  floor = 8 if platform == "cpu" else 16
  cap = frames.TILE
  n = floor
  while n < span and (n < cap or platform == "gpu"):
    n *= 2
  return n if n >= span else -(-span // cap) * cap


def frame_rows(rows: int, platform: str) -> int:
  """Rows of a frame whose columns are read as groups (axial): a power of two on GPUs, whole tiles beyond
  the tile cap elsewhere (a column is one block of all rows)."""
  if platform == "gpu":
    n = 1
    while n < rows:
      n *= 2
    return n
  return rows if rows <= frames.TILE else -(-rows // frames.TILE) * frames.TILE


# ----------------------------------------------------------------------------------------------- layout

def to_frame(x: Array, f: Frame) -> Array:
  """[batch, length, heads, dim] -> the frame array [batch, rows * cols, heads, dim] (heads-packed frames:
  [batch, rows * cols, heads * dim]); the contract's array itself when no padding is needed."""
  b, length, h, dim = x.shape
  total = f.rows * f.span
  if total != length:
    x = jnp.pad(x, ((0, 0), (0, total - length), (0, 0), (0, 0)))
  if f.cols != f.span:
    x = jnp.pad(x.reshape(b, f.rows, f.span, h, dim), ((0, 0), (0, 0), (0, f.cols - f.span), (0, 0), (0, 0)))
  x = x.reshape(b, f.rows * f.cols, h, dim)
  return x.reshape(b, f.rows * f.cols, h * dim) if f.packed else x


def from_frame(y: Array, f: Frame, dim: int) -> Array:
  """The inverse of `to_frame`: [batch, length, heads, dim]."""
  y = y.reshape(f.batch, f.rows, f.cols, f.heads, dim)
  if f.cols != f.span:
    y = y[:, :, :f.span]
  y = y.reshape(f.batch, f.rows * f.span, f.heads, dim)
  return y if y.shape[1] == f.length else y[:, :f.length]


def reorder_lse(lse: Array, f: Frame) -> Array:
  """[BH, groups, 1, glen] of one view -> the other view's [BH, glen, 1, groups]."""
  return jnp.swapaxes(lse[:, :, 0], 1, 2)[:, :, None]


def mask_frame(mask: Array, f: Frame) -> Array:
  """[batch, length] bool -> [batch, rows, cols] (padding False)."""
  b, length = mask.shape
  m = jnp.pad(mask, ((0, 0), (0, f.rows * f.span - length))).reshape(b, f.rows, f.span)
  return jnp.pad(m, ((0, 0), (0, 0), (0, f.cols - f.span)))


def view_rows(x: Array, view: str) -> Array:
  """[batch, rows, cols] -> per-group validity rows [batch, groups, 1, glen] (f32) of a view."""
  x = x if view == "rows" else jnp.swapaxes(x, 1, 2)
  return x.astype(F32)[:, :, None, :]


# -------------------------------------------------------------------------------------------- the plans

@dataclasses.dataclass(frozen=True)
class Plan:
  """A plan's static description: its frame and passes (forward order) and how they are wired."""

  frame: Frame
  name: str
  passes: tuple[Pass, ...]
  pooling: str | None
  causal: bool
  pools: bool  # DeepSets pools given
  out_dtype: Any
  select: int = 0  # fixed with selected spans: spans per query attended exactly


def kernel_dtype(q: Array, k: Array, v: Array) -> Any:
  dt = jnp.result_type(q.dtype, k.dtype, v.dtype)
  return dt if jnp.dtype(dt).itemsize < 4 else F32


def make_frame(q: Array, v: Array, mask: Array | None, span: int, rows: int, platform: str) -> Frame:
  b, length, h, d = q.shape
  return Frame(batch=b, heads=h, length=length, rows=rows, cols=frame_cols(span, platform), span=span, d=d,
               dv=v.shape[-1], scale=contract.logit_scale(d), packed=packs_heads(platform),
               platform=platform, masked=mask is not None, partial_banks=partial_banks(platform))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run(plan: Plan, arrays: dict) -> Array:
  return _FORWARD[plan.name](plan, arrays)[0]


def _run_fwd(plan: Plan, arrays: dict):
  out, res = _FORWARD[plan.name](plan, arrays)
  return out, (arrays, res)


def _run_bwd(plan: Plan, residual: tuple, do: Array):
  arrays, res = residual
  grads = _BACKWARD[plan.name](plan, arrays, res, do)
  return ({n: grads.get(n) for n in arrays},)


_run.defvjp(_run_fwd, _run_bwd)


# A plan over a permutation of each head's tokens (the bidirectional routed plan's rank order), gathered
# inside the custom_vjp: the permutation's transpose is the inverse permutation, so the cotangents move by
# gathers too (autodiff of a gather is a scatter-add, on TPU a sort and several passes), the backward's
# gathers of q, k and v are the forward's (XLA shares them) and none clamps its indices.

def _permuted(x: Array, order: Array) -> Array:
  """x [batch, length, heads, dim] with row i of each head taken from row order[b, i, h]."""
  return jnp.take_along_axis(x, order[..., None], axis=1, mode="promise_in_bounds")


def _ordered_frames(plan: Plan, raw: dict, extra: dict, order: Array) -> dict:
  return {**{n: to_frame(_permuted(x, order), plan.frame) for n, x in raw.items()}, **extra}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run_ordered(plan: Plan, raw: dict, extra: dict, order: Array, inverse: Array) -> Array:
  return _run_ordered_fwd(plan, raw, extra, order, inverse)[0]


def _run_ordered_fwd(plan: Plan, raw: dict, extra: dict, order: Array, inverse: Array):
  f = plan.frame
  out, res = _FORWARD[plan.name](plan, _ordered_frames(plan, raw, extra, order))
  return _permuted(from_frame(out, f, f.dv), inverse), (raw, extra, order, inverse, res)


def _run_ordered_bwd(plan: Plan, residual: tuple, do: Array):
  raw, extra, order, inverse, res = residual
  f = plan.frame
  a = _ordered_frames(plan, raw, extra, order)
  do = to_frame(_permuted(do, order), f)
  if plan.name == "fixed":  # the cotangent in that order and the output there are this backward's own
    grads = _fixed_backward(plan, a, res, do, over={"do": "dk", "o_fin": "dv"})
  else:
    grads = _BACKWARD[plan.name](plan, a, res, do)
  dims = {n: x.shape[-1] for n, x in raw.items()}
  return ({n: _permuted(from_frame(grads[n], f, dims[n]), inverse) for n in raw}, None, None, None)


_run_ordered.defvjp(_run_ordered_fwd, _run_ordered_bwd)


def grad_dtypes(arrays: dict) -> dict[str, Any]:
  """Gradient dtypes: each input's own."""
  out = {"dq": arrays["q"].dtype, "dk": arrays["k"].dtype, "dv": arrays["v"].dtype}
  if "pool_q" in arrays:
    out.update(dpq=arrays["pool_q"].dtype, dpk=arrays["pool_k"].dtype)
  return out


def _common(arrays: dict, names: tuple[str, ...]) -> dict[str, Array]:
  return {n: arrays[n] for n in names if n in arrays}


def _bank_total(f: Frame, x: Array) -> Array:
  """A bank gradient as one [BH, n, 1, dim] array (partial sums over groups summed where they were kept)."""
  return x if frames.accumulates_banks(f) else jnp.sum(x, axis=1)


# ------------------------------------------------------------------------------------------------ fixed

def _fixed_forward(plan: Plan, a: dict):
  f, (spans, main) = plan.frame, plan.passes
  kdt = a["q"].dtype
  s = passes.forward(f, spans, _common(a, ("q", "k", "v", "pool_q", "pool_k", "mask")), out_dtype=kdt,
                     tok_dtype=kdt, name="combiner_spans")
  m = passes.forward(f, main, {**_common(a, ("q", "k", "v", "mask", "bank_valid")), "bk": s["kbar_row"],
                               "bv": s["vt_row"]}, out_dtype=plan.out_dtype, tok_dtype=kdt,
                     bank_rows=f.rows, name="combiner_main")
  return m["o"], (s["kbar_row"], s["vt_row"], m["o"], m["lse"])


def _fixed_backward(plan: Plan, a: dict, res: tuple, do: Array, over: dict[str, str] | None = None) -> dict:
  """over: the main pass's gradients written over its inputs (`passes.backward`)."""
  f, (spans, main) = plan.frame, plan.passes
  kbar, vt, o, lse = res
  dt = grad_dtypes(a)
  m = passes.backward(f, main, {**_common(a, ("q", "k", "v", "mask", "bank_valid")), "bk": kbar, "bv": vt,
                                "do": do, "o_fin": o, "lse_fin": lse}, dtypes=dt, bank_rows=f.rows,
                      name="combiner_main", over=over)
  s = passes.backward(f, spans, {**_common(a, ("q", "k", "v", "pool_q", "pool_k", "mask")),
                                 "dkbar_row": _bank_total(f, m["dbk"]), "dvt_row": _bank_total(f, m["dbv"]),
                                 "dq_in": m["dq"], "dk_in": m["dk"], "dv_in": m["dv"]},
                      dtypes=dt, name="combiner_spans")
  return {"q": s["dq"], "k": s["dk"], "v": s["dv"], "pool_q": s.get("dpq"), "pool_k": s.get("dpk")}


# ------------------------------------------------------------------------------------- fixed + selected

def _selected_frames(a: dict) -> dict[str, Array]:
  """The frame arrays the selected-spans kernels read whole (the chosen blocks)."""
  return {**a, "k_all": a["k"], "v_all": a["v"]}


def _selected_forward(plan: Plan, a: dict):
  f, (spans, _) = plan.frame, plan.passes
  kdt = a["q"].dtype
  s = passes.forward(f, spans, _common(a, ("q", "k", "v", "pool_q", "pool_k", "mask")), out_dtype=kdt,
                     tok_dtype=kdt, name="combiner_spans")
  bank = (s["kbar_row"], s["vt_row"])
  m = selected_kernels.main_forward(f, _selected_frames(a), bank, plan.out_dtype, plan.causal, plan.select)
  return m["o"], (bank, m)


def _selected_backward(plan: Plan, a: dict, res: tuple, do: Array) -> dict:
  f, (spans, _) = plan.frame, plan.passes
  bank, m = res
  b = selected_kernels.main_backward(f, _selected_frames(a), bank, m, do, plan.causal, plan.select)
  k = selected_kernels.keys_backward(f, a, m, b, do, plan.causal, plan.select)
  s = passes.backward(f, spans, {**_common(a, ("q", "k", "v", "pool_q", "pool_k", "mask")),
                                 "dkbar_row": _bank_total(f, b["dbk"]), "dvt_row": _bank_total(f, b["dbv"]),
                                 "dq_in": b["dq"], "dk_in": k["dk"], "dv_in": k["dv"]},
                      dtypes=grad_dtypes(a), name="combiner_spans")
  return {"q": s["dq"], "k": s["dk"], "v": s["dv"], "pool_q": s.get("dpq"), "pool_k": s.get("dpk")}


def inputs(q: Array, k: Array, v: Array, pool_q: Array | None, pool_k: Array | None,
           kdt: Any) -> dict[str, Array]:
  """A plan's token arrays by name, in the op contract's layout: q, k, v in the kernels' dtype `kdt`
  (`kernel_dtype`), the DeepSets pools (when given) as they are."""
  a = {"q": q.astype(kdt), "k": k.astype(kdt), "v": v.astype(kdt)}
  if pool_q is not None:
    a["pool_q"], a["pool_k"] = pool_q, pool_k
  return a


def _arrays(f: Frame, q: Array, k: Array, v: Array, pool_q: Array | None, pool_k: Array | None,
            kdt: Any) -> dict[str, Array]:
  return {n: to_frame(x, f) for n, x in inputs(q, k, v, pool_q, pool_k, kdt).items()}


def fixed(q: Array, k: Array, v: Array, mask: Array | None, pool_q: Array | None, pool_k: Array | None, *,
          size: int, causal: bool, pooling: str | None, platform: str, select: int = 0,
          order: tuple[Array, Array] | None = None) -> Array:
  """Combiner-Fixed (pooling "max" | "mean"), Sparse-Fixed (pooling None) or Combiner-Fixed with each
  query's `select` best spans attended exactly (`combiner.selected_kernels`) on the kernels.
  q, k: [batch, length, heads, head_dim]; v: [..., value_dim] -> [batch, length, heads, value_dim].
  order: (order, inverse) int [batch, length, heads], a permutation of each head's tokens and its inverse:
  the plan runs over the tokens in that order (row i of a head is token order[b, i, h]; mask, when given,
  is in that order) and the output comes back in the tokens' own order."""
  rows = -(-q.shape[1] // size)
  f = make_frame(q, v, mask, size, rows, platform)
  pools = pool_q is not None
  kind = "last" if pooling is None else "block"
  spans = Pass("rows", construct=Construct(kind, pooling or "max", "all", pools=pools), attend=False)
  main = Pass("rows", own="le" if causal else "all", bank="lt" if causal else "ne", bank_last=pooling is None)
  name = "fixed_select" if select else "fixed"
  plan = Plan(f, name, (spans, main), pooling, causal, pools, jnp.dtype(v.dtype), min(select, rows))
  extra = {}
  if mask is not None:
    mf = mask_frame(mask, f)
    extra["mask"] = view_rows(mf, "rows")
    ok = mf[:, :, f.span - 1] if pooling is None else jnp.any(mf, axis=2)
    extra["bank_valid"] = ok.astype(F32)[:, None, :]
  kdt = kernel_dtype(q, k, v)
  if order is not None:
    return _run_ordered(plan, inputs(q, k, v, pool_q, pool_k, kdt), extra, *order)
  return from_frame(_run(plan, {**_arrays(f, q, k, v, pool_q, pool_k, kdt), **extra}), f, f.dv)


# ------------------------------------------------------------------------------------------------ axial

_INPUTS = ("q", "k", "v", "pool_q", "pool_k")


def _view_args(a: dict, view: str, extra: bool = False) -> dict[str, Array]:
  """The plan's inputs a pass reads: the frame arrays (both views read the same ones) and the validity rows
  of its view ("_c": the column view's), where the plan is masked."""
  out = {n: a[n] for n in _INPUTS if n in a}
  suffix = "_c" if view == "cols" else ""
  for n in ("mask",) + (("extra_valid",) if extra else ()):
    if n + suffix in a:
      out[n] = a[n + suffix]
  return out


def _axial_forward(plan: Plan, a: dict):
  """Forward passes: vertical (columns, then rows), horizontal and rowmajor (rows, then columns), sparse
  axial (rows, columns), joint mixture (columns, rows, columns); the last pass's output is final. Residuals:
  the output and its log-sum-exp (and rowmajor's per-row keys)."""
  f, ps = plan.frame, plan.passes
  kdt = a["q"].dtype
  fwd = functools.partial(passes.forward, f, tok_dtype=kdt, out_dtype=plan.out_dtype)
  vertical = None
  if plan.name in ("vertical", "mixture_joint"):
    vertical = fwd(ps[0], _view_args(a, "cols"), name="combiner_columns")
    if plan.name == "vertical":
      r = fwd(ps[1], {**_view_args(a, "rows", extra=True), "xk": vertical["kbar_tok"],
                      "xv": vertical["vt_tok"], "o_ext": vertical["o"],
                      "lse_ext": reorder_lse(vertical["lse"], f)}, name="combiner_rows")
      return r["o"], {"o": r["o"], "lse": r["lse"]}
  row_pass, col_pass = (ps[1], ps[2]) if plan.name == "mixture_joint" else ps
  row_args = _view_args(a, "rows", extra=plan.name == "mixture_joint")
  if vertical is not None:
    row_args.update(xk=vertical["kbar_tok"], xv=vertical["vt_tok"])
  r = fwd(row_pass, {**row_args, **_common(a, ("kbar_in",))}, name="combiner_rows")
  col_args = {**_view_args(a, "cols", extra=True), "o_ext": r["o"], "lse_ext": reorder_lse(r["lse"], f)}
  res = {}
  if plan.name in ("horizontal", "mixture_joint"):
    col_args.update(xk=r["kbar_tok"], xv=r["vt_tok"])
  elif plan.name == "rowmajor":
    res["kbar_rows"] = a["kbar_in"] if "kbar_in" in a else r["kbar_row"]
    col_args.update(xk_bank=res["kbar_rows"], xv=r["vt_tok"])
  c = fwd(col_pass, col_args, name="combiner_columns")
  return c["o"], {**res, "o": c["o"], "lse": c["lse"]}


def _rebuilt(plan: Plan, a: dict, p: Pass, after: Any) -> dict[str, Array]:
  """The span summaries pass p built in the forward, built again (its construction alone) once `after` is
  computed (an optimization barrier: else XLA may build them early and keep them as long as before)."""
  only = dataclasses.replace(p, own=None, extra=None, bank=None, ext=False, attend=False)
  args = {**_view_args(a, p.view), **_common(a, ("kbar_in",))}
  args, _ = jax.lax.optimization_barrier((args, after))
  return passes.forward(plan.frame, only, args, tok_dtype=a["q"].dtype, out_dtype=plan.out_dtype,
                        name="combiner_rebuild")


_GRADS = {"q": "dq", "k": "dk", "v": "dv", "pool_q": "dpq", "pool_k": "dpk"}


def _carry(out: dict) -> dict[str, Array]:
  """A backward pass's gradients as the next one's in-place inputs."""
  return {g + "_in": out[g] for g in _GRADS.values() if g in out}


def _pool_carry(carry: dict) -> dict[str, Array]:
  """The DeepSets pools' gradients of `carry`, for the pass that builds summaries (the first pass of a plan's
  backward reads no pools)."""
  return {n: x for n, x in carry.items() if n in ("dpq_in", "dpk_in")}


def _axial_backward(plan: Plan, a: dict, res: dict, do: Array, carry: dict | None = None) -> dict:
  """The passes in reverse, each adding to dq, dk, dv (and DeepSets pools) in place (starting from `carry`,
  the gradients of another plan, where given), from the plan's final log-sum-exp (`lse_fin`, in each pass's
  view). The per-position summaries a backward pass reads are rebuilt just before it (`_rebuilt`)."""
  f, ps = plan.frame, plan.passes
  dt = grad_dtypes(a)
  tok_dt = {**dt, "dxk": a["q"].dtype, "dxv": a["q"].dtype}
  bwd = functools.partial(passes.backward, f, dtypes=tok_dt)
  carry = carry or {}
  last_view = "rows" if plan.name == "vertical" else "cols"
  lse = {last_view: res["lse"], ("cols" if last_view == "rows" else "rows"): reorder_lse(res["lse"], f)}
  fin = {"do": do, "o_fin": res["o"]}
  if plan.name == "vertical":
    col, row = ps
    v = _rebuilt(plan, a, col, (fin, carry))
    r = bwd(row, {**_view_args(a, "rows", extra=True), "xk": v["kbar_tok"], "xv": v["vt_tok"], **fin,
                  "lse_fin": lse["rows"], **carry}, name="combiner_rows")
    g = bwd(col, {**_view_args(a, "cols"), **fin, "lse_fin": lse["cols"], "dkbar_tok": r["dxk"],
                  "dvt_tok": r["dxv"], **_pool_carry(carry), **_carry(r)}, name="combiner_columns")
    return {n: g[d] for n, d in _GRADS.items() if d in g}
  row_pass, col_pass = (ps[1], ps[2]) if plan.name == "mixture_joint" else ps
  col_args = {**_view_args(a, "cols", extra=True), **fin, "lse_fin": lse["cols"], **carry}
  if plan.name in ("horizontal", "mixture_joint"):
    h = _rebuilt(plan, a, row_pass, (fin, carry))
    col_args.update(xk=h["kbar_tok"], xv=h["vt_tok"])
  elif plan.name == "rowmajor":
    col_args.update(xk_bank=res["kbar_rows"], xv=_rebuilt(plan, a, row_pass, (fin, carry))["vt_tok"])
  c = bwd(col_pass, col_args, bank_rows=f.rows, name="combiner_columns")
  row_args = {**_view_args(a, "rows", extra=plan.name == "mixture_joint"), **fin, "lse_fin": lse["rows"],
              **_common(a, ("kbar_in",)), **_pool_carry(carry), **_carry(c)}
  if plan.name in ("horizontal", "mixture_joint"):
    row_args.update(dkbar_tok=c["dxk"], dvt_tok=c["dxv"])
  elif plan.name == "rowmajor":
    row_args.update(dkbar_row=_bank_total(f, c["dxk_bank"]), dvt_tok=c["dxv"])
  if plan.name == "mixture_joint":
    # The row pass's backward in two (each part's gradients need only the final lse and o): its own row and
    # the horizontal spans' construction, which reads their gradients; then the vertical spans, rebuilt only
    # now, so the two families of per-position arrays are never held together.
    own = bwd(dataclasses.replace(row_pass, extra=None), row_args, name="combiner_rows")
    v = _rebuilt(plan, a, ps[0], _carry(own))
    g = bwd(dataclasses.replace(row_pass, own=None, construct=None),
            {**row_args, "xk": v["kbar_tok"], "xv": v["vt_tok"], **_carry(own)}, name="combiner_rows")
    # the vertical spans' construction, by columns (the DeepSets pools' gradients so far from `own`)
    g = bwd(ps[0], {**_view_args(a, "cols"), "dkbar_tok": g["dxk"], "dvt_tok": g["dxv"], **_carry(own),
                    **_carry(g)}, name="combiner_columns")
  else:
    g = bwd(row_pass, row_args, name="combiner_rows")
  grads = {n: g[d] for n, d in _GRADS.items() if d in g}
  if plan.name == "rowmajor" and "kbar_in" in a:
    grads["kbar_in"] = _bank_total(f, c["dxk_bank"])
  return grads


def _halves(plan: Plan) -> tuple[Plan, Plan]:
  """The mean mixture's vertical and horizontal plans (on its frame: output weight 1/2 each)."""
  return (dataclasses.replace(plan, name="vertical", passes=plan.passes[:2]),
          dataclasses.replace(plan, name="horizontal", passes=plan.passes[2:]))


def _mixture_forward(plan: Plan, a: dict):
  (vertical, horizontal), wide = _halves(plan), plan.out_dtype
  o_v, res_v = _axial_forward(vertical, a)
  o_h, res_h = _axial_forward(horizontal, a)
  out = (0.5 * (o_v.astype(F32) + o_h.astype(F32))).astype(wide)
  return out, (res_v, res_h)


def _mixture_backward(plan: Plan, a: dict, res: tuple, do: Array) -> dict:
  """The horizontal plan's backward, then the vertical plan's adding to the same gradients in place."""
  vertical, horizontal = _halves(plan)
  g = _axial_backward(horizontal, a, res[1], do)
  return _axial_backward(vertical, a, res[0], do, carry={_GRADS[n] + "_in": x for n, x in g.items()
                                                          if x is not None})


_FORWARD = {"fixed": _fixed_forward, "fixed_select": _selected_forward, "vertical": _axial_forward,
            "horizontal": _axial_forward, "rowmajor": _axial_forward, "sparse_axial": _axial_forward,
            "mixture_joint": _axial_forward, "mixture": _mixture_forward}
_BACKWARD = {"fixed": _fixed_backward, "fixed_select": _selected_backward, "vertical": _axial_backward,
             "horizontal": _axial_backward, "rowmajor": _axial_backward, "sparse_axial": _axial_backward,
             "mixture_joint": _axial_backward, "mixture": _mixture_backward}


def _axial_passes(name: str, causal: bool, pooling: str, pools: bool, given_keys: bool) -> tuple[Pass, ...]:
  """The forward passes of an axial plan (see the module docstring)."""
  row_own, col_own = ("le", "lt") if causal else ("all", "ne")
  col_kind = "prefix" if causal else "all_but_one"
  vertical = Construct(col_kind, pooling, col_own, pools=pools)
  horizontal = Construct("all_but_one", pooling, "ne", pools=pools)
  v_count = "vertical_causal" if causal else "vertical"
  if name == "vertical":
    return (Pass("cols", own=col_own, construct=vertical, final=False),
            Pass("rows", own=row_own, extra="ne", extra_count=v_count, ext=True))
  if name == "horizontal":
    return (Pass("rows", own=row_own, construct=horizontal, final=False),
            Pass("cols", own=col_own, extra=col_own, extra_count="horizontal", ext=True))
  if name == "rowmajor":
    own = Construct("own", pooling, "all", pools=pools, given_keys=given_keys)
    return (Pass("rows", own=row_own, construct=own, final=False),
            Pass("cols", extra=col_own, extra_bank_keys=True, extra_count="rows", ext=True))
  if name == "sparse_axial":
    return (Pass("rows", own=row_own, final=False), Pass("cols", own=col_own, ext=True))
  return (Pass("cols", construct=vertical, attend=False),  # mixture_joint
          Pass("rows", own=row_own, extra="ne", extra_count=v_count, construct=horizontal, final=False),
          Pass("cols", own=col_own, extra=col_own, extra_count="horizontal", ext=True))


def _validity(name: str, mf: Array, causal: bool) -> dict[str, Array]:
  """Per-view validity rows of a masked axial plan: the tokens', and the `extra` summaries' nonempty-ness."""
  out = {"mask": view_rows(mf, "rows"), "mask_c": view_rows(mf, "cols")}
  m = mf.astype(jnp.int32)
  if name in ("vertical", "mixture_joint"):  # column e's rows before r (causal) or other than r
    below = jnp.cumsum(m, axis=1) - m
    per_col = jnp.sum(m, axis=1, keepdims=True) - m
    out["extra_valid"] = view_rows((below if causal else per_col) > 0, "rows")
  if name in ("horizontal", "mixture_joint"):  # row s without column c
    out["extra_valid_c"] = view_rows((jnp.sum(m, axis=2, keepdims=True) - m) > 0, "cols")
  if name == "rowmajor":
    out["extra_valid_c"] = view_rows(jnp.broadcast_to(jnp.any(mf, axis=2, keepdims=True), mf.shape), "cols")
  return out


def axial(q: Array, k: Array, v: Array, mask: Array | None, pool_q: Array | None, pool_k: Array | None, *,
          row_length: int, direction: str | None, causal: bool, pooling: str, platform: str,
          kbar: Array | None = None, normalize: str = "mean") -> Array:
  """Combiner-Axial in `direction` ("rowmajor" | "vertical" | "horizontal"), Sparse-Axial (None) or
  Combiner-Mixture (direction "mixture", `normalize` "mean" | "joint") on the kernels.
  q, k: [batch, length, heads, head_dim]; v: [..., value_dim] -> [batch, length, heads, value_dim].
  kbar (rowmajor): the span keys [batch, rows, heads, head_dim] to use instead of the pooled rows."""
  name = {"mixture": "mixture_joint" if normalize == "joint" else "mixture", None: "sparse_axial"}.get(
      direction, direction)
  rows = frame_rows(-(-q.shape[1] // row_length), platform)
  f = make_frame(q, v, mask, row_length, rows, platform)
  pools = pool_q is not None
  if name == "mixture":  # the vertical plan's passes, then the horizontal plan's: each half of the output
    f = dataclasses.replace(f, out_weight=0.5)
    ps = tuple(p for half in ("vertical", "horizontal")
               for p in _axial_passes(half, causal, pooling, pools, False))
  else:
    ps = _axial_passes(name, causal, pooling, pools, kbar is not None)
  plan = Plan(f, name, ps, pooling, causal, pools, jnp.dtype(v.dtype))
  a = _arrays(f, q, k, v, pool_q, pool_k, kernel_dtype(q, k, v))
  if mask is not None:
    for half in (("vertical", "horizontal") if name == "mixture" else (name,)):
      a.update(_validity(half, mask_frame(mask, f), causal))
  if kbar is not None:  # [batch, rows, heads, d] -> [BH, frame rows, 1, d]
    kb = jnp.pad(kbar, ((0, 0), (0, f.rows - kbar.shape[1]), (0, 0), (0, 0)))
    a["kbar_in"] = jnp.swapaxes(kb, 1, 2).reshape(f.batch * f.heads, f.rows, 1, f.d).astype(F32)
  return from_frame(_run(plan, a), f, f.dv)


PLANS = {"vertical": functools.partial(axial, direction="vertical"),
         "horizontal": functools.partial(axial, direction="horizontal"),
         "rowmajor": functools.partial(axial, direction="rowmajor"),
         "sparse_axial": functools.partial(axial, direction=None),
         "mixture": functools.partial(axial, direction="mixture", normalize="mean"),
         "mixture_joint": functools.partial(axial, direction="mixture", normalize="joint")}


# ------------------------------------------------------------------------------------------- logsparse

def _flip(f: Frame, x: Array) -> Array:
  """A frame array of the sequence reversed (its real part; padding stays at the end)."""
  if x.shape[1] == f.length:
    return jnp.flip(x, axis=1)
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, x.shape[1] - f.length)
  return jnp.pad(jnp.flip(x[:, :f.length], axis=1), pad)


def _flip_lse(f: Frame, lse: Array) -> Array:
  """Per-head log-sum-exps [BH, tiles, 1, T] of the sequence reversed."""
  return _flip(f, lse.reshape(lse.shape[0], -1)).reshape(lse.shape)


def _reversed(a: dict, fr: Frame) -> dict:
  """The reversed direction's arrays: the plan's own where its kernels read them reversed (`fr.reverse`),
  else the flipped copies (`_r`); its mask is always the flipped one."""
  if fr.reverse:
    return {n: x for n, x in a.items() if n in frames.FRAME_INPUTS} | (
        {"mask": a["mask_r"]} if "mask_r" in a else {})
  return {n[:-2]: x for n, x in a.items() if n.endswith("_r")}


def _dyadic_forward(plan: Plan, a: dict):
  f = plan.frame
  fwd, rev = plan.passes  # Dyadic descriptions (rev None when causal)
  ext, res_r = None, None
  if rev is not None:
    fr = rev.frame
    o_r, lse_r, bank_r = dyadic_kernels.direction_forward(fr, rev, _reversed(a, fr), a["q"].dtype)
    ext = (o_r if fr.reverse else _flip(f, o_r), _flip_lse(f, lse_r))
    res_r = bank_r
  o, lse, bank = dyadic_kernels.direction_forward(f, fwd, a, plan.out_dtype, ext)
  return o, (o, lse, bank, res_r)


def _dyadic_backward(plan: Plan, a: dict, res: tuple, do: Array) -> dict:
  f = plan.frame
  fwd, rev = plan.passes
  o, lse, bank, bank_r = res
  g = dyadic_kernels.direction_backward(f, fwd, a, bank, do, o, lse)
  if rev is not None and rev.frame.reverse:  # the reversed direction adds its gradients to g in place
    g = dyadic_kernels.direction_backward(rev.frame, rev, _reversed(a, rev.frame), bank_r, do, o,
                                          _flip_lse(f, lse), acc=g)
  grads = {"q": g["dq"], "k": g["dk"], "v": g["dv"], "pool_q": g.get("dpq"), "pool_k": g.get("dpk")}
  if rev is not None and not rev.frame.reverse:
    gr = dyadic_kernels.direction_backward(f, rev, _reversed(a, f), bank_r, _flip(f, do), _flip(f, o),
                                           _flip_lse(f, lse))
    grads.update(q_r=gr["dq"], k_r=gr["dk"], v_r=gr["dv"], pool_q_r=gr.get("dpq"), pool_k_r=gr.get("dpk"))
  return grads


_FORWARD["logsparse"] = _dyadic_forward
_BACKWARD["logsparse"] = _dyadic_backward


def logsparse(q: Array, k: Array, v: Array, mask: Array | None, pool_q: Array | None, pool_k: Array | None, *,
              causal: bool, pooling: str | None, platform: str) -> Array:
  """Combiner-Logsparse (pooling "max" | "mean") or LogSparse (pooling None) on the kernels of
  `combiner.dyadic_kernels`. q, k: [batch, length, heads, head_dim]; v: [..., value_dim]."""
  length = q.shape[1]
  tile = frame_cols(min(length, frames.GPU_TILE if platform == "gpu" else frames.TILE), platform)
  f = make_frame(q, v, mask, tile, -(-length // tile), platform)
  pools = pool_q is not None
  levels = (length - 1).bit_length()
  fwd = dyadic_kernels.Dyadic(f, levels, pooling, pools, with_self=True, ext=not causal and length > 1)
  # The reversed direction reads the arrays reversed in its kernels where the frame has no padding (its
  # tiles are then the arrays' tiles backwards); else it runs on flipped copies.
  fr = dataclasses.replace(f, reverse=not f.packed and f.rows * f.cols == length)
  rev = (None if causal or length == 1 else
         dyadic_kernels.Dyadic(fr, levels, pooling, pools, with_self=False, ext=False))
  plan = Plan(f, "logsparse", (fwd, rev), pooling, causal, pools, jnp.dtype(v.dtype))
  kdt = kernel_dtype(q, k, v)
  a = _arrays(f, q, k, v, pool_q, pool_k, kdt)
  if mask is not None:
    a["mask"] = view_rows(mask_frame(mask, f), "rows")
  if rev is not None:
    if not fr.reverse:
      flipped = [None if x is None else jnp.flip(x, axis=1) for x in (q, k, v, pool_q, pool_k)]
      for n, x in _arrays(f, *flipped, kdt).items():
        a[n + "_r"] = x
    if mask is not None:
      a["mask_r"] = view_rows(mask_frame(jnp.flip(mask, axis=1), f), "rows")
  return from_frame(_run(plan, a), f, f.dv)
