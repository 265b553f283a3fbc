"""One joint log-sum-exp combine, shared by every Combiner plan, its sparse counterparts and span summaries.

A query's attention is a softmax over several *pieces* of logits with different layouts (direct keys of its
block, pooled span keys, dyadic levels, ...). Each piece brings its logits, a validity mask and a function that
contracts softmax weights with the piece's values. `joint_softmax` normalises all pieces together with one shared
max, which is the only place where the numerics of masking and empty rows are decided. `partial_softmax` and
`merge` split that softmax when several softmaxes share pieces (Combiner-Mixture's two plans share D_i).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = Any


class Piece(NamedTuple):
  """A block of logits for the same queries.

  logits: [*Q, n]     scaled logits in the softmax dtype
  valid:  broadcastable to logits; False entries get exactly zero weight
  apply:  weights [*Q, n] -> [*Q, value_dim], the weighted sum of this piece's values
  """

  logits: Array
  valid: Array
  apply: Callable[[Array], Array]


class Partial(NamedTuple):
  """An unnormalised softmax over some pieces, kept with its own stabilising max so partials can be merged.

  numer: [*Q, value_dim]  sum over the pieces of apply(exp(logits - max))
  denom: [*Q]             sum of exp(logits - max)
  max:   [*Q]             max valid logit (-inf for rows with no valid entry), without gradient
  """

  numer: Array
  denom: Array
  max: Array


def partial_softmax(pieces: Sequence[Piece]) -> Partial:
  """The shared-max exponentials of all pieces' valid logits, contracted with their values."""
  valids = [jnp.broadcast_to(p.valid, p.logits.shape) for p in pieces]
  row_max = None
  for p, valid in zip(pieces, valids, strict=True):
    m = jnp.max(jnp.where(valid, p.logits, -jnp.inf), axis=-1)
    row_max = m if row_max is None else jnp.maximum(row_max, m)
  # The max only stabilises exp(); the result does not depend on it, so it carries no gradient.
  row_max = jax.lax.stop_gradient(row_max)
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[..., None]
  numer, denom = None, None
  for p, valid in zip(pieces, valids, strict=True):
    # Masked entries (possibly huge or -inf) become -inf before exp(): exactly zero weight, and a zero gradient
    # that never touches their logits. One select, so the backward keeps only the weights and the mask.
    w = jnp.exp(jnp.where(valid, p.logits, -jnp.inf) - safe_max)
    s = jnp.sum(w, axis=-1)
    o = p.apply(w)
    numer = o if numer is None else numer + o
    denom = s if denom is None else denom + s
  return Partial(numer, denom, row_max)


def merge(partials: Sequence[Partial]) -> Partial:
  """One softmax over the union of the partials' entries: each is rescaled by exp(its max - the joint max) <= 1,
  so nothing overflows and a partial underflows only where it is negligible."""
  row_max = partials[0].max
  for p in partials[1:]:
    row_max = jnp.maximum(row_max, p.max)
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  numer, denom = None, None
  for p in partials:
    factor = jnp.where(jnp.isfinite(p.max), jnp.exp(jnp.where(jnp.isfinite(p.max), p.max, 0.0) - safe_max), 0.0)
    o, s = p.numer * factor[..., None], p.denom * factor
    numer = o if numer is None else numer + o
    denom = s if denom is None else denom + s
  return Partial(numer, denom, row_max)


def normalize(p: Partial) -> Array:
  """numer / denom; rows with no valid entry return zeros (finite), never NaN (only padded query rows)."""
  return p.numer / jnp.where(p.denom > 0, p.denom, 1.0)[..., None]


def joint_softmax(pieces: Sequence[Piece]) -> Array:
  """sum_p apply_p(w_p) with w = softmax over the concatenation of all valid logits.

  Rows with no valid entry return zeros (finite), never NaN: that happens only for padded query rows.
  """
  return normalize(partial_softmax(pieces))


def attend(logits: Array, valid: Array, values: Array, contract: str) -> Array:
  """Single-piece masked softmax attention: `einsum(contract, weights, values)`."""
  return joint_softmax([Piece(logits, valid, lambda w: jnp.einsum(contract, w, values))])
