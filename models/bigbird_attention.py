"""BigBird attention module: projections + `attention_baselines.bigbird.bigbird` with a random pattern fixed
   per layer.

Name `bigbird`. The op draws its random blocks from `params.seed` (a static numpy pattern); this module adds
the layer index to it, so every layer has its own fixed pattern, as in the paper's implementation.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from flax import nnx

from models import attention

AUTO = attention.AUTO


class BigBirdAttention(attention.OpAttention):
  """OpAttention whose random-block seed is `params.seed` (default 0) plus the layer index."""

  CONTEXT = ("layer",)

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs, layer: int | None = None):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    seed = self.plan_params.get("seed", 0)  # an int (its declared kind) or "auto"
    seed = 0 if seed == AUTO else seed
    self.plan_params["seed"] = seed + (layer or 0)
