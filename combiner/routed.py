"""Combiner-learnable (Ren et al., NeurIPS 2021, section 4.4 and Appendix D): full attention over routed
clusters.

A routing module (e.g. `routing.kmeans`) assigns each token a cluster id per head. The partition is made
balanced: per (batch, head) the tokens are sorted by (cluster id, position) and the sorted order is cut into
consecutive chunks of `w = ceil(L / num_clusters)` tokens (the last may be shorter). Token `i` attends
directly to its own chunk and, through one pooled abstraction each, to every other chunk (docs/design.md
section 4, plan `routed`):

- bidirectional: `D_i` = own chunk, spans = the other chunks (masked keys removed, empty spans dropped);
- causal (paper eq. 12): every set is intersected with the prefix `[0, i]`, so a span is the part of another
  chunk at positions `<= i`, its abstraction is a *prefix* pooling and its value a softmax over that prefix
  only.

Causal outputs are not invariant to later tokens' cluster ids: the balanced chunks are cut from the ranks of
all L tokens, so a later token's cluster moves the chunk boundaries of earlier ones (the leak of the Routing
Transformer's balanced top-k, which `routing.attention` only runs as "balanced_leaky"). Later values never
reach an earlier output and no gradient flows from a later token to an earlier output (membership is
discrete), but a decoder's outputs at i depend on the clusters of tokens after i; a causal model built on this
plan says so when it is built (models/routing_attention.py).

Layout: tokens are permuted into a [chunks, w] "slot" grid sorted by (chunk, position), where a chunk is a
reshape axis, so span abstractions are reductions (or cumulative reductions, causal) over the slot axis: the
contiguous-segment case of `jax.ops.segment_max` without a scatter. Causal: the prefix state of chunk r seen
by query i is the one ended by the last member of r at a position `<= i`; per block of w positions that is a
block-start state or the state ended by a token of the same block (see the code), so no [L, chunks, d] tensor
is formed. Cost O(L * (w + chunks) * d) time, O(L * (w + chunks)) memory besides the inputs, i.e. O(L^1.5 d)
for num_clusters ~ sqrt(L); never O(L^2).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_core import contract
from attention_core.blocks import to_grid
from attention_core.combine import Piece, attend, joint_softmax, weighted_sum
from combiner import common, kernel_plans, routed_kernels
from combiner import pooling as pool_ops

Array = Any


def _check_cluster_ids(cluster_ids: Any, shape: tuple[int, int, int], num_clusters: int, op: str) -> Array:
  # Argument validation: any array-like (numpy, jax, tracers) passes.
  if not hasattr(cluster_ids, "shape") or tuple(cluster_ids.shape) != shape:
    raise ValueError(f"{op}: argument 'cluster_ids' must be an int array [batch, length, heads] = {shape}, "
                     f"got {getattr(cluster_ids, 'shape', type(cluster_ids).__name__)}")
  if not jnp.issubdtype(cluster_ids.dtype, jnp.integer):
    raise TypeError(f"{op}: argument 'cluster_ids' must have an integer dtype, got {cluster_ids.dtype}")
  if not isinstance(cluster_ids, jax.core.Tracer):  # values are checkable only outside a trace
    _check_cluster_values(cluster_ids, num_clusters, op)
  return jnp.asarray(cluster_ids).astype(jnp.int32)


def _check_cluster_values(cluster_ids: Any, num_clusters: int, op: str) -> None:
  concrete = np.asarray(cluster_ids)
  lo, hi = int(concrete.min()), int(concrete.max())
  if lo < 0 or hi >= num_clusters:
    raise ValueError(f"{op}: argument 'cluster_ids' must lie in [0, num_clusters={num_clusters}), "
                     f"got values in [{lo}, {hi}]")


def _concrete_ids(q: Any, k: Any, v: Any, *, cluster_ids: Any = None, num_clusters: Any = None,
                  **_: Any) -> None:
  """The values of concrete cluster ids, checked before an eager call's compiled program (whose trace
  cannot read them); ids or a cluster count the op rejects otherwise are left to its own words."""
  try:
    n = contract.check_positive_int(num_clusters, name="num_clusters", op="")
  except ValueError:
    return
  shaped = hasattr(cluster_ids, "dtype") and tuple(cluster_ids.shape) == tuple(q.shape[:3])
  if shaped and jnp.issubdtype(cluster_ids.dtype, jnp.integer):
    _check_cluster_values(cluster_ids, n, "combiner.routed")


class _Slots(NamedTuple):
  """The balanced partition in slot layout: per (batch, head), tokens sorted by (chunk, position),
  [chunks, w]."""

  w: int  # chunk size
  chunks: int
  chunk: Array  # [b, h, L] chunk of each position
  order_p: Array  # [b, h, slots] slot -> position (padded slots point at position 0 and are not real)
  slot_of: Array  # [b, h, L] position -> slot
  pos_s: Array  # [b, h, C, w] position of each slot (length for padded slots)
  real_s: Array  # [b, h, C, w] slot holds a real (unmasked) token


def _partition(ids: Array, mask: Array, num_clusters: int) -> _Slots:
  """Ranks tokens in (cluster, position) order and cuts that order into chunks of w = ceil(L / num_clusters).

  ids: [b, h, L] cluster ids; mask: [b, L]. Masked tokens rank after every real one (as if in a cluster of
  their own, `num_clusters`), so the chunks of real tokens do not depend on what padded positions hold."""
  batch, heads, length = ids.shape
  w = -(-length // num_clusters)
  chunks = -(-length // w)  # may be < num_clusters when w does not divide evenly
  slots = chunks * w
  ids = jnp.where(mask[:, None, :], ids, num_clusters)  # [b, h, L]
  rank = jnp.argsort(jnp.argsort(ids, axis=-1, stable=True), axis=-1).astype(jnp.int32)  # [b, h, L]
  chunk = rank // w  # [b, h, L]
  order = jnp.argsort(chunk, axis=-1, stable=True).astype(jnp.int32)  # [b, h, L]: slot -> position
  slot_of = jnp.argsort(order, axis=-1).astype(jnp.int32)  # [b, h, L]: position -> slot
  order_p = jnp.pad(order, ((0, 0), (0, 0), (0, slots - length)))  # [b, h, slots]
  in_range = jnp.arange(slots) < length  # [slots]
  pos_s = jnp.where(in_range, order_p, length).reshape(batch, heads, chunks, w)
  real_s = (jnp.take_along_axis(mask[:, None, :], order_p, axis=-1) & in_range).reshape(
      batch, heads, chunks, w)
  return _Slots(w, chunks, chunk, order_p, slot_of, pos_s, real_s)


def _to_slots(t: Array, p: _Slots) -> Array:
  """[b, h, L, d] -> [b, h, C, w, d] in slot layout."""
  g = jnp.take_along_axis(t, p.order_p[..., None], axis=2)
  return g.reshape(*t.shape[:2], p.chunks, p.w, t.shape[-1])


def _from_slots(t: Array, p: _Slots) -> Array:
  """[b, h, C, w, e] slot layout -> [b, h, L, e] position order."""
  flat = t.reshape(*t.shape[:2], p.chunks * p.w, t.shape[-1])
  return jnp.take_along_axis(flat, p.slot_of[..., None], axis=2)


@contract.per_platform_op(common.plan_choice, check=_concrete_ids)
def routed(q: Array, k: Array, v: Array, *, cluster_ids: Array, num_clusters: int, causal: bool = False,
           mask: Array | None = None, pooling: str = "max", pool_q: Array | None = None,
           pool_k: Array | None = None, implementation: str = "auto") -> Array:
  """Combiner-routed attention under the op contract.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  cluster_ids: int [batch, length, heads] in [0, num_clusters) (no gradient; e.g. nearest k-means centroid).
  pooling: "max" | "mean" over a span's real members; pool_q / pool_k (shaped like q) are pooled instead of
  q / k for the span abstractions. Returns [batch, length, heads, value_dim] in v's dtype.
  implementation: "xla", "pallas" or "auto" (pallas on GPU/TPU). The bidirectional plan is Combiner-Fixed
  over the slot order, blocks = chunks, so "pallas" runs it on Combiner-Fixed's kernels (`_on_kernels`);
  the causal plan runs on its own (`combiner.routed_kernels`): a slot-layout pass for the own chunk and the
  prefix states, a position-layout kernel for the other chunks' states.
  """
  op = "combiner.routed"
  n = contract.check_positive_int(num_clusters, name="num_clusters", op=op)
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
    if not causal:
      return _on_kernels(c, cluster_ids, n, pooling, op)
    ids = _check_cluster_ids(cluster_ids, c.q.shape[:3], n, op)
    return routed_kernels.causal(c.q, c.k, c.v, c.mask, c.pool_q, c.pool_k, ids, num_clusters=n,
                                 pooling=pooling, platform=contract.backend())
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
  batch, heads, length, _ = x.q.shape  # head-major
  ids = _check_cluster_ids(cluster_ids, (batch, length, heads), n, op).transpose(0, 2, 1)  # [b, h, L]
  part = _partition(jax.lax.stop_gradient(ids), x.mask, n)
  out = (_causal if causal else _bidirectional)(x, part, pooling)  # [b, h, L, dv]
  return common.finish(out, x)


def _on_kernels(c: common.Checked, cluster_ids: Array, n: int, pooling: str, op: str) -> Array:
  """The bidirectional plan on Combiner-Fixed's kernels: each head's tokens gathered in rank order ((cluster,
  position), masked tokens last: the same chunks of w as `_partition`, in every head the real tokens first),
  blocks of w attended as Combiner-Fixed bidirectional (own block exactly, every other block through its
  summary; both indifferent to the order inside a block), the output scattered back to positions."""
  batch, length, heads, _ = c.q.shape
  ids = _check_cluster_ids(cluster_ids, (batch, length, heads), n, op)  # [b, L, h]
  if c.mask is not None:
    ids = jnp.where(c.mask[:, :, None], ids, n)
  to_slot = jnp.argsort(jax.lax.stop_gradient(ids), axis=1, stable=True)  # [b, L(rank), h] -> position
  to_pos = jnp.argsort(to_slot, axis=1)  # [b, L(position), h] -> rank
  real = None if c.mask is None else jnp.arange(length) < jnp.sum(c.mask, axis=1, keepdims=True)
  w = -(-length // n)
  return kernel_plans.fixed(c.q, c.k, c.v, real, c.pool_q, c.pool_k, size=w, causal=False, pooling=pooling,
                            platform=contract.backend(), order=(to_slot.astype(jnp.int32),
                                                                to_pos.astype(jnp.int32)))


def _bidirectional(x: common.Inputs, p: _Slots, pooling: str) -> Array:
  """D_i = own chunk, spans = the other chunks; everything in slot layout. Returns [b, h, L, dv]."""
  qs, ks, vs = _to_slots(x.q, p), _to_slots(x.k, p), _to_slots(x.v, p)  # [b, h, C, w, d|dv]
  pqs, pks = _to_slots(x.pool_q, p), _to_slots(x.pool_k, p)
  own = jnp.arange(p.chunks)
  direct_logits = jnp.einsum("bhcqd,bhckd->bhcqk", qs, ks) * x.scale  # [b, h, C, w, w]
  direct = Piece(direct_logits, p.real_s[:, :, :, None, :],
                 lambda w: weighted_sum("bhcqk,bhckd->bhcqd", w, vs))
  kbar, nonempty = pool_ops.pool(pks, p.real_s, axis=3, kind=pooling)  # [b, h, C, d], [b, h, C]
  qbar, _ = pool_ops.pool(pqs, p.real_s, axis=3, kind=pooling)
  inner = jnp.einsum("bhcd,bhckd->bhck", qbar, ks) * x.scale  # [b, h, C, w]
  vbar = attend(inner, p.real_s, vs, "bhck,bhckd->bhcd")  # [b, h, C, dv]
  span_logits = jnp.einsum("bhcqd,bhrd->bhcqr", qs, kbar) * x.scale  # [b, h, C, w, C]
  span_valid = nonempty[:, :, None, None, :] & (own[:, None, None] != own[None, None, :])  # [b, h, C, 1, C]
  span = Piece(span_logits, span_valid, lambda w: weighted_sum("bhcqr,bhrd->bhcqd", w, vbar))
  return _from_slots(joint_softmax([direct, span]), p)  # [b, h, L, dv]


def _causal(x: common.Inputs, p: _Slots, pooling: str) -> Array:
  """Paper eq. 12: every set intersected with the prefix [0, i]; spans are prefix poolings.
  Returns [b, h, L, dv].

  Chunk r's prefix states: state t pools the chunk's slots 0..t (sorted by position), with the span value a
  softmax over those slots under the pooled query of the same prefix.
  """
  batch, heads, length, _ = x.q.shape
  w, chunks, slots = p.w, p.chunks, p.chunks * p.w
  qs, ks, vs = _to_slots(x.q, p), _to_slots(x.k, p), _to_slots(x.v, p)  # [b, h, C, w, d|dv]
  pqs, pks = _to_slots(x.pool_q, p), _to_slots(x.pool_k, p)
  scale = x.scale
  own = jnp.arange(chunks)
  direct_logits = jnp.einsum("bhcqd,bhckd->bhcqk", qs, ks) * scale  # [b, h, C, w, w]
  direct_valid = p.real_s[:, :, :, None, :] & (p.pos_s[..., None, :] <= p.pos_s[..., :, None])
  kbar, nonempty = pool_ops.finalize(pool_ops.inclusive_scan_stats(pks, p.real_s, 3, pooling), pooling)
  qbar, _ = pool_ops.finalize(pool_ops.inclusive_scan_stats(pqs, p.real_s, 3, pooling), pooling)
  # kbar: [b, h, C, w, d], nonempty: [b, h, C, w] (prefix state t of chunk r has a real member)
  inner = jnp.einsum("bhctd,bhcud->bhctu", qbar, ks) * scale  # [b, h, C, w(state), w(key)]
  inner_valid = p.real_s[:, :, :, None, :] & (jnp.arange(w)[None, :] <= jnp.arange(w)[:, None])
  vbar = attend(inner, inner_valid, vs, "bhctu,bhcud->bhctd")  # [b, h, C, w, dv]
  kbar_f = kbar.reshape(batch, heads, slots, -1)  # flat state index = r * w + t
  vbar_f = vbar.reshape(batch, heads, slots, -1)
  nonempty_f = nonempty.reshape(batch, heads, slots)

  # Query i sees chunk r in state t_r(i) = (#members of r at positions <= i) - 1: L x chunks vectors, too many
  # to gather. Cut positions into blocks of B = w: at a block's start every chunk has one "base" state
  # ([blocks, chunks] of them), and inside the block only the chunks of the block's own tokens advance, each
  # to the state that token ends (one per token). So query i takes chunk r from the base state unless a token
  # of r at a position in [block start, i] advanced it, and then from the last such token. Both are dense
  # pieces.
  nb = -(-length // w)
  lp = nb * w

  def to_blocks(t: Array, fill: Any = 0) -> Array:  # [b, h, L, ...] -> [b, h, nb, w, ...]
    return to_grid(t, nb, w, axis=2, fill=fill)

  qb = to_blocks(x.q)  # [b, h, nb, B, d], queries in position order
  chunk_b = to_blocks(p.chunk, chunks)  # [b, h, nb, B]; padding gets chunk id `chunks` (none)
  pos = jnp.arange(length, dtype=jnp.int32)
  token_b = to_blocks(jnp.broadcast_to(pos < length, p.chunk.shape), False)  # [b, h, nb, B] real positions
  onehot = jax.nn.one_hot(chunk_b, chunks, dtype=jnp.int32)  # [b, h, nb, B, C]
  before = jnp.cumsum(onehot.sum(axis=3), axis=2) - onehot.sum(axis=3)  # [b, h, nb, C] members before block
  base = own * w + jnp.maximum(before - 1, 0)  # [b, h, nb, C] flat state index

  # table [b, h, slots, e], index [b, h, ...] -> [b, h, ..., e]
  def states(table: Array, index: Array) -> Array:
    flat = jnp.take_along_axis(table, index.reshape(batch, heads, -1, 1), axis=2)
    return flat.reshape(*index.shape, table.shape[-1])

  kb, vb = states(kbar_f, base), states(vbar_f, base)  # [b, h, nb, C, d|dv]
  base_nonempty = (before > 0) & jnp.take_along_axis(  # [b, h, nb, C]
      nonempty_f, base.reshape(batch, heads, -1), axis=2).reshape(base.shape)
  advanced = jnp.cumsum(onehot, axis=3) > 0  # [b, h, nb, B, C]: chunk r advanced at a position in [start, i]
  not_own = chunk_b[..., :, None] != own  # [b, h, nb, B, C]
  base_logits = jnp.einsum("bhnqd,bhnrd->bhnqr", qb, kb) * scale  # [b, h, nb, B, C]
  base_valid = base_nonempty[:, :, :, None, :] & ~advanced & not_own
  base_piece = Piece(base_logits, base_valid, lambda a: weighted_sum("bhnqr,bhnrd->bhnqd", a, vb))

  tok_state = to_blocks(p.slot_of)  # [b, h, nb, B]: the state token j ends is its own slot
  ku, vu = states(kbar_f, tok_state), states(vbar_f, tok_state)  # [b, h, nb, B, d|dv]
  tok_nonempty = token_b & jnp.take_along_axis(
      nonempty_f, tok_state.reshape(batch, heads, -1), axis=2).reshape(tok_state.shape)
  ar = jnp.arange(w)
  later_same = (chunk_b[..., :, None] == chunk_b[..., None, :]) & (ar[:, None] < ar[None, :])  # [b,h,nb,j,j']
  next_same = jnp.min(jnp.where(later_same, ar, w), axis=-1)  # [b, h, nb, B]: next token of j's chunk
  last = (ar[None, :] <= ar[:, None]) & (ar[:, None] < next_same[..., None, :])  # [b, h, nb, B(i), B(j)]
  upd_valid = last & tok_nonempty[..., None, :] & (chunk_b[..., None, :] != chunk_b[..., :, None])
  upd_logits = jnp.einsum("bhnqd,bhnjd->bhnqj", qb, ku) * scale  # [b, h, nb, B, B]
  upd_piece = Piece(upd_logits, upd_valid, lambda a: weighted_sum("bhnqj,bhnjd->bhnqd", a, vu))

  # The direct piece lives in slot layout; its rows move to position order and its weights move back.
  def rows_to_blocks(t: Array) -> Array:  # [b, h, C, w, e] slot layout -> [b, h, nb, B, e] position layout
    return to_blocks(_from_slots(t, p))

  def direct_apply(a: Array) -> Array:  # a [b, h, nb, B, w] -> [b, h, nb, B, dv]
    a = a.reshape(batch, heads, lp, w)[:, :, :length]
    a = jnp.take_along_axis(a, p.order_p[..., None], axis=2).reshape(batch, heads, chunks, w, w)
    return rows_to_blocks(weighted_sum("bhcqk,bhckd->bhcqd", a, vs))

  direct_valid = jnp.broadcast_to(direct_valid, direct_logits.shape)
  direct = Piece(rows_to_blocks(direct_logits), rows_to_blocks(direct_valid), direct_apply)
  out = joint_softmax([direct, base_piece, upd_piece])  # [b, h, nb, B, dv]
  return out.reshape(batch, heads, lp, -1)[:, :, :length]
