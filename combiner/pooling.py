"""Span abstractions: coordinate-wise max or mean pooling over the real (unmasked) members of a span.

Pooling is kept as (value, count) statistics until it is finalised, so that empty spans are known and dropped.
Exclusive prefix statistics come from `cummax` (below) / `jax.lax.cumsum`, "all members but one" from a top-2
(or total-minus-self) reduction, block statistics from reshape-and-reduce; nothing of size L^2 is formed.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_core.blocks import shift

Array = Any
POOLINGS = ("max", "mean")


class Stats(NamedTuple):
  value: Array  # [..., dim]: running max (-inf when empty) or running sum
  count: Array  # [...] (heads may broadcast as 1): number of real members


def masked(x: Array, valid: Array, kind: str) -> Array:
  fill = -jnp.inf if kind == "max" else 0.0
  return jnp.where(valid[..., None], x, fill)


def reduce_stats(x: Array, valid: Array, axis: int, kind: str) -> Stats:
  """Statistics over `axis` of x [..., dim]; `valid` broadcasts against x.shape[:-1] (heads may be 1)."""
  xm = masked(x, valid, kind)
  value = jnp.max(xm, axis=axis) if kind == "max" else jnp.sum(xm, axis=axis)
  return Stats(value, jnp.sum(valid, axis=axis, dtype=jnp.int32))


def inclusive_scan_stats(x: Array, valid: Array, axis: int, kind: str, *, reverse: bool = False) -> Stats:
  """Statistics over the members up to and including (or from, `reverse`) each position along `axis`."""
  xm = masked(x, valid, kind)
  if kind == "max":
    value = cummax(xm, axis, reverse)
  else:
    value = jax.lax.cumsum(xm, axis=axis, reverse=reverse)
  return Stats(value, jax.lax.cumsum(valid.astype(jnp.int32), axis=axis, reverse=reverse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def cummax(x: Array, axis: int, reverse: bool = False) -> Array:
  """`jax.lax.cummax` whose gradient is that of a max over each prefix: the cotangent of prefix t goes to the
  members equal to its max, split evenly between ties (as `jnp.max`'s). JAX differentiates cummax through an
  associative scan, log2(n) levels of slices and pads in both passes; this backward is a few cumulative ops
  and one gather along `axis`."""
  return jax.lax.cummax(x, axis=axis, reverse=reverse)


def _cummax_fwd(x: Array, axis: int, reverse: bool):
  m = jax.lax.cummax(x, axis=axis, reverse=reverse)
  return m, (x, m)


def _cummax_bwd(axis: int, reverse: bool, res: tuple, g: Array):
  # "Earlier" and "later" are in scan order (decreasing index when `reverse`). The prefix max m is
  # nondecreasing, so the prefixes whose max a member s equals form a run [s, e(s)) of equal m: s gets the
  # cotangents h_t = g_t / n_t of that run, n_t the members tied at prefix t's max.
  x, m = res
  n = x.shape[axis]
  acc = jnp.promote_types(x.dtype, jnp.float32)
  tie = x == m  # member s attains its prefix's max
  run_start = m != shift(m, axis, reverse, -jnp.inf)  # a new max begins a run
  ties = jax.lax.cumsum(tie.astype(jnp.int32), axis=axis, reverse=reverse)
  count = ties - jax.lax.cummax(jnp.where(run_start, ties - 1, 0), axis=axis, reverse=reverse)  # n_t >= 1
  after = jax.lax.cumsum(g.astype(acc) / count, axis=axis, reverse=not reverse)  # sum of h over t at/after s
  order = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
  order = n - 1 - order if reverse else order  # scan position
  next_start = jax.lax.cummin(jnp.where(run_start, order, n), axis=axis, reverse=not reverse)
  end = shift(next_start, axis, not reverse, n)  # e(s): the first run start after s, n past the end
  pad = [(0, 0)] * x.ndim
  pad[axis] = (1, 0) if reverse else (0, 1)  # a zero where e(s) = n
  index = n - end if reverse else end
  beyond = jnp.take_along_axis(jnp.pad(after, pad), index, axis=axis)
  return (jnp.where(tie, after - beyond, 0).astype(x.dtype),)


cummax.defvjp(_cummax_fwd, _cummax_bwd)


def exclusive_scan_stats(x: Array, valid: Array, axis: int, kind: str, *, reverse: bool = False) -> Stats:
  """Statistics over the members strictly before (or after, `reverse`) each position along `axis`.

  The one-position shift is what keeps a query's own row/column out of its summary (a summary that included it
  would leak the future in causal mode).
  """
  s = inclusive_scan_stats(x, valid, axis, kind, reverse=reverse)
  fill = -jnp.inf if kind == "max" else 0.0
  return Stats(shift(s.value, axis, reverse, fill), shift(s.count, axis, reverse, 0))


def pair_stats(s: Stats, blocks: int, kind: str) -> Stats:
  """Statistics of `blocks` blocks, each the union of two consecutive blocks of `s` (along axis 2).

  s.value: [batch, heads, n, dim], s.count: [batch, 1, n] with n >= 2 * blocks - 1 (padded with empty blocks).
  """
  fill = -jnp.inf if kind == "max" else 0.0
  value = common_pad(s.value, 2 * blocks, fill)
  count = common_pad(s.count, 2 * blocks, 0)
  value = value.reshape(*value.shape[:2], blocks, 2, value.shape[-1])
  value = jnp.max(value, axis=3) if kind == "max" else jnp.sum(value, axis=3)
  return Stats(value, jnp.sum(count.reshape(*count.shape[:2], blocks, 2), axis=3))


def common_pad(x: Array, n: int, fill: Any) -> Array:
  extra = n - x.shape[2]
  if extra <= 0:
    return x[:, :, :n]
  pad = [(0, 0)] * x.ndim
  pad[2] = (0, extra)
  return jnp.pad(x, pad, constant_values=fill)


def all_but_one_stats(x: Array, valid: Array, axis: int, kind: str) -> Stats:
  """Statistics over all members along `axis` except the one at each position, in O(n) per position.

  max: the top value, except at the (first) arg-max position, which gets the runner-up; sum: total minus self.
  Both replace a prefix-and-suffix scan pair (two cummax passes and their gradients).
  """
  xm = masked(x, valid, kind)
  count = jnp.sum(valid, axis=axis, keepdims=True, dtype=jnp.int32) - valid.astype(jnp.int32)
  if kind != "max":
    return Stats(jnp.sum(xm, axis=axis, keepdims=True) - xm, count)
  first = jnp.argmax(xm, axis=axis, keepdims=True)  # [..., 1, ..., dim]
  is_first = jax.lax.broadcasted_iota(jnp.int32, xm.shape, axis) == first
  top1 = jnp.max(xm, axis=axis, keepdims=True)
  top2 = jnp.max(jnp.where(is_first, -jnp.inf, xm), axis=axis, keepdims=True)
  return Stats(jnp.where(is_first, top2, top1), count)


def finalize(s: Stats, kind: str) -> tuple[Array, Array]:
  """(pooled [..., dim], nonempty [...]); empty spans pool to 0 and must be dropped by the caller."""
  nonempty = s.count > 0
  if kind == "max":
    pooled = jnp.where(nonempty[..., None], s.value, 0.0)
  else:
    pooled = s.value / jnp.maximum(s.count, 1)[..., None].astype(s.value.dtype)
  return pooled, nonempty


def pool(x: Array, valid: Array, axis: int, kind: str) -> tuple[Array, Array]:
  return finalize(reduce_stats(x, valid, axis, kind), kind)
