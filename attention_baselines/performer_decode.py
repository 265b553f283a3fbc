"""Performer (FAVOR+) decoded as a recurrence: the running key-value summary and key sum of
`attention_baselines.linear_decode`, with FAVOR+'s positive random features, so a token costs O(m e) and the
cache does not grow with the length.

The forward pass stabilises the key features by one factor per batch and head, the max over all real keys
of W k' - |k'|^2 / 2, which cancels in the normalised output. A decoder cannot see the later keys, so it keeps
the running max instead (`shift`) and rescales its summaries by exp(old - new) whenever a key raises it: the
same outputs, up to rounding. Values enter with non-finite entries selected to zero, and every output from a
non-finite value on (per batch row and head) is NaN, as in the forward pass.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_baselines.linear_decode import clean_values, read_summaries
from attention_baselines.performer import DEFAULT_FEATURES, key_exponents, query_features, resolve_features
from attention_core import contract
from attention_core.decode import Cache, Decoder, finish, token

Array = Any


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               features: Array | None = None, rng: Array | None = None, num_features: int = DEFAULT_FEATURES,
               chunk_size: Any = None) -> Cache:
  """kv [batch, heads, m, e], ksum [batch, heads, m], shift [batch, heads] (the summaries' stabiliser, -inf
  before any finite key) and seen_bad [batch, heads]; m from `features` or `num_features`."""
  del max_length, rng, chunk_size
  ct = contract.softmax_dtype(dtype)
  m = num_features if features is None else features.shape[0]
  return {"kv": jnp.zeros((batch, heads, m, value_dim), ct), "ksum": jnp.zeros((batch, heads, m), ct),
          "shift": jnp.full((batch, heads), -jnp.inf, ct), "seen_bad": jnp.zeros((batch, heads), bool)}


def _absorb(cache: Cache, k: Array, v: Array, w: Array) -> Cache:
  """The summaries with keys k [batch, n, heads, d] and values v [batch, n, heads, e] added (w [m, d])."""
  kp = key_exponents(k, w)  # [batch, n, heads, m]
  new_max = jnp.max(jnp.where(jnp.isfinite(kp), kp, -jnp.inf), axis=(1, 3))  # [batch, heads]
  shift = jnp.maximum(cache["shift"], new_max)
  safe = jnp.where(jnp.isfinite(shift), shift, 0.0)
  # exp(old - new) <= 1 for the summaries so far; they are zeros (or NaN, kept) while the old shift is -inf.
  rescale = jnp.where(jnp.isfinite(cache["shift"]), jnp.exp(cache["shift"] - safe), 0.0)  # [batch, heads]
  phi_k = jnp.exp(kp - safe[:, None, :, None])  # [batch, n, heads, m]
  values, bad = clean_values(v)  # [batch, n, heads, e], [batch, n, heads]
  return {"kv": cache["kv"] * rescale[..., None, None] + jnp.einsum("bnhm,bnhe->bhme", phi_k, values),
          "ksum": cache["ksum"] * rescale[..., None] + jnp.sum(phi_k, axis=1), "shift": shift,
          "seen_bad": cache["seen_bad"] | jnp.any(bad, axis=1)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None, features: Array | None = None, rng: Array | None = None,
         num_features: int = DEFAULT_FEATURES, chunk_size: Any = None) -> tuple[Array, Cache]:
  """Adds the token's features and value to the summaries, then reads them with phi(q)."""
  del pool_q, pool_k, chunk_size
  x = token(q, k, v, position, None, None, op="performer")
  w = resolve_features(features, rng, num_features, q.shape[-1], x.q.dtype, op="performer")
  cache = _absorb(cache, x.k[:, None], x.v[:, None], w)
  return finish(read_summaries(query_features(x.q, w), cache), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, *, pool_q: Array | None = None,
            pool_k: Array | None = None, features: Array | None = None, rng: Array | None = None,
            num_features: int = DEFAULT_FEATURES, chunk_size: Any = None) -> Cache:
  """Adds the prompt's keys k [batch, prompt_length, heads, head_dim] and values at once."""
  del q, pool_q, pool_k, chunk_size
  ct = cache["kv"].dtype
  w = resolve_features(features, rng, num_features, k.shape[-1], ct, op="performer")
  return _absorb(cache, k.astype(ct), v.astype(ct), w)


PERFORMER = Decoder(init_cache, step, prefill)
