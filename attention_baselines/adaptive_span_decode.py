"""Adaptive-span attention decoded from a ring of the last W = ceil(max_span + R) keys and values: no key
farther than that can have a positive soft mask, so a step costs O(W * d) whatever the sequence length, and
equals row `position` of the causal forward pass (`attention_baselines.adaptive_span`). Step arguments
besides the plan: `spans` [heads] in tokens and `positions` (None or [heads or 1, P, head_dim], row x the
embedding of distance x), as for the op (the model's current spans and relative position embeddings)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_baselines import adaptive_span as span_op
from attention_baselines.adaptive_span import OP, RAMP, check_max_span, check_ramp, check_spans, soft_mask
from attention_baselines.adaptive_span import window as span_window
from attention_core.combine import Piece, joint_softmax, weighted_sum
from attention_core.decode import Cache, Decoder, finish, token, write, zeros

Array = Any


def slots(max_length: int, max_span: Any, ramp: Any) -> int:
  """Ring size: every distance x < max_span + R, at most the sequence."""
  return max(1, min(max_length, span_window(check_max_span(max_span), check_ramp(ramp))))


def init_cache(batch: int, heads: int, max_length: int, head_dim: int, value_dim: int, dtype: Any, *,
               max_span: Any = None, ramp: Any = RAMP, **unused: Any) -> Cache:
  """A ring of `slots(...)` keys and values per head (position p lives in slot p mod slots)."""
  del unused
  n = slots(max_length, max_length if max_span is None else max_span, ramp)
  return {"k": zeros(batch, heads, n, head_dim, dtype), "v": zeros(batch, heads, n, value_dim, dtype)}


def step(cache: Cache, q: Array, k: Array, v: Array, position: Any, *, spans: Array, max_span: Any = None,
         ramp: Any = RAMP, positions: Array | None = None, pool_q: Array | None = None,
         pool_k: Array | None = None, **unused: Any) -> tuple[Array, Cache]:
  """Writes the token at slot position mod W and attends to the ring with the soft span mask (and the
  relative position embedding of each slot's distance)."""
  del pool_q, pool_k, unused
  x = token(q, k, v, position, None, None, op=OP)
  n = cache["k"].shape[2]
  cache = {"k": write(cache["k"], x.k, x.position % n), "v": write(cache["v"], x.v, x.position % n)}
  heads = q.shape[1]
  ramp = check_ramp(ramp)
  z = check_spans(spans, heads).astype(x.q.dtype)
  if max_span is not None:
    z = jnp.clip(z, 0.0, float(check_max_span(max_span)))
  else:
    z = jnp.maximum(z, 0.0)
  distance = (x.position - jnp.arange(n)) % n  # [slots]: slot j holds position `position - distance`
  m = soft_mask(distance.astype(z.dtype), z[:, None], ramp)  # [heads, slots]
  valid = (distance <= x.position) & (m > 0)  # [heads, slots]: written slots inside the span
  logits = jnp.einsum("bhd,bhnd->bhn", x.q, cache["k"])  # [batch, heads, slots]
  if positions is not None:
    p = span_op.check_positions(positions, heads, q.shape[-1], n)  # [heads or 1, P, head_dim]
    p = p.astype(x.q.dtype)
    logits = logits + jnp.einsum("bhd,hnd->bhn", x.q, p[:, distance])  # p of each slot's distance
  logits = logits * x.scale
  # m e^s / sum m e^s as a softmax of s + log m over the keys with m > 0.
  logits = logits + jnp.log(jnp.where(valid, m, 1.0))
  out = joint_softmax([Piece(logits, valid, lambda w: weighted_sum("bhn,bhnd->bhd", w, cache["v"]))])
  return finish(out, x), cache  # [batch, heads, value_dim]


def prefill(cache: Cache, q: Array, k: Array, v: Array, **unused: Any) -> Cache:
  """Writes the prompt's last min(prompt_length, W) keys and values (k [batch, prompt_length, heads,
  head_dim]) at their ring slots."""
  del q, unused
  n = cache["k"].shape[2]
  length = k.shape[1]
  keep = min(length, n)
  where = jnp.arange(length - keep, length) % n  # distinct slots
  out = {}
  for name, x in (("k", k), ("v", v)):
    last = jnp.swapaxes(x[:, length - keep:], 1, 2)  # [batch, heads, keep, dim]
    out[name] = cache[name].at[:, :, where].set(last.astype(cache[name].dtype))
  return out


ADAPTIVE_SPAN = Decoder(init_cache, step, prefill)
