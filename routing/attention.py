"""Routing attention (Roy et al., TACL 2021, Algorithm 1) as a pure function.

Each head routes its layer-normed queries (and keys) to `clusters` centroids; every centroid gathers its top
`window` tokens (sorted by position), attention runs inside each cluster, and each token's output is the
average over the clusters it was gathered into (zero when it is in none). With `clusters * window ~ length`
and `window ~ sqrt(length)` the cost is O(length^1.5 * d).

The two reference implementations disagree in two places, which are options here:
- `scale_logits`: multiply logits by 1/sqrt(head_dim) (lucidrains' routing-transformer, and the op contract of
  docs/design.md section 3) or use the raw dot products of the layer-normed vectors (the paper's TF code);
- `mask_self`: with shared QK a token's key is its own query, so its self logit is the largest one; lucidrains
  masks it unless it is the only key visible (the first token of a causal cluster). Off by default (paper).

Membership in decoders (the default is decided here, with the reason). The paper's balanced membership (each
centroid takes its top-`window` tokens) is not causal: whether token i makes a centroid's top-`window` depends
on the scores of tokens after i, so a later token can push i out of (or pull it into) a cluster and change
out_i. The Jacobian of out_i with respect to later inputs is still zero (membership is discrete), which is why
gradient checks miss it; a teacher-forced decoder can exploit it and its likelihoods are then not those of a
causal model. Both reference codes (the paper's top-k and lucidrains' `routing-transformer`) share this leak.
So:

- `membership=None` (default) resolves to "nearest" when `causal and share_qk` (exactly causal: a token's
  cluster is its own nearest centroid and it attends to the `window` most recent cluster-mates) and to
  "balanced" otherwise (bidirectional models have nothing to leak; without shared QK "nearest" is undefined);
- `membership="balanced"` in a decoder is refused with an error naming "nearest"; the paper's leaking decoder
  stays available as the explicit `membership="balanced_leaky"` (the same top-k), for reproducing the paper
  and for like-for-like timing against lucidrains' peer. A causal call without shared QK has no exactly causal
  membership and is refused the same way;
- speed: "nearest" sorts tokens by (centroid, position) and attends over a sliding window of that order
  (2 * window keys per query instead of window).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import neighbours, to_grid
from attention_core.combine import Piece, joint_softmax, weighted_sum
from attention_core.norm import layer_norm
from routing import kmeans

Array = Any


class RoutingAux(NamedTuple):
  """What a training step needs besides the output.

  stats:       batch sums for `kmeans.ema_update` (nearest-centroid assignment of queries and keys,
               real tokens)
  commit_loss: scalar commitment loss mean((x - stop_gradient(assigned centroid))^2) over queries and keys
  """

  stats: kmeans.CentroidStats
  commit_loss: Array


def _softmax_weights(q: Array, k: Array, valid: Array, scale: float) -> Array:
  """Normalised attention weights [..., queries, keys] from the shared softmax (`attention_core.combine`)."""
  logits = jnp.einsum("...qd,...kd->...qk", q, k) * scale  # [..., queries, keys]
  return joint_softmax([Piece(logits, valid, lambda w: w)])


def _dlogits(weights: Array, v: Array, out: Array, g: Array, scale: float) -> tuple[Array, Array]:
  """Backward of out = weights @ v through the softmax: (d scaled-logit inputs, dv)."""
  dv = jnp.einsum("...qk,...qd->...kd", weights, g)  # [..., keys, dv]
  dw = jnp.einsum("...qd,...kd->...qk", g, jnp.where(jnp.isfinite(v), v, 0))  # [..., queries, keys]
  # softmax Jacobian: dlogit = w * (dw - sum_k w dw), with sum_k w dw = sum_d g * out (a [..., queries, dv]
  # reduction instead of one fused into the dw contraction, which XLA:CPU runs several times slower than the
  # dot).
  return weights * (dw - jnp.sum(g * out, axis=-1, keepdims=True)) * scale, dv


def _saved(out: Array) -> Array:
  # The barrier keeps the saved output a stored value: otherwise XLA:CPU re-runs the weights @ v contraction
  # inside the backward's fusions.
  return jax.lax.optimization_barrier(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cluster_attention(q: Array, k: Array, v: Array, valid: Array, scale: float) -> Array:
  """Masked softmax attention inside each cluster, with a hand-written backward.

  q: [..., queries, d]; k: [..., keys, d]; v: [..., keys, dv]; valid: bool broadcastable to
  [..., queries, keys]. Returns [..., queries, dv]. Rows with no valid key give zeros.

  Why a custom VJP: autodiff of the shared `joint_softmax` (numerator / denominator) differentiates the
  division through the value contraction, and XLA:CPU fuses that contraction into a reduction which runs
  several times slower than the matmuls themselves; the textbook backward from the saved weights is plain
  einsums.
  """
  return weighted_sum("...qk,...kd->...qd", _softmax_weights(q, k, valid, scale), v)


def _cluster_attention_fwd(q: Array, k: Array, v: Array, valid: Array, scale: float) -> tuple[Array, tuple]:
  weights = _softmax_weights(q, k, valid, scale)
  out = weighted_sum("...qk,...kd->...qd", weights, v)
  return out, (q, k, v, weights, _saved(out))


def _cluster_attention_bwd(scale: float, res: tuple, g: Array) -> tuple:
  q, k, v, weights, out = res
  dlogits, dv = _dlogits(weights, v, out, g, scale)
  dq = jnp.einsum("...qk,...kd->...qd", dlogits, k)
  dk = jnp.einsum("...qk,...qd->...kd", dlogits, q)
  return dq, dk, dv, None


_cluster_attention.defvjp(_cluster_attention_fwd, _cluster_attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _shared_cluster_attention(q: Array, v: Array, valid: Array, scale: float) -> Array:
  """`_cluster_attention` with keys = queries (shared QK): the backward forms dq with one contraction,
  (dlogits + dlogits^T) @ q, instead of two."""
  return _cluster_attention(q, q, v, valid, scale)


def _shared_cluster_attention_fwd(q: Array, v: Array, valid: Array, scale: float) -> tuple[Array, tuple]:
  weights = _softmax_weights(q, q, valid, scale)
  out = weighted_sum("...qk,...kd->...qd", weights, v)
  return out, (q, v, weights, _saved(out))


def _shared_cluster_attention_bwd(scale: float, res: tuple, g: Array) -> tuple:
  q, v, weights, out = res
  dlogits, dv = _dlogits(weights, v, out, g, scale)
  dq = jnp.einsum("...qk,...kd->...qd", dlogits + jnp.swapaxes(dlogits, -1, -2), q)
  return dq, dv, None


_shared_cluster_attention.defvjp(_shared_cluster_attention_fwd, _shared_cluster_attention_bwd)


MEMBERSHIPS = ("balanced", "nearest", "balanced_leaky")


def _nearest_window(qn: Array, v: Array, assign: Array, mask: Array, *, window: int, causal: bool,
                    scale: float, mask_self: bool) -> Array:
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
  # position -> sorted index: the inverse permutation, by a scatter (a second sort would cost as much as the
  # first)
  flat_order = (order
                + (jnp.arange(batch * heads, dtype=jnp.int32) * length).reshape(batch, heads, 1)).reshape(-1)
  rank = jnp.zeros((batch * heads * length,), jnp.int32).at[flat_order].set(
      jnp.tile(jnp.arange(length, dtype=jnp.int32), batch * heads), unique_indices=True,
      mode="promise_in_bounds").reshape(batch, heads, length)

  def sorted_blocks(t: Array, fill: Any = 0) -> Array:  # [b, h, L, ...] in sorted order -> [b, h, nb, w, ...]
    return to_grid(t, nb, w, axis=2, fill=fill)

  def gather(t: Array) -> Array:  # [b, L, h, e] -> sorted [b, h, L, e]
    return jnp.take_along_axis(t.transpose(0, 2, 1, 3), order[..., None], axis=2)

  qs = sorted_blocks(gather(qn))  # [b, h, nb, w, d]
  vs = sorted_blocks(gather(v))  # [b, h, nb, w, dv]
  cl = sorted_blocks(jnp.take_along_axis(assign, order, axis=-1), -1)  # [b, h, nb, w]; padding: cluster -1
  real = sorted_blocks(jnp.take_along_axis(mask[:, None, :], order, axis=-1), False)
  idx = sorted_blocks(jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), assign.shape), lp)  # sorted index

  offsets = (-1, 0) if causal else (-1, 0, 1)

  ks, vk = neighbours(qs, offsets, 2), neighbours(vs, offsets, 2)  # [b, h, nb, keys, d]: keys are the queries
  kcl, kreal = neighbours(cl, offsets, 2, -2), neighbours(real, offsets, 2, False)
  kidx = neighbours(idx, offsets, 2, -lp)
  delta = idx[..., :, None] - kidx[..., None, :]  # [b, h, nb, w, keys]: sorted distance query - key
  near = (delta >= 0) & (delta < w) if causal else (jnp.abs(delta) < w)
  valid = near & (cl[..., :, None] == kcl[..., None, :]) & kreal[..., None, :]
  if mask_self:
    others = valid & (delta != 0)
    valid = jnp.where(jnp.any(others, axis=-1, keepdims=True), others, valid)
  out = _cluster_attention(qs, ks, vk, valid, scale)  # [b, h, nb, w, dv]
  out = out.reshape(batch, heads, lp, -1)[:, :, :length]
  return jnp.take_along_axis(out, rank[..., None], axis=2).transpose(0, 2, 1, 3)  # [b, L, h, dv]


def routing_attention(q: Array, k: Array, v: Array, *, centroids: Array, window: int, causal: bool,
                      mask: Array | None = None, share_qk: bool = True, scale_logits: bool = True,
                      mask_self: bool = False, membership: str | None = None) -> tuple[Array, RoutingAux]:
  """Content-routed sparse attention; returns (out, aux).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  centroids: [heads, clusters, head_dim] (state; no gradient flows into it). window: tokens per cluster,
  clipped to `length`. share_qk: keys are the queries (`k` is ignored), the paper's choice for causal models,
  which makes every cluster's causal mask well defined. Queries and keys are layer-normed (no affine) before
  both routing and attention, as in Algorithm 1. Returns out [batch, length, heads, value_dim] in v's dtype
  and `RoutingAux`. A query whose cluster holds no visible key (only possible without shared QK) gets zeros.

  membership: None (default) = "nearest" when `causal and share_qk`, else "balanced" (see the module
  docstring).
    "balanced" (the paper): top-`window` tokens per centroid; bidirectional only. In a decoder it would leak
    the future through a discrete channel: whether an earlier token makes a centroid's top-`window` depends
    on later tokens' scores, so out_i can change when a later token changes (its Jacobian is still exactly
    zero). "balanced_leaky": the same top-k, also accepted when causal, leak included (the paper as
    published).
    "nearest": every token joins only its nearest centroid and attends to its `window` most recent
    cluster-mates (itself included; bidirectional: `window - 1` on each side), found by sorting tokens by
    (centroid, position) and attending within a sliding window of that order. The set depends on tokens <= i
    only, so a decoder is exactly causal; needs `share_qk=True` (one cluster per token for both roles). Every
    token gets an output.
  """
  op = "routing_attention"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  share_qk = contract.check_bool(share_qk, name="share_qk", op=op)
  scale_logits = contract.check_bool(scale_logits, name="scale_logits", op=op)
  mask_self = contract.check_bool(mask_self, name="mask_self", op=op)
  window = contract.check_positive_int(window, name="window", op=op)
  if membership is None:
    membership = "nearest" if causal and share_qk else "balanced"
  membership = contract.check_choice(membership, name="membership", allowed=MEMBERSHIPS, op=op)
  if membership == "nearest" and not share_qk:
    raise ValueError(f"{op}: argument 'membership'='nearest' needs share_qk=True (one cluster per token)")
  if membership == "balanced" and causal:
    raise ValueError(f"{op}: argument 'membership'='balanced' is not causal (later tokens decide which "
                     f"earlier ones make a centroid's top-window); use membership='nearest' with "
                     f"share_qk=True, or 'balanced_leaky' to run the paper's leaking decoder knowingly")
  if membership == "balanced_leaky":
    membership = "balanced"
  batch, length, heads, head_dim = q.shape
  # argument validation: any array-like (numpy, jax, tracers) passes
  if not hasattr(centroids, "shape") or len(centroids.shape) != 3 or centroids.shape[0] != heads \
      or centroids.shape[2] != head_dim:
    raise ValueError(f"{op}: argument 'centroids' must have shape "
                     f"[heads={heads}, clusters, head_dim={head_dim}], "
                     f"got {getattr(centroids, 'shape', type(centroids).__name__)}")
  window = min(window, length)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)

  # Head-major from here on: the layer norm, the centroid scores and the row gathers all read [b, h, L, d].
  qh = layer_norm(q.astype(ct).transpose(0, 2, 1, 3))  # [batch, heads, length, head_dim]
  kh = qh if share_qk else layer_norm(k.astype(ct).transpose(0, 2, 1, 3))
  qn, kn = qh.transpose(0, 2, 1, 3), kh.transpose(0, 2, 1, 3)  # [batch, length, heads, head_dim]
  q_scores = kmeans.scores(qh, centroids, heads_first=True)  # [batch, heads, clusters, length]
  k_scores = q_scores if share_qk else kmeans.scores(kh, centroids, heads_first=True)
  if membership == "nearest":
    q_assign = kmeans.nearest_centroid(q_scores)  # [batch, heads, length]
    out = _nearest_window(qn, v.astype(ct), q_assign, mask, window=window, causal=causal,
                          scale=contract.logit_scale(head_dim) if scale_logits else 1.0, mask_self=mask_self)
    # keys are the queries
    return out.astype(v.dtype), cluster_aux(qn, qn, q_assign, q_assign, centroids, mask)
  q_idx = kmeans.balanced_membership(q_scores, window, mask)  # [batch, heads, clusters, window]
  k_idx = q_idx if share_qk else kmeans.balanced_membership(k_scores, window, mask)
  # Flat row ids into [batch * heads * length, e] head-major tables: plain row gathers (and row scatter-adds
  # in the backward), which XLA:CPU runs far faster than batched take_along_axis.
  base = (jnp.arange(batch * heads, dtype=jnp.int32) * length).reshape(batch, heads, 1, 1)
  q_rows, k_rows = q_idx + base, k_idx + base  # [batch, heads, clusters, window]

  def rows(t: Array, r: Array) -> Array:  # t [batch, heads, length, e] -> [batch, heads, clusters, window, e]
    return t.reshape(batch * heads * length, t.shape[-1]).at[r].get(mode="promise_in_bounds")

  qg = rows(qh, q_rows)  # [batch, heads, clusters, window, head_dim]
  kg = qg if share_qk else rows(kh, k_rows)
  vg = rows(v.astype(ct).transpose(0, 2, 1, 3), k_rows)  # [batch, heads, clusters, window, value_dim]
  key_real = jnp.broadcast_to(mask[:, None, :], (batch, heads, length)).reshape(-1).at[k_rows].get(
      mode="promise_in_bounds")  # [batch, heads, clusters, window]
  valid = key_real[..., None, :]  # [batch, heads, clusters, 1, window]
  if share_qk:
    # Queries and keys are the same position-sorted distinct indices, so position order is slot order.
    slot = jnp.arange(window)
    later, same = slot[:, None] >= slot[None, :], slot[:, None] == slot[None, :]  # [window, window]
  else:
    later = q_idx[..., :, None] >= k_idx[..., None, :]  # [batch, heads, clusters, window, window]
    same = q_idx[..., :, None] == k_idx[..., None, :]
  if causal:
    valid = valid & later
  if mask_self:
    others = valid & ~same
    valid = jnp.where(jnp.any(others, axis=-1, keepdims=True), others, valid)
  scale = contract.logit_scale(head_dim) if scale_logits else 1.0
  if share_qk:
    yg = _shared_cluster_attention(qg, vg, valid, scale)  # [batch, heads, clusters, window, value_dim]
  else:
    yg = _cluster_attention(qg, kg, vg, valid, scale)
  n = batch * heads * length
  flat_rows = q_rows.reshape(-1)
  total = jnp.zeros((n, yg.shape[-1]), ct).at[flat_rows].add(yg.reshape(-1, yg.shape[-1]),
                                                             mode="promise_in_bounds")
  count = jnp.zeros((n,), ct).at[flat_rows].add(1.0, mode="promise_in_bounds")
  out = (total / jnp.maximum(count, 1.0)[:, None]).reshape(batch, heads, length, -1).transpose(0, 2, 1, 3)

  q_assign = kmeans.nearest_centroid(q_scores)  # [batch, heads, length]
  k_assign = q_assign if share_qk else kmeans.nearest_centroid(k_scores)
  return out.astype(v.dtype), cluster_aux(qn, kn, q_assign, k_assign, centroids, mask)


def cluster_aux(qn: Array, kn: Array, q_assign: Array, k_assign: Array, centroids: Array,
                mask: Array) -> RoutingAux:
  """The EMA statistics and commitment loss of queries and keys assigned to their nearest centroids.

  qn, kn: [batch, length, heads, head_dim] layer-normed; q_assign, k_assign: [batch, heads, length] centroid
  ids; centroids: [heads, clusters, head_dim]; mask: [batch, length]. The loss averages the query and key
  terms.
  """
  clusters = centroids.shape[1]
  stats = kmeans.merge_stats(kmeans.centroid_stats(qn, q_assign, mask, clusters),
                             kmeans.centroid_stats(kn, k_assign, mask, clusters))
  commit = 0.5 * (kmeans.commitment_loss(qn, q_assign, centroids, mask)
                  + kmeans.commitment_loss(kn, k_assign, centroids, mask))
  return RoutingAux(stats, commit)


def _normed(q: Array, k: Array) -> tuple[Array, Array]:
  """Layer-normed q, k [batch, length, heads, head_dim] in the softmax dtype (float32, or float64)."""
  ct = contract.softmax_dtype(q.dtype, k.dtype)
  return layer_norm(q.astype(ct)), layer_norm(k.astype(ct))


def nearest_assignments(q: Array, k: Array, centroids: Array) -> tuple[Array, Array, Array]:
  """Each token's nearest centroid to its layer-normed query and key together (ids [batch, length, heads]),
  to its query alone and to its key alone ([batch, heads, length] each): `routing.nearest_kernel`'s XLA form.
  q, k: [batch, length, heads, head_dim]; centroids: [heads, clusters, head_dim]."""
  qn, kn = _normed(q, k)
  q_scores, k_scores = kmeans.scores(qn, centroids), kmeans.scores(kn, centroids)  # [b, h, clusters, L]
  ids = kmeans.nearest_centroid(q_scores + k_scores).transpose(0, 2, 1)  # [batch, length, heads]
  return ids, kmeans.nearest_centroid(q_scores), kmeans.nearest_centroid(k_scores)


def routed_aux(q: Array, k: Array, q_assign: Array, k_assign: Array, centroids: Array,
               mask: Array) -> RoutingAux:
  """Combiner-routed's k-means statistics and commitment loss, from the query-only and key-only assignments
  ([batch, heads, length]) of `nearest_assignments`."""
  qn, kn = _normed(q, k)
  return cluster_aux(qn, kn, q_assign, k_assign, centroids, mask)


def routed_clusters(q: Array, k: Array, centroids: Array, mask: Array) -> tuple[Array, RoutingAux]:
  """Combiner-routed's partition: one cluster per token and head, shared by its query and key.

  A token goes to the centroid closest to its layer-normed query and key together (the Combiner plan handles
  causality itself, so no shared QK is needed). q, k: [batch, length, heads, head_dim]; centroids: [heads,
  clusters, head_dim]; mask: [batch, length]. Returns (ids [batch, length, heads], the k-means statistics).
  """
  ids, q_assign, k_assign = nearest_assignments(q, k, centroids)
  return ids, routed_aux(q, k, q_assign, k_assign, centroids, mask)
