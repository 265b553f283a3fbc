"""Transformer-XL relative positional attention (Dai et al., 2019, arXiv 1901.02860), causal only.

The keys and values cover [memory; segment]: M = k.shape[1] - q.shape[1] >= 0 memory positions (hidden states
of earlier segments) precede the L positions of the current segment, so query i sits at absolute position
M + i. With the projected relative position embeddings r_d = W_{k,R} R_d (index d = distance), the content
bias u and the position bias v (`v_bias`), the logit of query i and key j <= M + i is

  s_ij = ((q_i + u) . k_j + (q_i + v) . r_{(M+i)-j}) / sqrt(head_dim)

(the paper's four terms (a)-(d), with q_i = W_q E_{x_i} and k_j = W_{k,E} E_{x_j}), followed by one softmax
over the real keys j <= M + i. `clamp_len` >= 0 gives every distance beyond it r_{clamp_len} (the paper's
clamp_len; -1 = none).

The position term is never built per pair of positions: (q + v) @ r^T gives [L, M + L] scores per distance,
and the paper's relative shift (pad one column, reshape, drop a row) moves row i left by L - 1 - i so that
column j holds distance M + i - j. Cost O(L * (M + L) * d) time, O(L * (M + L)) memory, as dense attention.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_core import contract
from attention_core.combine import attend

Array = Any
OP = "transformer_xl"


def sinusoid(length: int, dim: int) -> Array:
  """The paper's R: [length, dim] float32 with row p = [sin(p w), cos(p w)], w_i = 10000^(-2i/dim),
  i < ceil(dim / 2) (an odd dim drops the last cosine). Row p is the embedding of relative distance p."""
  length = contract.check_positive_int(length, name="length", op="sinusoid")
  dim = contract.check_positive_int(dim, name="dim", op="sinusoid")
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [ceil(dim / 2)]
  angle = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]  # [length, ceil(dim / 2)]
  return jnp.asarray(np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)[:, :dim], jnp.float32)


def check_clamp_len(clamp_len: Any, *, op: str = OP) -> int:
  if isinstance(clamp_len, bool) or not isinstance(clamp_len, (int, np.integer)) or clamp_len < -1:
    raise ValueError(f"{op}: argument 'clamp_len' must be an integer >= -1 (-1 = no clamp), "
                     f"got {clamp_len!r}")
  return int(clamp_len)


def check_causal(causal: Any, *, op: str = OP) -> None:
  causal = contract.check_bool(causal, name="causal", op=op)
  if not causal:
    raise ValueError(f"{op}: argument 'causal' must be True: Transformer-XL attention is causal only (keys "
                     "j <= M + i of [memory; segment]); choose a bidirectional op for encoders")


def check_weights(r: Any, u: Any, v_bias: Any, *, heads: int, head_dim: int, distances: int,
                  op: str = OP) -> tuple[Array, Array, Array]:
  """(r [distances', heads, head_dim], u [heads, head_dim], v_bias [heads, head_dim]) with a heads axis of 1
  broadcast to `heads`; r must hold at least `distances` rows (row d = distance d; later rows are unused)."""
  out = []
  for name, x, rank in (("r", r, 3), ("u", u, 2), ("v_bias", v_bias, 2)):
    # argument validation: any array-like (numpy, jax, tracers) passes
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{op}: argument {name!r} must be an array, got {type(x).__name__}")
    x = jnp.asarray(x)
    want = "[distances, heads, head_dim]" if rank == 3 else "[heads, head_dim]"
    if x.ndim != rank or x.shape[-1] != head_dim or x.shape[-2] not in (1, heads):
      raise ValueError(f"{op}: argument {name!r} must have shape {want} with heads = {heads} (or 1) and "
                       f"head_dim = {head_dim}, got {tuple(x.shape)}")
    out.append(jnp.broadcast_to(x, (*x.shape[:-2], heads, head_dim)))
  if out[0].shape[0] < distances:
    raise ValueError(f"{op}: argument 'r' must hold at least {distances} distances (rows), got "
                     f"{out[0].shape[0]}")
  return out[0], out[1], out[2]


def distance_rows(total: int, clamp_len: int) -> int:
  """How many rows of r the distances 0 .. total - 1 read: min(total, clamp_len + 1) under a clamp."""
  return total if clamp_len < 0 else min(total, clamp_len + 1)


def clamped(r: Array, total: int, clamp_len: int) -> Array:
  """r [>= distance_rows, heads, head_dim] -> [total, heads, head_dim]: row d is r_{min(d, clamp_len)}."""
  if clamp_len < 0 or clamp_len >= total - 1:
    return r[:total]
  return r[np.minimum(np.arange(total), clamp_len)]


def rel_shift(x: Array) -> Array:
  """The paper's relative shift: x [..., L, K] whose column c holds distance K - 1 - c -> [..., L, K] whose
  column j holds, for row i, distance (K - L + i) - j (exact for j <= K - L + i; later columns hold other
  rows' entries, to be masked). Pad a zero column in front, read the [L, K + 1] block as [K + 1, L], drop
  its first row and read the rest as [L, K]: row i starts L - 1 - i entries further on."""
  *lead, length, total = x.shape
  x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])  # [..., L, K + 1]
  x = x.reshape(*lead, total + 1, length)[..., 1:, :]  # [..., K, L]
  return x.reshape(*lead, length, total)


def check_inputs(q: Any, k: Any, v: Any, mask: Any, *, op: str = OP) -> tuple[Array, Array, Array, Array]:
  """q [batch, L, heads, head_dim]; k [batch, M + L, heads, head_dim], v [batch, M + L, heads, value_dim],
  mask None or [batch, M + L] (None = every key real) -> jax arrays, mask [batch, M + L] bool."""
  k, _, v, mask = contract.check_qkv(k, k, v, mask, op=op)
  # argument validation: any array-like (numpy, jax, tracers) passes
  if not hasattr(q, "shape") or not hasattr(q, "dtype"):
    raise TypeError(f"{op}: argument 'q' must be an array of shape [batch, length, heads, dim], got "
                    f"{type(q).__name__}")
  q = jnp.asarray(q)
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"{op}: argument 'q' must be floating point, got dtype {q.dtype}")
  if q.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] \
      or not 1 <= q.shape[1] <= k.shape[1]:
    raise ValueError(f"{op}: argument 'q' must have shape [batch, L, heads, head_dim] with k's batch, heads "
                     f"and head_dim and 1 <= L <= k's length M + L, got q {tuple(q.shape)} and k "
                     f"{tuple(k.shape)}")
  return q, k, v, mask


def transformer_xl(q: Array, k: Array, v: Array, *, r: Array, u: Array, v_bias: Array, causal: bool = True,
                   mask: Array | None = None, clamp_len: int = -1) -> Array:
  """Transformer-XL attention of the segment's queries over [memory; segment] (see the module docstring).

  q: [batch, L, heads, head_dim]; k: [batch, M + L, heads, head_dim]; v: [batch, M + L, heads, value_dim]
  (M >= 0 memory positions first); mask: None or [batch, M + L] bool, True = real key.
  r: [>= M + L, heads or 1, head_dim], row d = the projected embedding of distance d (rows past the last
  distance read are unused; under a clamp only min(M + L, clamp_len + 1) are needed); u, v_bias: [heads or
  1, head_dim]. causal must be True. Returns [batch, L, heads, value_dim] in v's dtype; a row with no real key
  j <= M + i is zeros, and a masked or future key or value (even NaN or Inf) never reaches an output.
  """
  q, k, v, mask = check_inputs(q, k, v, mask)
  check_causal(causal)
  clamp_len = check_clamp_len(clamp_len)
  r, u, v_bias = check_weights(r, u, v_bias, heads=q.shape[2], head_dim=q.shape[3],
                               distances=distance_rows(k.shape[1], clamp_len))
  return heads_first(q, k, v, r_heads=jnp.swapaxes(r, 0, 1), u=u, v_bias=v_bias, causal=True, mask=mask,
                     clamp_len=clamp_len)


@contract.partitioned_op(per_head=("r_heads", "u", "v_bias"))
def heads_first(q: Array, k: Array, v: Array, *, r_heads: Array, u: Array, v_bias: Array, causal: bool = True,
                mask: Array | None = None, clamp_len: int = -1) -> Array:
  """`transformer_xl` with r given heads first, r_heads [heads or 1, distances, head_dim], so that every
  per-head argument has a leading heads axis, the one a partitioned op splits (here and in the models'
  `attention_core.sharding.attend`)."""
  q, k, v, mask = check_inputs(q, k, v, mask)
  check_causal(causal)
  clamp_len = check_clamp_len(clamp_len)
  batch, length, heads, head_dim = q.shape
  total = k.shape[1]
  memory = total - length
  if not hasattr(r_heads, "ndim") or r_heads.ndim != 3:  # argument validation, as `check_weights`
    raise ValueError(f"{OP}: argument 'r_heads' must have shape [heads, distances, head_dim], got "
                     f"{getattr(r_heads, 'shape', type(r_heads).__name__)}")
  r, u, v_bias = check_weights(jnp.swapaxes(r_heads, 0, 1), u, v_bias, heads=heads, head_dim=head_dim,
                               distances=distance_rows(total, clamp_len))
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  real = mask[:, :, None, None]  # [batch, M + L, 1, 1]
  # Masked keys and values are selected to zero, so NaN there reaches no logit, output or gradient.
  qh = jnp.swapaxes(q.astype(ct), 1, 2)  # [batch, heads, L, head_dim]
  # [batch, heads, M + L, dim]
  kh, vh = (jnp.swapaxes(jnp.where(real, x, 0).astype(ct), 1, 2) for x in (k, v))
  content = jnp.einsum("bhid,bhjd->bhij", qh + u.astype(ct)[:, None], kh)  # [batch, heads, L, M + L]
  # Distances M + L - 1 .. 0 (descending, the paper's order), then the shift aligns them to the keys.
  by_distance = jnp.einsum("bhid,nhd->bhin", qh + v_bias.astype(ct)[:, None],
                           clamped(r, total, clamp_len).astype(ct)[::-1])  # [batch, heads, L, M + L]
  logits = (content + rel_shift(by_distance)) * contract.logit_scale(head_dim)  # [batch, heads, L, M + L]
  visible = np.arange(total)[None, :] <= memory + np.arange(length)[:, None]  # [L, M + L]: j <= M + i
  valid = mask[:, None, None, :] & visible  # [batch, 1, L, M + L]
  out = attend(logits, valid, vh, "bhij,bhjd->bhid")  # [batch, heads, L, value_dim]; future values guarded
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [batch, L, heads, value_dim]
