"""BigBird attention, ITC form (Zaheer et al., 2020): window, global and random blocks.

Positions are cut into blocks of `block_size`. A query block attends to
  * window blocks: itself and its neighbours (causal: itself, causally masked, and the previous block),
  * global blocks (`global_blocks`, block indices, negative = from the end; default the first and the last),
  * `num_random_blocks` other blocks drawn once per `seed` (a fixed pattern per layer: the model passes the
    layer index; causal: only blocks before its own).
A global block's queries attend to every key (causal: every key up to themselves). The pattern is static
(numpy): window blocks come from pads and slices, global blocks are shared by all query blocks and random
blocks are one gather, three pieces of one softmax: O(L * (3 + globals + random) * block_size * d), never an
[L, L] array. The global rows are computed densely and written over.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_baselines.common import (
  block_mask,
  map_row_blocks,
  map_row_chunks,
  neighbour_blocks,
  select_real,
)
from attention_baselines.longformer import dense_rows, global_indices
from attention_core import contract
from attention_core.blocks import num_blocks, to_grid
from attention_core.combine import Piece, flag_nonfinite, flagged_sum, joint_softmax

Array = Any


def block_pattern(num: int, *, causal: bool, global_blocks: Any, num_random_blocks: int,
                  seed: int, op: str = "bigbird") -> tuple[np.ndarray, np.ndarray]:
  """The ITC block pattern: (allowed [num, num] bool, query block -> key block; is_global [num] bool).

  Global query blocks get full rows (causal: blocks up to their own); random blocks are drawn per query block
  without replacement from the blocks neither in its window nor global (causal: before its own)."""
  glob = global_indices(global_blocks, num, op=op, name="global_blocks")
  is_global = np.zeros(num, bool)
  is_global[glob] = True
  rng = np.random.default_rng(seed)
  allowed = np.zeros((num, num), bool)
  for a in range(num):
    if is_global[a]:
      allowed[a, :a + 1 if causal else num] = True
      continue
    allowed[a, max(a - 1, 0):a + 1 if causal else a + 2] = True
    allowed[a, glob[glob <= a] if causal else glob] = True
    candidates = np.flatnonzero(~allowed[a, :a] if causal else ~allowed[a])
    take = min(num_random_blocks, candidates.size)
    if take:
      allowed[a, rng.choice(candidates, size=take, replace=False)] = True
  return allowed, is_global


@contract.partitioned_op()
def bigbird(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, block_size: int = 64,
            global_blocks: Any = (0, -1), num_random_blocks: int = 3, seed: int = 0,
            row_chunks: int | None = None) -> Array:
  """Block-sparse ITC attention.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`attention_baselines.common.num_row_chunks`; None = automatic).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "bigbird"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  if isinstance(num_random_blocks, bool) or not isinstance(num_random_blocks, (int, np.integer)) \
     or num_random_blocks < 0:
    raise ValueError(f"{op}: argument 'num_random_blocks' must be a non-negative int, "
                     f"got {num_random_blocks!r}")
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"{op}: argument 'seed' must be an int, got {seed!r}")
  batch, length, heads, head_dim = q.shape
  size = min(size, length)
  n = num_blocks(length, size)
  allowed, is_global = block_pattern(n, causal=causal, global_blocks=global_blocks,
                                     num_random_blocks=int(num_random_blocks), seed=int(seed), op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)
  rows = batch * heads

  # Non-global query blocks: three pieces of one softmax over disjoint key sets. Window blocks by pads and
  # slices, global blocks shared by every query block, random blocks by one gather of `num_random_blocks`.
  # The pattern is static: numpy, computed once for all rows.
  offsets = (-1, 0) if causal else (-1, 0, 1)
  blocks = np.arange(n)
  pos = np.arange(n * size).reshape(n, size)  # [n, size]
  glob = np.flatnonzero(is_global)
  wblock = np.stack([blocks + o for o in offsets], axis=1)  # [n, window blocks]
  wstatic = (wblock >= 0) & (wblock < n) & ~is_global[np.clip(wblock, 0, n - 1)]
  wpos = (wblock[:, :, None] * size + np.arange(size)).reshape(n, -1)  # [n, window keys]
  window = np.zeros((n, n), bool)
  for o in offsets:
    inside = (blocks + o >= 0) & (blocks + o < n)
    window[blocks[inside], blocks[inside] + o] = True
  # Causally, a global key block is seen only by the query blocks after it (the global query blocks' rows are
  # dense): the blocks no non-global query block follows (the last block) stay out of the shared piece.
  gkeys = glob[[bool(np.any(~is_global[g + 1:])) for g in glob]] if causal else glob
  gstatic = np.broadcast_to(gkeys[None, :] <= blocks[:, None] if causal else True, (n, gkeys.size))
  rand = allowed & ~window & ~is_global[None, :] & ~is_global[:, None]  # [n, n]
  slots = int(rand.sum(axis=1).max())
  index = np.zeros((n, slots), np.int64)  # [n, slots]: each query block's random key blocks
  used = np.zeros((n, slots), bool)
  for a in range(n):
    chosen = np.flatnonzero(rand[a])
    index[a, :chosen.size], used[a, :chosen.size] = chosen, True

  def attention(block: tuple[Array, ...], mask: Array, ids: Array) -> Array:
    """A block of rows: q, k, v [rows, length, dim] -> [rows, length, value_dim]."""
    qh, kh, vh = block
    rows = qh.shape[0]
    mask = block_mask(mask, ids, heads)  # [rows, length]
    kh, vh = select_real(mask, kh, vh)
    grid_mask = to_grid(mask, n, size, axis=1)  # [rows, n, size]; padding is False
    qb = to_grid(qh, n, size, axis=1)  # [rows, n, size, head_dim]
    qh_grid = qb.reshape(rows, n * size, head_dim)  # padded to whole blocks
    kb = to_grid(kh, n, size, axis=1)  # [rows, n, size, head_dim]
    # Values flagged once, before the window, global and random pieces copy them.
    vb = to_grid(flag_nonfinite(vh), n, size, axis=1)  # [rows, n, size, value_dim + 1]

    def piece(keys: Array, values: Array, key_valid: Array, kpos: np.ndarray, static: np.ndarray) -> Piece:
      """keys [rows, n, K, d] (or [rows, K, d], shared), values likewise with `flag_nonfinite`'s extra
      column; key_valid [rows, n | 1, K]; kpos, static: [n, K] key positions and pattern validity."""
      if keys.ndim == 3:  # shared keys: one plain matmul over all queries (faster on CPU than a 4-d einsum)
        logits = jnp.einsum("gld,gkd->glk", qh_grid, keys).reshape(rows, n, size, -1) * scale
      else:
        logits = jnp.einsum("gnqd,gnkd->gnqk", qb, keys) * scale  # [rows, n, size, K]
      near = static[:, None, :]  # [n, 1, K]
      if causal:
        near = near & (kpos[:, None, :] <= pos[:, :, None])  # [n, size, K]
      valid = key_valid[:, :, None, :] & near  # [rows, n, size | 1, K]
      if keys.ndim == 3:
        def apply_shared(w: Array) -> Array:
          out = flagged_sum("glk,gkd->gld", w.reshape(rows, n * size, -1), values)
          return out.reshape(rows, n, size, -1)

        return Piece(logits, valid, apply_shared)
      return Piece(logits, valid, lambda w: flagged_sum("gnqk,gnkd->gnqd", w, values))

    pieces = [piece(neighbour_blocks(kb, offsets, axis=1), neighbour_blocks(vb, offsets, axis=1),
                    neighbour_blocks(grid_mask, offsets, axis=1, fill=False), wpos,
                    np.repeat(wstatic, size, axis=1))]
    if gkeys.size:
      pieces.append(piece(kb[:, gkeys].reshape(rows, gkeys.size * size, head_dim),
                          vb[:, gkeys].reshape(rows, gkeys.size * size, -1),
                          grid_mask[:, gkeys].reshape(rows, 1, gkeys.size * size),
                          np.broadcast_to(pos[gkeys].reshape(1, -1), (n, gkeys.size * size)),
                          np.repeat(gstatic, size, axis=1)))
    if slots:
      def gather(x: Array) -> Array:  # [rows, n, size, dim] -> [rows, n, slots * size, dim]
        return x[:, index].reshape(rows, n, slots * size, x.shape[-1])

      pieces.append(piece(gather(kb), gather(vb), grid_mask[:, index].reshape(rows, n, slots * size),
                          pos[index].reshape(n, -1), np.repeat(used, size, axis=1)))
    out = joint_softmax(pieces)  # [rows, n, size, value_dim]
    if glob.size:  # global query blocks: dense rows, written over whole blocks
      gpos = pos[glob].reshape(-1)  # [G * size]
      full = dense_rows(qb[:, glob].reshape(rows, gpos.size, head_dim), kh, vh, gpos, mask, causal, scale)
      out = out.at[:, glob].set(full.reshape(rows, glob.size, size, -1))  # [rows, G, size, value_dim]
    return out.reshape(rows, n * size, -1)[:, :length]

  def run(chunks: int) -> Array:
    return map_row_blocks(attention, (q, k, v), mask, chunks, dtype=ct, out_dtype=v.dtype)

  return map_row_chunks(run, rows, length, row_chunks, op=op)
