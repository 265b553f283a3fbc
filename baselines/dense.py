"""Exact softmax attention under the op contract: the baseline every table row is compared against."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from combiner import contract
from combiner.combine import attend

Array = Any


def dense(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None) -> Array:
  """softmax(q k^T / sqrt(d)) v with an optional causal mask and key mask.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  Returns [batch, length, heads, value_dim] in v's dtype. O(L^2) memory, by definition.
  (Not jax.nn.dot_product_attention: it needs value_dim == head_dim and keeps bf16 softmax in bf16.)
  """
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op="dense")
  causal = contract.check_bool(causal, name="causal", op="dense")
  length = q.shape[1]
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  logits = jnp.einsum("bqhd,bkhd->bqhk", q, k, preferred_element_type=ct) * contract.logit_scale(q.shape[-1])
  valid = mask[:, None, None, :]  # [batch, 1, 1, length_k]
  if causal:
    valid = valid & jnp.tril(jnp.ones((length, length), dtype=bool))[:, None, :]  # [length_q, 1, length_k]
  out = attend(logits, valid, v.astype(ct), "bqhk,bkhd->bqhd")  # [batch, length, heads, value_dim]
  return out.astype(v.dtype)
