"""Routing attention (Roy et al., TACL 2021, Algorithm 1) as a pure function.

Each head routes its layer-normed queries (and keys) to `clusters` centroids; every centroid gathers its top
`window` tokens (sorted by position), attention runs inside each cluster, and each token's output is the average
over the clusters it was gathered into (zero when it is in none). With `clusters * window ~ length` and
`window ~ sqrt(length)` the cost is O(length^1.5 * d).

The two reference implementations disagree in two places, which are options here:
- `scale_logits`: multiply logits by 1/sqrt(head_dim) (lucidrains' routing-transformer, and the op contract of
  DESIGN.md section 3) or use the raw dot products of the layer-normed vectors (the paper's TF code);
- `mask_self`: with shared QK a token's key is its own query, so its self logit is the largest one; lucidrains
  masks it unless it is the only key visible (the first token of a causal cluster). Off by default (paper).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from combiner import contract
from combiner.combine import attend
from routing import kmeans

Array = Any


class RoutingAux(NamedTuple):
  """What a training step needs besides the output.

  stats:       batch sums for `kmeans.ema_update` (nearest-centroid assignment of queries and keys, real tokens)
  commit_loss: scalar commitment loss mean((x - stop_gradient(assigned centroid))^2) over queries and keys
  """

  stats: kmeans.CentroidStats
  commit_loss: Array


def _gather(x: Array, idx: Array) -> Array:
  """x [batch, heads, length, dim], idx [batch, heads, clusters, window] -> [batch, heads, clusters, window, dim]."""
  b, h, c, w = idx.shape
  flat = jnp.take_along_axis(x, idx.reshape(b, h, c * w, 1), axis=2)
  return flat.reshape(b, h, c, w, x.shape[-1])


def _scatter_mean(y: Array, idx: Array, length: int) -> Array:
  """Averages the cluster outputs y [batch, heads, clusters, window, dv] back onto positions.

  Returns [batch, heads, length, dv]; a position gathered into no cluster gets exactly zero.
  """
  b, h, c, w, dv = y.shape
  flat_idx = idx.reshape(b * h, c * w)
  flat_y = y.reshape(b * h, c * w, dv)

  def one(i, vals):
    total = jnp.zeros((length, dv), vals.dtype).at[i].add(vals)
    count = jnp.zeros((length,), vals.dtype).at[i].add(1.0)
    return total / jnp.maximum(count, 1.0)[:, None]

  return jax.vmap(one)(flat_idx, flat_y).reshape(b, h, length, dv)


MEMBERSHIPS = ("balanced", "nearest")


def _nearest_window(qn: Array, v: Array, assign: Array, mask: Array, *, window: int, causal: bool, scale: float,
                    mask_self: bool) -> Array:
  """Attention to the `window` most recent same-cluster tokens (shared QK), in (cluster, position) order.

  qn: [batch, length, heads, d] layer-normed; v: [batch, length, heads, dv]; assign: [batch, heads, length].
  Sorted order is cut into blocks of `window`; a query sees its own and the previous block (and the next one,
  bidirectional), masked to its cluster and to sorted distance < window. Returns [batch, length, heads, dv].
  """
  batch, length, heads, _ = qn.shape
  w = window
  nb = -(-length // w)
  lp = nb * w
  order = jnp.argsort(assign, axis=-1, stable=True).astype(jnp.int32)  # [b, h, L]: sorted index -> position
  rank = jnp.argsort(order, axis=-1).astype(jnp.int32)  # position -> sorted index

  def sorted_blocks(t: Array, fill: Any = 0) -> Array:  # [b, h, L, ...] in sorted order -> [b, h, nb, w, ...]
    t = jnp.pad(t, [(0, 0), (0, 0), (0, lp - length)] + [(0, 0)] * (t.ndim - 3), constant_values=fill)
    return t.reshape(batch, heads, nb, w, *t.shape[3:])

  def gather(t: Array) -> Array:  # [b, L, h, e] -> sorted [b, h, L, e]
    return jnp.take_along_axis(t.transpose(0, 2, 1, 3), order[..., None], axis=2)

  qs = sorted_blocks(gather(qn))  # [b, h, nb, w, d]
  vs = sorted_blocks(gather(v))  # [b, h, nb, w, dv]
  cl = sorted_blocks(jnp.take_along_axis(assign, order, axis=-1), -1)  # [b, h, nb, w]; padding: cluster -1
  real = sorted_blocks(jnp.take_along_axis(mask[:, None, :], order, axis=-1), False)
  idx = sorted_blocks(jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), assign.shape), lp)  # sorted index

  offsets = (-1, 0) if causal else (-1, 0, 1)

  def neighbours(t: Array, fill: Any) -> Array:  # [b, h, nb, w, ...] -> [b, h, nb, len(offsets) * w, ...]
    parts = []
    for o in offsets:
      pad = [(0, 0)] * t.ndim
      pad[2] = (max(-o, 0), max(o, 0))
      parts.append(jax.lax.slice_in_dim(jnp.pad(t, pad, constant_values=fill), max(o, 0), max(o, 0) + nb, axis=2))
    return jnp.concatenate(parts, axis=3)

  ks, vk = neighbours(qs, 0), neighbours(vs, 0)  # keys are the queries
  kcl, kreal, kidx = neighbours(cl, -2), neighbours(real, False), neighbours(idx, -lp)
  delta = idx[..., :, None] - kidx[..., None, :]  # [b, h, nb, w, keys]: sorted distance query - key
  near = (delta >= 0) & (delta < w) if causal else (jnp.abs(delta) < w)
  valid = near & (cl[..., :, None] == kcl[..., None, :]) & kreal[..., None, :]
  if mask_self:
    others = valid & (delta != 0)
    valid = jnp.where(jnp.any(others, axis=-1, keepdims=True), others, valid)
  logits = jnp.einsum("bhnqd,bhnkd->bhnqk", qs, ks) * scale  # [b, h, nb, w, keys]
  out = attend(logits, valid, vk, "bhnqk,bhnkd->bhnqd").reshape(batch, heads, lp, -1)[:, :, :length]
  return jnp.take_along_axis(out, rank[..., None], axis=2).transpose(0, 2, 1, 3)  # [b, L, h, dv]


def routing_attention(q: Array, k: Array, v: Array, *, centroids: Array, window: int, causal: bool,
                      mask: Array | None = None, share_qk: bool = True, scale_logits: bool = True,
                      mask_self: bool = False, membership: str = "balanced") -> tuple[Array, RoutingAux]:
  """Content-routed sparse attention; returns (out, aux).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  centroids: [heads, clusters, head_dim] (state; no gradient flows into it). window: tokens per cluster,
  clipped to `length`. share_qk: keys are the queries (`k` is ignored), the paper's choice for causal models,
  which makes every cluster's causal mask well defined. Queries and keys are layer-normed (no affine) before
  both routing and attention, as in Algorithm 1. Returns out [batch, length, heads, value_dim] in v's dtype and
  `RoutingAux`. A query whose cluster holds no visible key (only possible without shared QK) gets zeros.

  membership: "balanced" (the paper): top-`window` tokens per centroid. In a decoder this leaks the future
    through a discrete channel: whether an earlier token makes a centroid's top-`window` depends on later
    tokens' scores, so out_i can change when a later token changes (its Jacobian is still exactly zero).
    "nearest": every token joins only its nearest centroid and attends to its `window` most recent cluster-mates
    (itself included; bidirectional: `window - 1` on each side), found by sorting tokens by (centroid, position)
    and attending within a sliding window of that order. The set depends on tokens <= i only, so a decoder is
    exactly causal; needs `share_qk=True` (one cluster per token for both roles). Every token gets an output.
  """
  op = "routing_attention"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  share_qk = contract.check_bool(share_qk, name="share_qk", op=op)
  scale_logits = contract.check_bool(scale_logits, name="scale_logits", op=op)
  mask_self = contract.check_bool(mask_self, name="mask_self", op=op)
  window = contract.check_positive_int(window, name="window", op=op)
  membership = contract.check_choice(membership, name="membership", allowed=MEMBERSHIPS, op=op)
  if membership == "nearest" and not share_qk:
    raise ValueError(f"{op}: argument 'membership'='nearest' needs share_qk=True (one cluster per token)")
  batch, length, heads, head_dim = q.shape
  if not hasattr(centroids, "shape") or len(centroids.shape) != 3 or centroids.shape[0] != heads \
      or centroids.shape[2] != head_dim:
    raise ValueError(f"{op}: argument 'centroids' must have shape [heads={heads}, clusters, head_dim={head_dim}], "
                     f"got {getattr(centroids, 'shape', type(centroids).__name__)}")
  clusters = centroids.shape[1]
  window = min(window, length)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)

  qn = kmeans.layer_norm(q.astype(ct))  # [batch, length, heads, head_dim]
  kn = qn if share_qk else kmeans.layer_norm(k.astype(ct))
  q_scores = kmeans.scores(qn, centroids)  # [batch, heads, clusters, length]
  k_scores = q_scores if share_qk else kmeans.scores(kn, centroids)
  if membership == "nearest":
    q_assign = kmeans.nearest_centroid(q_scores)  # [batch, heads, length]
    out = _nearest_window(qn, v.astype(ct), q_assign, mask, window=window, causal=causal,
                          scale=contract.logit_scale(head_dim) if scale_logits else 1.0, mask_self=mask_self)
    stats = kmeans.centroid_stats(qn, q_assign, mask, clusters)
    stats = kmeans.merge_stats(stats, stats)  # keys are the queries
    return out.astype(v.dtype), RoutingAux(stats, kmeans.commitment_loss(qn, q_assign, centroids, mask))
  q_idx = kmeans.balanced_membership(q_scores, window, mask)  # [batch, heads, clusters, window]
  k_idx = q_idx if share_qk else kmeans.balanced_membership(k_scores, window, mask)

  qg = _gather(qn.transpose(0, 2, 1, 3), q_idx)  # [batch, heads, clusters, window, head_dim]
  kg = _gather(kn.transpose(0, 2, 1, 3), k_idx)  # [batch, heads, clusters, window, head_dim]
  vg = _gather(v.astype(ct).transpose(0, 2, 1, 3), k_idx)  # [batch, heads, clusters, window, value_dim]
  logits = jnp.einsum("bhcqd,bhckd->bhcqk", qg, kg)  # [batch, heads, clusters, window, window]
  if scale_logits:
    logits = logits * contract.logit_scale(head_dim)
  key_real = jnp.take_along_axis(mask[:, None, None, :], k_idx, axis=-1)  # [batch, heads, clusters, window]
  valid = key_real[..., None, :]  # [batch, heads, clusters, 1, window]
  if causal:
    valid = valid & (q_idx[..., :, None] >= k_idx[..., None, :])
  if mask_self:
    others = valid & (q_idx[..., :, None] != k_idx[..., None, :])
    valid = jnp.where(jnp.any(others, axis=-1, keepdims=True), others, valid)
  yg = attend(logits, valid, vg, "bhcqk,bhckd->bhcqd")  # [batch, heads, clusters, window, value_dim]
  out = _scatter_mean(yg, q_idx, length).transpose(0, 2, 1, 3)  # [batch, length, heads, value_dim]

  q_assign = kmeans.nearest_centroid(q_scores)  # [batch, heads, length]
  k_assign = q_assign if share_qk else kmeans.nearest_centroid(k_scores)
  stats = kmeans.merge_stats(kmeans.centroid_stats(qn, q_assign, mask, clusters),
                             kmeans.centroid_stats(kn, k_assign, mask, clusters))
  commit = 0.5 * (kmeans.commitment_loss(qn, q_assign, centroids, mask)
                  + kmeans.commitment_loss(kn, k_assign, centroids, mask))
  return out.astype(v.dtype), RoutingAux(stats, commit)
