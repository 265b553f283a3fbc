"""YOSO's bucket tables as fused Pallas kernels (Triton on GPU, Mosaic on TPU, interpreted on CPU).

The same sums as the one-hot formulation of `yoso.tables` (per hash t, the table T_t = onehot(write codes)^T
rows, [2^tau, L] x [L, f], read back as onehot(read codes) T_t), but the one-hot factors are made tile by tile
on chip and never written to device memory, and every hash of a group runs in one kernel launch:

  build: grid (groups, hashes). A program walks the rows in tiles of TILE, makes the [2^tau, TILE] one-hot of
         its hash's codes and accumulates [2^tau, TILE] x [TILE, f] into its table in float32.
  read:  grid (groups, row tiles). A program loops over the hashes, making the [TILE, 2^tau] one-hot of its
         rows' codes and adding [TILE, 2^tau] x [2^tau, f] table products in float32. On TPU the hashes
         come in chunks whose tables fit VMEM (grid (groups, chunks, row tiles)), one partial sum each.

  pair_sums: grid (groups, row tiles), one hash, rows sorted by code. out_a = sum_b [code(a) = code(b)]
         (x_a . y_b) z_b, the exact backward's dQ (a queries, b keys: x dY, y v, z k) and dK (a keys, b
         queries: x v, y dY, z q). Sorted, a tile's partners form one contiguous run of the other side's
         tiles (its `ranges`, computed outside), which the program walks as flash attention walks its keys:
         [TILE, TILE] products x y^T, masked to equal codes, times z. O(L * partners * d), no [L, L] array.
         On TPU the program copies just those tiles from HBM (VMEM holds no whole row set).

Build and read take optional per-hash row weights w [groups, hashes, L]: the build then sums w_tj rows_j
(the weight rides in the one-hot factor: w where the code matches, 0 elsewhere) and the read scales row i's
product by w_ti. The sketched backward is these weighted sums (`yoso.tables`). Several row sets share one
build or read (one one-hot, several products): dV's table of dY and dK's of weighted q.

Matmul operands are bfloat16 with float32 accumulation: "bfloat16" operands (for bfloat16 inputs) go as
they are; "float32" operands are split in two bfloat16 parts (x = hi + lo to 16 significant bits; the
one-hot factor is exact, a weighted one is split too: three products), as on the tensor cores' and the
MXU's fast paths; float64 operands (exact tests, interpret mode) stay float64. Tables are float32 sums.

Codes >= 2^tau (masked keys, padding) match no bucket. Bucket counts and row widths are padded to powers of
two >= 16 for Triton (zero rows and columns, sliced off). The caller zeroes rows that must not count: a zero
one-hot entry times a non-finite row is still NaN in a product, so a non-finite real row reaches every reader
of its group (as a non-finite visible key does in dense attention).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from attention_core import pallas
from attention_core.blocks import pad_to

Array = Any

TILE = 128  # rows per step; a multiple of the TPU's 128 lanes, and Triton's power-of-two loads
MIN_DIM = 16  # buckets and row widths are padded to powers of two >= this (Triton's dot sizes)
OPERANDS = ("bfloat16", "float32")
BUILD_GPU = pltriton.CompilerParams(num_warps=8, num_stages=2)  # a [2^tau, f] float32 accumulator
READ_GPU = pltriton.CompilerParams(num_warps=4, num_stages=2)
PAIRS_GPU = pltriton.CompilerParams(num_warps=4, num_stages=2)
TPU_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
BUILD_TPU = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
# Rows a TPU build program holds in VMEM at once: the grid walks longer sequences in chunks of this many rows
# (v4 has 16 MiB of VMEM; whole rows of a few thousand positions, double-buffered, overflow it). GPUs read
# every row from global memory and take one chunk.
BUILD_ROWS = 1024
# VMEM a TPU read program may give its tables (double-buffered, rows padded to 128 lanes): the hashes come in
# chunks of at most this much, one partial output each, summed after. 32 hashes of 256 buckets in two
# float32 parts fill it; the sketched backward's two table sets take two chunks.
READ_TABLES_VMEM = 8 << 20
READ_TPU = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))


def _parts(x: Array, operands: str) -> list[Array]:
  """x as the matmul operands that sum to it: [x] in float64 or for bfloat16 operands (cast), [hi, lo]
  bfloat16 for float32 ones."""
  if x.dtype == jnp.float64:
    return [x]
  if operands == "bfloat16":
    return [x.astype(jnp.bfloat16)]
  hi = x.astype(jnp.bfloat16)
  return [hi, (x.astype(jnp.float32) - hi.astype(jnp.float32)).astype(jnp.bfloat16)]


def _product(a_parts: list[Array], b_parts: list[Array], trans_a: bool = False, trans_b: bool = False
             ) -> Array:
  """sum of a_i @ b_j over the part pairs that carry the precision (hi.hi, hi.lo, lo.hi), float32 sums."""
  out = 0.0
  for i, a in enumerate(a_parts):
    for j, b in enumerate(b_parts):
      if i + j <= 1:
        out = out + pallas.dot(a, b, trans_a=trans_a, trans_b=trans_b)
  return out


def _onehot_parts(hit: Array, weights: Array | None, like: Array, operands: str) -> list[Array]:
  """The one-hot factor of a product: hit as 0/1 (exact in bfloat16), or weights where hit, split."""
  if weights is None:
    dtype = jnp.float64 if like.dtype == jnp.float64 else jnp.bfloat16
    return [hit.astype(dtype)]
  return _parts(jnp.where(hit, weights, 0), operands)


def _split_refs(refs: Sequence[Any], has_weights: bool) -> tuple[Any, Any, Sequence[Any]]:
  """(codes_ref, weights_ref or None, the rest) of a kernel's refs."""
  return (refs[0], refs[1], refs[2:]) if has_weights else (refs[0], None, refs[1:])


def _build_kernel(*refs, buckets: int, weighted: Sequence[bool], operands: str, has_weights: bool):
  """One (group, hash, row chunk): tables[f_s] += sum_j onehot_j (w_j) rows_s[j] over the chunk's rows j.
  codes_ref, weights_ref [1, C]; rows refs [C, f_s]; table refs [buckets, f_s], the same block for every
  chunk (grid axis 2 runs in order), zeroed by the first."""
  codes_ref, weights_ref, refs = _split_refs(refs, has_weights)
  rows_refs, out_refs = refs[:len(weighted)], refs[len(weighted):]
  steps = rows_refs[0].shape[0] // TILE

  def step(i, accs):
    start = pl.multiple_of(i * TILE, TILE)
    codes = codes_ref[:, pl.ds(start, TILE)]  # [1, T]
    hit = lax.broadcasted_iota(jnp.int32, (buckets, TILE), 0) == codes  # [B, T]
    w = None if weights_ref is None else weights_ref[:, pl.ds(start, TILE)]  # [1, T]
    out = []
    for acc, rows_ref, weigh in zip(accs, rows_refs, weighted, strict=True):
      rows = rows_ref[pl.ds(start, TILE), :]  # [T, f]
      onehot = _onehot_parts(hit, w if weigh else None, rows, operands)
      out.append(acc + _product(onehot, _parts(rows, operands)))  # [B, f]
    return tuple(out)

  @pl.when(pl.program_id(2) == 0)
  def _():
    for ref in out_refs:
      ref[...] = jnp.zeros(ref.shape, ref.dtype)

  init = tuple(jnp.zeros(ref.shape, ref.dtype) for ref in out_refs)
  accs = lax.fori_loop(0, steps, step, init)
  for ref, acc in zip(out_refs, accs, strict=True):
    ref[...] += acc.astype(ref.dtype)


def _read_kernel(*refs, buckets: int, weighted: Sequence[bool], parts: int, has_weights: bool):
  """One (group, row tile) or, on TPU, (group, hash chunk, row tile): out_s[i] = sum_t (w_ti) onehot_ti
  tables_s[t] over its m hashes. codes_ref, weights_ref [m, 1, T] (rows on lanes: a [T, 1] block would be
  padded to 128 lanes in TPU VMEM, 128 times its size); table refs (parts each, the table's operand parts)
  [m, buckets, f_s]; out refs [T, f_s]."""
  codes_ref, weights_ref, refs = _split_refs(refs, has_weights)
  n = len(weighted)
  table_refs, out_refs = refs[:n * parts], refs[n * parts:]

  def step(t, accs):
    codes = codes_ref[t]  # [1, T]
    hit = lax.broadcasted_iota(jnp.int32, (buckets, TILE), 0) == codes  # [B, T]
    w = None if weights_ref is None else weights_ref[t].T  # [T, 1]
    out = []
    for s, (acc, weigh) in enumerate(zip(accs, weighted, strict=True)):
      table = [table_refs[s * parts + p][t] for p in range(parts)]  # [B, f] each
      dtype = jnp.float64 if table[0].dtype == jnp.float64 else jnp.bfloat16
      val = _product([hit.astype(dtype)], table, trans_a=True)  # [T, f]
      out.append(acc + (val * w if weigh else val))
    return tuple(out)

  init = tuple(jnp.zeros(ref.shape, _sum_dtype(ref)) for ref in out_refs)
  accs = lax.fori_loop(0, codes_ref.shape[0], step, init)
  for ref, acc in zip(out_refs, accs, strict=True):
    ref[...] = acc.astype(ref.dtype)


def _sum_dtype(x: Array) -> Any:
  """Tables and reads are float32 sums (float64 for float64 operands)."""
  return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _padded(length: int) -> int:
  return -(-length // TILE) * TILE


def _pow2(n: int) -> int:
  """The smallest power of two >= max(n, MIN_DIM): Triton's loads and dots want power-of-two sizes >= 16."""
  p = MIN_DIM
  while p < n:
    p *= 2
  return p


def _read_chunk(hashes: int, buckets: int, widths: Sequence[int], parts: int) -> int:
  """The most hashes, a divisor of `hashes`, whose tables (double-buffered bfloat16 parts, [buckets, width]
  tiles of (16, 128)) fit READ_TABLES_VMEM on TPU; at least one."""
  lanes = sum(-(-f // 128) * 128 for f in widths)
  per_hash = 2 * parts * (-(-buckets // 16) * 16) * lanes * 2
  fit = max(1, READ_TABLES_VMEM // per_hash)
  return max(c for c in range(1, hashes + 1) if hashes % c == 0 and c <= fit)


def _none_to(codes: Array, buckets: int, kernel_buckets: int) -> Array:
  """Codes >= buckets (no bucket) moved past the kernel's padded bucket range."""
  return jnp.where(codes >= buckets, kernel_buckets, codes)


def build(codes: Array, rows: Sequence[Array], weights: Array | None = None,
          weighted: Sequence[bool] | None = None, *, buckets: int, operands: str) -> list[Array]:
  """Per hash, the tables T_t[c] = sum of (w_tj) rows_j over j with code_t(j) = c.

  codes [g, m, L] int32 (>= buckets: no bucket); rows: row sets [g, L, f_s]; weights None or [g, m, L];
  weighted: per row set, whether it takes the weights (default: all when weights are given).
  Returns one table [g, m, buckets, f_s] per row set, float32 (float64 for float64 rows).
  """
  g, m, length = codes.shape
  weighted = tuple(weighted if weighted is not None else [weights is not None] * len(rows))
  padded, kb = _padded(length), _pow2(buckets)
  chunk = min(padded, BUILD_ROWS)  # TPU: rows per program; `padded` a whole number of chunks
  padded = -(-padded // chunk) * chunk
  codes = pad_to(_none_to(codes, buckets, kb), padded, 2, fill=kb)[:, :, None, :]  # [g, m, 1, Lp]
  widths = [r.shape[-1] for r in rows]
  rows = [pad_to(pad_to(r, _pow2(f), 2), padded, 1) for r, f in zip(rows, widths, strict=True)]  # [g, Lp, F]
  args = [codes] + ([] if weights is None else [pad_to(weights, padded, 2)[:, :, None, :]]) + rows

  def specs(c):  # row chunks of c rows: (in_specs, grid)
    hash_row = pl.BlockSpec((None, None, 1, c), lambda b, t, i: (b, t, 0, i))
    return ([hash_row] * (1 + (weights is not None))
            + [pl.BlockSpec((None, c, r.shape[-1]), lambda b, t, i: (b, i, 0)) for r in rows],
            (g, m, padded // c))

  (in_specs, grid), (tpu_specs, tpu_grid) = specs(padded), specs(chunk)
  kernel = functools.partial(_build_kernel, buckets=kb, weighted=weighted, operands=operands,
                             has_weights=weights is not None)
  call = pallas.platform_call(
      kernel, grid=grid, in_specs=in_specs, gpu_params=BUILD_GPU, tpu_params=BUILD_TPU,
      tpu_kw={"in_specs": tpu_specs, "grid": tpu_grid},
      out_specs=[pl.BlockSpec((None, None, kb, r.shape[-1]), lambda b, t, i: (b, t, 0, 0)) for r in rows],
      out_shape=[jax.ShapeDtypeStruct((g, m, kb, r.shape[-1]), _sum_dtype(r)) for r in rows])
  return [t[:, :, :buckets, :f] for t, f in zip(call(*args), widths, strict=True)]


def read(codes: Array, tables: Sequence[Array], weights: Array | None = None,
         weighted: Sequence[bool] | None = None, *, operands: str) -> list[Array]:
  """out_s[i] = sum_t (w_ti) T^s_t[code_t(i)] for each table set.

  codes [g, m, L] int32 (>= buckets: reads nothing); tables [g, m, buckets, f_s] (from `build`); weights
  None or [g, m, L]; weighted per table set as in `build`. Returns [g, L, f_s] each, float32 (float64 for
  float64 tables).
  """
  g, m, length = codes.shape
  buckets = tables[0].shape[2]
  weighted = tuple(weighted if weighted is not None else [weights is not None] * len(tables))
  padded, kb = _padded(length), _pow2(buckets)
  widths = [t.shape[-1] for t in tables]
  tables = [pad_to(pad_to(t, _pow2(f), 3), kb, 2) for t, f in zip(tables, widths, strict=True)]
  args = [pad_to(_none_to(codes, buckets, kb), padded, 2, fill=kb)[:, :, None, :]]  # [g, m, 1, Lp]
  if weights is not None:
    args.append(pad_to(weights, padded, 2)[:, :, None, :])
  split = [_parts(table, operands) for table in tables]
  parts = len(split[0])
  args += [p for table_parts in split for p in table_parts]
  kernel_widths = [t.shape[-1] for t in tables]
  chunk = _read_chunk(m, kb, kernel_widths, parts)

  def specs(h, row_index, table_index):  # blocks of h hashes
    return ([pl.BlockSpec((None, h, 1, TILE), row_index)] * (1 + (weights is not None))
            + [pl.BlockSpec((None, h, kb, t.shape[-1]), table_index) for t in tables for _ in range(parts)])

  tpu_kw = {  # grid (g, hash chunks, row tiles); out [g, chunks, Lp, F], each chunk's partial sums
      "grid": (g, m // chunk, padded // TILE),
      "in_specs": specs(chunk, lambda b, c, i: (b, c, 0, i), lambda b, c, i: (b, c, 0, 0)),
      "out_specs": [pl.BlockSpec((None, None, TILE, f), lambda b, c, i: (b, c, i, 0)) for f in kernel_widths],
      "out_shape": [jax.ShapeDtypeStruct((g, m // chunk, padded, t.shape[-1]), _sum_dtype(t))
                    for t in tables]}
  kernel = functools.partial(_read_kernel, buckets=kb, weighted=weighted, parts=parts,
                             has_weights=weights is not None)
  call = pallas.platform_call(
      kernel, grid=(g, padded // TILE),
      in_specs=specs(m, lambda b, i: (b, 0, 0, i), lambda b, i: (b, 0, 0, 0)),
      gpu_params=READ_GPU, tpu_params=READ_TPU, tpu_kw=tpu_kw,
      tpu_finish=lambda outs: type(outs)(out.sum(1) for out in outs),  # the chunks' partial sums
      out_specs=[pl.BlockSpec((None, TILE, f), lambda b, i: (b, i, 0)) for f in kernel_widths],
      out_shape=[jax.ShapeDtypeStruct((g, padded, t.shape[-1]), _sum_dtype(t)) for t in tables])
  return [out[:, :length, :f] for out, f in zip(call(*args), widths, strict=True)]


def _pair_step(x: list[Array], codes: Array, b_codes: Array, y: Array, z: Array, acc: Array, operands: str
               ) -> Array:
  """acc + where(codes equal, x y^T, 0) z for one b tile: x the a tile's parts [T, e], codes [T, 1];
  b_codes [1, T]; y [T, e]; z [T, d]."""
  s = _product(x, _parts(y, operands), trans_b=True)  # [T, T]
  w = jnp.where(codes == b_codes, s, 0.0)
  return acc + _product(_parts(w, operands), _parts(z, operands))  # [T, d]


def _pair_kernel(ranges_ref, a_codes_ref, x_ref, b_codes_ref, y_ref, z_ref, out_ref, *, operands: str):
  """One (group, a tile): out = sum over the b tiles in its range of where(codes equal, x y^T, 0) z.
  ranges_ref [tiles, 2] (the group's first and end b tile per a tile); a_codes_ref [T, 1]; x_ref [T, e];
  b_codes_ref [1, Lb]; y_ref [Lb, e]; z_ref [Lb, d]; out_ref [T, d]."""
  tile = pl.program_id(1)
  x = _parts(x_ref[...], operands)  # [T, e]

  def step(b, acc):
    rows = pl.ds(pl.multiple_of(b * TILE, TILE), TILE)
    return _pair_step(x, a_codes_ref[...], b_codes_ref[:, rows], y_ref[rows, :], z_ref[rows, :], acc,
                      operands)

  init = jnp.zeros(out_ref.shape, _sum_dtype(x_ref))
  acc = lax.fori_loop(ranges_ref[tile, 0], ranges_ref[tile, 1], step, init)
  out_ref[...] = acc.astype(out_ref.dtype)


def _pair_kernel_tpu(ranges_ref, a_codes_ref, x_ref, b_codes_hbm, y_hbm, z_hbm, out_ref, codes_buf, y_buf,
                     z_buf, sems, *, operands: str):
  """`_pair_kernel` on TPU: the b side stays in HBM and the program copies only the tiles of its range into
  VMEM, two slots, the next tile's copy running under this tile's products (whole rows of a few thousand
  positions, double-buffered, overflow a v4 core's 16 MiB of VMEM). b_codes_hbm [g, 1, Lb]; y_hbm [g, Lb, e];
  z_hbm [g, Lb, d]; codes_buf [2, 1, T], y_buf [2, T, e], z_buf [2, T, d]; sems DMA [3, 2]."""
  group, tile = pl.program_id(0), pl.program_id(1)
  lo, hi = ranges_ref[tile, 0], ranges_ref[tile, 1]
  x = _parts(x_ref[...], operands)  # [T, e]

  def copies(b, slot):
    rows = pl.ds(pl.multiple_of(b * TILE, TILE), TILE)
    return [pltpu.make_async_copy(b_codes_hbm.at[group, :, rows], codes_buf.at[slot], sems.at[0, slot]),
            pltpu.make_async_copy(y_hbm.at[group, rows, :], y_buf.at[slot], sems.at[1, slot]),
            pltpu.make_async_copy(z_hbm.at[group, rows, :], z_buf.at[slot], sems.at[2, slot])]

  def step(b, slot, acc):
    return _pair_step(x, a_codes_ref[...], codes_buf[slot], y_buf[slot], z_buf[slot], acc, operands)

  acc = pallas.prefetched_loop(lo, hi, copies, step, jnp.zeros(out_ref.shape, _sum_dtype(x_ref)))
  out_ref[...] = acc.astype(out_ref.dtype)


def tile_ranges(a_codes: Array, b_codes: Array) -> Array:
  """[g, tiles of a, 2]: for each TILE of the sorted a codes [g, La], the first and end tile of the sorted b
  codes [g, Lb] holding its codes (its run of partners; empty when none)."""
  length = a_codes.shape[1]
  starts = jnp.arange(0, length, TILE)
  first = a_codes[:, starts]  # [g, n] each tile's smallest code
  last = a_codes[:, jnp.minimum(starts + TILE, length) - 1]  # and largest
  lo = jax.vmap(lambda b, c: jnp.searchsorted(b, c, side="left"))(b_codes, first)
  hi = jax.vmap(lambda b, c: jnp.searchsorted(b, c, side="right"))(b_codes, last)
  return jnp.stack([lo // TILE, -(-hi // TILE)], axis=-1).astype(jnp.int32)  # [g, n, 2]


def pair_sums(a_codes: Array, x: Array, b_codes: Array, y: Array, z: Array, *, operands: str) -> Array:
  """out_a = sum_b [a_codes_a = b_codes_b] (x_a . y_b) z_b for one hash, both sides sorted by code.

  a_codes [g, La], b_codes [g, Lb] int32, each ascending along L (equal codes pair; give rows that pair with
  nothing codes no row of the other side has); x [g, La, e]; y [g, Lb, e]; z [g, Lb, d], rows that pair with
  nothing zero (a zero weight times a non-finite row is still NaN in a product). Returns [g, La, d], float32
  (float64 for float64 inputs).
  """
  g, la = a_codes.shape
  lb = b_codes.shape[1]
  pa, pb = _padded(la), _padded(lb)
  # [g, R, 2], R a power of two >= the tiles (Triton's block sizes), extra rows empty
  ranges = pad_to(tile_ranges(a_codes, b_codes), _pow2(pa // TILE), 1)
  big = jnp.iinfo(jnp.int32).max
  a_codes = pad_to(a_codes, pa, 1, fill=big - 1)[..., None]  # [g, Pa, 1]; padding pairs with nothing
  b_codes = pad_to(b_codes, pb, 1, fill=big)[:, None, :]  # [g, 1, Pb]
  e, d = _pow2(x.shape[-1]), _pow2(z.shape[-1])
  x = pad_to(pad_to(x, e, 2), pa, 1)
  y, z_p = (pad_to(pad_to(t, w, 2), pb, 1) for t, w in ((y, e), (z, d)))
  tile = lambda width: pl.BlockSpec((None, TILE, width), lambda b, i: (b, i, 0))  # noqa: E731
  whole = lambda width: pl.BlockSpec((None, pb, width), lambda b, i: (b, 0, 0))  # noqa: E731
  range_spec = pl.BlockSpec((None, ranges.shape[1], 2), lambda b, i: (b, 0, 0))
  common = dict(
      grid=(g, pa // TILE), gpu_params=PAIRS_GPU, tpu_params=TPU_PARAMS,
      out_specs=pl.BlockSpec((None, TILE, d), lambda b, i: (b, i, 0)),
      out_shape=jax.ShapeDtypeStruct((g, pa, d), _sum_dtype(x)))
  specs = [range_spec, tile(1), tile(e), pl.BlockSpec((None, 1, pb), lambda b, i: (b, 0, 0)), whole(e),
           whole(d)]
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  tpu_kw = {  # loop bounds are scalars in SMEM; the b side stays in HBM, its tiles copied in by the kernel
      "in_specs": [pl.BlockSpec((None, ranges.shape[1], 2), lambda b, i: (b, 0, 0), memory_space=pltpu.SMEM),
                   *specs[1:3], hbm, hbm, hbm],
      "scratch_shapes": [pltpu.VMEM((2, 1, TILE), b_codes.dtype), pltpu.VMEM((2, TILE, e), y.dtype),
                         pltpu.VMEM((2, TILE, d), z_p.dtype), pltpu.SemaphoreType.DMA((3, 2))]}
  call = pallas.platform_call(functools.partial(_pair_kernel, operands=operands), in_specs=specs,
                              tpu_kernel=functools.partial(_pair_kernel_tpu, operands=operands),
                              tpu_kw=tpu_kw, **common)
  return call(ranges, a_codes, x, b_codes, y, z_p)[:, :la, :z.shape[-1]]
