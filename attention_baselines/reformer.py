"""Reformer LSH attention (Kitaev et al., ICLR 2020) under the op contract: shared QK, hashed chunks.

Keys are the unit-normalised queries (shared QK; the op's `k` argument is not read). Each of `n_hashes` rounds
hashes every position with a random rotation R ([head_dim, n_buckets / 2]): bucket = argmax([xR, -xR]), x the
unit query. Positions are sorted by (bucket, position); the sorted sequence is cut into chunks of
`chunk_size`, and each chunk attends to itself and to the chunk before it (the first chunk's predecessor is
the last chunk). A token attends to itself only when nothing else is visible to it (the paper's rule: its own
key dominates q.k otherwise). The rounds' softmaxes are combined by their log-sum-exps, i.e. one softmax over
the multiset union of the rounds' visible keys. Masked keys (padding) go to an extra last bucket and are never
attended to. Cost O(n_hashes * L * chunk_size * d) plus the sorts.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from attention_baselines.common import block_mask, map_row_blocks, map_row_chunks, select_real
from attention_core import contract
from attention_core.blocks import num_blocks, pad_to
from attention_core.combine import Piece, merge, normalize, partial_softmax, weighted_sum

Array = Any


def rotations(rng: Array, *, heads: int, n_hashes: int, head_dim: int, n_buckets: int) -> Array:
  """The random rotations of every round and head: [heads, n_hashes, head_dim, n_buckets // 2], N(0, 1)."""
  return jax.random.normal(rng, (heads, n_hashes, head_dim, n_buckets // 2), jnp.float32)


def lsh_buckets(x: Array, rot: Array) -> Array:
  """Angular LSH of x [batch, heads, L, d] by rot [heads, n_hashes, d, n_buckets/2]: [b, h, n_hashes, L].

  bucket = argmax([xR, -xR]), computed as the index of the largest |xR| plus n_buckets/2 when that entry is
  negative (one matmul for all rounds, no concatenation)."""
  heads, n_hashes, d, half = rot.shape
  flat = jnp.swapaxes(rot, 1, 2).reshape(heads, d, n_hashes * half).astype(x.dtype)  # all rounds at once
  r = jnp.einsum("bhld,hdk->bhlk", x, flat)  # [batch, heads, L, n_hashes * n_buckets/2]
  r = jnp.moveaxis(r.reshape(*r.shape[:3], n_hashes, half), 3, 2)  # [batch, heads, n_hashes, L, n_buckets/2]
  j = jnp.argmax(jnp.abs(r), axis=-1)
  negative = jnp.take_along_axis(r, j[..., None], axis=-1)[..., 0] < 0
  return jnp.where(negative, j + half, j).astype(jnp.int32)


def _inverse(order: Array) -> Array:
  """Inverse permutations along the last axis: order[..., undo[..., i]] = i."""
  pos = jnp.arange(order.shape[-1], dtype=order.dtype)
  flat = order.reshape(-1, order.shape[-1])
  inv = jax.vmap(lambda o: jnp.zeros_like(o).at[o].set(pos, unique_indices=True))(flat)
  return inv.reshape(order.shape)


@jax.custom_vjp
def _permute(x: Array, order: Array, undo: Array) -> Array:
  """x [rows, L, dim] gathered by each round's permutation order [rows, r, L] -> [rows, r, L, dim].

  The gradient is a gather by the inverse permutation summed over rounds, not a scatter-add."""
  return jnp.take_along_axis(x[:, None], order[..., None], axis=2)


def _permute_fwd(x, order, undo):
  return _permute(x, order, undo), (order, undo)


def _permute_bwd(res, g):
  order, undo = res
  return jnp.sum(jnp.take_along_axis(g, undo[..., None], axis=2), axis=1), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def _unpermute(x: Array, undo: Array, order: Array) -> Array:
  """Per-round inverse of `_permute`: x [rows, r, L, ...] gathered by undo [rows, r, L] along L."""
  return jnp.take_along_axis(x, undo.reshape(undo.shape + (1,) * (x.ndim - 3)), axis=2)


def _unpermute_fwd(x, undo, order):
  return _unpermute(x, undo, order), (undo, order)


def _unpermute_bwd(res, g):
  undo, order = res
  return _unpermute(g, order, undo), None, None


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def _contract_with(values: Array):
  return lambda w: weighted_sum("grnck,grnkd->grncd", w, values)  # [rows, r, n, c, value_dim]


def _unit(x: Array) -> Array:
  """x / |x|, with zero rows kept at zero."""
  n2 = jnp.sum(x * x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.where(n2 > 0, n2, 1.0))


def reformer(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, rng: Array,
             n_hashes: int = 2, n_buckets: int | None = None, chunk_size: int = 64,
             row_chunks: int | None = None) -> Array:
  """LSH attention with shared QK, `n_hashes` rounds of `n_buckets` buckets, chunks of `chunk_size`.

  q: [batch, length, heads, head_dim] (also the keys, normalised); k: checked, not read; v: [..., value_dim];
  rng: a jax key for the rotations (a fresh one per training step). n_buckets: even, or 1 (no hashing);
  None = 2 * the number of chunks (the paper's choice of about two buckets per chunk), at least 2.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`attention_baselines.common.num_row_chunks`; None = automatic).
  """
  op = "reformer"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  n_hashes = contract.check_positive_int(n_hashes, name="n_hashes", op=op)
  chunk_size = contract.check_positive_int(chunk_size, name="chunk_size", op=op)
  batch, length, heads, head_dim = q.shape
  chunk_size = min(chunk_size, length)
  n_chunks = num_blocks(length, chunk_size)
  if n_buckets is None:
    n_buckets = max(2, 2 * n_chunks)
  n_buckets = contract.check_positive_int(n_buckets, name="n_buckets", op=op)
  if n_buckets % 2 and n_buckets != 1:
    raise ValueError(f"{op}: argument 'n_buckets' must be 1 or even, got {n_buckets}")
  rot = rotations(rng, heads=heads, n_hashes=n_hashes, head_dim=head_dim, n_buckets=max(n_buckets, 2))
  return _lsh(q, k, v, causal=causal, mask=mask, rot=rot, n_buckets=n_buckets, chunk_size=chunk_size,
              row_chunks=row_chunks)


reformer.partitions_itself = True  # through `_lsh`, its rotations drawn for every head first


@contract.partitioned_op(per_head=("rot",))
def _lsh(q: Array, k: Array, v: Array, *, causal: bool, mask: Array, rot: Array, n_buckets: int,
         chunk_size: int, row_chunks: int | None) -> Array:
  """`reformer` with its arguments checked and its rotations rot [heads, n_hashes, head_dim, n_buckets // 2]
  drawn (for every head, before the heads are split: each device hashes its heads with a one-device call's
  rotations); mask [batch, length] bool; chunk_size at most the length."""
  op = "reformer"
  batch, length, heads, head_dim = q.shape
  n_hashes = rot.shape[1]
  n_chunks = num_blocks(length, chunk_size)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  padded = n_chunks * chunk_size

  rows = batch * heads
  valid = pad_to(mask, padded, axis=1)  # [batch, padded]

  def attention(block: tuple[Array, ...], aux: tuple[Array, Array], ids: Array) -> Array:
    """A block of rows: q [rows, padded, d], v [rows, padded, dv] -> [rows, padded, dv]; aux: the key mask
    [batch, padded] and the rotations [heads, ...]."""
    qh, vh = block
    valid = block_mask(aux[0], ids, heads)  # [rows, padded]
    rot = aux[1][ids % heads]  # [rows, n_hashes, head_dim, n_buckets // 2]
    qh, vh = select_real(valid, qh, vh)  # masked positions hold anything (NaN): zeros before any arithmetic
    rows = qh.shape[0]
    if n_buckets == 1:  # no hashing: the chunks are runs of consecutive positions
      buckets = jnp.zeros((rows, n_hashes, padded), jnp.int32)
    else:
      buckets = lsh_buckets(jax.lax.stop_gradient(qh)[None], rot)[0]  # [rows, n_hashes, padded]
    buckets = jnp.where(valid[:, None, :], buckets, n_buckets)  # masked keys: a last bucket of their own
    pos = jnp.arange(padded, dtype=jnp.int32)
    order = jnp.argsort(buckets * padded + pos, axis=-1).astype(jnp.int32)  # [rows, n_hashes, padded]
    # The inverse permutation by one scatter (much cheaper than a second sort on CPU).
    undo = _inverse(order)

    sq = _permute(qh, order, undo)  # [rows, r, padded, d], sorted per round
    sv = _permute(vh, order, undo)  # [rows, r, padded, dv]
    chunked = (rows, n_hashes, n_chunks, chunk_size)
    sq, sv = sq.reshape(*chunked, head_dim), sv.reshape(*chunked, sv.shape[-1])
    spos = order.reshape(chunked)  # original positions, sorted
    svalid = jnp.take_along_axis(jnp.broadcast_to(valid[:, None, :], order.shape), order, axis=-1)
    svalid = svalid.reshape(chunked)  # [rows, r, n, c]
    sk = _unit(sq)
    scale = contract.logit_scale(head_dim)

    # Own chunk: the key in slot i is the query in slot i, so "self" is the diagonal.
    own_logits = jnp.einsum("grncd,grnkd->grnck", sq, sk) * scale  # [rows, r, n, c, c]
    own_visible = svalid[..., None, :]  # [rows, r, n, 1, c]
    if causal:
      own_visible = own_visible & (spos[..., None, :] <= spos[..., :, None])
    eye = jnp.eye(chunk_size, dtype=bool)
    others = [own_visible & ~eye]
    pieces = [(own_logits, sv)]
    if n_chunks > 1:  # the previous chunk (cyclic); it never holds the query's own position
      pk, pv = jnp.roll(sk, 1, axis=2), jnp.roll(sv, 1, axis=2)
      ppos, pvalid = jnp.roll(spos, 1, axis=2), jnp.roll(svalid, 1, axis=2)
      prev_logits = jnp.einsum("grncd,grnkd->grnck", sq, pk) * scale  # [rows, r, n, c, c]
      prev_visible = pvalid[..., None, :]
      if causal:
        prev_visible = prev_visible & (ppos[..., None, :] <= spos[..., :, None])
      others.append(prev_visible)
      pieces.append((prev_logits, pv))
    alone = ~functools.reduce(jnp.logical_or, [jnp.any(o, axis=-1, keepdims=True) for o in others])
    visible = [others[0] | (eye & alone), *others[1:]]  # [rows, r, n, c, c] each
    part = partial_softmax([Piece(lg, vis, _contract_with(val))
                            for (lg, val), vis in zip(pieces, visible, strict=True)])

    def unsort(x):  # [rows, r, n, c, ...] -> original order [rows, r, padded, ...]
      x = x.reshape(rows, n_hashes, padded, *x.shape[4:])
      return _unpermute(x, undo, order)

    rounds = [type(part)(*(unsort(t)[:, r] for t in part)) for r in range(n_hashes)]
    return normalize(merge(rounds))  # [rows, padded, value_dim]

  q, v = (pad_to(x, padded, axis=1) for x in (q, v))  # [batch, padded, heads, dim]

  def run(chunks: int) -> Array:
    return map_row_blocks(attention, (q, v), (valid, rot), chunks, dtype=ct, out_dtype=v.dtype)

  return map_row_chunks(run, rows, padded, row_chunks, op=op)[:, :length]
