"""Performer attention module: projections + `attention_baselines.performer.performer`, its random features
   as state.

Name `performer` (`config.model.attention.name`). The features W [num_features, head_dim] are module state
(`RandomFeatures`, not a parameter: no gradient, saved in checkpoints). Training calls redraw them from the
"attention" rng stream every `redraw_every` calls (the schedule of the paper's released code and of
performer-pytorch, whose default interval is 1000); evaluation never redraws. `redraw_every = 0` keeps the
first draw for good.

Config fields besides `name`, `params`, `dropout_rate`:
  params.num_features, params.chunk_size   the op's arguments ("auto" = the registry's 256 and 128);
                                           `params.rng` is ignored (the module supplies the features)
  redraw_every                             int >= 0, default 1000
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_baselines.performer import orthogonal_features
from attention_core import registry as ops_registry
from models import attention

Array = Any
DEFAULT_REDRAW_EVERY = 1000


class RandomFeatures(nnx.Variable):
  """FAVOR+ random features [num_features, head_dim]: state, redrawn on a schedule, never trained."""


class RedrawStep(nnx.Variable):
  """Training calls since construction (an int32 scalar): drives the redraw schedule."""


class PerformerAttention(attention.OpAttention):
  """Projections + FAVOR+ attention with module-owned random features."""

  FIELDS = {"redraw_every": attention.Field(int, "redraw the random features every this many training calls "
                                           "(0 = never)", minimum=0),
            "recompute": attention.RECOMPUTE}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    spec = ops_registry.get(self.op_name)
    self.num_features = int(attention.resolve_plan_params(spec, self.plan_params, 1)["num_features"])
    every = config.get("redraw_every", None)
    every = DEFAULT_REDRAW_EVERY if every is None else every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
      raise ValueError(f"attention {self.name!r}: redraw_every must be an int >= 0, got {every!r}")
    self.redraw_every = every
    self.rng = rngs.attention.fork()
    self.random_features = RandomFeatures(orthogonal_features(self.rng(), self.num_features, head_dim))
    self.step = RedrawStep(jnp.zeros((), jnp.int32))

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    return {"features": self.random_features[...]}

  def step_kwargs(self, q: Array, k: Array, x: Array, params: dict[str, Any]) -> dict[str, Any]:
    return {"features": self.random_features[...]}  # the module's, not per token

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool, memory: Array | None = None,
               memory_mask: Array | None = None) -> Array:
    if not deterministic and self.redraw_every:
      step = self.step[...]
      fresh = orthogonal_features(self.rng(), self.num_features, self.head_dim)
      redraw = (step > 0) & (step % self.redraw_every == 0)
      self.random_features[...] = jnp.where(redraw, fresh, self.random_features[...])
      self.step[...] = step + 1
    return super().__call__(x, mask, deterministic=deterministic, memory=memory, memory_mask=memory_mask)
