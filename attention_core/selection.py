"""What the block-selecting ops (NSA, MoBA, Combiner-Fixed with selected spans) share: rows layout, key
blocks, per-query block choice and the attention over each query's chosen blocks.

Both ops choose, for every query, a few key blocks by a score and attend exactly to the tokens of those
blocks. The choice differs per query, so the chosen blocks are gathered per query, over chunks of queries
(`attention_core.blocks.map_chunks`: one chunk's gathered keys alive at a time, recomputed in the backward).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_core.blocks import head_major
from attention_core.combine import Piece, unflag

Array = Any
# Gathered key (or value) numbers per chunk of queries: rows x queries x chosen keys x dim, about 2^24 (64 MB
# in float32) by default.
GATHER_BUDGET = 1 << 24


def rows_and_mask(q: Array, k: Array, v: Array, mask: Array | None, dtype: Any
                  ) -> tuple[Array, Array, Array, Array]:
  """q, k, v as rows [batch * heads, length, dim] in `dtype`, the key mask per row [rows, length] (all True
  for None), and masked keys and values selected to zero (NaN or Inf there reaches nothing)."""
  batch, length, heads, _ = q.shape
  real = jnp.ones((batch * heads, length), bool) if mask is None else jnp.repeat(mask, heads, axis=0)
  qh, kh, vh = (head_major(x.astype(dtype)).reshape(batch * heads, length, x.shape[-1]) for x in (q, k, v))
  kh, vh = (jnp.where(real[:, :, None], x, 0.0) for x in (kh, vh))
  return qh, kh, vh, real


def pad_length(x: Array, length: int, fill: Any = 0) -> Array:
  """Pads axis 1 of x up to `length` with `fill`."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, length - x.shape[1])
  return jnp.pad(x, pad, constant_values=fill)


def num_query_chunks(rows: int, length: int, per_query: int, budget: int = GATHER_BUDGET) -> int:
  """How many chunks the queries run in so that rows x chunk x per_query numbers stay within `budget`."""
  size = max(1, budget // max(1, rows * per_query))
  size = 1 << (size.bit_length() - 1)  # a power of two
  return -(-length // min(size, length))


def choose(scores: Array, valid: Array, forced: Array, count: int) -> tuple[Array, Array]:
  """The `count` best blocks per query: forced ones first (by their rank, higher first), then by score.

  scores [..., blocks] (without gradient), valid [..., blocks] (only these may be chosen), forced
  [..., blocks] int rank (0 = not forced). Ties go to the lower block index. Returns (indices [..., count]
  int32, chosen [..., count] bool: False for slots left over when fewer than `count` blocks are valid)."""
  scores = jax.lax.stop_gradient(scores)
  # Above every score of the query (forced blocks' own scores may hold anything, NaN from future keys too).
  top = jnp.max(jnp.where(valid & (forced == 0), jnp.abs(scores), 0.0), axis=-1, keepdims=True) + 1.0
  key = jnp.where(forced > 0, top * (1 + forced.astype(scores.dtype)), scores)
  key = jnp.where(valid, key, -jnp.inf)
  values, index = jax.lax.top_k(key, count)
  return index.astype(jnp.int32), values > -jnp.inf


def gather_blocks(x: Array, index: Array) -> Array:
  """x [rows, blocks, size, dim], index [rows, queries, count] -> [rows, queries, count * size, dim]."""
  rows, queries, count = index.shape
  blocks = x.shape[1]
  # One gather of whole blocks along one axis (contiguous slices), not a batched gather per row.
  flat = (index + (jnp.arange(rows, dtype=index.dtype) * blocks)[:, None, None]).reshape(-1)
  out = jnp.take(x.reshape(rows * blocks, *x.shape[2:]), flat, axis=0, mode="clip")
  return out.reshape(rows, queries, count * x.shape[2], x.shape[3])


def chosen_piece(qc: Array, kb: Array, vb_flagged: Array, real_b: Array, index: Array, chosen: Array,
                 qpos: Array, causal: bool, scale: float) -> Piece:
  """The softmax piece of every query's chosen blocks.

  qc [rows, Q, d] (a chunk of queries at positions qpos [1, Q]); kb [rows, blocks, size, d], vb_flagged
  [rows, blocks, size, e + 1] (`flag_nonfinite`), real_b [rows, blocks, size] key mask; index, chosen
  [rows, Q, count] from `choose`. Keys after the query are invalid when causal."""
  size = kb.shape[2]
  keys = gather_blocks(kb, index)  # [rows, Q, count * size, d]
  values = gather_blocks(vb_flagged, index)  # [rows, Q, count * size, e + 1]
  real = gather_blocks(real_b[..., None], index)[..., 0]  # [rows, Q, count * size]
  kpos = (index[..., None] * size + jnp.arange(size)).reshape(index.shape[0], index.shape[1], -1)
  valid = real & jnp.repeat(chosen, size, axis=-1)
  if causal:
    valid = valid & (kpos <= qpos[..., None])
  logits = jnp.einsum("gqd,gqkd->gqk", qc, keys) * scale
  return Piece(logits, valid, lambda w: unflag(jnp.einsum("gqk,gqke->gqe", w, values)))

