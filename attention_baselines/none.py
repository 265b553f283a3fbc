"""No attention: the "None" row of the YOSO paper's Long Range Arena table (Zeng et al., 2021, section 4.2).

The op returns zeros, so an attention layer adds only its output projection's bias (none here) to the residual
stream and the model reduces to its feed-forward blocks: the reference that shows what attention buys.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract

Array = Any


def none(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None) -> Array:
  """Zeros of v's shape and dtype: [batch, length, heads, value_dim] (the contract is still checked)."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op="none")
  contract.check_bool(causal, name="causal", op="none")
  return jnp.zeros_like(v)
