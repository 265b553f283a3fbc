"""Routing Transformer attention (Roy et al., TACL 2021) as pure JAX functions.

`routing_attention` routes layer-normed queries/keys to per-head centroids (the paper's balanced top-`window`
membership, or by default in decoders the exactly causal nearest-centroid membership) and attends inside
clusters; `kmeans` holds the centroid state helpers (init, EMA update from batch sums, commitment loss);
`local_attention` is the paper's local heads. The Flax module that owns the centroids is in
`models/routing_attention.py`.
"""

from routing.attention import RoutingAux, routing_attention
from routing.kmeans import CentroidStats, ema_update, init_centroids
from routing.local import local_attention

__all__ = ["CentroidStats", "RoutingAux", "ema_update", "init_centroids", "local_attention",
           "routing_attention"]
