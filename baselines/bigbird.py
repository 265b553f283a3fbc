"""BigBird attention, ITC form (Zaheer et al., 2020): window, global and random blocks.

Positions are cut into blocks of `block_size`. A query block attends to
  * window blocks: itself and its neighbours (causal: itself, causally masked, and the previous block),
  * global blocks (`global_blocks`, block indices, negative = from the end; default the first and the last),
  * `num_random_blocks` other blocks drawn once per `seed` (a fixed pattern per layer: the model passes the
    layer index; causal: only blocks before its own).
A global block's queries attend to every key (causal: every key up to themselves). The pattern is static
(numpy), so the key blocks of each query block are one gather: O(L * (3 + globals + random) * block_size * d),
never an [L, L] array; the global rows are computed densely and written over.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from baselines.longformer import dense_rows, global_indices
from core import contract
from core.blocks import head_major, num_blocks, to_grid
from core.combine import attend

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


def bigbird(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, block_size: int = 64,
            global_blocks: Any = (0, -1), num_random_blocks: int = 3, seed: int = 0) -> Array:
  """Block-sparse ITC attention.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
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
  qh, kh, vh = (head_major(x.astype(ct)) for x in (q, k, v))  # [batch, heads, length, dim]

  # Sparse rows: each non-global query block's key blocks as a fixed-width list (unused slots invalid).
  sparse = allowed & ~is_global[:, None]
  slots = max(int(sparse.sum(axis=1).max()), 1)
  index = np.zeros((n, slots), np.int64)
  used = np.zeros((n, slots), bool)
  for a in range(n):
    blocks = np.flatnonzero(sparse[a])
    index[a, :blocks.size], used[a, :blocks.size] = blocks, True
  pos = np.arange(n * size).reshape(n, size)
  kpos = pos[index].reshape(n, slots * size)  # [n, keys]
  near = np.repeat(used, size, axis=1)[:, None, :]  # [n, 1, keys]
  if causal:
    near = near & (kpos[:, None, :] <= pos[:, :, None])  # [n, size, keys]

  def gather(x: Array) -> Array:  # [batch, heads, length, dim] -> [batch, heads, n, keys, dim]
    x = to_grid(x, n, size, axis=2)[:, :, index]  # [batch, heads, n, slots, size, dim]
    return x.reshape(batch, heads, n, slots * size, x.shape[-1])

  kvalid = to_grid(mask, n, size, axis=1)[:, index].reshape(batch, n, slots * size)  # [batch, n, keys]
  valid = kvalid[:, None, :, None, :] & near  # [batch, 1, n, size | 1, keys]
  qb = to_grid(qh, n, size, axis=2)  # [batch, heads, n, size, head_dim]
  logits = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, gather(kh)) * scale  # [batch, heads, n, size, keys]
  out = attend(logits, valid, gather(vh), "bhnqk,bhnkd->bhnqd")  # [batch, heads, n, size, value_dim]
  out = out.reshape(batch, heads, n * size, -1)[:, :, :length]
  rows = pos[is_global].reshape(-1)
  rows = rows[rows < length]
  if rows.size:
    out = out.at[:, :, rows].set(dense_rows(qh, kh, vh, rows, mask, causal, scale))
  return head_major(out).astype(v.dtype)
