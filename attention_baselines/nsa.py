"""Native Sparse Attention (NSA; Yuan et al., DeepSeek, 2025, arXiv 2502.11089), causal.

Three branches, each with its own softmax over its own keys, summed with gates (docs/design.md section 5,
"NSA and MoBA"). Positions are 0-based; query i, scale 1/sqrt(d):
  * compression: compressed block c covers positions [c*s, c*s + l) (l = `compress_block`, stride
    s = `compress_stride`); its key and value are phi_k, phi_v of the block's keys and values (masked keys as
    zeros; a block without a real key is dropped). Query i sees block c once it is complete: c*s + l - 1 <= i.
    phi is the mean of the block's real keys, or with weights (the model's `models.nsa_attention`) a per-head
    MLP `relu(flatten(x + pos) @ w1 + b1) @ w2` with an intra-block position encoding `pos` [l, dim].
  * selection: the compression softmax weights p_i[c] score the selection blocks of l' = `select_block`
    positions: block b gets sum_c p_i[c] * (number of stride-s chunks that block c and block b share), the
    paper's eq. 9. Query i keeps `num_selected` = n blocks among b <= i // l': always its own block, the
    block before it and the first block (the paper's local and initial blocks; they count toward n, as in
    its n = 16, so n >= 3), then the best others by score (ties go to the lower block), and attends exactly
    to their keys j <= i.
  * sliding window: the keys j with i - w < j <= i (w = `window`).
  out_i = g_i^cmp o_i^cmp + g_i^slc o_i^slc + g_i^win o_i^win with gates [batch, length, heads, 3] in that
order (the model's sigmoid gates); without gates every branch weighs 1/3, so the rows sum to one.

Selection is per query and per head (the model has no grouped keys to share it over). Cost per query: L/s
compressed logits + n * l' selected + w window keys, O(L * (L/s + n*l' + w) * d). implementation="xla"
gathers the selected blocks per query over chunks of queries (`attention_core.selection`); "pallas" runs the
selection and window branches in the fused kernel of `attention_baselines.selection_flash` (the compression
branch and the block choice stay in XLA); "auto" takes it on GPU and TPU (per lowering platform), XLA on CPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_baselines import selection_flash
from attention_baselines.common import from_rows, to_rows
from attention_core import contract
from attention_core.blocks import map_chunks, num_blocks
from attention_core.combine import Piece, flag_nonfinite, flagged_sum, joint_softmax
from attention_core.registry import sqrt_pow2
from attention_core.selection import (
  choose,
  chosen_piece,
  num_query_chunks,
  pad_length,
  rows_and_mask,
)

Array = Any
MLP_PARTS = ("pos", "w1", "b1", "w2")  # the compression MLP's arrays, for keys and for values
BRANCHES = 3  # gates: compression, selection, sliding window
FORCED = 3  # blocks every query selects: its own, the one before it, the first
IMPLEMENTATIONS = selection_flash.IMPLEMENTATIONS  # "pallas": attention_baselines.selection_flash


def auto_params(length: int) -> dict[str, int]:
  """The paper's l = 32, s = 16, l' = 64, n = 16, w = 512 from L = 4096 on; shorter sequences keep its ratios
  (l' ~ sqrt(L) as a power of two, l = l'/2, s = l/2, w = 8 l')."""
  select = min(64, sqrt_pow2(length))
  compress = max(1, select // 2)
  return {"compress_block": compress, "compress_stride": max(1, compress // 2), "select_block": select,
          "num_selected": 16, "window": 8 * select}


def check_num_selected(num_selected: Any, *, op: str) -> int:
  """n, the blocks each query selects, counting its FORCED ones (own, previous, first): an int >= 3."""
  if isinstance(num_selected, bool) or not isinstance(num_selected, int) or num_selected < FORCED:
    raise ValueError(f"{op}: argument 'num_selected' must be an int >= {FORCED} (each query's own block, the "
                     f"one before it and the first block are always selected and count toward it), got "
                     f"{num_selected!r}")
  return num_selected


def check_mlp(op: str, prefix: str, arrays: tuple[Any, ...], heads: int, block: int, dim: int
         ) -> tuple[Array, ...] | None:
  """The compression MLP's arrays (pos [H, l, dim], w1 [H, l*dim, hidden], b1 [H, hidden], w2 [H, hidden,
  dim]; H = heads or 1), checked; None when none is given (mean pooling)."""
  names = [f"{prefix}_{p}" for p in MLP_PARTS]
  if all(a is None for a in arrays):
    return None
  for name, a in zip(names, arrays, strict=True):
    if a is None:
      raise ValueError(f"{op}: argument {name!r} is missing: give all of {names} or none (mean pooling)")
  pos, w1, b1, w2 = (jnp.asarray(a) for a in arrays)
  hidden = w1.shape[-1] if w1.ndim == 3 else -1
  want = {names[0]: (block, dim), names[1]: (block * dim, hidden), names[2]: (hidden,),
          names[3]: (hidden, dim)}
  for name, a in zip(names, (pos, w1, b1, w2), strict=True):
    if a.ndim != len(want[name]) + 1 or a.shape[0] not in (1, heads) or tuple(a.shape[1:]) != want[name]:
      raise ValueError(f"{op}: argument {name!r} must have shape [heads or 1, *{want[name]}] "
                       f"(heads = {heads}, compress_block = {block}), got {tuple(a.shape)}")
  return pos, w1, b1, w2


def _compress(x: Array, real: Array, mlp: tuple[Array, ...] | None, *, batch: int, block: int,
              stride: int) -> tuple[Array, Array]:
  """Compressed blocks of x [rows, P, dim] (masked keys zero; real [rows, P]; P whole chunks of `stride`):
  block c covers [c·s, c·s + l), l = `block`. Returns (one vector per block [rows, C, dim_out], whether the
  block holds a real key [rows, C]), C = P / s. Computed per stride chunk, never as [C, l, dim] blocks: block
  c is its chunks c .. c + l/s - 1, the mean of their real rows, or the MLP's first layer as a sum over them
  of (chunk + its slot's `pos`) @ (its slot's rows of w1)."""
  rows, length, dim = x.shape
  chunks, per_block = length // stride, block // stride
  xc = pad_length(x, length + (per_block - 1) * stride).reshape(rows, -1, stride, dim)
  if real is None:  # every key real: the blocks past the end hold fewer
    rc = jnp.asarray(np.arange(chunks + per_block - 1) < chunks)[None, :, None]  # [1, chunks', 1]
  else:
    rc = pad_length(real, length + (per_block - 1) * stride, False).reshape(rows, -1, stride)
  slide = lambda a: sum(a[:, t:t + chunks] for t in range(per_block))  # noqa: E731  chunks -> blocks
  count = slide(jnp.sum(jnp.broadcast_to(rc, (rc.shape[0], chunks + per_block - 1, stride)), axis=-1,
                        dtype=jnp.int32))  # [rows or 1, C] real keys per block
  if mlp is None:
    total = slide(jnp.sum(jnp.where(rc[..., None], xc, 0.0), axis=2))  # [rows, C, dim]
    return total / jnp.maximum(count, 1)[..., None].astype(x.dtype), count > 0
  pos, w1, b1, w2 = (a.astype(x.dtype) for a in mlp)  # [H or 1, ...]: shared weights stay unbroadcast
  heads = rows // batch
  grid = (batch, heads, chunks + per_block - 1, stride)
  xc, rc = xc.reshape(*grid, dim), jnp.broadcast_to(rc, (rows, *grid[2:])).reshape(grid)
  w1 = w1.reshape(w1.shape[0], per_block, stride * dim, -1)
  pos = pos.reshape(pos.shape[0], per_block, stride, dim)

  def slot(t: int) -> Array:  # every chunk as slot t of a block: [rows, chunks', hidden]
    xt = jnp.where(rc[..., None], xc + pos[None, :, t, None], 0.0).reshape(*grid[:3], stride * dim)
    return _per_head("bhcx,hxy->bhcy", xt, w1[:, t]).reshape(rows, -1, w1.shape[-1])

  bias = jnp.tile(jnp.broadcast_to(b1, (heads, b1.shape[-1])), (batch, 1))[:, None]  # [rows, 1, hidden]
  h = jax.nn.relu(sum(slot(t)[:, t:t + chunks] for t in range(per_block)) + bias)  # [rows, C, hidden]
  out = _per_head("bhcy,hyz->bhcz", h.reshape(batch, heads, chunks, -1), w2)
  return out.reshape(rows, chunks, -1), count > 0


def _per_head(spec: str, x: Array, w: Array) -> Array:
  """einsum(spec, x, w) for weights w [H or 1, ...] per head or shared by the heads (no broadcast copy)."""
  if w.shape[0] == 1:
    return jnp.einsum(spec.replace(",h", ","), x, w[0])
  return jnp.einsum(spec, x, w)


def _choice(*_: Any, implementation: Any = "auto", **__: Any) -> Any:
  """What `nsa` traces per platform (the key of `contract.per_platform_op`)."""
  return selection_flash.per_platform_key(implementation, op="nsa")


@contract.per_platform_op(_choice, per_head=tuple(f"cmp_{side}_{part}" for side in ("key", "value")
                                                   for part in MLP_PARTS))
def nsa(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None, compress_block: int = 32,
        compress_stride: int = 16, select_block: int = 64, num_selected: int = 16, window: int = 512,
        gates: Array | None = None, cmp_key_pos: Array | None = None, cmp_key_w1: Array | None = None,
        cmp_key_b1: Array | None = None, cmp_key_w2: Array | None = None, cmp_value_pos: Array | None = None,
        cmp_value_w1: Array | None = None, cmp_value_b1: Array | None = None,
        cmp_value_w2: Array | None = None, query_chunks: int | None = None,
        implementation: str = "auto") -> Array:
  """Native Sparse Attention: gated compression, selection and sliding-window branches (module docstring).

  q, k: [batch, length, heads, head_dim]; v: [batch, length, heads, value_dim]; mask: [batch, length] bool.
  num_selected: n, the selected blocks per query counting its forced ones (own, previous, first), as the
    paper's n = 16; at least 3.
  gates: None (the default: each branch weighs 1/3, so a row sums to one) or [batch, length, heads, 3]
    (compression, selection, window: the model's sigmoid gates).
  cmp_key_*, cmp_value_*: the compression MLPs (all four arrays of a side, or none: mean pooling).
  query_chunks: queries run in this many sequential chunks (None = automatic: ~64 MB of gathered keys each on
  the XLA path, one with the kernels).
  implementation: "xla" | "pallas" | "auto" (module docstring).
  Returns [batch, length, heads, value_dim] in v's dtype.
  """
  op = "nsa"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op, keep_none=True)
  causal = contract.check_bool(causal, name="causal", op=op)
  if not causal:
    raise ValueError(f"{op}: argument 'causal' must be True: NSA is defined for decoders")
  size = contract.check_positive_int(compress_block, name="compress_block", op=op)
  stride = contract.check_positive_int(compress_stride, name="compress_stride", op=op)
  sel = contract.check_positive_int(select_block, name="select_block", op=op)
  count = check_num_selected(num_selected, op=op)
  width = contract.check_positive_int(window, name="window", op=op)
  contract.check_implementation(implementation, IMPLEMENTATIONS, op=op)
  fused = selection_flash.choose_implementation(implementation, op=op) == "pallas"
  if size % stride or sel % stride:
    raise ValueError(f"{op}: argument 'compress_stride' ({stride}) must divide compress_block ({size}) and "
                     f"select_block ({sel})")
  batch, length, heads, head_dim = q.shape
  value_dim = v.shape[-1]
  key_mlp = check_mlp(op, "cmp_key", (cmp_key_pos, cmp_key_w1, cmp_key_b1, cmp_key_w2), heads, size,
                      head_dim)
  value_mlp = check_mlp(op, "cmp_value", (cmp_value_pos, cmp_value_w1, cmp_value_b1, cmp_value_w2), heads,
                        size, value_dim)
  if gates is not None:
    gates = jnp.asarray(gates)
    if gates.shape != (batch, length, heads, BRANCHES):
      raise ValueError(f"{op}: argument 'gates' must have shape [batch, length, heads, 3] = "
                       f"{(batch, length, heads, BRANCHES)}, got {tuple(gates.shape)}")
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  scale = contract.logit_scale(head_dim)

  padded = num_blocks(length, sel) * sel  # whole selection blocks, hence whole chunks of `stride`
  gp = (jnp.full((batch * heads, length, BRANCHES), 1.0 / BRANCHES, ct) if gates is None
        else to_rows(gates, ct))
  if fused:  # the kernels take q, k and v in their own dtype (bfloat16 stays bfloat16)
    qh, kh, vh, real = rows_and_mask(q, k, v, mask, jnp.result_type(q.dtype, k.dtype, v.dtype))
  else:
    qh, kh, vh, real = rows_and_mask(q, k, v, mask, ct)  # [rows, length, dim], real [rows, length]
  # Per query, the gathered keys of the XLA path. The kernels' block scores come out whole from the
  # compression pass, so choosing from them in chunks saves nothing and costs a loop: one chunk.
  per_query = min(count, padded // sel) * sel * (head_dim + value_dim + 2) + padded // stride
  n_chunks = query_chunks if query_chunks is not None else (
      1 if fused else num_query_chunks(qh.shape[0], padded, per_query))
  n_chunks = contract.check_positive_int(n_chunks, name="query_chunks", op=op)
  args = (pad_length(gp, padded), pad_length(kh, padded), pad_length(vh, padded),
          pad_length(real, padded, False))
  plan = dict(batch=batch, compress_block=size, compress_stride=stride, select_block=sel, num_selected=count,
              window=width, key_mlp=key_mlp, value_mlp=value_mlp, query_chunks=n_chunks)
  if fused:
    if mask is None and padded == length:  # every key real: no mask to carry through the kernels
      args = (*args[:3], None)
    out = _attend_fused(pad_length(qh, padded), *args, **plan, scale=scale, dtype=ct)
  else:
    out = attend_rows(pad_length(qh * scale, padded), jnp.arange(padded, dtype=jnp.int32), *args, **plan)
  return from_rows(out[:, :length], batch, v.dtype)


def attend_rows(qs: Array, qpos: Array, gates: Array, kp: Array, vp: Array, realp: Array, *, batch: int,
                compress_block: int, compress_stride: int, select_block: int, num_selected: int, window: int,
                key_mlp: tuple[Array, ...] | None, value_mlp: tuple[Array, ...] | None,
                query_chunks: int) -> Array:
  """NSA for the queries qs [rows, Q, d] (scaled, at positions qpos [Q], increasing and consecutive within
  each of `query_chunks` chunks; gates [rows, Q, 3]) over keys kp [rows, P, d], values vp [rows, P, e] and key
  mask realp [rows, P], P a whole number of selection blocks, masked keys already zero, all in the softmax
  dtype; rows = batch x heads. Arguments checked by `nsa`. The XLA path (`_attend_fused`: the kernels').
  Returns [rows, Q, e]."""
  size, stride, sel = compress_block, compress_stride, select_block
  rows, padded, head_dim = kp.shape
  value_dim = vp.shape[-1]
  nb = padded // sel
  chunks, per_block = padded // stride, size // stride
  count = min(num_selected, nb)
  width = min(window, padded)

  ckeys, cvalid = _compress(kp, realp, key_mlp, batch=batch, block=size, stride=stride)  # [rows, C, d]
  cvalues = flag_nonfinite(_compress(vp, realp, value_mlp, batch=batch, block=size, stride=stride)[0])
  cend = jnp.arange(chunks) * stride + size - 1  # [C]: the last position of each compressed block
  kb = kp.reshape(rows, nb, sel, head_dim)
  vb = flag_nonfinite(vp).reshape(rows, nb, sel, value_dim + 1)
  rb = realp.reshape(rows, nb, sel)

  q_size = -(-qs.shape[1] // query_chunks)
  # The window's keys for a chunk starting at p: positions [p - width + 1, p + q_size), one slice.
  kw = jnp.pad(kp, ((0, 0), (width - 1, q_size), (0, 0)))
  vw = jnp.pad(flag_nonfinite(vp), ((0, 0), (width - 1, q_size), (0, 0)))
  rw = jnp.pad(realp, ((0, 0), (width - 1, q_size)), constant_values=False)
  blocks = jnp.arange(nb)

  def attend_chunk(tree: tuple[Array, ...]) -> Array:
    qc, qpos, gc = tree  # [rows, Q, d], [1, Q], [rows, Q, 3]
    i = qpos[..., None]  # [1, Q, 1]
    # Compression: one softmax over the complete compressed blocks.
    clogits = jnp.einsum("gqd,gcd->gqc", qc, ckeys)
    cvis = cvalid[:, None, :] & (cend <= i)  # [rows, Q, C]
    masked = jnp.where(cvis, clogits, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    w = jnp.exp(masked - jnp.where(jnp.isfinite(top), top, 0.0))
    den = jnp.sum(w, axis=-1, keepdims=True)
    p = w / jnp.where(den > 0, den, 1.0)  # [rows, Q, C]
    o_cmp = flagged_sum("gqc,gce->gqe", p, cvalues)
    # Selection: compressed scores -> stride chunks -> selection blocks (paper eq. 9), then the top blocks.
    ps = jnp.pad(jax.lax.stop_gradient(p), ((0, 0), (0, 0), (per_block - 1, 0)))
    chunk_scores = sum(ps[:, :, per_block - 1 - t:per_block - 1 - t + chunks] for t in range(per_block))
    scores = chunk_scores.reshape(rows, -1, nb, sel // stride).sum(-1)  # [rows, Q, nb]
    own = i // sel  # [1, Q, 1]
    forced = jnp.where(blocks == own, 3, jnp.where(blocks == own - 1, 2, jnp.where(blocks == 0, 1, 0)))
    visible = jnp.broadcast_to(blocks <= own, scores.shape)
    index, chosen = choose(scores, visible, jnp.broadcast_to(forced, scores.shape), count)
    o_slc = joint_softmax([chosen_piece(qc, kb, vb, rb, index, chosen, qpos, True, 1.0)])
    # Sliding window: keys i - width < j <= i, one slice of the padded keys per chunk.
    start = qpos[0, 0]
    span = q_size + width - 1
    kwin = jax.lax.dynamic_slice_in_dim(kw, start, span, axis=1)  # [rows, span, d]
    vwin = jax.lax.dynamic_slice_in_dim(vw, start, span, axis=1)
    rwin = jax.lax.dynamic_slice_in_dim(rw, start, span, axis=1)
    jpos = start - (width - 1) + jnp.arange(span)  # [span]
    wvis = rwin[:, None, :] & (jpos <= i) & (jpos > i - width)  # [rows, Q, span]
    wlogits = jnp.einsum("gqd,gkd->gqk", qc, kwin)
    o_win = joint_softmax([Piece(wlogits, wvis, lambda w: flagged_sum("gqk,gke->gqe", w, vwin))])
    return gc[..., 0:1] * o_cmp + gc[..., 1:2] * o_slc + gc[..., 2:3] * o_win

  return map_chunks(attend_chunk, (qs, qpos[None, :], gates), query_chunks, axis=1)  # [rows, Q, e]


def overlaps(chunks: int, per_block: int, blocks: int, per_select: int) -> np.ndarray:
  """[C, nb]: how many stride chunks compressed block c (chunks c .. c + per_block - 1) shares with selection
  block b (chunks b * per_select ..), the weights of the paper's eq. 9."""
  chunk = np.arange(chunks)[:, None] + np.arange(per_block)[None, :]  # [C, per_block]
  return (chunk[:, :, None] // per_select == np.arange(blocks)).sum(1).astype(np.float32)


def _attend_fused(qp: Array, gates: Array, kp: Array, vp: Array, realp: Array, *, batch: int,
                  compress_block: int, compress_stride: int, select_block: int, num_selected: int,
                  window: int, key_mlp: tuple[Array, ...] | None, value_mlp: tuple[Array, ...] | None,
                  query_chunks: int, scale: float, dtype: Any) -> Array:
  """`attend_rows` in the kernels, for the queries qp [rows, P, d] (unscaled; at positions 0..P-1) with q, k
  and v in their own dtype: the compression branch and the selection blocks' scores are one pass of
  `selection_flash` over the compressed keys (in `dtype`, the softmax dtype), compressed block c at position
  c·s + l - 1 (its last token: causal) with values [phi_v | eq. 9's overlaps of c], whose softmax weights
  times the overlaps are the block scores; the choice in XLA; then the selection and window branches."""
  rows, padded, _ = kp.shape
  size, stride, sel = compress_block, compress_stride, select_block
  ct = dtype
  value_dim = vp.shape[-1]
  nb = padded // sel
  count = min(num_selected, nb)
  ckeys, cvalid = _compress(kp.astype(ct), realp, key_mlp, batch=batch, block=size, stride=stride)
  cvalid = jnp.broadcast_to(cvalid, ckeys.shape[:2])  # [rows, C]
  cvalues, _ = _compress(vp.astype(ct), realp, value_mlp, batch=batch, block=size, stride=stride)
  chunks = ckeys.shape[1]
  cblock = min(128, 1 << (chunks - 1).bit_length())
  cpad = -(-chunks // cblock) * cblock  # compressed keys padded to whole kernel blocks, masked
  per_block, per_select = size // stride, sel // stride
  weights = jnp.asarray(overlaps(chunks, per_block, nb, per_select), ct)
  width = 1 << (value_dim + nb - 1).bit_length()  # [phi_v | overlaps | zeros]: the kernel's power of two
  values = jnp.concatenate([cvalues, jnp.broadcast_to(weights, (rows, chunks, nb)),
                            jnp.zeros((rows, chunks, width - value_dim - nb), ct)], axis=-1)
  creal = None if realp is None and cpad == chunks else pad_length(cvalid, cpad, False)  # None: all real
  out = selection_flash.attend(qp.astype(ct), pad_length(ckeys, cpad), pad_length(values, cpad), creal, None,
                               block=cblock, causal=True, scale=scale, key_stride=stride,
                               key_offset=size - 1)  # [rows, P, width]
  o_cmp, scores = out[..., :value_dim], jax.lax.stop_gradient(out[..., value_dim:value_dim + nb])
  blocks = jnp.arange(nb)

  def choose_chunk(tree: tuple[Array, Array]) -> Array:
    sc, qpos = tree  # [rows, Q, nb], [1, Q]
    own = (qpos // sel)[..., None]  # [1, Q, 1]
    forced = jnp.where(blocks == own, 3, jnp.where(blocks == own - 1, 2, jnp.where(blocks == 0, 1, 0)))
    # `choose` in one pass: a score is at most l/s (softmax weights times overlaps), so rank·(l/s + 1) puts
    # the forced blocks first in their order; ties go to the lower block (top_k's).
    key = jnp.where(blocks <= own, sc + (per_block + 1.0) * forced, -jnp.inf)
    top, index = jax.lax.top_k(key, count)
    return jnp.where(top > -jnp.inf, index, -1).astype(jnp.int32)  # [rows, Q, count]

  ids = map_chunks(choose_chunk, (scores, jnp.arange(padded, dtype=jnp.int32)[None, :]), query_chunks, axis=1)
  o_slc, o_win = selection_flash.attend(qp, kp, vp, realp, ids, block=sel, causal=True, scale=scale,
                                        also_window=window)  # both branches in one pass over the keys
  return (gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc.astype(ct) + gates[..., 2:3] * o_win.astype(ct))
