"""A block-sparse flash-attention kernel (Pallas) that every Combiner plan and sparse counterpart runs on.

Every plan is "each query group attends to a few key sets": its own block or row (direct keys), its own
column (the same kernel on a column-major layout of the grid), span summaries (pooled keys with their in-span
expected values) and, for logsparse, one span key per dyadic level. `attend` takes queries laid out in
groups, q [bh, groups, group_len, head_dim], and a static list of `Source`s: key/value sets that are either
the group's own ([bh, groups, n, dim]) or shared by every group ([bh, 1, n, dim]), each with a key-validity
mask and a structural rule comparing a query id (its row in the group, or its group's index) with the key's
index ("all", "le", "lt", "ne") or with a per-key row range ("range"). The kernel runs one online softmax
over all sources of a query tile and returns the normalised output and its log-sum-exp, both float32; calls
on different layouts (row- and column-major) then combine exactly with `merge`, O(L·d) work in XLA.

Forward: grid (bh, groups, query tiles). A query tile [block_q, head_dim] stays on chip; each source is one
block holding the whole set ([n, dim]; n is small: a block, a row, a column, the summaries), read in key
tiles of block_k with `pl.ds` inside a `fori_loop` that stops after the last key a causal rule lets the tile
see. Matmuls take the input dtype (bfloat16 on accelerators) and accumulate in float32; softmax statistics
are float32. Nothing of size [L, n] is written to device memory. Key and value tiles have non-finite entries
selected to 0 before any product, and a per-key code marks the keys that had any: a query that sees such a key
gets NaN (as the XLA plans give it), while a NaN behind a mask or in the future reaches no output.

Backward (custom_vjp; recomputation from the saved log-sum-exp as in FlashAttention-2): one dq kernel with
the forward's grid and loops, and one dk/dv kernel per source with grid (bh, key groups, key tiles) looping
over the query tiles that can see its key tile (its group's, or every group's for a shared source): no
atomics. The log-sum-exp output is differentiable (`merge` uses it); its cotangent enters as delta - dlse.

Block shapes satisfy both lowerings: Triton (GPU) needs power-of-two loads, Mosaic (TPU) needs the last two
block dims divisible by (8, 128) or equal to the array's. Tiles are powers of two >= 16, group and source
lengths are padded to whole tiles (padded keys invalid, padded queries dropped), per-key data sits in [rows,
n] blocks with n on lanes. `lax.platform_dependent` picks Triton on GPU, Mosaic on TPU and interpret mode on
CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from attention_core import contract, pallas
from attention_core.blocks import pad_to

Array = Any
RULES = ("all", "le", "lt", "ne", "range")
QIDS = ("row", "group")
BLOCK_Q = 128  # query / key tile caps on TPU (its 128 lanes) and in interpret mode
BLOCK_K = 128
LANES = 128  # TPU vector lanes: per-query statistics are stored with queries on lanes
GPU_BLOCK_Q = 64  # on GPUs, where smaller tiles keep more programs in flight (scripts/tune_kernels.py)
GPU_BLOCK_K = 64
MIN_BLOCK = 16
SPLIT_TILES = 2  # query tiles per program in the dk/dv kernel of a shared (summary) source, at least
# Partial sums of a shared source's splits hold at most 1/SPLIT_SHARE as many numbers as the queries: (TPU,
# GPU). A TPU core runs a grid's programs one after the other, so few long splits cost it nothing; a GPU
# wants many programs in flight.
SPLIT_SHARE = (8, 1)
VALID, NONFINITE = 1.0, 2.0  # key codes in row 0 of the validity data; 0 marks an invalid key

GPU_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)
TPU_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))


def _pallas_call(platform: str | None, kernel, **kw):
  """pl.pallas_call lowered per platform (`attention_core.pallas.platform_call`) with this kernel family's
     params;
  `platform`: the one platform the primal was traced for, if any (a custom_vjp's rules are traced outside
  that context, so it rides along as a static argument and each kernel is traced only for it)."""
  return pallas.platform_call(kernel, gpu_params=GPU_PARAMS, tpu_params=TPU_PARAMS, platform=platform, **kw)


def _div(a: Any, b: int) -> Any:
  """a // b for non-negative ints; jnp's floor division lowers through `sign`, which Mosaic cannot place."""
  return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _rem(a: Any, b: int) -> Any:
  return a % b if isinstance(a, int) else lax.rem(a, jnp.int32(b))


_dot = pallas.dot


class Source(NamedTuple):
  """A key/value set. k: [bh, gk, n, head_dim]; v: [bh, gk, n, value_dim]; valid: [batch, gk, n] bool.

  gk = groups: group g reads its own keys; gk = 1: every group reads the same keys (span summaries).
  rule: key j is visible to a query when rule(qid, j) holds and valid[j]: "all", "le" (j <= qid), "lt"
  (j < qid), "ne" (j != qid), "range" (rows[0][j] <= qid < rows[1][j]); qid is the query's row inside its
  group ("row") or its group's index ("group").
  rows: for "range", the (first, end) query ids of each key, int arrays broadcastable to [gk, n].
  packed: k, v are heads-packed, [batch, gk, n, heads * dim] (see `attend`).
  """

  k: Array
  v: Array
  valid: Array
  rule: str = "all"
  qid: str = "row"
  rows: Any = None
  packed: bool = False


class _Spec(NamedTuple):  # the static part of a source, after padding
  rule: str
  qid: str
  shared: bool
  n: int  # padded length
  block: int
  pack: int | None = None  # heads, for heads-packed keys and values


def packs_heads() -> bool:
  """Whether the fused plans hand the kernels heads-packed arrays ([batch, ..., heads * dim], the op
  contract's own layout, so no head-major transposes) instead of head-major ones. On GPUs: Triton loads any
  strided tile. Mosaic (TPU) wants a block's last dim to be a multiple of 128 or the whole axis, and CPU
  runs the head-major arrays the TPU gets (tests force the packed ones)."""
  return contract.backend() in contract.ACCELERATOR_BACKENDS and contract.backend() != "tpu"


def _packed(imap, pack: int | None):
  """An index map over [bh, g, n, dim] blocks, moved to the heads-packed [batch, g, n, heads * dim] array
  (block bh % heads of the last axis); unchanged for pack None."""
  if pack is None:
    return imap

  def packed(b, g, t):
    i = imap(b, g, t)
    return (_div(i[0], pack), i[1], i[2], _rem(i[0], pack))
  return packed


def tile_caps() -> tuple[int, int]:
  """(query tile cap, key tile cap) for the backend being traced for."""
  backend = contract.backend()
  if backend in contract.ACCELERATOR_BACKENDS and backend != "tpu":
    return GPU_BLOCK_Q, GPU_BLOCK_K
  return BLOCK_Q, BLOCK_K


def group_length(length: int) -> int:
  """Queries per group for plans free to choose it (logsparse): one query tile."""
  return _tile(length, tile_caps()[0])


def _valid_rows(spec: _Spec) -> int:
  return 4 if spec.rule == "range" else 1


def _tile(n: int, cap: int) -> int:
  t = MIN_BLOCK
  while t < n and t < cap:
    t *= 2
  return t


def _visible(rule: str, qid: Array, kid: Array) -> Array | None:
  if rule == "le":
    return kid <= qid
  if rule == "lt":
    return kid < qid
  if rule == "ne":
    return kid != qid
  return None


def _key_tiles(spec: _Spec, qid_max: Array, num: int) -> Array | int:
  """Number of key tiles a query tile must visit: causal rules stop after the last visible key."""
  if spec.rule == "le":
    return jnp.minimum(num, _div(qid_max + spec.block, spec.block))
  if spec.rule == "lt":
    return jnp.minimum(num, _div(qid_max + spec.block - 1, spec.block))
  return num


def _over_key_tiles(spec: _Spec, qid_max: Array, body, carry):
  """carry after body(j, carry) for the key tiles j a query tile must visit.

  A source of one tile runs it once at the static offset 0, even where a causal rule lets no key of it be
  seen (every logit is then masked): Mosaic cannot prove a dynamic offset into a key-code row of fewer than
  128 lanes aligned (E2003), and a tile of 128 or more keys only exists when every offset is a multiple of
  128. Larger sources loop, stopping after the last tile a causal rule lets the query tile see.
  """
  num = spec.n // spec.block
  if num == 1:
    return body(0, carry)
  return lax.fori_loop(0, _key_tiles(spec, qid_max, num), body, carry)


def _tile_start(j: Array | int, block: int) -> Array | int:
  """Offset of key tile j (static 0 for a source of one tile, see `_over_key_tiles`)."""
  return j * block if isinstance(j, int) else pl.multiple_of(j * block, block)


def _scores(q, k, valid_ref, vstart, spec: _Spec, qid, start, scale):
  """Logits [bq, bk] (float32) of a query tile against the key tile at `start`, which are visible, and which
  keys ([1, bk]) held a non-finite key or value.

  valid_ref columns [vstart, vstart + bk): row 0 the key code (0 invalid, VALID, NONFINITE); for the "range"
  rule rows 1, 2 the first and end query id of each key (rows are loaded from the ref: Triton cannot slice
  loaded values).
  """
  s = _dot(q, k, trans_b=True) * scale
  row = lambda i: valid_ref[pl.ds(i, 1), pl.ds(vstart, spec.block)]  # noqa: E731  [1, bk]
  code = row(0)
  ok = code > 0
  if spec.rule == "range":
    qf = jnp.asarray(qid).astype(jnp.float32)
    ok = ok & (row(1) <= qf) & (qf < row(2))
  else:
    kid = start + lax.broadcasted_iota(jnp.int32, (1, spec.block), 1)
    vis = _visible(spec.rule, qid, kid)
    if vis is not None:
      ok = ok & vis
  return s, ok, code > VALID


def _finite(x: Array) -> Array:
  """x with non-finite entries selected to 0: a key or value no query of the tile sees must not reach a
  product with its zero weight (0 * NaN)."""
  return jnp.where(jnp.isfinite(x.astype(jnp.float32)), x, jnp.zeros_like(x))  # Mosaic tests float32 only


def _fwd_kernel(q_ref, *refs, specs: Sequence[_Spec], scale: float, block_q: int):
  n = len(specs)
  src = [refs[3 * i:3 * i + 3] for i in range(n)]
  o_ref, lse_ref = refs[3 * n:]
  g, t = pl.program_id(1), pl.program_id(2)
  q = q_ref[...]  # [bq, d]
  rows = t * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  m = jnp.full((block_q, 1), -jnp.inf, jnp.float32)
  den = jnp.zeros((block_q, 1), jnp.float32)
  acc = jnp.zeros(o_ref.shape, jnp.float32)
  for spec, (k_ref, v_ref, valid_ref) in zip(specs, src, strict=True):
    qid = rows if spec.qid == "row" else g
    qid_max = t * block_q + block_q - 1 if spec.qid == "row" else g

    def body(j, carry, spec=spec, k_ref=k_ref, v_ref=v_ref, valid_ref=valid_ref, qid=qid):
      m, den, acc = carry
      start = _tile_start(j, spec.block)
      k = k_ref[pl.ds(start, spec.block), :]
      v = _finite(v_ref[pl.ds(start, spec.block), :])
      s, ok, bad = _scores(q, k, valid_ref, start, spec, qid, start, scale)
      # A visible key that held a NaN or Inf gets logit +inf: its query's max, weights and output turn NaN.
      s = jnp.where(ok, jnp.where(bad, jnp.inf, s), -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - m_safe)  # exactly 0 where masked
      alpha = jnp.exp(m - m_safe)
      den = alpha * den + jnp.sum(p, axis=1, keepdims=True)
      acc = alpha * acc + _dot(p.astype(v.dtype), v)
      return m_new, den, acc

    m, den, acc = _over_key_tiles(spec, qid_max, body, (m, den, acc))
  nonempty = den > 0
  safe = jnp.where(nonempty, den, 1.0)
  o_ref[...] = (acc / safe).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(safe), -jnp.inf).T  # [1, bq]: queries on lanes


def _dq_kernel(q_ref, do_ref, lse_ref, delta_ref, *refs, specs: Sequence[_Spec], scale: float, block_q: int):
  n = len(specs)
  src = [refs[3 * i:3 * i + 3] for i in range(n)]
  (dq_ref,) = refs[3 * n:]
  g, t = pl.program_id(1), pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse, delta = _column(lse_ref[...]), _column(delta_ref[...])  # [bq, 1]
  lse = jnp.where(lse == -jnp.inf, 0.0, lse)
  rows = t * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  dq = jnp.zeros(dq_ref.shape, jnp.float32)
  for spec, (k_ref, v_ref, valid_ref) in zip(specs, src, strict=True):
    qid = rows if spec.qid == "row" else g
    qid_max = t * block_q + block_q - 1 if spec.qid == "row" else g

    def body(j, dq, spec=spec, k_ref=k_ref, v_ref=v_ref, valid_ref=valid_ref, qid=qid):
      start = _tile_start(j, spec.block)
      k = k_ref[pl.ds(start, spec.block), :]
      v = _finite(v_ref[pl.ds(start, spec.block), :])
      s, ok, _ = _scores(q, k, valid_ref, start, spec, qid, start, scale)
      p = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - lse), 0.0)
      dp = _dot(do, v, trans_b=True)
      ds = p * (dp - delta)
      return dq + _dot(ds.astype(k.dtype), _finite(k)) * scale

    dq = _over_key_tiles(spec, qid_max, body, dq)
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _column(row: Array) -> Array:
  """[1, n] -> [n, 1]: per-query statistics are stored with queries on lanes (a [n, 1] array would be padded
  to 128 lanes on TPU, 128 times its size) and used as columns against [n, keys] logits."""
  return row.T


def _dkv_kernel(q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, valid_ref, dk_ref, dv_ref, *, spec: _Spec,
                scale: float, block_q: int, group_len: int):
  """dk, dv of one key tile from the queries in q_ref etc.: its own group's, or for a shared source the
  split (a run of whole query tiles of the flattened sequence) of grid axis 1, summed over splits outside."""
  g, tk = pl.program_id(1), pl.program_id(2)
  k, v = k_ref[...], _finite(v_ref[...])
  start = tk * spec.block
  num_q = q_ref.shape[0] // block_q  # block_q: this kernel's query tile (`_kv_query_tile`)
  base = g * q_ref.shape[0] if spec.shared else 0  # row of the split's first query in the flattened sequence
  # First query tile that can see this key tile (causal rules); later tiles all may.
  if spec.rule in ("le", "lt") and spec.qid == "row" and not spec.shared:
    lo = _div(start, block_q)
  elif spec.rule in ("le", "lt") and spec.shared:  # shared summaries: groups >= first key index (+1 for "lt")
    lo = jnp.maximum(_div((start + (1 if spec.rule == "lt" else 0)) * group_len - base, block_q), 0)
  else:
    lo = 0
  lo = jnp.minimum(lo, num_q)

  def body(i, carry):
    dk, dv = carry
    qs = _tile_start(i, block_q)
    row0 = base + qs  # query row in its group's (own) or the flattened (shared) sequence
    q = q_ref[pl.ds(qs, block_q), :]
    do = do_ref[pl.ds(qs, block_q), :]
    lse = _column(lse_ref[:, pl.ds(qs, block_q)])
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    delta = _column(delta_ref[:, pl.ds(qs, block_q)])
    offsets = lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    if not spec.shared:
      qid = row0 + offsets if spec.qid == "row" else g
    elif group_len & (group_len - 1) == 0:  # a tile may hold rows of several groups (of 2^s rows)
      shift = group_len.bit_length() - 1
      rows = row0 + offsets
      qid = rows & (group_len - 1) if spec.qid == "row" else lax.shift_right_logical(rows, jnp.int32(shift))
    else:  # groups of whole tiles: one group per tile
      qid = _rem(row0, group_len) + offsets if spec.qid == "row" else _div(row0, group_len)
    s, ok, _ = _scores(q, k, valid_ref, 0, spec, qid, start, scale)
    p = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - lse), 0.0)  # [bq, bk]
    dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta)
    dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True) * scale
    return dk, dv

  zeros = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
  # One query tile runs at the static offset 0 (see `_over_key_tiles`; before lo, its rows are all masked).
  dk, dv = body(0, zeros) if num_q == 1 else lax.fori_loop(lo, num_q, body, zeros)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _row_spec(rows: int, width: int, pack: int | None = None) -> pl.BlockSpec:
  """Tile t of `rows` rows of group g: [bh, groups, n, width] -> [rows, width]."""
  return pl.BlockSpec((None, None, rows, width), _packed(lambda b, g, t: (b, g, t, 0), pack))


def _full_spec(rows: int, width: int, pack: int | None = None) -> pl.BlockSpec:
  """All `rows` rows of group g (the grid's key-tile axis does not move it)."""
  return pl.BlockSpec((None, None, rows, width), _packed(lambda b, g, t: (b, g, 0, 0), pack))


def _lane_spec(rows: int) -> pl.BlockSpec:
  """Tile t of per-query statistics stored lane-dense: [bh, groups, 1, n] -> [1, rows]."""
  return pl.BlockSpec((None, None, 1, rows), lambda b, g, t: (b, g, 0, t))


def _full_lane_spec(rows: int) -> pl.BlockSpec:
  return pl.BlockSpec((None, None, 1, rows), lambda b, g, t: (b, g, 0, 0))


def _split_queries(x: Array, splits: int, rows: int, fill: float, axis: int = 2) -> Array:
  """[bh, groups, glen, w] -> [bh, splits, rows, w] (axis 2; axis 3: [bh, groups, 1, glen] -> [bh, splits,
  1, rows]): the flattened rows, cut into splits, padded by `fill`."""
  if axis == 3:
    return _split_queries(jnp.swapaxes(x, 2, 3), splits, rows, fill).swapaxes(2, 3)
  bh, w = x.shape[0], x.shape[-1]
  return pad_to(x.reshape(bh, -1, w), splits * rows, 1, fill).reshape(bh, splits, rows, w)


def _kv_query_tile(rows: int, block_q: int) -> int:
  """Query tile of the dk/dv kernel over `rows` queries: block_q, except where per-query statistics would be
  read at offsets that are not multiples of 128 lanes (Mosaic, E2003), which tiles of fewer than 128 queries
  give: there all `rows` queries in one tile when they are at most 128, else tiles of 128 (`rows` is then a
  multiple of 128). GPU tiles (Triton) are powers of two and keep block_q."""
  if block_q >= LANES or tile_caps()[0] < BLOCK_Q:
    return block_q
  return rows if rows <= LANES else LANES


def _key_tile_spec(rows: int, spec: _Spec, width: int) -> pl.BlockSpec:
  """Key tile t of group g (shared: of the one group, whatever grid axis 1 is)."""
  return pl.BlockSpec((None, None, rows, width), _packed(
      (lambda b, g, t: (b, 0, t, 0)) if spec.shared else (lambda b, g, t: (b, g, t, 0)), spec.pack))


def _valid_tile_spec(rows: int, cols: int, shared: bool) -> pl.BlockSpec:
  """Key-code columns of key tile t."""
  return pl.BlockSpec((None, None, rows, cols), (lambda b, g, t: (b, 0, 0, t)) if shared
                      else (lambda b, g, t: (b, g, 0, t)))


def _width(x: Array, pack: int | None) -> int:
  """Per-head feature width of a head-major or heads-packed array."""
  return x.shape[-1] // (pack or 1)


def _source_specs(specs, arrays):
  in_specs = []
  for spec, (k, v, _) in zip(specs, arrays, strict=True):
    gmap = (lambda bh, g, t: (bh, 0, 0, 0)) if spec.shared else (lambda bh, g, t: (bh, g, 0, 0))
    in_specs += [pl.BlockSpec((None, None, spec.n, _width(k, spec.pack)), _packed(gmap, spec.pack)),
                 pl.BlockSpec((None, None, spec.n, _width(v, spec.pack)), _packed(gmap, spec.pack)),
                 pl.BlockSpec((None, None, _valid_rows(spec), spec.n), gmap)]
  return in_specs


def _flat(specs, arrays):
  out = []
  for k, v, valid in arrays:
    out += [k, v, valid]
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _flash(platform: str | None, specs: tuple, scale: float, block_q: int, pack: int | None, out_dtype: Any,
           q: Array, arrays: tuple):
  return _flash_fwd(platform, specs, scale, block_q, pack, out_dtype, q, arrays)[0]


def _flash_fwd(platform, specs, scale, block_q, pack, out_dtype, q, arrays):
  batch, groups, glen, _ = q.shape
  bh, d = batch * (pack or 1), _width(q, pack)
  dv = _width(arrays[0][1], specs[0].pack)
  o, lse = _pallas_call(
      platform, functools.partial(_fwd_kernel, specs=specs, scale=scale, block_q=block_q),
      grid=(bh, groups, glen // block_q),
      in_specs=[_row_spec(block_q, d, pack)] + _source_specs(specs, arrays),
      out_specs=[_row_spec(block_q, dv, pack), _lane_spec(block_q)],
      out_shape=[jax.ShapeDtypeStruct((batch, groups, glen, dv * (pack or 1)), out_dtype),
                 jax.ShapeDtypeStruct((bh, groups, 1, glen), jnp.float32)],
      name="combiner_flash_fwd",
  )(q, *_flat(specs, arrays))
  return (o, lse), (q, arrays, o, lse)


def _flash_bwd(platform, specs, scale, block_q, pack, out_dtype, res, cts):
  q, arrays, o, lse = res
  do, dlse = cts
  batch, groups, glen, _ = q.shape
  bh, d = batch * (pack or 1), _width(q, pack)
  prod = do.astype(jnp.float32) * o.astype(jnp.float32)
  if pack:  # [batch, groups, glen, heads * dv] -> per head, head-major
    delta = jnp.sum(prod.reshape(batch, groups, glen, pack, -1), axis=-1)  # [batch, groups, glen, heads]
    delta = jnp.moveaxis(delta, 3, 1).reshape(bh, groups, glen)
  else:
    delta = jnp.sum(prod, axis=-1)  # [bh, groups, glen]
  delta = delta[:, :, None] - dlse  # [bh, groups, 1, glen], like lse
  do = do.astype(q.dtype)
  row_spec = functools.partial(_row_spec, block_q)
  dq = _pallas_call(
      platform, functools.partial(_dq_kernel, specs=specs, scale=scale, block_q=block_q),
      grid=(bh, groups, glen // block_q),
      in_specs=[row_spec(d, pack), row_spec(_width(do, pack), pack), _lane_spec(block_q), _lane_spec(block_q)]
      + _source_specs(specs, arrays),
      out_specs=row_spec(d, pack),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      name="combiner_flash_dq",
  )(q, do, lse, delta, *_flat(specs, arrays))
  d_arrays = []
  for spec, (k, v, valid) in zip(specs, arrays, strict=True):
    if spec.shared:
      # Every query sees the summaries: the flattened [groups * glen] queries of each (bh) are cut into splits
      # of `per` query tiles, one program each; padded rows get lse = +inf, hence weight 0. Each split writes
      # float32 partial sums for all n keys, so a split takes at least SPLIT_TILES tiles and enough that the
      # partial sums hold few numbers: splits * n * (d + dv) * SPLIT_SHARE <= groups * glen * d.
      tiles = groups * glen // block_q
      numbers = spec.n * (_width(k, spec.pack) + _width(v, spec.pack)) * SPLIT_SHARE[tile_caps()[0] < BLOCK_Q]
      per = max(SPLIT_TILES, -(-numbers // (block_q * d)))
      splits, rows = -(-tiles // per), min(tiles, per) * block_q
      tile = _kv_query_tile(rows, block_q)
      rows = -(-rows // tile) * tile  # whole kernel tiles
      fills = ((q, 0.0, 2), (do, 0.0, 2), (lse, jnp.inf, 3), (delta, 0.0, 3))
      qs = [_split_queries(x, splits, rows, fill, axis) for x, fill, axis in fills]
    else:
      qs, splits, rows = [q, do, lse, delta], groups, glen
    full = functools.partial(_full_spec, rows)
    kv_tile = functools.partial(_key_tile_spec, spec.block, spec)
    vmap = _valid_tile_spec(_valid_rows(spec), spec.block, spec.shared)
    # Partial sums over splits stay float32 until summed; a group's own keys get theirs in their dtype.
    out_shape = [jax.ShapeDtypeStruct((x.shape[0], splits, spec.n, x.shape[-1]),
                                      jnp.float32 if spec.shared else x.dtype) for x in (k, v)]
    dk_w, dv_w = _width(k, spec.pack), _width(v, spec.pack)
    dk, dv = _pallas_call(
        platform, functools.partial(_dkv_kernel, spec=spec, scale=scale,
                                    block_q=_kv_query_tile(rows, block_q), group_len=glen),
        grid=(bh, splits, spec.n // spec.block),
        in_specs=[full(d, pack), full(_width(do, pack), pack), _full_lane_spec(rows), _full_lane_spec(rows),
                  kv_tile(dk_w), kv_tile(dv_w), vmap],
        out_specs=[kv_tile(dk_w), kv_tile(dv_w)] if not spec.shared
        else [_row_spec(spec.block, dk_w), _row_spec(spec.block, dv_w)],
        out_shape=out_shape,
        name="combiner_flash_dkv",
    )(*qs, k, v, valid)
    if spec.shared:  # partial sums of the splits
      dk, dv = jnp.sum(dk, axis=1, keepdims=True), jnp.sum(dv, axis=1, keepdims=True)
    d_arrays.append((dk.astype(k.dtype), dv.astype(v.dtype), jnp.zeros_like(valid)))
  return dq, tuple(d_arrays)


_flash.defvjp(_flash_fwd, _flash_bwd)


def attend(q: Array, sources: Sequence[Source], *, heads: int, scale: float, packed: bool = False,
           out_dtype: Any = jnp.float32) -> tuple[Array, Array]:
  """Joint softmax of grouped queries over `sources`.

  q: [bh, groups, group_len, head_dim], bh = batch * heads (batch-major); packed: q is heads-packed,
  [batch, groups, group_len, heads * head_dim] (a free reshape of the op contract's layout), and so is out.
  Returns (out [bh, groups, group_len, value_dim] in `out_dtype`, lse [bh, groups, group_len] float32);
  rows with no visible key give out 0 and lse -inf. A caller that merges partial outputs keeps out float32;
  one whose output is final may take its dtype, which the backward then reads too, as flash attention does.
  """
  groups, glen = q.shape[1:3]
  cap_q, cap_k = tile_caps()
  block_q = _tile(glen, cap_q)
  glen_p = -(-glen // block_q) * block_q
  qp = pad_to(q, glen_p, 2)
  specs, arrays = [], []
  for s in sources:
    if s.rule not in RULES or s.qid not in QIDS:
      raise ValueError(f"flash.attend: bad source rule {s.rule!r} / qid {s.qid!r}")
    n = s.k.shape[2]
    block = _tile(n, cap_k)
    n_p = -(-n // block) * block
    shared = s.k.shape[1] == 1 and groups > 1
    # Row 0: the key code, per (batch, head): 0 invalid, else VALID or NONFINITE (a NaN/Inf in its key or
    # value). The kernels select non-finite entries of a tile's keys and values to 0 before their products,
    # so a key no query of a tile sees never meets its zero weight (0 * NaN); queries that see one get NaN.
    pack = heads if s.packed else None
    finite = _per_head(jnp.isfinite(s.k), pack) & _per_head(jnp.isfinite(s.v), pack)  # [bh, gk, n]
    valid = jnp.repeat(s.valid, heads, axis=0)  # [bh, gk, n]
    valid = jnp.where(valid, jnp.where(finite, VALID, NONFINITE), 0.0)[:, :, None, :]  # [bh, gk, 1, n]
    if s.rule == "range":  # rows 1, 2: the query-id range of each key (exact in float32); row 3 pads to 4
      shape = valid.shape[:2] + (1, n)
      lo, hi = (jnp.broadcast_to(jnp.asarray(r, jnp.float32).reshape(-1, n)[:, None], shape) for r in s.rows)
      valid = jnp.concatenate([valid, lo, hi, jnp.zeros_like(lo)], axis=2)  # [batch, gk, 4, n]
    valid = pad_to(valid, n_p, 3)
    specs.append(_Spec(s.rule, s.qid, shared, n_p, block, pack))
    arrays.append((pad_to(s.k.astype(q.dtype), n_p, 2), pad_to(s.v.astype(q.dtype), n_p, 2), valid))
  o, lse = _flash(contract.traced_platform(), tuple(specs), float(scale), block_q, heads if packed else None,
                  jnp.dtype(out_dtype), qp, tuple(arrays))
  return o[:, :, :glen], lse[:, :, 0, :glen]


def _per_head(finite: Array, pack: int | None) -> Array:
  """[bh, gk, n, dim] (or heads-packed [batch, gk, n, heads * dim]) -> [bh, gk, n]: all entries finite."""
  if pack is None:
    return jnp.all(finite, axis=-1)
  batch, gk, n, _ = finite.shape
  per = jnp.all(finite.reshape(batch, gk, n, pack, -1), axis=-1)  # [batch, gk, n, heads]
  return jnp.moveaxis(per, 3, 1).reshape(batch * pack, gk, n)


def merge(parts: Sequence[tuple[Array, Array]]) -> tuple[Array, Array]:
  """One softmax over the union of several (out, lse) partials of the same queries (any common layout).

  Partials with lse = -inf (no visible key) get weight 0; selects keep their gradients finite.
  """
  top = parts[0][1]
  for _, x in parts[1:]:
    top = jnp.maximum(top, x)
  top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  weights = [jnp.where(jnp.isfinite(x), jnp.exp(jnp.where(jnp.isfinite(x), x, 0.0) - top), 0.0)
             for _, x in parts]
  total = sum(weights[1:], weights[0])
  inv = 1.0 / jnp.where(total > 0, total, 1.0)
  out = sum((o * (w * inv)[..., None] for (o, _), w in zip(parts, weights, strict=True)))
  lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  return out, lse
