"""Adaptive attention span (Sukhbaatar et al., 2019, arXiv 1905.07799): softmax attention whose weights are
multiplied, per head, by a soft mask of the query-key distance before they are normalised.

Positions are 0-based, s_ij = q_i . k_j / sqrt(d), x = i - j (causal: keys j <= i) or |i - j|
(bidirectional); head h has a span z_h in [0, max_span] (tokens, real-valued) and

  m_z(x) = clamp((R + z - x) / R, 0, 1),    a_ij = m_z(x_ij) exp(s_ij) / sum_k m_z(x_ik) exp(s_ik)

with R = `ramp` (the paper's 32). With `positions` p (the paper's learned relative position embeddings, one
vector per distance, p_x [heads, head_dim]), s_ij = q_i . (k_j + p_{x_ij}) / sqrt(d); the paper is causal,
and bidirectionally p is indexed by |i - j|, so it tells near from far but not left from right. Masked keys
are dropped; keys with m_z(x) = 0 (x >= z + R) get weight exactly zero and gradient exactly zero, and those
beyond z + R are never read. The spans and p are model parameters (`models.adaptive_span_attention` owns them
and the spans' L1 penalty); the op takes them as `spans` [heads] in tokens, clamped to [0, max_span].

d/dz where m has corners (x = z, where m leaves 1, and x = z + R, where it leaves 0; they matter at whole
numbers z, above all z = 0, where every head starts and where the penalty sends it back): the derivative for
a growing span, the right derivative (pairs z < x <= z + R, the key at x = z + R included although it
weighs nothing), at every z but z = max_span, where the span can only shrink and d/dz is the left
derivative (pairs z <= x < z + R). The clamp passes this derivative in full at both ends of [0, max_span]
and none outside (`clamp_spans`).

Keys may cover [memory; segment] (Transformer-XL's cache of earlier segments, which the paper trains the spans
with): k, v and the key mask then hold M = k.shape[1] - q.shape[1] memory positions before the L of the
segment, query i sits at position M + i, and x = (M + i) - j over the keys j <= M + i (causal only; M = 0 is
the ordinary op). Memory keys at distance >= ceil(max_span + R) from the first query are dropped before the
loop; the rest are laid out so that query block b meets, at offset t, the key block t blocks before its own
position, and the loop below runs over them unchanged.

Compute is skipped beyond the largest current span: queries and keys are cut into blocks of `block_size`,
and the forward and backward passes (one `jax.custom_vjp`) each loop with `lax.while_loop` over key-block
offsets t (query block b meets key block b - t, and b + t when bidirectional), for t < T =
floor((max_h z_h + R - 1) / block_size) + 2: the offsets whose nearest query-key pair is at most max z + R
apart. The trip count T is computed from the spans at run time, so a layer costs
O(L * (max z + R + block) * d) whatever `max_span` is; `max_span` bounds T statically (and the decoder's
window) and clamps z. Blocks beyond T are never read: a NaN there stays out of every output and gradient.
Inside the loop softmax runs online as in flash attention (running max, rescaled sums); the backward
recomputes each block's weights from the saved log-sum-exp. The position term is never built per pair:
at offset t a block's pairs span the 2 * block - 1 distances around t * block, so q @ p^T over those rows
([size, 2 * size - 1] per query block) and a gather by each pair's distance give its [size, size] logits,
O(L * block * d) per offset like q . k.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attention_baselines import adaptive_span_flash, transformer_xl
from attention_core import contract
from attention_core.blocks import head_major, num_blocks, pad_to
from attention_core.combine import flag_nonfinite, unflag

Array = Any
OP = "adaptive_span"
RAMP = 32  # the paper's R
BLOCK = 64  # block size of the loop over key blocks (CPU: fewest wasted keys for spans of a few hundred)
IMPLEMENTATIONS = adaptive_span_flash.IMPLEMENTATIONS  # "pallas": attention_baselines.adaptive_span_flash


def auto_params(length: int) -> dict[str, int]:
  """The whole sequence as the bound (max_span = L), the paper's ramp R = 32, blocks of 64 (fewer for
  short sequences)."""
  return {"max_span": max(1, length), "ramp": RAMP,
          "block_size": min(BLOCK, 1 << max(0, (max(length, 1) - 1).bit_length()))}


def check_spans(spans: Any, heads: int, *, op: str = OP) -> Array:
  """`spans` as an array [heads] (a scalar or [1] is shared by every head)."""
  if not hasattr(spans, "shape") and not isinstance(spans, (int, float)):
    raise TypeError(f"{op}: argument 'spans' must be an array [heads] of spans in tokens, got "
                    f"{type(spans).__name__}")
  z = jnp.asarray(spans)
  if not jnp.issubdtype(z.dtype, jnp.floating):
    z = z.astype(jnp.float32)
  z = z.reshape(-1) if z.ndim <= 1 else z
  if z.ndim != 1 or z.shape[0] not in (1, heads):
    raise ValueError(f"{op}: argument 'spans' must have shape [heads] = [{heads}] or [1], got "
                     f"{tuple(jnp.shape(spans))}")
  return jnp.broadcast_to(z, (heads,))


def check_ramp(ramp: Any, *, op: str = OP) -> float:
  if isinstance(ramp, bool) or not isinstance(ramp, (int, float)) or not ramp > 0:
    raise ValueError(f"{op}: argument 'ramp' must be a positive number (the soft mask's width R), "
                     f"got {ramp!r}")
  return float(ramp)


def check_max_span(max_span: Any, *, op: str = OP) -> int:
  if isinstance(max_span, bool) or not isinstance(max_span, (int, float)) or not max_span >= 0 \
      or int(max_span) != max_span:
    raise ValueError(f"{op}: argument 'max_span' must be a non-negative integer (the largest span in "
                     f"tokens), got {max_span!r}")
  return int(max_span)


def soft_mask(distance: Array, spans: Array, ramp: float) -> Array:
  """m_z(x) = clamp((R + z - x) / R, 0, 1): distance [...] and spans broadcastable to it."""
  return jnp.clip((ramp + spans - distance) / ramp, 0.0, 1.0)


def window(max_span: int, ramp: float) -> int:
  """The number of keys a query can see at most, itself included: distances x < max_span + R."""
  return int(math.ceil(max_span + ramp))


def check_positions(positions: Any, heads: int, head_dim: int, distances: int, *, op: str = OP) -> Array:
  """`positions` as an array [heads or 1, P, head_dim] with P >= `distances` (row x: distance x)."""
  if not hasattr(positions, "shape"):
    raise TypeError(f"{op}: argument 'positions' must be an array [heads, distances, head_dim], got "
                    f"{type(positions).__name__}")
  shape = tuple(positions.shape)
  if len(shape) != 3 or shape[0] not in (1, heads) or shape[2] != head_dim or shape[1] < distances:
    raise ValueError(f"{op}: argument 'positions' must have shape [heads or 1, >= {distances}, {head_dim}] "
                     f"(one embedding per distance 0 .. ceil(max_span + ramp) - 1), got {shape}")
  return jnp.asarray(positions)


def check_inputs(q: Any, k: Any, v: Any, mask: Any) -> tuple[Array, Array, Array, Array]:
  """q [batch, L, heads, head_dim]; k [batch, M + L, heads, head_dim]; v [batch, M + L, heads, value_dim];
  mask None or [batch, M + L] -> jax arrays, mask bool (all True for None). M = 0 is the op contract's check
  as it is; M > 0 (keys longer than the queries) the Transformer-XL op's."""
  if all(hasattr(x, "shape") and len(x.shape) == 4 for x in (q, k)) and q.shape[1] != k.shape[1]:
    return transformer_xl.check_inputs(q, k, v, mask, op=OP)
  return contract.check_qkv(q, k, v, mask, op=OP)


class Plan(NamedTuple):
  """The static layout of one call. Queries: n blocks of `size`. Keys: `lead` zero keys, then the M memory
  keys and the L segment keys, padded to front + n blocks, so that query block b sits at the position of key
  block front + b (front = (lead + M) / size)."""

  causal: bool
  ramp: float
  size: int
  n: int  # query blocks
  bound: int  # static bound on the trip count T
  length: int  # L
  front: int  # key blocks before the segment's first (0 without memory)
  lead: int  # zero keys in front of the memory (0 without memory)
  max_span: float  # the clamp's upper end (where d/dz is the shrinking side's, `corner_band`)


def choose_implementation(implementation: Any, positions: Any, *, strict: bool = False) -> Any:
  """What the op runs where it is traced (`contract.backend`): "auto" is the kernels on GPU and TPU, XLA on
  CPU, and XLA on GPUs with `positions` (`adaptive_span_flash.supports`). There an explicit "pallas" is XLA
  too, and raises ValueError ("does not apply") when `strict` on a GPU host (the GPU branch of a program
  traced elsewhere, for every platform, takes XLA). Unknown values are returned as they are (the op rejects
  them in its own words)."""
  if implementation not in IMPLEMENTATIONS:
    return implementation
  chosen = contract.resolve_implementation(implementation, IMPLEMENTATIONS, op=OP)
  if chosen != "pallas" or adaptive_span_flash.supports(positions is not None):
    return chosen
  if strict and implementation == "pallas" and jax.default_backend() == "gpu":
    raise ValueError(f"{OP}: argument 'implementation'='pallas' does not apply here: the kernels take "
                     "relative positions on TPU only (Triton has no lane rotation); use 'auto' or 'xla'")
  return "xla"


def _choice(q: Any, k: Any, v: Any, *, implementation: Any = "auto", positions: Any = None, **_: Any) -> Any:
  """What `adaptive_span` traces per platform (the key of `contract.per_platform_op`)."""
  chosen = choose_implementation(implementation, positions)
  return (chosen, adaptive_span_flash.tile_size(1 << 20)) if chosen == "pallas" else chosen


@contract.per_platform_op(_choice)
def adaptive_span(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, spans: Array,
                  max_span: int, ramp: float = RAMP, block_size: int = BLOCK,
                  positions: Array | None = None, implementation: str = "auto") -> Array:
  """Softmax attention with a learned soft span per head (see the module docstring).

  q: [batch, L, heads, head_dim]; k: [batch, M + L, heads, head_dim]; v: [batch, M + L, heads, value_dim]
  (M >= 0 memory keys first, query i at position M + i; M > 0 needs causal); mask: [batch, M + L] bool.
  spans: [heads] (or [1]) spans z in tokens, clamped to [0, max_span] (a span outside reads as the nearer
    end and gets no gradient); differentiable, one-sided at whole numbers (module docstring).
  max_span: static bound on the spans (the loop's static trip-count bound). ramp: R > 0.
  block_size: queries and keys per block of the loop.
  positions: None or [heads (or 1, shared), P, head_dim], P >= ceil(max_span + ramp): row x is the learned
  embedding p_x of distance x (|i - j| bidirectionally), added to the keys; differentiable.
  implementation: "xla" (the loop below), "pallas" (`attention_baselines.adaptive_span_flash`: the same
  weights and derivatives in fused kernels, tiles of 128 on TPU, 64 on GPUs; with positions TPU only) or
  "auto" (the kernels on GPU and TPU, per lowering platform, where they apply; XLA on CPU).
  Returns [batch, L, heads, value_dim] in v's dtype.
  """
  q, k, v, mask = check_inputs(q, k, v, mask)
  causal = contract.check_bool(causal, name="causal", op=OP)
  size = contract.check_positive_int(block_size, name="block_size", op=OP)
  ramp = check_ramp(ramp)
  max_span = check_max_span(max_span)
  contract.check_implementation(implementation, IMPLEMENTATIONS, op=OP)
  fused = choose_implementation(implementation, positions, strict=True) == "pallas"
  batch, length, heads, head_dim = q.shape
  memory = k.shape[1] - length
  if memory and not causal:
    raise ValueError(f"{OP}: keys longer than the queries (a memory of {memory} positions) need causal=True")
  # Memory keys at distance >= window from the first query are out of every span: never passed on.
  drop = max(0, memory - (window(max_span, ramp) - 1))
  k, v, mask = k[:, drop:], v[:, drop:], mask[:, drop:]  # [batch, M' + L, ...]
  memory -= drop
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  z = clamp_spans(check_spans(spans, heads).astype(ct), max_span)  # [heads]
  if fused:
    p = None if positions is None else check_positions(positions, heads, head_dim, window(max_span, ramp))
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    out = adaptive_span_flash.attend(*(head_major(x).astype(dtype) for x in (q, k, v)), mask, z, p,
                                     causal=causal, ramp=ramp, max_span=max_span,
                                     window=window(max_span, ramp))  # [batch, heads, L, value_dim]
    return jnp.swapaxes(out, 1, 2).astype(v.dtype)
  size = min(size, length)
  n = num_blocks(length, size)
  lead = -memory % size
  front = (lead + memory) // size
  # Static bound on the offsets: the largest span's T (at most every key block).
  bound = min(front + n, -(-(window(max_span, ramp) + size - 1) // size))
  plan = Plan(causal, ramp, size, n, bound, length, front, lead, float(max_span))
  qh, kh, vh = (head_major(x).astype(ct) for x in (q, k, v))  # [batch, heads, L or M' + L, dim]
  qh = qh * contract.logit_scale(head_dim)
  rows = None
  if positions is not None:
    p = check_positions(positions, heads, head_dim, window(max_span, ramp)).astype(ct)
    p = jnp.broadcast_to(p, (heads, *p.shape[1:]))  # [heads, P, head_dim]
    rows = _position_rows(plan, p)  # [heads, (bound + 1) * size - 1, head_dim]
    # Distances > max z + R weigh nothing and reach no derivative: their rows selected to zero, never read (a
    # NaN there stays out); distance max z + R itself weighs nothing but is in d/dz (`corner_band`).
    reach = jnp.arange(rows.shape[1]) - (size - 1) <= jnp.max(z) + ramp  # [rows]
    rows = jnp.where(reach[None, :, None], rows, 0.0)
  out = _span_attention(plan, qh, kh, vh, mask, z, rows)  # [batch, heads, L, value_dim]
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [batch, L, heads, value_dim]


def _trip_count(z: Array, plan: tuple) -> Array:
  """T = floor((max z + R - 1) / block) + 2, in [1, bound]: the key-block offsets that can reach a key at
  distance <= max z + R from some query of the block (offset t >= 1 starts at distance (t - 1) * block + 1;
  the key at max z + R itself weighs nothing but is in d/dz, `corner_band`). plan: a `Plan`, or its first
  five fields."""
  _, ramp, size, _, bound = plan[:5]
  reach = jnp.floor((jnp.max(z) + ramp - 1) / size) + 2
  return jnp.clip(reach.astype(jnp.int32), 1, bound)


@jax.custom_jvp
def clamp_spans(spans: Array, max_span: float) -> Array:
  """z = clip(spans, 0, max_span) [heads], whose derivative is 1 on the closed interval (at its ends too) and
  0 outside: a span at 0 or max_span gets the one-sided derivative of `corner_band` in full (jnp.clip halves
  it there)."""
  return jnp.clip(spans, 0.0, max_span)


@clamp_spans.defjvp
def _clamp_spans_jvp(primals, tangents):
  spans, max_span = primals
  inside = (spans >= 0.0) & (spans <= max_span)
  return clamp_spans(spans, max_span), jnp.where(inside, tangents[0], jnp.zeros_like(tangents[0]))


def corner_band(x: Array, z: Array, ramp: float, max_span: float) -> Array:
  """Which distances x carry dm/dz = 1/R (x and z broadcastable): z < x <= z + R, the derivative for a
  growing span (the right derivative, both corners counted on that side: m stays 1 at x = z and leaves 0 at
  x = z + R), except at z = max_span, where the span can only shrink: z <= x < z + R. At z = 0, where every
  head starts and where the span penalty sends it back, growing is the only way a span can move."""
  d = x - z
  top = z >= max_span
  return jnp.where(top, (d >= 0) & (d < ramp), (d > 0) & (d <= ramp))


def _blocks(x: Array, n: int, size: int) -> Array:
  """Queries [batch, heads, L, dim] -> [batch, heads, n, size, dim], zeros after L."""
  x = pad_to(x, n * size, axis=2)
  return x.reshape(*x.shape[:2], n, size, x.shape[-1])


def _key_blocks(x: Array, plan: Plan) -> Array:
  """Keys [batch, heads, M + L, dim] -> [batch, heads, front + n, size, dim]: `lead` zeros in front, zeros
  after the last key."""
  blocks = plan.front + plan.n
  x = jnp.pad(x, ((0, 0), (0, 0), (plan.lead, blocks * plan.size - plan.lead - x.shape[2]), (0, 0)))
  return x.reshape(*x.shape[:2], blocks, plan.size, x.shape[-1])


def _unblock_keys(x: Array, plan: Plan) -> Array:
  """`_key_blocks`' inverse: [batch, heads, front + n, size, dim] -> [batch, heads, M + L, dim]."""
  x = x.reshape(*x.shape[:2], -1, x.shape[-1])
  return x[:, :, plan.lead:plan.front * plan.size + plan.length]


def _layout(plan: Plan, k: Array, v: Array, mask: Array) -> dict[str, Array]:
  """Keys, values and key mask cut into blocks: k [batch, heads, front + n, size, head_dim]; v the same with
  value_dim + 1 (`flag_nonfinite`); real [batch, front + n, size]."""
  real = _key_blocks(mask[:, None, :, None], plan)[:, 0, ..., 0]  # [batch, front + n, size]
  kk = jnp.where(mask[:, None, :, None], k, 0.0)  # masked keys selected to zero (NaN there stays out)
  vv = flag_nonfinite(jnp.where(mask[:, None, :, None], v, 0.0))  # [batch, heads, M + L, value_dim + 1]
  return {"k": _key_blocks(kk, plan), "v": _key_blocks(vv, plan), "real": real}


def _offset(plan: Plan, u: Array) -> Array:
  """Loop index u -> key-block offset t (causal: t = u; bidirectional: t = u - (bound - 1))."""
  return u if plan.causal else u - (plan.bound - 1)


def _step_count(plan: Plan, t_count: Array) -> tuple[Array, Array]:
  """(first loop index, end loop index) of the offsets |t| < T."""
  if plan.causal:
    return jnp.int32(0), t_count
  return plan.bound - t_count, plan.bound - 1 + t_count


def _block_weights(plan: Plan, t: Array, real: Array, z: Array, band: bool = False) -> tuple[Array, ...]:
  """For offset t: (valid [batch, heads, n, size, size], soft mask m [heads, size, size]) of every query
  block b against key block b - t (real [batch, n, size]: its keys' mask); valid = real key, causal order,
  m > 0. The distance (M + i) - j of a pair is t * size + its rows' difference: the layout aligns blocks.
  band: also the pairs in d/dz (real key, causal order, `corner_band`), [batch, heads, n, size, size]."""
  size = plan.size
  dist = t * size + jnp.arange(size)[:, None] - jnp.arange(size)[None, :]  # (M + i) - j: [size, size]
  x = (dist if plan.causal else jnp.abs(dist)).astype(z.dtype)
  m = soft_mask(x, z[:, None, None], plan.ramp)  # [heads, size, size]
  pairs = real[:, None, :, None, :]  # [batch, 1, n, 1, size]
  if plan.causal:
    pairs = pairs & (dist >= 0)
  valid = pairs & (m > 0)[None, :, None]  # [batch, heads, n, size, size]
  if not band:
    return valid, m
  return valid, m, pairs & corner_band(x, z[:, None, None], plan.ramp, plan.max_span)[None, :, None]


def _keys_at(x: Array, plan: Plan, t: Array, axis: int) -> Array:
  """[..., front + n key blocks, ...] -> [..., n, ...]: entry b holds key block (front + b - t) mod
  (front + n), the one query block b meets at offset t; the wrapped ones are not its keys (`_real_at`)."""
  x = jnp.roll(x, t, axis=axis)
  return lax.slice_in_dim(x, plan.front, plan.front + plan.n, axis=axis)


def _to_keys(x: Array, plan: Plan, t: Array, axis: int) -> Array:
  """`_keys_at`'s transpose: [..., n, ...] per query block -> [..., front + n, ...] at their key blocks."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (plan.front, 0)
  return jnp.roll(jnp.pad(x, pad), -t, axis=axis)


def _real_at(plan: Plan, t: Array, real: Array) -> Array:
  """The key mask of key blocks front + b - t, [batch, n, size], False where that is outside the keys."""
  b = jnp.arange(plan.n) + plan.front - t
  return _keys_at(real, plan, t, 1) & ((b >= 0) & (b < plan.front + plan.n))[None, :, None]


def _position_rows(plan: Plan, p: Array) -> Array:
  """p [heads, P, head_dim] -> [heads, (bound + 1) * size - 1, head_dim]: row r holds distance
  r - (size - 1), zeros for the distances outside [0, P) (never valid pairs), so that every offset's
  2 * size - 1 distances are one static-size slice (`_position_logits`)."""
  used = min(p.shape[1], plan.bound * plan.size)  # no pair of the layout is farther apart
  return jnp.pad(p[:, :used], ((0, 0), (plan.size - 1, plan.bound * plan.size - used), (0, 0)))


def _near_rows(plan: Plan, t: Array, rows: Array) -> Array:
  """The rows of the distances |t| * size + [-(size - 1), size - 1], those of offset t's pairs: [heads,
  2 * size - 1, head_dim]."""
  return lax.dynamic_slice_in_dim(rows, jnp.abs(t) * plan.size, 2 * plan.size - 1, axis=1)


def _position_logits(plan: Plan, t: Array, qb: Array, near: Array) -> Array:
  """q_i . p_{x_ij} for the pairs of every query block b and key block b - t: qb [batch, heads, n, size,
  head_dim] (scaled), near = `_near_rows` -> [batch, heads, n, size, size]: q @ p^T over the 2 * size - 1
  distances of offset t, then a gather by each pair's distance."""
  size = plan.size
  base = jnp.abs(t) * size
  qp = jnp.einsum("bhnqd,hrd->bhnqr", qb, near)  # [batch, heads, n, size, 2 * size - 1]
  dist = t * size + jnp.arange(size)[:, None] - jnp.arange(size)[None, :]  # (M + i) - j: [size, size]
  x = dist if plan.causal else jnp.abs(dist)
  index = jnp.clip(x - base + size - 1, 0, 2 * size - 2)  # row of `near`: [size, size]
  return jnp.take_along_axis(qp, index[None, None, None], axis=-1)  # [batch, heads, n, size, size]


def _forward(plan: Plan, q: Array, k: Array, v: Array, mask: Array, z: Array,
             rows: Array | None) -> tuple[Array, Array]:
  """q [batch, heads, L, head_dim] (scaled), rows None or `_position_rows` -> (out [batch, heads, L,
  value_dim], lse [batch, heads, n, size]); online softmax over the key-block offsets |t| < T."""
  size, n = plan.size, plan.n
  lay = _layout(plan, k, v, mask)
  qb = _blocks(q, n, size)  # [batch, heads, n, size, head_dim]
  batch, heads = q.shape[:2]
  dv = lay["v"].shape[-1]
  start, end = _step_count(plan, _trip_count(z, plan))

  def body(u, carry):
    acc, row_max, denom = carry
    t = _offset(plan, u)
    kb, vb = _keys_at(lay["k"], plan, t, 2), _keys_at(lay["v"], plan, t, 2)  # [batch, heads, n, size, dim]
    valid, m = _block_weights(plan, t, _real_at(plan, t, lay["real"]), z)
    s = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kb)  # [batch, heads, n, size, size]
    if rows is not None:
      s = s + _position_logits(plan, t, qb, _near_rows(plan, t, rows))
    s = jnp.where(valid, s, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))  # [batch, heads, n, size]
    safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    keep = jnp.where(jnp.isfinite(row_max), jnp.exp(row_max - safe), 0.0)  # rescales the earlier sums
    p = m[None, :, None] * jnp.exp(s - safe[..., None])  # exactly 0 where invalid (exp(-inf))
    acc = acc * keep[..., None] + jnp.einsum("bhnqk,bhnkd->bhnqd", p, vb)
    return acc, new_max, denom * keep + jnp.sum(p, axis=-1)

  shape = (batch, heads, n, size)
  init = (jnp.zeros((*shape, dv), q.dtype), jnp.full(shape, -jnp.inf, q.dtype), jnp.zeros(shape, q.dtype))
  acc, row_max, denom = lax.fori_loop(start, end, body, init)
  out = unflag(acc / jnp.where(denom > 0, denom, 1.0)[..., None])  # [batch, heads, n, size, value_dim]
  lse = jnp.where(denom > 0, jnp.where(jnp.isfinite(row_max), row_max, 0.0) + jnp.log(
      jnp.where(denom > 0, denom, 1.0)), jnp.inf)  # inf: a row with no key (padding) gets no weight
  return out.reshape(batch, heads, n * size, -1)[:, :, :plan.length], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _span_attention(plan: Plan, q: Array, k: Array, v: Array, mask: Array, z: Array,
                    rows: Array | None) -> Array:
  return _forward(plan, q, k, v, mask, z, rows)[0]


def _span_attention_fwd(plan, q, k, v, mask, z, rows):
  out, lse = _forward(plan, q, k, v, mask, z, rows)
  return out, (q, k, v, mask, z, rows, out, lse)


def _span_attention_bwd(plan, saved, d_out):
  """Flash-attention backward over the same offsets: with a_ij = m_ij exp(s_ij - lse_i) and
  g_ij = dout_i . v_j - dout_i . out_i, ds_ij = a_ij g_ij, and dm_ij = exp(s_ij - lse_i) g_ij, which reaches
  z_h as dm/dz = 1/R on the pairs of `corner_band`. The position term's share of ds reaches q and the rows of
  p through the pullback of `_position_logits` (a scatter-add by distance)."""
  q, k, v, mask, z, rows, out, lse = saved
  size, n, ramp = plan.size, plan.n, plan.ramp
  batch, heads = q.shape[:2]
  lay = _layout(plan, k, v, mask)
  vfin = lay["v"][..., :-1]  # non-finite values selected to 0: [batch, heads, front + n, size, value_dim]
  kfin = jnp.where(jnp.isfinite(lay["k"]), lay["k"], 0.0)
  qb = _blocks(q, n, size)  # [batch, heads, n, size, head_dim]
  dob = _blocks(d_out, n, size)  # [batch, heads, n, size, value_dim]
  delta = jnp.sum(dob * _blocks(jnp.where(jnp.isfinite(out), out, 0.0), n, size), axis=-1)
  start, end = _step_count(plan, _trip_count(z, plan))

  def body(u, carry):
    dq, dk, dv, dz, drows = carry
    t = _offset(plan, u)
    kb, vb = _keys_at(kfin, plan, t, 2), _keys_at(vfin, plan, t, 2)  # [batch, heads, n, size, dim]
    valid, m, band = _block_weights(plan, t, _real_at(plan, t, lay["real"]), z, band=True)
    s = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kb)  # [batch, heads, n, size, size]
    if rows is not None:
      pos, pull = jax.vjp(functools.partial(_position_logits, plan, t), qb, _near_rows(plan, t, rows))
      s = s + pos  # [batch, heads, n, size, size]
    e = jnp.exp(jnp.where(valid | band, s, -jnp.inf) - lse[..., None])  # e^s / Z: [batch, heads, n, q, k]
    a = jnp.where(valid, m[None, :, None] * e, 0.0)
    g = jnp.einsum("bhnqd,bhnkd->bhnqk", dob, vb) - delta[..., None]
    ds = jnp.where(valid, a * g, 0.0)  # [batch, heads, n, size, size]
    dq = dq + jnp.einsum("bhnqk,bhnkd->bhnqd", ds, kb)
    # the key blocks' shares, put back in their place (wrapped blocks carry zeros: no valid pair)
    dk = dk + _to_keys(jnp.einsum("bhnqk,bhnqd->bhnkd", ds, qb), plan, t, 2)
    dv = dv + _to_keys(jnp.einsum("bhnqk,bhnqd->bhnkd", a, dob), plan, t, 2)
    # dL/dm = e^s / Z * g; dm/dz = 1/R on the pairs of `corner_band` (the lower corner, m = 0, included).
    dz = dz + jnp.sum(jnp.where(band, e * g, 0.0), axis=(0, 2, 3, 4)) / ramp
    if rows is not None:
      dq_pos, d_near = pull(ds)
      dq = dq + dq_pos
      at = jnp.abs(t) * size
      drows = lax.dynamic_update_slice_in_dim(
          drows, lax.dynamic_slice_in_dim(drows, at, 2 * size - 1, axis=1) + d_near, at, axis=1)
    return dq, dk, dv, dz, drows

  init = (jnp.zeros_like(qb), jnp.zeros(lay["k"].shape, q.dtype), jnp.zeros(vfin.shape, q.dtype),
          jnp.zeros((heads,), z.dtype), None if rows is None else jnp.zeros_like(rows))
  dq, dk, dv, dz, drows = lax.fori_loop(start, end, body, init)
  dq = dq.reshape(batch, heads, n * size, -1)[:, :, :plan.length]
  return dq, _unblock_keys(dk, plan), _unblock_keys(dv, plan), None, dz, drows


_span_attention.defvjp(_span_attention_fwd, _span_attention_bwd)
