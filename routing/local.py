"""Block-local attention: the Routing Transformer's local heads (Roy et al., section 5).

Positions are cut into blocks of `block_size`; a query attends to its own block and the previous one (and, in
bidirectional mode, the next one), causally masked when `causal`. O(length * block_size * d). Lengths that are not
a multiple of the block are padded with masked keys internally and sliced back.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from core import contract
from core.combine import attend

Array = Any


def _neighbours(x: Array, offsets: tuple[int, ...], fill: Any) -> Array:
  """x [batch, blocks, size, ...] -> [batch, blocks, len(offsets) * size, ...]: block n+o for each offset o."""
  blocks = x.shape[1]
  parts = []
  for o in offsets:
    pad = [(0, 0)] * x.ndim
    if o < 0:
      pad[1] = (-o, 0)
      parts.append(jnp.pad(x, pad, constant_values=fill)[:, :blocks])
    elif o > 0:
      pad[1] = (0, o)
      parts.append(jnp.pad(x, pad, constant_values=fill)[:, o:])
    else:
      parts.append(x)
  return jnp.concatenate(parts, axis=2)


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
  blocks = -(-length // size)
  padded = blocks * size

  def to_blocks(x: Array) -> Array:
    x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(batch, blocks, size, *x.shape[2:])

  offsets = (-1, 0) if causal else (-1, 0, 1)
  qb = to_blocks(q.astype(ct))  # [batch, blocks, size, heads, head_dim]
  kb = _neighbours(to_blocks(k.astype(ct)), offsets, 0)  # [batch, blocks, keys, heads, head_dim]
  vb = _neighbours(to_blocks(v.astype(ct)), offsets, 0)  # [batch, blocks, keys, heads, value_dim]
  pos = to_blocks(jnp.broadcast_to(jnp.arange(length), (batch, length)))  # [batch, blocks, size]
  real = to_blocks(mask)  # padding beyond `length` is False
  kpos = _neighbours(pos, offsets, -1)  # [batch, blocks, keys]
  kreal = _neighbours(real, offsets, False)  # blocks before the first / after the last are not keys
  valid = kreal[:, :, None, :]  # [batch, blocks, 1, keys]
  if causal:
    valid = valid & (kpos[:, :, None, :] <= pos[:, :, :, None])
  logits = jnp.einsum("bnqhd,bnkhd->bnhqk", qb, kb) * contract.logit_scale(head_dim)
  out = attend(logits, valid[:, :, None], vb, "bnhqk,bnkhd->bnhqd")  # [batch, blocks, heads, size, value_dim]
  return out.transpose(0, 1, 3, 2, 4).reshape(batch, padded, heads, -1)[:, :length].astype(v.dtype)
