"""NSA attention module: projections + `attention_baselines.nsa.nsa` with its learned compression and gates.

Name `nsa` (decoders only). The module owns, per layer and per head:
  cmp_key_pos, cmp_value_pos   intra-block position encodings [heads, l, head_dim], added to the keys / values
                               of each compressed block before its MLP (initialised at zero);
  cmp_key_w1, _b1, _w2 (and cmp_value_*)   the compression MLPs relu(flatten(block + pos) @ w1 + b1) @ w2,
                               hidden size head_dim (lecun-normal kernels, zero biases);
  gate                         a dense layer from the features to heads x 3 whose sigmoid gates the
                               compression, selection and window branches (zero bias: gates start at 1/2).
The compressed block length l is fixed at construction (the MLP's input is l * head_dim), from `params.
compress_block` or, for "auto", the op's choice for the model's sequence length `seq_len`; the other plan
parameters are fixed with it at the same length (the stride must divide l and the selection block). The
paper's defaults (l = 32, stride 16, selection blocks of 64, top-16, window 512) are the op's automatic
parameters from L = 4096 on (`attention_baselines.nsa.auto_params`). Selection is per head: the model has no
grouped keys (GQA) to share it over.

Config fields besides `name`, `params`, `dropout_rate`: `seq_len` (filled in by `models.registry.build`) and
`recompute`.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
from flax import nnx

from attention_baselines.nsa import BRANCHES, MLP_PARTS
from attention_core import registry as ops_registry
from attention_core import sharding
from models import attention, layers

Array = Any
PLAN = ("compress_block", "compress_stride", "select_block", "num_selected", "window")


class NSAAttention(attention.OpAttention):
  """Projections + NSA with module-owned compression MLPs, intra-block position encodings and gates."""

  FIELDS = {"seq_len": attention.SEQ_LEN, "recompute": attention.RECOMPUTE}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    seq_len = self.seq_len(config, "shape the compression MLPs")
    spec = ops_registry.get(self.op_name)
    plan = attention.resolve_plan_params(spec, self.plan_params, seq_len)
    self.plan_params.update({key: int(plan[key]) for key in PLAN})
    size = self.plan_params["compress_block"]
    hidden = head_dim
    for side in ("key", "value"):
      parts = (layers.param(rngs, layers.zeros_init, (num_heads, size, head_dim), ("heads", None, "kv")),
               layers.param(rngs, attention.per_head_init, (num_heads, size * head_dim, hidden),
                            ("heads", None, None)),
               layers.param(rngs, layers.zeros_init, (num_heads, hidden), ("heads", None)),
               layers.param(rngs, attention.per_head_init, (num_heads, hidden, head_dim),
                            ("heads", None, "kv")))
      for part, value in zip(MLP_PARTS, parts, strict=True):
        setattr(self, f"cmp_{side}_{part}", value)
    self.gate = layers.DenseGeneral((features,), (num_heads, BRANCHES), in_axes=("embed",),
                                    out_axes=("heads", None), dtype=dtype, rngs=rngs)

  def weights(self) -> dict[str, Array]:
    return {f"cmp_{side}_{part}": getattr(self, f"cmp_{side}_{part}")[...]
            for side in ("key", "value") for part in MLP_PARTS}

  def op_kinds(self) -> dict[str, str]:
    return {name: sharding.HEADS for name in self.weights()}

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    return {"gates": jax.nn.sigmoid(self.gate(x)), **self.weights()}  # gates: [batch, length, heads, 3]

  # Cached decoding: the decoder (attention_baselines/nsa_decode.py) takes the token's gates and the MLPs at
  # each step, nothing at the prefill.
  def step_kwargs(self, q: Array, k: Array, x: Array, params: dict[str, Any]) -> dict[str, Any]:
    return {"gates": jax.nn.sigmoid(self.gate(x))[:, 0], **self.weights()}  # gates: [batch, heads, 3]

  def prefill_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
    return {}
