"""BlockBERT attention module: projections + `attention_baselines.blockbert.blockbert` with per-head block
permutations.

Name `blockbert` (encoders: bidirectional only). Config fields besides `name`, `params`, `dropout_rate`:
  shifts     one shift per head, head h attending from block a to block (a + shifts[h]) mod num_blocks;
             None or "auto" = the paper's mix (`attention_baselines.blockbert.default_shifts`: about one
             head in six shifted, the rest block-diagonal);
  recompute  recompute the op in the backward pass.
The shifts reach the op as an int array over heads, so a mesh that splits the heads gives each device its
heads' shifts.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_baselines.blockbert import default_shifts
from attention_core import sharding
from models import attention

Array = Any


class BlockBERTAttention(attention.OpAttention):
  """OpAttention whose per-head block shifts come from the `shifts` field (default: the paper's mix)."""

  FIELDS = {
    "shifts": attention.Field(
      tuple, "one block shift per head: head h attends from block a to block (a + shifts[h]) mod "
      "params.num_blocks (None = the paper's mix, about one head in six shifted, the rest block-diagonal)"),
    "recompute": attention.RECOMPUTE,
  }

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    shifts = config.get("shifts", None)
    if shifts is None or attention.is_auto(shifts):
      self.shifts = None
    else:
      shifts = tuple(shifts)
      if len(shifts) != num_heads or any(isinstance(s, bool) or not isinstance(s, int) for s in shifts):
        raise ValueError(f"attention 'blockbert': shifts must be {num_heads} ints (one per head), "
                         f"got {shifts!r}")
      self.shifts = shifts

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    shifts = self.shifts
    if shifts is None:
      shifts = default_shifts(self.num_heads, min(int(params["num_blocks"]), q.shape[1]))
    return {"shifts": jnp.asarray(shifts, jnp.int32)}  # [heads]

  def op_kinds(self) -> dict[str, str]:
    return {"shifts": sharding.HEADS}
