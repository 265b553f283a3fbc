"""The linear transformer (Katharopoulos et al., 2020): attention through a positive feature map, O(L d^2).

    out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / phi(q_i)^T sum_j phi(k_j),   phi(x) = elu(x) + 1

with j over the visible keys (all real keys, or j <= i when causal). `feature_attention` is the shared engine
for any positive feature map (Performer's FAVOR+ uses it too): bidirectional by one [m, d_v] key-value
summary, causal by prefix sums over chunks of `chunk_size` positions (exact attention-like product inside a
chunk, the running summary of all earlier chunks between them), so no [L, L] array ever exists.

It runs over blocks of batch x heads rows (`attention_baselines.common.map_row_blocks`) with a hand-written
backward:
bidirectionally it keeps each row's [m, d_v] summary between the passes, causally nothing (the backward
recomputes the in-chunk products and the summaries, never the outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attention_baselines.common import block_mask, map_row_blocks, map_row_chunks, num_row_chunks, select_real
from attention_core import contract
from attention_core.blocks import num_blocks, pad_to, shift

Array = Any
# Causal chunk: the in-chunk product costs c per position and feature, the chunk summaries m (the features)
# per position and feature, so c = m = 64 balances the two for elu + 1 on 64-dimensional heads.
DEFAULT_CHUNK = 64
# (q rows, k rows [rows, length, d], key validity [rows, length, 1] or None (every key real), params) ->
# (phi(q), phi(k)), each [rows, length, m], non-negative, masked keys' phi(k) zero; differentiated by
# autodiff, a block at a time.
FeatureMap = Callable[[Array, Array, Array, Any], tuple[Array, Array]]


def feature_attention(q: Array, k: Array, v: Array, mask: Array, params: Any, feature_map: FeatureMap, *,
                      causal: bool, chunk: int, row_chunks: int | None, op: str) -> Array:
  """Normalised linear attention with phi = feature_map(..., params), over blocks of rows.

  q, k: [batch, length, heads, d]; v: [batch, length, heads, e]; mask: [batch, length] bool (True = real), or
  None when every key is real (no masking work at all);
  params: arrays the feature map reads without gradient (Performer's random features) or None; chunk:
  positions per causal chunk; row_chunks: `attention_baselines.common.num_row_chunks` (None: automatic); op:
  the op's
  name. Returns [batch, length, heads, e] in v's dtype; rows whose visible keys all have zero features give
  zeros. Causally a later position's value, even NaN or Inf, never reaches an earlier output: values enter
  with non-finite entries selected to zero, and an output that sees a non-finite value (at or before its
  position) is NaN.
  """
  heads = q.shape[2]
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  chunk = min(chunk, q.shape[1])

  def inputs(rows: tuple[Array, ...], aux: Any, ids: Array) -> tuple[Array, Array, Array, Array, Callable]:
    """A block's phi(q), phi(k), v with masked keys' values selected to zero, the keys' mask [rows, length]
    and the features' vjp."""
    q, k, v = rows
    mask, params = aux
    mask = block_mask(mask, ids, heads)  # [rows, length] or None
    valid = None if mask is None else mask[:, :, None]
    (phi_q, phi_k), vjp = jax.vjp(lambda q, k: feature_map(q, k, valid, params), q, k)
    return phi_q, phi_k, *select_real(mask, v), mask, vjp

  def forward(rows: tuple[Array, ...], aux: Any, ids: Array) -> tuple[Array, Any]:
    phi_q, phi_k, v, _, _ = inputs(rows, aux, ids)
    if causal:
      return _causal_forward(phi_q, phi_k, v, chunk), None
    return _bidirectional_forward(phi_q, phi_k, v)

  def backward(rows: tuple[Array, ...], aux: Any, ids: Array, res: Any, dout: Array
               ) -> tuple[Array, Array, Array]:
    phi_q, phi_k, v, mask, vjp = inputs(rows, aux, ids)
    if causal:
      dphi_q, dphi_k, dv = _causal_backward(phi_q, phi_k, v, dout, chunk)
    else:
      dphi_q, dphi_k, dv = _bidirectional_backward(phi_q, phi_k, v, res, dout)
    return (*vjp((dphi_q, dphi_k)), *select_real(mask, dv))

  def run(chunks: int) -> Array:
    return map_row_blocks(forward, (q, k, v), (mask, params), chunks, dtype=ct, out_dtype=v.dtype,
                          bwd=backward)

  return map_row_chunks(run, q.shape[0] * heads, q.shape[1], row_chunks, op=op)


def _bidirectional_forward(phi_q: Array, phi_k: Array, v: Array) -> tuple[Array, tuple[Array, Array]]:
  """phi_q, phi_k [rows, length, m], v [rows, length, e] -> (out [rows, length, e], (kv, ksum))."""
  kv = jnp.einsum("glm,gle->gme", phi_k, v)  # [rows, m, e]
  ksum = jnp.einsum("glm->gm", phi_k)  # [rows, m]
  denom = jnp.einsum("glm,gm->gl", phi_q, ksum)  # [rows, length]
  return jnp.einsum("glm,gme->gle", phi_q, kv) / _safe(denom)[..., None], (kv, ksum)


def _bidirectional_backward(phi_q: Array, phi_k: Array, v: Array, res: tuple[Array, Array], dout: Array
                            ) -> tuple[Array, Array, Array]:
  """With a = dOut / denom and u = a kv^T: dphi_q = u - (phi_q . u / denom) ksum, dkv = phi_q^T a, dksum =
  phi_q^T (-(phi_q . u) / denom), dphi_k = v dkv^T + dksum, dv = phi_k dkv."""
  kv, ksum = res
  denom = jnp.einsum("glm,gm->gl", phi_q, ksum)  # [rows, length]
  inv = 1.0 / _safe(denom)
  a = dout * inv[..., None]  # [rows, length, e]
  u = jnp.einsum("gle,gme->glm", a, kv)  # [rows, length, m]
  ddenom = jnp.where(denom > 0, -jnp.einsum("glm,glm->gl", phi_q, u) * inv, 0.0)  # [rows, length]
  dkv = jnp.einsum("glm,gle->gme", phi_q, a)  # [rows, m, e]
  dksum = jnp.einsum("glm,gl->gm", phi_q, ddenom)  # [rows, m]
  dphi_q = u + ddenom[..., None] * ksum[:, None, :]
  dphi_k = jnp.einsum("gle,gme->glm", v, dkv) + dksum[:, None, :]
  return dphi_q, dphi_k, jnp.einsum("glm,gme->gle", phi_k, dkv)


def _chunked(x: Array, chunk: int) -> Array:
  """[rows, length, dim] -> [rows, n, chunk, dim], zero-padded to whole chunks."""
  n = num_blocks(x.shape[1], chunk)
  return pad_to(x, n * chunk, axis=1).reshape(x.shape[0], n, chunk, x.shape[-1])


def _unchunked(x: Array, length: int) -> Array:
  """[rows, n, chunk, dim] -> [rows, length, dim]."""
  return x.reshape(x.shape[0], -1, x.shape[-1])[:, :length]


def _causal_parts(phi_q: Array, phi_k: Array, v: Array, chunk: int) -> tuple[Array, ...]:
  """The chunked causal terms: fq, fk [rows, n, c, m]; vc [rows, n, c, e] (non-finite values selected to
  zero); the in-chunk product W = tril(phi_q phi_k^T) [rows, n, c, c]; the summaries of every earlier chunk,
  S = sum of phi_k^T v [rows, n, m, e] and KS = sum of phi_k [rows, n, m] (exclusive running sums); the
  denominators W 1 + phi_q KS [rows, n, c]; and whether a position has seen a non-finite value [rows, length,
  1]."""
  finite = jnp.isfinite(v)
  seen_bad = jnp.cumsum(jnp.any(~finite, axis=-1, keepdims=True), axis=1) > 0  # [rows, length, 1]
  fq, fk, vc = (_chunked(x, chunk) for x in (phi_q, phi_k, jnp.where(finite, v, 0.0)))  # [rows, n, c, dim]
  tril = jnp.tril(jnp.ones((chunk, chunk), bool))
  s = exclusive_prefix_sum(jnp.einsum("gncm,gnce->gnme", fk, vc))  # [rows, n, m, e]
  ks = exclusive_prefix_sum(jnp.sum(fk, axis=2))  # [rows, n, m]
  w = jnp.where(tril, jnp.einsum("gncm,gnkm->gnck", fq, fk), 0.0)  # [rows, n, c, c]
  denom = jnp.sum(w, axis=-1) + jnp.einsum("gncm,gnm->gnc", fq, ks)  # [rows, n, c]
  return fq, fk, vc, w, s, ks, denom, seen_bad


def _causal_forward(phi_q: Array, phi_k: Array, v: Array, chunk: int) -> Array:
  """out_i = (W v + phi_q S)_i / (W 1 + phi_q KS)_i (`_causal_parts`), NaN from a non-finite value on.
  phi_q, phi_k [rows, length, m]; v [rows, length, e]. Returns [rows, length, e]."""
  fq, _, vc, w, s, _, denom, seen_bad = _causal_parts(phi_q, phi_k, v, chunk)
  numer = jnp.einsum("gnck,gnke->gnce", w, vc) + jnp.einsum("gncm,gnme->gnce", fq, s)
  out = _unchunked(numer / _safe(denom)[..., None], v.shape[1])  # [rows, length, e]
  return jnp.where(seen_bad, jnp.nan, out)


def _causal_backward(phi_q: Array, phi_k: Array, v: Array, dout: Array, chunk: int
                     ) -> tuple[Array, Array, Array]:
  """With a = dOut / denom, P = a v^T [c, c] and R = a S^T [c, m], the forward's numerator never recomputed:
  ddenom = -(a . numer) / denom = -(rowsum(W * P) + rowsum(phi_q * R)) / denom, dW = tril(P + ddenom), dphi_q
  = dW phi_k + R + ddenom KS, dS = phi_q^T a and dKS = phi_q^T ddenom, whose running sums over the later
  chunks give each chunk's dkv and dks; dphi_k = dW^T phi_q + v dkv^T + dks, dv = W^T a + phi_k dkv. Outputs
  that saw a non-finite value pass no gradient, and such values get none. 8 chunk matmuls, and 2 to recompute
  W and S."""
  fq, fk, vc, w, s, ks, denom, seen_bad = _causal_parts(phi_q, phi_k, v, chunk)
  inv = 1.0 / _safe(denom)
  a = _chunked(jnp.where(seen_bad, 0.0, dout), chunk) * inv[..., None]  # [rows, n, c, e]
  p = jnp.einsum("gnce,gnke->gnck", a, vc)  # [rows, n, c, c]
  r = jnp.einsum("gnce,gnme->gncm", a, s)  # [rows, n, c, m]
  a_numer = jnp.einsum("gnck,gnck->gnc", w, p) + jnp.einsum("gncm,gncm->gnc", fq, r)  # [rows, n, c]
  ddenom = jnp.where(denom > 0, -a_numer * inv, 0.0)  # [rows, n, c]
  tril = jnp.tril(jnp.ones((chunk, chunk), bool))
  dw = jnp.where(tril, p + ddenom[..., None], 0.0)  # [rows, n, c, c]
  dfq = jnp.einsum("gnck,gnkm->gncm", dw, fk) + r + ddenom[..., None] * ks[:, :, None, :]
  dkv = exclusive_prefix_sum(jnp.einsum("gncm,gnce->gnme", fq, a), reverse=True)  # [rows, n, m, e]
  dks = exclusive_prefix_sum(jnp.einsum("gncm,gnc->gnm", fq, ddenom), reverse=True)  # [rows, n, m]
  dfk = (jnp.einsum("gnck,gncm->gnkm", dw, fq) + jnp.einsum("gnce,gnme->gncm", vc, dkv)
         + dks[:, :, None, :])
  dv = jnp.einsum("gnck,gnce->gnke", w, a) + jnp.einsum("gncm,gnme->gnce", fk, dkv)
  length = v.shape[1]
  return _unchunked(dfq, length), _unchunked(dfk, length), jnp.where(jnp.isfinite(v), _unchunked(dv, length),
                                                                     0.0)


def exclusive_prefix_sum(x: Array, reverse: bool = False) -> Array:
  """out[:, i] = sum of x[:, j] for j < i (zeros for i = 0), or for j > i when `reverse`; x: [rows, n, ...].

  An associative scan shifted by one: each partial sum adds runs of neighbouring slices, so a later slice,
  even non-finite, never reaches an earlier output (a triangular matmul would multiply it by zero), and the
  log2(n) levels are whole-array elementwise passes that XLA:CPU spreads over its cores, where a sequential
  scan runs n small steps one after the other."""
  return shift(jax.lax.associative_scan(jnp.add, x, reverse=reverse, axis=1), 1, reverse, 0.0)


def check_args(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any, chunk_size: Any,
               row_chunks: Any) -> tuple[Array, Array, Array, Array | None, bool, int, int | None]:
  """The contract checks of the feature-attention ops: (q, k, v, mask, causal, chunk, row chunks); mask
  stays None when not given (every key real); row chunks:
  as given, checked (`attention_baselines.common.num_row_chunks`)."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op, keep_none=True)
  causal = contract.check_bool(causal, name="causal", op=op)
  chunk = contract.check_positive_int(chunk_size, name="chunk_size", op=op)
  num_row_chunks(q.shape[0] * q.shape[2], q.shape[1], row_chunks, op=op)  # rejects a bad count
  return q, k, v, mask, causal, chunk, row_chunks


@jax.custom_jvp
def elu_feature_map(x: Array) -> Array:
  """phi(x) = elu(x) + 1 > 0, the paper's feature map, as x + 1 above zero and exp(x) below (exactly
  elu + 1, without expm1's slower kernel and its rounding in the added 1)."""
  return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


@elu_feature_map.defjvp
def _elu_feature_map_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
  """phi'(x) = 1 above zero and exp(x) = phi(x) at or below it, so phi' = min(phi, 1): the derivative
  from the output alone, without a second exp or the selects of the two branches' autodiff."""
  (x,), (dx,) = primals, tangents
  y = elu_feature_map(x)
  return y, dx * jnp.minimum(y, 1.0)


def _elu_features(q: Array, k: Array, valid: Array | None, params: None) -> tuple[Array, Array]:
  """The linear transformer's `FeatureMap`: elu + 1 of q and of the real keys (masked keys selected to zero
  first, so a NaN there reaches no gradient)."""
  if valid is None:
    return elu_feature_map(q), elu_feature_map(k)
  phi_k = elu_feature_map(jnp.where(valid, k, 0.0))
  return elu_feature_map(q), jnp.where(valid, phi_k, 0.0)


def _safe(denom: Array) -> Array:
  return jnp.where(denom > 0, denom, 1.0)


@contract.partitioned_op()
def linear(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
           chunk_size: int = DEFAULT_CHUNK, row_chunks: int | None = None) -> Array:
  """Linear-transformer attention with phi = elu + 1 (no logit scale: the paper applies phi to q and k as is).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  chunk_size: positions per chunk of the causal prefix sum (cost O(L (chunk + d) d)); unused bidirectionally.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`attention_baselines.common.num_row_chunks`; None = automatic).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  q, k, v, mask, causal, chunk, chunks = check_args(q, k, v, mask, op="linear", causal=causal,
                                                    chunk_size=chunk_size, row_chunks=row_chunks)
  return feature_attention(q, k, v, mask, None, _elu_features, causal=causal, chunk=chunk, row_chunks=chunks,
                           op="linear")
