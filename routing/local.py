"""Block-local attention: the Routing Transformer's local heads (Roy et al., section 5).

Positions are cut into blocks of `block_size`; a query attends to its own block and the previous one (and, in
bidirectional mode, the next one), causally masked when `causal`. O(length * block_size * d). Lengths that are
not a multiple of the block are padded with masked keys internally and sliced back.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import neighbours, num_blocks, to_grid
from attention_core.combine import attend

Array = Any


def local_attention(q: Array, k: Array, v: Array, *, block_size: int, causal: bool,
                    mask: Array | None = None) -> Array:
  """Own block + previous block (+ next block when bidirectional), softmax attention.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "local_attention"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  batch, length, heads, head_dim = q.shape
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  blocks = num_blocks(length, size)
  padded = blocks * size

  def to_blocks(x: Array) -> Array:  # [batch, length, ...] -> [batch, blocks, size, ...]
    return to_grid(x, blocks, size, axis=1)

  offsets = (-1, 0) if causal else (-1, 0, 1)
  qb = to_blocks(q.astype(ct))  # [batch, blocks, size, heads, head_dim]
  kb = neighbours(to_blocks(k.astype(ct)), offsets, 1)  # [batch, blocks, keys, heads, head_dim]
  vb = neighbours(to_blocks(v.astype(ct)), offsets, 1)  # [batch, blocks, keys, heads, value_dim]
  pos = to_blocks(jnp.broadcast_to(jnp.arange(length), (batch, length)))  # [batch, blocks, size]
  real = to_blocks(mask)  # padding beyond `length` is False
  kpos = neighbours(pos, offsets, 1, -1)  # [batch, blocks, keys]
  kreal = neighbours(real, offsets, 1, False)  # blocks before the first / after the last are not keys
  valid = kreal[:, :, None, :]  # [batch, blocks, 1, keys]
  if causal:
    valid = valid & (kpos[:, :, None, :] <= pos[:, :, :, None])
  logits = jnp.einsum("bnqhd,bnkhd->bnhqk", qb, kb) * contract.logit_scale(head_dim)
  out = attend(logits, valid[:, :, None], vb, "bnhqk,bnkhd->bnhqd")  # [batch, blocks, heads, size, value_dim]
  return out.transpose(0, 1, 3, 2, 4).reshape(batch, padded, heads, -1)[:, :length].astype(v.dtype)
