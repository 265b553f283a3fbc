"""Block-local attention, the Long Range Arena "Local Attention" baseline (Tay et al., 2021).

Positions are cut into non-overlapping blocks of `block_size`; each query attends only within its own block
(causal: its block up to itself). O(L * block_size * d). A ragged last block is padded with masked keys.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from baselines.common import from_rows, masked_rows, rows_mask, to_rows
from core import contract
from core.blocks import num_blocks, to_grid
from core.combine import attend

Array = Any


def local(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
          block_size: int = 128) -> Array:
  """Softmax attention inside each block of `block_size` positions.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "local"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  batch, length, heads, head_dim = q.shape
  size = min(size, length)
  n = num_blocks(length, size)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  qb = to_grid(to_rows(q, ct), n, size, axis=1)  # [batch * heads, n, size, head_dim]
  kb, vb = (to_grid(masked_rows(x, mask, ct), n, size, axis=1) for x in (k, v))  # [b * h, n, size, dim]
  valid = to_grid(rows_mask(mask, heads), n, size, axis=1)[:, :, None, :]  # [b * h, n, 1, size]; pads False
  if causal:
    valid = valid & jnp.tril(jnp.ones((size, size), bool))
  logits = jnp.einsum("gnqd,gnkd->gnqk", qb, kb) * contract.logit_scale(head_dim)  # [b * h, n, size, size]
  out = attend(logits, valid, vb, "gnqk,gnkd->gnqd")  # [batch * heads, n, size, value_dim]
  return from_rows(out.reshape(batch * heads, n * size, -1)[:, :length], batch, v.dtype)
