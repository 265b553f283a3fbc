"""Adaptive-span attention module: projections + `attention_baselines.adaptive_span` with a learned span
per head and its L1 penalty (Sukhbaatar et al., 2019).

Name `adaptive_span` (decoders and encoders). The module owns per layer
  span_ratio   [heads] the spans as a fraction of `max_span`, z_h = max_span * clamp(span_ratio_h, 0, 1)
               (the paper's parameterisation), initialised at `span_init` (default 0, as the paper's code:
               every head starts at the ramp R and grows where distant keys help).
  positions    [ceil(max_span + R), head_dim] with `relative_positions`: the paper's learned relative position
               embeddings p_x, one per distance a key can be read at, shared by the heads (s_tr = q_t . (k_r +
               p_{t-r}) / sqrt(d); bidirectionally p_{|t-r|}), initialised N(0, 1/head_dim).
The clamp passes a gradient outside [0, 1] only when it points back inside (a projected step, as the paper's
clamp after each update), so a span pushed to 0 by the penalty can grow again.
`relative_positions` defaults to False in the registry's generic use: the other baselines of the tables
carry the model's absolute positions and no per-layer position table, and existing configs and checkpoints
keep their parameters; configs/adaptive_span.py turns it on with `position_embedding="none"`, as the paper.

The loss: `span_loss * mean_h z_h` per layer (the paper's lambda / M * sum_h z_h, lambda ~ 2e-6 per token of
span), sown as a `loss_term` that the train step adds to the loss as it is (docs/design.md section 5).

`max_span` (plan parameter, "auto" = the model's sequence length) and `ramp` are fixed at construction from
`seq_len`, so a span in tokens is the same at every length the module is called with (decoding included).

Segment recurrence (`config.model.mem_len`, as in the paper's Transformer-XL setting): `memory` [batch, M,
features] (the block's normed inputs of earlier segments) and `memory_mask` [batch, M] make keys and values
over concat([memory, x]) and queries from x alone, so query i sits at position M + i and a span reaches back
into the memory, at most max_span + R tokens (a memory longer than that costs nothing: the op drops what no
span reaches; set `params.max_span` above the segment length for spans that cover a longer memory). With a
memory, use `relative_positions` and `position_embedding="none"` (p depends on distances only, so it means
the same in the memory) rather than absolute positions that restart at every segment. Cached decoding runs
from position 0 without memory, as the Transformer-XL module's.
Config fields besides `name`, `params`, `dropout_rate`: `seq_len` (filled in by `models.registry.build`),
`span_init`, `span_loss`, `relative_positions`, `recompute`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_baselines.adaptive_span import window as span_window
from attention_core import registry as ops_registry
from attention_core import sharding
from models import attention, layers

Array = Any
SPAN_LOSS = 2e-6  # the paper's lambda, per token of span


@jax.custom_vjp
def clamp_ratio(x: Array) -> Array:
  """clip(x, 0, 1) whose gradient outside [0, 1] passes only when a descent step moves x back inside."""
  return jnp.clip(x, 0.0, 1.0)


def _clamp_fwd(x: Array) -> tuple[Array, Array]:
  return jnp.clip(x, 0.0, 1.0), x


def _clamp_bwd(x: Array, g: Array) -> tuple[Array]:
  inward = ((x >= 0.0) & (x <= 1.0)) | ((x < 0.0) & (g < 0.0)) | ((x > 1.0) & (g > 0.0))
  return (jnp.where(inward, g, 0.0),)


clamp_ratio.defvjp(_clamp_fwd, _clamp_bwd)


class AdaptiveSpanAttention(attention.OpAttention):
  """Projections + adaptive-span attention with module-owned spans and their L1 penalty."""

  FIELDS = {
    "seq_len": attention.SEQ_LEN,
    "span_init": attention.Field(
      float, "each head's initial span as a fraction of params.max_span (None = 0, the paper's code)",
      minimum=0, maximum=1),
    "span_loss": attention.Field(
      float, "L1 coefficient per token of span added to the loss (None = 2e-6, the paper's)", minimum=0),
    "relative_positions": attention.Field(
      bool, "learned relative position embeddings p_{t-r} added to the keys, one per distance, shared by the "
      "heads (None = False; the paper's, on in configs/adaptive_span.py)"),
    "recompute": attention.RECOMPUTE,
  }

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    seq_len = self.seq_len(config, "fix max_span")
    plan = attention.resolve_plan_params(ops_registry.get(self.op_name), self.plan_params, seq_len)
    self.plan_params.update(max_span=int(plan["max_span"]), ramp=plan["ramp"])
    self.max_span = int(plan["max_span"])
    init = float(self.FIELDS["span_init"].read(config, "span_init", 0.0))
    self.span_loss = float(self.FIELDS["span_loss"].read(config, "span_loss", SPAN_LOSS))
    self.span_ratio = layers.param(rngs, lambda key, shape, dtype: jnp.full(shape, init, dtype),
                                   (num_heads,), ("heads",))
    self.relative_positions = bool(config.get("relative_positions", None) or False)
    if self.relative_positions:
      distances = span_window(self.max_span, float(plan["ramp"]))
      self.positions = layers.param(rngs, jax.nn.initializers.normal(head_dim ** -0.5), (distances, head_dim),
                                    (None, "kv"))

  def spans(self) -> Array:
    """The current spans in tokens: [heads]."""
    return self.max_span * clamp_ratio(self.span_ratio[...].astype(jnp.float32))

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool, memory: Array | None = None,
               memory_mask: Array | None = None) -> Array:
    self.sow(nnx.Intermediate, "loss_term", self.span_loss * jnp.mean(self.spans()))
    return super().__call__(x, mask, deterministic=deterministic, memory=memory, memory_mask=memory_mask)

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    out = {"spans": self.spans()}  # [heads]
    if self.relative_positions:
      p = self.positions[...]  # [distances, head_dim], shared by the heads
      out["positions"] = jnp.broadcast_to(p[None], (self.num_heads, *p.shape))  # [heads, distances, head_dim]
    return out

  def op_kinds(self) -> dict[str, str]:
    return {"spans": sharding.HEADS, "positions": sharding.HEADS}

  def step_kwargs(self, q: Array, k: Array, x: Array, params: dict[str, Any]) -> dict[str, Any]:
    return self.op_inputs(q, k, x=x, mask=None, params=params)  # per head, not per token
