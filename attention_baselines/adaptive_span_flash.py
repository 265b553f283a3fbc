"""Adaptive-span attention as Pallas kernels: `attention_baselines.adaptive_span`'s implementation="pallas".

Queries and keys are cut into tiles of B positions (128 on TPU, 64 on GPUs), laid out as the op lays out its
blocks (memory keys padded in front, so that query tile t sits at key tile front + t). Row r = b·H + h of the
batch × heads rows has its head's span z_h and trip count T_h = floor((z_h + R - 1) / B) + 2 (the op's, per
head here): query tile t reads the key tiles front + t - u for 0 <= u < T_h (bidirectionally also front + t +
u), a loop whose trip count is read at run time, so a layer costs O(L·(z + R + B)·d) per head whatever
`max_span` is, and no key tile farther away is ever read. Every tile pair computes the op's weights exactly:
m_z(x)·e^(s - lse) over the real keys, x = (M + i) - j or |i - j|, and d/dz on the pairs of
`adaptive_span.corner_band`.

Kernels, each one custom call (grid; what a program loops over):
  forward   (rows, query tiles): its key tiles; online softmax; the output and the log-sum-exp.
  dq        (rows, query tiles): the same key tiles, weights recomputed from the log-sum-exp; dq and, per
            query, its share of d/dz.
  dk, dv    (rows, key tiles): the query tiles that read the key tile.
  positions (offsets, heads, batch), with `positions` only: per key-tile offset, the position term's
            gradient by distance, summed over the query tiles and over the rows that share the table.

Positions: s_ij += q_i·p_x. A tile pair at offset u has the 2B - 1 signed distances u·B + a - b (query row a,
key row b); with W the window of 2B rows of `table` (p by signed distance, descending), q @ W^T gives every
query's logits per distance, and a lane rotation of each row (`pltpu.roll`, row a by B + 1 + a) moves each
pair's onto its key's lane: no gather, no vector per pair; the backward rotates back (row a by B - 1 - a). A
row's rotation is one static lane rotation per bit of a, selected per row (TPUs before v5 have no strided
rotation). Triton has no lane rotation, so on GPUs the op keeps XLA when it has positions (`supports`).

Non-finite handling as `attention_baselines.selection_flash`: keys and values with a NaN or Inf are selected
to 0 before any product, a per-key code marks them, and a query whose weights reach such a key gets NaN (the
XLA path's answer); one behind the mask, the causal order or m = 0 is inert. Matmuls take the input dtype and
accumulate in float32 (float64 stays float64 in interpret mode).

TPU: the tiles a program loops over (keys and values; queries and cotangents for dk/dv and the position
gradient; the position windows) stay in HBM and are copied into two VMEM slots, the next tile's copy running
under this tile's work, so any length fits VMEM. GPUs read them from HBM; CPU runs interpret mode
(`attention_core.pallas.platform_call`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
IMPLEMENTATIONS = ("auto", "xla", "pallas")  # the op's `implementation` values (registry.fused_path)
TILE_CAPS = {"tpu": 128, "gpu": 64, "cpu": 128}  # B per platform (TPU: lanes; CPU: interpret mode)
MIN_TILE = 8
VALID, NONFINITE = 1.0, 2.0  # key codes; 0 marks a masked key
GPU_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)


def _platform() -> str:
  backend = contract.backend()
  return "tpu" if backend == "tpu" else "gpu" if backend in contract.ACCELERATOR_BACKENDS else "cpu"


def tile_size(length: int) -> int:
  """B for `length` queries where the op is traced: the platform's cap (TPU: always 128, its lanes), else
  the smallest power of two >= length, at least MIN_TILE."""
  cap = TILE_CAPS[_platform()]
  if _platform() == "tpu":
    return cap
  t = MIN_TILE
  while t < length and t < cap:
    t *= 2
  return t


def supports(positions: bool) -> bool:
  """Whether the kernels run where the op is traced: everywhere, but with positions not on GPUs (Triton
  has no lane rotation)."""
  return not (positions and _platform() == "gpu")


class Plan(NamedTuple):
  """The static part of a call."""

  causal: bool
  ramp: float
  max_span: float
  scale: float
  tile: int  # B
  nt: int  # query tiles
  nk: int  # key tiles: front + nt
  front: int  # key tiles before query tile 0's own (memory)
  bound: int  # static bound on the trip count
  heads: int  # H (row r = b·H + h)
  table_heads: int  # heads of the position table (1: shared by the heads), 0: no positions

  @property
  def offsets(self) -> int:
    """Key-tile offsets u a row may read: 0..bound-1, or -(bound-1)..bound-1 bidirectionally."""
    return self.bound if self.causal else 2 * self.bound - 1

  @property
  def table_rows(self) -> int:
    return (2 * self.bound + 1) * self.tile

  def window_start(self, u: Any) -> Any:
    """First `table` row of the window of offset u: row rho holds the signed distance (bound+1)·B - 1 - rho,
    so the window of offset u (distances u·B + B - 1 down to u·B - B) starts at (bound - u)·B."""
    return (self.bound - u) * self.tile


def _stats(x: Array) -> Any:
  return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _finite(x: Array) -> Array:
  return jnp.where(jnp.isfinite(x.astype(jnp.float32)), x, jnp.zeros_like(x))


def _iota(n: int, m: int, axis: int) -> Array:
  return lax.broadcasted_iota(jnp.int32, (n, m), axis)


def _rotate_rows(x: Array, shift: int, sign: int) -> Array:
  """Row a of x rolled along lanes by shift + sign·a (x [B, 2B]): one static rotation, then one per bit of a
  (selected per row), as TPUs before v5 have no strided rotation."""
  b, n = x.shape
  x = pltpu.roll(x, shift % n, 1) if shift % n else x
  a = _iota(b, 1, 0)
  for bit in range(max(0, (b - 1).bit_length())):
    x = jnp.where((a >> bit) & 1 == 1, pltpu.roll(x, (sign << bit) % n, 1), x)
  return x


def _skew(qp: Array, b: int) -> Array:
  """[B, 2B] logits per window row (descending distance) -> [B, B] per pair: out[a, c] = qp[a, B - 1 - a + c]
  (row a rotated by B + 1 + a)."""
  return _rotate_rows(qp, b + 1, 1)[:, :b]


def _unskew(ds: Array, b: int) -> Array:
  """`_skew`'s transpose: [B, B] per pair -> [B, 2B] per window row: out[a, B - 1 - a + c] = ds[a, c], zeros
  elsewhere (row a rotated by B - 1 - a)."""
  return _rotate_rows(jnp.concatenate([ds, jnp.zeros_like(ds)], axis=1), b - 1, -1)


def _pair(plan: Plan, q: Array, k: Array, code: Array, window: Array | None, qtile: Any, ktile: Any,
          z: Any) -> tuple[Array, ...]:
  """Query tile `qtile` (q [B, d]) against key tile `ktile` (k [B, d] finite, code [1, B], window [2B, d]
  or None; z the row's span) -> (s [B, B] scaled logits, m soft mask, valid: real key, causal order, m > 0,
  band: real key, causal order, `corner_band`)."""
  b = plan.tile
  st = _stats(q)
  s = pallas.dot(q, k, trans_b=True).astype(st)
  if window is not None:
    s = s + _skew(pallas.dot(q, window.astype(q.dtype), trans_b=True).astype(st), b)
  s = s * plan.scale
  dist = (plan.front + qtile - ktile) * b + _iota(b, b, 0) - _iota(b, b, 1)  # (M + i) - j: [B, B]
  x = (dist if plan.causal else jnp.where(dist < 0, -dist, dist)).astype(st)
  zb = jnp.full((b, b), z, st)
  m = jnp.clip((plan.ramp + zb - x) / plan.ramp, 0.0, 1.0)
  ok = code > 0
  if plan.causal:
    ok = ok & (dist >= 0)
  d = x - zb
  top = zb >= plan.max_span  # the span can only shrink: the left derivative
  band = ok & ((top & (d >= 0) & (d < plan.ramp)) | (~top & (d > 0) & (d <= plan.ramp)))
  return s, m, ok & (m > 0), band


class _Stream(NamedTuple):
  src: Any  # a row's ref (GPU, interpret mode) or its view in HBM (TPU)
  index: Callable[[Any], tuple]  # loop value -> the tile's index into src


def _loop(lo: Any, hi: Any, streams: list[_Stream], body, carry, scratch):
  """carry after body(i, tiles, carry) for i in [lo, hi), tiles read from the streams: directly, or on TPU
  (scratch = buffers [2, *tile] per stream, then DMA semaphores [streams, 2]) copied into two VMEM slots,
  the next tile's copy started before this tile's work."""
  if not scratch:
    return lax.fori_loop(lo, hi, lambda i, c: body(i, [s.src[s.index(i)] for s in streams], c), carry)
  bufs, sems = scratch[:-1], scratch[-1]

  def copies(i, slot):
    return [pltpu.make_async_copy(s.src.at[s.index(i)], buf.at[slot], sems.at[n, slot])
            for n, (s, buf) in enumerate(zip(streams, bufs, strict=True))]

  return pallas.prefetched_loop(lo, hi, copies, lambda i, slot, c: body(i, [buf[slot] for buf in bufs], c),
                                carry)


def _key_range(plan: Plan, qtile: Any, trips: Any) -> tuple[Any, Any]:
  """[lo, hi) of the key tiles query tile `qtile` reads: offsets 0 <= u < T (bidirectionally |u| < T)."""
  own = plan.front + qtile
  lo = jnp.maximum(own - trips + 1, 0)
  return lo, (own + 1 if plan.causal else jnp.minimum(own + trips, plan.nk))


def _query_range(plan: Plan, ktile: Any, trips: Any) -> tuple[Any, Any]:
  """[lo, hi) of the query tiles that read key tile `ktile`."""
  first = ktile - plan.front  # the query tile whose own key tile it is
  lo = jnp.maximum(first if plan.causal else first - trips + 1, 0)
  return lo, jnp.minimum(first + trips, plan.nt)


def _window_stream(plan: Plan, src: Any, offset: Callable[[Any], Any]) -> _Stream:
  return _Stream(src, lambda i: (pl.ds(pl.multiple_of(plan.window_start(offset(i)), plan.tile),
                                       2 * plan.tile),))


def _forward_body(plan: Plan, refs: dict, scratch: tuple) -> None:
  t = pl.program_id(1)
  trips, z = refs["trips"][0, 0], refs["z"][0, 0]
  q = refs["q"][...]  # [B, d]
  st = _stats(q)
  lo, hi = _key_range(plan, t, trips)
  streams = [_Stream(refs["k"], lambda kt: (kt,)), _Stream(refs["v"], lambda kt: (kt,))]
  if plan.table_heads:
    streams.append(_window_stream(plan, refs["table"], lambda kt: plan.front + t - kt))

  def body(kt, tiles, carry):
    row_max, den, acc = carry
    k, v = _finite(tiles[0]), _finite(tiles[1])
    code = refs["code"][kt]  # [1, B]
    s, m, valid, _ = _pair(plan, q, k, code, tiles[2] if plan.table_heads else None, t, kt, z)
    # A visible key that held a NaN or Inf gets logit +inf: its query's max, weights and output turn NaN.
    s = jnp.where(valid, jnp.where(code > VALID, jnp.inf, s), -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(s, axis=1, keepdims=True))
    safe = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    p = m * jnp.exp(s - safe)  # exactly 0 where invalid
    keep = jnp.exp(row_max - safe)
    return new_max, keep * den + jnp.sum(p, axis=1, keepdims=True), keep * acc + pallas.dot(
        p.astype(v.dtype), v).astype(st)

  b = plan.tile
  init = (jnp.full((b, 1), -jnp.inf, st), jnp.zeros((b, 1), st), jnp.zeros(refs["o"].shape, st))
  row_max, den, acc = _loop(lo, hi, streams, body, init, scratch)
  seen = den > 0
  safe = jnp.where(seen, den, 1.0)
  refs["o"][...] = (acc / safe).astype(refs["o"].dtype)
  refs["lse"][...] = jnp.where(seen, row_max + jnp.log(safe), jnp.inf).T.astype(refs["lse"].dtype)


def _grads(plan: Plan, q: Array, do: Array, lse: Array, delta: Array, k: Array, v: Array, code: Array,
           window: Array | None, qtile: Any, ktile: Any, z: Any) -> tuple[Array, ...]:
  """One tile pair's backward: (weights a [B, B], ds = a (dp - delta), the d/dz terms e·g on the band)
  with lse, delta [B, 1] per query."""
  s, m, valid, band = _pair(plan, q, k, code, window, qtile, ktile, z)
  e = jnp.exp(jnp.where(valid | band, s, -jnp.inf) - lse)  # e^s / Z (lse = inf: a row without keys)
  a = jnp.where(valid, m * e, 0.0)
  g = pallas.dot(do, v, trans_b=True).astype(a.dtype) - delta
  return a, a * g, jnp.where(band, e * g, 0.0)


def _dq_body(plan: Plan, refs: dict, scratch: tuple) -> None:
  t = pl.program_id(1)
  trips, z = refs["trips"][0, 0], refs["z"][0, 0]
  q, do = refs["q"][...], refs["do"][...]  # [B, d], [B, e]
  st = _stats(q)
  lse, delta = refs["lse"][...].T, refs["delta"][...].T  # [B, 1]
  lo, hi = _key_range(plan, t, trips)
  streams = [_Stream(refs["k"], lambda kt: (kt,)), _Stream(refs["v"], lambda kt: (kt,))]
  if plan.table_heads:
    streams.append(_window_stream(plan, refs["table"], lambda kt: plan.front + t - kt))

  def body(kt, tiles, carry):
    dq, dz = carry
    k, v = _finite(tiles[0]), _finite(tiles[1])
    window = tiles[2] if plan.table_heads else None
    _, ds, dm = _grads(plan, q, do, lse, delta, k, v, refs["code"][kt], window, t, kt, z)
    dq = dq + pallas.dot(ds.astype(k.dtype), k).astype(st)
    if window is not None:
      dq = dq + pallas.dot(_unskew(ds, plan.tile).astype(k.dtype), window.astype(k.dtype)).astype(st)
    return dq, dz + jnp.sum(dm, axis=1, keepdims=True)

  b = plan.tile
  dq, dz = _loop(lo, hi, streams, body, (jnp.zeros(refs["dq"].shape, st), jnp.zeros((b, 1), st)), scratch)
  refs["dq"][...] = (dq * plan.scale).astype(refs["dq"].dtype)
  refs["dz"][...] = (dz / plan.ramp).T.astype(refs["dz"].dtype)


def _dkv_body(plan: Plan, refs: dict, scratch: tuple) -> None:
  kt = pl.program_id(1)
  trips, z = refs["trips"][0, 0], refs["z"][0, 0]
  k, v, code = _finite(refs["k"][...]), _finite(refs["v"][...]), refs["code"][...]
  st = _stats(k)
  lo, hi = _query_range(plan, kt, trips)
  at = lambda t: (t,)  # noqa: E731
  streams = [_Stream(refs[n], at) for n in ("q", "do", "lse", "delta")]
  if plan.table_heads:
    streams.append(_window_stream(plan, refs["table"], lambda t: plan.front + t - kt))

  def body(t, tiles, carry):
    dk, dv = carry
    q, do, lse, delta = tiles[:4]
    a, ds, _ = _grads(plan, q, do, lse.T, delta.T, k, v, code, tiles[4] if plan.table_heads else None, t,
                      kt, z)
    dv = dv + pallas.dot(a.T.astype(do.dtype), do).astype(st)
    return dk + pallas.dot(ds.T.astype(q.dtype), q).astype(st), dv

  zeros = (jnp.zeros(refs["dk"].shape, st), jnp.zeros(refs["dv"].shape, st))
  dk, dv = _loop(lo, hi, streams, body, zeros, scratch)
  refs["dk"][...] = (dk * plan.scale).astype(refs["dk"].dtype)
  refs["dv"][...] = dv.astype(refs["dv"].dtype)


def _table_grad_body(plan: Plan, refs: dict, scratch: tuple) -> None:
  """Program (offset index, h, b): the position term's gradient at the 2B table rows of one key-tile offset,
  over every query tile of row b·H + h, added to the block of its table head."""
  u = pl.program_id(0) - (0 if plan.causal else plan.bound - 1)
  h, b = pl.program_id(1), pl.program_id(2)
  trips, z = refs["trips"][0, 0], refs["z"][0, 0]
  first = (b == 0) if plan.table_heads > 1 else (b == 0) & (h == 0)

  @pl.when(first)
  def _():
    refs["dtable"][...] = jnp.zeros(refs["dtable"].shape, refs["dtable"].dtype)

  @pl.when(jnp.maximum(u, -u) < trips)
  def _():
    start = plan.window_start(u)
    if scratch:  # TPU: the window into the last slot of a stream buffer of its own
      window_buf, sem = scratch[-2], scratch[-1]
      copy = pltpu.make_async_copy(refs["table"].at[pl.ds(pl.multiple_of(start, plan.tile), 2 * plan.tile)],
                                   window_buf.at[0], sem.at[len(scratch) - 2, 0])
      copy.start()
      copy.wait()
      window, rest = window_buf[0], scratch[:-2] + scratch[-1:]
    else:
      window, rest = refs["table"][pl.ds(start, 2 * plan.tile)], scratch
    lo = jnp.maximum(u - plan.front, 0)
    hi = jnp.minimum(plan.nt, plan.nt + u)
    streams = [_Stream(refs[n], lambda t: (t,)) for n in ("q", "do", "lse", "delta")]
    streams += [_Stream(refs[n], lambda t: (plan.front + t - u,)) for n in ("k", "v")]

    def body(t, tiles, acc):
      q, do, lse, delta, k, v = tiles
      kt = plan.front + t - u
      _, ds, _ = _grads(plan, q, do, lse.T, delta.T, _finite(k), _finite(v), refs["code"][kt], window, t, kt,
                        z)
      return acc + pallas.dot(_unskew(ds, plan.tile).T.astype(q.dtype), q).astype(acc.dtype)

    acc = _loop(lo, hi, streams, body, jnp.zeros(refs["dtable"].shape, refs["dtable"].dtype), rest)
    refs["dtable"][...] += acc * plan.scale


def _call(platform: str | None, body, plan: Plan, grid: tuple, operands: list, outputs: list, *,
          row: Callable, tile: Callable, parallel: tuple, name: str):
  """One kernel, per platform. operands: (name, array, kind), kind "scalar" (a row's [1, 1]; SMEM on TPU),
  "tile" (the program's tile of a [rows, n, *tile] array), "row" (a row's whole array), "stream" (a row's
  whole array, looped over: on TPU left in HBM and copied tile by tile), "table" (the position table of the
  row's head, streamed by windows). outputs: (name, shape, dtype, block, index map). row(*grid) and
  tile(*grid) place a program. On TPU the streamed operands get a VMEM buffer of two slots each, in operand
  order, then one DMA semaphore array [streams, 2]."""
  names = [n for n, _, _ in operands] + [n for n, *_ in outputs]

  def spec(x, kind, on_tpu):
    if kind == "scalar":
      return pl.BlockSpec((None, 1, 1), lambda *g: (row(*g), 0, 0),
                          memory_space=pltpu.SMEM if on_tpu else None)
    if kind == "tile":
      return pl.BlockSpec((None, None, *x.shape[2:]), lambda *g: (row(*g), tile(*g), 0, 0))
    if on_tpu and kind in ("stream", "table"):
      return pl.BlockSpec(memory_space=pl.ANY)
    if kind == "table":
      return pl.BlockSpec((None, *x.shape[1:]), lambda *g: (_table_head(plan, row(*g)), 0, 0))
    return pl.BlockSpec((None, *x.shape[1:]), lambda *g: (row(*g),) + (0,) * (x.ndim - 1))

  def kernel(*refs, on_tpu):
    by_name = dict(zip(names, refs[:len(names)], strict=True))
    if on_tpu:  # a streamed operand's view of the program's row (or table head) in HBM
      r = row(*(pl.program_id(i) for i in range(len(grid))))
      for n, _, kind in operands:
        if kind in ("stream", "table"):
          by_name[n] = by_name[n].at[_table_head(plan, r) if kind == "table" else r]
    body(plan, by_name, tuple(refs[len(names):]))

  streamed = [(n, x) for n, x, kind in operands if kind in ("stream", "table")]
  slots = [(2 * plan.tile, x.shape[-1]) if n == "table" else tuple(x.shape[2:]) for n, x in streamed]
  scratch = [pltpu.VMEM((2, *slot), x.dtype) for slot, (_, x) in zip(slots, streamed, strict=True)]
  scratch.append(pltpu.SemaphoreType.DMA((len(streamed), 2)))
  call = pallas.platform_call(
      functools.partial(kernel, on_tpu=False), gpu_params=GPU_PARAMS,
      tpu_params=pltpu.CompilerParams(dimension_semantics=parallel),
      tpu_kw={"in_specs": [spec(x, kind, True) for _, x, kind in operands], "scratch_shapes": scratch},
      tpu_kernel=functools.partial(kernel, on_tpu=True), platform=platform, grid=grid,
      in_specs=[spec(x, kind, False) for _, x, kind in operands],
      out_specs=[pl.BlockSpec(block, index) for *_, block, index in outputs],
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype, _, _ in outputs], name=name)
  return call(*[x for _, x, _ in operands])


def _table_head(plan: Plan, r: Any) -> Any:
  return r % plan.heads if plan.table_heads > 1 else 0


def _fold(plan: Plan, g: Array) -> Array:
  """The position kernel's [table heads, offsets, 2B, d] windows -> the table's gradient [table heads, rows,
  d]: window u covers table tiles bound - u and bound - u + 1."""
  heads, offsets, _, d = g.shape
  b = plan.tile
  start = plan.bound - (np.arange(offsets) - (0 if plan.causal else plan.bound - 1))  # [offsets]
  tiles = jnp.zeros((heads, 2 * plan.bound + 1, b, d), g.dtype)
  tiles = tiles.at[:, start].add(g[:, :, :b]).at[:, start + 1].add(g[:, :, b:])
  return tiles.reshape(heads, -1, d)


def _zero_cotangent(x: Array) -> Any:
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _scalars(plan: Plan, z: Array, trips: Array) -> list:
  rows = z.shape[0]
  return [("trips", trips.reshape(rows, 1, 1), "scalar"), ("z", z.reshape(rows, 1, 1), "scalar")]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(platform: str | None, plan: Plan, q: Array, k: Array, v: Array, z: Array, table: Array | None,
           aux: tuple[Array, Array]) -> Array:
  return _flash_fwd(platform, plan, q, k, v, z, table, aux)[0]


def _flash_fwd(platform, plan, q, k, v, z, table, aux):
  code, trips = aux
  rows, nt, b, _ = q.shape
  e = v.shape[-1]
  at = lambda r, t: (r, t, 0, 0)  # noqa: E731
  extra = [("table", table, "table")] if table is not None else []
  o, lse = _call(
      platform, _forward_body, plan, (rows, nt),
      _scalars(plan, z, trips) + [("q", q, "tile"), ("code", code, "row"), ("k", k, "stream"),
                                  ("v", v, "stream")] + extra,
      [("o", (rows, nt, b, e), q.dtype, (None, None, b, e), at),
       ("lse", (rows, nt, 1, b), z.dtype, (None, None, 1, b), at)],
      row=lambda r, t: r, tile=lambda r, t: t, parallel=("parallel", "parallel"), name="adaptive_span_fwd")
  return o, (q, k, v, z, table, aux, o, lse)


def _flash_bwd(platform, plan, res, do):
  q, k, v, z, table, aux, o, lse = res
  code, trips = aux
  rows, nt, b, d = q.shape
  nk, e = k.shape[1], v.shape[-1]
  st = z.dtype
  delta = jnp.sum(do.astype(st) * o.astype(st), axis=-1)[:, :, None, :]  # [rows, nt, 1, B]
  do = do.astype(q.dtype)
  at = lambda r, t: (r, t, 0, 0)  # noqa: E731
  scalars = _scalars(plan, z, trips)
  extra = [("table", table, "table")] if table is not None else []
  place = dict(row=lambda r, t: r, tile=lambda r, t: t, parallel=("parallel", "parallel"))
  dq, dz = _call(
      platform, _dq_body, plan, (rows, nt),
      scalars + [("q", q, "tile"), ("do", do, "tile"), ("lse", lse, "tile"), ("delta", delta, "tile"),
                 ("code", code, "row"), ("k", k, "stream"), ("v", v, "stream")] + extra,
      [("dq", q.shape, q.dtype, (None, None, b, d), at),
       ("dz", (rows, nt, 1, b), st, (None, None, 1, b), at)],
      **place, name="adaptive_span_dq")
  dk, dv = _call(
      platform, _dkv_body, plan, (rows, nk),
      scalars + [("code", code, "tile"), ("k", k, "tile"), ("v", v, "tile"), ("q", q, "stream"),
                 ("do", do, "stream"), ("lse", lse, "stream"), ("delta", delta, "stream")] + extra,
      [("dk", k.shape, k.dtype, (None, None, b, d), at), ("dv", v.shape, v.dtype, (None, None, b, e), at)],
      **place, name="adaptive_span_dkv")
  dtable = None
  if table is not None:
    heads = plan.heads
    window = (None, None, 2 * b, table.shape[-1])
    (g,) = _call(
        platform, _table_grad_body, plan, (plan.offsets, heads, rows // heads),
        scalars + [("code", code, "row"), ("q", q, "stream"), ("do", do, "stream"), ("lse", lse, "stream"),
                   ("delta", delta, "stream"), ("k", k, "stream"), ("v", v, "stream"),
                   ("table", table, "table")],
        [("dtable", (table.shape[0], plan.offsets, *window[2:]), st, window,
          lambda u, h, bb: (h if plan.table_heads > 1 else 0, u, 0, 0))],
        row=lambda u, h, bb: bb * heads + h, tile=None, parallel=("parallel", "arbitrary", "arbitrary"),
        name="adaptive_span_dtable")
    dtable = _fold(plan, g).astype(table.dtype)
  dz = jnp.sum(dz, axis=(1, 2, 3)).astype(z.dtype)
  return dq, dk, dv, dz, dtable, jax.tree.map(_zero_cotangent, aux)


_flash.defvjp(_flash_fwd, _flash_bwd)


def position_table(plan: Plan, positions: Array, reach: Array, dtype: Any) -> Array:
  """p [table heads, P, d] -> the table by signed distance [table heads, (2 bound + 1)·B, d] in `dtype`: row
  rho holds p_|y|, y = (bound + 1)·B - 1 - rho, where |y| < P, |y| <= reach (max z + R: farther rows are
  never read, a NaN there stays out) and, causal, y >= 0; zeros elsewhere."""
  y = (plan.bound + 1) * plan.tile - 1 - np.arange(plan.table_rows)
  x = np.abs(y)
  ok = jnp.asarray((x < positions.shape[1]) & ((y >= 0) | (not plan.causal))) & (x <= reach)
  rows = jnp.take(positions.astype(dtype), np.minimum(x, positions.shape[1] - 1), axis=1)
  return jnp.where(ok[None, :, None], rows, 0.0)


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def attend(q: Array, k: Array, v: Array, real: Array, z: Array, positions: Array | None, *, causal: bool,
           ramp: float, max_span: float, window: int) -> Array:
  """Adaptive-span attention in the kernels.

  q [batch, heads, L, d]; k [batch, heads, M + L, d]; v [batch, heads, M + L, e]; real [batch, M + L] key
  mask; z [heads] the clamped spans (differentiable); positions None or [heads or 1, P, d] (differentiable);
  window: ceil(max_span + R), the farthest distance + 1 a key is read at. Returns [batch, heads, L, e] in
  q's dtype."""
  batch, heads, length, head_dim = q.shape
  memory = k.shape[2] - length
  value_dim = v.shape[-1]
  st = _stats(q)
  b = tile_size(length)
  nt = -(-length // b)
  lead = -memory % b
  front = (lead + memory) // b
  nk = front + nt
  bound = min(nk, -(-(window + b - 1) // b))
  table_heads = 0 if positions is None else positions.shape[0]
  plan = Plan(bool(causal), float(ramp), float(max_span), float(head_dim ** -0.5), b, nt, nk, front, bound,
              heads, table_heads)
  rows = batch * heads
  d, e = _pow2(head_dim), _pow2(value_dim)

  def keys(x: Array, width: int) -> Array:  # [batch, heads, M + L, w] -> [rows, nk, B, width]
    x = pad_to(x.reshape(rows, -1, x.shape[-1]), width, 2)
    return jnp.pad(x, ((0, 0), (lead, nk * b - lead - x.shape[1]), (0, 0))).reshape(rows, nk, b, width)

  qt = pad_to(pad_to(q.reshape(rows, length, head_dim), nt * b, 1), d, 2).reshape(rows, nt, b, d)
  kt, vt = keys(k.astype(q.dtype), d), keys(v.astype(q.dtype), e)
  finite = jnp.all(jnp.isfinite(k), axis=-1) & jnp.all(jnp.isfinite(v), axis=-1)  # [batch, heads, M + L]
  code = jnp.where(real[:, None, :], jnp.where(finite, VALID, NONFINITE), 0.0).astype(jnp.float32)
  code = jnp.swapaxes(keys(code[..., None], 1), 2, 3)  # [rows, nk, 1, B]
  zr = jnp.tile(z.astype(st), batch)  # [rows]: row b·H + h has z_h
  trips = jnp.clip(jnp.floor((lax.stop_gradient(zr) + ramp - 1) / b) + 2, 1, bound).astype(jnp.int32)
  table = None
  if positions is not None:
    reach = lax.stop_gradient(jnp.max(z)) + ramp
    table = pad_to(position_table(plan, positions, reach.astype(st), st), d, 2)
  out = _flash(contract.traced_platform(), plan, qt, kt, vt, zr, table, (code, trips))  # [rows, nt, B, e]
  return out.reshape(rows, nt * b, e)[:, :length, :value_dim].reshape(batch, heads, length, value_dim)
