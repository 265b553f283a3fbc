"""Input handling shared by the baselines' ops."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from core.blocks import head_major

Array = Any


def masked_head_major(x: Array, mask: Array, dtype: Any) -> Array:
  """[batch, length, heads, dim] -> [batch, heads, length, dim] in `dtype`, masked positions set to zero.

  A select, so NaN or Inf held by masked keys or values reaches neither outputs (a zero softmax weight times
  Inf is NaN) nor gradients. mask: [batch, length] bool, True = real."""
  return jnp.where(mask[:, None, :, None], head_major(x.astype(dtype)), 0.0)


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
