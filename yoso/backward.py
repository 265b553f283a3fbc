"""YOSO's backward (paper section 3.3): the rule of the `jax.custom_vjp` around the LSH cumulation, which
re-uses the forward's codes (nothing is re-hashed):
  dV_j = 1/m sum_hashes sum_i B_ij dY_i                                   (tables keyed by query codes)
  dQ_i = (tau/2)/m sum_hashes sum_j B_ij (dY_i . v_j) k_j                 (the lower-bound surrogate, eq. 4)
  dK_j = (tau/2)/m sum_hashes sum_i B_ij (dY_i . v_j) q_i
both unbiased for the gradient of the dense surrogate `P V` whose `dP/d(q.k)` is replaced by `(tau/2) P`. The
bilinear weight `dY_i . v_j` is decomposed over value features (the paper's per-feature tables):
`sum_l dY_il sum_j B_ij v_jl k_j`, i.e. one [e, d] table per (hash, bucket). The default
(`backward_features=None`) does this exactly for every hash: O(L*m*d*e) time and O((L/chunk + 2^tau)*d*e)
table memory (one group and one hash at a time) - linear in L, quadratic in the head size, exactly the
paper's estimator (section 3.3, Table 1); the tables are in `yoso.tables`.
`backward_features=s` is a cheaper, linear-in-d alternative: per hash, the
value space is sketched with `s` random orthonormal directions scaled so that `E[R R^T] = I`, i.e. `dY . v`
becomes `(dY R) . (v R)`: still unbiased, O(L*m*s*d), but the sketch multiplies the gradient variance of dQ/dK
by roughly `e/s` (the measured errors are in docs/benchmarks_design.md, "YOSO design measurements"). Sketches
of s <= SCATTER_FEATURES = 2 directions skip the chunked matmuls: their tables are plain segment sums of
s*d-wide rows, so the backward is two forward-like passes over the hashes. The price is the variance: a small
model trains measurably worse with s=1 than with the exact form, which is why the exact form stays the
default.
Cost ceiling of the exact form: its tables cost 4*L*m*d*e multiply-adds (build and read, dQ and dK) against
dense's ~6*L^2*d, a ratio of 3L/(2*m*e) before padding and sorting. The chain rule
through the l2-normalisations of q, k and of the output is ordinary autodiff.

Three strategies, chosen by `cotangents`: sequences up to COUNTS_MAX_LENGTH = 2048 rows get the exact
estimator's same sums through dense collision counts instead (C_ij = the number of hashes in which q_i and
k_j collide; `_counts_backward`): quadratic, but large matmuls, faster than the tables there; longer
ones (and every sketch) the LSH tables; `backward="dense"` replaces the sampled backward by the exact O(L^2)
surrogate gradient (short sequences, tests).

The causal form restricts every sum to the pairs j <= i: the counts and the dense surrogate take the causal
mask, and the LSH tables become running sums within each bucket (`yoso.tables.backward_tables`): dQ over the
keys before a query, dK and dV over the queries after a key. Its exact form has no per-bucket table to
chunk, so it stays on the (causally masked) counts up to CAUSAL_COUNTS_MAX_LENGTH = 8192 rows: quadratic
in L; beyond, it runs the running sums on rows of e*d features (the sketch with R = I): linear in L and
O(L*e*d) memory per live hash, but many times slower than the counts at a few thousand rows. Long causal
sequences should take a sketch (`backward_features`, the "yoso_sketch" op): linear and cheap.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from yoso import tables
from yoso.collision import surrogate_collision

Array = Any

BACKWARDS = ("sampled", "dense")


def visible(kvalid: Array, causal: bool) -> Array:
  """[..., L_q, L_k] bool: key j is real (and j <= i when causal); kvalid [..., L_k]."""
  vis = kvalid[..., None, :]
  return vis & jnp.tri(kvalid.shape[-1], dtype=bool) if causal else vis


def _dense_surrogate(qn: Array, kn: Array, v: Array, kvalid: Array, tau: int, causal: bool) -> Array:
  """P V with the surrogate derivative; qn, kn [g, L, d] unit rows, v [g, L, e], kvalid [g, L]; g = b*h."""
  cos = jnp.einsum("gqd,gkd->gqk", qn, kn)  # [groups, length_q, length_k]
  p = jnp.where(visible(kvalid, causal), surrogate_collision(cos, tau), 0.0)
  return jnp.einsum("gqk,gke->gqe", p, v)  # [groups, length, value_dim]


def sketch_basis(rng: Array, heads: int, num_hashes: int, value_dim: int, features: int | None,
                 dtype: Any) -> Array | None:
  """[heads, m, e, s] value-space directions per head and hash with E[R R^T] = I, heads first (so that a
  heads shard takes its rows); None (features None or >= value_dim) means the e unit vectors: the exact
  per-feature decomposition."""
  if features is None or features >= value_dim:
    return None
  gauss = jax.random.normal(rng, (num_hashes, heads, value_dim, features), dtype)
  r, _ = jnp.linalg.qr(gauss)  # orthonormal columns spanning a uniformly random s-dim subspace
  r = r * np.sqrt(value_dim / features).astype(dtype)  # E[r r^T] = I
  return jnp.swapaxes(r, 0, 1)


def directions(basis: Array | None, batch: int) -> Array | None:
  """`sketch_basis` [heads, m, e, s] shared over the batch: [m, batch * heads, e, s] (None stays None)."""
  if basis is None:
    return None
  heads, m, e, s = basis.shape
  return jnp.broadcast_to(jnp.swapaxes(basis, 0, 1)[:, None], (m, batch, heads, e, s)).reshape(
      m, batch * heads, e, s)


def sketch_directions(rng: Array, batch: int, heads: int, num_hashes: int, value_dim: int,
                      features: int | None, dtype: Any) -> Array | None:
  """[m, batch * heads, e, s] value-space directions per hash with E[R R^T] = I (shared over the batch), drawn
  from `rng` (`sketch_basis`); None for the exact per-feature decomposition."""
  return directions(sketch_basis(rng, heads, num_hashes, value_dim, features, dtype), batch)


# Up to this length the exact backward runs on dense collision counts (`_counts_backward`): the same sums,
# O(L^2 * (m + d)) in large matmuls instead of O(L * m * d * e) in padded per-bucket tables (timings in
# docs/benchmarks_design.md). Counts would still win a little above this length, but beyond it the backward
# stays linear in L as the op promises; only "short" sequences take the quadratic form.
COUNTS_MAX_LENGTH = 2048
# The causal exact backward's counts limit: its linear alternative (running sums of e*d-wide rows) is slower
# than the quadratic counts far beyond this length; the limit bounds the counts' [L, L] matrices per group
# (a few of them, 256 MB each at 8192 rows in float32).
CAUSAL_COUNTS_MAX_LENGTH = 8192


def _collision_counts(qcodes: Array, kcodes: Array, kvalid: Array, dtype: Any, causal: bool = False) -> Array:
  """C_ij = number of hashes t with code_t(q_i) = code_t(k_j), 0 for masked keys (and j > i when causal):
  m * (the mean of B^t).

  One group: qcodes, kcodes [L, m]; kvalid [L]. Returns [L_q, L_k] in dtype. O(L^2 * m) compares.
  """
  counts = jnp.sum(qcodes[:, None, :] == kcodes[None, :, :], axis=-1, dtype=jnp.int32)  # [L_q, L_k]
  return jnp.where(visible(kvalid, causal), counts, 0).astype(dtype)


def _counts_backward(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array,
                     dy: Array, causal: bool = False) -> tuple[Array, Array, Array]:
  """(dq, dk, dv) unscaled, exactly the per-feature tables' sums, through dense counts C (short sequences):
  dQ = (C * dY V^T) K, dK = (C * dY V^T)^T Q, dV = C^T dY, C masked to j <= i when causal. Shapes as in
  `_sampled_backward`. O(L^2 * (m + d)) time and O(L^2) memory per group (groups run one at a time): see
  COUNTS_MAX_LENGTH for when it is used.
  """
  def group(xs):
    qc, kc, valid, q, k, vg, dyg = xs
    counts = _collision_counts(qc, kc, valid, q.dtype, causal)  # [L_q, L_k]
    weight = counts * (dyg @ vg.T)  # [L_q, L_k]
    return weight @ k, weight.T @ q, counts.T @ dyg
  return jax.lax.map(group, (qcodes, kcodes, kvalid, qn, kn, v, dy))


def _dense_backward(qn: Array, kn: Array, v: Array, kvalid: Array, dy: Array, tau: int, causal: bool
                    ) -> tuple[Array, Array, Array]:
  """(dq, dk, dv): the exact O(L^2) gradient of the dense surrogate `P V` (`backward="dense"`), P masked to
  j <= i when causal."""
  _, vjp = jax.vjp(lambda a, b, c: _dense_surrogate(a, b, c, kvalid, tau, causal), qn, kn, v)
  return vjp(dy)


def _sampled_backward(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array, dy: Array,
                      tau: int, directions: Array | None, formulation: str, causal: bool = False,
                      operands: str = "float32") -> tuple[Array, Array, Array]:
  """(dq, dk, dv) of the sampled estimator with the forward's codes, scaled: dense collision counts up to
  COUNTS_MAX_LENGTH rows (CAUSAL_COUNTS_MAX_LENGTH when causal) when exact (directions None), the LSH tables
  otherwise; only pairs j <= i when causal. Masked keys get zero dk, dv.

  Groups heads-major: codes [g, L, m]; kvalid [g, L]; qn, kn [g, L, d]; v, dy [g, L, e];
  directions None or [m, g, e, s].
  """
  m = qcodes.shape[-1]
  kv = kvalid[..., None]
  scale = (tau / 2) / m
  # dQ_i = (tau/2)/m sum B_ij (dY_i . v_j) k_j and dK_j = (tau/2)/m sum B_ij (dY_i . v_j) q_i.
  if directions is None and qcodes.shape[1] <= (CAUSAL_COUNTS_MAX_LENGTH if causal else COUNTS_MAX_LENGTH):
    dq, dk, dv = _counts_backward(qcodes, kcodes, kvalid, qn, kn, v, dy, causal)
  else:
    dq, dk, dv = tables.backward_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, 1 << tau, directions,
                                        formulation, causal, operands)
  dv = jnp.where(kv, dv / m, 0.0)
  dq, dk = scale * dq, scale * dk
  dk = jnp.where(kv, dk, 0.0)
  return dq, dk, dv


def cotangents(backward: str, tau: int, formulation: str, causal: bool, qn: Array, kn: Array, v: Array,
               qcodes: Array, kcodes: Array, kvalid: Array, directions: Array | None, dy: Array,
               operands: str = "float32") -> tuple[Array, Array, Array]:
  """(dq, dk, dv) of the mean over hashes of B V (over keys j <= i when causal) for the output cotangent dy:
  `backward` "dense" (the exact surrogate gradient) or "sampled" (`_sampled_backward`). Shapes as in
  `_sampled_backward`."""
  if backward == "dense":
    return _dense_backward(qn, kn, v, kvalid, dy, tau, causal)
  return _sampled_backward(qcodes, kcodes, kvalid, qn, kn, v, dy, tau, directions, formulation, causal,
                           operands)
