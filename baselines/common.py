"""Input handling shared by the baselines' ops.

The ops compute on one leading axis of batch x heads ("rows": [batch * heads, length, dim]) rather than
[batch, heads, length, dim]: XLA:CPU runs fused sum reductions many times slower on arrays that hold a unit
axis (batch 1, the common case), and every broadcast over such an axis brings one into the backward pass.

On a CPU the rows run in sequential chunks (`num_row_chunks`, `core.blocks.map_chunks`): XLA:CPU takes fresh
scratch memory for every execution and pays a page fault for each page it first touches, so intermediates
sized for all rows at once cost about as much in faults as in arithmetic, even with the recomputation in the
backward pass that keeps only one chunk's intermediates alive.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from core import contract
from core.blocks import head_major

Array = Any
# Positions per row chunk on a CPU (`num_row_chunks`): one row of this length at a time.
CHUNK_POSITIONS = 8192


def neighbour_blocks(x: Array, offsets: tuple[int, ...], axis: int, fill: Any = 0) -> Array:
  """Blocks n + o for each offset o in {-1, 0, 1} next to each other: x [..., n, size, ...] (blocks at `axis`)
  -> [..., n, len(offsets) * size, ...]; blocks before the first or after the last hold `fill`. Pads and
  slices only, so the backward pass is as cheap as the forward."""
  n = x.shape[axis]
  pad = [(0, 0)] * x.ndim
  pad[axis] = (1, 1)
  x = jnp.pad(x, pad, constant_values=fill)
  parts = [jax.lax.slice_in_dim(x, 1 + o, 1 + o + n, axis=axis) for o in offsets]
  return jnp.concatenate(parts, axis=axis + 1)


def to_rows(x: Array, dtype: Any) -> Array:
  """[batch, length, heads, dim] -> [batch * heads, length, dim] in `dtype`."""
  batch, length, heads, dim = x.shape
  return head_major(x.astype(dtype)).reshape(batch * heads, length, dim)


def masked_rows(x: Array, mask: Array, dtype: Any) -> Array:
  """`to_rows` with masked positions selected to zero (NaN or Inf there reaches neither outputs nor
  gradients). mask: [batch, length] bool, True = real."""
  return jnp.where(rows_mask(mask, x.shape[2])[:, :, None], to_rows(x, dtype), 0.0)


def rows_mask(mask: Array, heads: int) -> Array:
  """[batch, length] -> [batch * heads, length]: each batch row's mask repeated for its heads."""
  return jnp.repeat(mask, heads, axis=0)


def from_rows(x: Array, batch: int, dtype: Any) -> Array:
  """[batch * heads, length, dim] -> [batch, length, heads, dim] in `dtype` (the inverse of `to_rows`)."""
  rows, length, dim = x.shape
  return head_major(x.reshape(batch, rows // batch, length, dim)).astype(dtype)


def num_row_chunks(rows: int, length: int, chunks: Any, *, op: str) -> int:
  """How many sequential chunks of rows an op runs in: `chunks` if given (1 = all rows at once, at most
  `rows`); None = automatic: on a CPU, chunks of about CHUNK_POSITIONS positions (rows x length) each; on an
  accelerator, whose allocator keeps its memory and whose cores want every row at once, one."""
  if chunks is None:
    if jax.default_backend() != "cpu":
      return 1
    return -(-rows // max(1, CHUNK_POSITIONS // length))
  return min(rows, contract.check_positive_int(chunks, name="row_chunks", op=op))
