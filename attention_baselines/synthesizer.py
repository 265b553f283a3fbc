"""Synthesizer attention (Tay et al., ICML 2021) under the op contract: attention weights without q.k.

Dense synthesizer: each token's logits over the positions come from a two-layer MLP of that token alone,
B_i = W2 relu(W1 x_i + b1) + b2 (x_i: the token's query vector per head; W2 has one output per position up to
a fixed maximum length). Random synthesizer: one [max_len, max_len] logits matrix per head, learned or fixed,
independent of the input. Both take the softmax of those logits (no 1/sqrt(d): they are not dot products) over
the visible positions and mix the values: O(L^2) like dense attention. Keys are not read. The causal mask and
the key mask apply to the synthesized logits as to dot-product logits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_core import contract
from attention_core.combine import attend

Array = Any


def check_param(x: Array, *, name: str, shape: tuple, op: str) -> Array:
  """Checks x against `shape` (None = any size, ('>=', n) = at least n, ('heads', h) = 1 or h) and returns it
  as an array."""
  x = jnp.asarray(x)
  ok = x.ndim == len(shape)
  for got, want in zip(x.shape, shape, strict=False):
    if isinstance(want, tuple) and want[0] == "heads":
      ok = ok and got in (1, want[1])
    elif isinstance(want, tuple):
      ok = ok and got >= want[1]
    elif want is not None:
      ok = ok and got == want
  if not ok:
    desc = ", ".join("*" if w is None else (f"1|{w[1]}" if isinstance(w, tuple) and w[0] == "heads" else
                                            f">={w[1]}" if isinstance(w, tuple) else str(w)) for w in shape)
    raise ValueError(f"{op}: argument {name!r} must have shape [{desc}], got {tuple(x.shape)}")
  return x


def _attend_synthesized(logits: Array, v: Array, mask: Array, causal: bool) -> Array:
  """Softmax over the visible keys of logits [batch, heads, L, L], times v [batch, L, heads, dv]."""
  length = v.shape[1]
  valid = mask[:, None, None, :]  # [batch, 1, 1, L]
  if causal:
    valid = valid & jnp.tril(jnp.ones((length, length), dtype=bool))
  vh = jnp.swapaxes(jnp.where(mask[:, :, None, None], v.astype(logits.dtype), 0.0), 1, 2)  # [b, heads, L, dv]
  out = attend(logits, valid, vh, "bhqk,bhkd->bhqd")  # [batch, heads, L, dv]
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)


def synthesizer_dense(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, w1: Array,
                      b1: Array, w2: Array, b2: Array) -> Array:
  """Dense synthesizer. w1: [heads, head_dim, hidden], b1: [heads, hidden], w2: [heads, hidden, max_len],
  b2: [heads, max_len] with max_len >= L (the first L outputs are the logits over positions); a leading 1
  instead of heads shares a weight across heads."""
  op = "synthesizer"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  _, length, heads, head_dim = q.shape
  hh = ("heads", heads)
  w1 = check_param(w1, name="w1", shape=(hh, head_dim, None), op=op)
  hidden = w1.shape[-1]
  b1 = check_param(b1, name="b1", shape=(hh, hidden), op=op)
  w2 = check_param(w2, name="w2", shape=(hh, hidden, (">=", length)), op=op)
  b2 = check_param(b2, name="b2", shape=(hh, w2.shape[-1]), op=op)
  ct = contract.softmax_dtype(q.dtype, v.dtype, w1.dtype, w2.dtype)
  w1, w2 = (jnp.broadcast_to(w, (heads, *w.shape[1:])).astype(ct) for w in (w1, w2[:, :, :length]))
  h = jax.nn.relu(jnp.einsum("blhd,hde->bhle", q.astype(ct), w1) + b1.astype(ct)[:, None])  # [b, h, L, hid]
  logits = jnp.einsum("bhle,hek->bhlk", h, w2) + b2[:, None, :length].astype(ct)  # [batch, heads, L, L]
  return _attend_synthesized(logits, v, mask, causal)  # logits: [batch, heads, L, L]


def synthesizer_random(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                       logits: Array) -> Array:
  """Random synthesizer. logits: [heads or 1, max_len, max_len], max_len >= L (the top-left L x L block)."""
  op = "synthesizer_random"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  causal = contract.check_bool(causal, name="causal", op=op)
  _, length, heads, _ = q.shape
  logits = check_param(logits, name="logits", shape=(("heads", heads), (">=", length), (">=", length)), op=op)
  ct = contract.softmax_dtype(v.dtype, logits.dtype)
  lg = jnp.broadcast_to(logits[None, :, :length, :length].astype(ct), (q.shape[0], heads, length, length))
  # [batch, heads, L, L]
  return _attend_synthesized(lg, v, mask, causal)
