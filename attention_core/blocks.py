"""Padding, head-major layout and block/grid reshapes shared by the block-structured ops.

Block-structured ops pad the position axis to whole blocks (the padded keys are masked, the padded queries
sliced off) and view it as a [rows, cols] grid; plans compute head-major, [batch, heads, length, dim].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = Any


def head_major(x: Array) -> Array:
  """[batch, length, heads, dim] <-> [batch, heads, length, dim] (its own inverse)."""
  return jnp.swapaxes(x, 1, 2)


def pad_to(x: Array, length: int, axis: int, fill: Any = 0) -> Array:
  """Pads `axis` up to `length` with `fill`; padded positions are later masked out as keys and sliced off as
  queries (a fill such as -1 or False marks them in index and mask arrays)."""
  extra = length - x.shape[axis]
  if extra == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad, constant_values=fill)


def to_grid(x: Array, rows: int, cols: int, axis: int, fill: Any = 0) -> Array:
  """Splits position `axis` into (rows, cols), padding the tail with `fill` (length <= rows * cols)."""
  x = pad_to(x, rows * cols, axis, fill)
  return x.reshape(*x.shape[:axis], rows, cols, *x.shape[axis + 1:])


def from_grid(x: Array, length: int, axis: int) -> Array:
  """Merges (rows, cols) at `axis`, `axis + 1` back into one position axis of `length`."""
  x = x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])
  return x[(slice(None),) * axis + (slice(0, length),)]


def shift(x: Array, axis: int, reverse: bool, fill: Any) -> Array:
  """Shift by one along `axis` (forward: x[t] <- x[t-1]; reverse: x[t] <- x[t+1]), filling the vacated
  slot."""
  n = x.shape[axis]
  pad = [(0, 0)] * x.ndim
  if reverse:
    pad[axis] = (0, 1)
    return jnp.pad(jax.lax.slice_in_dim(x, 1, n, axis=axis), pad, constant_values=fill)
  pad[axis] = (1, 0)
  return jnp.pad(jax.lax.slice_in_dim(x, 0, n - 1, axis=axis), pad, constant_values=fill)


def num_blocks(length: int, size: int) -> int:
  return -(-length // size)


def neighbours(x: Array, offsets: tuple[int, ...], axis: int, fill: Any = 0) -> Array:
  """Block n + o of every block n, for each offset o, side by side: [..., blocks, size, ...] ->
  [..., blocks, len(offsets) * size, ...] (`axis` is the blocks axis). Blocks before the first or after
  the last are `fill`."""
  blocks = x.shape[axis]
  parts = []
  for o in offsets:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (max(-o, 0), max(o, 0))
    shifted = jnp.pad(x, pad, constant_values=fill) if o else x
    parts.append(jax.lax.slice_in_dim(shifted, max(o, 0), max(o, 0) + blocks, axis=axis))
  return jnp.concatenate(parts, axis=axis + 1)


def map_chunks(fn: Callable[[Any], Any], tree: Any, chunks: int, axis: int) -> Any:
  """fn(tree) computed over `chunks` slices of `axis`, one after the other, each a `jax.checkpoint`.

  tree: a pytree of arrays sharing the size of `axis`, split into `chunks` equal slices (the tail padded with
  zeros, its results dropped); fn maps a slice to a pytree of arrays with the slice on the same axis, and
  must treat the entries along `axis` independently. The backward recomputes one slice's intermediates at a
  time, so only one slice's are alive, forward and backward: less memory for big intermediates, and on a
  CPU, where every execution touches its scratch memory afresh, less time as well.
  """
  if chunks <= 1:
    return fn(tree)
  total = jax.tree.leaves(tree)[0].shape[axis]
  size = -(-total // chunks)
  chunks = -(-total // size)

  def split(x: Array) -> Array:  # [..., total, ...] -> [chunks, ..., size, ...]
    x = pad_to(x, chunks * size, axis)
    return jnp.moveaxis(x.reshape(*x.shape[:axis], chunks, size, *x.shape[axis + 1:]), axis, 0)

  def join(y: Array) -> Array:  # [chunks, ..., size, ...] -> [..., total, ...]
    y = jnp.moveaxis(y, 0, axis)
    y = y.reshape(*y.shape[:axis], chunks * size, *y.shape[axis + 2:])
    return jax.lax.slice_in_dim(y, 0, total, axis=axis)

  return jax.tree.map(join, jax.lax.map(jax.checkpoint(fn), jax.tree.map(split, tree)))
