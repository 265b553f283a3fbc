"""The linear transformer (Katharopoulos et al., 2020): attention through a positive feature map, O(L d^2).

    out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / phi(q_i)^T sum_j phi(k_j),   phi(x) = elu(x) + 1

with j over the visible keys (all real keys, or j <= i when causal). `feature_attention` is the shared engine
for any positive feature map (Performer's FAVOR+ uses it too): bidirectional by one [m, d_v] key-value
summary, causal by prefix sums over chunks of `chunk_size` positions (exact attention-like product inside a
chunk, the running summary of all earlier chunks between them), so no [L, L] array ever exists.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from baselines.common import from_rows, masked_rows, num_row_chunks, rows_mask, to_rows
from core import contract
from core.blocks import map_chunks, num_blocks, pad_to
from core.combine import weighted_sum

Array = Any
DEFAULT_CHUNK = 128


def feature_attention(phi_q: Array, phi_k: Array, v: Array, *, causal: bool, chunk_size: int) -> Array:
  """Normalised linear attention from feature maps (masked keys already zeroed in phi_k and v).

  phi_q, phi_k: [rows, length, features] (non-negative); v: [rows, length, value_dim] (rows: batch x heads).
  Returns [rows, length, value_dim]; rows whose visible keys all have zero features give zeros.
  The normaliser rides along as one more value column (a column of ones), so numerator and denominator come
  out of the same contractions.
  """
  length = phi_q.shape[1]
  v1 = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)  # [rows, length, e + 1]
  if not causal:
    kv = jnp.einsum("glm,gld->gmd", phi_k, v1)  # [rows, features, value_dim + 1]
    numer = jnp.einsum("glm,gmd->gld", phi_q, kv)  # [rows, length, value_dim + 1]
  else:
    c = min(chunk_size, length)
    n = num_blocks(length, c)

    def chunks(x: Array) -> Array:  # [rows, length, dim] -> [rows, n, c, dim]
      x = pad_to(x, n * c, axis=1)
      return x.reshape(x.shape[0], n, c, x.shape[-1])

    fq, fk, vc = chunks(phi_q), chunks(phi_k), chunks(v1)
    kv = jnp.einsum("gncm,gncd->gnmd", fk, vc)  # [rows, n, features, value_dim + 1]
    kv = exclusive_prefix_sum(kv)  # summaries of every chunk before this one
    within = jnp.einsum("gncm,gnkm->gnck", fq, fk)  # [rows, n, c, c]
    within = jnp.where(jnp.tril(jnp.ones((c, c), bool)), within, 0.0)
    # A later position's value (zero weight here) must not reach earlier outputs, even when it is NaN or Inf.
    numer = weighted_sum("gnck,gnkd->gncd", within, vc) + jnp.einsum("gncm,gnmd->gncd", fq, kv)
    numer = numer.reshape(numer.shape[0], n * c, -1)[:, :length]  # [rows, length, e + 1]
  numer, denom = numer[..., :-1], numer[..., -1]
  return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


def exclusive_prefix_sum(x: Array) -> Array:
  """out[:, i] = sum of x[:, j] for j < i (zeros for i = 0); x: [rows, n, ...].

  A sequential scan: each step adds one slice, so a later slice, even non-finite, never reaches an earlier
  output (a triangular matmul would multiply it by zero), and the work is O(n) slices rather than O(n^2)."""
  def step(total: Array, item: Array) -> tuple[Array, Array]:
    return total + item, total

  _, out = jax.lax.scan(step, jnp.zeros_like(x[:, 0]), jnp.moveaxis(x, 1, 0))
  return jnp.moveaxis(out, 0, 1)


def prepare(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, chunk_size: Any,
            row_chunks: Any) -> tuple[Array, Array, Array, Array, bool, int, int]:
  """Contract checks; q, k, v as rows [batch * heads, length, dim] (`baselines.common.to_rows`) in the softmax
  dtype with masked keys' k and v replaced by zeros (a select, so NaN or Inf there reaches neither outputs nor
  gradients). Returns (q, k, v, key_valid, causal, chunk, row chunks); key_valid: [batch * heads, length,
  1]; row chunks: `baselines.common.num_row_chunks`."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  chunk = contract.check_positive_int(chunk_size, name="chunk_size", op=op)
  chunks = num_row_chunks(q.shape[0] * q.shape[2], q.shape[1], row_chunks, op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  valid = rows_mask(mask, q.shape[2])[:, :, None]  # [batch * heads, length, 1]
  qh = to_rows(q, ct)  # [batch * heads, length, head_dim]
  kh = masked_rows(k, mask, ct)  # [batch * heads, length, head_dim]
  vh = masked_rows(v, mask, ct)  # [batch * heads, length, value_dim]
  return qh, kh, vh, valid, causal, chunk, chunks


def elu_feature_map(x: Array) -> Array:
  """phi(x) = elu(x) + 1 > 0, the paper's feature map."""
  return jax.nn.elu(x) + 1.0


def linear(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
           chunk_size: int = DEFAULT_CHUNK, row_chunks: int | None = None) -> Array:
  """Linear-transformer attention with phi = elu + 1 (no logit scale: the paper applies phi to q and k as is).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  chunk_size: positions per chunk of the causal prefix sum (cost O(L (chunk + d) d)); unused bidirectionally.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`baselines.common.num_row_chunks`; None = automatic, and one bidirectionally, where no intermediate is
    wider than the inputs and chunks would only add the backward's recomputation).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  out_dtype = v.dtype
  qh, kh, vh, valid, causal, chunk, chunks = prepare(q, k, v, mask, op="linear", causal=causal,
                                                     chunk_size=chunk_size, row_chunks=row_chunks)
  if row_chunks is None and not causal:
    chunks = 1

  def attention(rows: tuple[Array, ...]) -> Array:  # a chunk of rows -> [rows, length, value_dim]
    qh, kh, vh, valid = rows
    phi_k = jnp.where(valid, elu_feature_map(kh), 0.0)  # [rows, length, head_dim]
    return feature_attention(elu_feature_map(qh), phi_k, vh, causal=causal, chunk_size=chunk)

  out = map_chunks(attention, (qh, kh, vh, valid), chunks, axis=0)  # [batch * heads, length, value_dim]
  return from_rows(out, q.shape[0], out_dtype)
