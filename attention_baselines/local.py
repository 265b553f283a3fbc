"""Block-local attention, the Long Range Arena "Local Attention" baseline (Tay et al., 2021).

Positions are cut into non-overlapping blocks of `block_size`; each query attends only within its own block
(causal: its block up to itself). O(L * block_size * d). A ragged last block is padded with masked keys.
On TPU the blocks are a static Splash mask (`attention_baselines.splash`): the kernel visits the diagonal
tiles only.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_baselines import splash
from attention_baselines.common import block_mask, map_row_blocks, map_row_chunks, select_real
from attention_core import contract
from attention_core.blocks import num_blocks, to_grid
from attention_core.combine import attend_zeros_hidden, flag_nonfinite, unflag

Array = Any
IMPLEMENTATIONS = splash.IMPLEMENTATIONS


@contract.per_platform_op(splash.choice)
def local(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
          block_size: int = 128, row_chunks: int | None = None, implementation: str = "auto") -> Array:
  """Softmax attention inside each block of `block_size` positions.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`attention_baselines.common.num_row_chunks`; None = automatic; the XLA path's).
  implementation: "xla" (einsums over the blocks), "splash" (Splash attention, TPU only: bfloat16 or float32)
    or "auto": Splash where it applies, chosen per lowering platform (`contract.per_platform`).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "local"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op, keep_none=True)
  causal = contract.check_bool(causal, name="causal", op=op)
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  batch, length, heads, head_dim = q.shape
  size = min(size, length)
  if splash.runs(q, k, v, splash.Pattern(causal=causal, block=size), implementation, op=op):
    return splash.attention(q, k, v, mask, splash.Pattern(causal=causal, block=size))
  n = num_blocks(length, size)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)

  def attention(rows: tuple[Array, ...], mask: Array, ids: Array) -> Array:
    """A block of rows: q, k, v [rows, length, dim] -> [rows, length, value_dim]."""
    qh, kh, vh = rows
    mask = block_mask(mask, ids, heads)  # [rows, length], or None: every key real
    kh, vh = select_real(mask, kh, vh)
    qb, kb, vb = (to_grid(x, n, size, axis=1) for x in (qh * scale, kh, vh))  # [rows, n, size, dim]
    real = jnp.ones((1, length), bool) if mask is None else mask  # no mask: a constant XLA folds away
    valid = to_grid(real, n, size, axis=1)[:, :, None, :]  # [rows or 1, n, 1, size]; pads False
    if causal:
      valid = valid & jnp.tril(jnp.ones((size, size), bool))
    logits = jnp.einsum("gnqd,gnkd->gnqk", qb, kb)  # [rows, n, size, size]
    if causal:  # a later key's value (zero weight) must not reach earlier outputs even when it is NaN or Inf
      out = unflag(attend_zeros_hidden(logits, valid, flag_nonfinite(vb), "gnqk,gnkd->gnqd"))
    else:  # every zero-weight value is a masked key's or the padding's: zeros here
      out = attend_zeros_hidden(logits, valid, vb, "gnqk,gnkd->gnqd")  # [rows, n, size, value_dim]
    return out.reshape(qh.shape[0], n * size, -1)[:, :length]

  def run(chunks: int) -> Array:
    return map_row_blocks(attention, (q, k, v), mask, chunks, dtype=ct, out_dtype=v.dtype)

  return map_row_chunks(run, batch * heads, length, row_chunks, op=op)
