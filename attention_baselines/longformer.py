"""Longformer attention (Beltagy et al., 2020): a sliding window plus global tokens.

Query i attends to keys j with |i - j| <= window (causal: i - window <= j <= i) and to every global token;
a global token attends to every key (causal: every key up to itself). Global positions default to the first
token (the classification token); `global_positions` names others (negative values count from the end).

The band is computed on blocks of `window` positions: a query block meets only its own and its two
neighbouring key blocks (causal: own and previous), so the cost is O(L * window * d) and no [L, L] array
exists. Global keys
form a second piece of the same softmax (excluded from the band so none is counted twice); the few global rows
are computed densely and written over the band's rows. (The paper's separate projections for global attention
are a model choice, not part of this op.) On TPU the whole pattern, band and global tokens (at most
`splash.MAX_GLOBALS` of them), is one static Splash mask (`attention_baselines.splash`): the kernel visits the
band's tiles and the global rows and columns only.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_baselines import splash
from attention_baselines.common import (
  block_mask,
  map_row_blocks,
  map_row_chunks,
  neighbour_blocks,
  select_real,
)
from attention_core import contract
from attention_core.blocks import num_blocks, to_grid
from attention_core.combine import Piece, attend, flag_nonfinite, flagged_sum, joint_softmax, weighted_sum

Array = Any


def global_indices(positions: Any, length: int, *, op: str, name: str = "global_positions") -> np.ndarray:
  """Sorted unique positions in [0, length) from ints (negative = from the end); a clear error otherwise."""
  if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool):
    positions = (positions,)
  try:
    items = list(positions)
  except TypeError:
    items = None
  if items is None or any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) for p in items):
    raise ValueError(f"{op}: argument {name!r} must be a sequence of ints, got {positions!r}")
  items = [int(p) for p in items]
  bad = [p for p in items if not -length <= p < length]
  if bad:
    raise ValueError(f"{op}: argument {name!r} has positions {bad} outside [-{length}, {length}) for "
                     f"length {length}")
  return np.unique(np.asarray([p % length for p in items], np.int64))


def dense_rows(q_rows: Array, k: Array, v: Array, rows: np.ndarray, key_valid: Array, causal: bool,
               scale: float) -> Array:
  """Full softmax attention for the queries at positions `rows` only (global queries).

  q_rows: [batch * heads, len(rows), d]; k: [batch * heads, length, d]; v: [batch * heads, length, value_dim];
  key_valid: [batch * heads, length] bool. Returns [batch * heads, len(rows), value_dim]."""
  length = k.shape[1]
  logits = jnp.einsum("gqd,gkd->gqk", q_rows, k) * scale  # [batch * heads, G, length]
  valid = key_valid[:, None, :]  # [batch * heads, 1, length]
  if causal:
    valid = valid & (np.arange(length)[None, :] <= rows[:, None])
  return attend(logits, valid, v, "gqk,gkd->gqd")


IMPLEMENTATIONS = splash.IMPLEMENTATIONS


@contract.per_platform_op(splash.choice)
def longformer(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, window: int = 128,
               global_positions: Any = (0,), row_chunks: int | None = None,
               implementation: str = "auto") -> Array:
  """Sliding-window attention with global tokens.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  window: keys on each side (causal: before) a query sees; global_positions: ints, may be empty.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`attention_baselines.common.num_row_chunks`; None = automatic; the XLA path's).
  implementation: "xla" (einsums over neighbouring blocks), "splash" (Splash attention, TPU only: bfloat16 or
    float32, at most `splash.MAX_GLOBALS` global positions) or "auto": Splash where it applies, chosen per
    lowering platform (`contract.per_platform`).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "longformer"
  masked = mask is not None
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  window = contract.check_positive_int(window, name="window", op=op)
  batch, length, heads, head_dim = q.shape
  glob = global_indices(global_positions, length, op=op)
  pattern = splash.Pattern(causal=causal, window=window, global_positions=tuple(int(g) for g in glob))
  if splash.runs(q, k, v, pattern, implementation, op=op):
    return splash.attention(q, k, v, mask if masked else None, pattern)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)

  size = min(window, length)
  n = num_blocks(length, size)
  is_global = np.zeros(n * size, bool)
  is_global[glob] = True
  offsets = (-1, 0) if causal else (-1, 0, 1)
  pos = np.arange(n * size).reshape(n, size)
  kpos = np.concatenate([pos + o * size for o in offsets], axis=1)  # [n, keys]
  dist = kpos[:, None, :] - pos[:, :, None]  # [n, size, keys]: key - query
  near = (dist <= 0 if causal else dist <= window) & (dist >= -window)

  def attention(block: tuple[Array, ...], mask: Array, ids: Array) -> Array:
    """A block of rows: q, k, v [rows, length, dim] -> [rows, length, value_dim]."""
    qh, kh, vh = block
    rows = qh.shape[0]
    mask = block_mask(mask, ids, heads)  # [rows, length]
    kh, vh = select_real(mask, kh, vh)
    band_keys = mask & ~jnp.asarray(is_global[:length])  # [rows, length]: globals come in their own piece
    qb = to_grid(qh, n, size, axis=1)  # [rows, n, size, head_dim]
    kb = neighbour_blocks(to_grid(kh, n, size, axis=1), offsets, axis=1)  # [rows, n, keys, head_dim]
    # Values flagged once, before the neighbouring blocks copy them three times.
    vb = neighbour_blocks(to_grid(flag_nonfinite(vh), n, size, axis=1), offsets,
                          axis=1)  # [rows, n, keys, dv + 1]
    kvalid = neighbour_blocks(to_grid(band_keys, n, size, axis=1), offsets, axis=1,
                              fill=False)  # [rows, n, keys]
    valid = kvalid[:, :, None, :] & near  # [rows, n, size, keys]
    logits = jnp.einsum("gnqd,gnkd->gnqk", qb, kb) * scale  # [rows, n, size, keys]
    pieces = [Piece(logits, valid, lambda w: flagged_sum("gnqk,gnkd->gnqd", w, vb))]
    if glob.size:
      kg, vg = kh[:, glob], vh[:, glob]  # [rows, G, dim]
      glogits = jnp.einsum("gnqd,gjd->gnqj", qb, kg) * scale  # [rows, n, size, G]
      gvalid = mask[:, glob][:, None, None, :]  # [rows, 1, 1, G]
      if causal:
        gvalid = gvalid & (glob[None, None, :] <= pos[:, :, None])  # [.., n, size, G]
      pieces.append(Piece(glogits, gvalid, lambda w: weighted_sum("gnqj,gjd->gnqd", w, vg)))
    out = joint_softmax(pieces)  # [rows, n, size, value_dim]
    out = out.reshape(rows, n * size, -1)[:, :length]
    if glob.size:
      out = out.at[:, glob].set(dense_rows(qh[:, glob], kh, vh, glob, mask, causal, scale))
    return out

  def run(chunks: int) -> Array:
    return map_row_blocks(attention, (q, k, v), mask, chunks, dtype=ct, out_dtype=v.dtype)

  return map_row_chunks(run, batch * heads, length, row_chunks, op=op)
