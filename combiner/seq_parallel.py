"""Sequence parallelism: one sequence split over the devices of a mesh axis ("seq") under `shard_map`.

Each device holds a contiguous run of L / P positions, a whole number of blocks. For Combiner-Fixed a query
needs its own block (local) and, from every other block, only that block's span summary: the pooled key
k̄_r and the in-span value ṽ_r, both computed where the block lives. So the one collective of the forward
pass is an all-gather of L / block_size summary rows per head (its transpose, a reduce-scatter of their
gradients, is the one of the backward pass); keys and values never cross devices. `dense` is the usual
context-parallel baseline to compare against: it all-gathers K and V.

Batch is split over the "data" axis and heads over "model" when the mesh has them (and they divide evenly).
`chunk_blocks` processes the local blocks a few at a time under `jax.checkpoint` (a `lax.map`), so the live
logits are chunk x block x (block + L / block) per head instead of the whole local run's: what makes very long
sequences fit in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from combiner import common, contract
from combiner.combine import Piece, attend, joint_softmax
from combiner.fixed import block_direct_piece, span_summaries
from combiner.pooling import POOLINGS

Array = Any
SEQ_AXIS = "seq"


def resolve_mesh(mesh: Any, axis: str, op: str) -> Any:
  """The explicit `mesh`, else the one set by `jax.set_mesh`; it must have the sequence axis."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or axis not in tuple(mesh.axis_names):
    raise ValueError(f"{op}: needs a device mesh with a {axis!r} axis (argument 'mesh', or `jax.set_mesh`), "
                     f"got {None if mesh is None else dict(mesh.shape)}")
  return mesh


def seq_size(mesh: Any = None, axis: str = SEQ_AXIS) -> int:
  """Devices along the sequence axis of `mesh` (or the context mesh); 1 when there is none."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or axis not in tuple(mesh.axis_names):
    return 1
  return int(mesh.shape[axis])


def _specs(mesh: Any, axis: str, batch: int, heads: int) -> tuple[P, P]:
  """PartitionSpecs of [batch, length, heads, dim] arrays and of the [batch, length] mask."""
  def split(name: str, size: int) -> str | None:
    n = dict(mesh.shape).get(name, 1)
    return name if name != axis and n > 1 and size % n == 0 else None

  b, h = split("data", batch), split("model", heads)
  return P(b, axis, h, None), P(b, axis)


def _check_length(length: int, parts: int, multiple: int, op: str, what: str) -> None:
  if length % (parts * multiple):
    raise ValueError(f"{op}: length {length} must be a multiple of {parts} devices along the sequence axis "
                     f"x {what} = {parts * multiple} (each device holds whole blocks); pad the sequence with "
                     "masked positions to such a length")


def _over_chunks(fn: Callable, arrays: tuple[Array, ...], length: int, chunk: int | None) -> Any:
  """fn over the length axis (1) of [batch, length, ...] arrays, `chunk` positions at a time (None: at once).

  Outputs are pytrees of [batch, chunk_len, ...] arrays re-joined along axis 1; each chunk is recomputed in
  the backward pass (`jax.checkpoint`), so only one chunk's intermediates are ever alive.
  """
  if chunk is None or chunk >= length:
    return fn(*arrays, 0)
  n = length // chunk

  def split(x):  # [batch, length, ...] -> [n, batch, chunk, ...] (free when batch = 1)
    return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

  def body(args):
    # The barrier keeps XLA from hoisting the chunk's casts out of the loop (whole-run float32 copies).
    *xs, i = jax.lax.optimization_barrier(args)
    return fn(*xs, i * chunk)

  out = jax.lax.map(jax.checkpoint(body), (*map(split, arrays), jnp.arange(n)))
  return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(y.shape[1], n * y.shape[2], *y.shape[3:]), out)


def fixed(q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None = None,
          pooling: str = "max", pool_q: Array | None = None, pool_k: Array | None = None, mesh: Any = None,
          axis: str = SEQ_AXIS, chunk_blocks: int | None = None) -> Array:
  """Combiner-Fixed with the sequence split over mesh axis `axis`; equals `combiner.fixed` (same arguments).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; length must be a multiple of
  (devices along `axis`) x block_size. chunk_blocks: blocks per step of the local computation (None = all).
  """
  op = "combiner.seq_parallel.fixed"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  contract.check_choice(pooling, name="pooling", allowed=POOLINGS, op=op)
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  if chunk_blocks is not None:
    chunk_blocks = contract.check_positive_int(chunk_blocks, name="chunk_blocks", op=op)
  mesh = resolve_mesh(mesh, axis, op)
  parts = int(mesh.shape[axis])
  batch, length, heads, _ = q.shape
  _check_length(length, parts, size, op, f"block_size {size}")
  local_blocks = length // (parts * size)
  if chunk_blocks is not None and local_blocks % chunk_blocks:
    raise ValueError(f"{op}: argument 'chunk_blocks' ({chunk_blocks}) must divide the {local_blocks} blocks "
                     "each device holds")
  # Pooled inputs other than q, k travel as extra arguments only when given (each one costs its own gradient).
  pools = {name: x for name, x in (("pool_q", pool_q), ("pool_k", pool_k)) if x is not None}
  for name, x in pools.items():
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(q.shape[-1])
  chunk = None if chunk_blocks is None else chunk_blocks * size

  def to_blocks(x, n):  # [batch, n * size, heads, dim] -> [batch, heads, n, size, dim] in the softmax dtype
    return common.to_grid(common.head_major(x.astype(ct)), n, size, 2)

  def local(q, k, v, m, *extra):  # one device's run: [batch, local_length, heads_local, dim]
    local_length = q.shape[1]

    def summaries(q, k, v, m, *pooled):
      *pooled, _ = pooled  # drop the chunk's start position
      pq, pk = dict(zip(pools, pooled)).get("pool_q", q), dict(zip(pools, pooled)).get("pool_k", k)
      n = k.shape[1] // size
      kb = to_blocks(k, n)
      return span_summaries(to_blocks(pq, n), kb if pk is k else to_blocks(pk, n), kb, to_blocks(v, n),
                            common.to_grid(m, n, size, 1)[:, None], scale, pooling)

    # Span summaries of the local blocks: k_bar [b, h, n, d], nonempty [b, 1, n], v_tilde [b, h, n, dv].
    k_bar, nonempty, v_tilde = _over_chunks(lambda *a: jax.tree.map(lambda y: jnp.moveaxis(y, 2, 1),
                                                                    summaries(*a)),
                                            (q, k, v, m, *extra), local_length, chunk)
    k_bar, nonempty, v_tilde = (jnp.moveaxis(y, 1, 2) for y in (k_bar, nonempty, v_tilde))
    # The only communication: every block's summary, L / block_size rows per head.
    k_all, ne_all, v_all = (jax.lax.all_gather(y, axis, axis=2, tiled=True)
                            for y in (k_bar, nonempty, v_tilde))
    first = jax.lax.axis_index(axis) * local_length  # global position of this device's first token
    spans_r = jnp.arange(k_all.shape[2])

    def attend_chunk(q, k, v, m, start):
      n = q.shape[1] // size
      qb, kb, vb = to_blocks(q, n), to_blocks(k, n), to_blocks(v, n)
      mb = common.to_grid(m, n, size, 1)[:, None]  # [batch, 1, n, size]
      direct = block_direct_piece(qb, kb, vb, mb, scale, causal)
      blk = (first + start) // size + jnp.arange(n)  # global block index of each query block
      logits = jnp.einsum("bhnqd,bhrd->bhnqr", qb, k_all) * scale  # [batch, heads, n, size, blocks]
      other = (spans_r[None, :] < blk[:, None]) if causal else (spans_r[None, :] != blk[:, None])
      valid = other[:, None, :] & ne_all[:, :, None, None, :]
      spans = Piece(logits, valid, lambda w: jnp.einsum("bhnqr,bhrd->bhnqd", w, v_all))
      out = joint_softmax([direct, spans])  # [batch, heads, n, size, value_dim]
      return common.head_major(common.from_grid(out, n * size, 2)).astype(v.dtype)

    return _over_chunks(attend_chunk, (q, k, v, m), local_length, chunk)

  spec, mspec = _specs(mesh, axis, batch, heads)
  in_specs = (spec,) * 3 + (mspec,) + (spec,) * len(pools)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=spec)(q, k, v, mask, *pools.values())


def dense(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, mesh: Any = None,
          axis: str = SEQ_AXIS) -> Array:
  """Dense softmax attention, context-parallel: queries stay split along `axis`, K, V and the mask are
  all-gathered. The baseline whose communication the Combiner ops are compared with; equals `baselines.dense`.
  """
  op = "combiner.seq_parallel.dense"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  mesh = resolve_mesh(mesh, axis, op)
  parts = int(mesh.shape[axis])
  batch, length, heads, _ = q.shape
  _check_length(length, parts, 1, op, "1")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(q.shape[-1])

  def local(q, k, v, m):
    k_all, v_all = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))  # [b, L, h, d]
    m_all = jax.lax.all_gather(m, axis, axis=1, tiled=True)  # [batch, length]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(ct), k_all.astype(ct)) * scale  # [b, h, local, L]
    valid = m_all[:, None, None, :]
    if causal:
      q_pos = jax.lax.axis_index(axis) * q.shape[1] + jnp.arange(q.shape[1])
      valid = valid & (jnp.arange(k_all.shape[1])[None, :] <= q_pos[:, None])
    out = attend(logits, valid, v_all.astype(ct), "bhqk,bkhd->bhqd")  # [batch, heads, local, value_dim]
    return common.head_major(out).astype(v.dtype)

  spec, mspec = _specs(mesh, axis, batch, heads)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (mspec,), out_specs=spec)(q, k, v, mask)


# Registry op name -> its sequence-parallel counterpart (models choose it when the mesh's seq axis is > 1).
OPS = {"combiner_fixed": fixed, "dense": dense}
