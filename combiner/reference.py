"""From-definition Combiner reference: the dense effective attention matrix built with explicit loops.

This module is the independent statement of docs/design.md section 4 that the fast ops in `combiner/` are
tested against, and the source of the attention-pattern pictures. Everything is NumPy float64 and written
for clarity, never for speed: one query at a time, sets as Python lists, softmax written out.

For query `i` a plan gives a direct set `D_i` and disjoint spans `S_i^r` that together partition
`Omega_i = {j <= i}` (causal) or all `j` (bidirectional), masked keys removed. With `s(a, b) = a.b / sqrt(d)`:

  w = softmax over {s(q_i, k_j) : j in D_i} u {s(q_i, kbar_r) : r}            (one joint softmax)
  A[i, j] = w_ij                              for j in D_i
  A[i, j] = w_ir * softmax_{j in S_r}(s(qbar_r, k_j))   for j in S_r

`kbar_r` pools (max or mean, coordinate-wise, over the span's real members) `pool_k` (default k); `qbar_r`
pools `pool_q` (default q), except for `axial_rowmajor`, whose span query is the column-aligned token's own
query `q`.

Plans (`plan_sets`): "fixed" (block_size), "logsparse", "axial_rowmajor", "axial_vertical", "axial_horizontal"
(row_length), "routed" (cluster_ids [length], num_clusters). `attention_matrix` also takes "mixture"
(row_length, normalize "mean" | "joint"). The sparse baselines (`sparse_support`, `sparse_attention_matrix`)
take "fixed", "logsparse", "axial".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Array = Any

PLANS = ("fixed", "logsparse", "axial_rowmajor", "axial_vertical", "axial_horizontal", "routed")
MATRIX_PLANS = PLANS + ("mixture",)
SPARSE_PLANS = ("fixed", "logsparse", "axial")
POOLINGS = ("max", "mean")
NORMALIZES = ("mean", "joint")


# ----------------------------------------------------------------------------------------------------------
# Argument helpers


def _positive_int(params: dict[str, Any], name: str, plan: str) -> int:
  if name not in params:
    raise ValueError(f"reference plan {plan!r} needs the argument {name!r}")
  value = params[name]
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"reference: argument {name!r} must be a positive integer, got {value!r}")
  return int(value)


def _no_extra(params: dict[str, Any], allowed: Sequence[str], plan: str) -> None:
  extra = sorted(set(params) - set(allowed))
  if extra:
    raise ValueError(f"reference plan {plan!r} got unexpected arguments {extra}; allowed: {sorted(allowed)}")


def _real(length: int, mask: Array | None) -> np.ndarray:
  """[length] bool, True where the key is a real token."""
  if mask is None:
    return np.ones(length, bool)
  mask = np.asarray(mask, bool)
  if mask.shape != (length,):
    raise ValueError(f"reference: argument 'mask' must have shape ({length},), got {mask.shape}")
  return mask


def omega(length: int, i: int, *, causal: bool, mask: Array | None = None) -> list[int]:
  """Omega_i: the keys query i may see, before any plan partitions them."""
  real = _real(length, mask)
  stop = i + 1 if causal else length
  return [j for j in range(stop) if real[j]]


# ----------------------------------------------------------------------------------------------------------
# Plans: D_i and the spans, straight from the table in docs/design.md section 4


def _logsparse_causal_spans(i: int) -> list[list[int]]:
  """Dyadic partition of [0, i): for every bit b set in i, [p, p + 2^b) with p = (i >> (b+1)) << (b+1).

  Listed from the highest bit down, i.e. from the far past towards i. The number of levels is whatever i's
  binary expansion needs; with i <= L - 1 that is at most (L-1).bit_length(), so the top span is never lost.
  """
  spans = []
  for b in reversed(range(i.bit_length())):
    if (i >> b) & 1:
      p = (i >> (b + 1)) << (b + 1)
      spans.append(list(range(p, p + (1 << b))))
  return spans


def _logsparse_spans(length: int, i: int, causal: bool) -> list[list[int]]:
  spans = _logsparse_causal_spans(i)
  if not causal:
    # The same construction on reversed positions i' = L-1-i covers (i, L); map back with j = L-1-j'.
    ir = length - 1 - i
    spans += [sorted(length - 1 - j for j in span) for span in _logsparse_causal_spans(ir)]
  return spans


def _routed_chunks(length: int, cluster_ids: Array, num_clusters: int) -> list[list[int]]:
  """Balanced partition: tokens sorted by (cluster id, position) cut into chunks of ceil(L / num_clusters)."""
  cluster_ids = np.asarray(cluster_ids)
  if cluster_ids.shape != (length,):
    raise ValueError(f"reference: argument 'cluster_ids' must have shape ({length},), "
                     f"got {cluster_ids.shape}")
  order = sorted(range(length), key=lambda j: (int(cluster_ids[j]), j))
  w = -(-length // num_clusters)
  return [sorted(order[c:c + w]) for c in range(0, length, w)]


def _raw_sets(plan: str, length: int, i: int, causal: bool, params: dict[str, Any]
              ) -> tuple[list[int], list[list[int]]]:
  """D_i and spans before masking (but already restricted to the causal prefix)."""
  if plan == "fixed":
    _no_extra(params, ("block_size",), plan)
    s = _positive_int(params, "block_size", plan)
    blocks = [list(range(b, min(b + s, length))) for b in range(0, length, s)]
    own = i // s
    direct = blocks[own]
    spans = [blk for b, blk in enumerate(blocks) if b != own]
  elif plan == "logsparse":
    _no_extra(params, (), plan)
    direct = [i]
    spans = _logsparse_spans(length, i, causal)
  elif plan in ("axial_rowmajor", "axial_vertical", "axial_horizontal"):
    _no_extra(params, ("row_length",), plan)
    m = _positive_int(params, "row_length", plan)
    rows = [list(range(r, min(r + m, length))) for r in range(0, length, m)]
    cols = [[j for j in range(length) if j % m == c] for c in range(m)]
    row_i, col_i = i // m, i % m
    if plan == "axial_rowmajor":
      direct = rows[row_i]
      spans = [row for r, row in enumerate(rows) if r != row_i]
    else:
      direct = sorted(set(rows[row_i]) | set(cols[col_i]))
      family = cols if plan == "axial_vertical" else rows
      own = col_i if plan == "axial_vertical" else row_i
      spans = [[j for j in grp if j not in direct] for g, grp in enumerate(family) if g != own]
  elif plan == "routed":
    _no_extra(params, ("cluster_ids", "num_clusters"), plan)
    n = _positive_int(params, "num_clusters", plan)
    if "cluster_ids" not in params:
      raise ValueError("reference plan 'routed' needs the argument 'cluster_ids'")
    chunks = _routed_chunks(length, params["cluster_ids"], n)
    own = next(c for c, chunk in enumerate(chunks) if i in chunk)
    direct = chunks[own]
    spans = [chunk for c, chunk in enumerate(chunks) if c != own]
  else:
    raise ValueError(f"reference: argument 'plan' must be one of {PLANS}, got {plan!r}")
  if causal:
    direct = [j for j in direct if j <= i]
    spans = [[j for j in span if j <= i] for span in spans]
  return direct, spans


def plan_sets(plan: str, length: int, i: int, *, causal: bool, mask: Array | None = None, **params: Any
              ) -> tuple[list[int], list[list[int]]]:
  """(D_i, [S_i^1, ...]) for query i: sorted key positions, masked keys removed, empty spans dropped."""
  if not 0 <= i < length:
    raise ValueError(f"reference: query index {i} outside [0, {length})")
  real = _real(length, mask)
  if plan == "routed" and "cluster_ids" in params and "num_clusters" in params:
    # Masked tokens form a cluster of their own after the real ones: the partition of real tokens never
    # depends on padded content.
    ids = np.where(real, np.asarray(params["cluster_ids"]), params["num_clusters"])
    params = dict(params, cluster_ids=ids)
  direct, spans = _raw_sets(plan, length, i, bool(causal), params)
  direct = sorted(j for j in direct if real[j])
  spans = [sorted(j for j in span if real[j]) for span in spans]
  return direct, [span for span in spans if span]


def span_query_rows(plan: str, length: int, i: int, *, causal: bool, mask: Array | None = None, **params: Any
                    ) -> list[int | None]:
  """For each span of `plan_sets(...)` (same order): the position whose own query is the span query, or None.

  Only `axial_rowmajor` uses a token's query: the column-aligned token (r', col(i)) of span row r'. When that
  token is masked or lies beyond a ragged last row, the span query is pooled like the key (None here). All
  other plans pool the span query (None).
  """
  real = _real(length, mask)
  _, spans = plan_sets(plan, length, i, causal=causal, mask=mask, **params)
  if plan != "axial_rowmajor":
    return [None] * len(spans)
  m = params["row_length"]
  out: list[int | None] = []
  for span in spans:
    aligned = (span[0] // m) * m + i % m
    out.append(aligned if aligned < length and real[aligned] else None)
  return out


# ----------------------------------------------------------------------------------------------------------
# The effective attention matrix


def _softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - np.max(x))
  return e / np.sum(e)


def _pool(x: np.ndarray, members: Sequence[int], pooling: str) -> np.ndarray:
  rows = x[list(members)]
  if pooling == "max":
    return rows.max(axis=0)
  if pooling == "mean":
    return rows.mean(axis=0)
  raise ValueError(f"reference: argument 'pooling' must be one of {POOLINGS}, got {pooling!r}")


def _as_matrix(x: Array, name: str, length: int | None = None) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or (length is not None and x.shape[0] != length):
    raise ValueError(f"reference: argument {name!r} must have shape [length, dim], got {x.shape}")
  return x


def _combiner_row(i: int, direct: list[int], spans: list[list[int]], span_queries: list[np.ndarray],
                  q: np.ndarray, k: np.ndarray, span_keys: list[np.ndarray], length: int) -> np.ndarray:
  """One row of A from D_i, the spans, their query and key abstractions."""
  scale = 1.0 / math.sqrt(q.shape[1])
  row = np.zeros(length)
  if not direct and not spans:
    return row  # a padded query with nothing to see: the op only has to stay finite here
  logits = [q[i] @ k[j] * scale for j in direct] + [q[i] @ kb * scale for kb in span_keys]
  w = _softmax(np.array(logits))
  for j, wj in zip(direct, w[:len(direct)], strict=True):
    row[j] += wj
  for span, qb, wr in zip(spans, span_queries, w[len(direct):], strict=True):
    inner = _softmax(np.array([qb @ k[j] * scale for j in span]))
    for j, a in zip(span, inner, strict=True):
      row[j] += wr * a
  return row


def _plan_matrix(plan: str, q: np.ndarray, k: np.ndarray, pool_q: np.ndarray, pool_k: np.ndarray, *,
                 causal: bool, mask: Array | None, pooling: str, span_key_fn: Callable | None,
                 params: dict[str, Any]) -> np.ndarray:
  length = q.shape[0]
  a = np.zeros((length, length))
  for i in range(length):
    direct, spans = plan_sets(plan, length, i, causal=causal, mask=mask, **params)
    aligned = span_query_rows(plan, length, i, causal=causal, mask=mask, **params)
    span_q = [q[t] if t is not None else _pool(pool_q, span, pooling)
              for span, t in zip(spans, aligned, strict=True)]
    span_k = [_pool(pool_k, span, pooling) for span in spans]
    if span_key_fn is not None:
      span_k = [np.asarray(span_key_fn(kb), np.float64) for kb in span_k]
    a[i] = _combiner_row(i, direct, spans, span_q, q, k, span_k, length)
  return a


def attention_matrix(plan: str, q: Array, k: Array, *, causal: bool, mask: Array | None = None,
                     pooling: str = "max", pool_q: Array | None = None, pool_k: Array | None = None,
                     span_key_fn: Callable | None = None, **params: Any) -> np.ndarray:
  """The effective dense attention A [L, L] of a Combiner plan for one (batch, head), float64.

  q, k: [L, d]; pool_q / pool_k: [L, d'] pooled instead of q / k for the span abstractions (default q / k).
  "mixture" takes row_length and normalize: "mean" averages the vertical and horizontal matrices, "joint" puts
  D_i once and both span families under one outer softmax. `span_key_fn` (axial_rowmajor only) maps each
  pooled span key [d] to the span key actually used, per span (so it must act on one key vector at a time).
  Padded query rows (mask[i] False) are whatever the sets give; only real rows are part of the contract.
  """
  if pooling not in POOLINGS:
    raise ValueError(f"reference: argument 'pooling' must be one of {POOLINGS}, got {pooling!r}")
  q, k = _as_matrix(q, "q"), _as_matrix(k, "k")
  if q.shape != k.shape:
    raise ValueError(f"reference: 'q' and 'k' must have the same shape, got {q.shape} and {k.shape}")
  length = q.shape[0]
  pool_q = q if pool_q is None else _as_matrix(pool_q, "pool_q", length)
  pool_k = k if pool_k is None else _as_matrix(pool_k, "pool_k", length)
  if pool_q.shape[1] != q.shape[1] or pool_k.shape[1] != q.shape[1]:
    raise ValueError("reference: 'pool_q' and 'pool_k' must have q's head_dim (they meet k_j, q_i in logits)")
  if span_key_fn is not None and plan != "axial_rowmajor":
    raise ValueError("reference: argument 'span_key_fn' applies to plan 'axial_rowmajor' only")
  common = dict(causal=causal, mask=mask, pooling=pooling, span_key_fn=span_key_fn)
  if plan == "mixture":
    normalize = params.pop("normalize", "mean")
    _no_extra(params, ("row_length",), plan)
    if normalize == "mean":
      av = _plan_matrix("axial_vertical", q, k, pool_q, pool_k, params=params, **common)
      ah = _plan_matrix("axial_horizontal", q, k, pool_q, pool_k, params=params, **common)
      return 0.5 * (av + ah)
    if normalize != "joint":
      raise ValueError(f"reference: argument 'normalize' must be one of {NORMALIZES}, got {normalize!r}")
    a = np.zeros((length, length))
    for i in range(length):
      direct, vspans = plan_sets("axial_vertical", length, i, causal=causal, mask=mask, **params)
      direct_h, hspans = plan_sets("axial_horizontal", length, i, causal=causal, mask=mask, **params)
      assert direct == direct_h  # both plans attend own row u own column directly
      spans = vspans + hspans
      a[i] = _combiner_row(i, direct, spans, [_pool(pool_q, s, pooling) for s in spans], q, k,
                           [_pool(pool_k, s, pooling) for s in spans], length)
    return a
  if plan not in PLANS:
    raise ValueError(f"reference: argument 'plan' must be one of {MATRIX_PLANS}, got {plan!r}")
  return _plan_matrix(plan, q, k, pool_q, pool_k, params=params, **common)


# ----------------------------------------------------------------------------------------------------------
# Sparse baselines: the plans with the spans dropped (docs/design.md section 4, last note)


def sparse_support(plan: str, length: int, i: int, *, causal: bool, mask: Array | None = None, **params: Any
                   ) -> list[int]:
  """Sorted keys query i attends to in the sparse baseline of `plan` ("fixed", "logsparse", "axial").

  fixed: D_i u {j in Omega_i : j mod s = s-1} (Child et al.'s summary positions); logsparse: {i} u the last
  position of each (unmasked) span, the one nearest i; axial: (own row u own column) n Omega_i. Masked keys
  are removed afterwards: a masked summary position is simply absent, nothing replaces it.
  """
  if not 0 <= i < length:
    raise ValueError(f"reference: query index {i} outside [0, {length})")
  real = _real(length, mask)
  visible = set(omega(length, i, causal=causal))
  if plan == "fixed":
    _no_extra(params, ("block_size",), plan)
    s = _positive_int(params, "block_size", plan)
    support = {j for j in visible if j // s == i // s or j % s == s - 1}
  elif plan == "logsparse":
    _no_extra(params, (), plan)
    support = {i} | {span[-1] for span in _logsparse_causal_spans(i)}
    if not causal:
      support |= {length - 1 - span[-1] for span in _logsparse_causal_spans(length - 1 - i)}
  elif plan == "axial":
    _no_extra(params, ("row_length",), plan)
    m = _positive_int(params, "row_length", plan)
    support = {j for j in visible if j // m == i // m or j % m == i % m}
  else:
    raise ValueError(f"reference: argument 'plan' must be one of {SPARSE_PLANS}, got {plan!r}")
  return sorted(j for j in support if j in visible and real[j])


def sparse_attention_matrix(plan: str, q: Array, k: Array, *, causal: bool, mask: Array | None = None,
                            **params: Any) -> np.ndarray:
  """A [L, L] of a sparse baseline for one (batch, head): softmax of s(q_i, k_j) over `sparse_support`."""
  q, k = _as_matrix(q, "q"), _as_matrix(k, "k")
  length = q.shape[0]
  scale = 1.0 / math.sqrt(q.shape[1])
  a = np.zeros((length, length))
  for i in range(length):
    support = sparse_support(plan, length, i, causal=causal, mask=mask, **params)
    if support:
      a[i, support] = _softmax(np.array([q[i] @ k[j] * scale for j in support]))
  return a


# ----------------------------------------------------------------------------------------------------------
# Batched convenience under the op layout


def _per_head(x: Array | None, b: int, h: int) -> np.ndarray | None:
  return None if x is None else np.asarray(x, np.float64)[b, :, h, :]


def _batched(matrix_fn: Callable[..., np.ndarray], q: Array, k: Array, v: Array, mask: Array | None,
             head_params: Callable[[int, int], dict[str, Any]]) -> np.ndarray:
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"reference: q, k [batch, length, heads, d] and v [batch, length, heads, dv] expected, "
                     f"got {q.shape}, {k.shape}, {v.shape}")
  batch, length, heads, _ = q.shape
  out = np.zeros(v.shape)
  for b in range(batch):
    mask_b = None if mask is None else np.asarray(mask, bool)[b]
    for h in range(heads):
      a = matrix_fn(q[b, :, h], k[b, :, h], mask=mask_b, **head_params(b, h))
      out[b, :, h] = a @ v[b, :, h]
  return out


def reference_op(plan: str, q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                 pool_q: Array | None = None, pool_k: Array | None = None, **params: Any) -> np.ndarray:
  """out = A @ v per (batch, head) under the op layout: q, k [batch, L, heads, d], v [batch, L, heads, dv].

  For "routed", `cluster_ids` is [batch, L, heads] (per head) or [batch, L] (shared by the heads).
  Returns float64 NumPy [batch, L, heads, dv].
  """
  cluster_ids = params.pop("cluster_ids", None)

  def head_params(b: int, h: int) -> dict[str, Any]:
    extra = dict(params, pool_q=_per_head(pool_q, b, h), pool_k=_per_head(pool_k, b, h))
    if cluster_ids is not None:
      ids = np.asarray(cluster_ids)
      extra["cluster_ids"] = ids[b, :, h] if ids.ndim == 3 else ids[b]
    return extra

  return _batched(lambda qq, kk, **kw: attention_matrix(plan, qq, kk, causal=causal, **kw), q, k, v, mask,
                  head_params)


def sparse_reference_op(plan: str, q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                        **params: Any) -> np.ndarray:
  """Sparse baseline out = A @ v per (batch, head) under the op layout."""
  return _batched(lambda qq, kk, **kw: sparse_attention_matrix(plan, qq, kk, causal=causal, **kw), q, k, v,
                  mask, lambda b, h: dict(params))
