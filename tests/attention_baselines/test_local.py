"""Local (blockwise) attention against its definition in float64."""

import jax
import numpy as np
import pytest

from attention_baselines.dense import dense
from attention_baselines.local import local
from tests.attention_baselines.definitions import causal_tril, inputs, masked_softmax


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,block", [(11, 4), (12, 3), (5, 8)])
def test_local_matches_definition(causal, length, block):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(length + block, length=length)
    pos = np.arange(length)
    allowed = (pos[:, None] // block) == (pos[None, :] // block)
    if causal:
      allowed &= causal_tril(length)
    out = local(q, k, v, causal=causal, mask=mask, block_size=block)
    np.testing.assert_allclose(out, masked_softmax(q, k, v, allowed, mask), rtol=1e-10, atol=1e-12)
    if block >= length:
      np.testing.assert_allclose(out, dense(q, k, v, causal=causal, mask=mask), rtol=1e-10, atol=1e-12)
