"""YOSO's LSH bucket tables: per hash, `2^tau` buckets each holding a sum over the rows hashed there, read
back by the rows of the other side. Masked keys go to an extra bucket that no query ever reads.

The forward (`cumulate`, paper section 3.2) sums value rows per bucket. The sampled backward (section 3.3)
needs the same sums of dY for dV, and for dQ/dK the paper's per-feature tables: bucket c's [e, d] matrix
`T_c = sum_{j in c} v_j k_j^T` read as `dY_i^T T_{code(i)}` (dK alike), or, with a value-space sketch of `s`
directions per hash, the same tables of width s (`backward_tables`).

Two formulations of the same sums (`formulation=`). "sorted" suits a CPU, where scatters are serial and small
matmuls cheap: segment sums (`_lsh_cumulate`), and for the per-feature tables bucket-sorted, chunk-padded
batched matmuls (`_feature_tables`), faster on CPU than e scatters of d-vectors per hash; sketches of
s <= SCATTER_FEATURES directions stay plain segment sums of s*d-wide rows (`_sketched_tables`). "onehot":
per hash, onehot(write codes)^T [2^tau, L] times the rows, and the read onehot(read codes) [L, 2^tau] times
the table (`_onehot_cumulate`, `_onehot_feature_tables`), with the one-hot factor exact in bfloat16 and
float32 operands split in two bfloat16 parts. "pallas" ("auto" on GPUs and TPUs): the same one-hot sums in
the fused kernels of `yoso.kernels`, and the exact dQ/dK as sums over code-sorted pairs
(`_pallas_feature_tables`). Same codes, same sums.

The causal form sums, for row i, only the rows j <= i of its bucket (the forward and dQ) or j >= i (dV, dK):
no table holds that, so per hash the rows are sorted by (bucket, position) and a segmented running sum that
restarts at every bucket is read at each reader's place in the order (`_bucket_prefix_sums`): O(L log L)
for the sort, O(L*e) for the sums, one formulation on every backend.

Groups g = batch * heads, heads-major, throughout: codes [g, L, m] int32, rows [g, L, ...].
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from yoso import kernels

Array = Any


POSITIONS = ("all", "prefix", "suffix")


def _segmented_running_sum(rows: Array, starts: Array, reverse: bool) -> Array:
  """Inclusive running sums of rows [n, e] along axis 0 that restart at every True of starts [n] (a segment's
  first row in the scan's direction: from the end when reverse). [n, e].

  A select, not a subtraction of global prefix sums: no cancellation, and a non-finite row reaches only the
  later rows of its own segment.
  """
  def combine(a, b):
    (start_a, sum_a), (start_b, sum_b) = a, b
    return start_a | start_b, jnp.where(start_b, sum_b, sum_a + sum_b)

  return jax.lax.associative_scan(combine, (starts[:, None], rows), reverse=reverse)[1]


def _bucket_prefix_sums(read_codes: Array, write_ids: Array, rows: Array, num_buckets: int,
                        reverse: bool) -> Array:
  """One hash of one group: out_i = sum of rows j with write_ids[j] == read_codes[i] and j <= i (j >= i when
  reverse). read_codes [L] in [0, num_buckets); write_ids [L] in [0, num_buckets] (num_buckets: a row no
  reader sees); rows [L, e] -> [L, e].

  The 2L items (a writer and a reader per position, the writer first in the scan's direction so that a row's
  own position counts) are stably sorted by code, i.e. by (code, position); a running sum that restarts at
  every code, read at each reader's place, is the sum of the writers before it in its bucket. A row after
  the reader (a future position) never enters its sum, even when it is not finite.
  """
  length = read_codes.shape[0]
  writer_slot = 1 if reverse else 0
  pair = (read_codes, write_ids) if reverse else (write_ids, read_codes)
  items = jnp.stack(pair, axis=-1).reshape(2 * length)  # item 2p + slot
  order, codes = _sort_by_code(items, num_buckets + 1)  # [2L] each, by (code, position, slot)
  writer = (order % 2 == writer_slot)[:, None]
  sorted_rows = jnp.where(writer, rows[order // 2], 0)  # [2L, e]; readers add nothing
  starts = codes != jnp.roll(codes, -1 if reverse else 1)  # a bucket's first item in the scan's direction
  sums = _segmented_running_sum(sorted_rows, starts, reverse)  # [2L, e]
  place = jnp.zeros((2 * length,), jnp.int32).at[order].set(jnp.arange(2 * length, dtype=jnp.int32),
                                                            unique_indices=True)  # item -> sorted index
  return sums[place[1 - writer_slot::2]]  # [L, e]: at the readers' places


def _lsh_cumulate(read_codes: Array, write_codes: Array, write_valid: Array, per_group: Any, per_hash: Any,
                  write_fn, read_fn, num_buckets: int, out_dim: int, dtype: Any, positions: str = "all"
                  ) -> Array:
  """sum_t read_fn(T_t[read_code_t(i)]), T_t[c] = sum of the write_fn rows j, valid, with write_code_t(j) = c.

  Groups g = batch * heads, heads-major: read_codes, write_codes [g, L, m] int32; write_valid [g, L] bool;
  per_group: pytree with leading axis g; per_hash: pytree with leading axes [m, g] (or None).
  write_fn(group, hash) -> [L, e] rows to insert; read_fn(rows [L, e], group, hash) -> [L, out_dim], where
  group and hash are one group's (and one hash's) slices. Returns [g, L, out_dim]. Groups run one at a time
  (lax.map) with a scan over hashes inside, so one group's rows stay in cache across its hashes and one
  [2^tau + 1, e] table is alive at a time, which keeps long sequences from growing super-linearly.
  positions: which rows j reach row i: "all" (the table), "prefix" (j <= i) or "suffix" (j >= i), the causal
  sums, through `_bucket_prefix_sums` (O(L*e) live rows per hash instead of a table).
  """
  g, length, _ = read_codes.shape
  # Bucket num_buckets collects invalid rows; read codes never reach it.
  write_ids = jnp.where(write_valid[..., None], write_codes, num_buckets)  # [g, L, m]
  per_hash = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), per_hash)  # leading [g, m]

  def group(xs):
    wids, rids, data, hashes = xs  # [L, m], [L, m], one group's data, per-hash pytree [m, ...]

    def step(acc, hs):
      wid, rid, extra = hs  # [L], [L], one hash's slice
      rows = write_fn(data, extra)  # [L, e]
      if positions == "all":
        read = jax.ops.segment_sum(rows, wid, num_segments=num_buckets + 1)[rid]  # table [2^tau + 1, e]
      else:
        read = _bucket_prefix_sums(rid, wid, rows, num_buckets, reverse=positions == "suffix")
      return acc + read_fn(read, data, extra), None

    out, _ = jax.lax.scan(step, jnp.zeros((length, out_dim), dtype), (wids.T, rids.T, hashes))
    return out

  return jax.lax.map(group, (write_ids, read_codes, per_group, per_hash))


FORMULATIONS = ("auto", "sorted", "onehot", "pallas")


def resolve_formulation(formulation: str, platform: str) -> str:
  """"auto" -> "pallas" on GPU and TPU (one-hot matmuls made on chip, `yoso.kernels`), "sorted" elsewhere
  (CPU). `yoso.attention.yoso` asks per lowering platform (`attention_core.contract.per_platform`)."""
  if formulation != "auto":
    return formulation
  return "pallas" if platform in ("gpu", "tpu") else "sorted"


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


def _drop_invalid(write_codes: Array, write_valid: Array, rows: Array, num_buckets: int
                  ) -> tuple[Array, Array]:
  """For the one-hot products: invalid rows get no bucket (code num_buckets) and zero values, since a zero
  one-hot entry times a NaN row is still NaN. write_codes [g, L, m], write_valid [g, L], rows [g, L, e]."""
  valid = write_valid[..., None]
  return jnp.where(valid, write_codes, num_buckets), jnp.where(valid, rows, 0)


def _onehot_cumulate(read_codes: Array, write_codes: Array, write_valid: Array, rows: Array,
                     num_buckets: int) -> Array:
  """sum_t T_t[read_code_t(i)], T_t[c] = sum of the valid rows j with write_code_t(j) = c, as one-hot
  matmuls: T_t = onehot(write codes)^T rows, [2^tau, L] x [L, e], and the read onehot(read codes) T_t.

  The same sums as `_lsh_cumulate` with identity write/read functions. Codes [g, L, m] int32, write_valid
  [g, L], rows [g, L, e] -> [g, L, e]. A scan over hashes with all groups batched: one [g, L, 2^tau]
  one-hot per step. O(L*m*2^tau*e) multiply-adds, all on the matmul units.
  """
  write_codes, rows = _drop_invalid(write_codes, write_valid, rows, num_buckets)

  def step(acc, codes):
    rc, wc = codes  # [g, L] each
    table = _onehot_matmul("glc,gle->gce", _onehot(wc, num_buckets), rows)  # [g, 2^tau, e]
    return acc + _onehot_matmul("glc,gce->gle", _onehot(rc, num_buckets), table), None

  out, _ = jax.lax.scan(step, jnp.zeros(rows.shape, rows.dtype),
                        (jnp.moveaxis(read_codes, -1, 0), jnp.moveaxis(write_codes, -1, 0)))
  return out


def _hash_major(codes: Array) -> Array:
  """[g, L, m] -> [g, m, L], the kernels' layout (one hash's codes contiguous)."""
  return jnp.swapaxes(codes, 1, 2)


def _pallas_cumulate(read_codes: Array, write_codes: Array, write_valid: Array, rows: Array,
                     num_buckets: int, operands: str) -> Array:
  """`_onehot_cumulate`'s sums through the fused kernels (`yoso.kernels`): one build launch for every
  hash's table, one read launch. Shapes as there."""
  write_codes, rows = _drop_invalid(write_codes, write_valid, rows, num_buckets)
  (table,) = kernels.build(_hash_major(write_codes), [rows], buckets=num_buckets, operands=operands)
  (out,) = kernels.read(_hash_major(read_codes), [table], operands=operands)  # [g, L, e]
  return out.astype(rows.dtype)


def cumulate(read_codes: Array, write_codes: Array, write_valid: Array, rows: Array, num_buckets: int,
             formulation: str, positions: str = "all", operands: str = "float32") -> Array:
  """sum_t T_t[read_code_t(i)], T_t[c] = sum of the valid rows j with write_code_t(j) = c: the forward's
  tables (values keyed by key codes, read by queries) and dV's (dY keyed by query codes, read by keys).

  read_codes, write_codes [g, L, m] int32; write_valid [g, L]; rows [g, L, e] -> [g, L, e], unscaled.
  formulation "sorted" (segment sums), "onehot" (one-hot matmuls) or "pallas" (the same in fused kernels,
  matmul operands `operands`). positions "prefix" / "suffix" keep only the rows j <= i / j >= i (the causal
  form; sorted running sums whatever the formulation).
  """
  if formulation == "pallas" and positions == "all":
    return _pallas_cumulate(read_codes, write_codes, write_valid, rows, num_buckets, operands)
  if formulation == "onehot" and positions == "all":
    return _onehot_cumulate(read_codes, write_codes, write_valid, rows, num_buckets)
  return _lsh_cumulate(read_codes, write_codes, write_valid, rows, None, lambda x, _: x, lambda x, *_: x,
                       num_buckets, rows.shape[-1], rows.dtype, positions)



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
  kn, v = (jnp.where(kvalid[..., None], x, 0) for x in (kn, v))  # nor reach a product (0 * NaN is NaN)
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


MAX_CHUNK = 16  # rows per matmul block in the exact backward; more pads more, fewer runs smaller matmuls


def _chunk_size(length: int, buckets: int) -> int:
  """The largest power of two <= MAX_CHUNK and <= twice the mean bucket size (padding stays below ~L)."""
  chunk = 1
  while chunk * 2 <= min(MAX_CHUNK, 2 * length / buckets):
    chunk *= 2
  return chunk


def _sort_by_code(codes: Array, buckets: int) -> tuple[Array, Array]:
  """(order, sorted codes) of codes [L] in [0, buckets): a stable sort by code.

  When code * L + row fits in int32 (tau <= 8 up to L = 8M rows) one plain sort of those packed keys does it,
  faster on XLA:CPU than argsort's sort of (key, index) pairs; otherwise argsort.
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


def _sorted_layouts(qcodes: Array, kcodes: Array, kvalid: Array, num_buckets: int
                    ) -> tuple[int, int, Any, Any]:
  """(chunk, padded_length, query layouts, key layouts): every hash's `_bucket_layout` of qcodes and kcodes
  [g, L, m] (masked keys in the extra bucket `num_buckets`), each layout a tuple of [g, m, ...] arrays.

  The chunk is sized by `_chunk_size` and the padded length covers the worst case over bucket sizes. All
  hashes are laid out up front: one batched sort is cheaper than m small ones inside the hash loop.
  """
  length = qcodes.shape[1]
  buckets = num_buckets + 1  # the extra bucket holds masked keys; query codes never reach it
  chunk = _chunk_size(length, buckets)
  padded_length = -(-(length + buckets * (chunk - 1)) // chunk) * chunk  # worst case over bucket sizes
  kcodes = jnp.where(kvalid[..., None], kcodes, num_buckets)
  layout = jax.vmap(jax.vmap(functools.partial(_bucket_layout, buckets=buckets, chunk=chunk,
                                               padded_length=padded_length)))
  qlay, klay = layout(jnp.swapaxes(qcodes, 1, 2)), layout(jnp.swapaxes(kcodes, 1, 2))  # each [g, m, ...]
  return chunk, padded_length, qlay, klay


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
  per hash; tests check it against the sum over colliding pairs. Groups run one at a time
  (lax.map) so that a group's rows stay in cache across its hashes (vmapped groups are slower).
  """
  buckets = num_buckets + 1  # the extra bucket holds masked keys; query codes never reach it
  chunk, padded_length, qlay, klay = _sorted_layouts(qcodes, kcodes, kvalid, num_buckets)
  num_chunks = padded_length // chunk

  def pad(x, source):  # [L, f] -> [num_chunks, chunk, f], zeros between buckets (a gather; source L fills)
    return jnp.take(x, source, axis=0, mode="fill", fill_value=0).reshape(num_chunks, chunk, -1)

  def tables(a, b, chunk_bucket):  # [n, C, e], [n, C, d] -> [buckets + 1, e, d]
    per_chunk = jnp.einsum("nce,ncd->ned", a, b)  # [num_chunks, e, d]
    return jax.ops.segment_sum(per_chunk, chunk_bucket, num_segments=buckets + 1, indices_are_sorted=True)

  def read(a, table, chunk_bucket, slot):  # a [n, C, e], table [buckets + 1, e, d] -> [L, d]
    return jnp.einsum("nce,ned->ncd", a, table[chunk_bucket]).reshape(padded_length, -1)[slot]

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
                     num_buckets: int, directions: Array | None, causal: bool = False
                     ) -> tuple[Array, Array, Array]:
  """(dq, dk, dv) unscaled for a narrow sketch, the backward in forward form: per hash, the value-space
  projections a = dY R_t, b = v R_t [g, L, s] turn both bilinear sums into ordinary LSH cumulations of
  s*d-wide rows, dQ_i = sum_f a_if T_t[code(i)]_f with T_t[c]_f = sum_{j in c} b_jf k_j, and dK_j =
  sum_f b_jf U_t[code(j)]_f with U_t[c]_f = sum_{i in c} a_if q_i. dV rides in U's table (its dY columns), so
  the backward is two passes over the hashes, like two forwards of width s*d (+ e).

  Shapes as in `_feature_tables`; directions [m, g, e, s], or None for R_t = I (a = dY, b = v, s = e: the
  exact per-feature sums as e*d-wide rows). causal: dQ_i sums the keys j <= i, dK_j and dV_j the queries
  i >= j (`_lsh_cumulate`'s prefix and suffix sums). dv [g, L, e] is sum_t sum_i B^t_ij dY_i, unscaled, for
  every key (the caller zeroes masked keys and divides by m).
  """
  _, length, d = qn.shape
  e = v.shape[-1]
  if directions is None:  # the identity: every hash reads dY and v themselves, no per-hash copies
    s, per_hash = e, None
  else:
    s = directions.shape[-1]
    per_hash = (jnp.einsum("gle,mges->mgls", dy, directions),  # a [m, g, L, s]
                jnp.einsum("gle,mges->mgls", v, directions))  # b [m, g, L, s]

  def ab(grp, hsh):  # one group's and hash's (a, b) [L, s]
    return (grp[3], grp[2]) if hsh is None else hsh

  def outer(w, x):  # [L, s], [L, d] -> [L, s * d]
    return (w[:, :, None] * x[:, None, :]).reshape(length, s * d)

  def contract(w, rows):  # [L, s], [L, s * d] -> [L, d]
    return jnp.einsum("ls,lsd->ld", w, rows.reshape(length, s, d))

  per_group = (qn, kn, v, dy)
  prefix, suffix = ("prefix", "suffix") if causal else ("all", "all")
  dq = _lsh_cumulate(qcodes, kcodes, kvalid, per_group, per_hash, lambda grp, h: outer(ab(grp, h)[1], grp[1]),
                     lambda rows, grp, h: contract(ab(grp, h)[0], rows), num_buckets, d, qn.dtype, prefix)
  qvalid = jnp.ones(kvalid.shape, bool)
  dvk = _lsh_cumulate(kcodes, qcodes, qvalid, per_group, per_hash,
                      lambda grp, h: jnp.concatenate([grp[3], outer(ab(grp, h)[0], grp[0])], -1),
                      lambda rows, grp, h: jnp.concatenate(
                          [rows[:, :e], contract(ab(grp, h)[1], rows[:, e:])], -1),
                      num_buckets, e + d, qn.dtype, suffix)
  return dq, dvk[..., e:], dvk[..., :e]


def _pallas_sketched_tables(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array,
                            dy: Array, num_buckets: int, directions: Array, operands: str
                            ) -> tuple[Array, Array, Array]:
  """`_sketched_tables`' bidirectional sums through the fused kernels, one direction f at a time: the
  weights a_f = dY R_t[:, f] and b_f = v R_t[:, f] [g, m, L] ride in the one-hot factors. dK's table of
  a_f-weighted queries and dV's of dY share one build and one read (both keyed by query codes, read at key
  codes); dQ's of b_f-weighted keys is the other. Shapes and results as in `_sketched_tables`."""
  qc = _hash_major(qcodes)  # [g, m, L]
  kc = _hash_major(jnp.where(kvalid[..., None], kcodes, num_buckets))  # masked keys: no bucket
  kn = jnp.where(kvalid[..., None], kn, 0)
  a = jnp.einsum("gle,mges->sgml", dy, directions)  # [s, g, m, L]
  b = jnp.where(kvalid[None, :, None, :], jnp.einsum("gle,mges->sgml", v, directions), 0)
  dq, dk, dv = jnp.zeros_like(qn), jnp.zeros_like(kn), None
  for f in range(directions.shape[-1]):
    first = dv is None  # dV (unweighted dY rows) rides along once
    rows, weighted = ([dy, qn], [False, True]) if first else ([qn], [True])
    built = kernels.build(qc, rows, a[f], weighted, buckets=num_buckets, operands=operands)
    outs = kernels.read(kc, built, b[f], weighted, operands=operands)  # [g, L, e (dV)], [g, L, d]
    if first:
      dv = outs[0].astype(dy.dtype)
    dk = dk + outs[-1].astype(dk.dtype)
    (table,) = kernels.build(kc, [kn], b[f], buckets=num_buckets, operands=operands)
    (read,) = kernels.read(qc, [table], a[f], operands=operands)  # [g, L, d]
    dq = dq + read.astype(dq.dtype)
  return dq, dk, dv


def _pallas_feature_tables(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array,
                           dy: Array, num_buckets: int, operands: str) -> tuple[Array, Array]:
  """`_feature_tables`' exact sums without tables: per hash, queries and keys sorted by code, dQ_i = sum_j
  [code(i) = code(j)] (dY_i . v_j) k_j and dK_j = sum_i [...] (v_j . dY_i) q_i by `kernels.pair_sums`
  (each sorted tile meets only the run of tiles sharing its codes), put back in position order and summed
  over the hashes (a scan: one hash's sorted copies live at a time). Shapes and results as in
  `_feature_tables`."""
  kcodes, v = _drop_invalid(kcodes, kvalid, v, num_buckets)  # masked keys: a code no query has
  kn = jnp.where(kvalid[..., None], kn, 0)  # and nothing of theirs in a product
  rows = jnp.arange(qn.shape[0])[:, None]
  sort_rows = jax.vmap(functools.partial(_sort_by_code, buckets=num_buckets + 1))

  def sort(codes):  # [g, L] -> (sorted codes, order, inverse order)
    order, sorted_codes = sort_rows(codes)
    inverse = jnp.zeros_like(order).at[rows, order].set(jnp.arange(codes.shape[1], dtype=order.dtype))
    return sorted_codes, order, inverse

  def gather(x, order):  # [g, L, f] rows in `order`
    return jnp.take_along_axis(x, order[..., None], axis=1)

  def hash_step(acc, codes):
    (qs, qo, qi), (ks, ko, ki) = sort(codes[0]), sort(codes[1])
    dy_s, q_s, v_s, k_s = gather(dy, qo), gather(qn, qo), gather(v, ko), gather(kn, ko)
    dq = kernels.pair_sums(qs, dy_s, ks, v_s, k_s, operands=operands)  # [g, L, d] in query-code order
    dk = kernels.pair_sums(ks, v_s, qs, dy_s, q_s, operands=operands)  # in key-code order
    return (acc[0] + gather(dq, qi).astype(acc[0].dtype), acc[1] + gather(dk, ki).astype(acc[1].dtype)), None

  per_hash = (jnp.moveaxis(qcodes, 2, 0), jnp.moveaxis(kcodes, 2, 0))  # [m, g, L] each
  (dq, dk), _ = jax.lax.scan(hash_step, (jnp.zeros_like(qn), jnp.zeros_like(kn)), per_hash)
  return dq, dk


def backward_tables(qcodes: Array, kcodes: Array, kvalid: Array, qn: Array, kn: Array, v: Array, dy: Array,
                    num_buckets: int, directions: Array | None, formulation: str, causal: bool = False,
                    operands: str = "float32") -> tuple[Array, Array, Array]:
  """(dq, dk, dv) unscaled through the LSH tables: dQ_i = sum_t sum_j B^t_ij (dY_i . v_j) k_j, dK_j alike
  with q_i, dV_j = sum_t sum_i B^t_ij dY_i; `dY . v` sketched per hash when directions [m, g, e, s] is given.

  Shapes as in `_feature_tables`. The one-hot matmuls for "onehot"; for "pallas", the fused kernels (the
  exact dQ/dK as sums over code-sorted pairs, `_pallas_feature_tables`); for "sorted", segment sums for
  sketches of s <= SCATTER_FEATURES directions (dV riding along), bucket-sorted chunked matmuls otherwise.
  causal (the sums over j <= i for dQ, i >= j for dK and dV) takes the running sums of `_sketched_tables` for
  every sketch and for the exact form (then rows of e*d features: linear in L, O(L*e*d) memory per live
  hash).
  dv is given for every key (the caller zeroes masked keys).
  """
  if causal:
    return _sketched_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, directions, causal=True)
  if formulation == "sorted" and directions is not None and directions.shape[-1] <= SCATTER_FEATURES:
    return _sketched_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, directions)
  if formulation == "pallas" and directions is not None:
    return _pallas_sketched_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, directions, operands)
  # dV: tables of dY keyed by query codes, read at key codes; every query read the forward, so every
  # query's cotangent is inserted.
  dv = cumulate(kcodes, qcodes, jnp.ones(kvalid.shape, bool), dy, num_buckets, formulation,
                operands=operands)
  if formulation == "pallas":
    dq, dk = _pallas_feature_tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, operands)
  else:
    tables = _feature_tables if formulation == "sorted" else _onehot_feature_tables
    dq, dk = tables(qcodes, kcodes, kvalid, qn, kn, v, dy, num_buckets, directions)
  return dq, dk, dv
