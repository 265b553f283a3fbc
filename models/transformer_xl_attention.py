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

from attention_baselines.transformer_xl import sinusoid, transformer_xl
from attention_core import registry as ops_registry
from attention_core import sharding
from models import attention, layers, recompute

Array = Any
PLAN = ("clamp_len",)  # the op's plan parameters; r, u and v_bias are the module's


def heads_first(q: Array, k: Array, v: Array, *, r_heads: Array, u: Array, v_bias: Array, causal: bool,
                mask: Array | None = None, clamp_len: int = -1) -> Array:
  """`transformer_xl` with r given heads first, r_heads [heads, distances, head_dim], so that
  `sharding.attend` splits every per-head argument along its leading axis."""
  return transformer_xl(q, k, v, r=jnp.swapaxes(r_heads, 0, 1), u=u, v_bias=v_bias, causal=causal, mask=mask,
                        clamp_len=clamp_len)


def key_mask(mask: Array | None, memory_mask: Array | None, batch: int, length: int, memory: int
             ) -> Array | None:
  """The mask of [memory; segment] keys, [batch, M + L] bool, or None when every key is real."""
  if memory == 0:
    return mask
  if mask is None and memory_mask is None:
    return None
  parts = (jnp.ones((batch, memory), bool) if memory_mask is None else jnp.asarray(memory_mask, bool),
           jnp.ones((batch, length), bool) if mask is None else jnp.asarray(mask, bool))
  return jnp.concatenate(parts, axis=1)  # [batch, M + L]


class TransformerXLAttention(attention.OpAttention):
  """Projections + Transformer-XL attention with module-owned W_{k,R}, u and v over [memory; segment]."""

  FIELDS = {"recompute": attention.RECOMPUTE}

  def __init__(self, config: ml_collections.ConfigDict, *, features: int, num_heads: int, head_dim: int,
               causal: bool, dtype: Any, rngs: nnx.Rngs):
    super().__init__(config, features=features, num_heads=num_heads, head_dim=head_dim, causal=causal,
                     dtype=dtype, rngs=rngs)
    other = sorted(set(self.plan_params) - set(PLAN))
    if other:
      raise ValueError(f"attention {self.op_name!r}: params {other} are not plan parameters (the module owns "
                       f"r, u and v_bias); its plan parameters: {list(PLAN)}")
    self.pos_key = layers.DenseGeneral((features,), (num_heads, head_dim), in_axes=("embed",),
                                       out_axes=("heads", "kv"), use_bias=False, dtype=dtype, rngs=rngs)
    self.u = layers.param(rngs, layers.zeros_init, (num_heads, head_dim), ("heads", "kv"))
    self.v_bias = layers.param(rngs, layers.zeros_init, (num_heads, head_dim), ("heads", "kv"))

  def relative(self, distances: int) -> Array:
    """r = R W_{k,R} for distances 0 .. distances - 1: [distances, heads, head_dim]."""
    return self.pos_key(sinusoid(distances, self.features))

  def weights(self, distances: int) -> dict[str, Array]:
    """The op's learned arguments, heads first (`heads_first`)."""
    return {"r_heads": jnp.swapaxes(self.relative(distances), 0, 1), "u": self.u[...],
            "v_bias": self.v_bias[...]}

  def op_kinds(self) -> dict[str, str]:
    return {"r_heads": sharding.HEADS, "u": sharding.HEADS, "v_bias": sharding.HEADS}

  def __call__(self, x: Array, mask: Array | None, *, deterministic: bool, memory: Array | None = None,
               memory_mask: Array | None = None) -> Array:
    """x: [batch, L, features]; mask: None or [batch, L]; memory: None or [batch, M, features]; memory_mask:
    None or [batch, M] (True = valid). Returns [batch, L, features]."""
    batch, length = x.shape[:2]
    context = x if memory is None else jnp.concatenate([jnp.asarray(memory).astype(x.dtype), x], axis=1)
    total = context.shape[1]  # M + L
    keys = key_mask(mask, memory_mask, batch, length, total - length)  # [batch, M + L] or None
    q = self.query(x)  # [batch, L, heads, head_dim]
    k, v = self.key(context), self.value(context)  # [batch, M + L, heads, head_dim]
    params = attention.resolve_plan_params(ops_registry.get(self.op_name), self.plan_params, length)
    arrays = self.weights(total)
    if self.recompute:
      names = list(arrays)

      def op(q, k, v, keys, *rest):
        return self.call_op(heads_first, q, k, v, keys, **params, **dict(zip(names, rest, strict=True)))

      o = recompute.recompute_in_backward(op, q, k, v, keys, *arrays.values())
    else:
      o = self.call_op(heads_first, q, k, v, keys, **params, **arrays)  # [batch, L, heads, head_dim]
    return self.output(o, deterministic=deterministic)  # [batch, L, features]

  # Cached decoding: the decoder takes r for the cache's length and the biases at every step.
  def decode_step(self, x: Array, cache: attention.LayerCache, position: Array
                  ) -> tuple[Array, attention.LayerCache]:
    decoder, params = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, 1, heads, head_dim]
    o, state = decoder.step(cache.state, q[:, 0], k[:, 0], v[:, 0], position, **params,
                            r=self.relative(cache.max_length), u=self.u[...], v_bias=self.v_bias[...])
    return self.out(o[:, None]), attention.LayerCache(state, cache.max_length)  # [batch, 1, features]

  def prefill(self, x: Array, cache: attention.LayerCache) -> tuple[Array, attention.LayerCache]:
    decoder, params = self._decoding(cache.max_length)
    q, k, v = self.project(x)  # [batch, prompt_length, heads, head_dim]
    o = sharding.attend(heads_first, q, k, v, kinds=self.op_kinds(), causal=True, **params,
                        **self.weights(x.shape[1]))
    state = decoder.prefill(cache.state, q, k, v, **params)
    return self.out(o), attention.LayerCache(state, cache.max_length)  # [batch, prompt_length, features]
