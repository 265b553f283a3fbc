"""NSA against its definition (docs/design.md section 5, "NSA and MoBA"), written with explicit loops in numpy
float64: the compressed blocks and their MLP, the paper's eq. 9 block scores, the forced and top-n blocks, the
window and the gates; gradients against finite differences; causality through the Jacobian (no future block is
ever selected, no compressed block holds a future token); masked keys holding NaN; argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from attention_baselines.nsa import nsa
from tests.attention_baselines.definitions import assert_masked_nonfinite_inert, inputs

# Selection blocks of 2: 7 blocks at length 13-14, so a query past the third block has more than the forced
# three to choose from and the fourth is chosen by score.
PLAN = dict(compress_block=4, compress_stride=2, select_block=2, num_selected=4, window=3)


def _softmax_out(logits, values):
  """Softmax of a list of logits over their values (zeros when empty)."""
  if not logits:
    return np.zeros(values.shape[-1] if values.ndim > 1 else 0)
  s = np.asarray(logits)
  w = np.exp(s - s.max())
  return (w / w.sum()) @ values


def mlp_weights(seed, heads, size, dim, hidden=5):
  g = np.random.default_rng(seed)
  return (g.normal(size=(heads, size, dim)), g.normal(size=(heads, size * dim, hidden)) / 3,
          g.normal(size=(heads, hidden)), g.normal(size=(heads, hidden, dim)) / 2)


def reference(q, k, v, mask, *, compress_block, compress_stride, select_block, num_selected, window,
              gates=None, key_mlp=None, value_mlp=None):
  q, k, v, mask = (np.asarray(x, np.float64) for x in (q, k, v, mask))
  mask = mask.astype(bool)
  b_, n, h_, d = q.shape
  ll, s, sel = compress_block, compress_stride, select_block
  out = np.zeros(v.shape)
  for b in range(b_):
    for h in range(h_):
      real = mask[b]

      def phi(x, mlp, c, real=real, h=h):
        pos = range(c * s, c * s + ll)
        if mlp is None:
          rows = [x[p] for p in pos if real[p]]
          return np.mean(rows, axis=0)
        pe, w1, b1, w2 = (a[h] for a in mlp)
        flat = np.concatenate([x[p] + pe[t] if real[p] else np.zeros(x.shape[1]) for t, p in enumerate(pos)])
        return np.maximum(flat @ w1 + b1, 0.0) @ w2

      blocks = [c for c in range(n) if c * s + ll <= n and real[c * s:c * s + ll].any()]
      ck = {c: phi(k[b, :, h], key_mlp, c) for c in blocks}
      cv = {c: phi(v[b, :, h], value_mlp, c) for c in blocks}
      for i in range(n):
        qi = q[b, i, h] / np.sqrt(d)
        vis = [c for c in blocks if c * s + ll - 1 <= i]
        if vis:
          s_c = np.array([qi @ ck[c] for c in vis])
          p = np.exp(s_c - s_c.max())
          p /= p.sum()
          o_cmp = sum(pc * cv[c] for pc, c in zip(p, vis, strict=True))
        else:
          p, o_cmp = [], np.zeros(v.shape[-1])
        own = i // sel
        score = {}
        for blk in range(own + 1):
          chunks = set(range(blk * sel // s, (blk + 1) * sel // s))
          score[blk] = sum(pc * len(chunks & set(range(c, c + ll // s)))
                           for pc, c in zip(p, vis, strict=True))
        prio = {blk: 3 if blk == own else 2 if blk == own - 1 else 1 if blk == 0 else 0 for blk in score}
        chosen = sorted(score, key=lambda blk: (-prio[blk], -score[blk], blk))[:num_selected]
        sel_keys = [j for blk in chosen for j in range(blk * sel, min((blk + 1) * sel, n))
                    if j <= i and real[j]]
        win_keys = [j for j in range(max(0, i - window + 1), i + 1) if real[j]]
        outs = [o_cmp]
        for keys in (sel_keys, win_keys):
          outs.append(_softmax_out([qi @ k[b, j, h] for j in keys], v[b, keys, h]) if keys
                      else np.zeros(v.shape[-1]))
        g = np.full(3, 1 / 3) if gates is None else np.asarray(gates)[b, i, h]
        out[b, i, h] = sum(gc * o for gc, o in zip(g, outs, strict=True))
  return out


def _mlps(heads, head_dim, value_dim, size=4):
  key_mlp = mlp_weights(1, heads, size, head_dim)
  value_mlp = mlp_weights(2, heads, size, value_dim)
  names = ("pos", "w1", "b1", "w2")
  kwargs = {f"cmp_key_{n}": jnp.asarray(a) for n, a in zip(names, key_mlp, strict=True)}
  kwargs.update({f"cmp_value_{n}": jnp.asarray(a) for n, a in zip(names, value_mlp, strict=True)})
  return key_mlp, value_mlp, kwargs


def test_matches_the_definition_with_mlps_and_gates():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(3, length=13)
    gates = jax.random.uniform(jax.random.key(5), (*q.shape[:3], 3), jnp.float64)
    key_mlp, value_mlp, kwargs = _mlps(2, 4, 3)
    got = jax.jit(lambda q, k, v, m, g: nsa(q, k, v, causal=True, mask=m, gates=g, **PLAN, **kwargs))(
        q, k, v, mask, gates)
    want = reference(q, k, v, mask, **PLAN, gates=gates, key_mlp=key_mlp, value_mlp=value_mlp)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# The second plan (non-overlapping compressed blocks, one selected block, window 1) runs with -m slow.
@pytest.mark.parametrize("plan", [PLAN, pytest.param(dict(compress_block=4, compress_stride=4, select_block=8,
                                                          num_selected=3, window=1), marks=pytest.mark.slow)])
def test_matches_the_definition_with_mean_pooling(plan):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(4, length=14)
    got = jax.jit(lambda q, k, v, m: nsa(q, k, v, causal=True, mask=m, **plan))(q, k, v, mask)
    np.testing.assert_allclose(got, reference(q, k, v, mask, **plan), rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # two compilations of the op
def test_query_chunks_give_the_same_result():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(6, length=11)
    run = jax.jit(lambda q, k, v, m, c: nsa(q, k, v, causal=True, mask=m, **PLAN, query_chunks=c),
                  static_argnums=4)
    np.testing.assert_allclose(run(q, k, v, mask, 3), run(q, k, v, mask, 1), rtol=1e-12, atol=1e-13)


@pytest.mark.slow  # finite differences over every input: the slowest check here
def test_gradients_match_finite_differences():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(7, batch=1, length=9, heads=1)
    gates = jax.random.uniform(jax.random.key(8), (*q.shape[:3], 3), jnp.float64)
    _, _, kwargs = _mlps(1, 4, 3)
    fn = jax.jit(lambda q, k, v, g, w: nsa(q, k, v, causal=True, mask=mask, gates=g, **PLAN, **w))
    check_grads(fn, (q, k, v, gates, kwargs), order=1, modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)


def test_no_output_depends_on_the_future():
  """d out[i] / d (q, k, v)[j] = 0 for j > i: no future block is selected, no compressed block that holds a
  future token is seen, the window ends at i."""
  with jax.enable_x64(True):
    q, k, v, mask = inputs(9, batch=1, length=12)
    _, _, kwargs = _mlps(2, 4, 3)
    fn = lambda q, k, v: nsa(q, k, v, causal=True, mask=mask, **PLAN, **kwargs)  # noqa: E731
    jac = jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(q, k, v)
    future = np.triu(np.ones((12, 12), bool), 1)
    for j in jac:  # [B, L, H, E, B, L, H, D]
      block = np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7))
      assert np.all(block[future] == 0.0)
    dk = np.abs(np.asarray(jac[1])).sum(axis=(0, 2, 3, 4, 6, 7))
    assert dk[11, 0] > 0  # the first block (selected, compressed) reaches the last query


# The every-op sweep (tests/attention_core/test_masked_nonfinite.py) checks the outputs fast; gradients here.
@pytest.mark.slow
def test_masked_keys_holding_nan_change_nothing_and_get_no_gradient():
  q, k, v, mask = inputs(10, length=12, dtype=jnp.float32)
  _, _, kwargs = _mlps(2, 4, 3)
  fn = jax.jit(lambda k, v: nsa(q, k, v, causal=True, mask=mask, **PLAN, **kwargs))
  assert_masked_nonfinite_inert(fn, k, v, mask)


def test_bad_arguments_name_the_argument():
  q, k, v, _ = inputs(0, length=8, dtype=jnp.float32)
  with pytest.raises(ValueError, match="'causal'"):
    nsa(q, k, v, causal=False)
  with pytest.raises(ValueError, match="'compress_stride'"):
    nsa(q, k, v, causal=True, compress_block=4, compress_stride=3, select_block=6)
  for n in (0, 2, 3.0):  # fewer than the three forced blocks, or not an int
    with pytest.raises(ValueError, match="'num_selected' must be an int >= 3"):
      nsa(q, k, v, causal=True, num_selected=n)
  with pytest.raises(ValueError, match="'gates'"):
    nsa(q, k, v, causal=True, gates=jnp.ones((2, 8, 2, 2)))
  _, _, kwargs = _mlps(2, 4, 3)
  with pytest.raises(ValueError, match="'cmp_key_b1'"):
    nsa(q, k, v, causal=True, **PLAN, **dict(kwargs, cmp_key_b1=None))
  with pytest.raises(ValueError, match="'cmp_value_w1'"):
    nsa(q, k, v, causal=True, **PLAN, **dict(kwargs, cmp_value_w1=jnp.ones((2, 5, 5))))
