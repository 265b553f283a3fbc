"""The linear transformer decoded as a recurrence (Katharopoulos et al., 2020, "transformers are RNNs"): per
head a running key-value summary S = sum_j phi(k_j) v_j^T [m, e] and key sum z = sum_j phi(k_j) [m], so a
token costs O(m e) whatever its position, and the cache does not grow with the length.

    out_t = phi(q_t)^T S_t / phi(q_t)^T z_t,   with S_t, z_t over j <= t

As in the causal forward pass (`attention_baselines.linear.feature_attention`), values enter with non-finite
entries selected to zero, and every output from a non-finite value on (per batch row and head) is NaN.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_baselines.linear import elu_feature_map
from attention_core import contract
from attention_core.decode import Cache, Decoder, finish, token, zeros

Array = Any


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               chunk_size: Any = None) -> Cache:
  """kv [batch, heads, m, e], ksum [batch, heads, m] and seen_bad [batch, heads] (a non-finite value so far);
  max_length and the forward pass's chunk_size do not shape it."""
  del max_length, chunk_size
  return {"kv": zeros(batch, heads, head_dim, value_dim, dtype),
          "ksum": jnp.zeros((batch, heads, head_dim), contract.softmax_dtype(dtype)),
          "seen_bad": jnp.zeros((batch, heads), bool)}


def clean_values(v: Array) -> tuple[Array, Array]:
  """v [..., e] -> (v with non-finite entries selected to 0, whether each row [...] held one)."""
  finite = jnp.isfinite(v)
  return jnp.where(finite, v, 0.0), ~jnp.all(finite, axis=-1)


def read_summaries(phi_q: Array, cache: Cache) -> Array:
  """phi(q)^T S / phi(q)^T z for phi_q [batch, heads, m] (zeros where the denominator is not positive), NaN
  for a head that has seen a non-finite value: [batch, heads, e]."""
  denom = jnp.einsum("bhm,bhm->bh", phi_q, cache["ksum"])  # [batch, heads]
  out = jnp.einsum("bhm,bhme->bhe", phi_q, cache["kv"]) / jnp.where(denom > 0, denom, 1.0)[..., None]
  return jnp.where(cache["seen_bad"][..., None], jnp.nan, out)


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, pool_q: Array | None = None,
         pool_k: Array | None = None, chunk_size: Any = None) -> tuple[Array, Cache]:
  """Adds the token's phi(k) v^T and phi(k) to the summaries, then reads them with phi(q)."""
  del pool_q, pool_k, chunk_size
  x = token(q, k, v, position, None, None, op="linear")
  phi_q, phi_k = elu_feature_map(x.q), elu_feature_map(x.k)  # [batch, heads, m]
  values, bad = clean_values(x.v)  # [batch, heads, e], [batch, heads]
  cache = {"kv": cache["kv"] + phi_k[..., :, None] * values[..., None, :],
           "ksum": cache["ksum"] + phi_k, "seen_bad": cache["seen_bad"] | bad}
  return finish(read_summaries(phi_q, cache), x), cache


def prefill(cache: Cache, q: Array, k: Array, v: Array, *, pool_q: Array | None = None,
            pool_k: Array | None = None, chunk_size: Any = None) -> Cache:
  """Adds the prompt's summaries (k [batch, prompt_length, heads, head_dim], v [..., value_dim]) at once."""
  del q, pool_q, pool_k, chunk_size
  ct = cache["kv"].dtype
  phi_k = elu_feature_map(k.astype(ct))  # [batch, prompt_length, heads, m]
  values, bad = clean_values(v.astype(ct))  # [batch, prompt_length, heads, e], [batch, prompt_length, heads]
  return {"kv": cache["kv"] + jnp.einsum("blhm,blhe->bhme", phi_k, values),
          "ksum": cache["ksum"] + jnp.sum(phi_k, axis=1),
          "seen_bad": cache["seen_bad"] | jnp.any(bad, axis=1)}


LINEAR = Decoder(init_cache, step, prefill)
