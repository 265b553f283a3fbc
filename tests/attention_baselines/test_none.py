"""The "none" attention (no token mixing) outputs zeros of the value's shape and dtype."""

import jax.numpy as jnp
import numpy as np

from attention_baselines.none import none
from tests.attention_baselines.definitions import inputs


def test_none_is_zero():
  q, k, v, mask = inputs(0, dtype=jnp.float32)
  out = none(q, k, v, causal=True, mask=mask)
  assert out.shape == v.shape and out.dtype == v.dtype and not np.any(np.asarray(out))
