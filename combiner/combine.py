"""One joint log-sum-exp combine, shared by every Combiner plan, its sparse counterparts and span summaries.

A query's attention is a softmax over several *pieces* of logits with different layouts (direct keys of its
block, pooled span keys, dyadic levels, ...). Each piece brings its logits, a validity mask and a function that
contracts softmax weights with the piece's values. `joint_softmax` normalises all pieces together with one shared
max, which is the only place where the numerics of masking and empty rows are decided.
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


def joint_softmax(pieces: Sequence[Piece]) -> Array:
  """sum_p apply_p(w_p) with w = softmax over the concatenation of all valid logits.

  Rows with no valid entry return zeros (finite), never NaN: that happens only for padded query rows.
  """
  valids = [jnp.broadcast_to(p.valid, p.logits.shape) for p in pieces]
  row_max = None
  for p, valid in zip(pieces, valids, strict=True):
    m = jnp.max(jnp.where(valid, p.logits, -jnp.inf), axis=-1)
    row_max = m if row_max is None else jnp.maximum(row_max, m)
  # The max only stabilises exp(); the result does not depend on it, so it carries no gradient.
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))[..., None]
  numer, denom = None, None
  for p, valid in zip(pieces, valids, strict=True):
    # where() before exp() keeps masked entries (possibly -inf or huge) out of both exp and its gradient.
    w = jnp.where(valid, jnp.exp(jnp.where(valid, p.logits, row_max) - row_max), 0.0)
    s = jnp.sum(w, axis=-1)
    o = p.apply(w)
    numer = o if numer is None else numer + o
    denom = s if denom is None else denom + s
  return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


def attend(logits: Array, valid: Array, values: Array, contract: str) -> Array:
  """Single-piece masked softmax attention: `einsum(contract, weights, values)`."""
  return joint_softmax([Piece(logits, valid, lambda w: jnp.einsum(contract, w, values))])
