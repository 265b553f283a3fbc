"""YOSO attention (Zeng et al., 2021): self-attention as LSH Bernoulli sampling, with its own backward.

With l2-normalised queries and keys, `B_ij = 1[f(q_i) = f(k_j)]` for a random `tau`-bit hyperplane hash `f` is a
Bernoulli variable with mean `p_ij = (1 - arccos(q_i . k_j)/pi)^tau`. YOSO-m averages `B V` over `m` hashes;
YOSO-E is its expectation `P V`. N-YOSO l2-normalises the output (the paper's default), which also makes the
missing row normalisation of `P` irrelevant.

Forward (paper section 3.2): for each hash, a table of `2^tau` buckets holds the sum of the values of the keys
hashed there (`jax.ops.segment_sum`), and each query reads its bucket. A `lax.scan` over hashes keeps one table
per step alive, so memory is O(b*h*2^tau*d) for tables plus O(L*m) int32 codes and O(L*d) accumulators; time is
O(L*m*d). Masked keys go to an extra bucket that no query ever reads.

Backward (paper section 3.3), a `jax.custom_vjp` that re-uses the forward's codes (nothing is re-hashed):
  dV_j = 1/m sum_hashes sum_i B_ij dY_i                                   (tables keyed by query codes)
  dQ_i = (tau/2)/m sum_hashes sum_j B_ij (dY_i . v_j) k_j                 (the lower-bound surrogate, eq. 4)
  dK_j = (tau/2)/m sum_hashes sum_i B_ij (dY_i . v_j) q_i
both unbiased for the gradient of the dense surrogate `P V` whose `dP/d(q.k)` is replaced by `(tau/2) P`. The
bilinear weight `dY_i . v_j` is decomposed over value features (the paper's per-feature tables):
`sum_l dY_il sum_j B_ij v_jl k_j`, a table of `d`-vectors per feature. Done exactly that costs O(L*m*d^2)
(`backward_features=None`). The default instead sketches the value space with `s` random orthonormal directions
per hash, scaled so that `E[R R^T] = I`: `dY . v` is replaced by `(dY R) . (v R)`, unbiased, fresh directions for
every hash so their noise averages over the `m` hashes like the Bernoulli noise does, at cost O(L*m*s*d) - linear
in `d`. The chain rule through the l2-normalisations of q, k and of the output is ordinary autodiff.
`backward="dense"` replaces the sampled backward by the exact O(L^2) surrogate gradient (short sequences, tests).

The 1/sqrt(head_dim) logit scale of the op contract is a no-op here: YOSO only sees directions of q and k.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from combiner import contract
from yoso import hashing

Array = Any

HASHES = ("gaussian", "fast")
BACKWARDS = ("sampled", "dense")
MAX_TAU = 24  # 2^tau buckets per table; beyond this the tables dwarf the sequence
DEFAULT_BACKWARD_FEATURES = 4
_NORM_EPS = 1e-6


def l2_normalize(x: Array) -> Array:
  """x / max(|x|, eps) along the last axis: zero vectors stay zero with finite gradients."""
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), _NORM_EPS**2))


def expected_collision(cos: Array, tau: int) -> Array:
  """(1 - arccos(cos)/pi)^tau, the collision probability of `tau` hyperplane bits.

  The cosine is clipped a few ulps inside [-1, 1] so that rounding (|q.k| slightly above 1) gives no NaN and the
  arccos derivative stays finite when a query is parallel to a key.
  """
  eps = 8 * float(jnp.finfo(cos.dtype).eps)
  cos = jnp.clip(cos, -1.0 + eps, 1.0 - eps)
  return (1.0 - jnp.arccos(cos) / np.pi) ** tau


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def surrogate_collision(cos: Array, tau: int) -> Array:
  """expected_collision with the paper's lower-bound derivative (tau/2) * p in place of the exact one (eq. 4).

  The exact derivative grows without bound as the cosine approaches 1; the surrogate is what YOSO trains with.
  """
  return expected_collision(cos, tau)


@surrogate_collision.defjvp
def _surrogate_collision_jvp(tau, primals, tangents):
  (cos,), (dcos,) = primals, tangents
  p = expected_collision(cos, tau)
  return p, (tau / 2) * p * dcos


def _dense_surrogate(qn: Array, kn: Array, v: Array, kvalid: Array, tau: int) -> Array:
  """P V with the surrogate derivative; qn, kn [b, L, h, d] unit rows, v [b, L, h, e], kvalid [b, L]."""
  cos = jnp.einsum("bqhd,bkhd->bhqk", qn, kn)  # [batch, heads, length_q, length_k]
  p = jnp.where(kvalid[:, None, None, :], surrogate_collision(cos, tau), 0.0)
  return jnp.einsum("bhqk,bkhe->bqhe", p, v)  # [batch, length, heads, value_dim]


def _lsh_cumulate(read_codes: Array, write_codes: Array, write_valid: Array, per_hash: Any, write_fn, read_fn,
                  num_buckets: int, out_dim: int, dtype: Any) -> Array:
  """sum over hashes t of read_fn(T_t[read_code_t(i)], t) where T_t[c] = sum_{j valid, write_code_t(j) = c} write_fn(j, t).

  read_codes, write_codes: [b, L, h, m] int32; write_valid: [b, L] bool; per_hash: pytree with leading axis m.
  write_fn(per_hash_t) -> [b, L, h, e] rows to insert; read_fn(rows [b, L, h, e], per_hash_t) -> [b, L, h, out_dim].
  One table per step of a scan over hashes, so only O(b*h*2^tau*e) table memory is alive at a time.
  """
  b, length, h, _ = read_codes.shape
  stride = num_buckets + 1  # bucket num_buckets collects invalid rows; read codes never reach it
  base = ((jnp.arange(b)[:, None] * h + jnp.arange(h)[None, :]) * stride)[:, None, :, None]  # [b, 1, h, 1]
  write_ids = jnp.where(write_valid[:, :, None, None], write_codes, num_buckets) + base  # [b, L, h, m]
  read_ids = read_codes + base  # [b, L, h, m]

  def step(acc, xs):
    wid, rid, extra = xs  # [b, L, h], [b, L, h], per-hash slice
    rows = write_fn(extra)  # [b, L, h, e]
    table = jax.ops.segment_sum(rows.reshape(b * length * h, -1), wid.reshape(-1),
                                num_segments=b * h * stride)  # [b*h*(2^tau+1), e]
    read = table[rid.reshape(-1)].reshape(b, length, h, -1)  # [b, L, h, e]
    return acc + read_fn(read, extra), None

  init = jnp.zeros((b, length, h, out_dim), dtype)
  xs = (jnp.moveaxis(write_ids, -1, 0), jnp.moveaxis(read_ids, -1, 0), per_hash)
  out, _ = jax.lax.scan(step, init, xs)
  return out


def _sketch_directions(rng: Array, heads: int, num_hashes: int, value_dim: int, features: int | None,
                       dtype: Any) -> Array:
  """[m, h, e, s] value-space directions with E[R R^T] = I: the identity (exact) or s random orthonormal ones."""
  if features is None or features >= value_dim:
    return jnp.broadcast_to(jnp.eye(value_dim, dtype=dtype), (num_hashes, heads, value_dim, value_dim))
  g = jax.random.normal(rng, (num_hashes, heads, value_dim, features), dtype)
  r, _ = jnp.linalg.qr(g)  # orthonormal columns spanning a uniformly random s-dim subspace
  return r * np.sqrt(value_dim / features).astype(dtype)


def _make_cumulation(tau: int, backward: str):
  """The custom_vjp core: (qn, kn, v, codes..., directions) -> the mean over hashes of B V, not normalised."""
  num_buckets = 1 << tau

  @jax.custom_vjp
  def cumulation(qn, kn, v, qcodes, kcodes, kvalid, directions):
    return _forward(v, qcodes, kcodes, kvalid)

  def _forward(v, qcodes, kcodes, kvalid):
    m = qcodes.shape[-1]
    out = _lsh_cumulate(qcodes, kcodes, kvalid, None, lambda _: v, lambda rows, _: rows, num_buckets,
                        v.shape[-1], v.dtype)
    return out / m

  def fwd(qn, kn, v, qcodes, kcodes, kvalid, directions):
    return _forward(v, qcodes, kcodes, kvalid), (qn, kn, v, qcodes, kcodes, kvalid, directions)

  def bwd(res, dy):
    qn, kn, v, qcodes, kcodes, kvalid, directions = res
    if backward == "dense":
      _, vjp = jax.vjp(lambda a, b, c: _dense_surrogate(a, b, c, kvalid, tau), qn, kn, v)
      dq, dk, dv = vjp(dy)
      return dq, dk, dv, None, None, None, None
    m = qcodes.shape[-1]
    b, length, h, d = qn.shape
    e = v.shape[-1]
    qvalid = jnp.ones(kvalid.shape, bool)  # every query read the forward, so every query's cotangent counts
    kv = kvalid[:, :, None, None]
    # dV: tables of dY keyed by query codes, read at key codes.
    dv = _lsh_cumulate(kcodes, qcodes, qvalid, None, lambda _: dy, lambda rows, _: rows, num_buckets, e, v.dtype)
    dv = jnp.where(kv, dv / m, 0.0)

    def weighted(src_w, dst_w, vec):
      # sum_hash sum_s (dst_w R)_s sum_{collisions} (src_w R)_s vec: tables of s*d entries per bucket.
      def write_fn(r):  # r: [h, e, s]
        w = jnp.einsum("blhe,hes->blhs", src_w, r)
        return (w[..., None] * vec[..., None, :]).reshape(b, length, h, -1)  # [b, L, h, s*d]

      def read_fn(rows, r):
        w = jnp.einsum("blhe,hes->blhs", dst_w, r)
        return jnp.einsum("blhs,blhsd->blhd", w, rows.reshape(b, length, h, -1, d))
      return write_fn, read_fn

    scale = (tau / 2) / m
    # dQ_i = (tau/2)/m sum B_ij (dY_i . v_j) k_j: keys write v_j (x) k_j, queries read with dY_i.
    w_fn, r_fn = weighted(v, dy, kn)
    dq = scale * _lsh_cumulate(qcodes, kcodes, kvalid, directions, w_fn, r_fn, num_buckets, d, qn.dtype)
    # dK_j = (tau/2)/m sum B_ij (dY_i . v_j) q_i: queries write dY_i (x) q_i, keys read with v_j.
    w_fn, r_fn = weighted(dy, v, qn)
    dk = scale * _lsh_cumulate(kcodes, qcodes, qvalid, directions, w_fn, r_fn, num_buckets, d, kn.dtype)
    dk = jnp.where(kv, dk, 0.0)
    return dq, dk, dv, None, None, None, None

  cumulation.defvjp(fwd, bwd)
  return cumulation


def _check_tau(tau: Any, op: str) -> int:
  tau = contract.check_positive_int(tau, name="tau", op=op)
  if tau > MAX_TAU:
    raise ValueError(f"{op}: argument 'tau' must be an integer in [1, {MAX_TAU}], got {tau}")
  return tau


def _check_bidirectional(causal: Any, op: str) -> None:
  if contract.check_bool(causal, name="causal", op=op):
    raise ValueError(f"{op}: argument 'causal' must be False: YOSO attention is bidirectional only "
                     f"(the paper defines no causal variant)")


def _check_rng(rng: Any, op: str) -> Array:
  if rng is None or not hasattr(rng, "dtype"):
    raise TypeError(f"{op}: argument 'rng' must be a JAX PRNG key (jax.random.key(seed)), got {rng!r}")
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.dtype != jnp.uint32 or rng.shape[-1:] != (2,):
      raise TypeError(f"{op}: argument 'rng' must be a JAX PRNG key, got dtype {rng.dtype} shape {rng.shape}")
    rng = jax.random.wrap_key_data(rng)
  if rng.shape != ():
    raise ValueError(f"{op}: argument 'rng' must be a single key, got shape {rng.shape}")
  return rng


def yoso(q: Array, k: Array, v: Array, *, rng: Array, num_hashes: int, tau: int, causal: bool = False,
         mask: Array | None = None, normalize_output: bool = True, hash: str = "gaussian",
         backward: str = "sampled", backward_features: int | None = DEFAULT_BACKWARD_FEATURES) -> Array:
  """YOSO-m attention: the mean over `num_hashes` LSH samples of B V, l2-normalised per row when asked.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool
  (True = real key; masked keys are never inserted in a table). rng: a PRNG key; the same key gives the same
  hash functions (and backward sketch), so pass a fresh key per training step and a fixed one in evaluation.
  hash: "gaussian" (exact hyperplanes) or "fast" (Hadamard rotations, power-of-two head_dim).
  backward: "sampled" (linear cost, re-uses the forward's codes) or "dense" (exact O(L^2) surrogate gradient).
  backward_features: value-space directions per hash in the sampled dQ/dK estimate (cost O(L*m*s*d)); None uses
  all value features exactly (O(L*m*d*value_dim)). Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "yoso"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  _check_bidirectional(causal, op)
  rng = _check_rng(rng, op)
  num_hashes = contract.check_positive_int(num_hashes, name="num_hashes", op=op)
  tau = _check_tau(tau, op)
  normalize_output = contract.check_bool(normalize_output, name="normalize_output", op=op)
  contract.check_choice(hash, name="hash", allowed=HASHES, op=op)
  contract.check_choice(backward, name="backward", allowed=BACKWARDS, op=op)
  if backward_features is not None:
    backward_features = contract.check_positive_int(backward_features, name="backward_features", op=op)
  heads, head_dim = q.shape[2:]
  if hash == "fast" and not hashing.is_power_of_two(head_dim):
    raise ValueError(f"{op}: argument 'hash'='fast' needs a power-of-two head_dim, got head_dim={head_dim}; "
                     f"use hash='gaussian'")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  hash_rng, sketch_rng = jax.random.split(rng)
  qn = l2_normalize(q.astype(ct))  # [batch, length, heads, head_dim]
  kn = l2_normalize(k.astype(ct))
  # Codes are integers: no gradient flows through hashing; the custom backward supplies dQ and dK.
  qcodes = hashing.hash_codes(jax.lax.stop_gradient(qn), hash_rng, num_hashes=num_hashes, tau=tau, method=hash)
  kcodes = hashing.hash_codes(jax.lax.stop_gradient(kn), hash_rng, num_hashes=num_hashes, tau=tau, method=hash)
  directions = _sketch_directions(sketch_rng, heads, num_hashes, v.shape[-1], backward_features, ct)
  out = _make_cumulation(tau, backward)(qn, kn, v.astype(ct), qcodes, kcodes, mask, directions)
  if normalize_output:
    out = l2_normalize(out)
  return out.astype(v.dtype)  # [batch, length, heads, value_dim]


def yoso_e(q: Array, k: Array, v: Array, *, tau: int, causal: bool = False, mask: Array | None = None,
           normalize_output: bool = True) -> Array:
  """YOSO-E: the expectation P V with P_ij = (1 - arccos(q_i . k_j)/pi)^tau on l2-normalised q, k; O(L^2).

  Shapes as in `yoso`. Gradients are the exact derivatives of the expectation (ordinary autodiff).
  """
  op = "yoso_e"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  _check_bidirectional(causal, op)
  tau = _check_tau(tau, op)
  normalize_output = contract.check_bool(normalize_output, name="normalize_output", op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  qn, kn = l2_normalize(q.astype(ct)), l2_normalize(k.astype(ct))
  cos = jnp.einsum("bqhd,bkhd->bhqk", qn, kn)  # [batch, heads, length_q, length_k]
  p = jnp.where(mask[:, None, None, :], expected_collision(cos, tau), 0.0)
  out = jnp.einsum("bhqk,bkhe->bqhe", p, v.astype(ct))  # [batch, length, heads, value_dim]
  if normalize_output:
    out = l2_normalize(out)
  return out.astype(v.dtype)
