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

from attention_core import contract
from attention_core.blocks import from_grid, to_grid
from attention_core.combine import Piece, joint_softmax, weighted_sum
from combiner import common, kernel_plans
from combiner.dyadic import flipped, level_summaries

Array = Any


def level_pieces(x: common.Inputs, pooling: str | None) -> list[Piece]:
  """One piece per level for the prefix spans of every query, in the frame of `x` (head-major)."""
  length = x.q.shape[2]
  pieces = []
  for level, (k_prev, v_prev, ok_prev) in enumerate(level_summaries(x, pooling)):
    size = 1 << level
    blocks = k_prev.shape[2]
    qb = to_grid(x.q, blocks, size, 2)  # [batch, heads, blocks, size, head_dim]
    # Contractions and outer products stay einsums: XLA:CPU runs broadcast-multiply-reduce forms of them
    # many times slower, above all in the backward pass (docs/benchmarks_design.md, "Design measurements").
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
  implementation: "xla" (einsums), "pallas" (`combiner.dyadic_kernels`) or "auto" (pallas on GPU/TPU).
  """
  op = "combiner.logsparse"
  if common.uses_kernels(implementation, op=op):
    c = common.check(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k)
    return kernel_plans.logsparse(*c, causal=causal, pooling=pooling, platform=contract.backend())
  x = common.prepare(q, k, v, mask, op=op, causal=causal, pooling=pooling, pool_q=pool_q, pool_k=pool_k,
                     materialize=True)
  return common.finish(joint_softmax(logsparse_pieces(x, causal, pooling)), x)
