"""Combiner-Logsparse (paper §4.2, Appendix B): a dyadic partition of the past (and, bidirectionally, the
future).

For query i and each bit l set in i, the span is the aligned dyadic block [p, p + 2^l) with
p = (i >> (l+1)) << (l+1). At level l the blocks of size 2^l tile the sequence and query i (in block
t = i >> l) uses block t - 1 exactly when t is odd, so every level is a reshape, a pool and a one-block shift:
no gathers, O(L·d) per level and O(L·log L·d) in all. The bidirectional plan runs the same construction on the
reversed sequence for the positions after i.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from combiner import common, fused
from combiner import pooling as pool_ops
from core.blocks import from_grid, num_blocks, shift, to_grid
from core.combine import Piece, attend, joint_softmax, weighted_sum

Array = Any


def num_levels(length: int) -> int:
  # (L-1).bit_length(), not ceil(log2(L)) - 1: the latter loses the top span when L = 2^k + 1.
  return (length - 1).bit_length()


def level_summaries(x: common.Inputs, pooling: str | None,
                    expectation: Any = None) -> list[tuple[Array, Array, Array]]:
  """Per level l, the span each block of size 2^l reads: (k_prev [batch, heads, blocks, head_dim], v_prev
  [batch, heads, blocks, value_dim], ok_prev [batch, 1, blocks]); block t reads block t - 1 when t is odd.

  pooling=None gives the sparse counterpart: the span is represented by its last position (the suffix sums of
  i's binary expansion) instead of pooled abstractions.
  expectation: (q_bar, kb, vb, mb, scale) -> in-span expected values [batch, heads, blocks, value_dim]; None
  is the einsum + masked softmax below (the fused plan passes `combiner.fused.span_expectation`).
  """
  length = x.q.shape[2]
  out = []
  # Level-0 statistics are the tokens themselves; level l+1 pools pairs of level-l blocks, so all pooling
  # costs O(L·d) in total (and its max-gradient touches full-length tensors only once).
  stats_k = pool_ops.Stats(pool_ops.masked(x.pool_k, x.mask[:, None], pooling or "max"), x.mask[:, None])
  stats_q = pool_ops.Stats(pool_ops.masked(x.pool_q, x.mask[:, None], pooling or "max"), x.mask[:, None])
  for level in range(num_levels(length)):
    size = 1 << level
    blocks = num_blocks(length, size)
    kb, vb = (to_grid(t, blocks, size, 2) for t in (x.k, x.v))  # [batch, heads, blocks, size, d]
    mb = to_grid(x.mask, blocks, size, 1)[:, None]  # [batch, 1, blocks, size]
    if pooling is None:
      k_bar, v_tilde, nonempty = kb[:, :, :, -1], vb[:, :, :, -1], mb[:, :, :, -1]
    else:
      if level:
        stats_k, stats_q = (pool_ops.pair_stats(s, blocks, pooling) for s in (stats_k, stats_q))
      # k_bar: [batch, heads, blocks, head_dim]; nonempty: [batch, 1, blocks]
      k_bar, nonempty = pool_ops.finalize(stats_k, pooling)
      q_bar, _ = pool_ops.finalize(stats_q, pooling)
      if expectation is None:
        in_span = jnp.einsum("bhnd,bhnkd->bhnk", q_bar, kb) * x.scale  # [batch, heads, blocks, size]
        v_tilde = attend(in_span, mb, vb, "bhnk,bhnkd->bhnd")  # [batch, heads, blocks, value_dim]
      else:
        v_tilde = expectation(q_bar, kb, vb, mb, x.scale)
    # Query block t reads span block t - 1, and only when t is odd (bit `level` of i is set).
    k_prev = shift(k_bar, 2, False, 0.0)
    v_prev = shift(v_tilde, 2, False, 0.0)
    ok_prev = shift(nonempty, 2, False, False) & (jnp.arange(blocks) % 2 == 1)  # [batch, 1, blocks]
    out.append((k_prev, v_prev, ok_prev))
  return out


def level_pieces(x: common.Inputs, pooling: str | None) -> list[Piece]:
  """One piece per level for the prefix spans of every query, in the frame of `x` (head-major)."""
  length = x.q.shape[2]
  pieces = []
  for level, (k_prev, v_prev, ok_prev) in enumerate(level_summaries(x, pooling)):
    size = 1 << level
    blocks = k_prev.shape[2]
    qb = to_grid(x.q, blocks, size, 2)  # [batch, heads, blocks, size, head_dim]
    # Contractions and outer products stay einsums: XLA:CPU runs broadcast-multiply-reduce forms of them
    # 10-80x slower, above all in the backward pass.
    logits = jnp.einsum("bhnqd,bhnd->bhnq", qb, k_prev) * x.scale  # [batch, heads, blocks, size]
    valid = jnp.broadcast_to(ok_prev[..., None], (*ok_prev.shape, size))  # [batch, 1, blocks, size]
    pieces.append(Piece(from_grid(logits, length, 2)[..., None], from_grid(valid, length, 2)[..., None],
                        _block_apply(v_prev, blocks, size, length)))
  return pieces


def _block_apply(v_prev: Array, blocks: int, size: int, length: int):
  def apply(w: Array) -> Array:  # w: [batch, heads, length, 1] -> [batch, heads, length, value_dim]
    wb = to_grid(w[..., 0], blocks, size, 2)  # [batch, heads, blocks, size]
    return from_grid(weighted_sum("bhnq,bhnd->bhnqd", wb, v_prev), length, 2)
  return apply


def self_piece(x: common.Inputs) -> Piece:
  """D_i = {i}."""
  logits = jnp.einsum("bhld,bhld->bhl", x.q, x.k)[..., None] * x.scale  # [batch, heads, length, 1]
  return Piece(logits, x.mask[:, None, :, None], lambda w: weighted_sum("bhl,bhld->bhld", w[..., 0], x.v))


def flipped(x: common.Inputs) -> common.Inputs:
  def f(t):
    return jnp.flip(t, axis=2)

  return x._replace(q=f(x.q), k=f(x.k), v=f(x.v), mask=jnp.flip(x.mask, axis=1), pool_q=f(x.pool_q),
                    pool_k=f(x.pool_k))


def unflip(p: Piece) -> Piece:
  def f(t):
    return jnp.flip(t, axis=2)

  return Piece(f(p.logits), f(p.valid), lambda w: f(p.apply(f(w))))


def logsparse_pieces(x: common.Inputs, causal: bool, pooling: str | None) -> list[Piece]:
  pieces = [self_piece(x)] + level_pieces(x, pooling)
  if not causal:
    pieces += [unflip(p) for p in level_pieces(flipped(x), pooling)]
  return pieces


@common.per_platform
def logsparse(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, pooling: str = "max",
              pool_q: Array | None = None, pool_k: Array | None = None,
              implementation: str = "auto") -> Array:
  """Combiner-Logsparse. q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim].

  D_i = {i}; spans = the dyadic partition of [0, i) (and of (i, L) when bidirectional). O(L·log L·d).
  implementation: "xla" (einsums), "pallas" (the kernel of `combiner.flash`) or "auto" (pallas on GPU/TPU).
  """
  op = "combiner.logsparse"
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k,
                     materialize=True, implementation=implementation)
  if x.kernel_dtype is not None:
    return fused.logsparse_plan(x, causal, pooling)
  return common.finish(joint_softmax(logsparse_pieces(x, causal, pooling)), x)
