"""One joint log-sum-exp combine, shared by every Combiner plan, its sparse counterparts and span summaries.

A query's attention is a softmax over several *pieces* of logits with different layouts (direct keys of its
block, pooled span keys, dyadic levels, ...). Each piece brings its logits, a validity mask and a function
that contracts softmax weights with the piece's values. `joint_softmax` normalises all pieces together with
one shared max, which is the only place where the numerics of masking and empty rows are decided.
`partial_softmax` and `merge` split that softmax when several softmaxes share pieces (Combiner-Mixture's two
plans share D_i).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = Any


class Piece(NamedTuple):
  """A block of logits for the same queries.

  logits: [*Q, n]     scaled logits in the softmax dtype
  valid:  broadcastable to logits; False entries get exactly zero weight
  apply:  weights [*Q, n] -> [*Q, value_dim], the weighted sum of this piece's values; a value with zero
          weight (masked, future) must not reach the output even when it is NaN or Inf (`weighted_sum`)
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


def _exp_weights(pieces: Sequence[Piece]) -> tuple[list[Array], Array]:
  """Each piece's exp(logits - row max) (exactly 0 where invalid) and the row max (-inf for empty rows)."""
  valids = [jnp.broadcast_to(p.valid, p.logits.shape) for p in pieces]
  row_max = None
  for p, valid in zip(pieces, valids, strict=True):
    m = jnp.max(jnp.where(valid, p.logits, -jnp.inf), axis=-1)
    row_max = m if row_max is None else jnp.maximum(row_max, m)
  # The max only stabilises exp(); the result does not depend on it, so it carries no gradient.
  row_max = jax.lax.stop_gradient(row_max)
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[..., None]
  # Masked entries (possibly huge or -inf) become -inf before exp(): exactly zero weight, and a zero gradient
  # that never touches their logits. One select, so the backward keeps only the weights and the mask.
  return [jnp.exp(jnp.where(valid, p.logits, -jnp.inf) - safe_max)
          for p, valid in zip(pieces, valids, strict=True)], row_max


def partial_softmax(pieces: Sequence[Piece]) -> Partial:
  """The shared-max exponentials of all pieces' valid logits, contracted with their values."""
  weights, row_max = _exp_weights(pieces)
  numer = _sum(p.apply(w) for p, w in zip(pieces, weights, strict=True))
  return Partial(numer, _sum(jnp.sum(w, axis=-1) for w in weights), row_max)


def _sum(xs: Any) -> Any:
  out = None
  for x in xs:
    out = x if out is None else out + x
  return out


def merge(partials: Sequence[Partial]) -> Partial:
  """One softmax over the union of the partials' entries: each is rescaled by exp(its max - the joint max)
  <= 1, so nothing overflows and a partial underflows only where it is negligible."""
  row_max = partials[0].max
  for p in partials[1:]:
    row_max = jnp.maximum(row_max, p.max)
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  factors = [jnp.where(jnp.isfinite(p.max), jnp.exp(jnp.where(jnp.isfinite(p.max), p.max, 0.0) - safe_max),
                       0.0)
             for p in partials]
  return Partial(_sum(p.numer * f[..., None] for p, f in zip(partials, factors, strict=True)),
                 _sum(p.denom * f for p, f in zip(partials, factors, strict=True)), row_max)


def normalize(p: Partial) -> Array:
  """numer / denom; rows with no valid entry return zeros (finite), never NaN (only padded query rows)."""
  return p.numer / jnp.where(p.denom > 0, p.denom, 1.0)[..., None]


# Pieces with at most this many logits per query are normalised before `apply` (weights times 1/denom) instead
# of after it (summed outputs times 1/denom). For the single-logit pieces of logsparse that saves much of the
# fwd+bwd time and temp memory (docs/benchmarks_design.md, "Design measurements"): the after-form's backward
# reduces cotangent x output over value_dim for every piece. Wide pieces keep the after-form, which scales
# Q x value_dim numbers instead of Q x n.
NORMALIZE_WEIGHTS_MAX_LOGITS = 8


def joint_softmax(pieces: Sequence[Piece]) -> Array:
  """sum_p apply_p(w_p) with w = softmax over the concatenation of all valid logits.

  Rows with no valid entry return zeros (finite), never NaN: that happens only for padded query rows.
  """
  weights, _ = _exp_weights(pieces)
  denom = _sum(jnp.sum(w, axis=-1) for w in weights)
  inv = (1.0 / jnp.where(denom > 0, denom, 1.0))[..., None]  # [*Q, 1]
  narrow = [(p, w) for p, w in zip(pieces, weights, strict=True)
            if w.shape[-1] <= NORMALIZE_WEIGHTS_MAX_LOGITS]
  wide = [(p, w) for p, w in zip(pieces, weights, strict=True)
          if w.shape[-1] > NORMALIZE_WEIGHTS_MAX_LOGITS]
  out_narrow = _sum(p.apply(w * inv) for p, w in narrow)
  out_wide = _sum(p.apply(w) for p, w in wide)
  if out_wide is None:
    return out_narrow
  out_wide = out_wide * inv
  return out_wide if out_narrow is None else out_wide + out_narrow


def weighted_sum(contract: str, weights: Array, values: Array) -> Array:
  """`einsum(contract, weights, values)` in which a value row with zero weight never reaches the output.

  weights >= 0 (exactly 0 for masked and future entries); values: [..., value_dim], whose last axis is the
  output's last axis. A plain contraction computes 0 * NaN = NaN, so one NaN or Inf in a masked or future
  value would poison every output of the contraction. Here non-finite values are selected to 0 before the
  contraction, and an output that gives positive weight to a non-finite value row is NaN (a visible
  non-finite value still shows). The flag rides along as one more value column (1 for a non-finite row), so
  one contraction yields both, with no conditional: XLA:CPU compiles a model holding a `lax.cond` per piece
  many times slower and larger.
  """
  return flagged_sum(contract, weights, flag_nonfinite(values))


def flag_nonfinite(values: Array) -> Array:
  """values [..., value_dim] -> [..., value_dim + 1]: non-finite entries selected to 0, and a last column that
  is 1 for a row holding any non-finite entry. Ops whose pieces read overlapping copies of the same values
  (neighbouring blocks, gathered blocks) flag the values once, before copying, and contract the copies with
  `flagged_sum`."""
  finite = jnp.isfinite(values)
  bad = jnp.logical_not(jnp.all(finite, axis=-1, keepdims=True)).astype(values.dtype)  # [..., 1]
  return jnp.concatenate([jnp.where(finite, values, 0), bad], axis=-1)


def flagged_sum(contract: str, weights: Array, flagged: Array) -> Array:
  """`weighted_sum` of values already passed through `flag_nonfinite`.

  flagged: [..., value_dim + 1]; returns [..., value_dim]."""
  return unflag(jnp.einsum(contract, weights, flagged))


def unflag(both: Array) -> Array:
  """Sums of `flag_nonfinite` values [..., value_dim + 1] -> [..., value_dim]: NaN where a non-finite value
  had positive weight."""
  return jnp.where(both[..., -1:] > 0, jnp.nan, both[..., :-1])


def attend(logits: Array, valid: Array, values: Array, contract: str) -> Array:
  """Single-piece masked softmax attention: `weighted_sum(contract, weights, values)`."""
  return joint_softmax([Piece(logits, valid, lambda w: weighted_sum(contract, w, values))])


def attend_zeros_hidden(logits: Array, valid: Array, values: Array, contract: str) -> Array:
  """`attend` for callers whose values at invalid entries are zeros (masked keys selected to zero, padding),
  so no contraction can meet a hidden non-finite value and `weighted_sum`'s guard is not needed; a visible
  non-finite value still shows. Callers with other hidden values (future keys) pass `flag_nonfinite(values)`
  and `unflag` the result: `attend`'s guard. A hand-written backward (flash attention's: dlogits = P * (dP -
  rowsum(dOut * Out))) keeps only the weights and the output between the passes, faster on a CPU than the
  autodiff of `attend`.

  logits [*Q, K] (K, the keys, last); valid broadcastable to logits; contract "A,B->C": weights A x values B
  -> output C whose last axis is the values' last, a plain contraction (no repeated or ellipsis indices).
  """
  return _softmax_contract(logits, valid, values, contract)


def _softmax_weights(logits: Array, valid: Array) -> Array:
  """Softmax over the last axis of the valid logits; exactly 0 where invalid, rows with none valid all 0."""
  weights, _ = _exp_weights([Piece(logits, valid, None)])
  denom = jnp.sum(weights[0], axis=-1, keepdims=True)
  return weights[0] * (1.0 / jnp.where(denom > 0, denom, 1.0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _softmax_contract(logits: Array, valid: Array, values: Array, contract: str) -> Array:
  return _softmax_contract_fwd(logits, valid, values, contract)[0]


def _softmax_contract_fwd(logits: Array, valid: Array, values: Array, contract: str) -> tuple[Array, Any]:
  weights = _softmax_weights(logits, valid)
  out = jnp.einsum(contract, weights, values)
  return out, (weights, values, out)


def _softmax_contract_bwd(contract: str, res: Any, dout: Array) -> tuple[Array, None, Array]:
  weights, values, out = res
  w_spec, rest = contract.split(",")
  v_spec, o_spec = rest.split("->")
  dweights = jnp.einsum(f"{o_spec},{v_spec}->{w_spec}", dout, values)  # [*Q, K]
  row = jnp.einsum(f"{o_spec},{o_spec}->{w_spec[:-1]}", dout, out)[..., None]  # [*Q, 1]
  dlogits = weights * (dweights - row)
  dvalues = jnp.einsum(f"{w_spec},{o_spec}->{v_spec}", weights, dout)
  return dlogits.astype(weights.dtype), None, dvalues.astype(values.dtype)


_softmax_contract.defvjp(_softmax_contract_fwd, _softmax_contract_bwd)
