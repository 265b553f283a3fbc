"""BP-Transformer: the op against its graph written from the definition in float64 (an explicit [N, N]
adjacency over tokens and span nodes, dense masked softmax with the relative vectors), causal and
bidirectional, odd lengths (padding to a power of two), masks, span nodes as given states or as their tokens'
means; causality by Jacobian; the model with span nodes carried through its blocks, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.bp_transformer import bp_transformer, num_span_nodes, tokens_in_graph, tree_size


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
    for lvl in range(levels):
      size = 1 << lvl
      ranges = [(j, j * size, (j + 1) * size - 1) for j in range(n >> lvl)]
      left = sorted([r for r in ranges if r[2] < i], key=lambda r: -r[2])[:k]  # nearest first, not holding i
      right = sorted([r for r in ranges if r[1] > i], key=lambda r: r[1])[:k]
      for side, chosen in (("left", left), ("right", [] if causal else right)):
        for m, (j, _, _) in enumerate(chosen):
          b = node_of[(lvl, j)]
          if b is not None:
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


# Fast: odd lengths (padding) in both directions, with and without span-node states; the rest (a power of two,
# k = 1 and 3, one level row shared by every level, a single token) repeat them with -m slow (a compile each).
FAST = {(13, 2, 3, False, True), (13, 2, 3, True, True), (11, 3, 1, True, False)}
CASES = [pytest.param(*c, marks=() if c in FAST else pytest.mark.slow)
         for c in [(13, 2, 3, False, True), (13, 2, 3, True, True), (11, 3, 1, True, False),
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
