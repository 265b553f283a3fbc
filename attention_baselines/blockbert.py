"""BlockBERT blockwise attention (Qiu et al., 2019), bidirectional.

The sequence is cut into `num_blocks` = n blocks; position i lies in block floor(i * n / L) (the paper's
block assignment, so a length that n does not divide gives blocks of floor(L/n) or ceil(L/n) positions).
Head h has a block permutation pi_h(a) = (a + s_h) mod n, a shift s_h: query block a attends to key block
pi_h(a) only, one softmax over that block's real keys. Shift 0 is block-diagonal attention (local
dependencies), other shifts reach a distant block; the paper mixes them across heads. O(L * (L/n) * d).

The blocks sit on a [n, ceil(L/n)] grid (a static gather when n does not divide L; empty slots are masked
keys), and each row's key blocks are one gather by its head's shift, so shifts may be traced arrays (a
module's per-head shifts under a heads-sharded mesh).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_baselines.common import block_mask, map_row_blocks, map_row_chunks, select_real
from attention_core import contract
from attention_core.combine import attend_zeros_hidden

Array = Any


def default_shifts(heads: int, num_blocks: int) -> tuple[int, ...]:
  """The paper's mix: most heads block-diagonal (shift 0), about one head in six shifted (at least one per
  non-zero shift, at least one head left diagonal), the shifted heads cycling through 1..n-1 and placed
  last. 12 heads: 10:2 of (1, 2):(2, 1) for n = 2, 10:1:1 for n = 3, the paper's pre-training optima."""
  if num_blocks <= 1 or heads <= 1:
    return (0,) * heads
  shifted = min(heads - 1, max(num_blocks - 1, round(heads / 6)))
  return (0,) * (heads - shifted) + tuple(1 + i % (num_blocks - 1) for i in range(shifted))


def block_layout(length: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The paper's blocks on a grid: (index [n, size] positions (0 in empty slots), filled [n, size] bool,
  slot [length]: each position's flat grid slot). Block a holds [ceil(a L / n), ceil((a + 1) L / n))."""
  starts = -(-np.arange(num_blocks + 1) * length // num_blocks)  # [n + 1]
  size = int(np.max(np.diff(starts)))
  offsets = np.arange(size)
  index = starts[:-1, None] + offsets  # [n, size]
  filled = index < starts[1:, None]
  block = np.arange(length) * num_blocks // length  # [length]
  slot = block * size + np.arange(length) - starts[block]
  return np.where(filled, index, 0), filled, slot


def check_shifts(shifts: Any, heads: int, num_blocks: int, *, op: str) -> Array:
  """Per-head shifts as an int32 array [heads] in [0, n); None = `default_shifts`. A static sequence is
  checked; a traced array is taken as it is (reduced mod n)."""
  if shifts is None:
    return jnp.asarray(default_shifts(heads, num_blocks), jnp.int32)
  if isinstance(shifts, (list, tuple)) or isinstance(shifts, np.ndarray):
    values = list(np.asarray(shifts).reshape(-1)) if isinstance(shifts, np.ndarray) else list(shifts)
    if len(values) != heads or any(isinstance(s, bool) or not isinstance(s, (int, np.integer))
                                   for s in values):
      raise ValueError(f"{op}: argument 'shifts' must be {heads} ints (one per head), got {shifts!r}")
    return jnp.asarray([int(s) % num_blocks for s in values], jnp.int32)
  shifts = jnp.asarray(shifts)
  if shifts.shape != (heads,) or not jnp.issubdtype(shifts.dtype, jnp.integer):
    raise ValueError(f"{op}: argument 'shifts' must be an int array [heads] = [{heads}], "
                     f"got {shifts.dtype}{list(shifts.shape)}")
  return shifts.astype(jnp.int32) % num_blocks


def blockbert(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, num_blocks: int = 2,
              shifts: Any = None, row_chunks: int | None = None) -> Array:
  """Blockwise attention: query block a of head h attends to key block (a + shifts[h]) mod num_blocks.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  num_blocks: n; a value above the length is cut to the length (every block then one position).
  shifts: [heads] ints (a sequence or an int array); None (default) = `default_shifts(heads, n)`, the
    paper's mix: most heads shift 0 (block-diagonal) and about one head in six shifted (12 heads, n = 2:
    10 heads 0, 2 heads 1). Bidirectional only (causal=False).
  row_chunks: rows of batch x heads run in this many chunks (`attention_baselines.common.num_row_chunks`).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "blockbert"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op, keep_none=True)
  if contract.check_bool(causal, name="causal", op=op):
    raise ValueError(f"{op}: argument 'causal' must be False: BlockBERT is bidirectional only "
                     "(a shifted block reads later positions)")
  n = min(contract.check_positive_int(num_blocks, name="num_blocks", op=op), q.shape[1])
  shift = check_shifts(shifts, q.shape[2], n, op=op)  # [heads], for every head before the heads are split
  return _blockwise(q, k, v, mask=mask, num_blocks=n, shifts=shift, row_chunks=row_chunks)


@contract.partitioned_op(per_head=("shifts",))
def _blockwise(q: Array, k: Array, v: Array, *, mask: Array | None, num_blocks: int, shifts: Array,
               row_chunks: int | None) -> Array:
  """`blockbert` with its arguments checked and its shifts [heads] in [0, num_blocks) made (the defaults
  depend on the number of heads, so they are made for every head, and each device takes its own heads')."""
  op = "blockbert"
  batch, length, heads, head_dim = q.shape
  n, shift = num_blocks, shifts
  index, filled, slot = block_layout(length, n)
  size = index.shape[1]
  regular = length % n == 0  # the grid is a reshape
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)

  def grid(x: Array) -> Array:  # [rows, length, ...] -> [rows, n, size, ...]
    return x.reshape(x.shape[0], n, size, *x.shape[2:]) if regular else x[:, index]

  def attention(rows: tuple[Array, ...], aux: tuple[Array, Array], ids: Array) -> Array:
    """A block of rows: q, k, v [rows, length, dim] -> [rows, length, value_dim]."""
    qh, kh, vh = rows
    mask, shift = aux
    mask = block_mask(mask, ids, heads)  # [rows, length], or None: every key real
    kh, vh = select_real(mask, kh, vh)
    real = jnp.ones((1, length), bool) if mask is None else mask
    qb, kb, vb, mb = grid(qh * scale), grid(kh), grid(vh), grid(real)  # [rows, n, size, ...]
    if not regular:
      mb = mb & filled
      vb = jnp.where(filled[:, :, None], vb, 0.0)  # empty slots hold copies of position 0: zeros instead
    target = (jnp.arange(n)[None, :] + shift[ids % heads][:, None]) % n  # [rows, n]: each block's key block
    kb, vb = (jnp.take_along_axis(x, target[:, :, None, None], axis=1) for x in (kb, vb))
    mb = jnp.take_along_axis(jnp.broadcast_to(mb, (kb.shape[0], n, size)), target[:, :, None], axis=1)
    logits = jnp.einsum("gnqd,gnkd->gnqk", qb, kb)  # [rows, n, size, size]
    # Every zero-weight value is a masked key's or an empty slot's: zeros here.
    out = attend_zeros_hidden(logits, mb[:, :, None, :], vb, "gnqk,gnkd->gnqd")  # [rows, n, size, dv]
    out = out.reshape(out.shape[0], n * size, -1)
    return out if regular else out[:, slot]

  def run(chunks: int) -> Array:
    return map_row_blocks(attention, (q, k, v), (mask, shift), chunks, dtype=ct, out_dtype=v.dtype)

  return map_row_chunks(run, batch * heads, length, row_chunks, op=op)
