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

from baselines.common import masked_head_major
from core import contract
from core.blocks import head_major, num_blocks, pad_to
from core.combine import weighted_sum

Array = Any
DEFAULT_CHUNK = 128


def feature_attention(phi_q: Array, phi_k: Array, v: Array, *, causal: bool, chunk_size: int) -> Array:
  """Normalised linear attention from feature maps (masked keys already zeroed in phi_k and v).

  phi_q, phi_k: [batch, heads, length, features] (non-negative); v: [batch, heads, length, value_dim].
  Returns [batch, heads, length, value_dim]; rows whose visible keys all have zero features give zeros.
  The normaliser rides along as one more value column (a column of ones), so numerator and denominator come
  out of the same contractions.
  """
  length = phi_q.shape[2]
  v1 = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)  # [batch, heads, length, e + 1]
  if not causal:
    kv = jnp.einsum("bhlm,bhld->bhmd", phi_k, v1)  # [batch, heads, features, value_dim + 1]
    numer = jnp.einsum("bhlm,bhmd->bhld", phi_q, kv)  # [batch, heads, length, value_dim + 1]
  else:
    c = min(chunk_size, length)
    n = num_blocks(length, c)

    def chunks(x: Array) -> Array:  # [batch, heads, length, dim] -> [batch, heads, n, c, dim]
      x = pad_to(x, n * c, axis=2)
      return x.reshape(*x.shape[:2], n, c, x.shape[-1])

    fq, fk, vc = chunks(phi_q), chunks(phi_k), chunks(v1)
    # Summaries of every chunk before this one: a strictly lower-triangular [n, n] matmul over the chunks'
    # own summaries (one large contraction; a chunk's own or later summary, even non-finite, never enters).
    kv = jnp.einsum("bhncm,bhncd->bhnmd", fk, vc)  # [batch, heads, n, features, value_dim + 1]
    kv = weighted_sum("pn,bhnmd->bhpmd", jnp.tril(jnp.ones((n, n), kv.dtype), -1), kv)
    within = jnp.einsum("bhncm,bhnkm->bhnck", fq, fk)  # [batch, heads, n, c, c]
    within = jnp.where(jnp.tril(jnp.ones((c, c), bool)), within, 0.0)
    # A later position's value (zero weight here) must not reach earlier outputs, even when it is NaN or Inf.
    numer = weighted_sum("bhnck,bhnkd->bhncd", within, vc) + jnp.einsum("bhncm,bhnmd->bhncd", fq, kv)
    numer = numer.reshape(*numer.shape[:2], n * c, -1)[:, :, :length]  # [batch, heads, length, e + 1]
  numer, denom = numer[..., :-1], numer[..., -1]
  return numer / jnp.where(denom > 0, denom, 1.0)[..., None]


def prepare(q: Array, k: Array, v: Array, mask: Array | None, *, op: str, causal: Any,
            chunk_size: Any) -> tuple[Array, Array, Array, Array, bool, int]:
  """Contract checks; head-major q, k, v in the softmax dtype with masked keys' k and v replaced by zeros (a
  select, so NaN or Inf there reaches neither outputs nor gradients).
  Returns (q, k, v, key_valid, causal, chunk); key_valid: [batch, 1, length, 1]."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  chunk = contract.check_positive_int(chunk_size, name="chunk_size", op=op)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  valid = mask[:, None, :, None]  # [batch, 1, length, 1]
  qh = head_major(q.astype(ct))  # [batch, heads, length, head_dim]
  kh = masked_head_major(k, mask, ct)  # [batch, heads, length, head_dim]
  vh = masked_head_major(v, mask, ct)  # [batch, heads, length, value_dim]
  return qh, kh, vh, valid, causal, chunk


def elu_feature_map(x: Array) -> Array:
  """phi(x) = elu(x) + 1 > 0, the paper's feature map."""
  return jax.nn.elu(x) + 1.0


def linear(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
           chunk_size: int = DEFAULT_CHUNK) -> Array:
  """Linear-transformer attention with phi = elu + 1 (no logit scale: the paper applies phi to q and k as is).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  chunk_size: positions per chunk of the causal prefix sum (cost O(L (chunk + d) d)); unused bidirectionally.
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  out_dtype = v.dtype
  qh, kh, vh, valid, causal, chunk = prepare(q, k, v, mask, op="linear", causal=causal, chunk_size=chunk_size)
  phi_k = jnp.where(valid, elu_feature_map(kh), 0.0)  # [batch, heads, length, head_dim]
  out = feature_attention(elu_feature_map(qh), phi_k, vh, causal=causal, chunk_size=chunk)
  return head_major(out).astype(out_dtype)
