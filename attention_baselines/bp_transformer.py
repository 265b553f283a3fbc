"""BP-Transformer attention (Ye et al., 2019, "Modelling Long-Range Context via Binary Partitioning").

The graph: the L tokens padded to n = 2^ceil(log2 L) are the leaves of a perfect binary tree whose n - 1 inner
nodes are span nodes; span node (l, j), level l = 1..log2 n, covers the tokens [j 2^l, (j + 1) 2^l). Node
order (the op's `graph=True` input and output): the L tokens, then the span nodes level by level from the
bottom (level 1 first, the root last), each level in position order: (l, j) sits at L + n - n / 2^(l-1) + j.

Edges (who attends to whom), each labelled with a relative position vector added to the key:
- token i: itself (`r_self`) and its contextual nodes, which partition the rest of its context (every other
  token, or every earlier one when causal, covered exactly once), as in the paper and the authors' released
  code: on each side, k nodes per level l = 0, 1, ..., each level starting where the previous one ended (the
  paper's p_0 = i + 1, p_l = p_{l-1} + k). Level 0 is the k tokens next to i; at level l >= 1, when the
  boundary that level l - 1 left is not a boundary of level-l nodes, the first of the k nodes is the
  level-(l - 1) node there (the released code's "overlap" step, which keeps the nodes from overlapping), the
  others level-l nodes. Slot m of level l is labelled `r_left[l, m]` (left) or `r_right[l, m]` (right,
  bidirectional only). In closed form, with u = i - c_l, c_l = k (2^l - 1) + 1 (left; the right side mirrors
  it on n - 1 - i): level 0 reads tokens i - 1 - m; level l >= 1 reads, when bit l - 1 of u is 0, the
  level-(l - 1) node u >> (l - 1) in slot 0, and level-l nodes (u >> l) - m in the other slots (all of them
  when that bit is 1); nodes before the first (or after the last) do not exist. Left nodes end before i, so
  the causal form (left only) reads no span that reaches i.
- span node (l, j): its 2^l tokens (the paper's affiliated edges; `r_anc[l]`), in both forms: a span node is
  read only by tokens after its span, so reading its own tokens is causal for every token that uses it.
Masked tokens, and span nodes whose tokens are all masked (padding up to n included), are dropped as keys.
Logits are `q_a . (k_b + r_ab) / sqrt(d)`, one softmax per node over its edges.

A token's at most 2k log2 n + 1 edges are one softmax over pieces of static layout, built from pads,
slices and reshapes of the level arrays, never a gather. A token's level-l nodes other than slot 0's finer
one are the level-l nodes A - m below its anchor A (A = i - 1 at level 0, u >> l above), so the tokens of
one anchor, or of one aligned group of 2^(l - 1) (aligned at c_l, or at -c_l on the right), share them:
- k up to 8: one piece per level and side with one column per slot, each group's k nodes stacked from k
  shifted copies of the level arrays (`_context_nodes`): exactly the edges, in a program that grows with k;
- larger k: blocks of ceil((k - 1) / 4) consecutive anchors read one window of consecutive level-l nodes,
  cut by a pad, a reshape and at most 5 shifted slices whatever k is (`_Band`); a static mask keeps each
  token's own k (a window is 1.1-1.43x k nodes, 1.25x for k = 16, 32, 64; a level with fewer nodes is
  read whole), the relative vectors follow as one Toeplitz table per level, and the finer nodes are a
  piece of one column. A window also holds nodes its token does not read (later ones, when causal), so
  the values are flagged once (`flag_nonfinite`): a non-finite one there never reaches it.
The right side is the left on reversed positions; span nodes of level l attend to their 2^l tokens as
[n / 2^l, 2^l] blocks. O(k n log n) logits and O(n log n d) for the span nodes; no [n, n] array is ever
built. (`token_neighbours` lists the same edges per token, for the cached decoder and the tests.)

Without span-node states (`graph=False`, the op contract on L tokens: benchmarks, the op sweeps) a span
node's query, key and value are the masked means of its tokens'; the model
(models/bp_transformer_attention.py) carries the span nodes as states updated by every layer and passes
`graph=True`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_core import contract
from attention_core.combine import Piece, attend_zeros_hidden, flag_nonfinite, joint_softmax, unflag

Array = Any
OP = "bp_transformer"


def tree_size(length: int) -> int:
  """n: the tree's leaf count, the smallest power of two >= length."""
  return 1 << max(0, int(length) - 1).bit_length()


def num_span_nodes(length: int) -> int:
  return tree_size(length) - 1


def tokens_in_graph(nodes: int) -> int | None:
  """The token count L whose graph has `nodes` = L + n(L) - 1 nodes, or None (L -> L + n - 1 is
  one-to-one)."""
  n = 1
  while n <= nodes:
    length = nodes - n + 1
    if length >= 1 and tree_size(length) == n:
      return length
    n *= 2
  return None


def span_offset(n: int, level: int) -> int:
  """Where level `level` (>= 1) starts among the n - 1 span nodes (bottom level first)."""
  return n - (n >> (level - 1))


def _left_nodes(i: np.ndarray, context: int, lvl: int, m: int) -> tuple[np.ndarray, np.ndarray]:
  """(node level, node index) of slot m of level `lvl` on the left of tokens i (module docstring; an index
  below 0 is no node)."""
  if lvl == 0:
    return np.zeros_like(i), i - 1 - m
  u = i - (context * ((1 << lvl) - 1) + 1)
  finer = (m == 0) & ((u >> (lvl - 1)) & 1 == 0)  # the level-(l - 1) node where level l - 1 ended
  return np.where(finer, lvl - 1, lvl), np.where(finer, u >> (lvl - 1), (u >> lvl) - m)


@functools.lru_cache(maxsize=64)
def token_neighbours(n: int, context: int, causal: bool) -> tuple[np.ndarray, ...]:
  """Static neighbour table of the n token nodes (their contextual nodes, module docstring).

  Returns (index, valid, kind, level, rank), each [n, S], S = 1 + (1 or 2) * context * log2 n: the node index
  among the 2n nodes [tokens (n); span nodes (n - 1); one zero node], whether the slot holds an edge, and its
  label: kind 0 self, 1 left, 2 right; the slot's level l (its node is of level l or l - 1); the slot m."""
  levels = n.bit_length() - 1
  sides = (1,) if causal else (1, 2)
  width = 1 + len(sides) * context * levels
  index = np.full((n, width), 2 * n - 1, np.int32)
  valid = np.zeros((n, width), bool)
  kind, level, rank = (np.zeros((n, width), np.int32) for _ in range(3))
  i = np.arange(n)
  index[:, 0], valid[:, 0] = i, True
  slot = 1
  for lvl in range(levels):
    for side in sides:
      for m in range(context):
        at, j = _left_nodes(i if side == 1 else n - 1 - i, context, lvl, m)
        count = n >> at
        ok = (j >= 0) & (j < count)
        j = j if side == 1 else count - 1 - j  # the right side mirrors the left
        node = np.where(at == 0, j, n + n - (n >> np.maximum(at - 1, 0)) + j)  # tokens, then span_offset
        index[:, slot] = np.where(ok, node, 2 * n - 1)
        valid[:, slot], kind[:, slot], level[:, slot], rank[:, slot] = ok, side, lvl, m
        slot += 1
  return index, valid, kind, level, rank


def _groups(n: int, context: int, lvl: int) -> tuple[int, int, int, np.ndarray]:
  """Level `lvl` >= 1's aligned groups of 2^(l - 1) tokens, g = (i - c_l) >> (l - 1): (size, front, first,
  even [G]): token i sits at row i + front of the G groups, group 0 is g = first, `even` says which g are
  even (slot 0 holds their level-(l - 1) node g)."""
  size = 1 << (lvl - 1)
  c = context * ((1 << lvl) - 1) + 1
  front = -c % size
  count = -(-(n + front) // size)
  first = -((c + front) // size)
  return size, front, first, (np.arange(count) + first) % 2 == 0


def _context_nodes(nodes: list[tuple[Array, ...]], lvl: int, context: int, n: int
                   ) -> tuple[int, int, tuple[Array, ...]]:
  """The left contextual nodes of level `lvl` per aligned group of tokens (module docstring), from the level
  arrays nodes[l] = (keys, values, real) [b, n >> l, ...], as (group size, front, (keys [b, G, k, h, d],
  values, real [b, G, k])): token i sits at i + front of the G groups. Slot m >= 1 holds level-l node
  (g >> 1) - m of group g = (i - c_l) >> (l - 1); slot 0 the level-(l - 1) node g where g is even, else
  level-l node g >> 1; indices below 0 are no node (real False)."""
  if lvl == 0:  # tokens i - 1 - m, one group per token
    shifted = [tuple(_shift(x, 1 + m, n) for x in nodes[0]) for m in range(context)]
    return 1, 0, tuple(jnp.stack(parts, axis=2) for parts in zip(*shifted, strict=True))
  size, front, first, even = _groups(n, context, lvl)
  count = even.size
  coarse = [jnp.repeat(x, 2, axis=1) for x in nodes[lvl]]  # entry j: level-l node j >> 1
  fine = nodes[lvl - 1]  # entry j: level-(l - 1) node j
  even = jnp.asarray(even)
  slots = []
  for m in range(context):
    picked = [_window(x, first - 2 * m, count) for x in coarse]  # level-l node (g >> 1) - m
    if m == 0:
      finer = [_window(x, first, count) for x in fine]
      picked = [jnp.where(even.reshape((1, count) + (1,) * (a.ndim - 2)), b, a)
                for a, b in zip(picked, finer, strict=True)]
    slots.append(picked)
  return size, front, tuple(jnp.stack(parts, axis=2) for parts in zip(*slots, strict=True))


def _shift(x: Array, by: int, n: int) -> Array:
  """x[:, i - by] for i < n (zeros, False, before the first): [b, n, ...]."""
  return _window(x, -by, n)


def _group_piece(q: Array, size: int, front: int, nodes: tuple[Array, ...], vectors: Array | None, n: int,
                 scale: float, flip: Any) -> Piece:
  """The piece of the O slots that each aligned group of `size` tokens reads (token i at row i + front):
  q [b, n, h, d] (the side's order), the groups' (keys [b, G, O, h, d], values, real [b, G, O]) and the
  slots' relative vectors [h, O, d] (or None) -> logits [b, h, n, O]."""
  batch, _, heads, head_dim = q.shape
  kn, vn, real = nodes
  count, slots = real.shape[1:]
  extent = [(0, 0), (0, 0), (front, count * size - n - front)]
  qg = _window(q, -front, count * size).reshape(batch, count, size, heads, head_dim)
  s = jnp.einsum("bcghd,bcohd->bhcgo", qg, kn).reshape(batch, heads, count * size, slots)
  s = s[:, :, front:front + n]
  if vectors is not None:
    s = s + jnp.einsum("bihd,hmd->bhim", q, jnp.broadcast_to(vectors, (heads, slots, head_dim)))
  valid = jnp.repeat(real, size, axis=1)[:, None, front:front + n]  # [b, 1, n, O]

  def apply(w: Array) -> Array:  # [b, h, n, O] -> [b, h, n, dv]
    w = jnp.pad(flip(w), [*extent, (0, 0)]).reshape(batch, heads, count, size, slots)
    out = jnp.einsum("bhcgo,bcohd->bhcgd", w, vn).reshape(batch, heads, count * size, vn.shape[-1])
    return flip(out[:, :, front:front + n])

  return Piece(flip(s) * scale, flip(valid), apply)


_STACKED_MAX = 8  # k up to this: one column per slot (`_context_nodes`); above: windows (`_Band`)
_SHIFTS = 4  # at most this many block shifts per window: blocks of ceil((k - 1) / 4) anchors


@dataclasses.dataclass(frozen=True, eq=False)
class _Band:
  """Level `lvl`'s left contextual nodes as blocks of consecutive anchors (module docstring), static.

  A token's anchor is A = i - 1 at level 0 and A = (i - c_l) >> l above; it reads the level-l nodes A - m of
  its slots m (all k, or 1..k - 1 when slot 0 holds the finer node). The `per` tokens of one anchor are
  consecutive, so the tokens are laid out as `blocks` blocks of `anchors` anchors (token i at row
  i + front), and block j reads the `width` level-l nodes from start + j * anchors: its own anchors' and the
  `shifts` blocks of nodes before them (shifts * anchors >= k - 1) or, when the level has no more, all of
  them (one block). Column c of the row of anchor p (in its block) holds slot m = p - c + shift; `valid`
  [blocks * rows, width] says which (row, column) pairs are edges of the graph.
  """

  per: int
  anchors: int
  blocks: int
  shifts: int
  width: int
  front: int
  start: int
  shift: int
  banded: bool
  valid: np.ndarray

  @property
  def rows(self) -> int:
    return self.anchors * self.per


@functools.lru_cache(maxsize=256)
def _band(n: int, context: int, lvl: int) -> _Band:
  """The blocked layout of level `lvl` of a tree of n leaves with k = `context` nodes per level."""
  count = n >> lvl  # the level's nodes (level 0: the tokens)
  per = 1 << lvl
  c = context * (per - 1) + 1  # c_l (level 0: 1, its anchor i - 1)
  a0 = -(c // per) if c % per == 0 else -(c // per) - 1  # the anchor of token 0: floor(-c / per)
  front = -(c + a0 * per)  # token 0's row
  last = (n - 1 - c) // per  # the anchor of the last token
  anchors = max(1, -(-(context - 1) // _SHIFTS))
  shifts = -(-(context - 1) // anchors)
  if count <= (shifts + 1) * anchors:
    anchors, blocks, shifts, width, start, banded = last - a0 + 1, 1, 0, count, 0, False
  else:
    width, start, banded = (shifts + 1) * anchors, a0 - shifts * anchors, True
    blocks = -(-(front + n) // (anchors * per))
  shift = a0 - start
  r = np.arange(blocks * anchors * per)[:, None]
  i, col = r - front, np.arange(width)[None, :]
  node = start + (r // (anchors * per)) * anchors * banded + col
  m = (r // per) % anchors - col + shift
  ok = (i >= 0) & (i < n) & (node >= 0) & (node < count) & (m >= 0) & (m < context)
  if lvl:
    ok &= ~((((i - c) >> (lvl - 1)) % 2 == 0) & (m == 0))  # an even group's slot 0 is the finer node
  return _Band(per, anchors, blocks, shifts, width, front, start, shift, banded, ok)


def _band_nodes(x: Array, band: _Band) -> Array:
  """A level array [b, count, ...] -> each block's window of nodes [b, blocks, width, ...] (zeros, False,
  outside the level)."""
  if not band.banded:
    return x[:, None]
  x = _window(x, band.start, (band.blocks + band.shifts) * band.anchors)
  x = x.reshape(x.shape[0], band.blocks + band.shifts, band.anchors, *x.shape[2:])
  parts = [x[:, s:s + band.blocks] for s in range(band.shifts + 1)]  # block j: node blocks j .. j + shifts
  return jnp.concatenate(parts, axis=2)


def _band_table(vectors: Array, band: _Band) -> Array:
  """The level's k relative vectors [h, k, d] -> each (anchor p, column c) pair's [h, anchors, width, d]:
  slot p - c + shift's vector, zeros outside 0..k - 1. A Toeplitz arrangement by one tile and one reshape:
  row p of the tiled sequence E (E[j] = slot shift + anchors - 1 - j), read with rows one shorter, starts at
  E[anchors - 1 - p]."""
  heads, k, _ = vectors.shape
  b, length = band.anchors, band.width + band.anchors
  e = _window(jnp.flip(vectors, axis=1), k - band.shift - b, length)  # [h, length, d]
  tiled = jnp.tile(e[:, None], (1, b, 1, 1)).reshape(heads, b * length, -1)
  return tiled[:, b - 1:b - 1 + b * (length - 1)].reshape(heads, b, length - 1, -1)[:, :, :band.width]


def _window(x: Array, start: int, count: int) -> Array:
  """x[:, start:start + count] with zeros (False) for the entries outside x: [b, count, ...]."""
  before, after = max(0, -start), max(0, start + count - x.shape[1])
  x = jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
  return jax.lax.slice_in_dim(x, start + before, start + before + count, axis=1)


def _level_piece(q: Array, nodes: tuple[Array, ...], vectors: Array | None, band: _Band, n: int,
                 scale: float, flip: Any) -> Piece:
  """The piece of one level and side for k above 8: q [b, n, h, d] (the side's order), the level's (keys,
  flagged values, real) [b, count, ...] and its relative vectors [h, k, d] (or None) -> logits
  [b, h, n, width] over each token's block window, valid where the band says and the node is real; its
  apply gives flagged sums."""
  batch, _, heads, head_dim = q.shape
  kn, vn, real = (_band_nodes(x, band) for x in nodes)  # [b, blocks, width, ...]
  rows = band.blocks * band.rows
  extent = [(0, 0), (0, 0), (band.front, rows - n - band.front), (0, 0)]
  qb = _window(q, -band.front, rows).reshape(batch, band.blocks, band.rows, heads, head_dim)
  s = jnp.einsum("bjrhd,bjchd->bhjrc", qb, kn)  # [b, h, blocks, rows, width]
  if vectors is not None:
    rel = jnp.broadcast_to(_band_table(vectors, band), (heads, band.anchors, band.width, head_dim))
    qa = qb.reshape(batch, band.blocks, band.anchors, band.per, heads, head_dim)
    s = s + jnp.einsum("bjpshd,hpcd->bhjpsc", qa, rel).reshape(s.shape)
  valid = jnp.asarray(band.valid).reshape(1, 1, band.blocks, band.rows, band.width) & real[:, None, :, None]
  cut = lambda x: flip(x.reshape(*x.shape[:2], rows, band.width)[:, :, band.front:band.front + n])  # noqa: E731

  def apply(w: Array) -> Array:  # [b, h, n, width] -> [b, h, n, dv + 1]
    w = jnp.pad(flip(w), extent).reshape(batch, heads, band.blocks, band.rows, band.width)
    out = jnp.einsum("bhjrc,bjchd->bhjrd", w, vn).reshape(batch, heads, rows, vn.shape[-1])
    return flip(out[:, :, band.front:band.front + n])

  return Piece(cut(s) * scale, cut(valid), apply)


def _finer_piece(q: Array, nodes: tuple[Array, ...], vector: Array | None, lvl: int, context: int, n: int,
                 scale: float, flip: Any) -> Piece:
  """Slot 0 of level `lvl` >= 1 where it holds the level-(l - 1) node g of an even group (`_groups`): q
  [b, n, h, d], the level-(l - 1) arrays (keys, flagged values, real), the slot's relative vector [h, d]
  (or None) -> logits [b, h, n, 1]."""
  size, front, first, even = _groups(n, context, lvl)
  kn, vn, real = (_window(x, first, even.size)[:, :, None] for x in nodes)  # [b, G, 1, ...]
  real = real & jnp.asarray(even)[None, :, None]
  return _group_piece(q, size, front, (kn, vn, real), None if vector is None else vector[:, None], n, scale,
                      flip)


def relative_table(heads: int, head_dim: int, context: int, rel_self: Array | None, rel_left: Array | None,
                   rel_right: Array | None, rel_anc: Array | None, dtype: Any) -> tuple[Array | None, int]:
  """The relative vectors as one table [heads or 1, 1 + 2 T k + T, head_dim] (rows: self, left, right, anc;
  `label_of` and `anc_label` index it) and T, its number of level rows; (None, 1) when none is given."""
  given = {n: x for n, x in (("rel_self", rel_self), ("rel_left", rel_left), ("rel_right", rel_right),
                             ("rel_anc", rel_anc)) if x is not None}
  if not given:
    return None, 1
  given = {n: jnp.asarray(x) for n, x in given.items()}
  h = heads if any(x.shape[0] == heads for x in given.values()) else 1
  rows = [x.shape[1] for n, x in given.items() if n != "rel_self" and x.ndim >= 3]
  t = rows[0] if rows else 1
  want = {"rel_self": (head_dim,), "rel_left": (t, context, head_dim), "rel_right": (t, context, head_dim),
          "rel_anc": (t, head_dim)}
  for name, x in given.items():
    if x.shape[1:] != want[name] or x.shape[0] not in (1, heads):
      dims = ", ".join(map(str, want[name]))
      raise ValueError(f"{OP}: argument {name!r} must have shape [heads or 1, {dims}]"
                       f" (T level rows shared by the tables, k = context = {context}), got {tuple(x.shape)}")
  full = {n: jnp.broadcast_to(given[n].astype(dtype), (h, *s)) if n in given else jnp.zeros((h, *s), dtype)
          for n, s in want.items()}
  table = jnp.concatenate([full["rel_self"][:, None], full["rel_left"].reshape(h, t * context, head_dim),
                           full["rel_right"].reshape(h, t * context, head_dim), full["rel_anc"]], axis=1)
  return table, t  # [h, 1 + 2 T k + T, head_dim]


def label_of(kind: np.ndarray, level: np.ndarray, rank: np.ndarray, rows: int, context: int) -> np.ndarray:
  """Row of `relative_table` for token edges: self 0; left (l, m) 1 + min(l, T-1) k + m; right after the left
  rows. Levels beyond the table's T rows share its last row."""
  lvl = np.minimum(level, rows - 1)
  left = 1 + lvl * context + rank
  return np.where(kind == 0, 0, np.where(kind == 1, left, left + rows * context)).astype(np.int32)


def anc_label(level: int, rows: int, context: int) -> int:
  """Row of `relative_table` for a span node of level `level` >= 1 reading its tokens."""
  return 1 + 2 * rows * context + min(level - 1, rows - 1)


def _masked_mean(x: Array, real: Array, n: int, level: int) -> Array:
  """x [b, n, h, d] (zero where not real), real [b, n] -> the level's span means [b, n / 2^l, h, d]."""
  size = 1 << level
  total = x.reshape(x.shape[0], n // size, size, *x.shape[2:]).sum(2)
  count = real.reshape(real.shape[0], n // size, size).sum(2).astype(x.dtype)[:, :, None, None]
  return total / jnp.maximum(count, 1)


def bp_transformer(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                   context: int = 4, rel_self: Array | None = None, rel_left: Array | None = None,
                   rel_right: Array | None = None, rel_anc: Array | None = None,
                   graph: bool = False) -> Array:
  """BP-Transformer graph attention, causal or bidirectional.

  graph=False: q, k [batch, L, heads, head_dim], v [batch, L, heads, value_dim], mask [batch, L]; span nodes
    are the masked means of their tokens; returns the tokens' output [batch, L, heads, value_dim].
  graph=True: q, k, v, mask over the graph's N = L + n - 1 nodes (tokens, then span nodes, module
    docstring); returns every node's output [batch, N, heads, value_dim].
  context: k, the nodes per level and side; rel_self [heads or 1, head_dim], rel_left / rel_right
    [heads or 1, T, k, head_dim], rel_anc [heads or 1, T, head_dim]: relative vectors added to the keys (level
    l reads row min(l, T - 1); rel_anc's row l - 1 is level l); None = zeros.
  """
  causal = contract.check_bool(causal, name="causal", op=OP)
  graph = contract.check_bool(graph, name="graph", op=OP)
  context = contract.check_positive_int(context, name="context", op=OP)
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=OP)
  batch, nodes, heads, head_dim = q.shape
  length = tokens_in_graph(nodes) if graph else nodes
  if length is None:
    raise ValueError(f"{OP}: with graph=True the length must be L + n - 1 for L tokens and n = "
                     f"2^ceil(log2 L) (tokens, then span nodes), got {nodes}")
  n = tree_size(length)
  levels = n.bit_length() - 1
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  table, rows = relative_table(heads, head_dim, context, rel_self, rel_left, rel_right, rel_anc, ct)
  scale = contract.logit_scale(head_dim)
  pad = [(0, 0), (0, n - length), (0, 0), (0, 0)]

  token_real = jnp.pad(mask[:, :length], [(0, 0), (0, n - length)])  # [b, n]
  span_real = jnp.concatenate(
      [token_real.reshape(batch, n >> lvl, 1 << lvl).any(-1) for lvl in range(1, levels + 1)]
      + [jnp.zeros((batch, 0), bool)], axis=1)  # [b, n - 1]
  if graph:
    span_real = span_real & mask[:, length:]
  zero = lambda x, real: jnp.where(real[:, :, None, None], x.astype(ct), 0)  # noqa: E731  masked: inert
  qt = jnp.pad(q[:, :length].astype(ct), pad)  # [b, n, h, d]
  kt, vt = (zero(jnp.pad(x[:, :length], pad), token_real) for x in (k, v))  # [b, n, h, dim]
  if graph:
    qs = q[:, length:].astype(ct)
    ks, vs = (zero(x[:, length:], span_real) for x in (k, v))  # [b, n - 1, h, dim]
  else:
    means = lambda x: jnp.concatenate(  # noqa: E731
        [_masked_mean(x, token_real, n, lvl) for lvl in range(1, levels + 1)] + [x[:, :0]], axis=1)
    ks, vs = means(kt), means(vt)  # [b, n - 1, h, dim]

  # Tokens, one softmax over their own key and one piece per level and side (module docstring; no gather):
  # for k up to 8 one column per slot; above, windows of consecutive anchors' nodes and a piece for the finer
  # slot 0, whose windows also hold nodes a token does not read (later ones, when causal): their values are
  # flagged once (`flag_nonfinite`) so that a non-finite one there never reaches the token's output.
  span = lambda x, lvl: x[:, span_offset(n, lvl):span_offset(n, lvl) + (n >> lvl)]  # noqa: E731
  windows = context > _STACKED_MAX
  vtf, vsf = (flag_nonfinite(vt), flag_nonfinite(vs)) if windows else (vt, vs)  # [b, n or n - 1, h, dv (+ 1)]
  nodes = [(kt, vtf, token_real)] + [(span(ks, lvl), span(vsf, lvl), span(span_real, lvl))
                                     for lvl in range(1, levels)]  # per level: [b, n >> l, ...]
  self_logits = jnp.einsum("bihd,bihd->bhi", qt, kt)  # [b, h, n]
  if table is not None:
    self_vector = jnp.broadcast_to(table[:, 0], (heads, head_dim))
    self_logits = self_logits + jnp.einsum("bihd,hd->bhi", qt, self_vector)
  pieces = [Piece(self_logits[..., None] * scale, token_real[:, None, :, None],
                  lambda w: jnp.einsum("bhio,bihd->bhid", w, vtf))]
  for side in (1,) if causal else (1, 2):
    # The right side is the left side on reversed positions (nodes reversed within each level).
    flip = (lambda x: x) if side == 1 else (lambda x: jnp.flip(x, axis=1))  # noqa: E731
    flip_rows = (lambda x: x) if side == 1 else (lambda x: jnp.flip(x, axis=2))  # noqa: E731
    levels_of_side = [tuple(flip(x) for x in lvl_nodes) for lvl_nodes in nodes]
    q_side = flip(qt)
    for lvl in range(levels):
      first = int(label_of(np.int32(side), np.int32(lvl), np.int32(0), rows, context))  # slot 0's table row
      vectors = None if table is None else table[:, first:first + context]  # [h, k, d]
      if not windows:
        size, front, slots = _context_nodes(levels_of_side, lvl, context, n)
        pieces.append(_group_piece(q_side, size, front, slots, vectors, n, scale, flip_rows))
        continue
      pieces.append(_level_piece(q_side, levels_of_side[lvl], vectors, _band(n, context, lvl), n, scale,
                                 flip_rows))
      if lvl:
        vector = None if table is None else table[:, first]  # [h, d]
        finer = levels_of_side[lvl - 1]
        pieces.append(_finer_piece(q_side, finer, vector, lvl, context, n, scale, flip_rows))
  token_out = joint_softmax(pieces)  # [b, h, n, dv (+ 1)]
  token_out = unflag(token_out) if windows else token_out
  token_out = jnp.moveaxis(token_out, 1, 2)[:, :length]  # [b, L, h, dv]
  if not graph:
    return token_out.astype(v.dtype)

  # Span nodes: level l's nodes read their 2^l tokens.
  outs = []
  for lvl in range(1, levels + 1):
    size, count = 1 << lvl, n >> lvl
    start = span_offset(n, lvl)
    ql = qs[:, start:start + count]  # [b, count, h, d]
    kl = kt.reshape(batch, count, size, heads, head_dim)
    vl = jnp.moveaxis(vt.reshape(batch, count, size, heads, vt.shape[-1]), 3, 1)  # [b, h, count, size, dv]
    s = jnp.einsum("bjhd,bjthd->bhjt", ql, kl)  # [b, h, count, size]
    if table is not None:
      s = s + jnp.einsum("bjhd,hd->bhj", ql, table[:, anc_label(lvl, rows, context)])[..., None]
    real = token_real.reshape(batch, 1, count, size)
    outs.append(jnp.moveaxis(attend_zeros_hidden(s * scale, real, vl, "bhjt,bhjtd->bhjd"), 1, 2))
  span_out = jnp.concatenate(outs + [token_out[:, :0]], axis=1)  # [b, n - 1, h, dv]
  return jnp.concatenate([token_out, span_out], axis=1).astype(v.dtype)  # [b, L + n - 1, h, dv]


def auto_params(length: int) -> dict:
  """k = 4 context nodes per level and side (the paper's setting for text classification and translation)."""
  return {"context": 4}
