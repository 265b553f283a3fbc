"""Tile math inside the Combiner kernels (combiner/passes.py): online softmax, its backward, pooling.

Everything here runs on values inside a Pallas kernel (Mosaic on TPU, Triton on GPU, interpret mode on CPU):
query tiles [bq, d], key tiles [bk, d], value tiles [bk, dv], per-query statistics as columns [bq, 1] and
per-key data as rows [1, bk]. Matmuls take the kernel dtype (bfloat16 on accelerators) and accumulate in
float32; softmax statistics are float32.

Non-finite inputs follow the op contract (docs/design.md §3): logits come from the raw keys, so a NaN key
poisons only the queries that see it; values are multiplied with their non-finite entries selected to 0 and
a key whose value holds a NaN or Inf has its logits set to NaN, so a query that sees it gets NaN while a query
that does not (a masked, future or other-span key) never meets it in a product.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from attention_core import pallas

Array = Any
F32 = jnp.float32
NEG = -jnp.inf
RULES = ("all", "le", "lt", "ne", "eq")


def dot(a: Array, b: Array, ta: bool = False, tb: bool = False) -> Array:
  """a @ b of two 2-D tiles (either transposed), float32 accumulation."""
  return pallas.dot(a, b, trans_a=ta, trans_b=tb)


def finite(x: Array) -> Array:
  """x with non-finite entries selected to 0 (for products whose zero weights must stay zero)."""
  return jnp.where(jnp.isfinite(x.astype(F32)), x, jnp.zeros_like(x))


def poisoned(k: Array, v: Array) -> Array:
  """Keys [bk, d] whose value row [bk, dv] holds a non-finite entry set to NaN: their logits turn NaN for
  exactly the queries that see them."""
  bad = jnp.max(jnp.where(jnp.isfinite(v.astype(F32)), 0.0, 1.0), axis=1, keepdims=True) > 0  # [bk, 1]
  return jnp.where(bad, jnp.asarray(jnp.nan, k.dtype), k)


def visible(rule: str, qid: Array, kid: Array) -> Array | None:
  """Structural visibility of key ids `kid` [1, bk] from query ids `qid` [bq, 1] (None: all)."""
  if rule == "le":
    return kid <= qid
  if rule == "lt":
    return kid < qid
  if rule == "ne":
    return kid != qid
  if rule == "eq":
    return kid == qid
  return None


def column(row: Array) -> Array:
  """[1, n] -> [n, 1] (per-query statistics are stored lane-dense, used as columns)."""
  return row.astype(F32).T


def take_row(x: Array, i: int) -> Array:
  """Row i [1, w] of x [n, w] (a masked sum: Triton has no slices of values)."""
  rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.sum(jnp.where(rows == i, x, jnp.zeros_like(x)), axis=0, keepdims=True)


def take_lane(x: Array, i: int) -> Array:
  """Column i [n, 1] of x [n, w]."""
  lanes = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(lanes == i, x, jnp.zeros_like(x)), axis=1, keepdims=True)


def flip_rows(x: Array) -> Array:
  """x [n, w] (n a power of two) with its rows in reverse order: row r <- row n-1-r, i.e. r XOR (n-1), one
  butterfly stage per bit (two sublane rolls and a select), in float32 so packed bfloat16 rows roll too. Exact
  and NaN-safe, unlike a one-hot matmul (Mosaic has no `rev`)."""
  n = x.shape[0]
  y = x.astype(F32)
  rows = lax.broadcasted_iota(jnp.int32, y.shape, 0)
  s = 1
  while s < n:
    y = jnp.where((rows & s) == 0, pltpu.roll(y, n - s, 0), pltpu.roll(y, s, 0))  # row r + s | row r - s
    s *= 2
  return y.astype(x.dtype)


def min_rows(platform: str) -> int:
  """The fewest rows a matmul operand is given: a TPU sublane tile (8), Triton's smallest dot (16)."""
  return 16 if platform == "gpu" else 8


def rows_of(x: Array, n: int) -> Array:
  """[1, w] -> [n, w]: a one-row operand repeated to fill a matmul's smallest tile."""
  return jnp.broadcast_to(x, (n, x.shape[1]))


def pad_rows(x: Array, n: int) -> Array:
  """[m, w] -> [n, w] (m <= n), zero rows below: a one-hot matmul in float32, exact (Triton concatenates
  only along the last axis)."""
  m = x.shape[0]
  if m >= n:
    return x
  place = lax.broadcasted_iota(jnp.int32, (n, m), 0) == lax.broadcasted_iota(jnp.int32, (n, m), 1)
  return select_rows(place, x).astype(x.dtype)


def stack_rows(parts: list[Array], platform: str) -> Array:
  """Equal tiles [t, w] stacked along rows: concatenations on TPU and CPU; one-hot placements (exact float32
  matmuls) on GPUs, where Triton concatenates only along the last axis."""
  if len(parts) == 1:
    return parts[0]
  if platform != "gpu":
    return jnp.concatenate(parts, axis=0)
  t = parts[0].shape[0]
  n = t * len(parts)
  rows = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
  out = jnp.zeros((n, parts[0].shape[1]), F32)
  for i, x in enumerate(parts):
    place = lax.broadcasted_iota(jnp.int32, (n, t), 0) == lax.broadcasted_iota(jnp.int32, (n, t), 1) + i * t
    out = jnp.where((rows >= i * t) & (rows < (i + 1) * t), select_rows(place, x), out)
  return out


class Online(NamedTuple):
  """Online softmax state of a query tile: running max m [bq, 1], denominator [bq, 1], numerator [bq, dv]."""

  m: Array
  den: Array
  acc: Array

  @staticmethod
  def empty(rows: int, dv: int) -> Online:
    return Online(jnp.full((rows, 1), NEG, F32), jnp.zeros((rows, 1), F32), jnp.zeros((rows, dv), F32))


def online_step(st: Online, q: Array, k: Array, v: Array, vis: Array, scale: float) -> Online:
  """One key tile: q [bq, d], k [bk, d], v [bk, dv] (any float dtypes; matmuls in q's), vis [bq, bk]."""
  s = dot(q, poisoned(k, v).astype(q.dtype), tb=True) * scale
  s = jnp.where(vis, s, NEG)
  m_new = jnp.maximum(st.m, jnp.max(s, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == NEG, 0.0, m_new)
  p = jnp.exp(s - m_safe)  # exactly 0 where not visible
  alpha = jnp.exp(st.m - m_safe)
  return Online(m_new, alpha * st.den + jnp.sum(p, axis=1, keepdims=True),
                alpha * st.acc + dot(p.astype(q.dtype), finite(v).astype(q.dtype)))


def merge_partial(st: Online, o: Array, lse: Array) -> Online:
  """Adds a normalised partial softmax over other keys of the same queries: o [bq, dv], lse [bq, 1]."""
  o = o.astype(F32)
  m_new = jnp.maximum(st.m, lse)
  m_safe = jnp.where(m_new == NEG, 0.0, m_new)
  w = jnp.where(lse == NEG, 0.0, jnp.exp(lse - m_safe))
  alpha = jnp.exp(st.m - m_safe)
  return Online(m_new, alpha * st.den + w, alpha * st.acc + w * jnp.where(lse == NEG, 0.0, o))


def finish(st: Online) -> tuple[Array, Array]:
  """(out [bq, dv] float32, 0 for a query that sees no key; lse [bq, 1], -inf there; NaN stays NaN)."""
  ok = st.den != 0
  safe = jnp.where(ok, st.den, 1.0)
  return st.acc / safe, jnp.where(ok, st.m + jnp.log(safe), NEG)


def probs(q: Array, k: Array, v: Array, vis: Array, lse: Array, scale: float) -> Array:
  """Softmax weights [bq, bk] of visible keys, recomputed from the query's log-sum-exp lse [bq, 1]."""
  s = dot(q, poisoned(k, v).astype(q.dtype), tb=True) * scale
  lse = jnp.where(lse == NEG, 0.0, lse)
  return jnp.where(vis, jnp.exp(jnp.where(vis, s, 0.0) - lse), 0.0)


def grads(q: Array, do: Array, k: Array, v: Array, vis: Array, lse: Array, delta: Array,
          scale: float) -> tuple[Array, Array]:
  """(p, ds) [bq, bk] of one key tile: the weights and d(loss)/d(logit) (unscaled), for
  dq = ds @ k * scale, dk = ds^T @ q * scale, dv = p^T @ do. delta = rowsum(do * out) [bq, 1]."""
  p = probs(q, k, v, vis, lse, scale)
  dp = dot(do.astype(q.dtype), finite(v).astype(q.dtype), tb=True)
  return p, p * (dp - delta)


# ----------------------------------------------------------------------------------------------- pooling
# x [n, d] float32, valid [n, 1] bool. Max pools select invalid rows to -inf, mean pools to 0; an empty span
# pools to 0 (and is dropped by its consumer). Ties of a max share its gradient equally.

def pool_block(x: Array, valid: Array, kind: str) -> tuple[Array, Array]:
  """One span: (pooled [1, d], count [1, 1])."""
  cnt = jnp.sum(valid.astype(F32), axis=0, keepdims=True)
  if kind == "max":
    top = jnp.max(jnp.where(valid, x, NEG), axis=0, keepdims=True)
    return jnp.where(cnt > 0, top, 0.0), cnt
  return jnp.sum(jnp.where(valid, x, 0.0), axis=0, keepdims=True) / jnp.maximum(cnt, 1.0), cnt


def route_block(x: Array, valid: Array, kind: str, pooled: Array, cnt: Array, g: Array) -> Array:
  """Gradient [n, d] of `pool_block` for the pooled gradient g [1, d]."""
  if kind == "max":
    hit = (x == pooled) & valid
    ties = jnp.sum(hit.astype(F32), axis=0, keepdims=True)
    return jnp.where(hit, g / jnp.maximum(ties, 1.0), 0.0)
  return jnp.where(valid, g / jnp.maximum(cnt, 1.0), 0.0)


def pool_all_but_one(x: Array, valid: Array, kind: str) -> tuple[Array, Array]:
  """Per row j, the span of every other valid row: (pooled [n, d], count [n, 1])."""
  n = x.shape[0]
  total = jnp.sum(valid.astype(F32), axis=0, keepdims=True)
  cnt = total - valid.astype(F32)
  if kind == "max":
    xm = jnp.where(valid, x, NEG)
    top = jnp.max(xm, axis=0, keepdims=True)
    first = _first_hit(xm == top, n)
    top2 = jnp.max(jnp.where(first, NEG, xm), axis=0, keepdims=True)
    return jnp.where(cnt > 0, jnp.where(first, top2, top), 0.0), cnt
  s = jnp.sum(jnp.where(valid, x, 0.0), axis=0, keepdims=True)
  return (s - jnp.where(valid, x, 0.0)) / jnp.maximum(cnt, 1.0), cnt


def route_all_but_one(x: Array, valid: Array, kind: str, cnt: Array, g: Array) -> Array:
  """Gradient [n, d] of `pool_all_but_one` for pooled gradients g [n, d] (rows with empty spans carry 0)."""
  n = x.shape[0]
  g = jnp.where(cnt > 0, g, 0.0)
  if kind == "mean":
    share = g / jnp.maximum(cnt, 1.0)
    return jnp.where(valid, jnp.sum(share, axis=0, keepdims=True) - share, 0.0)
  xm = jnp.where(valid, x, NEG)
  top = jnp.max(xm, axis=0, keepdims=True)
  first = _first_hit(xm == top, n)  # the arg-max row (per coordinate)
  rest = jnp.where(first, NEG, xm)
  second = _first_hit((rest == jnp.max(rest, axis=0, keepdims=True)) & ~first & valid, n)
  # every row but the arg-max pools to `top` (at its first row); the arg-max row pools to the runner-up
  to_first = jnp.sum(jnp.where(first, 0.0, g), axis=0, keepdims=True)
  to_second = jnp.sum(jnp.where(first, g, 0.0), axis=0, keepdims=True)
  return jnp.where(first, to_first, 0.0) + jnp.where(second & valid, to_second, 0.0)


def _first_hit(hit: Array, n: int) -> Array:
  """[n, d] bool: the first True row of each column of `hit` (all False where none)."""
  rows = lax.broadcasted_iota(jnp.int32, hit.shape, 0)
  first = jnp.min(jnp.where(hit, rows, n), axis=0, keepdims=True)
  return rows == first


def select_rows(place: Array, x: Array) -> Array:
  """place [n, m] (0/1, at most one 1 per row) times x [m, w], exactly: row i is x's row j where
  place[i, j] == 1, else 0, infinities and NaN included (a float32 matmul of the finite parts and one of a
  code for the others; Triton has no gathers, slices or row concatenations)."""
  place = place.astype(F32)
  finite = jnp.isfinite(x)
  code = jnp.where(finite, 0.0, jnp.where(jnp.isnan(x), 3.0, jnp.where(x > 0, 1.0, 2.0)))
  dims = (((1,), (0,)), ((), ()))
  moved, code = (lax.dot_general(place, y.astype(F32), dims, preferred_element_type=F32,
                                 precision=lax.Precision.HIGHEST) for y in (jnp.where(finite, x, 0.0), code))
  return jnp.where(code == 1, jnp.inf, jnp.where(code == 2, -jnp.inf, jnp.where(code == 3, jnp.nan, moved)))


def _shift(x: Array, k: int, fill: Any, platform: str) -> Array:
  """Row j takes x[j - k] (k > 0: down) or x[j + |k|] (k < 0: up); rows shifted in from outside are fill.
  A sublane rotation on TPU; elsewhere a 0/1 shift matrix times x in float32 (exact: one term per row;
  non-finite entries ride through a finite stand-in), as Triton has neither rotations nor slices."""
  n = x.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  inside = (rows >= k) if k > 0 else (rows < n + k)
  if platform == "tpu":
    return jnp.where(inside, pltpu.roll(x, k % n, 0), fill)
  src = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  dst = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  moved = select_rows(src == dst - k, x)
  return jnp.where(inside, moved, fill)


def _running_max(x: Array, platform: str) -> Array:
  """Exclusive running max down the rows (-inf before the first row): log-step scans."""
  n = x.shape[0]
  run = _shift(x, 1, NEG, platform)
  k = 1
  while k < n:
    run = jnp.maximum(run, _shift(run, k, NEG, platform))
    k *= 2
  return run


def _tri_sum(x: Array, strict_lower: bool) -> Array:
  """Sum over the rows before (strict_lower) or after each row: a triangular matmul in float32."""
  n = x.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  tri = ((cols < rows) if strict_lower else (cols > rows)).astype(F32)
  return lax.dot_general(tri, x.astype(F32), (((1,), (0,)), ((), ())), preferred_element_type=F32,
                         precision=lax.Precision.HIGHEST)


def pool_prefix(x: Array, valid: Array, kind: str, platform: str) -> tuple[Array, Array]:
  """Per row j, the span of the valid rows before j: (pooled [n, d], count [n, 1])."""
  cnt = _tri_sum(valid.astype(F32), True)
  if kind == "mean":
    return _tri_sum(jnp.where(valid, x, 0.0), True) / jnp.maximum(cnt, 1.0), cnt
  return jnp.where(cnt > 0, _running_max(jnp.where(valid, x, NEG), platform), 0.0), cnt


def pool_upto(x: Array, valid: Array, kind: str, platform: str) -> tuple[Array, Array]:
  """Per row j, the span of the valid rows up to and including j: (pooled [n, d], count [n, 1])."""
  xv = jnp.where(valid, x, 0.0)
  cnt = _tri_sum(valid.astype(F32), True) + valid.astype(F32)
  if kind == "mean":
    return (_tri_sum(xv, True) + xv) / jnp.maximum(cnt, 1.0), cnt
  xm = jnp.where(valid, x, NEG)
  return jnp.where(cnt > 0, jnp.maximum(_running_max(xm, platform), xm), 0.0), cnt


def route_prefix(x: Array, valid: Array, kind: str, cnt: Array, g: Array, platform: str,
                 upto: bool = False) -> Array:
  """Gradient [n, d] of `pool_prefix` (`pool_upto` if upto) for pooled gradients g [n, d].

  Mean: row s receives g[j] / cnt[j] from every later row j (and from itself, upto). Max: the maximum over
  the rows before j sits at the last "record" before j (a valid row greater than every valid row before it;
  a tie is no record, so ties go to the earlier row). Record s thus owns the rows j in (s, r] ([s, r), upto),
  r its next record (or past the last row), and receives S[r] - S[s], S the inclusive (exclusive, upto)
  prefix sums of g; S at the next record comes from a reverse log-step fill.
  """
  n = x.shape[0]
  g = jnp.where(cnt > 0, g, 0.0)
  if kind == "mean":
    share = g / jnp.maximum(cnt, 1.0)
    return jnp.where(valid, _tri_sum(share, False) + (share if upto else 0.0), 0.0)
  xm = jnp.where(valid, x, NEG)
  record = valid & (xm > _running_max(xm, platform))
  before = _tri_sum(g, True)
  sums = before if upto else before + g  # S
  val = _shift(jnp.where(record, sums, 0.0), -1, 0.0, platform)  # S of the record at j + 1, if one
  has = _shift(record.astype(F32), -1, 0.0, platform)
  k = 1
  while k < n:  # val[j] <- S of the first record after j
    later, later_has = _shift(val, -k, 0.0, platform), _shift(has, -k, 0.0, platform)
    val = jnp.where(has > 0, val, later)
    has = jnp.maximum(has, later_has)
    k *= 2
  end = jnp.where(has > 0, val, take_row(before + g, n - 1))
  return jnp.where(record, end - sums, 0.0)
