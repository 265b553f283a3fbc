"""Modules for the baselines that own parameters or randomness: Reformer, Linformer, Sinkhorn, Synthesizer.

Each wraps its pure op from `baselines/` and supplies the op arguments that the registration's
`bench_inputs` fills with fixed stand-ins for the benchmark:
  reformer            `rng`: the LSH rotations come from the "attention" rng stream (fresh every training
                      step, fixed in evaluation), as YOSO's hashes do. Shared QK: the key projection is
                      not used.
  linformer           `proj_k`, `proj_v`: E, F [proj_dim, seq_len] per layer, shared by the heads, initialised
                      N(0, 1/proj_dim) as in the paper. Field `proj_dim` (None =
                      `attention_baselines.linformer.PROJ_DIM`, 256).
  sinkhorn            `sort_w1`, `sort_b1`, `sort_w2`, `sort_b2`: the sorting network per head (hidden size =
                      head_dim, one output per block of the model's length); `params.block_size` is fixed at
                      construction from `seq_len`.
  synthesizer         `w1`, `b1`, `w2`, `b2`: the dense synthesizer's per-head MLP (hidden size = head_dim,
                      one output per position up to `seq_len`).
  synthesizer_random  `logits`: one learned [seq_len, seq_len] logits matrix per head.
`seq_len` (the model's sequence length) is filled in by `models.registry.build`; inputs may be shorter.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_baselines.linformer import PROJ_DIM as LINFORMER_PROJ_DIM
from attention_core import registry as ops_registry
from attention_core import sharding
from models import attention, layers

Array = Any


class _OwnArgumentsAttention(attention.OpAttention):
  """An op whose listed arguments (`OWN`) the module supplies itself instead of the registry's stand-ins."""

  OWN: tuple[str, ...] = ()
  FIELDS: dict[str, attention.Field] = {}
  PER_HEAD = False  # the OWN arrays have a leading heads axis (split with the heads under
                    # attention_core.sharding)

  def own_arguments(self, length: int) -> dict[str, Any]:
    raise NotImplementedError

  def op_kinds(self) -> dict[str, str]:
    return {key: sharding.HEADS for key in self.OWN} if self.PER_HEAD else {}

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    return self.own_arguments(x.shape[1])


class ReformerAttention(_OwnArgumentsAttention):
  OWN = ("rng",)

  def __init__(self, config: ml_collections.ConfigDict, *, rngs: nnx.Rngs, **kwargs: Any):
    super().__init__(config, rngs=rngs, **kwargs)
    self.rng = rngs.attention.fork()

  def own_arguments(self, length: int) -> dict[str, Any]:
    return {"rng": self.rng()}


class LinformerAttention(_OwnArgumentsAttention):
  OWN = ("proj_k", "proj_v")
  FIELDS = {"seq_len": attention.SEQ_LEN,
            "proj_dim": attention.Field(int, "the projected length k of E, F (None = 256)", minimum=1)}

  def __init__(self, config: ml_collections.ConfigDict, *, rngs: nnx.Rngs, **kwargs: Any):
    super().__init__(config, rngs=rngs, **kwargs)
    seq_len = self.seq_len(config)
    proj_dim = config.get("proj_dim", None) or LINFORMER_PROJ_DIM
    if isinstance(proj_dim, bool) or not isinstance(proj_dim, int) or proj_dim < 1:
      raise ValueError(f"attention 'linformer': proj_dim must be a positive int, got {proj_dim!r}")

    def init(key, shape, dt):
      return jax.random.normal(key, shape, dt) / jnp.sqrt(float(shape[0]))

    self.proj_k = layers.param(rngs, init, (proj_dim, seq_len), (None, None))  # E: [proj_dim, seq_len]
    self.proj_v = layers.param(rngs, init, (proj_dim, seq_len), (None, None))  # F: [proj_dim, seq_len]

  def own_arguments(self, length: int) -> dict[str, Any]:
    return {"proj_k": self.proj_k[...], "proj_v": self.proj_v[...]}


def _mlp(rngs: nnx.Rngs, heads: int, d_in: int, hidden: int, d_out: int) -> tuple[nnx.Param, ...]:
  """Per-head two-layer MLP parameters: w1 [heads, d_in, hidden], b1 [heads, hidden],
  w2 [heads, hidden, d_out], b2 [heads, d_out] (lecun-normal kernels, zero biases)."""
  return (layers.param(rngs, attention.per_head_init, (heads, d_in, hidden), ("heads", None, None)),
          layers.param(rngs, layers.zeros_init, (heads, hidden), ("heads", None)),
          layers.param(rngs, attention.per_head_init, (heads, hidden, d_out), ("heads", None, None)),
          layers.param(rngs, layers.zeros_init, (heads, d_out), ("heads", None)))


class SinkhornAttention(_OwnArgumentsAttention):
  OWN = ("sort_w1", "sort_b1", "sort_w2", "sort_b2")
  FIELDS = {"seq_len": attention.SEQ_LEN}
  PER_HEAD = True

  def __init__(self, config: ml_collections.ConfigDict, *, num_heads: int, head_dim: int, rngs: nnx.Rngs,
               **kwargs: Any):
    super().__init__(config, num_heads=num_heads, head_dim=head_dim, rngs=rngs, **kwargs)
    seq_len = self.seq_len(config)
    plan = attention.resolve_plan_params(ops_registry.get(self.op_name), self.plan_params, seq_len)
    self.block_size = int(plan["block_size"])
    self.plan_params["block_size"] = self.block_size
    blocks = -(-seq_len // self.block_size)
    self.sort_w1, self.sort_b1, self.sort_w2, self.sort_b2 = _mlp(rngs, num_heads, head_dim, head_dim, blocks)

  def own_arguments(self, length: int) -> dict[str, Any]:
    return {k: getattr(self, k)[...] for k in self.OWN}


class SynthesizerAttention(_OwnArgumentsAttention):
  OWN = ("w1", "b1", "w2", "b2")
  FIELDS = {"seq_len": attention.SEQ_LEN}
  PER_HEAD = True

  def __init__(self, config: ml_collections.ConfigDict, *, num_heads: int, head_dim: int, rngs: nnx.Rngs,
               **kwargs: Any):
    super().__init__(config, num_heads=num_heads, head_dim=head_dim, rngs=rngs, **kwargs)
    self.w1, self.b1, self.w2, self.b2 = _mlp(rngs, num_heads, head_dim, head_dim, self.seq_len(config))

  def own_arguments(self, length: int) -> dict[str, Any]:
    return {k: getattr(self, k)[...] for k in self.OWN}


class RandomSynthesizerAttention(_OwnArgumentsAttention):
  OWN = ("logits",)
  FIELDS = {"seq_len": attention.SEQ_LEN}
  PER_HEAD = True

  def __init__(self, config: ml_collections.ConfigDict, *, num_heads: int, rngs: nnx.Rngs, **kwargs: Any):
    super().__init__(config, num_heads=num_heads, rngs=rngs, **kwargs)
    seq_len = self.seq_len(config)

    def init(key, shape, dt):
      return jax.random.normal(key, shape, dt) / jnp.sqrt(float(shape[-1]))

    self.logits = layers.param(rngs, init, (num_heads, seq_len, seq_len), ("heads", None, None))

  def own_arguments(self, length: int) -> dict[str, Any]:
    return {"logits": self.logits[...]}

