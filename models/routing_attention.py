"""Routing Transformer and Combiner-routed attention modules: k-means centroids as non-gradient
state.

`RoutingAttention` ("routing"): the paper's layer, `routing_heads` heads of routing attention (shared QK by
default in causal models) next to `num_heads - routing_heads` local heads (own + previous block), all in one
layer with one output projection. Layers not listed in `routing_layers` use local heads only (the paper's
PG-19 setting routes only the last layers); they own no centroids.

`RoutedCombinerAttention` ("combiner_routed"): every head is Combiner-learnable (Combiner paper section 4.4),
the cluster of each token being its nearest centroid. Where the attention runs on kernels, the clusters and
the query-only and key-only assignments of the k-means update come from one kernel
(`routing.registry.routed_assignments`).

Cached decoding (`init_cache` / `decode_step` / `prefill`, see `models.transformer`): `RoutingAttention` with
membership "nearest" (`routing.decode`); balanced membership and `RoutedCombinerAttention` raise a ValueError,
since a later token changes earlier tokens' clusters (balanced) or chunk boundaries (combiner_routed).

Both keep per-head centroids `[heads, clusters, head_dim]` in a `Centroids` variable (not an `nnx.Param`, so
the optimizer never sees it), update them by an EMA of the assigned layer-normed vectors when called with
`deterministic=False`, and sow the commitment loss as `aux_loss` (the train step multiplies it by
`config.aux_loss_weight`, 1e-4 in the routing configs). The update uses batch sums, so under a jit over a
data-sharded batch every device applies the same global update.

Config fields (`config.model.attention`), besides `name`, `params`, `dropout_rate`:
  params.num_clusters  int, or "auto" = sqrt(length) rounded up to a power of two at call time, using the
                       first rows of the allocated centroids: sqrt_pow2(seq_len) of them when `seq_len` is
                       known (the registry fills it in from the model), else `max_clusters` (default 128:
                       L <= 16384)
  params.window        int or "auto" (= ceil(length / num_clusters) at call time); routing only
  params.block_size    local heads' block, int or "auto" (= the window); routing only
  params.pooling       "max" | "mean"; combiner_routed only
  routing_heads        routing heads per routing layer (default num_heads // 2; routing only)
  routing_layers       None (every layer) or a list of layer indices, negative counting from the end (routing
                       only; needs the block to pass `layer=` and `num_layers=`)
  share_qk             None (= causal), True or False; routing only (combiner_routed routes a token by its
                       query and key together and needs no sharing)
  scale_logits, mask_self  see `routing.attention` (defaults True, False)
  membership           None (default: "nearest" in decoders with shared QK, exactly causal; "balanced"
                       in encoders), "nearest" (nearest centroid, the window most recent cluster-mates),
                       "balanced" (the paper: top-window tokens per centroid; encoders only) or
                       "balanced_leaky" (the same in a decoder, where it leaks the future through the
                       discrete membership: an explicit opt-in); see the `routing.attention` module docstring
  ema_decay            0.999
  centroid_seed        seed of the centroids' initial values (default 0; layers offset it by their index)
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import combiner
from attention_core import registry as ops_registry
from models import attention
from routing import decode, kmeans
from routing.attention import routed_aux, routing_attention
from routing.local import local_attention
from routing.registry import routed_assignments
from runtime import cli

Array = Any
# "auto" clusters depend on the length, unknown at construction: allocate this many centroids and use the
# first sqrt_pow2(L) of them (an unused centroid gets no assignment, so its EMA leaves it exactly unchanged).
DEFAULT_MAX_CLUSTERS = 128

class Centroids(nnx.Variable):
  """k-means centroids [heads, clusters, head_dim]: state updated by EMA, never by gradients."""


def _cluster_state(config: ml_collections.ConfigDict, params: dict[str, Any],
                   name: str) -> tuple[int | None, int]:
  """(num_clusters or None for "auto", number of centroid rows to allocate)."""
  value = params.get("num_clusters", attention.AUTO)
  if attention.is_auto(value):
    seq_len = config.get("seq_len", None)  # filled in by models.registry.build from the model's length
    rows = config.get("max_clusters", None) or (ops_registry.sqrt_pow2(int(seq_len)) if seq_len
                                                 else DEFAULT_MAX_CLUSTERS)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
      raise ValueError(f"attention {name!r}: max_clusters must be a positive int, got {rows!r}")
    return None, rows
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"attention {name!r}: params.num_clusters must be a positive int or 'auto', "
                     f"got {value!r}")
  return value, value


def _clusters_for(num_clusters: int | None, rows: int, length: int, name: str) -> int:
  """The clusters used at this length: the configured number, or sqrt(L) rounded up to a power of two."""
  clusters = num_clusters or ops_registry.sqrt_pow2(length)
  if clusters > rows:
    raise ValueError(f"attention {name!r}: 'auto' wants {clusters} clusters at length {length} but only "
                     f"max_clusters={rows} centroids exist; raise config.model.attention.max_clusters")
  return clusters


def _int_or_auto(value: Any, auto: int, name: str) -> int:
  if attention.is_auto(value):
    return auto
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"routing attention: params.{name} must be a positive int or 'auto', got {value!r}")
  return value


# The config fields of the centroid state (both routing modules).
CENTROID_FIELDS = {
  "ema_decay": attention.Field(float, "decay of the centroids' moving average (None = 0.999)", minimum=0),
  "centroid_seed": attention.Field(int, "seed of the centroids' initialisation, plus the layer index "
                                   "(None = 0)"),
  "max_clusters": attention.Field(int, "rows of the centroid table (None = a power of two near sqrt of the "
                                  "sequence length)", minimum=1),
  "seq_len": attention.SEQ_LEN,
}


class _CentroidMixin:
  """Centroid state, its EMA update and the commitment loss, shared by both modules."""

  def _init_centroids(self, config: ml_collections.ConfigDict, heads: int, clusters: int, head_dim: int,
                      layer: int | None) -> None:
    self.ema_decay = float(config.get("ema_decay", 0.999))
    if not 0.0 <= self.ema_decay <= 1.0:
      raise ValueError(f"attention {self.name!r}: ema_decay must be in [0, 1], got {self.ema_decay}")
    seed = int(config.get("centroid_seed", 0)) + (layer or 0)
    # Fixed-seed init keeps construction a pure function of the config (no draw from the params stream).
    self.centroids = Centroids(kmeans.init_centroids(jax.random.key(seed), heads, clusters, head_dim))

  def _update(self, aux: Any, clusters: int, *, deterministic: bool) -> None:
    """Sows the commitment loss; in training, moves the first `clusters` centroids (the ones in use)."""
    self.sow(nnx.Intermediate, "aux_loss", aux.commit_loss.astype(jnp.float32))
    if not deterministic:
      mu = self.centroids[...]
      self.centroids[...] = mu.at[:, :clusters].set(
          kmeans.ema_update(mu[:, :clusters], aux.stats, self.ema_decay))


class RoutingAttention(attention.AttentionBase, _CentroidMixin):
  """Local heads + routing heads in one layer (Roy et al., section 5)."""

  FIELDS = {
    "routing_heads": attention.Field(int, "heads that route in a routing layer (None = half; the rest attend "
                                     "locally; 0 = every head local)", minimum=0),
    "routing_layers": attention.Field(tuple, "the routing layers, indices, negative from the top "
                                      "(None = every layer)"),
    "share_qk": attention.Field(bool, "shared query/key projection (None = in decoders, as the paper)"),
    "scale_logits": attention.Field(bool, "scale logits by 1/sqrt(head_dim) (None = True)"),
    "mask_self": attention.Field(bool, "a token never attends to itself (None = False)"),
    "membership": attention.Field(str, "cluster membership (None = 'nearest' in decoders, exactly causal; "
                                  "'balanced' = the paper's top-k, see routing/)"),
    **CENTROID_FIELDS,
  }
  CONTEXT = ("layer", "num_layers")
  # The module runs routing and local heads itself: the local heads' block is a plan parameter too.
  PLAN = {"num_clusters": ops_registry.POSITIVE, "window": ops_registry.POSITIVE,
          "block_size": ops_registry.POSITIVE}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs, layer: int | None = None,
               num_layers: int | None = None):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    params = attention.plan_params(config, self.PLAN, "routing")
    self.window_param = params.get("window", attention.AUTO)
    self.block_param = params.get("block_size", attention.AUTO)
    routing_heads = config.get("routing_heads", None)
    routing_heads = num_heads // 2 if routing_heads is None else int(routing_heads)
    if not 0 <= routing_heads <= num_heads:
      raise ValueError(f"attention 'routing': routing_heads must be in [0, num_heads={num_heads}], "
                       f"got {routing_heads}")
    layers = config.get("routing_layers", None)
    if layers is not None:
      if layer is None or num_layers is None:
        raise ValueError("attention 'routing': routing_layers needs the block to pass layer= and num_layers=")
      chosen = {int(i) % num_layers for i in layers}
      if layer not in chosen:
        routing_heads = 0
    self.routing_heads = routing_heads
    share_qk = config.get("share_qk", None)
    self.share_qk = bool(causal if share_qk is None else share_qk)
    self.scale_logits = bool(config.get("scale_logits", True))
    self.mask_self = bool(config.get("mask_self", False))
    membership = config.get("membership", None)
    # None: the op decides from causal/share_qk
    self.membership = None if membership is None else str(membership)
    self.num_clusters, rows = _cluster_state(config, params, "routing")
    if routing_heads:
      self._init_centroids(config, routing_heads, rows, head_dim, layer)
    else:
      self.ema_decay, self.centroids = None, None

  def _plan(self, length: int) -> tuple[int, int, int]:
    """(clusters, window, local block) for sequences of `length` tokens ("auto" entries resolved)."""
    if self.routing_heads:
      clusters = _clusters_for(self.num_clusters, self.centroids.shape[1], length, "routing")
    else:  # no centroids in this layer, but "auto" local blocks still follow the routing window
      clusters = self.num_clusters or ops_registry.sqrt_pow2(length)
    window = min(_int_or_auto(self.window_param, -(-length // clusters), "window"), length)
    return clusters, window, _int_or_auto(self.block_param, window, "block_size")

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool) -> Array:
    q, k, v = self.project(x)  # [batch, length, heads, head_dim]
    r = self.routing_heads
    clusters, window, block = self._plan(x.shape[1])
    parts = []
    if r < self.num_heads:
      parts.append(local_attention(q[:, :, r:], k[:, :, r:], v[:, :, r:], block_size=block,
                                   causal=self.causal, mask=mask))  # [batch, length, local_heads, head_dim]
    if r:
      o, aux = routing_attention(q[:, :, :r], k[:, :, :r], v[:, :, :r],
                                 centroids=self.centroids[:, :clusters], window=window, causal=self.causal,
                                 mask=mask, share_qk=self.share_qk,
                                 scale_logits=self.scale_logits, mask_self=self.mask_self,
                                 membership=self.membership)
      self._update(aux, clusters, deterministic=deterministic)
      parts.insert(0, o)  # [batch, length, routing_heads, head_dim]
    o = jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]  # [batch, length, heads, head_dim]
    return self.output(o, deterministic=deterministic)

  # Cached decoding (`routing.decode`): routing heads keep per-cluster rings, local heads the last two
  # blocks. "auto" plan parameters are chosen for the cache's `max_length`, as the forward pass over it.
  def _decoding(self, max_length: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(routing decoder parameters, local decoder parameters) for sequences of up to `max_length` tokens."""
    if not self.causal:
      raise ValueError("attention 'routing': cached decoding needs a causal model")
    membership = self.membership or ("nearest" if self.share_qk else "balanced")
    if self.routing_heads and membership != "nearest":
      raise ValueError(f"attention 'routing': cached decoding needs membership='nearest' with "
                       f"share_qk=True, got membership={membership!r} (balanced membership is not causal: "
                       "whether an earlier token is in a cluster depends on later tokens)")
    clusters, window, block = self._plan(max_length)
    routing = {}
    if self.routing_heads:
      routing = dict(centroids=self.centroids[:, :clusters], window=window, scale_logits=self.scale_logits,
                     mask_self=self.mask_self)
    return routing, {"block_size": block}

  def init_cache(self, batch: int, max_length: int) -> attention.LayerCache:
    """An empty cache for up to `max_length` tokens: {"routing": rings, "local": the last two blocks}."""
    routing, local = self._decoding(max_length)
    r, state = self.routing_heads, {}
    if r:
      state["routing"] = decode.ROUTING.init_cache(batch, r, max_length, self.head_dim, self.head_dim,
                                                   self.dtype, **routing)
    if r < self.num_heads:
      state["local"] = decode.LOCAL.init_cache(batch, self.num_heads - r, max_length, self.head_dim,
                                               self.head_dim, self.dtype, **local)
    return attention.LayerCache(state, max_length)

  def decode_step(self, x: Array, cache: attention.LayerCache, position: Array
                  ) -> tuple[Array, attention.LayerCache]:
    """x: [batch, 1, features], the token at `position` -> ([batch, 1, features], cache); equals row
    `position` of the causal forward pass over `cache.max_length` tokens (no centroid update)."""
    routing, local = self._decoding(cache.max_length)
    q, k, v = (t[:, 0] for t in self.project(x))  # [batch, heads, head_dim]
    r, state, parts = self.routing_heads, dict(cache.state), []
    if r:
      o, state["routing"] = decode.ROUTING.step(state["routing"], q[:, :r], k[:, :r], v[:, :r], position,
                                                **routing)
      parts.append(o)  # [batch, routing_heads, head_dim]
    if r < self.num_heads:
      o, state["local"] = decode.LOCAL.step(state["local"], q[:, r:], k[:, r:], v[:, r:], position, **local)
      parts.append(o)  # [batch, local_heads, head_dim]
    o = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]  # [batch, heads, head_dim]
    return self.out(o[:, None]), attention.LayerCache(state, cache.max_length)

  def prefill(self, x: Array, cache: attention.LayerCache) -> tuple[Array, attention.LayerCache]:
    """x: [batch, prompt_length, features] at positions [0, prompt_length): the forward pass's output and the
    cache filled with those positions (no centroid update)."""
    routing, local = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, prompt_length, heads, head_dim]
    r, state, parts = self.routing_heads, dict(cache.state), []
    if r:
      o, _ = routing_attention(q[:, :, :r], k[:, :, :r], v[:, :, :r], causal=True, share_qk=True,
                               membership="nearest", **routing)
      parts.append(o)  # [batch, prompt_length, routing_heads, head_dim]
      state["routing"] = decode.ROUTING.prefill(state["routing"], q[:, :, :r], k[:, :, :r], v[:, :, :r],
                                                **routing)
    if r < self.num_heads:
      parts.append(local_attention(q[:, :, r:], k[:, :, r:], v[:, :, r:], causal=True, **local))
      state["local"] = decode.LOCAL.prefill(state["local"], q[:, :, r:], k[:, :, r:], v[:, :, r:], **local)
    o = jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]  # [batch, prompt, heads, head_dim]
    return self.out(o), attention.LayerCache(state, cache.max_length)


@functools.cache
def _warn_balanced_causal() -> None:
  """Once per process: a causal combiner_routed model's outputs depend on later tokens' clusters."""
  print("WARNING: attention 'combiner_routed' in a causal model: its balanced chunks are cut from the "
        "cluster ids of all tokens, so later tokens' clusters move the chunks of earlier ones (the Routing "
        "Transformer's balanced top-k leak; no later value or gradient reaches an earlier output). For an "
        "exactly causal routed model use attention 'routing' (membership 'nearest').", file=sys.stderr,
        flush=True)


class RoutedCombinerAttention(attention.AttentionBase, _CentroidMixin):
  """Combiner-learnable: clusters = nearest k-means centroid of each layer-normed query (and key), per
  head."""

  FIELDS = CENTROID_FIELDS
  CONTEXT = ("layer",)
  PLAN = {"num_clusters": ops_registry.POSITIVE, "pooling": ops_registry.TEXT}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs, layer: int | None = None):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    params = attention.plan_params(config, self.PLAN, "combiner_routed")
    self.pooling = str(params.get("pooling", "max"))
    self.implementation = attention.implementation_of(config, ops_registry.get("combiner_routed"),
                                                      "combiner_routed")
    self.num_clusters, rows = _cluster_state(config, params, "combiner_routed")
    self._init_centroids(config, num_heads, rows, head_dim, layer)
    if causal:
      _warn_balanced_causal()

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool) -> Array:
    q, k, v = self.project(x)  # [batch, length, heads, head_dim]
    if mask is None:
      mask = jnp.ones(x.shape[:2], bool)
    clusters = _clusters_for(self.num_clusters, self.centroids.shape[1], x.shape[1], "combiner_routed")
    centroids = self.centroids[:, :clusters]
    # ids [batch, length, heads]; q_ids, k_ids [batch, heads, length]: on one kernel where the attention is
    ids, q_ids, k_ids = routed_assignments(q, k, centroids, implementation=self.implementation)
    aux = routed_aux(q, k, q_ids, k_ids, centroids, mask)
    o = combiner.routed(q, k, v, cluster_ids=ids, num_clusters=clusters, causal=self.causal, mask=mask,
                        pooling=self.pooling, implementation=self.implementation)  # [b, L, heads, head_dim]
    self._update(aux, clusters, deterministic=deterministic)
    return self.output(o, deterministic=deterministic)

  def init_cache(self, batch: int, max_length: int) -> attention.LayerCache:
    raise cli.mark_usage(ValueError(
        "attention 'combiner_routed' has no cached decoding step: its balanced partition ranks all tokens by "
        "(cluster, position) and cuts chunks of ceil(L / num_clusters), so a later token shifts the chunk "
        "boundaries of earlier ones; no cache of the past reproduces that"))
