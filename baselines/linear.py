"""The linear transformer (Katharopoulos et al., 2020): attention through a positive feature map, O(L d^2).

    out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / phi(q_i)^T sum_j phi(k_j),   phi(x) = elu(x) + 1

with j over the visible keys (all real keys, or j <= i when causal). `feature_attention` is the shared engine
for any positive feature map (Performer's FAVOR+ uses it too): bidirectional by one [m, d_v] key-value
summary, causal by prefix sums over chunks of `chunk_size` positions (exact attention-like product inside a
chunk, the running summary of all earlier chunks between them), so no [L, L] array ever exists.

The bidirectional op itself runs `_bidirectional`: a hand-written backward over blocks of rows read straight
from the [batch, length, heads, dim] inputs, which keeps only each row's [d, d_v] summary between the passes
and makes every feature and gradient pass a single sweep over its block (no transposed copies of q, k, v or
of the gradients, no recomputed matmuls).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from baselines.common import from_rows, masked_rows, num_row_chunks, rows_mask, to_rows
from core import contract
from core.blocks import map_chunks, num_blocks, pad_to

Array = Any
DEFAULT_CHUNK = 128


def feature_attention(phi_q: Array, phi_k: Array, v: Array, *, causal: bool, chunk_size: int) -> Array:
  """Normalised linear attention from feature maps (masked keys already zeroed in phi_k and v).

  phi_q, phi_k: [rows, length, features] (non-negative); v: [rows, length, value_dim] (rows: batch x heads).
  Returns [rows, length, value_dim]; rows whose visible keys all have zero features give zeros.
  Bidirectionally the normaliser rides along as one more value column (a column of ones), so numerator and
  denominator come out of the same contractions. Causally (`_causal_chunks`) a later position's value, even
  NaN or Inf, never reaches an earlier output: values enter with non-finite entries selected to zero, and an
  output that sees a non-finite value (at or before its position) is NaN.
  """
  if causal:
    finite = jnp.isfinite(v)
    seen_bad = jnp.cumsum(jnp.any(~finite, axis=-1, keepdims=True), axis=1) > 0  # [rows, length, 1]
    out = _causal_chunks(phi_q, phi_k, jnp.where(finite, v, 0.0), min(chunk_size, phi_q.shape[1]))
    return jnp.where(seen_bad, jnp.nan, out)
  v1 = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)  # [rows, length, e + 1]
  kv = jnp.einsum("glm,gld->gmd", phi_k, v1)  # [rows, features, value_dim + 1]
  numer = jnp.einsum("glm,gmd->gld", phi_q, kv)  # [rows, length, value_dim + 1]
  numer, denom = numer[..., :-1], numer[..., -1]
  return numer / _safe(denom)[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _causal_chunks(phi_q: Array, phi_k: Array, v: Array, chunk: int) -> Array:
  """Causal feature attention by chunks of `chunk` positions: inside a chunk the masked product W = tril(phi_q
  phi_k^T) [c, c], between chunks the summaries S = sum of phi_k^T v over every earlier chunk [features, e]
  (an exclusive running sum), out_i = (W v + phi_q S)_i / (W 1 + phi_q KS)_i with KS the summed phi_k.
  phi_q, phi_k [rows, length, m]; v [rows, length, e], finite. Returns [rows, length, e].

  The hand-written backward keeps W, S and the outputs and spends 8 chunk matmuls, where autodiff of the
  forward (and the recomputation a checkpoint adds) spends more and writes more."""
  return _causal_chunks_fwd(phi_q, phi_k, v, chunk)[0]


def _chunked(x: Array, chunk: int) -> Array:
  """[rows, length, dim] -> [rows, n, chunk, dim], zero-padded to whole chunks."""
  n = num_blocks(x.shape[1], chunk)
  return pad_to(x, n * chunk, axis=1).reshape(x.shape[0], n, chunk, x.shape[-1])


def _unchunked(x: Array, length: int) -> Array:
  """[rows, n, chunk, dim] -> [rows, length, dim]."""
  return x.reshape(x.shape[0], -1, x.shape[-1])[:, :length]


def _causal_chunks_fwd(phi_q: Array, phi_k: Array, v: Array, chunk: int) -> tuple[Array, Any]:
  fq, fk, vc = (_chunked(x, chunk) for x in (phi_q, phi_k, v))  # [rows, n, c, dim]
  tril = jnp.tril(jnp.ones((chunk, chunk), bool))
  s = exclusive_prefix_sum(jnp.einsum("gncm,gnce->gnme", fk, vc))  # [rows, n, m, e]
  ks = exclusive_prefix_sum(jnp.sum(fk, axis=2))  # [rows, n, m]
  w = jnp.where(tril, jnp.einsum("gncm,gnkm->gnck", fq, fk), 0.0)  # [rows, n, c, c]
  numer = jnp.einsum("gnck,gnke->gnce", w, vc) + jnp.einsum("gncm,gnme->gnce", fq, s)
  denom = jnp.sum(w, axis=-1) + jnp.einsum("gncm,gnm->gnc", fq, ks)  # [rows, n, c]
  out = numer / _safe(denom)[..., None]  # [rows, n, c, e]
  return _unchunked(out, phi_q.shape[1]), (fq, fk, vc, w, s, ks, denom, out)


def _causal_chunks_bwd(chunk: int, res: Any, cot: Array) -> tuple[Array, Array, Array]:
  """With a = dOut / denom and ddenom = -(dOut . out) / denom: dW = tril(a v^T + ddenom), dphi_q = dW phi_k +
  a S^T + ddenom KS, dS = phi_q^T a and dKS = phi_q^T ddenom, whose running sums over the later chunks give
  each chunk's dkv and dks; dphi_k = dW^T phi_q + v dkv^T + dks, dv = W^T a + phi_k dkv."""
  fq, fk, vc, w, s, ks, denom, out = res
  length = cot.shape[1]
  g = _chunked(cot, chunk)  # [rows, n, c, e]
  inv = 1.0 / _safe(denom)
  a = g * inv[..., None]
  ddenom = jnp.where(denom > 0, -jnp.einsum("gnce,gnce->gnc", g, out) * inv, 0.0)  # [rows, n, c]
  tril = jnp.tril(jnp.ones((chunk, chunk), bool))
  dw = jnp.where(tril, jnp.einsum("gnce,gnke->gnck", a, vc) + ddenom[..., None], 0.0)  # [rows, n, c, c]
  dfq = (jnp.einsum("gnck,gnkm->gncm", dw, fk) + jnp.einsum("gnce,gnme->gncm", a, s)
         + ddenom[..., None] * ks[:, :, None, :])
  dkv = exclusive_prefix_sum(jnp.einsum("gncm,gnce->gnme", fq, a), reverse=True)  # [rows, n, m, e]
  dks = exclusive_prefix_sum(jnp.einsum("gncm,gnc->gnm", fq, ddenom), reverse=True)  # [rows, n, m]
  dfk = (jnp.einsum("gnck,gncm->gnkm", dw, fq) + jnp.einsum("gnce,gnme->gncm", vc, dkv)
         + dks[:, :, None, :])
  dv = jnp.einsum("gnck,gnce->gnke", w, a) + jnp.einsum("gncm,gnme->gnce", fk, dkv)
  return tuple(_unchunked(x, length) for x in (dfq, dfk, dv))


_causal_chunks.defvjp(_causal_chunks_fwd, _causal_chunks_bwd)


def exclusive_prefix_sum(x: Array, reverse: bool = False) -> Array:
  """out[:, i] = sum of x[:, j] for j < i (zeros for i = 0), or for j > i when `reverse`; x: [rows, n, ...].

  A sequential scan: each step adds one slice, so a later slice, even non-finite, never reaches an earlier
  output (a triangular matmul would multiply it by zero), and the work is O(n) slices rather than O(n^2)."""
  def step(total: Array, item: Array) -> tuple[Array, Array]:
    return total + item, total

  _, out = jax.lax.scan(step, jnp.zeros_like(x[:, 0]), jnp.moveaxis(x, 1, 0), reverse=reverse)
  return jnp.moveaxis(out, 0, 1)


def check_args(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, chunk_size: Any,
               row_chunks: Any) -> tuple[Array, Array, Array, Array, bool, int, int]:
  """The contract checks of the feature-attention ops: (q, k, v, mask, causal, chunk, row chunks); mask
  defaults to all real; row chunks: `baselines.common.num_row_chunks`."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  chunk = contract.check_positive_int(chunk_size, name="chunk_size", op=op)
  chunks = num_row_chunks(q.shape[0] * q.shape[2], q.shape[1], row_chunks, op=op)
  return q, k, v, mask, causal, chunk, chunks


def as_rows(q: Array, k: Array, v: Array, mask: Array) -> tuple[Array, Array, Array, Array]:
  """q, k, v as rows [batch * heads, length, dim] (`baselines.common.to_rows`) in the softmax dtype with
  masked keys' k and v replaced by zeros (a select, so NaN or Inf there reaches neither outputs nor
  gradients), and the keys' validity [batch * heads, length, 1]."""
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  valid = rows_mask(mask, q.shape[2])[:, :, None]  # [batch * heads, length, 1]
  qh = to_rows(q, ct)  # [batch * heads, length, head_dim]
  kh = masked_rows(k, mask, ct)  # [batch * heads, length, head_dim]
  vh = masked_rows(v, mask, ct)  # [batch * heads, length, value_dim]
  return qh, kh, vh, valid


def prepare(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, chunk_size: Any,
            row_chunks: Any) -> tuple[Array, Array, Array, Array, bool, int, int]:
  """`check_args` then `as_rows`: (q, k, v rows, key_valid, causal, chunk, row chunks)."""
  q, k, v, mask, causal, chunk, chunks = check_args(q, k, v, mask, op=op, causal=causal,
                                                    chunk_size=chunk_size, row_chunks=row_chunks)
  return (*as_rows(q, k, v, mask), causal, chunk, chunks)


def elu_feature_map(x: Array) -> Array:
  """phi(x) = elu(x) + 1 > 0, the paper's feature map, as x + 1 above zero and exp(x) below (exactly
  elu + 1, without expm1's slower kernel and its rounding in the added 1)."""
  return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


def _row_blocks(batch: int, heads: int, chunks: int) -> tuple[int, int]:
  """(batches, heads) per block when the batch x heads rows run in about `chunks` sequential blocks: a block
  is whole divisors of both axes, so it is one contiguous slice [batches, length, heads, dim] of the input."""
  rows = -(-batch * heads // chunks)
  if rows >= heads:
    return max(b for b in range(1, batch + 1) if batch % b == 0 and b * heads <= rows), heads
  return 1, max(h for h in range(1, heads + 1) if heads % h == 0 and h <= rows)


def _block_start(index: Array, heads: int, size: tuple[int, int]) -> tuple[Array, Array, Array, Array]:
  """Where block `index` (blocks of size (batches, heads), heads fastest) starts in [batch, length, heads,
  dim]: (batch, 0, head, 0)."""
  per_batch = heads // size[1]
  zero = jnp.zeros_like(index)
  return index // per_batch * size[0], zero, index % per_batch * size[1], zero


def _block(x: Array, index: Array, size: tuple[int, int], dtype: Any) -> Array:
  """Block `index` of x [batch, length, heads, dim] as rows [batches * heads, length, dim] in `dtype`."""
  shape = (size[0], x.shape[1], size[1], x.shape[3])
  return to_rows(jax.lax.dynamic_slice(x, _block_start(index, x.shape[2], size), shape), dtype)


def _put_block(buf: Array, rows: Array, index: Array, size: tuple[int, int]) -> Array:
  """Writes rows [batches * heads, length, dim] into block `index` of buf [batch, length, heads, dim]."""
  return jax.lax.dynamic_update_slice(buf, from_rows(rows, size[0], buf.dtype),
                                      _block_start(index, buf.shape[2], size))


def _block_features(q: Array, k: Array, v: Array, mask: Array, index: Array, size: tuple[int, int]
                    ) -> tuple[Array, Array, Array, Array]:
  """A block's phi(q), phi(k) and v rows [rows, length, dim], masked keys' features and values selected to
  zero, and their validity [rows, length, 1]."""
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  b = _block_start(index, q.shape[2], size)[0]
  valid = rows_mask(jax.lax.dynamic_slice_in_dim(mask, b, size[0], axis=0), size[1])[..., None]
  phi_q = elu_feature_map(_block(q, index, size, ct))
  phi_k = jnp.where(valid, elu_feature_map(_block(k, index, size, ct)), 0.0)
  return phi_q, phi_k, jnp.where(valid, _block(v, index, size, ct), 0.0), valid


def _blocks_loop(count: int, body: Callable[[Array, Any], Any], init: Any) -> Any:
  """fori_loop over the blocks; one block (an accelerator's default) runs without a loop."""
  if count == 1:
    return body(jnp.int32(0), init)
  return jax.lax.fori_loop(jnp.int32(0), jnp.int32(count), body, init)


def _safe(denom: Array) -> Array:
  return jnp.where(denom > 0, denom, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _bidirectional(q: Array, k: Array, v: Array, mask: Array, size: tuple[int, int]) -> Array:
  """Bidirectional elu linear attention: q, k [batch, length, heads, d]; v [batch, length, heads, e]; mask
  [batch, length]; size: (batches, heads) per block (`_row_blocks`). Returns [batch, length, heads, e]."""
  return _bidirectional_fwd(q, k, v, mask, size)[0]


def _bidirectional_fwd(q: Array, k: Array, v: Array, mask: Array, size: tuple[int, int]) -> tuple[Array, Any]:
  batch, length, heads, d = q.shape
  count, rows = batch * heads // (size[0] * size[1]), size[0] * size[1]
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)

  def body(i, carry):
    out, kvs, ksums, denoms = carry
    phi_q, phi_k, vr, _ = _block_features(q, k, v, mask, i, size)
    kv = jnp.einsum("glm,gle->gme", phi_k, vr)  # [rows, d, e]
    ksum = jnp.einsum("glm->gm", phi_k)  # [rows, d]
    denom = jnp.einsum("glm,gm->gl", phi_q, ksum)  # [rows, length]
    numer = jnp.einsum("glm,gme->gle", phi_q, kv)  # [rows, length, e]
    out = _put_block(out, numer / _safe(denom)[..., None], i, size)
    return out, kvs.at[i].set(kv), ksums.at[i].set(ksum), denoms.at[i].set(denom)

  init = (jnp.zeros(v.shape, v.dtype), jnp.zeros((count, rows, d, v.shape[-1]), ct),
          jnp.zeros((count, rows, d), ct), jnp.zeros((count, rows, length), ct))
  out, kvs, ksums, denoms = _blocks_loop(count, body, init)
  return out, (q, k, v, mask, kvs, ksums, denoms)


def _bidirectional_bwd(size: tuple[int, int], res: Any, cot: Array) -> tuple[Array, Array, Array, None]:
  """With a = dOut / denom and u = a kv^T: dphi_q = u - (phi_q . u / denom) ksum, dkv = phi_q^T a, dksum =
  phi_q^T (-(phi_q . u) / denom), dphi_k = v dkv^T + dksum, dv = phi_k dkv; phi's derivative is min(phi, 1)
  (1 above zero, exp(x) = phi below); masked keys get zeros."""
  q, k, v, mask, kvs, ksums, denoms = res
  count = kvs.shape[0]

  def body(i, grads):
    dq, dk, dv = grads
    phi_q, phi_k, vr, valid = _block_features(q, k, v, mask, i, size)
    kv, ksum, denom = kvs[i], ksums[i], denoms[i]
    inv = 1.0 / _safe(denom)  # [rows, length]
    a = _block(cot, i, size, inv.dtype) * inv[..., None]  # [rows, length, e]
    u = jnp.einsum("gle,gme->glm", a, kv)  # [rows, length, d]
    ddenom = jnp.where(denom > 0, -jnp.einsum("glm,glm->gl", phi_q, u) * inv, 0.0)  # [rows, length]
    dphi_q = u + ddenom[..., None] * ksum[:, None, :]
    dkv = jnp.einsum("glm,gle->gme", phi_q, a)  # [rows, d, e]
    dksum = jnp.einsum("glm,gl->gm", phi_q, ddenom)  # [rows, d]
    dphi_k = jnp.einsum("gle,gme->glm", vr, dkv) + dksum[:, None, :]
    dvr = jnp.einsum("glm,gme->gle", phi_k, dkv)
    dq = _put_block(dq, dphi_q * jnp.minimum(phi_q, 1.0), i, size)
    dk = _put_block(dk, jnp.where(valid, dphi_k * jnp.minimum(phi_k, 1.0), 0.0), i, size)
    return dq, dk, _put_block(dv, jnp.where(valid, dvr, 0.0), i, size)

  dq, dk, dv = _blocks_loop(count, body, (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)))
  return dq, dk, dv, None


_bidirectional.defvjp(_bidirectional_fwd, _bidirectional_bwd)


def linear(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
           chunk_size: int = DEFAULT_CHUNK, row_chunks: int | None = None) -> Array:
  """Linear-transformer attention with phi = elu + 1 (no logit scale: the paper applies phi to q and k as is).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  chunk_size: positions per chunk of the causal prefix sum (cost O(L (chunk + d) d)); unused bidirectionally.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`baselines.common.num_row_chunks`; None = automatic).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  out_dtype = v.dtype
  q, k, v, mask, causal, chunk, chunks = check_args(q, k, v, mask, op="linear", causal=causal,
                                                    chunk_size=chunk_size, row_chunks=row_chunks)
  if not causal:  # blocks of rows sliced from the inputs as given
    return _bidirectional(q, k, v, mask, _row_blocks(q.shape[0], q.shape[2], chunks))
  qh, kh, vh, valid = as_rows(q, k, v, mask)

  def attention(rows: tuple[Array, ...]) -> Array:  # a chunk of rows -> [rows, length, value_dim]
    qh, kh, vh, valid = rows
    phi_k = jnp.where(valid, elu_feature_map(kh), 0.0)  # [rows, length, head_dim]
    return feature_attention(elu_feature_map(qh), phi_k, vh, causal=causal, chunk_size=chunk)

  out = map_chunks(attention, (qh, kh, vh, valid), chunks, axis=0)  # [batch * heads, length, value_dim]
  return from_rows(out, q.shape[0], out_dtype)
