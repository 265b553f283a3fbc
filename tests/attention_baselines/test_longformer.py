"""Longformer (sliding window plus global positions) against its definition in float64, its limiting case
and its argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.dense import dense
from attention_baselines.longformer import longformer
from tests.attention_baselines.definitions import (
  causal_tril,
  inputs,
  masked_softmax,
)


def _longformer_allowed(length, window, glob, causal):
  pos = np.arange(length)
  allowed = np.abs(pos[:, None] - pos[None, :]) <= window
  glob = np.asarray([g % length for g in glob], int)
  allowed[:, glob] = True
  allowed[glob, :] = True
  if causal:
    allowed &= causal_tril(length)
  return allowed


# The causal cases with several global positions are the slowest: they run with the slow tests.
@pytest.mark.parametrize("length,window,glob,causal", [
    pytest.param(*case, causal, id=f"{case[0]}-{case[1]}-glob{i}-{causal}",
                 marks=pytest.mark.slow if causal and i in (1, 3) else ())
    for i, case in enumerate([(11, 2, (0,)), (13, 3, (0, 5, -1)), (9, 1, ()), (10, 4, (3, 7))])
    for causal in (True, False)])
def test_longformer_matches_definition(causal, length, window, glob):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(length * window, length=length)
    out = longformer(q, k, v, causal=causal, mask=mask, window=window, global_positions=glob)
    ref = masked_softmax(q, k, v, _longformer_allowed(length, window, glob, causal), mask)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [10, 50])
def test_longformer_with_a_window_covering_everything_is_dense(causal, window):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(window, length=10)
    out = longformer(q, k, v, causal=causal, mask=mask, window=window, global_positions=(0, 4))
    np.testing.assert_allclose(out, dense(q, k, v, causal=causal, mask=mask), rtol=1e-10, atol=1e-12)


def test_longformer_rejects_bad_arguments():
  q, k, v, _ = inputs(0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="window"):
    longformer(q, k, v, causal=True, window=0)
  with pytest.raises(ValueError, match="global_positions"):
    longformer(q, k, v, causal=True, global_positions=(11,))
  with pytest.raises(ValueError, match="global_positions"):
    longformer(q, k, v, causal=True, global_positions=("a",))
