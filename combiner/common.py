"""Input handling shared by the Combiner plans: contract checks, compute dtype, head-major layout, padding.

Plans compute in the head-major layout [batch, heads, length, dim]: batch and heads then lead every batched
matmul, which XLA runs without the transposes that the contract's [batch, length, heads, dim] would cost at
each einsum (docs/benchmarks.md, "Design measurements").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from combiner.pooling import POOLINGS
from core import contract
from core.blocks import head_major

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


def kernel_dtype(*arrays: Array) -> Any:
  """Matmul input dtype of the fused kernels: the inputs' 16-bit float type, else float32."""
  dt = jnp.result_type(*(a.dtype for a in arrays))
  return dt if jnp.dtype(dt).itemsize < 4 else jnp.float32


def prepare(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, pooling: Any = "max",
            pool_q: Array | None = None, pool_k: Array | None = None, materialize: bool = False,
            implementation: str | None = None) -> Inputs:
  """Checks the op contract, casts to the softmax dtype (float32, or float64 under x64), goes head-major.

  materialize: build the head-major q, k, v as real arrays (`materialized_head_major`); for plans that reshape
  them into many different grids (logsparse: one per level).
  implementation: the op's "auto" | "xla" | "pallas" argument (None: the op has only the XLA path). For the
  fused kernels q, k, v stay in `kernel_dtype` (a bfloat16 input is not widened to float32 only to be
  narrowed again at the kernel); the pooled inputs still take the softmax dtype, as pooling runs there.
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
  pooled = []
  for name, x, default in (("pool_q", pool_q, q), ("pool_k", pool_k, k)):
    if x is None:
      x = default
    elif not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
    pooled.append(head_major(jnp.asarray(x).astype(ct)))
  kernel = None
  if implementation is not None and contract.resolve_implementation(implementation, op=op) == "pallas":
    kernel = kernel_dtype(q, k, v)
  to_heads = materialized_head_major if materialize else head_major
  dt = ct if kernel is None else kernel
  return Inputs(to_heads(q.astype(dt)), to_heads(k.astype(dt)), to_heads(v.astype(dt)), mask, pooled[0],
                pooled[1], contract.logit_scale(q.shape[-1]), v.dtype, kernel)


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
