"""Online spherical k-means for routing attention (Roy et al., TACL 2021, section 4.1 and Algorithm 1).

Queries and keys are projected to the sphere of radius sqrt(d) by a layer norm without scale or bias, so that
nearest-centroid search is maximum inner product search. Two assignments come out of the same scores:

- balanced membership (what attention uses): every centroid takes the top `window` tokens by score, sorted by
  position, so all clusters have the same size (a token may be in several clusters or in none);
- nearest centroid (what the centroid update uses): the argmax over centroids of each token.

Centroids are state, not parameters: the update is an exponential moving average computed from *sums* over the
batch (`CentroidStats`), so under `jax.jit` with a data-sharded batch the sums are global and every device
applies the same update with no extra code. Padding tokens never enter the sums.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_core.norm import layer_norm

Array = Any



class CentroidStats(NamedTuple):
  """Batch sums of the vectors assigned (nearest centroid) to each centroid.

  sums:   [heads, clusters, head_dim]  sum of assigned layer-normed queries and keys
  counts: [heads, clusters]            how many vectors were summed (float, so it sums across devices as is)
  """

  sums: Array
  counts: Array


def init_centroids(key: Array, heads: int, clusters: int, head_dim: int, dtype: Any = jnp.float32) -> Array:
  """Per-head centroids [heads, clusters, head_dim]: layer-normed standard normals (on the same sphere as
  x)."""
  return layer_norm(jax.random.normal(key, (heads, clusters, head_dim), jnp.float32)).astype(dtype)


def scores(x: Array, centroids: Array, *, heads_first: bool = False) -> Array:
  """Dot products of layer-normed tokens x [batch, length, heads, d] with centroids [heads, clusters, d].

  heads_first: x is [batch, heads, length, d] instead (no transpose of x before the contraction).
  Returns [batch, heads, clusters, length]; the routing decision carries no gradient.
  """
  x = jax.lax.stop_gradient(x)
  centroids = jax.lax.stop_gradient(centroids).astype(x.dtype)
  return jnp.einsum("bhld,hcd->bhcl" if heads_first else "blhd,hcd->bhcl", x, centroids)


def balanced_membership(token_scores: Array, window: int, mask: Array | None = None) -> Array:
  """Top-`window` tokens per centroid, sorted by position: int32 [batch, heads, clusters, window].

  token_scores: [batch, heads, clusters, length]; mask: [batch, length] bool, True = real token. Padding
  tokens score -inf, so they are chosen only when a sequence has fewer than `window` real tokens (and then
  they are masked out as keys by the caller); ties go to the earlier position.
  """
  length = token_scores.shape[-1]
  if not 1 <= window <= length:
    raise ValueError(f"balanced_membership: argument 'window' must be in [1, length={length}], got {window}")
  if mask is not None:
    token_scores = jnp.where(mask[:, None, None, :], token_scores, -jnp.inf)
  _, idx = jax.lax.top_k(token_scores, window)
  return jnp.sort(idx, axis=-1).astype(jnp.int32)


def nearest_centroid(token_scores: Array) -> Array:
  """argmax over centroids: int32 [batch, heads, length] from scores [batch, heads, clusters, length]."""
  return jnp.argmax(token_scores, axis=2).astype(jnp.int32)


def centroid_stats(x: Array, assignment: Array, mask: Array, clusters: int) -> CentroidStats:
  """Sums of x [batch, length, heads, d] per assigned centroid, over the batch and the real tokens only.

  assignment: [batch, heads, length] nearest-centroid ids; mask: [batch, length] bool.
  """
  x = jax.lax.stop_gradient(x)
  onehot = jax.nn.one_hot(assignment, clusters, dtype=x.dtype)  # [batch, heads, length, clusters]
  onehot = onehot * mask[:, None, :, None].astype(x.dtype)
  return CentroidStats(jnp.einsum("bhlc,blhd->hcd", onehot, x), jnp.sum(onehot, axis=(0, 2)))


def merge_stats(a: CentroidStats, b: CentroidStats) -> CentroidStats:
  return CentroidStats(a.sums + b.sums, a.counts + b.counts)


def commitment_loss(x: Array, assignment: Array, centroids: Array, mask: Array) -> Array:
  """mean((x - stop_gradient(assigned centroid))^2) over real tokens, heads and dims: pulls x to its centroid.

  x: [batch, length, heads, d]; assignment: [batch, heads, length]; returns a scalar in x's dtype.
  """
  centroids = jax.lax.stop_gradient(centroids).astype(x.dtype)
  heads = jnp.arange(centroids.shape[0])[None, :, None]
  assigned = centroids[heads, assignment]  # [batch, heads, length, d]
  err = jnp.mean(jnp.square(x.transpose(0, 2, 1, 3) - assigned), axis=-1)  # [batch, heads, length]
  weight = jnp.broadcast_to(mask[:, None, :], err.shape).astype(x.dtype)
  return jnp.sum(err * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def ema_update(centroids: Array, stats: CentroidStats, decay: float = 0.999, smoothing: float = 1.0) -> Array:
  """mu <- decay * mu + (1 - decay) * (sums + smoothing * mu) / (counts + smoothing).

  The target is the mean of the vectors assigned to mu (queries and keys together, which is the paper's
  `(1 - decay)/2 * (mean assigned q + mean assigned k)` when both sides have equal counts, as with shared QK),
  with Laplace smoothing: `smoothing` pseudo-observations located at mu itself. A centroid that got no vector
  in this batch therefore stays exactly where it is instead of decaying towards zero.
  centroids: [heads, clusters, d]; returns the same shape and dtype.
  """
  if not 0.0 <= decay <= 1.0:
    raise ValueError(f"ema_update: argument 'decay' must be in [0, 1], got {decay}")
  if smoothing <= 0.0:
    raise ValueError(f"ema_update: argument 'smoothing' must be > 0, got {smoothing}")
  mu = centroids.astype(stats.sums.dtype)
  target = (stats.sums + smoothing * mu) / (stats.counts + smoothing)[..., None]
  return (decay * mu + (1.0 - decay) * target).astype(centroids.dtype)
