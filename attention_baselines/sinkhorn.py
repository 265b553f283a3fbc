"""Sparse Sinkhorn attention (Tay et al., ICML 2020) under the op contract: learned block sorting.

The sequence is cut into blocks of `block_size`. A sorting network (a two-layer MLP per head,
relu(s W1 + b1) W2 + b2) maps each block's summary s to logits R[i, j] over the blocks; Sinkhorn balancing
(`sinkhorn_iters` alternating row and column normalisations of R / temperature in log space) turns them into a
doubly-stochastic soft permutation P. The sorted keys and values of block i are sum_j P[i, j] K_j and
sum_j P[i, j] V_j; each query of block i attends, in one softmax, to its own block (local) and to the sorted
block i. Cost O(L * block_size * d + (L / block_size)^2 * block_size * d).

Bidirectional: the summary of a block is the sum of its real keys and P ranges over every block.
Causal (the paper's causal Sinkhorn): a block's summary is its first key (visible to every query of the
block), block i may only be sorted with past blocks j < i (masked sorting), the balancing is causal (row i is
normalised over j < i, and column normalisation of row i only sums rows <= i), so P[i] depends on blocks <= i
only; the own block is causally masked and the first block has no sorted partner.

Masks: masked keys and values are zeroed (by select) before summaries and sorting; the sorted slot t of block
i is visible if any block that P mixes into it has a real key at slot t.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_baselines.synthesizer import check_param
from attention_core import contract
from attention_core.blocks import num_blocks, to_grid
from attention_core.combine import Piece, joint_softmax, weighted_sum

Array = Any


def masked_logsumexp(x: Array, valid: Array, axis: int) -> Array:
  """log sum_{valid} exp(x) along `axis` (keepdims); -inf where nothing is valid, with finite gradients."""
  valid = jnp.broadcast_to(valid, x.shape)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  s = jnp.sum(jnp.exp(jnp.where(valid, x - m, -jnp.inf)), axis=axis, keepdims=True)
  return jnp.where(s > 0, jnp.log(jnp.where(s > 0, s, 1.0)) + m, -jnp.inf)


def sinkhorn_balance(log_r: Array, *, iterations: int, causal: bool) -> Array:
  """log R [..., n, n] (query block i, key block j) -> log of the balanced P (-inf off the allowed set).

  Bidirectional: alternate row and column normalisation over all blocks. Causal: only j < i is allowed; the
  column step divides entry (i, j) by the sum over rows i' <= i, so row i never reads a later row."""
  n = log_r.shape[-1]
  i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
  allowed = (j < i) if causal else jnp.ones((n, n), bool)
  la = jnp.where(allowed, log_r, -jnp.inf)

  def safe_sub(a, lse):
    return jnp.where(allowed, a - jnp.where(jnp.isfinite(lse), lse, 0.0), -jnp.inf)

  for _ in range(iterations):
    la = safe_sub(la, masked_logsumexp(la, allowed, axis=-1))
    if causal:
      # [..., i, i', j]: rows i' <= i of column j
      prefix = allowed[None, :, :] & (jnp.arange(n)[None, :, None] <= jnp.arange(n)[:, None, None])
      stacked = jnp.broadcast_to(la[..., None, :, :], (*la.shape[:-2], n, n, n))
      lse = masked_logsumexp(stacked, prefix, axis=-2)
      la = safe_sub(la, lse[..., 0, :])
    else:
      la = safe_sub(la, masked_logsumexp(la, allowed, axis=-2))
  return la


def sinkhorn(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, block_size: int,
             sort_w1: Array, sort_b1: Array, sort_w2: Array, sort_b2: Array, sinkhorn_iters: int = 8,
             temperature: float = 0.75) -> Array:
  """Sparse Sinkhorn attention. Sorting network: sort_w1 [heads or 1, head_dim, hidden], sort_b1 [.., hidden],
  sort_w2 [heads or 1, hidden, max_blocks], sort_b2 [.., max_blocks], max_blocks >= ceil(L / block_size)."""
  op = "sinkhorn"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  block_size = contract.check_positive_int(block_size, name="block_size", op=op)
  sinkhorn_iters = contract.check_positive_int(sinkhorn_iters, name="sinkhorn_iters", op=op)
  if not float(temperature) > 0:
    raise ValueError(f"{op}: argument 'temperature' must be > 0, got {temperature!r}")
  batch, length, heads, head_dim = q.shape
  block_size = min(block_size, length)
  n = num_blocks(length, block_size)
  hh = ("heads", heads)
  w1 = check_param(sort_w1, name="sort_w1", shape=(hh, head_dim, None), op=op)
  b1 = check_param(sort_b1, name="sort_b1", shape=(hh, w1.shape[-1]), op=op)
  w2 = check_param(sort_w2, name="sort_w2", shape=(hh, w1.shape[-1], (">=", n)), op=op)
  b2 = check_param(sort_b2, name="sort_b2", shape=(hh, w2.shape[-1]), op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)

  keep = mask[:, :, None, None]  # [batch, L, 1, 1]

  def grid(x):  # [batch, L, heads, dim] -> [batch, heads, n, block, dim]
    return to_grid(jnp.swapaxes(x, 1, 2), n, block_size, axis=2)

  qb = grid(q.astype(ct))
  kb = grid(jnp.where(keep, k.astype(ct), 0.0))
  vb = grid(jnp.where(keep, v.astype(ct), 0.0))
  valid = to_grid(mask, n, block_size, axis=1)  # [batch, n, block]
  pos = to_grid(jnp.arange(length), n, block_size, axis=0)  # [n, block]

  summary = kb[:, :, :, 0] if causal else jnp.sum(kb, axis=3)  # [batch, heads, n, head_dim]
  w1, b1 = (jnp.broadcast_to(x, (heads, *x.shape[1:])).astype(ct) for x in (w1, b1))
  w2, b2 = (jnp.broadcast_to(x[..., :n], (heads, *x.shape[1:-1], n)).astype(ct) for x in (w2, b2))
  hidden = jax.nn.relu(jnp.einsum("bhnd,hde->bhne", summary, w1) + b1[:, None])  # [batch, heads, n, hidden]
  log_r = jnp.einsum("bhne,hem->bhnm", hidden, w2) + b2[:, None]  # [batch, heads, n, n]
  log_p = sinkhorn_balance(log_r / temperature, iterations=sinkhorn_iters, causal=causal)
  p = jnp.exp(log_p)  # [batch, heads, n, n], exactly 0 off the allowed set

  sk = weighted_sum("bhij,bhjcd->bhicd", p, kb)  # sorted keys [batch, heads, n, block, head_dim]
  sv = weighted_sum("bhij,bhjcd->bhicd", p, vb)  # sorted values [batch, heads, n, block, value_dim]
  idx = jnp.arange(n)
  allowed = (idx[None, :] < idx[:, None]) if causal else jnp.ones((n, n), bool)  # [n (i), n (j)]
  sorted_valid = jnp.any(allowed[None, :, :, None] & valid[:, None, :, :], axis=2)  # [batch, n, block]

  scale = contract.logit_scale(head_dim)
  own_logits = jnp.einsum("bhncd,bhnkd->bhnck", qb, kb) * scale  # [batch, heads, n, block, block]
  own_valid = valid[:, None, :, None, :]  # [batch, 1, n, 1, block]
  if causal:
    own_valid = own_valid & (pos[:, None, :] <= pos[:, :, None])
  sorted_logits = jnp.einsum("bhncd,bhnkd->bhnck", qb, sk) * scale
  sorted_valid = sorted_valid[:, None, :, None, :]  # [batch, 1, n, 1, block]
  out = joint_softmax([
      Piece(own_logits, own_valid, lambda w: weighted_sum("bhnck,bhnkd->bhncd", w, vb)),
      Piece(sorted_logits, sorted_valid, lambda w: weighted_sum("bhnck,bhnkd->bhncd", w, sv)),
  ])  # [batch, heads, n, block, value_dim]
  out = out.reshape(batch, heads, n * block_size, -1)[:, :, :length]
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)
