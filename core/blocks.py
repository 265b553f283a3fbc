"""Padding, head-major layout and block/grid reshapes shared by the block-structured ops.

Block-structured ops pad the position axis to whole blocks (the padded keys are masked, the padded queries sliced
off) and view it as a [rows, cols] grid; plans compute head-major, [batch, heads, length, dim].
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

Array = Any


def head_major(x: Array) -> Array:
  """[batch, length, heads, dim] <-> [batch, heads, length, dim] (its own inverse)."""
  return jnp.swapaxes(x, 1, 2)


def pad_to(x: Array, length: int, axis: int) -> Array:
  """Pads `axis` up to `length`; padded positions are later masked out as keys and sliced off as queries."""
  extra = length - x.shape[axis]
  if extra == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


def to_grid(x: Array, rows: int, cols: int, axis: int) -> Array:
  """Splits position `axis` into (rows, cols), padding the tail (length <= rows * cols)."""
  x = pad_to(x, rows * cols, axis)
  return x.reshape(*x.shape[:axis], rows, cols, *x.shape[axis + 1:])


def from_grid(x: Array, length: int, axis: int) -> Array:
  """Merges (rows, cols) at `axis`, `axis + 1` back into one position axis of `length`."""
  x = x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])
  return x[(slice(None),) * axis + (slice(0, length),)]


def num_blocks(length: int, size: int) -> int:
  return -(-length // size)
