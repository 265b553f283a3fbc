"""Sequence parallelism for Combiner-Logsparse and sparse LogSparse, the sequence split over a mesh axis
("seq") under `shard_map`.

Each device holds a run of n = L / P positions, n a power of two. At dyadic level l < log2(n) a query's span
(the block of 2^l before its own 2^(l+1)-aligned pair) lies on the query's own device: those levels are the
single-device plan (`combiner.logsparse.level_pieces`) on the local run. At each level l >= log2(n) (log2(P)
of them) a span is a run of 2^l / n whole devices, the same span for every query of a device, and only its
summary crosses devices:

- k̄ and q̄ pool per device (max or mean statistics with their counts, one [batch, heads, head_dim] row
  each) and are merged over the span's devices after one all-gather of P rows;
- ṽ = softmax_j(s(q̄, k_j)) v_j over the span's keys: each device scores its own keys against the q̄ of the
  level-l block it lies in and keeps the unnormalised sums (numerator, denominator, max); a second
  all-gather of those (P x levels rows) lets the reading device merge the span's devices;
- the sparse counterpart reads each span's last position: one all-gather of every device's last key, value
  and mask.

So a device receives O(P x log P x head_dim) numbers per head; keys and values stay where they are. The
bidirectional plan runs the same on the reversed sequence (the reversed local run, device P - 1 - d).
Plain autodiff through `shard_map` gives the backward pass (the all-gathers transpose to reduce-scatters).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from attention_core import contract, sharding
from attention_core.combine import Piece, joint_softmax, partial_softmax, weighted_sum
from combiner import common
from combiner import pooling as pool_ops
from combiner.dyadic import flipped, num_levels
from combiner.logsparse import level_pieces, self_piece, unflip
from combiner.pooling import POOLINGS

Array = Any


def _gather(x: Array, axis: str, reverse: bool) -> Array:
  """[...] per device -> [devices, ...] in device order (reversed for the reversed sequence)."""
  y = jax.lax.all_gather(x, axis, axis=0)
  return jnp.flip(y, axis=0) if reverse else y


def _members(devices: int, lo: Any, hi: Any) -> Array:
  """[devices] bool: devices lo <= j < hi."""
  j = jnp.arange(devices)
  return (j >= lo) & (j < hi)


def _span_stats(stats: pool_ops.Stats, member: Array, kind: str) -> pool_ops.Stats:
  """Per-device statistics [devices, batch, heads, d] (counts [devices, batch, 1]) merged over `member`."""
  fill = -jnp.inf if kind == "max" else 0.0
  value = jnp.where(member[:, None, None, None], stats.value, fill)
  value = jnp.max(value, axis=0) if kind == "max" else jnp.sum(value, axis=0)
  return pool_ops.Stats(value, jnp.sum(jnp.where(member[:, None, None], stats.count, 0), axis=0))


def _merge_devices(numer: Array, denom: Array, row_max: Array, member: Array) -> Array:
  """The softmax expectation over the union of the member devices' keys, from their unnormalised sums.

  numer [devices, batch, heads, value_dim], denom and row_max [devices, batch, heads] -> [batch, heads,
  value_dim] (zeros for a span without a real key)."""
  ok = member[:, None, None] & jnp.isfinite(row_max)
  top = jnp.max(jnp.where(ok, row_max, -jnp.inf), axis=0)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  factor = jnp.where(ok, jnp.exp(jnp.where(ok, row_max, 0.0) - top), 0.0)  # [devices, batch, heads]
  num = jnp.sum(numer * factor[..., None], axis=0)
  den = jnp.sum(denom * factor, axis=0)
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def _span_piece(x: common.Inputs, k_bar: Array, v_tilde: Array, valid: Array) -> Piece:
  """Every local query against one span: k_bar [batch, heads, d], v_tilde [batch, heads, value_dim], valid
  [batch]."""
  logits = jnp.einsum("bhnd,bhd->bhn", x.q, k_bar)[..., None] * x.scale  # [batch, heads, n, 1]
  return Piece(logits, valid[:, None, None, None],
               lambda w: weighted_sum("bhnx,bhxd->bhnd", w, v_tilde[:, :, None]))


def _far_pieces(x: common.Inputs, pooling: str | None, levels: range, devices: int, axis: str,
                reverse: bool) -> list[Piece]:
  """The pieces of the levels whose spans are whole other devices, in the frame of `x` (the local run, or
  the reversed local run when `reverse`: device index P - 1 - d)."""
  if not levels:
    return []
  local_levels = levels.start
  me = jax.lax.axis_index(axis)
  dev = devices - 1 - me if reverse else me
  pieces = []
  if pooling is None:  # the span's last position: the last position of the device before the query's block
    last = (x.k[:, :, -1], x.v[:, :, -1], x.mask[:, -1])  # [batch, heads, d], [batch, heads, dv], [batch]
    k_last, v_last, m_last = (_gather(t, axis, reverse) for t in last)  # [devices, ...]
    for level in levels:
      per = 1 << (level - local_levels)  # devices per level-l block
      block = dev // per
      src = jnp.maximum(block * per - 1, 0)
      valid = (block % 2 == 1) & m_last[src]  # [batch]
      pieces.append(_span_piece(x, k_last[src], v_last[src], valid))
    return pieces
  real = x.mask[:, None]  # [batch, 1, n]
  stats_k, stats_q = (pool_ops.reduce_stats(t, real, 2, pooling) for t in (x.pool_k, x.pool_q))
  # [devices, batch, heads, d] and counts [devices, batch, 1]
  stats_k, stats_q = (pool_ops.Stats(*(_gather(t, axis, reverse) for t in s)) for s in (stats_k, stats_q))
  # Each device's share of the in-span softmax of the level-l block it lies in: q̄ of that block against
  # its own keys.
  shares = []
  for level in levels:
    per = 1 << (level - local_levels)
    block = dev // per
    q_bar, _ = pool_ops.finalize(_span_stats(stats_q, _members(devices, block * per, (block + 1) * per),
                                             pooling), pooling)  # [batch, heads, d]
    logits = jnp.einsum("bhd,bhnd->bhn", q_bar, x.k) * x.scale  # [batch, heads, n]
    shares.append(partial_softmax([Piece(logits, real, lambda w: weighted_sum("bhn,bhnd->bhd", w, x.v))]))
  # [devices, levels, batch, heads, (value_dim)]
  numer, denom, row_max = (_gather(jnp.stack(t), axis, reverse) for t in zip(*shares, strict=True))
  for i, level in enumerate(levels):
    per = 1 << (level - local_levels)
    block = dev // per
    member = _members(devices, (block - 1) * per, block * per)  # the span: block - 1, when block is odd
    k_bar, nonempty = pool_ops.finalize(_span_stats(stats_k, member, pooling), pooling)
    v_tilde = _merge_devices(numer[:, i], denom[:, i], row_max[:, i], member)
    pieces.append(_span_piece(x, k_bar, v_tilde, (block % 2 == 1) & nonempty[:, 0]))
  return pieces


def _local(op: str, causal: bool, pooling: str | None, axis: str, devices: int, length: int,
           pools: tuple[str, ...], q: Array, k: Array, v: Array, mask: Array, *pooled: Array) -> Array:
  """One device's run [batch, n, heads, dim] -> its output, same layout."""
  given = dict(zip(pools, pooled, strict=True))
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling or "max", materialize=True, **given)
  local_levels = num_levels(q.shape[1])
  far = range(local_levels, num_levels(length))
  pieces = [self_piece(x)] + level_pieces(x, pooling) + _far_pieces(x, pooling, far, devices, axis, False)
  if not causal:
    xf = flipped(x)
    back = level_pieces(xf, pooling) + _far_pieces(xf, pooling, far, devices, axis, True)
    pieces += [unflip(p) for p in back]
  return common.finish(joint_softmax(pieces), x)


def _run(op: str, q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None, pooling: str | None,
         pools: dict[str, Array], mesh: Any, axis: str) -> Array:
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  contract.check_bool(causal, name="causal", op=op)
  mesh = sharding.resolve_mesh(mesh, axis, op)
  parts = int(mesh.shape[axis])
  batch, length, heads, _ = q.shape
  sharding.check_seq_length(length, parts, 1, op, "1")
  local = length // parts
  if local & (local - 1):
    raise ValueError(f"{op}: each device's run of positions (length {length} / {parts} devices = {local}) "
                     "must be a power of two, so that every dyadic span lies on one device or covers whole "
                     "devices; pad the sequence with masked positions to such a length")
  for name, x in pools.items():
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(q.shape):
      raise ValueError(f"{op}: argument {name!r} must be None or an array shaped like q {tuple(q.shape)}, "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
  spec, mspec = sharding.seq_specs(mesh, axis, batch, heads)
  fn = functools.partial(_local, op, bool(causal), pooling, axis, parts, length, tuple(pools))
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3 + (mspec,) + (spec,) * len(pools),
                       out_specs=spec)(q, k, v, mask, *pools.values())


def logsparse(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, pooling: str = "max",
              pool_q: Array | None = None, pool_k: Array | None = None, mesh: Any = None,
              axis: str = sharding.SEQ_AXIS) -> Array:
  """Combiner-Logsparse with the sequence split over mesh axis `axis`; equals `combiner.logsparse` (same
  arguments). q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; length / devices
  must be a power of two."""
  op = "combiner.seq_parallel_logsparse.logsparse"
  contract.check_choice(pooling, name="pooling", allowed=POOLINGS, op=op)
  pools = {name: x for name, x in (("pool_q", pool_q), ("pool_k", pool_k)) if x is not None}
  return _run(op, q, k, v, causal=causal, mask=mask, pooling=pooling, pools=pools, mesh=mesh, axis=axis)


def sparse_logsparse(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                     mesh: Any = None, axis: str = sharding.SEQ_AXIS) -> Array:
  """Sparse LogSparse with the sequence split over mesh axis `axis`; equals `combiner.sparse.logsparse`."""
  return _run("combiner.seq_parallel_logsparse.sparse_logsparse", q, k, v, causal=causal, mask=mask,
              pooling=None, pools={}, mesh=mesh, axis=axis)
