"""ETC global-local attention (Ainslie et al., 2020), bidirectional.

Two inputs: the long input (the L tokens of the op contract) and a global input of g = ceil(L / s) tokens,
global token t standing for segment t, the long positions [t s, (t + 1) s) (`segment_length` s; ETC puts
one global token per sentence). Attention is split into four pieces under two softmaxes:
  * long query i: l2l, the long keys j with |j - i| <= r (`radius`), and l2g, every global key, in one
    softmax;
  * global query t: g2g, every global key, and g2l, the long keys of its own segment (ETC's hard g2l mask,
    `hard_g2l=True`) or every long key, in one softmax.
Relative position labels (`max_distance` k): l2l and g2g pairs get label clip(j - i, -k, k) (positions in
their own input), l2g and g2l pairs one of two labels, "own segment" or "other segment" (ETC's two extra
labels for the links between a global token and the long tokens). `rel_bias` [heads | 1, 2k + 3] holds a
learned bias per label and head, added to the scaled logits: columns clip(j - i) + k, then 2k + 1 (other
segment), 2k + 2 (own segment). ETC's labels are relative key vectors a_l (logit q (k + a_l)); this op
takes a scalar per label and head.

The global keys and values are op arguments (the model derives them; `models/etc_attention.py`); without
them the op uses the masked mean of each segment's keys and values. A global token whose segment holds no
real long token is masked. O(L (2r + g) d + g (g + s) d), never an [L, L] array: l2l runs on blocks of r
positions against their neighbour blocks.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_baselines.common import from_rows, neighbour_blocks, to_rows
from attention_core import contract
from attention_core.blocks import num_blocks, to_grid
from attention_core.combine import Piece, flag_nonfinite, flagged_sum, joint_softmax

Array = Any


def auto_params(length: int) -> dict[str, int]:
  """ETC-base's local radius r = 84 and maximum relative distance k = 12, and one global token per 32 long
  tokens (the paper's 128-512 global tokens for 4096 long ones are segments of 8 to 32)."""
  return {"segment_length": 32, "radius": 84, "max_distance": 12}


def num_global(length: int, segment_length: int) -> int:
  """g = ceil(L / s): the number of global tokens."""
  return -(-length // segment_length)


def _check_nonnegative(value: Any, *, name: str, op: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"{op}: argument {name!r} must be a non-negative int, got {value!r}")
  return int(value)


def _check_global(x: Any, shape: tuple[int, ...], *, name: str, op: str) -> Array:
  if x is None:
    return None
  if not hasattr(x, "shape") or tuple(x.shape) != shape:
    raise ValueError(f"{op}: argument {name!r} must have shape [batch, globals, heads, dim] = {shape}, "
                     f"got {getattr(x, 'shape', type(x).__name__)}")
  return jnp.asarray(x)


def segment_means(x: Array, mask: Array | None, segment_length: int) -> Array:
  """x [batch, length, ...] -> [batch, g, ...]: each segment's mean over its real tokens (mask [batch,
  length], None = all real; masked tokens are selected out first, so NaN there stays out; a segment without
  a real token gives zeros)."""
  batch, length = x.shape[:2]
  segment_length = min(segment_length, length)
  g = num_global(length, segment_length)
  real = jnp.ones((batch, length), bool) if mask is None else mask
  real = real.reshape(real.shape + (1,) * (x.ndim - 2))  # [batch, length, 1, ...]
  xs = to_grid(jnp.where(real, x, 0.0), g, segment_length, axis=1)  # [batch, g, s, ...]
  count = jnp.sum(to_grid(real, g, segment_length, axis=1, fill=False), axis=2)  # [batch, g, 1, ...]
  return jnp.sum(xs, axis=2) / jnp.maximum(count, 1).astype(x.dtype)


def etc_attention(q: Array, k: Array, v: Array, *, mask: Array | None = None, segment_length: int = 32,
                  radius: int = 84, max_distance: int = 12, rel_bias: Array | None = None,
                  global_q: Array | None = None, global_k: Array | None = None,
                  global_v: Array | None = None, hard_g2l: bool = True,
                  with_global: bool = False) -> tuple[Array, Array | None]:
  """The long and (with_global) global outputs of ETC attention; `etc` is the op-contract form.

  q, k: [batch, L, heads, head_dim]; v: [batch, L, heads, value_dim]; mask: [batch, L] bool (long keys).
  global_q, global_k: [batch, g, heads, head_dim]; global_v: [batch, g, heads, value_dim]; None = the
    segment means of q, k, v over their real tokens.
  rel_bias: [heads or 1, 2 * max_distance + 3] or None (no bias).
  Returns (long [batch, L, heads, value_dim], global [batch, g, heads, value_dim] or None) in v's dtype.
  """
  op = "etc"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  s = contract.check_positive_int(segment_length, name="segment_length", op=op)
  r = _check_nonnegative(radius, name="radius", op=op)
  kd = _check_nonnegative(max_distance, name="max_distance", op=op)
  hard_g2l = contract.check_bool(hard_g2l, name="hard_g2l", op=op)
  batch, length, heads, head_dim = q.shape
  dv = v.shape[-1]
  s = min(s, length)
  g = num_global(length, s)
  global_q = _check_global(global_q, (batch, g, heads, head_dim), name="global_q", op=op)
  global_k = _check_global(global_k, (batch, g, heads, head_dim), name="global_k", op=op)
  global_v = _check_global(global_v, (batch, g, heads, dv), name="global_v", op=op)
  labels = 2 * kd + 3
  if rel_bias is not None:
    rel_bias = jnp.asarray(rel_bias)
    if rel_bias.ndim != 2 or rel_bias.shape[0] not in (1, heads) or rel_bias.shape[1] != labels:
      raise ValueError(f"{op}: argument 'rel_bias' must have shape [heads or 1, 2 * max_distance + 3] = "
                       f"[{heads} or 1, {labels}], got {tuple(rel_bias.shape)}")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)
  rows = batch * heads

  # Global tokens: a segment without a real long token has no global token (its key is masked).
  seg_real = jnp.any(to_grid(mask, g, s, axis=1, fill=False), axis=2)  # [batch, g]
  if global_k is None:
    global_k = segment_means(k, mask, s)
  if global_v is None:
    global_v = segment_means(v, mask, s)
  greal = seg_real[:, :, None, None]
  global_k, global_v = (jnp.where(greal, x, 0.0) for x in (global_k, global_v))
  kh, vh = (jnp.where(mask[:, :, None, None], x, 0.0) for x in (k, v))  # masked keys inert
  qh, kh, vh = (to_rows(x, ct) for x in (q, kh, vh))  # [rows, L, dim]
  gk, gv = to_rows(global_k, ct), to_rows(global_v, ct)  # [rows, g, dim]
  key_real = jnp.repeat(mask, heads, axis=0)  # [rows, L]
  gkey_real = jnp.repeat(seg_real, heads, axis=0)  # [rows, g]
  if rel_bias is None:
    bias = jnp.zeros((rows, labels), ct)
  else:
    bias = jnp.tile(jnp.broadcast_to(rel_bias.astype(ct), (heads, labels)), (batch, 1))  # [rows, labels]
  other, own = 2 * kd + 1, 2 * kd + 2

  def rel(delta: np.ndarray) -> np.ndarray:
    return np.clip(delta, -kd, kd) + kd

  def segment_bias(own_pair: np.ndarray) -> Array:  # [Q, K] static bool -> [rows, Q, K]
    return jnp.where(own_pair[None], bias[:, own, None, None], bias[:, other, None, None])

  # Long queries: l2l on blocks of w = max(r, 1) positions against their neighbour blocks, l2g shared.
  w = min(max(r, 1), length)
  n = num_blocks(length, w)
  qb = to_grid(qh * scale, n, w, axis=1)  # [rows, n, w, head_dim]
  kw = neighbour_blocks(to_grid(kh, n, w, axis=1), (-1, 0, 1), axis=1)  # [rows, n, 3w, head_dim]
  # Values flagged once: a real value outside the radius (zero weight) must not reach the output as NaN.
  vw = neighbour_blocks(to_grid(flag_nonfinite(vh), n, w, axis=1), (-1, 0, 1), axis=1)  # [rows, n, 3w, dv+1]
  mw = neighbour_blocks(to_grid(key_real, n, w, axis=1, fill=False), (-1, 0, 1), axis=1, fill=False)
  delta = np.arange(3 * w)[None, :] - w - np.arange(w)[:, None]  # [w, 3w]: key - query position
  band = np.abs(delta) <= r
  l2l = Piece(jnp.einsum("gnqd,gnkd->gnqk", qb, kw) + bias[:, rel(delta)][:, None],  # [rows, n, w, 3w]
              mw[:, :, None, :] & band, lambda p: flagged_sum("gnqk,gnkd->gnqd", p, vw))
  qpos = np.arange(n * w)
  gl = jnp.einsum("gld,gtd->glt", qb.reshape(rows, n * w, head_dim), gk)  # [rows, n * w, g]
  gl = gl + segment_bias(qpos[:, None] // s == np.arange(g)[None, :])
  l2g = Piece(gl.reshape(rows, n, w, g), gkey_real[:, None, None, :],
              lambda p: jnp.einsum("gnqt,gtd->gnqd", p, gv))
  long_out = joint_softmax([l2l, l2g]).reshape(rows, n * w, dv)[:, :length]
  long_out = from_rows(long_out, batch, v.dtype)  # [batch, L, heads, dv]
  if not with_global:
    return long_out, None

  # Global queries: g2g, and g2l over the own segment (hard) or every long token.
  if global_q is None:
    global_q = segment_means(q, mask, s)
  gq = to_rows(global_q, ct) * scale  # [rows, g, head_dim]
  tpos = np.arange(g)
  g2g = Piece(jnp.einsum("gtd,gud->gtu", gq, gk) + bias[:, rel(tpos[None, :] - tpos[:, None])],
              gkey_real[:, None, :], lambda p: jnp.einsum("gtu,gud->gtd", p, gv))  # [rows, g, g]
  if hard_g2l:
    ks, vs = to_grid(kh, g, s, axis=1), to_grid(vh, g, s, axis=1)  # [rows, g, s, dim]; padding zero
    g2l = Piece(jnp.einsum("gtd,gtjd->gtj", gq, ks) + bias[:, own, None, None],  # [rows, g, s]
                to_grid(key_real, g, s, axis=1, fill=False), lambda p: jnp.einsum("gtj,gtjd->gtd", p, vs))
  else:
    g2l = Piece(jnp.einsum("gtd,gjd->gtj", gq, kh)  # [rows, g, L]
                + segment_bias(np.arange(length)[None, :] // s == tpos[:, None]),
                key_real[:, None, :], lambda p: jnp.einsum("gtj,gjd->gtd", p, vh))
  global_out = from_rows(joint_softmax([g2g, g2l]), batch, v.dtype)  # [batch, g, heads, dv]
  return long_out, global_out


@contract.partitioned_op(per_head=("rel_bias",), like_q=("global_q", "global_k", "global_v"))
def etc(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, segment_length: int = 32,
        radius: int = 84, max_distance: int = 12, rel_bias: Array | None = None,
        global_q: Array | None = None, global_k: Array | None = None, global_v: Array | None = None,
        hard_g2l: bool = True, return_global: bool = False) -> Any:
  """ETC global-local attention, bidirectional only (causal=False).

  q, k: [batch, L, heads, head_dim]; v: [batch, L, heads, value_dim]; mask: [batch, L] bool.
  segment_length s: long tokens per global token (g = ceil(L / s) global tokens); radius r: the l2l window
  |j - i| <= r; max_distance k and rel_bias [heads or 1, 2k + 3]: relative position biases (module
  docstring): one learned scalar per label and head added to the logits, not ETC's relative key vectors;
  global_q/k/v: [batch, g, heads, dim] (None: segment means); hard_g2l (default True, ETC's hard mask): a
  global token reads only its own segment's long tokens (False: every long token).
  Returns only the long tokens' output [batch, L, heads, value_dim] in v's dtype by default; with
  return_global=True, the pair (long output, global output [batch, g, heads, value_dim]).
  """
  if contract.check_bool(causal, name="causal", op="etc"):
    raise ValueError("etc: argument 'causal' must be False: ETC attention is bidirectional only "
                     "(l2l and the global tokens read later positions)")
  long_out, global_out = etc_attention(
      q, k, v, mask=mask, segment_length=segment_length, radius=radius, max_distance=max_distance,
      rel_bias=rel_bias, global_q=global_q, global_k=global_k, global_v=global_v, hard_g2l=hard_g2l,
      with_global=bool(return_global))
  return (long_out, global_out) if return_global else long_out
