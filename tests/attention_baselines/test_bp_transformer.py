"""BP-Transformer: the op against its graph written from the definition in float64 (an explicit [N, N]
adjacency over tokens and span nodes built by walking the paper's p_l rule, dense masked softmax with the
relative vectors), causal and bidirectional, odd lengths (padding to a power of two), masks, span nodes as
given states or as their tokens' means; every token's contextual nodes cover its context exactly once;
causality by Jacobian; the model with span nodes carried through its blocks, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.bp_transformer import (
  _band,
  bp_transformer,
  num_span_nodes,
  span_offset,
  token_neighbours,
  tokens_in_graph,
  tree_size,
)


def contextual_nodes(length, k, i, causal):
  """Token i's contextual nodes by the paper's rule, walked in token positions: on each side k nodes per
  level, level 0 the k tokens next to i, each level starting where the previous one ended (p_0 = i + 1, p_l =
  p_{l-1} + k); at level l, a boundary that is not one of level-l nodes first takes the level-(l - 1) node
  there (the authors' released code). Returns [(side, level of the slot, slot m, node level, node index)]
  for the nodes inside the padded tree."""
  n = tree_size(length)
  levels = n.bit_length() - 1
  out = []
  for side in ("left",) if causal else ("left", "right"):
    edge = i if side == "left" else i + 1  # the covered context ends (left) or starts (right) here
    for lvl in range(levels):
      for m in range(k):
        size = 1 << lvl
        if lvl and edge % size:  # not a level-l boundary: the finer node first
          size //= 2
        start = edge - size if side == "left" else edge
        node_level = size.bit_length() - 1
        if 0 <= start and start + size <= n:
          out.append((side, lvl, m, node_level, start >> node_level))
        edge = start if side == "left" else edge + size
  return out


def _graph(length, k, causal, rows):
  """From the definition: nodes [L tokens; span nodes (level 1 first, position order)]. Returns the
  adjacency [N, N] bool (query row, key column), the relative-vector label per edge (-1 none) and the span
  nodes' token ranges. Labels: ("self",), ("left", l, m), ("right", l, m), ("anc", l), mapped to table
  rows."""
  n = tree_size(length)
  levels = n.bit_length() - 1
  spans = [(lvl, j) for lvl in range(1, levels + 1) for j in range(n >> lvl)]
  node_of = {(0, i): i for i in range(n)}  # padded tokens get ids past N (dropped below)
  for s, (lvl, j) in enumerate(spans):
    node_of[(lvl, j)] = length + s
  for i in range(length, n):
    node_of[(0, i)] = None
  nodes = length + len(spans)
  adj = np.zeros((nodes, nodes), bool)
  label = np.full((nodes, nodes), -1)

  def row(kind, lvl=0, m=0):
    r = min(lvl, rows - 1)
    return {"self": 0, "left": 1 + r * k + m, "right": 1 + rows * k + r * k + m,
            "anc": 1 + 2 * rows * k + min(lvl - 1, rows - 1)}[kind]

  for i in range(length):
    adj[i, i], label[i, i] = True, row("self")
    for side, lvl, m, node_level, j in contextual_nodes(length, k, i, causal):
      b = node_of[(node_level, j)]
      if b is not None:
        assert not adj[i, b]
        adj[i, b], label[i, b] = True, row(side, lvl, m)
  for lvl, j in spans:
    a = node_of[(lvl, j)]
    for t in range(j << lvl, (j + 1) << lvl):
      if t < length:
        adj[a, t], label[a, t] = True, row("anc", lvl)
  return adj, label, spans


def _span_real(token_mask, spans):
  """[batch, spans] bool: the span covers a real token."""
  return np.array([[token_mask[bi][j << lv:(j + 1) << lv].any() for lv, j in spans]
                   for bi in range(token_mask.shape[0])], bool).reshape(token_mask.shape[0], len(spans))


def _reference(q, k, v, mask, kctx, causal, table, graph):
  """Dense masked softmax over the graph in float64. graph=False: span nodes' q, k, v are the means of their
  real tokens'; only the tokens' output is returned."""
  q, k, v, table = (np.asarray(x, np.float64) for x in (q, k, v, table))
  mask = np.asarray(mask)
  nodes = q.shape[1]
  length = tokens_in_graph(nodes) if graph else nodes
  adj, label, spans = _graph(length, kctx, causal, (table.shape[1] - 1) // (2 * kctx + 1))
  b, _, h, d = q.shape
  if graph:
    span_real = _span_real(mask[:, :length], spans) & mask[:, length:]
    real = np.concatenate([mask[:, :length], span_real], axis=1)
  else:
    def means(x):
      out = []
      for lv, j in spans:
        sel = np.zeros(length, bool)
        sel[j << lv:(j + 1) << lv] = True
        sel = sel[None] & mask
        out.append((x * sel[:, :, None, None]).sum(1) / np.maximum(sel.sum(1), 1)[:, None, None])
      return np.stack(out, 1) if out else x[:, :0]
    span_real = _span_real(mask, spans)
    k = np.concatenate([k, means(np.where(mask[:, :, None, None], k, 0))], 1)
    v = np.concatenate([v, means(np.where(mask[:, :, None, None], v, 0))], 1)
    q = np.concatenate([q, np.zeros((b, len(spans), h, d))], 1)
    real = np.concatenate([mask, span_real], axis=1)
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      tab = table[hi if table.shape[0] > 1 else 0]
      r = np.where(label[..., None] >= 0, tab[np.maximum(label, 0)], 0.0)  # [N, N, d]
      s = np.einsum("ad,abd->ab", q[bi, :, hi], k[bi, None, :, hi] + r) / np.sqrt(d)
      keep = adj & real[bi][None, :]
      s = np.where(keep, s, -np.inf)
      mx = np.where(keep.any(1, keepdims=True), s.max(1, keepdims=True), 0.0)
      w = np.where(keep, np.exp(s - mx), 0.0)
      w = w / np.maximum(w.sum(1, keepdims=True), 1e-300)
      out[bi, :, hi] = w @ v[bi, :, hi]
  return out if graph else out[:, :length]


def _tables(rng, heads, rows, kctx, d):
  sh = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)  # noqa: E731
  return {"rel_self": sh(heads, d), "rel_left": sh(heads, rows, kctx, d),
          "rel_right": sh(heads, rows, kctx, d), "rel_anc": sh(heads, rows, d)}


def _stack(t, causal):
  right = jnp.zeros_like(t["rel_right"]) if causal else t["rel_right"]
  h, rows, kctx, d = t["rel_left"].shape
  return np.concatenate([np.asarray(t["rel_self"])[:, None], np.asarray(t["rel_left"]).reshape(h, -1, d),
                         np.asarray(right).reshape(h, -1, d), np.asarray(t["rel_anc"])], axis=1)


# Fast: odd lengths (padding) in both directions, with and without span-node states, and k = 9 (each level's
# nodes as overlapping windows) over several windows per level; the rest (k = 9 causal, a power of two, k = 1
# and 3, one level row shared by every level, a single token) repeat them with -m slow (a compile each).
FAST = {(13, 2, 3, False, True), (13, 2, 3, True, True), (11, 3, 1, True, False), (40, 9, 2, False, True)}
CASES = [pytest.param(*c, marks=() if c in FAST else pytest.mark.slow)
         for c in [(13, 2, 3, False, True), (13, 2, 3, True, True), (11, 3, 1, True, False),
                   (40, 9, 2, False, True), (57, 9, 6, True, False), (40, 4, 2, False, True),
                   (13, 2, 3, False, False), (8, 1, 4, False, True), (8, 1, 4, True, False),
                   (5, 3, 1, False, True), (5, 3, 1, True, True), (1, 2, 2, False, True),
                   (1, 2, 2, True, False)]]


@pytest.fixture
def x64():
  """float64 for this test only (a global switch would leak into every later test of the worker)."""
  with jax.enable_x64(True):
    yield


@pytest.mark.parametrize("length,kctx,rows,causal,graph", CASES)
def test_op_equals_its_graph_definition(length, kctx, rows, causal, graph, x64):
  """Masked keys and values hold NaN in the op's input (the definition reads clean ones): they stay inert."""
  rng = np.random.default_rng(length * 10 + kctx + 2 * causal + graph)
  b, h, d, dv = 2, 2, 4, 3
  nodes = length + num_span_nodes(length) if graph else length
  q, k = (jnp.asarray(rng.normal(size=(b, nodes, h, d))) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(b, nodes, h, dv)))
  mask = rng.random((b, nodes)) < 0.75
  mask[:, 0] = True
  tables = _tables(rng, h, rows, kctx, d)
  op = jax.jit(lambda q, k, v, m, t: bp_transformer(q, k, v, causal=causal, mask=m, context=kctx, graph=graph,
                                                     **t))
  poisoned = jnp.asarray(~mask)[:, :, None, None]
  got = op(q, jnp.where(poisoned, jnp.nan, k), jnp.where(poisoned, jnp.nan, v), jnp.asarray(mask), tables)
  want = _reference(q, k, v, mask, kctx, causal, _stack(tables, causal), graph)
  # Masked query rows are don't-care.
  np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=1e-9, atol=1e-9)


def test_causal_outputs_read_no_future_token_or_unfinished_span(x64):
  """Jacobian of the tokens' outputs in the causal graph form: zero to every later token and to every span
  node whose span reaches the token (L = 6: padding up to n = 8)."""
  length, kctx = 6, 1
  n = tree_size(length)
  nodes = length + n - 1
  rng = np.random.default_rng(5)
  q, k = (jnp.asarray(rng.normal(size=(1, nodes, 1, 4))) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(1, nodes, 1, 2)))
  tables = _tables(rng, 1, 2, kctx, 4)
  fn = lambda q, k, v: bp_transformer(q, k, v, causal=True, context=kctx, graph=True, **tables)  # noqa: E731
  jac = jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(q, k, v)  # each [1, N, 1, dv, 1, N, 1, d]
  adj, _, spans = _graph(length, kctx, True, 2)
  last = np.array(list(range(length)) + [((j + 1) << lv) - 1 for lv, j in spans])  # a node's last token
  forbidden = last[None, :] >= np.arange(length)[:, None]  # [token row, node column]
  np.fill_diagonal(forbidden, False)  # a token reads its own q, k, v
  seen = sum(np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7)) for j in jac)[:length]  # [L, N]
  assert np.all(seen[forbidden] == 0.0)
  np.testing.assert_array_equal(seen > 0, adj[:length])  # exactly the definition's edges


def test_graph_bookkeeping_and_bad_arguments():
  assert [tree_size(x) for x in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, 16]
  assert all(tokens_in_graph(x + num_span_nodes(x)) == x for x in range(1, 70))
  assert tokens_in_graph(2) is None  # L = 2 has 3 nodes, L = 1 has 1
  q = jnp.zeros((1, 5, 1, 4))
  with pytest.raises(ValueError, match="graph=True"):
    bp_transformer(q, q, q, causal=False, graph=True)
  with pytest.raises(ValueError, match="context"):
    bp_transformer(q, q, q, causal=False, context=0)
  with pytest.raises(ValueError, match="rel_left"):
    bp_transformer(q, q, q, causal=False, context=2, rel_left=jnp.zeros((1, 3, 1, 4)))


def test_contextual_nodes_cover_the_context_exactly_once():
  """L = 1..67, k = 1, 2, 4, causal and bidirectional: each token's self edge and contextual nodes cover every
  other token (every earlier one when causal) exactly once, in the op's own table (`token_neighbours`, the
  cached decoder's) and in the definition's walk, which agree slot by slot."""
  for length in range(1, 68):
    n = tree_size(length)
    for k in (1, 2, 4):
      for causal in (True, False):
        index, valid, kind, level, rank = token_neighbours(n, k, causal)
        first, last = _node_ranges(n)
        for i in range(length):
          cover = np.zeros(n, int)
          for b in index[i][valid[i]]:
            cover[first[b]:last[b]] += 1
          want = np.arange(n) <= i if causal else np.ones(n, bool)
          assert np.array_equal(cover[:length], want[:length].astype(int)), (length, k, causal, i)
          side_of = {"left": 1, "right": 2}
          walked = {(side_of[side], lvl, m, _node_id(n, nl, j))
                    for side, lvl, m, nl, j in contextual_nodes(length, k, i, causal)}
          table = {(int(kind[i, s]), int(level[i, s]), int(rank[i, s]), int(index[i, s]))
                   for s in range(1, index.shape[1]) if valid[i, s]}
          assert table == walked, (length, k, causal, i)


def _node_id(n, level, j):
  return j if level == 0 else n + span_offset(n, level) + j


def _node_ranges(n):
  """The token range [first, last) of each of the 2n nodes (tokens, span nodes, the zero node)."""
  first, last = list(range(n)), list(range(1, n + 1))
  for lvl in range(1, n.bit_length()):
    first += [j << lvl for j in range(n >> lvl)]
    last += [(j + 1) << lvl for j in range(n >> lvl)]
  return np.array(first + [0]), np.array(last + [0])


@pytest.mark.parametrize("causal,hot,token,want", [(False, 2, 1, 0.25), (True, 1, 2, 1 / 3)])
def test_uniform_weights_count_every_token_once(causal, hot, token, want):
  """L = 4, k = 1, span nodes as their tokens' means, q = 0 (uniform weights over a token's edges), v one-hot
  at token `hot`: token 1 reads tokens 0-3 once each (bidirectional: 1/4), token 2 reads tokens 0-2 once
  (causal: 1/3); an overlapping graph (a span node over tokens already read) gives 0.375 and 0.5."""
  q = jnp.zeros((1, 4, 1, 2))
  v = jnp.zeros((1, 4, 1, 1)).at[0, hot].set(1.0)
  out = bp_transformer(q, jax.random.normal(jax.random.key(0), (1, 4, 1, 2)), v, causal=causal, context=1)
  np.testing.assert_allclose(float(out[0, token, 0, 0]), want, rtol=1e-6)


def test_level_windows_hold_exactly_the_tables_edges():
  """n = 1..256, k = 1..9 and 64: the op's blocked windows of each level (valid entries, read as token, slot m
  and node) and the finer slot 0 hold exactly the left edges of `token_neighbours`, each once."""
  for n in (1, 2, 4, 8, 16, 32, 64, 256):
    for k in (*range(1, 10), 64):
      index, valid, kind, level, rank = token_neighbours(n, k, True)
      want = sorted((i, int(level[i, s]), int(rank[i, s]), int(index[i, s]))
                    for i in range(n) for s in range(1, index.shape[1]) if valid[i, s])
      got = []
      for lvl in range(n.bit_length() - 1):
        band = _band(n, k, lvl)
        rows, cols = np.nonzero(band.valid)
        node = band.start + (rows // band.rows) * band.anchors * band.banded + cols
        m = (rows // band.per) % band.anchors - cols + band.shift
        got += [(int(r) - band.front, lvl, int(mm), _node_id(n, lvl, int(j)))
                for r, mm, j in zip(rows, m, node, strict=True)]
        if lvl:
          c = k * ((1 << lvl) - 1) + 1
          for i in range(n):
            g = (i - c) >> (lvl - 1)
            if g % 2 == 0 and 0 <= g < n >> (lvl - 1):
              got.append((i, lvl, 0, _node_id(n, lvl - 1, g)))
      assert sorted(got) == want, (n, k)


def test_later_nonfinite_values_stay_out_of_the_windows_outputs():
  """k = 9, causal (each level's nodes as windows that also hold later nodes): NaN and Inf in the values of
  the second half change no output of the first half, and a token's own non-finite value still shows."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 48, 2, 4)), jnp.float32) for _ in range(3))
  op = jax.jit(lambda v: bp_transformer(q, k, v, causal=True, context=9))
  clean = np.asarray(op(v))
  for bad in (jnp.nan, jnp.inf):
    out = np.asarray(op(v.at[:, 24:].set(bad)))
    np.testing.assert_allclose(out[:, :24], clean[:, :24], rtol=1e-6, atol=1e-6)
    assert np.isnan(np.asarray(op(v.at[:, 30].set(bad)))[:, 30]).all()
