"""A flash-attention kernel (Pallas) over per-query selected key blocks: MoBA's chosen blocks, NSA's selected
blocks and its sliding window, without gathering any key per query.

Keys are cut into blocks of B positions (block b = positions [b·B, (b+1)·B)). Every query i attends to the
keys of its own set of blocks: `ids` [rows, P, K] lists them per query (-1 = unused slot), or, with `ids`
None, every block, narrowed by structural rules only (`causal`: j <= i; `window` w: j > i - w). The kernel
runs one online softmax per query over exactly its set (valid keys, rules applied), so the output equals the
XLA path's gather-and-softmax (`attention_core.selection.chosen_piece`).

Forward: grid (rows, query tiles). A query tile of `tile_q` queries reads only the union of the blocks its
queries chose: an int32 list per query tile, [count, block ids ascending, padding] (computed in XLA; in SMEM
on TPU, a plain int ref read in-kernel on GPU), looped over with a dynamic trip count. Per block, a query's
mask is whether the block is among its own ids (a compare against its K ids: the selection bitmask without a
per-slot layout, the same in the transposed backward, which knows the block but not its slot). A block is
read as `sub` key tiles of `tile_k` keys: each block is padded to whole tiles (its padded keys invalid), and
keys, values and key codes sit in [rows, tiles, tile_k, dim] arrays, so every dynamic index falls on a leading
axis (Mosaic places no dynamic lane or sublane offsets here; Triton loads power-of-two tiles).

Backward (custom_vjp, recomputation from the saved log-sum-exp as in FlashAttention-2): a dq kernel with the
forward's grid and lists; a dk/dv kernel with grid (rows, key tiles) looping over the transposed lists, for
each key block the query tiles that read it (XLA again), on transposed tiles ([keys, queries]) so the
per-query statistics and ids stay rows with queries on lanes. No atomics.

Non-finite handling as `combiner.flash`: key and value tiles have non-finite entries selected to 0 before any
product, a per-key code marks keys that had any, and a query that sees such a key gets NaN (as the XLA path)
while one behind a mask, a rule or an unchosen block is inert. Matmuls take the input dtype and accumulate in
float32 (float64 stays float64, interpret mode).

Blocks: on TPU a row's keys and values (forward, dq) or queries and output cotangents (dk/dv) stay in HBM and
a program copies in just the blocks its list names, two VMEM slots, the next block's copy running under
this block's products (`attention_core.pallas.prefetched_loop`), so VMEM holds no whole row at any length;
each program's list is its own SMEM block. GPUs and interpret mode read the same tiles from the row's ref.
`lax.platform_dependent` picks Triton on GPU, Mosaic on TPU and interpret mode on CPU
(`attention_core.pallas.platform_call`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from attention_core import contract, pallas
from attention_core.blocks import pad_to

Array = Any
TILE_CAPS = (128, 128)  # (query, key) tile caps on TPU (128 lanes) and in interpret mode
GPU_TILE_CAPS = (64, 64)  # on GPUs, as combiner.flash
MIN_TILE = 16
VALID, NONFINITE = 1.0, 2.0  # key codes; 0 marks an invalid key
# Entries of a block list at the least: a TPU program reads its own list as an SMEM block, whose last
# dimension Mosaic wants a multiple of 128.
LIST_WIDTH = 128

GPU_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)
TPU_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


class Plan(NamedTuple):
  """The static part of a call."""

  block: int  # B, positions per selection block
  tile_k: int  # keys per key tile (a power of two)
  sub: int  # key tiles per block (the block padded to sub * tile_k)
  tile_q: int  # queries per query tile (a power of two)
  causal: bool  # key j visible to query i only when j <= i
  window: int  # > 0: key j visible only when j > i - window
  scale: float
  ids: bool  # per-query block ids given (else every listed block)
  key_stride: int = 1  # key j sits at position j * key_stride + key_offset (the rules compare positions)
  key_offset: int = 0
  also_window: int = 0  # > 0: a second softmax in the same pass, over every key j > i - also_window

  @property
  def sets(self) -> tuple[tuple[bool, int], ...]:
    """The softmaxes of one pass: (whether the ids narrow it, its window) each."""
    first = (self.ids, self.window)
    return (first, (False, self.also_window)) if self.also_window else (first,)


def tile_caps() -> tuple[int, int]:
  """(query tile cap, key tile cap) for the platform being traced for."""
  backend = contract.backend()
  return GPU_TILE_CAPS if backend in contract.ACCELERATOR_BACKENDS and backend != "tpu" else TILE_CAPS


def _tile(n: int, cap: int) -> int:
  t = MIN_TILE
  while t < n and t < cap:
    t *= 2
  return t


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def tiles(length: int, block: int) -> tuple[int, int]:
  """(tile_q, tile_k) for `length` queries over blocks of `block` keys: query tiles no longer than a block
  where possible (a tile spanning several blocks reads the union of their choices)."""
  cap_q, cap_k = tile_caps()
  return _tile(min(block, length), cap_q), _tile(block, cap_k)


IMPLEMENTATIONS = ("auto", "xla", "pallas")  # the ops' `implementation` values (registry.fused_path)


def choose_implementation(implementation: Any, *, op: str) -> Any:
  """What an op running its selected blocks here (moba, nsa) runs where it is traced (`contract.backend`):
  "auto" is the kernel on GPU and TPU (on TPU it copies in only the blocks it reads, so any length fits),
  XLA on CPU. Unknown values (which the op rejects in its own words) are returned as they are."""
  if implementation not in IMPLEMENTATIONS:
    return implementation
  return contract.resolve_implementation(implementation, IMPLEMENTATIONS, op=op)


def per_platform_key(implementation: Any, *, op: str) -> Any:
  """What such an op's trace depends on per platform (the key of `contract.per_platform_op`)."""
  chosen = choose_implementation(implementation, op=op)
  return (chosen, tile_caps()) if chosen == "pallas" else chosen


def _div(a: Any, b: int) -> Any:
  """a // b for non-negative ints (jnp's floor division lowers through `sign`, which Mosaic cannot place)."""
  return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _finite(x: Array) -> Array:
  """x with non-finite entries selected to 0 (a key or value behind a mask meets zero weights in products)."""
  return jnp.where(jnp.isfinite(x.astype(jnp.float32)), x, jnp.zeros_like(x))


def _stats_dtype(x: Array) -> Any:
  return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _rules(plan: Plan, qpos: Array, kpos: Array, window: int) -> Array | None:
  """Structural visibility of keys kpos (indices) for queries at qpos (broadcasting), None when there is no
  rule; a key's position is kpos * key_stride + key_offset."""
  if plan.key_stride != 1 or plan.key_offset:
    kpos = kpos * plan.key_stride + plan.key_offset
  ok = None
  if plan.causal:
    ok = kpos <= qpos
  if window:
    inside = kpos > qpos - window
    ok = inside if ok is None else ok & inside
  return ok


def _visible(plan: Plan, code: Array, qpos: Array, kpos: Array, hit: Any) -> list[Array]:
  """Per softmax of the pass (`Plan.sets`): which pairs it sees (real key, rules, and the query's ids)."""
  out = []
  for uses_ids, window in plan.sets:
    ok = code > 0
    rule = _rules(plan, qpos, kpos, window)
    ok = ok if rule is None else ok & rule
    out.append(ok & hit if uses_ids and hit is not None else ok)
  return out


def _hit(ids: Array, b: Array, axis: int) -> Array:
  """Which queries chose block b: ids [tile_q, K] (axis 1) or [K, tile_q] (axis 0) -> keepdims bool."""
  return jnp.max(jnp.where(ids == b, 1.0, 0.0), axis=axis, keepdims=True) > 0


def _tiles_of_block(plan: Plan, b: Array, qmax: Any, body, carry):
  """carry after body(j, carry) for the key tiles j of block b; causal rules stop after the last tile a query
  up to qmax can see."""
  if plan.sub == 1:
    return body(0, carry)
  num = plan.sub
  if plan.causal:  # the last key index qmax can see: (qmax - key_offset) // key_stride
    last = _div(jnp.maximum(qmax - plan.key_offset, 0), plan.key_stride)
    num = jnp.minimum(num, _div(jnp.maximum(last - b * plan.block, 0), plan.tile_k) + 1)
  return lax.fori_loop(0, num, body, carry)


def _blocks(sub: int, entry, srcs: list, body, carry, scratch: tuple):
  """carry after body(b, tile_of, carry) for the blocks b = entry(1 + s), s < entry(0), of the program's
  list; tile_of(n, j) is key (or query) tile j of block b of srcs[n], a row's tiles [n, a, c]: read from the
  ref, or on TPU (scratch: a two-slot VMEM buffer [2, sub, a, c] per src, then DMA semaphores [srcs, 2]) from
  the block's copy out of HBM, the next block's copy started before this block's work."""
  if not scratch:
    def step(s, c):
      b = entry(1 + s)
      return body(b, lambda n, j: srcs[n][b * sub + j], c)
    return lax.fori_loop(0, entry(0), step, carry)
  bufs, sems = scratch[:-1], scratch[-1]

  def copies(s, slot):
    start = entry(1 + s) * sub
    return [pltpu.make_async_copy(src.at[pl.ds(start, sub)], buf.at[slot], sems.at[n, slot])
            for n, (src, buf) in enumerate(zip(srcs, bufs, strict=True))]

  return pallas.prefetched_loop(
      0, entry(0), copies, lambda s, slot, c: body(entry(1 + s), lambda n, j: bufs[n][slot, j], c), carry)


def _fwd_kernel(R: dict, scratch: tuple, *, plan: Plan):
  t = pl.program_id(1)
  tq, tk = plan.tile_q, plan.tile_k
  q = R["q"][...]  # [tq, d]
  st = _stats_dtype(q)
  qpos = t * tq + lax.broadcasted_iota(jnp.int32, (tq, 1), 0)
  qmax = t * tq + tq - 1
  ids = R["ids"][...] if plan.ids else None  # [tq, K]

  def block(b, tile_of, carry):
    hit = _hit(ids, b, 1) if ids is not None else None  # [tq, 1]

    def tile(j, carry):
      k, v, code = tile_of(0, j), _finite(tile_of(1, j)), tile_of(2, j)  # [tk, d], [tk, e], [1, tk]
      logits = pallas.dot(q, k, trans_b=True).astype(st) * plan.scale  # [tq, tk]
      kpos = b * plan.block + j * tk + lax.broadcasted_iota(jnp.int32, (1, tk), 1)
      new = []
      for (m, den, acc), ok in zip(carry, _visible(plan, code, qpos, kpos, hit), strict=True):
        # A visible key that held a NaN or Inf gets logit +inf: its query's max, weights and output turn NaN.
        s = jnp.where(ok, jnp.where(code > VALID, jnp.inf, logits), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)  # exactly 0 where invisible
        alpha = jnp.exp(m - m_safe)
        new.append((m_new, alpha * den + jnp.sum(p, axis=1, keepdims=True),
                    alpha * acc + pallas.dot(p.astype(v.dtype), v).astype(st)))
      return tuple(new)

    return _tiles_of_block(plan, b, qmax, tile, carry)

  e = R["o0"].shape[-1]
  init = tuple((jnp.full((tq, 1), -jnp.inf, st), jnp.zeros((tq, 1), st), jnp.zeros((tq, e), st))
               for _ in plan.sets)
  final = _blocks(plan.sub, _entries(R["lists"]), [R["k"], R["v"], R["code"]], block, init, scratch)
  for n, (m, den, acc) in enumerate(final):
    nonempty = den > 0
    safe = jnp.where(nonempty, den, 1.0)
    R[f"o{n}"][...] = (acc / safe).astype(R[f"o{n}"].dtype)
    R[f"lse{n}"][...] = jnp.where(nonempty, m + jnp.log(safe), -jnp.inf).T.astype(R[f"lse{n}"].dtype)


def _grads_of(plan: Plan, logits: Array, oks: list[Array], dos: list, lses: list, deltas: list, v: Array,
              lhs: bool) -> tuple[Array, Array | None]:
  """(ds, dv share) of one tile pair summed over the pass's softmaxes: p = e^(s - lse) where visible,
  ds = p (do . v - delta); the dv share p^T do (lhs: [keys, queries] tiles, else None)."""
  st = logits.dtype
  ds, dv = 0.0, None
  for ok, do, lse, delta in zip(oks, dos, lses, deltas, strict=True):
    p = jnp.where(ok, jnp.exp(jnp.where(ok, logits, 0.0) - lse), 0.0)
    if lhs:  # [tk, tq]: dp = v do^T
      dp = pallas.dot(v, do, trans_b=True).astype(st)
      share = pallas.dot(p.astype(do.dtype), do).astype(st)
      dv = share if dv is None else dv + share
    else:  # [tq, tk]
      dp = pallas.dot(do, v, trans_b=True).astype(st)
    ds = ds + p * (dp - delta)
  return ds, dv


def _per_set(R: dict, plan: Plan, tile_of=None) -> tuple[list, list, list]:
  """(do, lse, delta) of each softmax of the pass: the program's own tiles, or tile_of(name)'s."""
  get = tile_of or (lambda name: R[name][...])
  n = range(len(plan.sets))
  return [get(f"do{i}") for i in n], [get(f"lse{i}") for i in n], [get(f"delta{i}") for i in n]


def _dq_kernel(R: dict, scratch: tuple, *, plan: Plan):
  t = pl.program_id(1)
  tq, tk = plan.tile_q, plan.tile_k
  q = R["q"][...]  # [tq, d]
  st = _stats_dtype(q)
  dos, lses, deltas = _per_set(R, plan)  # [tq, e], [1, tq], [1, tq] each
  lses = [jnp.where(x.T == -jnp.inf, 0.0, x.T) for x in lses]  # [tq, 1]
  deltas = [x.T for x in deltas]
  qpos = t * tq + lax.broadcasted_iota(jnp.int32, (tq, 1), 0)
  qmax = t * tq + tq - 1
  ids = R["ids"][...] if plan.ids else None

  def block(b, tile_of, dq):
    hit = _hit(ids, b, 1) if ids is not None else None

    def tile(j, dq):
      k, v, code = _finite(tile_of(0, j)), _finite(tile_of(1, j)), tile_of(2, j)
      logits = pallas.dot(q, k, trans_b=True).astype(st) * plan.scale
      kpos = b * plan.block + j * tk + lax.broadcasted_iota(jnp.int32, (1, tk), 1)
      ds, _ = _grads_of(plan, logits, _visible(plan, code, qpos, kpos, hit), dos, lses, deltas, v, False)
      return dq + pallas.dot(ds.astype(k.dtype), k).astype(st) * plan.scale

    return _tiles_of_block(plan, b, qmax, tile, dq)

  dq = _blocks(plan.sub, _entries(R["lists"]), [R["k"], R["v"], R["code"]], block,
               jnp.zeros(R["dq"].shape, st), scratch)
  R["dq"][...] = dq.astype(R["dq"].dtype)


def _dkv_kernel(R: dict, scratch: tuple, *, plan: Plan):
  """dk, dv of one key tile from the query tiles its block's transposed list names, on [keys, queries]
  tiles (per-query rows broadcast over keys)."""
  kt = pl.program_id(1)
  tk = plan.tile_k
  b = _div(kt, plan.sub)
  j = kt - b * plan.sub
  k, v, code = R["k"][...], _finite(R["v"][...]), R["code"][...]  # [tk, d], [tk, e], [tk, 1]
  st = _stats_dtype(k)
  kpos = b * plan.block + j * tk + lax.broadcasted_iota(jnp.int32, (tk, 1), 0)
  names = ["q", *(n for x in ("do", "lse", "delta") for n in _per_set_names(plan, x))]
  names += ["ids"] if plan.ids else []  # the streams, in `_flash_bwd`'s order

  def body(t, tile_of, carry):
    dk, dv = carry
    got = {n: tile_of(i, 0) for i, n in enumerate(names)}
    q = got["q"]  # [tq, d]
    qpos = t * plan.tile_q + lax.broadcasted_iota(jnp.int32, (1, plan.tile_q), 1)
    logits = pallas.dot(k, q, trans_b=True).astype(st) * plan.scale  # [tk, tq]
    hit = _hit(got["ids"], b, 0) if plan.ids else None  # ids [K, tq] -> [1, tq]
    dos, lses, deltas = _per_set(R, plan, got.__getitem__)
    ds, share = _grads_of(plan, logits, _visible(plan, code, qpos, kpos, hit), dos,
                          [jnp.where(x == -jnp.inf, 0.0, x) for x in lses], deltas, v, True)
    return dk + pallas.dot(ds.astype(q.dtype), q).astype(st) * plan.scale, dv + share

  zeros = (jnp.zeros(R["dk"].shape, st), jnp.zeros(R["dv"].shape, st))
  dk, dv = _blocks(1, _entries(R["lists"]), [R[n] for n in names], body, zeros, scratch)
  R["dk"][...] = dk.astype(R["dk"].dtype)
  R["dv"][...] = dv.astype(R["dv"].dtype)


def _entries(lists_ref):
  """Entry s of the program's list ([1, W]: its count, then its blocks or query tiles)."""
  return lambda s: lists_ref[0, s]


def _call(platform: str | None, kernel, name: str, grid: tuple[int, int], operands: list, outputs: list,
          width: int, which, block: int):
  """One pallas_call per platform of kernel(R, scratch) over grid (rows, n), R its refs by name.
  operands: (name, array, kind), kind "lists" (the int32 lists [rows, 1, n' * width]: the program's own,
  which(r, t), in SMEM on TPU), "tile" (tile t of row r: [rows, n, a, c] -> [a, c]) or "row" (row r's
  tiles [n, a, c], looped over: one VMEM block off TPU; on TPU left in HBM, `block` tiles copied in at a time
  into two VMEM slots each, then DMA semaphores [rows, 2] as scratch). outputs: (name, shape struct), each
  the grid step's tile."""
  names = [n for n, _, _ in operands] + [n for n, _ in outputs]
  rows = [(n, x) for n, x, kind in operands if kind == "row"]

  def spec(x, kind, on_tpu):
    if kind == "lists":
      return pl.BlockSpec((None, 1, width), lambda r, t: (r, 0, which(r, t)),
                          memory_space=pltpu.SMEM if on_tpu else None)
    if kind == "tile":
      return pl.BlockSpec((None, None, *x.shape[2:]), lambda r, t: (r, t, 0, 0))
    if on_tpu:
      return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec((None, *x.shape[1:]), lambda r, t: (r, 0, 0, 0))

  def entry(*refs, on_tpu):
    R = dict(zip(names, refs[:len(names)], strict=True))
    if on_tpu:  # a streamed operand's view of the program's row in HBM
      for n, _ in rows:
        R[n] = R[n].at[pl.program_id(0)]
    kernel(R, tuple(refs[len(names):]))

  scratch = [pltpu.VMEM((2, block, *x.shape[2:]), x.dtype) for _, x in rows]
  scratch.append(pltpu.SemaphoreType.DMA((len(rows), 2)))
  return pallas.platform_call(
      functools.partial(entry, on_tpu=False), gpu_params=GPU_PARAMS, tpu_params=TPU_PARAMS,
      tpu_kernel=functools.partial(entry, on_tpu=True), platform=platform, grid=grid,
      in_specs=[spec(x, kind, False) for _, x, kind in operands],
      tpu_kw={"in_specs": [spec(x, kind, True) for _, x, kind in operands], "scratch_shapes": scratch},
      out_specs=[pl.BlockSpec((None, None, *x.shape[2:]), lambda r, t: (r, t, 0, 0)) for _, x in outputs],
      out_shape=[x for _, x in outputs], name=name,
  )(*[x for _, x, _ in operands])


class _Aux(NamedTuple):  # the non-differentiable kernel inputs
  code: Array  # [rows, key tiles, 1, tile_k] float32 key codes
  code_t: Array  # [rows, key tiles, tile_k, 1] the same, as columns (dk/dv)
  lists: Array  # [rows, 1, query tiles * W] int32: per query tile its count, then block ids
  lists_t: Array  # [rows, 1, blocks * W'] int32: per key block its count, then query tiles
  ids: Array | None  # [rows, query tiles, tile_q, K] int32 per-query block ids, -1 unused
  ids_t: Array | None  # [rows, query tiles, K, tile_q] the same, queries on lanes (dk/dv)


def _zero_cotangent(x: Array | None) -> Any:
  if x is None:
    return None
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(platform: str | None, plan: Plan, q: Array, k: Array, v: Array, aux: _Aux) -> tuple[Array, ...]:
  return _flash_fwd(platform, plan, q, k, v, aux)[0]


def _per_set_names(plan: Plan, *kinds: str) -> list[str]:
  return [f"{x}{i}" for i in range(len(plan.sets)) for x in kinds]


def _flash_fwd(platform, plan, q, k, v, aux):
  """(out per softmax of the pass), residuals."""
  rows, nt, tq, _ = q.shape
  e = v.shape[-1]
  operands = [("lists", aux.lists, "lists"), ("q", q, "tile"), ("k", k, "row"), ("v", v, "row"),
              ("code", aux.code, "row")] + ([("ids", aux.ids, "tile")] if plan.ids else [])
  shapes = [jax.ShapeDtypeStruct((rows, nt, tq, e), q.dtype), jax.ShapeDtypeStruct((rows, nt, 1, tq),
                                                                                   _stats_dtype(q))]
  outs = _call(platform, functools.partial(_fwd_kernel, plan=plan), "selection_flash_fwd", (rows, nt),
               operands, list(zip(_per_set_names(plan, "o", "lse"), shapes * len(plan.sets), strict=True)),
               _width(aux.lists, nt), lambda r, t: t, plan.sub)
  os, lses = tuple(outs[0::2]), tuple(outs[1::2])
  return os, (q, k, v, aux, os, lses)


def _flash_bwd(platform, plan, res, dos):
  q, k, v, aux, os, lses = res
  rows, nt, _, _ = q.shape
  nk = k.shape[1]
  st = _stats_dtype(q)
  per_set = []  # (do, lse, delta) per softmax
  for do, o, lse in zip(dos, os, lses, strict=True):
    delta = jnp.sum(do.astype(st) * o.astype(st), axis=-1)[:, :, None, :]  # [rows, nt, 1, tq]
    per_set += [do.astype(q.dtype), lse, delta]
  set_names = _per_set_names(plan, "do", "lse", "delta")
  ids = [("ids", aux.ids, "tile")] if plan.ids else []
  dq = _call(platform, functools.partial(_dq_kernel, plan=plan), "selection_flash_dq", (rows, nt),
             [("lists", aux.lists, "lists"), ("q", q, "tile"),
              *((n, x, "tile") for n, x in zip(set_names, per_set, strict=True)),
              ("k", k, "row"), ("v", v, "row"), ("code", aux.code, "row"), *ids],
             [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype))], _width(aux.lists, nt), lambda r, t: t,
             plan.sub)[0]
  sub = plan.sub
  # the kernel's streams in `_dkv_kernel`'s order: q, then do, lse, delta of each softmax, then the ids
  by_kind = dict(zip(set_names, per_set, strict=True))
  streamed = [("q", q)] + [(n, by_kind[n]) for x in ("do", "lse", "delta")
                           for n in _per_set_names(plan, x)] + ([("ids", aux.ids_t)] if plan.ids else [])
  dk, dv = _call(platform, functools.partial(_dkv_kernel, plan=plan), "selection_flash_dkv", (rows, nk),
                 [("lists", aux.lists_t, "lists"), *((n, x, "row") for n, x in streamed),
                  ("k", k, "tile"), ("v", v, "tile"), ("code", aux.code_t, "tile")],
                 [(n, jax.ShapeDtypeStruct(x.shape, x.dtype)) for n, x in (("dk", k), ("dv", v))],
                 _width(aux.lists_t, nk // sub), lambda r, t: _div(t, sub), 1)
  return dq, dk, dv, jax.tree.map(_zero_cotangent, aux, is_leaf=lambda x: x is None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _lists(member: Array, most: int) -> Array:
  """member [rows, n, m] bool -> [rows, 1, n * W] int32, list after list: the count, then the members
  ascending (at most `most`), W = `_list_width`; slots past the count are never read.
  A numpy member (the static rules) gives numpy lists: constants of the program."""
  if isinstance(member, np.ndarray):
    m = member.shape[-1]
    order = np.argsort(np.where(member, np.arange(m), m + np.arange(m)), axis=-1, kind="stable")
    out = np.concatenate([member.sum(-1, keepdims=True), order[..., :min(most, m)]], axis=-1)
    out = np.pad(out, ((0, 0), (0, 0), (0, _list_width(out.shape[-1]) - out.shape[-1]))).astype(np.int32)
    return out.reshape(out.shape[0], 1, -1)
  m = member.shape[-1]
  index = jnp.arange(m, dtype=jnp.int32)
  order = jnp.argsort(jnp.where(member, index, m + index), axis=-1)[..., :min(most, m)].astype(jnp.int32)
  count = jnp.sum(member, axis=-1, dtype=jnp.int32)[..., None]
  spare = jnp.zeros((*count.shape[:-1], _list_width(1 + order.shape[-1]) - 1 - order.shape[-1]), jnp.int32)
  return jnp.concatenate([count, order, spare], axis=-1).reshape(count.shape[0], 1, -1)  # [rows, 1, n * W]


def _list_width(entries: int) -> int:
  """W for lists of `entries` entries: a power of two (Triton's blocks), at least `LIST_WIDTH` (Mosaic's SMEM
  blocks)."""
  return max(LIST_WIDTH, _pow2(entries))


def _width(lists: Array, n: int) -> int:
  """The width W of each of the n lists in lists [rows, 1, n * W]."""
  return lists.shape[-1] // n


def attend(q: Array, k: Array, v: Array, real: Array | None, ids: Array | None, *, block: int, causal: bool,
           window: int = 0, scale: float, key_stride: int = 1, key_offset: int = 0,
           also_window: int = 0) -> Any:
  """Each query's softmax over the valid keys of its blocks.

  q [rows, P, d]: query i at position i; k [rows, N, d], v [rows, N, e], real [rows, N] bool key mask (None:
  every key real), N a whole number of blocks of `block` keys; ids [rows, P, K] int32: the blocks each query
  attends (-1 = unused), or None: every block. causal: keys j <= i only; window > 0: keys j > i - window only.
  scale: the logit scale. key_stride, key_offset: key j sits at position j * key_stride + key_offset for the
  rules (NSA's compressed block j ends there). also_window > 0: a second softmax in the same pass over the
  keys, every key j with i - also_window < j (and j <= i when causal), ids aside (NSA's window branch beside
  its selection). Returns [rows, P, e] in q's dtype (queries with no visible key get 0), or with also_window
  the pair (the ids' softmax, the window's); differentiable in q, k and v.
  """
  rows, length, d = q.shape
  n, e = k.shape[1], v.shape[-1]
  if n % block:
    raise ValueError(f"selection_flash.attend: {n} keys are not whole blocks of {block}")
  nb = n // block
  tq, tk = tiles(length, block)
  sub = -(-block // tk)
  nt = -(-length // tq)
  dp, ep = _pow2(d), _pow2(e)
  plan = Plan(block, tk, sub, tq, bool(causal), int(window), float(scale), ids is not None, int(key_stride),
              int(key_offset), int(also_window))

  def key_tiles(x: Array) -> Array:  # [rows, N, w] -> [rows, nb * sub, tk, w]
    x = pad_to(x.reshape(rows, nb, block, x.shape[-1]), sub * tk, 2)
    return x.reshape(rows, nb * sub, tk, x.shape[-1])

  finite = jnp.all(jnp.isfinite(k), axis=-1) & jnp.all(jnp.isfinite(v), axis=-1)
  code = jnp.where(finite, VALID, NONFINITE)  # [rows, N]
  code = (code if real is None else jnp.where(real, code, 0.0)).astype(jnp.float32)
  code = key_tiles(code[..., None])  # [rows, nb * sub, tk, 1]
  qt = pad_to(pad_to(q, nt * tq, 1), dp, 2).reshape(rows, nt, tq, dp)
  kt = key_tiles(pad_to(k.astype(q.dtype), dp, 2))
  vt = key_tiles(pad_to(v.astype(q.dtype), ep, 2))

  def seen_by_rule(w: int) -> np.ndarray:  # [nt, nb]: the blocks the rules let some query of a tile see
    first = np.arange(nt) * tq  # [nt] the tile's first and last query
    last = first + tq - 1
    starts = np.arange(nb) * block * key_stride + key_offset  # [nb] the blocks' first and last key positions
    ends = starts + (block - 1) * key_stride
    seen = np.ones((nt, nb), bool)
    if causal:
      seen &= starts[None, :] <= last[:, None]
    if w:
      seen &= ends[None, :] > first[:, None] - w
    return seen

  also = seen_by_rule(also_window) if also_window else np.zeros((nt, nb), bool)
  if ids is not None:
    count = ids.shape[-1]
    idp = pad_to(pad_to(ids.astype(jnp.int32), nt * tq, 1, -1), _pow2(count), 2, -1)  # [rows, nt * tq, K]
    # The union of each query tile's choices, one fused compare-and-reduce (-1 matches no block).
    member = jnp.any(idp.reshape(rows, nt, -1)[..., None] == jnp.arange(nb, dtype=jnp.int32), axis=2)
    member = member | also[None] if also_window else member
    most = min(nb, tq * count + int(also.sum(-1).max(initial=0)))
    lists = [_lists(member, most), _lists(jnp.swapaxes(member, 1, 2), nt)]
    ids4 = idp.reshape(rows, nt, tq, -1)
    aux_ids, aux_ids_t = ids4, jnp.swapaxes(ids4, 2, 3)
  else:  # every block a rule lets some query of the tile see: the same static lists for every row
    seen = seen_by_rule(window) | also
    most = int(seen.sum(-1).max(initial=1))
    lists = [jnp.broadcast_to(x, (rows, *x.shape[1:])) for x in (
        _lists(seen[None], most), _lists(seen.T[None], nt))]
    aux_ids = aux_ids_t = None
  aux = _Aux(jnp.swapaxes(code, 2, 3), code, *lists, aux_ids, aux_ids_t)
  outs = [o.reshape(rows, nt * tq, ep)[:, :length, :e]  # [rows, nt, tq, ep] each
          for o in _flash(contract.traced_platform(), plan, qt, kt, vt, aux)]
  return tuple(outs) if also_window else outs[0]
