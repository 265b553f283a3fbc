"""Transformer-XL attention module: projections + `attention_baselines.transformer_xl` over [memory; segment]
with the paper's relative positions (Dai et al., 2019).

Name `transformer_xl` (decoders only). Besides W_q, W_k (the paper's W_{k,E}), W_v and W_o of
`AttentionBase`, the module owns per layer
  pos_key   W_{k,R} [features, heads, head_dim], applied to the sinusoids R of distances 0 .. M + L - 1
            (`attention_baselines.transformer_xl.sinusoid`, width `features`): r = R W_{k,R};
  u, v_bias [heads, head_dim], the global content and position biases (zeros at first).
Keys and values are projected from concat([memory, x]) (memory: [batch, M, features] hidden states of
earlier segments, taken as given: the caller stops their gradient), queries from x alone, so query i sits at
absolute position M + i. `memory_mask` [batch, M] marks the valid memory positions (False: a stream that has
just restarted). The plan parameter `clamp_len` (automatic -1: none) gives distances beyond it the embedding
of clamp_len.

Cached decoding runs from position 0 without memory (`attention_baselines.transformer_xl_decode`), each step
passing r for the cache's whole length and the biases. Config fields besides `name`, `params`,
`dropout_rate`: `recompute`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
from flax import nnx

from attention_baselines.transformer_xl import heads_first, sinusoid
from attention_core import sharding
from models import attention, layers

Array = Any


class TransformerXLAttention(attention.OpAttention):
  """Projections + Transformer-XL attention with module-owned W_{k,R}, u and v over [memory; segment]."""

  FIELDS = {"recompute": attention.RECOMPUTE}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    self.pos_key = layers.DenseGeneral((features,), (num_heads, head_dim), in_axes=("embed",),
                                       out_axes=("heads", "kv"), use_bias=False, dtype=dtype, rngs=rngs)
    self.u = layers.param(rngs, layers.zeros_init, (num_heads, head_dim), ("heads", "kv"))
    self.v_bias = layers.param(rngs, layers.zeros_init, (num_heads, head_dim), ("heads", "kv"))

  def relative(self, distances: int) -> Array:
    """r = R W_{k,R} for distances 0 .. distances - 1: [distances, heads, head_dim]."""
    return self.pos_key(sinusoid(distances, self.features))

  def op_fn(self) -> Any:
    return heads_first

  def op_inputs(self, q: Array, k: Array, *, x: Array, mask: Array | None,
                params: dict[str, Any]) -> dict[str, Any]:
    """The op's learned arguments for the M + L keys, heads first (`heads_first`)."""
    return {"r_heads": jnp.swapaxes(self.relative(k.shape[1]), 0, 1), "u": self.u[...],
            "v_bias": self.v_bias[...]}

  def op_kinds(self) -> dict[str, str]:
    return {"r_heads": sharding.HEADS, "u": sharding.HEADS, "v_bias": sharding.HEADS}

  # Cached decoding: the decoder takes r for the cache's length and the biases at every step.
  def decode_step(self, x: Array, cache: attention.LayerCache, position: Array
                  ) -> tuple[Array, attention.LayerCache]:
    decoder, params = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, 1, heads, head_dim]
    o, state = decoder.step(cache.state, q[:, 0], k[:, 0], v[:, 0], position, **params,
                            r=self.relative(cache.max_length), u=self.u[...], v_bias=self.v_bias[...])
    return self.out(o[:, None]), attention.LayerCache(state, cache.max_length)  # [batch, 1, features]

  def prefill_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
    return {}  # the decoder reads r at each step
