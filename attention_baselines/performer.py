"""Performer attention (Choromanski et al., 2021): FAVOR+, positive orthogonal random features.

softmax attention's kernel exp(q.k / sqrt(d)) is estimated without bias by phi(q').phi(k') with
x' = x / d^(1/4) and the positive random features

    phi(x) = exp(W x - |x|^2 / 2) / sqrt(m),   W: [m, d], Gaussian rows, orthogonal in each block of d rows

so attention becomes linear attention with that feature map (`attention_baselines.linear.feature_attention`:
one key-value summary bidirectionally, chunked prefix sums causally; never an [L, L] array). Exponents are
stabilised by constants that cancel in the normalised output: each query's max over its features (a per-row
factor), and for keys the max over all real keys of W k' - |k'|^2 / 2 (one factor per batch and head), without
gradient.

The random features are an explicit input (`features`), or drawn from `rng` with `num_features` rows; the
model module owns them as state and redraws them on a schedule (models/performer_attention.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_baselines.linear import check_args, feature_attention
from attention_core import contract

Array = Any
DEFAULT_FEATURES = 256
# Causal chunk: with m = 256 features the chunk summaries are the larger term, so chunks twice linear's.
DEFAULT_CHUNK = 128


def orthogonal_features(rng: Array, num_features: int, head_dim: int, dtype: Any = jnp.float32) -> Array:
  """W: [num_features, head_dim]; each block of head_dim rows is orthogonal (a Haar-random rotation, from the
  QR of a Gaussian matrix) and every row gets the norm of an independent Gaussian vector, so each row alone is
  N(0, I) (the paper's orthogonal random features: unbiased, with lower variance than i.i.d. rows)."""
  op = "orthogonal_features"
  num_features = contract.check_positive_int(num_features, name="num_features", op=op)
  head_dim = contract.check_positive_int(head_dim, name="head_dim", op=op)
  blocks = -(-num_features // head_dim)
  block_key, norm_key = jax.random.split(rng)
  gauss = jax.random.normal(block_key, (blocks, head_dim, head_dim), dtype)
  qmat, rmat = jnp.linalg.qr(gauss)
  # Signs of R's diagonal make Q Haar-distributed; without them (Householder QR) every block's rows share a
  # sign pattern and the kernel estimate is biased.
  qmat = qmat * jnp.sign(jnp.diagonal(rmat, axis1=-2, axis2=-1))[..., None, :]
  rows = jnp.swapaxes(qmat, -1, -2)  # [blocks, d, d], orthonormal rows
  rows = rows.reshape(blocks * head_dim, head_dim)[:num_features]
  norms = jnp.linalg.norm(jax.random.normal(norm_key, (num_features, head_dim), dtype), axis=-1)
  return (rows * norms[:, None]).astype(dtype)  # [num_features, head_dim]


def softmax_kernel_features(x: Array, features: Array) -> Array:
  """The unstabilised positive features phi(x) = exp(W x - |x|^2 / 2) / sqrt(m): E[phi(a).phi(b)] = exp(a.b).

  x: [..., d]; features W: [m, d]. Returns [..., m]. (The op computes the same up to cancelling factors.)"""
  proj = jnp.einsum("...d,md->...m", x, features)
  return jnp.exp(proj - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)) / jnp.sqrt(features.shape[0])


def performer(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
              features: Array | None = None, rng: Array | None = None, num_features: int = DEFAULT_FEATURES,
              chunk_size: int = DEFAULT_CHUNK, row_chunks: int | None = None) -> Array:
  """FAVOR+ softmax attention.

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  features: [m, head_dim] random features shared by all heads (see `orthogonal_features`); when None they are
    drawn from `rng` with `num_features` rows (given features win: `rng` and `num_features` are then unused).
  chunk_size: positions per chunk of the causal prefix sum.
  row_chunks: rows of batch x heads run in this many chunks, one after the other
    (`attention_baselines.common.num_row_chunks`; None = automatic).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "performer"
  q, k, v, mask, causal, chunk, chunks = check_args(q, k, v, mask, op=op, causal=causal,
                                                    chunk_size=chunk_size, row_chunks=row_chunks)
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  w = resolve_features(features, rng, num_features, q.shape[-1], ct, op=op)  # [m, head_dim], every head's
  return _favor(q, k, v, causal=causal, mask=mask, features=w, chunk_size=chunk, row_chunks=chunks)


performer.partitions_itself = True  # through `_favor`, its features drawn first


@contract.partitioned_op()
def _favor(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None, features: Array,
           chunk_size: int, row_chunks: int | None) -> Array:
  """`performer` with its features [m, head_dim] drawn: drawn before the op partitions itself, every device
  uses the features a one-device call does, whatever splits the heads."""
  return feature_attention(q, k, v, mask, features, _favor_features, causal=causal, chunk=chunk_size,
                           row_chunks=row_chunks, op="performer")


def resolve_features(features: Array | None, rng: Array | None, num_features: int, head_dim: int,
                     dtype: Any, *, op: str) -> Array:
  """The random features W [m, head_dim] in `dtype`, without gradient: `features` if given, else drawn from
  `rng` with `num_features` rows; a ValueError naming the argument when neither fits."""
  if features is None and rng is None:
    raise ValueError(f"{op}: pass 'features' (an [m, head_dim] array) or 'rng' to draw them")
  if features is None:
    features = orthogonal_features(rng, num_features, head_dim)
  elif not hasattr(features, "shape") or features.ndim != 2 or features.shape[1] != head_dim:  # validation
    raise ValueError(f"{op}: argument 'features' must have shape [num_features, head_dim={head_dim}], "
                     f"got {getattr(features, 'shape', type(features).__name__)}")
  return jax.lax.stop_gradient(jnp.asarray(features).astype(dtype))


def query_features(q: Array, w: Array) -> Array:
  """phi(q') up to a per-query factor that cancels between numerator and denominator (|q'|^2 / 2 and the
  max over the features): q [..., d], w [m, d] -> [..., m]."""
  qp = jnp.einsum("...d,md->...m", q * float(q.shape[-1]) ** -0.25, w)  # [..., m]
  return jnp.exp(qp - jax.lax.stop_gradient(jnp.max(qp, axis=-1, keepdims=True)))


def key_exponents(k: Array, w: Array) -> Array:
  """The exponents of phi(k'), W k' - |k'|^2 / 2, before the stabilising shift: k [..., d] -> [..., m]."""
  ks = k * float(k.shape[-1]) ** -0.25
  return jnp.einsum("...d,md->...m", ks, w) - 0.5 * jnp.sum(ks * ks, axis=-1, keepdims=True)


def _favor_features(q: Array, k: Array, valid: Array | None, w: Array) -> tuple[Array, Array]:
  """FAVOR+'s `FeatureMap` (attention_baselines.linear) for rows q, k [rows, length, d] and features w [m,
     d], with
  the stabilising factors that cancel in the output: [rows, length, m] each. valid None: every key real."""
  phi_q = query_features(q, w)  # [rows, length, m]
  # Masked keys selected to zero first: a NaN there reaches no gradient.
  kp = key_exponents(k if valid is None else jnp.where(valid, k, 0.0), w)  # [rows, length, m]
  # One factor per (batch, head) row cancels too; only real keys set it.
  # Non-finite projections (a NaN or Inf key, which no visible output may depend on) stay out of the max.
  real = jnp.isfinite(kp) if valid is None else valid & jnp.isfinite(kp)
  kp_real = jnp.where(real, kp, -jnp.inf)
  kmax = jnp.max(kp_real, axis=(1, 2), keepdims=True)  # [rows, 1, 1]
  kmax = jax.lax.stop_gradient(jnp.where(jnp.isfinite(kmax), kmax, 0.0))
  phi_k = jnp.exp(kp - kmax)
  return phi_q, phi_k if valid is None else jnp.where(valid, phi_k, 0.0)
