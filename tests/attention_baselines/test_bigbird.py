"""BigBird (ITC: window, global and random blocks): its block pattern, the op against its definition in
float64, its limiting case and its argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.bigbird import bigbird, block_pattern
from attention_baselines.dense import dense
from tests.attention_baselines.definitions import (
  causal_tril,
  inputs,
  masked_softmax,
)


def _bigbird_allowed(length, block, allowed_blocks):
  """Token-level pattern from the block pattern: i sees j iff block(i) sees block(j)."""
  blocks = np.arange(length) // block
  return allowed_blocks[blocks[:, None], blocks[None, :]]


def test_bigbird_block_pattern_follows_itc():
  n, r = 12, 2
  for causal in (True, False):
    allowed, is_global = block_pattern(n, causal=causal, global_blocks=(0, -1), num_random_blocks=r, seed=3)
    assert list(np.flatnonzero(is_global)) == [0, n - 1]
    for a in range(n):
      row = np.flatnonzero(allowed[a])
      if causal:
        assert row.max() <= a  # no block after its own
      if is_global[a]:
        assert len(row) == (a + 1 if causal else n)
        continue
      window = set(range(max(a - 1, 0), a + 1 if causal else min(a + 2, n)))
      glob = {0} | (set() if causal else {n - 1})
      rand = set(row) - window - glob
      assert window | glob <= set(row) | ({n - 1} if causal else set())
      candidates = set(range(a) if causal else range(n)) - window - glob
      assert len(rand) == min(r, len(candidates))
  # The pattern is a pure function of the seed.
  a1, _ = block_pattern(n, causal=False, global_blocks=(0,), num_random_blocks=r, seed=1)
  a2, _ = block_pattern(n, causal=False, global_blocks=(0,), num_random_blocks=r, seed=1)
  a3, _ = block_pattern(n, causal=False, global_blocks=(0,), num_random_blocks=r, seed=2)
  assert np.array_equal(a1, a2) and not np.array_equal(a1, a3)


# The longest sequence, and the causal case with the most random blocks, run with the slow tests.
@pytest.mark.parametrize("length,block,glob,r,causal", [
    pytest.param(*case, causal, id=f"{case[0]}-{case[1]}-glob{i}-{case[3]}-{causal}",
                 marks=pytest.mark.slow if i == 0 or (i == 2 and causal) else ())
    for i, case in enumerate([(22, 2, (0, -1), 2), (13, 3, (1,), 1), (16, 2, (), 3)])
    for causal in (True, False)])
def test_bigbird_matches_definition(causal, length, block, glob, r):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(length + r, length=length)
    out = bigbird(q, k, v, causal=causal, mask=mask, block_size=block, global_blocks=glob,
                  num_random_blocks=r, seed=4)
    allowed_blocks, _ = block_pattern(-(-length // block), causal=causal, global_blocks=glob,
                                      num_random_blocks=r, seed=4)
    allowed = _bigbird_allowed(length, block, allowed_blocks)
    if causal:
      allowed &= causal_tril(length)
    np.testing.assert_allclose(out, masked_softmax(q, k, v, allowed, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird_with_every_block_global_is_dense(causal):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(9, length=11)
    out = bigbird(q, k, v, causal=causal, mask=mask, block_size=3, global_blocks=(0, 1, 2, 3),
                  num_random_blocks=1)
    np.testing.assert_allclose(out, dense(q, k, v, causal=causal, mask=mask), rtol=1e-10, atol=1e-12)


def test_bigbird_rejects_bad_arguments():
  q, k, v, _ = inputs(0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="block_size"):
    bigbird(q, k, v, causal=True, block_size=0)
  with pytest.raises(ValueError, match="num_random_blocks"):
    bigbird(q, k, v, causal=True, num_random_blocks=-1)
  with pytest.raises(ValueError, match="global_blocks"):
    bigbird(q, k, v, causal=True, block_size=4, global_blocks=(3,))
