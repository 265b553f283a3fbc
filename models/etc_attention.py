"""ETC attention module: projections + `attention_baselines.etc.etc` with learned relative position biases
and global tokens derived from segment summaries.

Name `etc` (encoders: bidirectional only). The model carries one stream of L tokens, so the global input is
built at every layer: global token t is the masked mean of its segment's layer inputs (ETC's one summary
token per sentence, here per `segment_length` tokens), and its keys and values come from projections of
their own (ETC's separate W^K, W^V for the global input). The long tokens attend to them (l2g) next to their
local window (l2l). The global tokens' own outputs (g2g, g2l) would feed a global stream in the next layer,
which this model does not have, so the module does not compute them; the op does on request
(`return_global=True`).

The module owns per layer
  global_key, global_value   [features] -> [heads, head_dim] projections of the segment means;
  rel_bias                   [heads, 2 * max_distance + 3] relative position biases, initialised at zero.
`max_distance` (plan parameter) is fixed at construction. Config fields besides `name`, `params`,
`dropout_rate`: `recompute`.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from flax import nnx

from attention_baselines.etc import segment_means
from attention_core import registry as ops_registry
from attention_core import sharding
from models import attention, layers

Array = Any


class ETCAttention(attention.OpAttention):
  """Projections + ETC attention: global keys and values from segment means, learned relative biases."""

  FIELDS = {"recompute": attention.RECOMPUTE}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    plan = attention.resolve_plan_params(ops_registry.get(self.op_name), self.plan_params, 1)
    max_distance = plan["max_distance"]
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
      raise ValueError(f"attention 'etc': params.max_distance must be a non-negative int, "
                       f"got {max_distance!r}")
    self.plan_params["max_distance"] = max_distance
    proj = dict(in_axes=("embed",), out_axes=("heads", "kv"), dtype=dtype, rngs=rngs)
    self.global_key = layers.DenseGeneral((features,), (num_heads, head_dim), **proj)
    self.global_value = layers.DenseGeneral((features,), (num_heads, head_dim), **proj)
    self.rel_bias = layers.param(rngs, nnx.initializers.zeros, (num_heads, 2 * max_distance + 3),
                                 ("heads", None))

  def op_kinds(self) -> dict[str, str]:
    return {"rel_bias": sharding.HEADS, "global_k": sharding.QKV, "global_v": sharding.QKV}

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    summary = segment_means(x, mask, int(params["segment_length"]))  # [batch, g, features]
    return {"rel_bias": self.rel_bias[...],  # [heads, 2k + 3]
            "global_k": self.global_key(summary), "global_v": self.global_value(summary)}  # [b, g, h, d]
