"""MoBA against its definition (docs/design.md section 5, "NSA and MoBA"), written with explicit loops in
numpy float64, causal and bidirectional; the attention weights read through one-hot values; gradients
against finite differences; causality through the Jacobian (no future block is ever chosen); masked keys
holding NaN; argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from attention_baselines.moba import moba
from tests.attention_baselines.definitions import assert_masked_nonfinite_inert, inputs


def reference(q, k, v, mask, *, causal, block_size, top_k):
  q, k, v, mask = (np.asarray(x, np.float64) for x in (q, k, v, mask))
  mask = mask.astype(bool)
  b_, n, h_, d = q.shape
  nb = -(-n // block_size)
  out = np.zeros(v.shape)
  for b in range(b_):
    for h in range(h_):
      real = mask[b]
      members = [[j for j in range(blk * block_size, min((blk + 1) * block_size, n)) if real[j]]
                 for blk in range(nb)]
      kbar = {blk: np.mean(k[b, m, h], axis=0) for blk, m in enumerate(members) if m}
      for i in range(n):
        qi = q[b, i, h] / np.sqrt(d)
        own = i // block_size
        others = [blk for blk in kbar if blk != own and (blk < own or not causal)]
        others.sort(key=lambda blk: (-(qi @ kbar[blk]), blk))
        chosen = [own] + others[:top_k - 1]
        keys = [j for blk in chosen for j in members[blk] if j <= i or not causal]
        if not keys:  # its own block masked up to i, and nothing else chosen
          continue
        s = np.array([qi @ k[b, j, h] for j in keys])
        w = np.exp(s - s.max())
        out[b, i, h] = (w / w.sum()) @ v[b, keys, h]
  return out


# The last two (a single block per query; more blocks than fit) run with -m slow.
CASES = [(True, 3, 2), (False, 3, 2), pytest.param(True, 4, 1, marks=pytest.mark.slow),
         pytest.param(False, 2, 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("causal,block_size,top_k", CASES)
def test_matches_the_definition(causal, block_size, top_k):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(3 + block_size, length=13)
    got = jax.jit(lambda q, k, v, m: moba(q, k, v, causal=causal, mask=m, block_size=block_size,
                                          top_k=top_k))(q, k, v, mask)
    want = reference(q, k, v, mask, causal=causal, block_size=block_size, top_k=top_k)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_one_hot_values_read_rows_over_own_block_and_top_k(causal):
  """v = I: output row i is query i's attention row; it sums to one and covers at most top_k blocks, its own
  among them (causal: none after i)."""
  with jax.enable_x64(True):
    n, size, top_k = 12, 3, 2
    q, k, _, _ = inputs(11, batch=1, length=n, heads=1)
    v = jnp.eye(n, dtype=jnp.float64)[None, :, None, :]
    rows = np.asarray(jax.jit(lambda q, k, v: moba(q, k, v, causal=causal, block_size=size, top_k=top_k))(
        q, k, v))[0, :, 0]  # [query, key]
    np.testing.assert_allclose(rows.sum(-1), 1.0, rtol=1e-12)
    for i in range(n):
      blocks = {j // size for j in np.flatnonzero(rows[i] > 0)}
      assert i // size in blocks and len(blocks) <= top_k
      if causal:
        assert not np.any(rows[i, i + 1:])
        assert np.all(rows[i, i // size * size:i + 1] > 0)
      else:
        assert np.all(rows[i, i // size * size:(i // size + 1) * size] > 0)


@pytest.mark.slow  # the finite differences of two directions: ~10 s on a loaded 2-core machine
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_finite_differences(causal):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(7, batch=1, length=9, heads=1)
    fn = jax.jit(lambda q, k, v: moba(q, k, v, causal=causal, mask=mask, block_size=2, top_k=2))
    check_grads(fn, (q, k, v), order=1, modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)


def test_no_output_depends_on_the_future():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(9, batch=1, length=12)
    fn = lambda q, k, v: moba(q, k, v, causal=True, mask=mask, block_size=3, top_k=2)  # noqa: E731
    jac = jax.jit(jax.jacrev(fn, argnums=(0, 1, 2)))(q, k, v)
    future = np.triu(np.ones((12, 12), bool), 1)
    for j in jac:  # [B, L, H, E, B, L, H, D]
      block = np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7))
      assert np.all(block[future] == 0.0)


# The every-op sweep (tests/attention_core/test_masked_nonfinite.py) checks the outputs fast; gradients here.
@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_masked_keys_holding_nan_change_nothing_and_get_no_gradient(causal):
  q, k, v, mask = inputs(10, length=12, dtype=jnp.float32)
  fn = jax.jit(lambda k, v: moba(q, k, v, causal=causal, mask=mask, block_size=3, top_k=2))
  assert_masked_nonfinite_inert(fn, k, v, mask)


@pytest.mark.slow  # two compilations of the op
def test_query_chunks_give_the_same_result():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(6, length=11)
    run = jax.jit(lambda q, k, v, m, c: moba(q, k, v, causal=True, mask=m, block_size=3, top_k=2,
                                             query_chunks=c), static_argnums=4)
    np.testing.assert_allclose(run(q, k, v, mask, 4), run(q, k, v, mask, 1), rtol=1e-12, atol=1e-13)


def test_bad_arguments_name_the_argument():
  q, k, v, _ = inputs(0, length=8, dtype=jnp.float32)
  with pytest.raises(ValueError, match="'block_size'"):
    moba(q, k, v, causal=True, block_size=0)
  with pytest.raises(ValueError, match="'top_k'"):
    moba(q, k, v, causal=False, top_k=-1)
  with pytest.raises(ValueError, match="'query_chunks'"):
    moba(q, k, v, causal=False, query_chunks=0)
  with pytest.raises(ValueError, match="'mask'"):
    moba(q, k, v, causal=True, mask=jnp.ones((2, 7), bool))
