"""Cached decoding for the exactly causal routing plans: nearest-centroid routing and block-local attention.

- routing, membership "nearest" (shared QK): per head, one ring buffer per cluster of the last `window`
  layer-normed keys (= queries) and values, plus how many tokens each cluster has received. A step
  layer-norms the query, assigns it to its nearest centroid, writes it into that cluster's ring and attends
  over the ring's filled slots, which are exactly the `window` most recent cluster-mates including itself
  (the causal rows of `routing.attention.routing_attention(membership="nearest")`): O((clusters + window) * d)
  per token, a cache of O(clusters * window * d). The centroids are an explicit input of every call, as in
  the op.
- local (`routing.local.local_attention`): a ring of the last 2 * block keys/values with their positions; the
  token at t attends to positions [(t // block - 1) * block, t]: O(block * d) per token.

Balanced membership (the paper's top-`window` tokens per centroid) has no decoder: whether an earlier token
is in a cluster depends on later tokens, so no cache of the past can reproduce it. The registered `routing`
op uses balanced membership (like-for-like with the lucidrains peer), so its `OpSpec` carries no decoder;
these decoders serve the model module (`models.routing_attention.RoutingAttention`), which resolves
membership to "nearest" in causal models with shared QK.

Layouts (head-major, one token): q_t, k_t: [batch, heads, head_dim]; v_t: [batch, heads, value_dim];
`position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.combine import Piece, joint_softmax
from attention_core.decode import Cache, finish, keys_piece, make_decoder, token, write, zeros
from attention_core.norm import layer_norm
from routing import kmeans

Array = Any


# ----------------------------------------------------------------------------------------------------------
# routing attention, membership "nearest"


def _check_centroids(centroids: Any, heads: int, head_dim: int, op: str) -> int:
  # argument validation: any array-like (numpy, jax, tracers) passes
  if not hasattr(centroids, "shape") or len(centroids.shape) != 3 or centroids.shape[0] != heads \
      or centroids.shape[2] != head_dim:
    raise ValueError(f"{op}: argument 'centroids' must have shape [heads={heads}, clusters, "
                     f"head_dim={head_dim}], got {getattr(centroids, 'shape', type(centroids).__name__)}")
  return int(centroids.shape[1])


def routing_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
                 centroids: Array, window: int, scale_logits: bool = True, mask_self: bool = False) -> Cache:
  """Rings of min(window, max_length) slots per cluster (the op clips the window to the length alike)."""
  op = "routing.decode"
  del scale_logits, mask_self
  clusters = _check_centroids(centroids, heads, head_dim, op)
  w = min(contract.check_positive_int(window, name="window", op=op),
          contract.check_positive_int(max_length, name="max_length", op=op))
  return {"k": zeros(batch, heads, (clusters, w), head_dim, dtype),  # layer-normed keys (= queries)
          "v": zeros(batch, heads, (clusters, w), value_dim, dtype),
          "count": jnp.zeros((batch, heads, clusters), jnp.int32)}  # tokens each cluster has received


def routing_step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, centroids: Array, window: int,
                 scale_logits: bool = True, mask_self: bool = False, pool_q: Array | None = None,
                 pool_k: Array | None = None) -> tuple[Array, Cache]:
  """Row `position` of routing_attention(causal=True, share_qk=True, membership="nearest"); `k` is not read
  (shared QK: the key is the layer-normed query). The ring size fixed by `routing_init` is the window."""
  op = "routing.decode"
  del pool_q, pool_k
  x = token(q, k, v, position, None, None, op=op)
  batch, heads, head_dim = x.q.shape
  clusters = _check_centroids(centroids, heads, head_dim, op)
  contract.check_positive_int(window, name="window", op=op)
  if cache["k"].shape[2] != clusters:
    raise ValueError(f"{op}: argument 'centroids' has {clusters} clusters, the cache {cache['k'].shape[2]}")
  w = cache["k"].shape[3]
  qn = layer_norm(x.q)  # [batch, heads, head_dim]
  scores = kmeans.scores(qn[:, :, None], centroids, heads_first=True)  # [batch, heads, clusters, 1]
  cluster = kmeans.nearest_centroid(scores)[..., 0]  # [batch, heads]
  b, h = jnp.arange(batch)[:, None], jnp.arange(heads)[None, :]
  count = cache["count"][b, h, cluster]  # [batch, heads]: earlier tokens of the token's cluster
  slot = count % w  # the ring slot of the oldest one once the ring is full
  keys = cache["k"].at[b, h, cluster, slot].set(qn.astype(cache["k"].dtype))
  values = cache["v"].at[b, h, cluster, slot].set(x.v.astype(cache["v"].dtype))
  cache = {"k": keys, "v": values, "count": cache["count"].at[b, h, cluster].add(1)}
  ring_k, ring_v = keys[b, h, cluster], values[b, h, cluster]  # [batch, heads, window, head_dim | value_dim]
  ring = jnp.arange(w)
  valid = ring < jnp.minimum(count + 1, w)[..., None]  # [batch, heads, window]: filled slots, itself included
  if mask_self:  # itself only when it is the first of its cluster
    others = valid & (ring != slot[..., None])
    valid = jnp.where(jnp.any(others, axis=-1, keepdims=True), others, valid)
  scale = contract.logit_scale(head_dim) if scale_logits else 1.0
  logits = jnp.einsum("bhd,bhnd->bhn", qn, ring_k) * scale  # [batch, heads, window]
  piece = Piece(logits, valid, lambda a: jnp.einsum("bhn,bhnd->bhd", a, ring_v))
  return finish(joint_softmax([piece]), x), cache


# ----------------------------------------------------------------------------------------------------------
# block-local attention: own block + previous block, causal


def local_init(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               block_size: int) -> Cache:
  s = contract.check_positive_int(block_size, name="block_size", op="local.decode")
  return {"k": zeros(batch, heads, 2 * s, head_dim, dtype), "v": zeros(batch, heads, 2 * s, value_dim, dtype),
          "pos": jnp.full((2 * s,), -1, jnp.int32)}  # position held by each slot (-1: empty)


def local_step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, block_size: int,
               pool_q: Array | None = None, pool_k: Array | None = None) -> tuple[Array, Cache]:
  """Row `position` of local_attention(causal=True): keys at positions [(t // block - 1) * block, t]."""
  del pool_q, pool_k
  x = token(q, k, v, position, None, None, op="local.decode")
  s = contract.check_positive_int(block_size, name="block_size", op="local.decode")
  slot = x.position % (2 * s)  # positions t - 2s + 1 .. t occupy distinct slots
  cache = {"k": write(cache["k"], x.k, slot), "v": write(cache["v"], x.v, slot),
           "pos": cache["pos"].at[slot].set(x.position)}
  first = jnp.maximum(x.position // s - 1, 0) * s  # the previous block's first position
  valid = cache["pos"] >= first  # [2 * block]; every filled slot holds a position <= t
  return finish(joint_softmax([keys_piece(x, cache["k"], cache["v"], valid)]), x), cache


ROUTING = make_decoder(routing_init, routing_step)
LOCAL = make_decoder(local_init, local_step)
