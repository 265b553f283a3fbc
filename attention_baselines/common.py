"""Input handling shared by the baselines' ops.

The ops compute on one leading axis of batch x heads ("rows": [batch * heads, length, dim]) rather than
[batch, heads, length, dim]: XLA:CPU runs fused sum reductions many times slower on arrays that hold a unit
axis (batch 1, the common case), and every broadcast over such an axis brings one into the backward pass.

On a CPU the rows run in sequential blocks (`num_row_chunks`, `map_row_blocks`): XLA:CPU takes fresh scratch
memory for every execution whose scratch outgrows the allocator's reuse threshold, and pays a page fault for
each page it first touches, so intermediates sized for all rows at once cost about as much in faults as in
arithmetic. A block is sliced straight out of the [batch, length, heads, dim] inputs and written straight into
outputs and gradients of that layout, and the backward pass recomputes one block at a time (or uses the op's
own small per-block residuals), so only one block's intermediates are ever alive.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import head_major

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


def from_rows(x: Array, batch: int, dtype: Any) -> Array:
  """[batch * heads, length, dim] -> [batch, length, heads, dim] in `dtype` (the inverse of `to_rows`)."""
  rows, length, dim = x.shape
  return head_major(x.reshape(batch, rows // batch, length, dim)).astype(dtype)


def num_row_chunks(rows: int, length: int, chunks: Any, *, op: str) -> int:
  """How many sequential chunks of rows an op runs in: `chunks` if given (1 = all rows at once, at most
  `rows`); None = automatic: on a CPU, chunks of about CHUNK_POSITIONS positions (rows x length) each; on an
  accelerator, whose allocator keeps its memory and whose cores want every row at once, one (by
  `contract.backend`: `map_row_chunks` stages each platform's count)."""
  if chunks is None:
    if contract.backend() != "cpu":
      return 1
    return -(-rows // max(1, CHUNK_POSITIONS // length))
  return min(rows, contract.check_positive_int(chunks, name="row_chunks", op=op))


def map_row_chunks(fn: Callable[[int], Any], rows: int, length: int, chunks: Any, *, op: str) -> Any:
  """fn(num_row_chunks(rows, length, chunks)) per lowering platform (`contract.per_platform`): a CPU
  program runs its automatic chunks and an accelerator's, compiled from any host, one."""
  num_row_chunks(rows, length, chunks, op=op)  # rejects a bad count here, once
  return contract.per_platform(lambda: fn(num_row_chunks(rows, length, chunks, op=op)),
                               key=lambda: num_row_chunks(rows, length, chunks, op=op))


def row_blocks(batch: int, heads: int, chunks: int) -> tuple[int, int]:
  """(batches, heads) per block when the batch x heads rows run in about `chunks` sequential blocks: a block
  is whole divisors of both axes, so it is one contiguous slice [batches, length, heads, dim] of an input."""
  rows = -(-batch * heads // chunks)
  if rows >= heads:
    return max(b for b in range(1, batch + 1) if batch % b == 0 and b * heads <= rows), heads
  return 1, max(h for h in range(1, heads + 1) if heads % h == 0 and h <= rows)


def _block_start(index: Array, heads: int, size: tuple[int, int]) -> tuple[Array, Array, Array, Array]:
  """Where block `index` (blocks of size (batches, heads), heads fastest) starts in [batch, length, heads,
  dim]: (batch, 0, head, 0)."""
  per_batch = heads // size[1]
  zero = jnp.zeros_like(index)
  return index // per_batch * size[0], zero, index % per_batch * size[1], zero


def _get_block(x: Array, index: Array, size: tuple[int, int], dtype: Any) -> Array:
  """Block `index` of x [batch, length, heads, dim] as rows [batches * heads, length, dim] in `dtype`."""
  shape = (size[0], x.shape[1], size[1], x.shape[3])
  return to_rows(jax.lax.dynamic_slice(x, _block_start(index, x.shape[2], size), shape), dtype)


def _put_block(buf: Array, rows: Array, index: Array, size: tuple[int, int]) -> Array:
  """Writes rows [batches * heads, length, dim] into block `index` of buf [batch, length, heads, dim]."""
  return jax.lax.dynamic_update_slice(buf, from_rows(rows, size[0], buf.dtype),
                                      _block_start(index, buf.shape[2], size))


def _num_row_blocks(x: Array, size: tuple[int, int]) -> int:
  """How many blocks of size (batches, heads) x [batch, length, heads, dim] holds."""
  return x.shape[0] * x.shape[2] // (size[0] * size[1])


def _row_ids(index: Array, heads: int, size: tuple[int, int]) -> Array:
  """The rows (batch * heads + head) of block `index`, in its row order: [batches * heads]."""
  b, _, h, _ = _block_start(index, heads, size)
  return ((b + jnp.arange(size[0]))[:, None] * heads + h + jnp.arange(size[1])).reshape(-1).astype(jnp.int32)


def block_mask(mask: Array | None, ids: Array, heads: int) -> Array | None:
  """The key mask [batch, length] of the rows `ids` (`map_row_blocks`): [rows, length]; None (no mask: every
  key real) stays None."""
  return None if mask is None else jnp.take(mask, ids // heads, axis=0)


def select_real(mask: Array | None, *xs: Array) -> tuple[Array, ...]:
  """Each x [rows, length, dim] with masked positions (mask [rows, length], True = real) selected to zero: a
  select, so NaN or Inf there reaches neither outputs nor gradients. No mask (None) leaves xs as they are."""
  if mask is None:
    return xs
  return tuple(jnp.where(mask[:, :, None], x, 0.0) for x in xs)


def _blocks_loop(count: int, body: Callable[[Array, Any], Any], init: Any) -> Any:
  """fori_loop over the blocks; one block (an accelerator's default) runs without a loop."""
  if count == 1:
    return body(jnp.int32(0), init)
  return jax.lax.fori_loop(jnp.int32(0), jnp.int32(count), body, init)


def map_row_blocks(fn: Callable[..., Any], xs: tuple[Array, ...], aux: Any, chunks: int, *, dtype: Any,
                   out_dtype: Any, bwd: Callable[..., Any] | None = None) -> Array:
  """An op's rows of batch x heads computed block by block, in about `chunks` sequential blocks.

  xs: the differentiable inputs, each [batch, length, heads, dim_i]; aux: a pytree of arrays the op reads
  without gradient (masks, random features), passed whole. Each block of xs reaches `fn` as rows [rows,
  length, dim_i] in `dtype` (`to_rows`), together with aux and the block's row ids [rows] (batch * heads +
  head: `ids // heads` is the batch row of a mask); `fn` returns the block's output rows [rows, length', e],
  written into [batch, length', heads, e] in `out_dtype`. fn must treat its rows independently, and must
  not close over traced arrays (pass them in aux).

  Without `bwd` the backward recomputes each block's forward and differentiates it (a per-block checkpoint).
  With `bwd`, fn returns (output rows, residuals), whose residuals (None, or small arrays) are kept per block,
  and bwd(rows, aux, ids, residuals, output cotangent rows) returns the gradients of the rows: an op with a
  hand-written backward.
  """
  size = row_blocks(xs[0].shape[0], xs[0].shape[2], chunks)
  return _map_row_blocks(fn, bwd, size, dtype, out_dtype, tuple(xs), aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _map_row_blocks(fn, bwd, size, dtype, out_dtype, xs, aux):
  return _forward(fn, bwd, size, dtype, out_dtype, xs, aux, keep=False)[0]


def _forward(fn, bwd, size, dtype, out_dtype, xs, aux, *, keep):
  """The blocks' outputs [batch, length', heads, e] and, with `keep`, their stacked residuals."""
  batch, _, heads, _ = xs[0].shape
  count = _num_row_blocks(xs[0], size)

  def run(index):
    return fn(tuple(_get_block(x, index, size, dtype) for x in xs), aux, _row_ids(index, heads, size))

  shapes = jax.eval_shape(run, jnp.int32(0))
  out_shape = (shapes[0] if bwd else shapes).shape  # [rows, length', e]
  out = jnp.zeros((batch, out_shape[1], heads, out_shape[2]), out_dtype)
  res = jax.tree.map(lambda s: jnp.zeros((count, *s.shape), s.dtype), shapes[1]) if bwd and keep else None

  def body(index, carry):
    out, res = carry
    y = run(index)
    if bwd:
      y, r = y
      if keep:
        res = jax.tree.map(lambda buf, item: buf.at[index].set(item), res, r)
    return _put_block(out, y, index, size), res

  return _blocks_loop(count, body, (out, res))


def _map_row_blocks_fwd(fn, bwd, size, dtype, out_dtype, xs, aux):
  out, res = _forward(fn, bwd, size, dtype, out_dtype, xs, aux, keep=True)
  return out, (xs, aux, res)


def _map_row_blocks_bwd(fn, bwd, size, dtype, out_dtype, saved, cot):
  xs, aux, res = saved
  heads = xs[0].shape[2]
  count = _num_row_blocks(xs[0], size)

  def body(index, grads):
    rows, ids = tuple(_get_block(x, index, size, dtype) for x in xs), _row_ids(index, heads, size)
    g = _get_block(cot, index, size, dtype)
    if bwd:
      block_res = jax.tree.map(lambda r: r[index], res)
      drows = bwd(rows, aux, ids, block_res, g)
    else:
      _, vjp = jax.vjp(lambda rows: fn(rows, aux, ids), rows)
      (drows,) = vjp(g)
    return tuple(_put_block(buf, d, index, size) for buf, d in zip(grads, drows, strict=True))

  grads = _blocks_loop(count, body, tuple(jnp.zeros_like(x) for x in xs))
  return grads, jax.tree.map(lambda _: None, aux)


_map_row_blocks.defvjp(_map_row_blocks_fwd, _map_row_blocks_bwd)
