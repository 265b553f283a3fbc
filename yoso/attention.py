"""YOSO attention (Zeng et al., 2021): self-attention as LSH Bernoulli sampling, with its own backward.

With l2-normalised queries and keys, `B_ij = 1[f(q_i) = f(k_j)]` for a random `tau`-bit hyperplane hash `f` is
a Bernoulli variable with mean `p_ij = (1 - arccos(q_i . k_j)/pi)^tau`. YOSO-m averages `B V` over `m` hashes;
YOSO-E is its expectation `P V`. N-YOSO l2-normalises the output (the paper's default), which also makes the
missing row normalisation of `P` irrelevant.

Forward (paper section 3.2): for each hash, a table of `2^tau` buckets holds the sum of the values of the keys
hashed there (`jax.ops.segment_sum`), and each query reads its bucket. Groups (batch * heads) run one at a
time with a `lax.scan` over hashes inside, so one table is alive at a time: memory is O(2^tau*d) for tables
plus O(L*m) int32 codes and O(L*d) accumulators; time is O(L*m*d). Masked keys go to an extra bucket that
no query ever reads.

Backward (paper section 3.3), a `jax.custom_vjp` that re-uses the forward's codes (nothing is re-hashed):
  dV_j = 1/m sum_hashes sum_i B_ij dY_i                                   (tables keyed by query codes)
  dQ_i = (tau/2)/m sum_hashes sum_j B_ij (dY_i . v_j) k_j                 (the lower-bound surrogate, eq. 4)
  dK_j = (tau/2)/m sum_hashes sum_i B_ij (dY_i . v_j) q_i
both unbiased for the gradient of the dense surrogate `P V` whose `dP/d(q.k)` is replaced by `(tau/2) P`. The
bilinear weight `dY_i . v_j` is decomposed over value features (the paper's per-feature tables):
`sum_l dY_il sum_j B_ij v_jl k_j`, i.e. one [e, d] table per (hash, bucket). The default
(`backward_features=None`) does this exactly for every hash: O(L*m*d*e) time and O((L/chunk + 2^tau)*d*e)
table memory (one group and one hash at a time) - linear in L, quadratic in the head size, exactly the
paper's estimator (section 3.3, Table 1). The tables are built and read by batched matmuls over bucket-sorted,
chunk-padded rows (`_feature_tables`), 2.3-2.7x faster on CPU than e scatters of d-vectors per hash.
`backward_features=s` is a cheaper, linear-in-d alternative: per hash, the
value space is sketched with `s` random orthonormal directions scaled so that `E[R R^T] = I`, i.e. `dY . v`
becomes `(dY R) . (v R)`: still unbiased, O(L*m*s*d), but the sketch multiplies the gradient variance of dQ/dK
by roughly `e/s`. Measured relative error of dQ against the dense surrogate gradient through the same forward
(L=256, d=e=64, m=32, tau=8, correlated q/k, mean of 6 keys): exact 1.6, s=16 3.3, s=8 4.6, s=4 6.5, s=1 13.0
(dV 1.1 for all); cycling the blocks of one random basis over the hashes instead of independent directions
measured the same. Sketches of s <= SCATTER_FEATURES = 2 directions skip the chunked matmuls: their tables
are plain segment sums of s*d-wide rows, so the backward is two forward-like passes over the hashes
(`_sketched_tables`, dV riding along); at L=4096, 8 heads, m=32, s=1 this is 316 ms fwd+bwd against 447 ms
chunked (s=2: 591 against 655). The price is the variance: a tiny MLM model on the recall task (L=128, 300
steps, mean of 3 seeds) ended at loss 1.94 / answer accuracy 0.275 with s=1 against 1.76 / 0.310 exact (one
seed of YOSO-E: 1.56 / 0.34), which is why the exact form stays the default. Cost ceiling of the exact form:
its tables cost 4*L*m*d*e multiply-adds (build and read, dQ and dK) against dense's ~6*L^2*d, a ratio of
3L/(2*m*e) = 6 at L=8192, m=32, e=64 before padding (about 1.5-2x at L=4096) and sorting, so 10x dense at
L=8192 is out of its reach. The chain rule through the l2-normalisations of q, k and of the output is
ordinary autodiff. Sequences up to COUNTS_MAX_LENGTH = 2048 rows get the exact estimator's same sums
through dense collision counts instead (C_ij = the number of hashes in which q_i and k_j collide;
`_counts_backward`): quadratic, but large matmuls, 3-30x faster than the tables there. `backward="dense"`
replaces the sampled backward by the exact O(L^2) surrogate gradient (short sequences, tests).

Formulations (`formulation=`): the tables above are segment sums and bucket-sorted chunked matmuls, which
suit a CPU, where scatters are serial and small matmuls cheap. On GPUs and TPUs ("auto" there) every table is
a one-hot matmul instead: per hash, onehot(write codes)^T [2^tau, L] times the rows, and the read
onehot(read codes) [L, 2^tau] times the table (`_onehot_cumulate`, `_onehot_feature_tables`), with the
one-hot factor exact in bfloat16 and float32 operands split in two bfloat16 parts. Same codes, same sums.

The 1/sqrt(head_dim) logit scale of the op contract is a no-op here: YOSO only sees directions of q and k.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core import contract
from yoso import hashing

Array = Any

HASHES = ("gaussian", "fast")
BACKWARDS = ("sampled", "dense")
MAX_TAU = 24  # 2^tau buckets per table; beyond this the tables dwarf the sequence
_NORM_EPS = 1e-6


def l2_normalize(x: Array) -> Array:
  """x / max(|x|, eps) along the last axis: zero vectors stay zero with finite gradients."""
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), _NORM_EPS**2))


# Abramowitz & Stegun 4.4.46: arccos(x) = sqrt(1 - x) * sum_n c_n x^n on [0, 1], |error| <= 2e-8.
_ACOS_COEFFS = (1.5707963050, -0.2145988016, 0.0889789874, -0.0501743046, 0.0308918810, -0.0170881256,
                0.0066700901, -0.0012624911)


def arccos_poly(x: Array) -> Array:
  """arccos on [-1, 1] from A&S 4.4.46 and arccos(-x) = pi - arccos(x): |error| <= 2e-8 (float32-exact).

  XLA:CPU lowers jnp.arccos to an atan2 of a sqrt, several times slower than this Horner polynomial, which
  matters in YOSO-E's L^2 elementwise pass.
  """
  a = jnp.abs(x)
  r = jnp.asarray(_ACOS_COEFFS[-1], x.dtype)
  for c in _ACOS_COEFFS[-2::-1]:
    r = r * a + c
  r = jnp.sqrt(1 - a) * r
  return jnp.where(x >= 0, r, np.pi - r)


def _collision_base(cos: Array) -> Array:
  """1 - arccos(cos)/pi: the polynomial arccos up to float32, jnp.arccos for wider types (exact tests)."""
  acos = arccos_poly(cos) if jnp.finfo(cos.dtype).bits <= 32 else jnp.arccos(cos)
  return 1.0 - acos / np.pi


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _collision(cos: Array, tau: int) -> Array:
  return jax.lax.integer_pow(_collision_base(cos), tau)


@_collision.defjvp
def _collision_jvp(tau, primals, tangents):
  # d/dc (1 - arccos(c)/pi)^tau = tau base^(tau-1) / (pi sqrt(1 - c^2)): re-uses base^(tau-1) from the value,
  # so the forward keeps one elementwise pass and no transcendental beyond one sqrt and one rsqrt.
  (cos,), (dcos,) = primals, tangents
  base = _collision_base(cos)
  low = jax.lax.integer_pow(base, tau - 1)
  slope = (tau / np.pi) * low * jax.lax.rsqrt((1 - cos) * (1 + cos))
  return low * base, slope * dcos


def expected_collision(cos: Array, tau: int) -> Array:
  """(1 - arccos(cos)/pi)^tau, the collision probability of `tau` hyperplane bits, with its exact derivative.

  The cosine is clipped a few ulps inside [-1, 1] so that rounding (|q.k| slightly above 1) gives no NaN and
  the arccos derivative stays finite when a query is parallel to a key.
  """
  eps = 8 * float(jnp.finfo(cos.dtype).eps)
  return _collision(jnp.clip(cos, -1.0 + eps, 1.0 - eps), tau)


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
  """P V with the surrogate derivative; qn, kn [g, L, d] unit rows, v [g, L, e], kvalid [g, L]; g = b*h."""
  cos = jnp.einsum("gqd,gkd->gqk", qn, kn)  # [groups, length_q, length_k]
  p = jnp.where(kvalid[:, None, :], surrogate_collision(cos, tau), 0.0)
  return jnp.einsum("gqk,gke->gqe", p, v)  # [groups, length, value_dim]


def _lsh_cumulate(read_codes: Array, write_codes: Array, write_valid: Array, per_group: Any, per_hash: Any,
                  write_fn, read_fn, num_buckets: int, out_dim: int, dtype: Any) -> Array:
  """sum_t read_fn(T_t[read_code_t(i)]), T_t[c] = sum of the write_fn rows j, valid, with write_code_t(j) = c.

  Groups g = batch * heads, heads-major: read_codes, write_codes [g, L, m] int32; write_valid [g, L] bool;
  per_group: pytree with leading axis g; per_hash: pytree with leading axes [m, g] (or None).
  write_fn(group, hash) -> [L, e] rows to insert; read_fn(rows [L, e], group, hash) -> [L, out_dim], where
  group and hash are one group's (and one hash's) slices. Returns [g, L, out_dim]. Groups run one at a time
  (lax.map) with a scan over hashes inside, so one group's rows stay in cache across its hashes and one
  [2^tau + 1, e] table is alive at a time. Against all groups per hash step, at L=16384 (8 heads, m=32) the
  forward measured 421 -> 332 ms and the s=1 sketch's forward+backward 2027 -> 1151 ms; at L=4096 within 6%.
  """
  g, length, _ = read_codes.shape
  # Bucket num_buckets collects invalid rows; read codes never reach it.
  write_ids = jnp.where(write_valid[..., None], write_codes, num_buckets)  # [g, L, m]
  per_hash = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), per_hash)  # leading [g, m]

  def group(xs):
    wids, rids, data, hashes = xs  # [L, m], [L, m], one group's data, per-hash pytree [m, ...]

    def step(acc, hs):
      wid, rid, extra = hs  # [L], [L], one hash's slice
      table = jax.ops.segment_sum(write_fn(data, extra), wid, num_segments=num_buckets + 1)  # [2^tau + 1, e]
      return acc + read_fn(table[rid], data, extra), None

    out, _ = jax.lax.scan(step, jnp.zeros((length, out_dim), dtype), (wids.T, rids.T, hashes))
    return out

  return jax.lax.map(group, (write_ids, read_codes, per_group, per_hash))


FORMULATIONS = ("auto", "sorted", "onehot")


def resolve_formulation(formulation: str, platform: str) -> str:
  """"auto" -> "onehot" on GPU and TPU (matmuls on tensor cores / the MXU), "sorted" elsewhere (CPU)."""
  if formulation != "auto":
    return formulation
  return "onehot" if platform in ("gpu", "tpu") else "sorted"


def _onehot(codes: Array, buckets: int) -> Array:
  """codes [..., L] -> bfloat16 one-hot [..., L, buckets]; codes >= buckets (masked rows) give zero rows."""
  return (codes[..., None] == jnp.arange(buckets, dtype=codes.dtype)).astype(jnp.bfloat16)


def _onehot_matmul(spec: str, onehot: Array, x: Array) -> Array:
  """einsum(spec, onehot, x) with float32 accumulation on the fast matmul units: a float32 x goes as two
  bfloat16 parts (x = hi + lo to 16 significant bits, relative error <= 2^-16 per entry; the one-hot factor
  is exact in bfloat16), float64 x (exact tests) as one float64 product."""
  if x.dtype == jnp.float64:
    return jnp.einsum(spec, onehot.astype(x.dtype), x)
  hi = x.astype(jnp.bfloat16)
  lo = (x - hi.astype(x.dtype)).astype(jnp.bfloat16)
  return (jnp.einsum(spec, onehot, hi, preferred_element_type=jnp.float32)
          + jnp.einsum(spec, onehot, lo, preferred_element_type=jnp.float32)).astype(x.dtype)


def _onehot_cumulate(read_codes: Array, write_codes: Array, write_valid: Array, rows: Array,
                     num_buckets: int) -> Array:
  """sum_t T_t[read_code_t(i)], T_t[c] = sum of the valid rows j with write_code_t(j) = c, as one-hot
  matmuls: T_t = onehot(write codes)^T rows, [2^tau, L] x [L, e], and the read onehot(read codes) T_t.

  The same sums as `_lsh_cumulate` with identity write/read functions. Codes [g, L, m] int32, write_valid
  [g, L], rows [g, L, e] -> [g, L, e]. A scan over hashes with all groups batched: one [g, L, 2^tau]
  one-hot per step. O(L*m*2^tau*e) multiply-adds, all on the matmul units.
  """
  write_codes = jnp.where(write_valid[..., None], write_codes, num_buckets)  # invalid rows: no bucket

  def step(acc, codes):
    rc, wc = codes  # [g, L] each
    table = _onehot_matmul("glc,gle->gce", _onehot(wc, num_buckets), rows)  # [g, 2^tau, e]
    return acc + _onehot_matmul("glc,gce->gle", _onehot(rc, num_buckets), table), None

  out, _ = jax.lax.scan(step, jnp.zeros(rows.shape, rows.dtype),
                        (jnp.moveaxis(read_codes, -1, 0), jnp.moveaxis(write_codes, -1, 0)))
  return out


ONEHOT_STEP_BYTES = 1 << 30  # float32 [groups, L, e*d] rows per step of the one-hot feature tables


def _onehot_feature_tables(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array,
                           dy: Array, num_buckets: int, directions: Array | None = None
                           ) -> tuple[Array, Array]:
  """`_feature_tables`' sums as one-hot matmuls: per hash, bucket c's table T[c] = sum_{j in c} v_j k_j^T
  is row c of onehot(k codes)^T (v (x) k), [2^tau, L] x [L, e*d], and each query's read dY_i^T T[code(i)]
  contracts dY_i with row i of onehot(q codes) T; dK alike with U[c] = sum_{i in c} dY_i q_i^T. With
  directions [m, g, e, s], v and dY are first projected on the hash's s directions (the sketch).

  Shapes and result as in `_feature_tables`. O(L*m*2^tau*e*d) multiply-adds (2^tau times the sorted
  tables' work, but in large matmuls); hashes are scanned and groups vmapped in batches whose [L, e*d]
  rows stay within ONEHOT_STEP_BYTES (all groups at once at L=4096, e=d=64; 4 at a time at 16K).
  """
  _, length, d = qn.shape
  kcodes = jnp.where(kvalid[..., None], kcodes, num_buckets)  # masked keys write and read nothing
  if directions is not None:
    directions = jnp.swapaxes(directions, 0, 1)  # [g, m, e, s]

  def outer(w, x):  # [L, s], [L, d] -> [L, s * d]
    return (w[:, :, None] * x[:, None, :]).reshape(length, -1)

  def read(onehot, table, w):  # [L, c], [c, s * d], [L, s] -> sum_f w_if table[code(i)]_f, [L, d]
    rows = _onehot_matmul("lc,cx->lx", onehot, table).reshape(length, -1, d)  # [L, s, d]
    return jnp.einsum("ls,lsd->ld", w, rows)

  def group(xs):
    qc, kc, r, q, k, vg, dyg = xs  # [L, m] x2; None or [m, e, s]; [L, d] x2; [L, e] x2

    def hash_step(acc, per_hash):
      qct, kct, rt = per_hash
      a, b = (dyg, vg) if rt is None else (dyg @ rt, vg @ rt)  # [L, e] or the sketch's [L, s]
      oq, ok = _onehot(qct, num_buckets), _onehot(kct, num_buckets)  # [L, 2^tau]
      dq = read(oq, _onehot_matmul("lc,lx->cx", ok, outer(b, k)), a)  # queries read sum v_j k_j^T
      dk = read(ok, _onehot_matmul("lc,lx->cx", oq, outer(a, q)), b)  # keys read sum dY_i q_i^T
      return (acc[0] + dq, acc[1] + dk), None

    out, _ = jax.lax.scan(hash_step, (jnp.zeros_like(q), jnp.zeros_like(k)), (qc.T, kc.T, r))
    return out

  width = v.shape[-1] if directions is None else directions.shape[-1]
  batch = max(1, min(qn.shape[0], ONEHOT_STEP_BYTES // (length * width * d * 4)))
  return jax.lax.map(group, (qcodes, kcodes, directions, qn, kn, v, dy), batch_size=batch)


MAX_CHUNK = 16  # rows per matmul block in the exact backward; more pads more (measured 16 > 32 > 8 at L=4096)


def _chunk_size(length: int, buckets: int) -> int:
  """The largest power of two <= MAX_CHUNK and <= twice the mean bucket size (padding stays below ~L)."""
  chunk = 1
  while chunk * 2 <= min(MAX_CHUNK, 2 * length / buckets):
    chunk *= 2
  return chunk


def _sort_by_code(codes: Array, buckets: int) -> tuple[Array, Array]:
  """(order, sorted codes) of codes [L] in [0, buckets): a stable sort by code.

  When code * L + row fits in int32 (tau <= 8 up to L = 8M rows) one plain sort of those packed keys does it,
  ~4x faster on XLA:CPU than argsort's sort of (key, index) pairs; otherwise argsort.
  """
  length = codes.shape[0]
  rows = jnp.arange(length, dtype=jnp.int32)
  if buckets * length < 2**31:
    packed = jnp.sort(codes.astype(jnp.int32) * length + rows)
    return packed % length, packed // length
  order = jnp.argsort(codes, stable=True).astype(jnp.int32)
  return order, codes[order]


def _bucket_layout(codes: Array, buckets: int, chunk: int, padded_length: int) -> tuple[Array, Array, Array]:
  """Rows sorted by bucket, each bucket padded to a multiple of `chunk` rows, so every chunk of the padded
  order lies in one bucket. codes [L] in [0, buckets) -> slot [L] (each row's padded position, a permutation
  into [0, padded_length)), source [padded_length] (the row at each padded position, L for padding) and
  chunk_bucket [padded_length // chunk] (`buckets` for the unused tail)."""
  length = codes.shape[0]
  counts = jnp.zeros((buckets,), jnp.int32).at[codes].add(1)
  padded = (counts + chunk - 1) // chunk * chunk
  ends = jnp.cumsum(padded)
  order, sorted_codes = _sort_by_code(codes, buckets)
  rank = jnp.arange(length, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_codes]  # within bucket
  sorted_slot = (ends - padded)[sorted_codes] + rank
  slot = jnp.zeros((length,), jnp.int32).at[order].set(sorted_slot, unique_indices=True)
  source = jnp.full((padded_length,), length, jnp.int32).at[sorted_slot].set(order, unique_indices=True)
  # Every chunk a bucket spans holds at least one of its rows (padding < chunk), so the rows name the chunks.
  chunk_bucket = jnp.full((padded_length // chunk,), buckets, jnp.int32).at[sorted_slot // chunk].set(
      sorted_codes.astype(jnp.int32))
  return slot, source, chunk_bucket


def _feature_tables(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array, dy: Array,
                    num_buckets: int, directions: Array | None = None) -> tuple[Array, Array]:
  """sum_t sum_j B^t_ij (dY_i . v_j) k_j and sum_t sum_i B^t_ij (dY_i . v_j) q_i for all hashes t: exactly
  (directions None), or with `dY . v` sketched per hash as `(dY R_t) . (v R_t)` (directions [m, g, e, s]).

  Groups heads-major: qcodes, kcodes [g, L, m]; kvalid [g, L]; qn, kn [g, L, d]; v, dy [g, L, e]. Returns
  (dq, dk) [g, L, d] each, unscaled; masked keys write nothing, and read nothing (their bucket has no query).

  The paper's per-feature tables, all features at once: per hash, bucket b's table is the [e, d] matrix
  T_b = sum_{j in b} v_j k_j^T and query i reads dY_i^T T_{code(i)} (dK alike with U_b = sum_{i in b} dY_i
  q_i^T read by v_j). Rather than e scatters of d-wide rows per hash (memory-bound on CPU), rows are sorted
  by code with every bucket padded to a multiple of `chunk` rows, so T is a batched [e, chunk] x [chunk, d]
  matmul per chunk summed over each bucket's chunks, and the read is a batched matmul of each query chunk
  with its bucket's table. Same O(L*m*e*d) work (plus padding), faster on CPU than e scatters of d-vectors
  per hash (at L=4096, 8 heads, m=32: 2.3-2.7x for the exact tables; with an s=8 sketch 0.66 s against about
  1.0 s for dQ and dK); tests check it against the sum over colliding pairs. Groups run one at a time
  (lax.map) so that a group's rows stay in cache across its hashes (vmapped groups measured 2x slower).
  """
  _, length, _ = qcodes.shape
  buckets = num_buckets + 1  # the extra bucket holds masked keys; query codes never reach it
  chunk = _chunk_size(length, buckets)
  padded_length = -(-(length + buckets * (chunk - 1)) // chunk) * chunk  # worst case over bucket sizes
  num_chunks = padded_length // chunk

  def pad(x, source):  # [L, f] -> [num_chunks, chunk, f], zeros between buckets (a gather; source L fills)
    return jnp.take(x, source, axis=0, mode="fill", fill_value=0).reshape(num_chunks, chunk, -1)

  def tables(a, b, chunk_bucket):  # [n, C, e], [n, C, d] -> [buckets + 1, e, d]
    per_chunk = jnp.einsum("nce,ncd->ned", a, b)  # [num_chunks, e, d]
    return jax.ops.segment_sum(per_chunk, chunk_bucket, num_segments=buckets + 1, indices_are_sorted=True)

  def read(a, table, chunk_bucket, slot):  # a [n, C, e], table [buckets + 1, e, d] -> [L, d]
    return jnp.einsum("nce,ned->ncd", a, table[chunk_bucket]).reshape(padded_length, -1)[slot]

  kcodes = jnp.where(kvalid[..., None], kcodes, num_buckets)
  layout = jax.vmap(jax.vmap(functools.partial(_bucket_layout, buckets=buckets, chunk=chunk,
                                               padded_length=padded_length)))
  # Every hash's layout up front: one batched sort is cheaper than m small ones inside the loop.
  qlay, klay = layout(jnp.swapaxes(qcodes, 1, 2)), layout(jnp.swapaxes(kcodes, 1, 2))  # each [g, m, ...]

  if directions is not None:
    directions = jnp.swapaxes(directions, 0, 1)  # [g, m, e, s]

  def group(xs):
    qlay, klay, r, q, k, vg, dyg = xs  # layouts [m, ...] each; None or [m, e, s]; [L, d] x2; [L, e] x2

    def hash_step(acc, per_hash):
      (qslot, qsrc, qchunks), (kslot, ksrc, kchunks), rt = per_hash
      vt, dyt = (vg, dyg) if rt is None else (vg @ rt, dyg @ rt)  # [L, e] or the sketch's [L, s]
      pv, pdy = pad(vt, ksrc), pad(dyt, qsrc)
      dq = read(pdy, tables(pv, pad(k, ksrc), kchunks), qchunks, qslot)  # queries read sum v_j k_j^T
      dk = read(pv, tables(pdy, pad(q, qsrc), qchunks), kchunks, kslot)  # keys read sum dY_i q_i^T
      return (acc[0] + dq, acc[1] + dk), None

    init = (jnp.zeros_like(q), jnp.zeros_like(k))
    out, _ = jax.lax.scan(hash_step, init, (qlay, klay, r))  # scanned over hashes
    return out

  return jax.lax.map(group, (qlay, klay, directions, qn, kn, v, dy))


SCATTER_FEATURES = 2  # sketches this narrow use segment sums: faster than chunks at s <= 2, slower at s = 4


def _sketched_tables(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array, dy: Array,
                     num_buckets: int, directions: Array) -> tuple[Array, Array, Array]:
  """(dq, dk, dv) unscaled for a narrow sketch, the backward in forward form: per hash, the value-space
  projections a = dY R_t, b = v R_t [g, L, s] turn both bilinear sums into ordinary LSH cumulations of
  s*d-wide rows, dQ_i = sum_f a_if T_t[code(i)]_f with T_t[c]_f = sum_{j in c} b_jf k_j, and dK_j =
  sum_f b_jf U_t[code(j)]_f with U_t[c]_f = sum_{i in c} a_if q_i. dV rides in U's table (its dY columns), so
  the backward is two passes over the hashes, like two forwards of width s*d (+ e).

  Shapes as in `_feature_tables`; directions [m, g, e, s]. dv [g, L, e] is sum_t sum_i B^t_ij dY_i, unscaled,
  for every key (the caller zeroes masked keys and divides by m).
  """
  g, length, d = qn.shape
  e = v.shape[-1]
  s = directions.shape[-1]
  a = jnp.einsum("gle,mges->mgls", dy, directions)  # [m, g, L, s]
  b = jnp.einsum("gle,mges->mgls", v, directions)  # [m, g, L, s]

  def outer(w, x):  # [L, s], [L, d] -> [L, s * d]
    return (w[:, :, None] * x[:, None, :]).reshape(length, s * d)

  def contract(w, rows):  # [L, s], [L, s * d] -> [L, d]
    return jnp.einsum("ls,lsd->ld", w, rows.reshape(length, s, d))

  dq = _lsh_cumulate(qcodes, kcodes, kvalid, kn, (a, b), lambda kg, ab: outer(ab[1], kg),
                     lambda rows, _, ab: contract(ab[0], rows), num_buckets, d, qn.dtype)
  qvalid = jnp.ones(kvalid.shape, bool)
  dvk = _lsh_cumulate(kcodes, qcodes, qvalid, (qn, dy), (a, b),
                      lambda qdy, ab: jnp.concatenate([qdy[1], outer(ab[0], qdy[0])], -1),
                      lambda rows, _, ab: jnp.concatenate([rows[:, :e], contract(ab[1], rows[:, e:])], -1),
                      num_buckets, e + d, qn.dtype)
  return dq, dvk[..., e:], dvk[..., :e]


def _sketch_directions(rng: Array, batch: int, heads: int, num_hashes: int, value_dim: int,
                       features: int | None, dtype: Any) -> Array | None:
  """[m, batch * heads, e, s] value-space directions per hash with E[R R^T] = I (shared over the batch).

  None (features None or >= value_dim) means the e unit vectors: the exact per-feature decomposition.
  """
  if features is None or features >= value_dim:
    return None
  gauss = jax.random.normal(rng, (num_hashes, heads, value_dim, features), dtype)
  r, _ = jnp.linalg.qr(gauss)  # orthonormal columns spanning a uniformly random s-dim subspace
  r = r * np.sqrt(value_dim / features).astype(dtype)  # E[r r^T] = I
  return jnp.broadcast_to(r[:, None], (num_hashes, batch, heads, value_dim, features)).reshape(
      num_hashes, batch * heads, value_dim, features)


# Up to this length the exact backward runs on dense collision counts (`_counts_backward`): the same sums,
# O(L^2 * (m + d)) in large matmuls instead of O(L * m * d * e) in padded per-bucket tables. Measured fwd+bwd
# at 8 heads, d=64, m=32 (tables -> counts): L=512 813 -> 28 ms, 1024 1172 -> 86, 2048 1398 -> 281, 4096
# 1924 -> 1062 (temp memory 186 -> 253 MB). Counts would still win at 4096, but above 2048 the backward stays
# linear in L as the op promises; only "short" sequences take the quadratic form.
COUNTS_MAX_LENGTH = 2048


def _collision_counts(qcodes: Array, kcodes: Array, kvalid: Array, dtype: Any) -> Array:
  """C_ij = number of hashes t with code_t(q_i) = code_t(k_j), 0 for masked keys: m * (the mean of B^t).

  One group: qcodes, kcodes [L, m]; kvalid [L]. Returns [L_q, L_k] in dtype. O(L^2 * m) compares.
  """
  counts = jnp.sum(qcodes[:, None, :] == kcodes[None, :, :], axis=-1, dtype=jnp.int32)  # [L_q, L_k]
  return jnp.where(kvalid[None, :], counts, 0).astype(dtype)


def _counts_backward(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array,
                     dy: Array) -> tuple[Array, Array, Array]:
  """(dq, dk, dv) unscaled, exactly the per-feature tables' sums, through dense counts C (short sequences):
  dQ = (C * dY V^T) K, dK = (C * dY V^T)^T Q, dV = C^T dY. Shapes as in `_feature_tables`. O(L^2 * (m + d))
  time and O(L^2) memory per group (groups run one at a time): see COUNTS_MAX_LENGTH for when it is used.
  """
  def group(xs):
    qc, kc, valid, q, k, vg, dyg = xs
    counts = _collision_counts(qc, kc, valid, q.dtype)  # [L_q, L_k]
    weight = counts * (dyg @ vg.T)  # [L_q, L_k]
    return weight @ k, weight.T @ q, counts.T @ dyg
  return jax.lax.map(group, (qcodes, kcodes, kvalid, qn, kn, v, dy))


def _make_cumulation(tau: int, backward: str, formulation: str = "sorted"):
  """The custom_vjp core on groups g = batch * heads: (qn, kn [g, L, d], v [g, L, e], codes [g, L, m], kvalid
  [g, L], directions) -> the mean over hashes of B V [g, L, e], not normalised. formulation "sorted" (segment
  sums and bucket-sorted tables, for CPUs) or "onehot" (one-hot matmuls, for GPUs and TPUs): the same sums."""
  num_buckets = 1 << tau

  @jax.custom_vjp
  def cumulation(qn, kn, v, qcodes, kcodes, kvalid, directions):
    return _forward(v, qcodes, kcodes, kvalid)

  def _forward(v, qcodes, kcodes, kvalid):
    m = qcodes.shape[-1]
    if formulation == "onehot":
      return _onehot_cumulate(qcodes, kcodes, kvalid, v, num_buckets) / m
    out = _lsh_cumulate(qcodes, kcodes, kvalid, v, None, lambda vg, _: vg, lambda rows, *_: rows, num_buckets,
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
    e = v.shape[-1]
    kv = kvalid[..., None]
    scale = (tau / 2) / m
    # dQ_i = (tau/2)/m sum B_ij (dY_i . v_j) k_j and dK_j = (tau/2)/m sum B_ij (dY_i . v_j) q_i.
    if directions is None and qcodes.shape[1] <= COUNTS_MAX_LENGTH:
      dq, dk, dv = _counts_backward(qcodes, kcodes, kvalid, qn, kn, v, dy)
    elif formulation == "onehot":
      dv = _onehot_cumulate(kcodes, qcodes, jnp.ones(kvalid.shape, bool), dy, num_buckets)
      dq, dk = _onehot_feature_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, directions)
    elif directions is not None and directions.shape[-1] <= SCATTER_FEATURES:
      dq, dk, dv = _sketched_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, directions)
    else:
      # dV: tables of dY keyed by query codes, read at key codes; every query read the forward, so every
      # query's cotangent is inserted.
      qvalid = jnp.ones(kvalid.shape, bool)
      dv = _lsh_cumulate(kcodes, qcodes, qvalid, dy, None, lambda dyg, _: dyg, lambda rows, *_: rows,
                         num_buckets, e, v.dtype)
      dq, dk = _feature_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, directions)
    dv = jnp.where(kv, dv / m, 0.0)
    dq, dk = scale * dq, scale * dk
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
         backward: str = "sampled", backward_features: int | None = None, formulation: str = "auto") -> Array:
  """YOSO-m attention: the mean over `num_hashes` LSH samples of B V, l2-normalised per row when asked.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool
  (True = real key; masked keys are never inserted in a table). rng: a PRNG key; the same key gives the same
  hash functions (and backward sketch), so pass a fresh key per training step and a fixed one in evaluation.
  hash: "gaussian" (exact hyperplanes) or "fast" (Hadamard rotations, power-of-two head_dim).
  backward: "sampled" (linear cost, re-uses the forward's codes) or "dense" (exact O(L^2) surrogate gradient).
  backward_features: None (default) computes the sampled dQ/dK with every value feature, exactly the paper's
  estimator, O(L*m*d*value_dim) (up to L = 2048 through dense collision counts, O(L^2*(m + d)), faster
  there); an int s sketches the value space with s random directions per hash, O(L*m*s*d), unbiased but with
  about value_dim/s times the gradient variance (s <= 2: two forward-like passes, 5.5x faster than the
  exact form at L=4096; the "yoso_sketch" registry op uses s=1).
  formulation: how the bucket tables are built and read, the same estimator and sums either way: "sorted"
  (segment sums and bucket-sorted chunked matmuls, serial-scatter friendly: CPUs), "onehot" (one-hot matmuls,
  2^tau times the multiply-adds but all on tensor cores / the MXU: GPUs and TPUs), "auto" (by backend).
  Returns [batch, length, heads, value_dim] in v's dtype.
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
  formulation = resolve_formulation(
      contract.check_choice(formulation, name="formulation", allowed=FORMULATIONS, op=op), contract.backend())
  if backward_features is not None:
    backward_features = contract.check_positive_int(backward_features, name="backward_features", op=op)
  heads, head_dim = q.shape[2:]
  if hash == "fast" and not hashing.is_power_of_two(head_dim):
    raise ValueError(f"{op}: argument 'hash'='fast' needs a power-of-two head_dim, got head_dim={head_dim}; "
                     f"use hash='gaussian'")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  batch, length = q.shape[:2]
  hash_rng, sketch_rng = jax.random.split(rng)
  # Heads-major inside: XLA's CPU dots and gathers are several times faster with (batch, heads) leading.
  qn = l2_normalize(jnp.swapaxes(q, 1, 2).astype(ct))  # [batch, heads, length, head_dim]
  kn = l2_normalize(jnp.swapaxes(k, 1, 2).astype(ct))
  vh = jnp.swapaxes(v, 1, 2).astype(ct)  # [batch, heads, length, value_dim]
  # Codes are integers: no gradient flows through hashing; the custom backward supplies dQ and dK.
  lsh = dict(num_hashes=num_hashes, tau=tau, method=hash)
  qcodes = hashing.hash_codes(jax.lax.stop_gradient(qn), hash_rng, **lsh)  # [batch, heads, length, m]
  kcodes = hashing.hash_codes(jax.lax.stop_gradient(kn), hash_rng, **lsh)
  directions = _sketch_directions(sketch_rng, batch, heads, num_hashes, v.shape[-1], backward_features, ct)
  groups = batch * heads

  def flat(x):  # [batch, heads, length, ...] -> [batch * heads, length, ...]
    return x.reshape(groups, length, *x.shape[3:])

  kvalid = jnp.broadcast_to(mask[:, None, :], (batch, heads, length))
  out = _make_cumulation(tau, backward, formulation)(flat(qn), flat(kn), flat(vh), flat(qcodes), flat(kcodes),
                                         flat(kvalid), directions)  # [batch * heads, length, value_dim]
  if normalize_output:
    out = l2_normalize(out)
  out = out.reshape(batch, heads, length, -1)
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [batch, length, heads, value_dim]


def yoso_e(q: Array, k: Array, v: Array, *, tau: int, causal: bool = False, mask: Array | None = None,
           normalize_output: bool = True) -> Array:
  """YOSO-E: the expectation P V with P_ij = (1 - arccos(q_i . k_j)/pi)^tau on l2-normalised q, k; O(L^2).

  Shapes as in `yoso`. Gradients are the exact derivatives of the expectation (a custom_jvp that re-uses
  the forward's `base^(tau-1)`; below float64 the arccos is the A&S 4.4.46 polynomial, `arccos_poly`).
  """
  op = "yoso_e"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  _check_bidirectional(causal, op)
  tau = _check_tau(tau, op)
  normalize_output = contract.check_bool(normalize_output, name="normalize_output", op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  qn = l2_normalize(jnp.swapaxes(q, 1, 2).astype(ct))  # [batch, heads, length, head_dim]
  kn = l2_normalize(jnp.swapaxes(k, 1, 2).astype(ct))
  # Masked keys are zeroed in V rather than in P: one [L, L] elementwise pass less, and their P column then
  # receives an exactly zero cotangent, so they still get no gradient.
  vh = jnp.where(mask[:, None, :, None], jnp.swapaxes(v, 1, 2).astype(ct), 0.0)  # [batch, heads, length, e]
  cos = jnp.einsum("bhqd,bhkd->bhqk", qn, kn)  # [batch, heads, length_q, length_k]
  out = jnp.einsum("bhqk,bhke->bhqe", expected_collision(cos, tau), vh)  # [batch, heads, length, e]
  if normalize_output:
    out = l2_normalize(out)
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [batch, length, heads, value_dim]


def depthwise_conv(v: Array, kernel: Array, mask: Array | None = None) -> Array:
  """Per-head convolution of V along the sequence ("same" zero padding), one kernel per head shared by its
  dims.

  v: [batch, length, heads, value_dim]; kernel: [heads, size] or [size] (shared by all heads), size odd;
  mask: [batch, length] (padded tokens are zeroed first, so their contents never reach a real token).
  Returns [batch, length, heads, value_dim] in v's dtype. O(L * size * heads * value_dim).
  """
  if mask is not None:
    v = jnp.where(mask[:, :, None, None], v, 0)
  b, length, h, e = v.shape
  kernel = jnp.broadcast_to(jnp.asarray(kernel), (h, jnp.shape(kernel)[-1]))
  size = kernel.shape[-1]
  if size % 2 == 0:
    raise ValueError(f"depthwise_conv: the kernel size must be odd, got {size}")
  # Channels = heads * value_dim with each head's kernel repeated over its dims: a grouped (depthwise) conv.
  rhs = jnp.repeat(kernel.T, e, axis=1)[:, None, :].astype(v.dtype)  # [size, 1, heads * value_dim]
  out = jax.lax.conv_general_dilated(
      v.reshape(b, length, h * e), rhs, window_strides=(1,), padding=[(size // 2, size // 2)],
      dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=h * e)  # [batch, length, heads * e]
  return out.reshape(b, length, h, e)


def yoso_c(q: Array, k: Array, v: Array, *, rng: Array, num_hashes: int, tau: int, conv_kernel: Array,
           causal: bool = False, mask: Array | None = None, normalize_output: bool = True,
           hash: str = "gaussian", backward: str = "sampled", backward_features: int | None = None,
           formulation: str = "auto") -> Array:
  """YOSO-C (paper section 4.2): `yoso(...)` plus a per-head depthwise convolution of V (`depthwise_conv`).

  conv_kernel: [heads, size] or [size], size odd, an explicit input like YOSO's rng (the model owns it as a
  parameter). Other arguments as in `yoso`. Returns [batch, length, heads, value_dim] in v's dtype.
  """
  out = yoso(q, k, v, rng=rng, num_hashes=num_hashes, tau=tau, causal=causal, mask=mask,
             normalize_output=normalize_output, hash=hash, backward=backward,
             backward_features=backward_features, formulation=formulation)
  shape = jnp.shape(conv_kernel)
  if len(shape) not in (1, 2) or shape[-1] % 2 == 0 or (len(shape) == 2 and shape[0] != q.shape[2]):
    raise ValueError(f"yoso_c: argument 'conv_kernel' must be [heads={q.shape[2]}, size] or [size] with an "
                     f"odd size, got shape {shape}")
  conv = depthwise_conv(v, conv_kernel, None if mask is None else jnp.asarray(mask, bool))
  return (out + conv).astype(v.dtype)  # [batch, length, heads, value_dim]
