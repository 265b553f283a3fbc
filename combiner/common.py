"""Input handling shared by the Combiner plans: contract checks, compute dtype, head-major layout, padding.

Plans compute in the head-major layout [batch, heads, length, dim]: batch and heads then lead every batched
matmul, which XLA runs without the transposes that the contract's [batch, length, heads, dim] would cost at
each einsum (docs/benchmarks.md, "Design measurements").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from attention_core import contract
from attention_core.blocks import head_major, map_chunks
from attention_core.combine import attend
from combiner import flash
from combiner import pooling as pool_ops
from combiner.pooling import POOLINGS

Array = Any


class Inputs(NamedTuple):
  q: Array  # [batch, heads, length, head_dim], compute dtype (kernel_dtype for the fused kernels)
  k: Array  # [batch, heads, length, head_dim]
  v: Array  # [batch, heads, length, value_dim]
  mask: Array  # [batch, length] bool
  pool_q: Array  # [batch, heads, length, head_dim]: pooled into span queries, softmax dtype
  pool_k: Array  # [batch, heads, length, head_dim]: pooled into span keys, softmax dtype
  scale: float
  out_dtype: Any
  kernel_dtype: Any = None  # matmul input dtype of the fused kernels; None: the XLA path
  heads_last: bool = False  # every array above in the contract's [batch, length, heads, dim] instead


def kernel_dtype(*arrays: Array) -> Any:
  """Matmul input dtype of the fused kernels: the inputs' 16-bit float type, else float32."""
  dt = jnp.result_type(*(a.dtype for a in arrays))
  return dt if jnp.dtype(dt).itemsize < 4 else jnp.float32


def plan_choice(*_: Any, implementation: Any = "auto", **__: Any) -> Any:
  """What a plan's trace depends on per platform (the key of `contract.per_platform_op`): the implementation
  "auto" resolves to and, for the fused kernels, their layout and tiles."""
  if implementation not in contract.IMPLEMENTATIONS:
    return implementation  # the op rejects it
  chosen = contract.resolve_implementation(implementation, op="")
  return (chosen, flash.packs_heads(), flash.tile_caps()) if chosen == "pallas" else chosen


per_platform = contract.per_platform_op(plan_choice)  # decorator: a plan's choices made per lowering platform


def prepare(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, pooling: Any = "max",
            pool_q: Array | None = None, pool_k: Array | None = None, materialize: bool = False,
            implementation: str | None = None, heads_last: bool = False) -> Inputs:
  """Checks the op contract, casts to the softmax dtype (float32, or float64 under x64), goes head-major.

  materialize: build the head-major q, k, v as real arrays (`materialized_head_major`); for plans that reshape
  them into many different grids (logsparse: one per level).
  implementation: the op's "auto" | "xla" | "pallas" argument (None: the op has only the XLA path). For the
  fused kernels q, k, v stay in `kernel_dtype` (a bfloat16 input is not widened to float32 only to be
  narrowed again at the kernel); the pooled inputs still take the softmax dtype, as pooling runs there.
  heads_last: a fused plan that hands the kernels heads-packed arrays (`combiner.flash.packs_heads`) keeps
  the contract's layout, so nothing is transposed; Inputs.heads_last says whether it did.
  """
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  # Masked keys and values are zeroed by a select, so a NaN or Inf behind the mask reaches no logit, pooled
  # summary or gradient (a product with zero weight would still be NaN).
  real = mask[:, :, None, None]  # [batch, length, 1, 1]
  k, v = jnp.where(real, k, 0), jnp.where(real, v, 0)
  pool_k = None if pool_k is None else jnp.where(real, jnp.asarray(pool_k), 0)
  contract.check_choice(pooling, name="pooling", allowed=POOLINGS, op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  kernel = None
  if implementation is not None and contract.resolve_implementation(implementation, op=op) == "pallas":
    kernel = kernel_dtype(q, k, v)
  # Max pooling is exact in any dtype: the fused kernels pool their own dtype (no float32 copy of q and k).
  pool_dt = kernel if kernel is not None and pooling == "max" else ct
  pooled = []
  for name, x, default in (("pool_q", pool_q, q), ("pool_k", pool_k, k)):
    if x is None:
      x = default
    elif not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
    pooled.append(jnp.asarray(x).astype(pool_dt))
  heads_last = heads_last and kernel is not None
  layout = pooled_layout = head_major
  if heads_last:
    layout = pooled_layout = _same
  elif materialize:
    layout = materialized_head_major
  dt = ct if kernel is None else kernel
  scale = contract.logit_scale(q.shape[-1])
  return Inputs(layout(q.astype(dt)), layout(k.astype(dt)), layout(v.astype(dt)), mask,
                pooled_layout(pooled[0]), pooled_layout(pooled[1]), scale, v.dtype, kernel, heads_last)


def _same(x: Array) -> Array:
  return x


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


def span_summary(pk: Array, pq: Array, k: Array, v: Array, valid: Array, scale: float, pooling: str
            ) -> tuple[Array, Array, Array]:
  """One span's abstraction: pooled key, in-span value and whether it is nonempty.

  pk, pq, k: [batch, heads, n, head_dim]; v: [batch, heads, n, value_dim]; valid: [n] members of the span.
  Returns k̄ [batch, heads, head_dim], ṽ = softmax_j(s(q̄, k_j)) v_j [batch, heads, value_dim], nonempty [1, 1].
  """
  member = valid[None, None, :]  # [1, 1, n]
  k_bar, nonempty = pool_ops.pool(pk, member, axis=2, kind=pooling)
  q_bar, _ = pool_ops.pool(pq, member, axis=2, kind=pooling)
  logits = jnp.einsum("bhd,bhnd->bhn", q_bar, k) * scale  # [batch, heads, n]
  return k_bar, attend(logits, member, v, "bhn,bhnd->bhd"), nonempty
