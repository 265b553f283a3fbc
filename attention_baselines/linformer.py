"""Linformer (Wang et al. 2020) under the op contract: keys and values projected along the length.

softmax(q (E k)^T / sqrt(d)) (F v), with E, F: [proj_dim, L] learned (or fixed random) projections, so the
cost is O(L * proj_dim * d). Every query mixes all positions through E and F, so there is no causal form (as
in the paper): causal=True is a ValueError. Masked keys and values are zeroed (by select) before the
projection, so a padded position contributes nothing whatever it holds.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.combine import attend

Array = Any
PROJ_DIM = 256  # the projected length k: the YOSO paper's Linformer setting (also the LRA one)


def _projection(p: Array, *, name: str, length: int, heads: int) -> Array:
  """[proj_dim, max_len] or [heads, proj_dim, max_len] -> [heads or 1, proj_dim, length] (first columns)."""
  p = jnp.asarray(p)
  if p.ndim == 2:
    p = p[None]
  if p.ndim != 3 or p.shape[0] not in (1, heads) or p.shape[2] < length:
    raise ValueError(f"linformer: argument {name!r} must have shape [proj_dim, max_len] or "
                     f"[heads={heads}, proj_dim, max_len] with max_len >= length = {length}, "
                     f"got {tuple(p.shape)}")
  return p[:, :, :length]


def linformer(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, proj_k: Array,
              proj_v: Array) -> Array:
  """Length-wise low-rank attention. proj_k (E), proj_v (F): [proj_dim, max_len] shared by the heads, or
  [heads, proj_dim, max_len]; the first L columns project a length-L input."""
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op="linformer")
  if contract.check_bool(causal, name="causal", op="linformer"):
    raise ValueError("linformer: argument 'causal' must be False: the length projection mixes every position "
                     "into every projected key, so Linformer has no causal form")
  batch, length, heads, head_dim = q.shape
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  e = _projection(proj_k, name="proj_k", length=length, heads=heads).astype(ct)  # [h or 1, proj_dim, L]
  f = _projection(proj_v, name="proj_v", length=length, heads=heads).astype(ct)
  keep = mask[:, :, None, None]  # [batch, L, 1, 1]
  kz = jnp.where(keep, k.astype(ct), 0.0)  # [batch, L, heads, head_dim]
  vz = jnp.where(keep, v.astype(ct), 0.0)  # [batch, L, heads, value_dim]
  e, f = (jnp.broadcast_to(x, (heads, *x.shape[1:])) for x in (e, f))  # [heads, proj_dim, L]
  ek = jnp.einsum("hpl,blhd->bhpd", e, kz)  # [batch, heads, proj_dim, head_dim]
  fv = jnp.einsum("hpl,blhd->bhpd", f, vz)  # [batch, heads, proj_dim, value_dim]
  qh = jnp.swapaxes(q.astype(ct), 1, 2)  # [batch, heads, L, head_dim]
  logits = jnp.einsum("bhqd,bhpd->bhqp", qh, ek) * contract.logit_scale(head_dim)  # [batch, heads, L, proj]
  out = attend(logits, jnp.ones((), bool), fv, "bhqp,bhpd->bhqd")  # [batch, heads, L, value_dim]
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)
