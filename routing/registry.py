"""Registers the routing attentions: pure ops for the benchmark, and the model modules that own the centroids.

The registered functions return only the output. Their k-means centroids come from a fixed seed (a stand-in
for trained state, same for every call), with the benchmark's setting clusters = window = sqrt(L) rounded up
to a power of two, shared QK and the op's default membership (exactly causal in decoders). Models use the
modules named in the registrations, which own and update the centroids instead.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_core import contract
from attention_core.registry import POSITIVE, TEXT, FusedPath, OpSpec, Param, register, sqrt_pow2

# Combiner-routed is the Combiner's `routed` plan over routing's clusters: a declared peer dependency.
from combiner import common
from combiner.routed import routed
from routing import nearest_kernel
from routing.attention import nearest_assignments, routing_attention

Array = Any
CENTROID_SEED = 0


def _centroids(q: Array, k: Array, v: Array, mask: Array | None, clusters: int, op: str) -> np.ndarray:
  """Fixed [heads, clusters, head_dim] centroids for q [batch, length, heads, head_dim]: a constant of the
  compiled program, not a random draw and normalisation run at every call. `num_clusters` and the op
  contract are checked first (the op's own errors), since the centroids are made before the op runs."""
  clusters = contract.check_positive_int(clusters, name="num_clusters", op=op)
  q = contract.check_qkv(q, k, v, mask, op=op, keep_none=True)[0]
  return _fixed_centroids(int(q.shape[2]), clusters, int(q.shape[3]))


@functools.cache
def _fixed_centroids(heads: int, clusters: int, head_dim: int) -> np.ndarray:
  """Layer-normed standard normals (as `kmeans.init_centroids`) drawn by numpy: made on the host, whatever
  the devices or mesh the op is traced for."""
  x = np.random.default_rng(CENTROID_SEED).standard_normal((heads, clusters, head_dim)).astype(np.float32)
  x = x - x.mean(axis=-1, keepdims=True)
  out = x / np.sqrt(np.square(x).mean(axis=-1, keepdims=True) + np.float32(1e-6))
  out.flags.writeable = False
  return out


def routing_op(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, num_clusters: int,
               window: int, membership: str | None = None) -> Array:
  """Routing attention with shared QK and fixed centroids; q, k: [batch, length, heads, head_dim] -> out.

  membership: None = the op's own default ("nearest" when causal, exactly causal; the paper's balanced top-k
  when bidirectional), as the `routing` model module uses; "balanced_leaky" is the paper's top-k in a decoder
  too, as lucidrains' `routing_transformer` peer (it leaks the future, see `routing.attention`). It is not
  among the registered `params` on purpose: configs pre-fill every registered param as a plan parameter,
  while the model module takes `membership` as a module field.
  """
  centroids = _centroids(q, k, v, mask, num_clusters, "routing")
  return _routing_by(q, k, v, centroids=centroids, window=window, causal=causal, mask=mask,
                     membership=membership)


@contract.partitioned_op(per_head=("centroids",))
def _routing_by(q: Array, k: Array, v: Array, *, centroids: Array, window: int, causal: bool,
                mask: Array | None, membership: str | None) -> Array:
  """`routing_op` with its centroids [heads, clusters, head_dim] made for every head: each device routes
  its heads by theirs."""
  out, _ = routing_attention(q, k, v, centroids=centroids, window=window, causal=causal, mask=mask,
                             share_qk=True, membership=membership)
  return out  # [batch, length, heads, value_dim]


def combiner_routed_op(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                       num_clusters: int, pooling: str = "max", implementation: str = "auto") -> Array:
  """Combiner-routed attention, clusters = nearest fixed centroid of the layer-normed query and key
  (on kernels under `implementation`: Combiner-Fixed's when bidirectional, `combiner.routed_kernels` when
  causal). The centroids are made for every head
  here and the rest partitions itself (`_routed_by`), each device routing its heads by theirs."""
  centroids = _centroids(q, k, v, mask, num_clusters, "combiner_routed")
  return _routed_by(q, k, v, centroids=centroids, causal=causal, mask=mask, num_clusters=num_clusters,
                    pooling=pooling, implementation=implementation)


combiner_routed_op.partitions_itself = True  # through `_routed_by` (attention_core.partition)


def _nearest(q: Array, k: Array, centroids: Array, implementation: str, sides: bool) -> Any:
  """`routing.nearest_kernel.nearest` where the attention runs on kernels and the kernel serves q, else its
  XLA form: the joint ids [batch, length, heads] (sides: and the query-only and key-only [batch, heads,
  length]). Unpartitioned: called inside the partitioned ops below."""
  platform = contract.backend()
  if common.uses_kernels(implementation, op="combiner_routed") and nearest_kernel.supported(q, platform):
    return nearest_kernel.nearest(q, k, centroids, platform=platform, sides=sides)
  ids = nearest_assignments(q, k, centroids)
  return ids if sides else ids[0]


@contract.per_platform_op(common.plan_choice, per_head=("centroids",))
def _routed_by(q: Array, k: Array, v: Array, *, centroids: Array, causal: bool, mask: Array | None,
               num_clusters: int, pooling: str, implementation: str) -> Array:
  """`combiner_routed_op` with its centroids [heads, clusters, head_dim] given. The plan ranks masked tokens
  after every real one whatever their ids, so only real tokens' ids matter here; on kernels they come from
  one kernel (`routing.nearest_kernel`) instead of XLA's layer norms, scores and argmax."""
  ids = _nearest(q, k, centroids, implementation, sides=False)  # [batch, length, heads]
  return routed(q, k, v, cluster_ids=ids, num_clusters=num_clusters, causal=causal, mask=mask,
                pooling=pooling, implementation=implementation)


def routed_assignments(q: Array, k: Array, centroids: Array, *, implementation: str = "auto"
                       ) -> tuple[Array, Array, Array]:
  """Combiner-routed's clusters and the k-means assignments of its training step, on one kernel where the
  attention runs on kernels: (ids [batch, length, heads], q_ids and k_ids [batch, heads, length]; see
  `routing.attention.nearest_assignments`). Partitions itself as the ops do (each device its heads' ids)."""
  ids = _assignments(q, k, k, centroids=centroids, implementation=implementation)  # [batch, length, heads, 3]
  return ids[..., 0], ids[..., 1].transpose(0, 2, 1), ids[..., 2].transpose(0, 2, 1)


@contract.per_platform_op(common.plan_choice, per_head=("centroids",))
def _assignments(q: Array, k: Array, v: Array, *, centroids: Array, implementation: str) -> Array:
  """`routed_assignments` stacked on a last axis [batch, length, heads, 3] (the partitioned form's output:
  per position and head). v: unused (k again; the partitioned form takes the op contract's q, k, v)."""
  del v
  ids, q_ids, k_ids = _nearest(q, k, centroids, implementation, sides=True)
  return jnp.stack([ids, q_ids.transpose(0, 2, 1), k_ids.transpose(0, 2, 1)], axis=-1)


register(OpSpec("routing", routing_op,
                params=lambda length: {"num_clusters": sqrt_pow2(length), "window": sqrt_pow2(length)},
                module="models.routing_attention:RoutingAttention",
                plan={"num_clusters": POSITIVE, "window": POSITIVE, "membership": Param(str, optional=True)},
                description="Routing Transformer attention: spherical k-means clusters (balanced top-k per "
                            "centroid; nearest centroid in decoders), O(L^1.5 d)"))
register(OpSpec("combiner_routed", combiner_routed_op,
                params=lambda length: {"num_clusters": sqrt_pow2(length)},
                module="models.routing_attention:RoutedCombinerAttention",
                plan={"num_clusters": POSITIVE, "pooling": TEXT},
                fused=FusedPath.declare(contract.IMPLEMENTATIONS),
                description="Combiner-learnable: full attention over k-means routed chunks, O(L^1.5 d)"))
