"""MoBA, Mixture of Block Attention (Lu et al., Moonshot AI, 2025): each query attends exactly to a few key
blocks chosen by a parameter-free gate, causal or bidirectional.

Positions are cut into blocks of B = `block_size` (docs/design.md section 5, "NSA and MoBA"). Query i
scores block b by s(q_i, kbar_b), kbar_b the mean of the block's real keys (a block without one is never
scored). It keeps its own block b(i) = i // B always and the best `top_k - 1` others (causal: among the blocks
before its own, so no future block is ever chosen; ties go to the lower block), and runs one softmax over the
real keys of the chosen blocks (causal: keys j <= i, so its own block is causal inside). Cost
O(L * top_k * B * d) plus the O(L * L/B * d) gate. implementation="xla" gathers the chosen blocks per query
over chunks of queries (`attention_core.selection`); "pallas" runs the fused kernel of
`attention_baselines.selection_flash` on the same choice (the gate stays in XLA), which reads each query
tile's chosen blocks in place; "auto" takes it on GPU and TPU (per lowering platform) and XLA on CPU.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_baselines import selection_flash
from attention_baselines.common import from_rows
from attention_core import contract
from attention_core.blocks import map_chunks, num_blocks
from attention_core.combine import flag_nonfinite, joint_softmax
from attention_core.registry import sqrt_pow2
from attention_core.selection import choose, chosen_piece, num_query_chunks, pad_length, rows_and_mask

Array = Any
IMPLEMENTATIONS = selection_flash.IMPLEMENTATIONS  # "pallas": attention_baselines.selection_flash


def auto_params(length: int) -> dict[str, int]:
  """The paper's B = 512, top-k = 3 (its 8K-token setting, 81% sparse) from L = 8192 on; shorter sequences
  keep that sparsity with B = L/16 (a power of two, at least sqrt(L))."""
  sixteenth = 1 << (max(1, -(-length // 16)) - 1).bit_length()  # L/16 rounded up to a power of two
  return {"block_size": min(512, max(sqrt_pow2(length), sixteenth)), "top_k": 3}


def _choice(*_: Any, implementation: Any = "auto", **__: Any) -> Any:
  """What `moba` traces per platform (the key of `contract.per_platform_op`)."""
  return selection_flash.per_platform_key(implementation, op="moba")


@contract.per_platform_op(_choice)
def moba(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, block_size: int = 512,
         top_k: int = 3, query_chunks: int | None = None, implementation: str = "auto") -> Array:
  """Mixture of Block Attention (module docstring).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  top_k: blocks per query, its own included. query_chunks: queries run in this many sequential chunks (None =
  automatic, ~64 MB of gathered keys each; with the kernel, chunks of the gate's scores).
  implementation: "xla" | "pallas" | "auto" (module docstring). Returns [batch, length, heads, value_dim] in
  v's dtype.
  """
  op = "moba"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op, keep_none=True)
  causal = contract.check_bool(causal, name="causal", op=op)
  size = contract.check_positive_int(block_size, name="block_size", op=op)
  count = contract.check_positive_int(top_k, name="top_k", op=op)
  contract.check_implementation(implementation, IMPLEMENTATIONS, op=op)
  if selection_flash.choose_implementation(implementation, op=op) == "pallas":
    return _moba_pallas(q, k, v, mask, causal=causal, size=size, count=count, query_chunks=query_chunks)
  batch, length, heads, head_dim = q.shape
  value_dim = v.shape[-1]
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)
  size, nb, padded, count = _blocks(length, size, count)
  qh, kh, vh, real = rows_and_mask(q, k, v, mask, ct)
  rows = qh.shape[0]
  kb = pad_length(kh, padded).reshape(rows, nb, size, head_dim)
  vb = flag_nonfinite(pad_length(vh, padded)).reshape(rows, nb, size, value_dim + 1)
  rb = pad_length(real, padded, False).reshape(rows, nb, size)
  filled = jnp.sum(rb, axis=-1)  # [rows, nb] real keys per block
  kbar = _mean_keys(kb, filled)  # [rows, nb, d]

  def attend_chunk(tree: tuple[Array, Array]) -> Array:
    qc, qpos = tree  # [rows, Q, d] (scaled), [1, Q]
    index, chosen = _gate(qc, qpos, kbar, filled, size=size, causal=causal, count=count)
    return joint_softmax([chosen_piece(qc, kb, vb, rb, index, chosen, qpos, causal, 1.0)])

  n_chunks = query_chunks if query_chunks is not None else num_query_chunks(
      rows, padded, count * size * (head_dim + value_dim + 2) + nb)
  n_chunks = contract.check_positive_int(n_chunks, name="query_chunks", op=op)
  qp = pad_length(qh * scale, padded)
  qpos = jnp.arange(padded, dtype=jnp.int32)[None, :]
  out = map_chunks(attend_chunk, (qp, qpos), n_chunks, axis=1)  # [rows, padded, e]
  return from_rows(out[:, :length], batch, v.dtype)


def _blocks(length: int, size: int, count: int) -> tuple[int, int, int, int]:
  """(block size, blocks, padded length, blocks chosen per query) for a sequence of `length`."""
  size = min(size, length)
  nb = num_blocks(length, size)
  return size, nb, nb * size, min(count, nb)


def _mean_keys(kb: Array, filled: Array) -> Array:
  """kb [rows, nb, size, d] (masked keys zeros), filled [rows, nb] real keys -> each block's mean key."""
  return jnp.sum(kb, axis=2) / jnp.maximum(filled, 1)[..., None].astype(kb.dtype)


def _gate(qc: Array, qpos: Array, kbar: Array, filled: Array, *, size: int, causal: bool, count: int
          ) -> tuple[Array, Array]:
  """MoBA's gate for a chunk of queries: each scores the visible blocks by its dot product with their mean
  key and keeps the top `count`, its own block always (qc [rows, Q, d] scaled, qpos [1, Q], kbar [rows, nb,
  d], filled [rows, nb] real keys per block) -> (index, chosen) [rows, Q, count], as `selection.choose`."""
  blocks = jnp.arange(kbar.shape[1])
  scores = jnp.einsum("gqd,gnd->gqn", qc, kbar)  # [rows, Q, nb]
  own = (qpos // size)[..., None]  # [1, Q, 1]
  visible = (filled > 0)[:, None, :]
  if causal:
    visible = visible & (blocks < own)
  visible = visible | (blocks == own)
  forced = jnp.broadcast_to((blocks == own).astype(jnp.int32), scores.shape)
  return choose(scores, jnp.broadcast_to(visible, scores.shape), forced, count)


def _moba_pallas(q: Array, k: Array, v: Array, mask: Array | None, *, causal: bool, size: int, count: int,
                 query_chunks: int | None) -> Array:
  """`moba` through `attention_baselines.selection_flash`: the same gate and choice in the softmax dtype
  (XLA), then the kernel over each query's chosen blocks, in the inputs' dtype (bfloat16 stays bfloat16)."""
  op = "moba"
  batch, length, heads, head_dim = q.shape
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)
  size, nb, padded, count = _blocks(length, size, count)
  qh, kh, vh, real = rows_and_mask(q, k, v, mask, jnp.result_type(q.dtype, k.dtype, v.dtype))
  rows = qh.shape[0]
  kp, vp, rp = pad_length(kh, padded), pad_length(vh, padded), pad_length(real, padded, False)
  rb = rp.reshape(rows, nb, size)
  filled = jnp.sum(rb, axis=-1)  # [rows, nb] real keys per block
  kbar = _mean_keys(kp.astype(ct).reshape(rows, nb, size, head_dim), filled)  # [rows, nb, d]

  def choose_chunk(tree: tuple[Array, Array]) -> Array:
    qc, qpos = tree  # [rows, Q, d] (scaled), [1, Q]
    index, chosen = _gate(qc, qpos, kbar, filled, size=size, causal=causal, count=count)
    return jnp.where(chosen, index, -1)  # [rows, Q, count]

  n_chunks = query_chunks if query_chunks is not None else num_query_chunks(rows, padded, nb)
  n_chunks = contract.check_positive_int(n_chunks, name="query_chunks", op=op)
  qpos = jnp.arange(length, dtype=jnp.int32)[None, :]
  ids = map_chunks(choose_chunk, (qh.astype(ct) * scale, qpos), n_chunks, axis=1)  # [rows, length, count]
  out = selection_flash.attend(qh, kp, vp, rp, ids, block=size, causal=causal, scale=scale)  # [rows, L, e]
  return from_rows(out, batch, v.dtype)
