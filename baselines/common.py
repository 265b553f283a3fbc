"""Input handling shared by the baselines' ops.

The ops compute on one leading axis of batch x heads ("rows": [batch * heads, length, dim]) rather than
[batch, heads, length, dim]: XLA:CPU runs fused sum reductions many times slower on arrays that hold a unit
axis (batch 1, the common case), and every broadcast over such an axis brings one into the backward pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from core.blocks import head_major

Array = Any


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
