"""Combiner-Fixed (paper §4.1): direct attention inside the own block, one pooled span per other block."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from combiner import common, contract
from combiner import pooling as pool_ops
from combiner.combine import Piece, attend, joint_softmax

Array = Any


def block_direct_piece(qb: Array, kb: Array, vb: Array, mb: Array, scale: float, causal: bool) -> Piece:
  """Attention to the own block ∩ Ω_i. qb, kb: [batch, blocks, size, heads, dim]; mb: [batch, blocks, size]."""
  size = qb.shape[2]
  logits = jnp.einsum("bnqhd,bnkhd->bnqhk", qb, kb) * scale  # [batch, blocks, size_q, heads, size_k]
  valid = mb[:, :, None, None, :]
  if causal:
    valid = valid & jnp.tril(jnp.ones((size, size), dtype=bool))[:, None, :]
  return Piece(logits, valid, lambda w: jnp.einsum("bnqhk,bnkhd->bnqhd", w, vb))


def other_block_valid(blocks: int, causal: bool) -> Array:
  """[blocks_q, blocks_r]: which blocks r are spans for queries of block n (before n when causal)."""
  n = jnp.arange(blocks)
  return (n[None, :] < n[:, None]) if causal else (n[None, :] != n[:, None])


def fixed(q: Array, k: Array, v: Array, *, block_size: int, causal: bool, mask: Array | None = None,
          pooling: str = "max", pool_q: Array | None = None, pool_k: Array | None = None) -> Array:
  """Combiner-Fixed. q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim].

  D_i = own block ∩ Ω_i; spans = every other block ∩ Ω_i (causal: the blocks before b(i)). Cost
  O(L·(s + L/s)·d), i.e. O(L·sqrt(L)·d) at s ~ sqrt(L).
  """
  x = common.prepare(q, k, v, mask, op="combiner.fixed", causal=causal, pooling=pooling, pool_q=pool_q,
                     pool_k=pool_k)
  size = contract.check_positive_int(block_size, name="block_size", op="combiner.fixed")
  length = x.q.shape[1]
  blocks = common.num_blocks(length, size)
  qb, kb, vb, pqb, pkb = (common.to_grid(t, blocks, size) for t in (x.q, x.k, x.v, x.pool_q, x.pool_k))
  mb = common.to_grid(x.mask, blocks, size)  # [batch, blocks, size]

  # Span abstractions, one per block, and their in-span expectations (independent of the query).
  k_bar, nonempty = pool_ops.pool(pkb, mb, axis=2, kind=pooling)  # [batch, blocks, heads, head_dim], [batch, blocks]
  q_bar, _ = pool_ops.pool(pqb, mb, axis=2, kind=pooling)
  span_logits = jnp.einsum("brhd,brkhd->brhk", q_bar, kb) * x.scale  # [batch, blocks, heads, size]
  v_tilde = attend(span_logits, mb[:, :, None, :], vb, "brhk,brkhd->brhd")  # [batch, blocks, heads, value_dim]

  direct = block_direct_piece(qb, kb, vb, mb, x.scale, causal)
  logits = jnp.einsum("bnqhd,brhd->bnqhr", qb, k_bar) * x.scale  # [batch, blocks, size, heads, blocks_r]
  valid = other_block_valid(blocks, causal)[None, :, None, None, :] & nonempty[:, None, None, None, :]
  spans = Piece(logits, valid, lambda w: jnp.einsum("bnqhr,brhd->bnqhd", w, v_tilde))
  out = joint_softmax([direct, spans])  # [batch, blocks, size, heads, value_dim]
  return common.from_grid(out, length).astype(x.out_dtype)

