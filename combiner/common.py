"""Input handling shared by the Combiner plans: contract checks, compute dtype, head-major layout, padding.

Plans compute in the head-major layout [batch, heads, length, dim]: batch and heads then lead every batched
matmul, which XLA runs without the transposes that the contract's [batch, length, heads, dim] would cost at
each einsum (docs/benchmarks_design.md, "Design measurements").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from attention_core import contract
from attention_core.blocks import head_major, map_chunks
from attention_core.combine import attend
from combiner import pooling as pool_ops
from combiner.pooling import POOLINGS

Array = Any


class Inputs(NamedTuple):
  q: Array  # [batch, heads, length, head_dim], softmax dtype
  k: Array  # [batch, heads, length, head_dim]
  v: Array  # [batch, heads, length, value_dim]
  mask: Array  # [batch, length] bool
  pool_q: Array  # [batch, heads, length, head_dim]: pooled into span queries
  pool_k: Array  # [batch, heads, length, head_dim]: pooled into span keys
  scale: float
  out_dtype: Any


class Checked(NamedTuple):
  """An op's inputs after the contract's checks, in the contract's layout: what the kernels take."""

  q: Array  # [batch, length, heads, head_dim]
  k: Array
  v: Array  # [batch, length, heads, value_dim]
  mask: Array | None  # [batch, length] bool, None: every key is real
  pool_q: Array | None  # DeepSets pools, or None: q and k themselves
  pool_k: Array | None


def plan_choice(*_: Any, implementation: Any = "auto", **__: Any) -> Any:
  """What a plan's trace depends on per platform (the key of `contract.per_platform_op`): the implementation
  "auto" resolves to and, for the kernels, the platform they are built for (layout, tiles, lowering)."""
  if implementation not in contract.IMPLEMENTATIONS:
    return implementation  # the op rejects it
  chosen = contract.resolve_implementation(implementation, op="")
  return (chosen, contract.backend()) if chosen == "pallas" else chosen


per_platform = contract.per_platform_op(plan_choice)  # decorator: a plan's choices made per lowering platform


def check(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, pooling: Any = "max",
          pool_q: Array | None = None, pool_k: Array | None = None) -> Checked:
  """The op contract's checks of a plan's inputs (docs/design.md §3); ValueError/TypeError naming the
  argument. A single DeepSets pool is paired with q or k for the other."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op, keep_none=True)
  contract.check_bool(causal, name="causal", op=op)
  contract.check_choice(pooling, name="pooling", allowed=POOLINGS, op=op)
  for name, x in (("pool_q", pool_q), ("pool_k", pool_k)):
    if x is not None and (not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape)):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
  if (pool_q is None) != (pool_k is None):
    pool_q, pool_k = (q if pool_q is None else pool_q), (k if pool_k is None else pool_k)
  pools = (None, None) if pool_q is None else (jnp.asarray(pool_q), jnp.asarray(pool_k))
  return Checked(q, k, v, mask, *pools)


def uses_kernels(implementation: Any, *, op: str) -> bool:
  """Whether an op's `implementation` ("auto" | "xla" | "pallas") runs the kernels for the platform traced."""
  return contract.resolve_implementation(implementation, op=op) == "pallas"


def prepare(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, pooling: Any = "max",
            pool_q: Array | None = None, pool_k: Array | None = None, materialize: bool = False) -> Inputs:
  """The XLA plans' inputs: checked (`check`), cast to the softmax dtype (float32, or float64 under x64),
  head-major.

  materialize: build the head-major q, k, v as real arrays (`materialized_head_major`); for plans that reshape
  them into many different grids (logsparse: one per level).
  """
  c = check(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
  q, k, v = c.q, c.k, c.v
  mask = jnp.ones(q.shape[:2], bool) if c.mask is None else c.mask
  # Masked keys and values are zeroed by a select, so a NaN or Inf behind the mask reaches no logit, pooled
  # summary or gradient (a product with zero weight would still be NaN).
  real = mask[:, :, None, None]  # [batch, length, 1, 1]
  k, v = jnp.where(real, k, 0), jnp.where(real, v, 0)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  pooled = [(q if c.pool_q is None else c.pool_q).astype(ct),
            (k if c.pool_k is None else jnp.where(real, c.pool_k, 0)).astype(ct)]
  layout = materialized_head_major if materialize else head_major
  scale = contract.logit_scale(q.shape[-1])
  return Inputs(layout(q.astype(ct)), layout(k.astype(ct)), layout(v.astype(ct)), mask,
                head_major(pooled[0]), head_major(pooled[1]), scale, v.dtype)


def materialized_head_major(x: Array) -> Array:
  """head_major(x) [batch, heads, length, dim] as a permuting gather instead of a transpose.

  XLA:CPU turns a transpose into a layout change and then fuses a transposing copy into every consumer that
  reshapes it; with one grid per logsparse level that is one full-size copy per level and consumer, all kept
  alive for the backward pass (about half the temp memory with the gather). A gather is always a real array,
  so every grid is a free reshape of it; its backward is a scatter with unique indices, as cheap as the copy
  it replaces.
  """
  batch, length, heads, dim = x.shape
  # (head, position) order
  rows = (np.arange(heads)[:, None] + heads * np.arange(length)[None, :]).reshape(-1)
  out = jnp.take(x.reshape(batch, length * heads, dim), jnp.asarray(rows, jnp.int32), axis=1,
                 unique_indices=True, indices_are_sorted=False, mode="clip")  # [batch, heads * length, dim]
  return out.reshape(batch, heads, length, dim)


def finish(out: Array, x: Inputs) -> Array:
  """[batch, heads, length, value_dim] -> the contract's [batch, length, heads, value_dim] in v's dtype."""
  return head_major(out).astype(x.out_dtype)


# The XLA paths of the grid plans (axial, mixture, sparse axial) hold several [batch, heads, rows, cols, n]
# logits and softmax-weight tensors (n = rows or cols), O(L·sqrt(L)) each. Where the largest of them exceeds
# this many bytes, the query rows are split into chunks that each stay under it and run one after the other
# (`map_rows`), and the backward recomputes a chunk's logits rather than keeping every chunk's. Below it
# the op runs in one piece: recomputation costs time, and at these sizes memory is not what limits it.
QUERY_CHUNK_BYTES = 1 << 30


def row_chunks(rows: int, row_bytes: int, query_chunks: int | None, *, op: str) -> int:
  """How many chunks of query rows to run: `query_chunks` if given (1 = one piece), else the fewest whose
  largest per-chunk tensor (`row_bytes` per query row) stays within QUERY_CHUNK_BYTES; at most `rows`."""
  if query_chunks is None:
    return max(1, min(rows, -(-rows * row_bytes // QUERY_CHUNK_BYTES)))
  return min(rows, check_query_chunks(query_chunks, op=op))


def check_query_chunks(query_chunks: Any, *, op: str) -> int | None:
  """None (automatic) or a positive number of chunks."""
  return None if query_chunks is None else contract.check_positive_int(query_chunks, name="query_chunks",
                                                                       op=op)


def map_rows(fn: Callable[[Any], Any], per_row: Any, chunks: int) -> Any:
  """fn(per_row) computed over `chunks` chunks of query rows, one after the other
     (`attention_core.blocks.map_chunks`).

  per_row: a pytree of arrays [batch or 1, heads or 1, rows, ...] (rows on axis 2); fn maps a chunk to a
  pytree of arrays with the chunk's rows on axis 2. Each chunk's backward recomputes its intermediates.
  """
  return map_chunks(fn, per_row, chunks, axis=2)


def span_summaries(pq: Array, pk: Array, k: Array, v: Array, valid: Array, scale: float,
                   pooling: str) -> tuple[Array, Array, Array]:
  """Span abstractions over the members axis (the second to last): pooled key, in-span value, nonempty.

  pq, pk, k: [..., n, head_dim] (pooled query source, pooled key source, keys); v: [..., n, value_dim];
  valid: [..., n], broadcastable (heads may be 1), the span's real members. Returns k_bar [..., head_dim],
  v_tilde = softmax_j(s(q_bar, k_j)) v_j [..., value_dim] and nonempty [...] (valid's leading dims).
  """
  axis = k.ndim - 2
  valid = valid.reshape((1,) * (k.ndim - 1 - valid.ndim) + valid.shape)
  k_bar, nonempty = pool_ops.pool(pk, valid, axis=axis, kind=pooling)
  q_bar, _ = pool_ops.pool(pq, valid, axis=axis, kind=pooling)
  logits = jnp.einsum("...d,...nd->...n", q_bar, k) * scale  # [..., n]
  return k_bar, attend(logits, valid, v, "...n,...nd->...d"), nonempty
