"""Input handling shared by the Combiner plans: contract checks, compute dtype, padding to whole blocks/rows."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from combiner import contract
from combiner.pooling import POOLINGS

Array = Any


class Inputs(NamedTuple):
  q: Array  # [batch, length, heads, head_dim], compute dtype
  k: Array  # [batch, length, heads, head_dim]
  v: Array  # [batch, length, heads, value_dim]
  mask: Array  # [batch, length] bool
  pool_q: Array  # [batch, length, heads, head_dim]: pooled into span queries
  pool_k: Array  # [batch, length, heads, head_dim]: pooled into span keys
  scale: float
  out_dtype: Any


def prepare(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, pooling: Any = "max",
            pool_q: Array | None = None, pool_k: Array | None = None) -> Inputs:
  """Checks the op contract and casts everything to the softmax dtype (float32, or float64 under x64)."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  contract.check_choice(pooling, name="pooling", allowed=POOLINGS, op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  pooled = []
  for name, x, default in (("pool_q", pool_q, q), ("pool_k", pool_k, k)):
    if x is None:
      x = default
    elif not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
    pooled.append(jnp.asarray(x).astype(ct))
  return Inputs(q.astype(ct), k.astype(ct), v.astype(ct), mask, pooled[0], pooled[1],
                contract.logit_scale(q.shape[-1]), v.dtype)


def pad_to(x: Array, length: int, axis: int = 1) -> Array:
  """Pads `axis` up to `length`; padded positions are later masked out as keys and sliced off as queries."""
  extra = length - x.shape[axis]
  if extra == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


def to_grid(x: Array, rows: int, cols: int) -> Array:
  """[batch, length, ...] -> [batch, rows, cols, ...], padding the tail (length <= rows * cols)."""
  x = pad_to(x, rows * cols)
  return x.reshape(x.shape[0], rows, cols, *x.shape[2:])


def from_grid(x: Array, length: int) -> Array:
  """[batch, rows, cols, ...] -> [batch, length, ...]."""
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :length]


def num_blocks(length: int, size: int) -> int:
  return -(-length // size)
