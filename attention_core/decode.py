"""Cached autoregressive decoding: the interface every causal op's incremental form implements, and helpers.

A `Decoder` is the incremental form of a causal op: `init_cache(...)` allocates the per-layer cache,
`step(cache, q_t, k_t, v_t, position)` attends the query at `position` to everything up to it and returns
`(out_t, cache)`, and `prefill(cache, q, k, v)` fills the cache from a prompt. A step equals row `position` of
the op's causal forward pass on the same tokens.

Layouts (head-major, one token): q_t, k_t, pool_q, pool_k: [batch, heads, head_dim]; v_t: [batch, heads,
value_dim]; `position`: an int32 scalar shared by the batch; out_t: [batch, heads, value_dim] in v's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_core import contract
from attention_core.combine import Piece, joint_softmax, weighted_sum

Array = Any
Cache = dict[str, Array]


class Decoder(NamedTuple):
  """The incremental form of a causal op (see the module docstring for the call conventions).

  init_cache(batch, heads, max_length, head_dim, value_dim, dtype, **plan_params) -> cache
  step(cache, q_t, k_t, v_t, position, *, pool_q=None, pool_k=None, **plan_params) -> (out_t, cache)
  prefill(cache, q, k, v, *, pool_q=None, pool_k=None, **plan_params) -> cache, for positions
    [0, prompt_length), with q, k, pool_q, pool_k: [batch, prompt_length, heads, head_dim] (the op
    contract's layout).
  pad_prompt: the prompt's own forward pass runs over max_length tokens, the prompt zero-padded (a causal op's
    prompt rows never see the padding), for ops whose plan depends on the length (Longformer's global
    positions, BigBird's block pattern); their models pass no per-token op arguments.
  """

  init_cache: Callable[..., Cache]
  step: Callable[..., tuple[Array, Cache]]
  prefill: Callable[..., Cache]
  pad_prompt: bool = False


def scan_prefill(step: Callable[..., tuple[Array, Cache]]) -> Callable[..., Cache]:
  """A prefill that runs `step` over the prompt positions in order (exact by construction)."""

  def prefill(cache: Cache, q: Array, k: Array, v: Array, *, pool_q: Array | None = None,
              pool_k: Array | None = None, **params: Any) -> Cache:
    xs = {"q": q, "k": k, "v": v, "pool_q": q if pool_q is None else pool_q,
          "pool_k": k if pool_k is None else pool_k}
    xs = {name: jnp.swapaxes(x, 0, 1) for name, x in xs.items()}  # [prompt_length, batch, heads, dim]

    def body(c, inputs):
      t, x = inputs
      _, c = step(c, x["q"], x["k"], x["v"], t, pool_q=x["pool_q"], pool_k=x["pool_k"], **params)
      return c, None

    cache, _ = jax.lax.scan(body, cache, (jnp.arange(q.shape[1], dtype=jnp.int32), xs))
    return cache

  return prefill


def bind(decoder: Decoder, **fixed: Any) -> Decoder:
  """The decoder with some plan parameters fixed (as `functools.partial` fixes them for the op)."""
  return decoder._replace(**{name: functools.partial(getattr(decoder, name), **fixed)
                              for name in ("init_cache", "step", "prefill")})


def make_decoder(init_cache: Callable[..., Cache], step: Callable[..., tuple[Array, Cache]]) -> Decoder:
  return Decoder(init_cache, step, scan_prefill(step))


class Token(NamedTuple):
  """One token's inputs in the softmax dtype (float32, or float64 under x64)."""

  q: Array  # [batch, heads, head_dim]
  k: Array
  v: Array  # [batch, heads, value_dim]
  pool_q: Array  # [batch, heads, head_dim]
  pool_k: Array
  position: Array  # int32 scalar
  scale: float
  out_dtype: Any


def token(q: Array, k: Array, v: Array, position: Any, pool_q: Array | None, pool_k: Array | None, *,
          op: str) -> Token:
  """Checks one decoding step's inputs and casts them to the softmax dtype."""
  if q.ndim != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2] or v.ndim != 3:
    raise ValueError(f"{op}: decoding step needs q_t, k_t [batch, heads, head_dim] and v_t [batch, heads, "
                     f"value_dim], got q_t {tuple(q.shape)}, k_t {tuple(k.shape)}, v_t {tuple(v.shape)}")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  pq = q if pool_q is None else pool_q
  pk = k if pool_k is None else pool_k
  return Token(q.astype(ct), k.astype(ct), v.astype(ct), pq.astype(ct), pk.astype(ct),
               jnp.asarray(position, jnp.int32), contract.logit_scale(q.shape[-1]), v.dtype)


def zeros(batch: int, heads: int, n: Any, dim: int, dtype: Any) -> Array:
  n = n if isinstance(n, tuple) else (n,)
  return jnp.zeros((batch, heads, *n, dim), contract.softmax_dtype(dtype))


def write(buf: Array, x: Array, *index: Array) -> Array:
  """buf [batch, heads, *N, dim] with x [batch, heads, dim] written at `index` (one per N axis)."""
  x = x.reshape(*x.shape[:2], *([1] * len(index)), x.shape[-1]).astype(buf.dtype)
  zero = jnp.zeros((), jnp.int32)
  return jax.lax.dynamic_update_slice(buf, x, (zero, zero, *index, zero))


def read(buf: Array, start: Array, size: int, axis: int) -> Array:
  return jax.lax.dynamic_slice_in_dim(buf, start, size, axis=axis)




def keys_piece(x: Token, k: Array, v: Array, valid: Array) -> Piece:
  """Attention of the token to the keys k [batch, heads, n, head_dim] where valid ([n] or broadcastable)."""
  logits = jnp.einsum("bhd,bhnd->bhn", x.q, k) * x.scale  # [batch, heads, n]
  return Piece(logits, valid, lambda w: jnp.einsum("bhn,bhnd->bhd", w, v))


def attend_cached(x: Token, k: Array, v: Array, valid: Array) -> Array:
  """The token's softmax attention over cached keys k [batch, heads, n, head_dim] and values v [batch, heads,
  n, value_dim] where valid ([n]); a value outside valid (a stale ring slot, even NaN) never reaches the
  output (`weighted_sum`). Returns [batch, heads, value_dim]."""
  piece = keys_piece(x, k, v, valid)._replace(apply=lambda w: weighted_sum("bhn,bhnd->bhd", w, v))
  return joint_softmax([piece])


def finish(out: Array, x: Token) -> Array:
  return out.astype(x.out_dtype)  # [batch, heads, value_dim]
