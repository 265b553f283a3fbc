"""The row-wise baselines run their rows of batch x heads in sequential blocks
(`attention_baselines.common.map_row_blocks`): any number of chunks (blocks of whole batches, of heads,
single rows) gives the one-piece outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines import common
from attention_baselines.bigbird import bigbird
from attention_baselines.linear import linear
from attention_baselines.local import local
from attention_baselines.longformer import longformer
from attention_baselines.performer import performer
from attention_baselines.reformer import reformer

OPS = {
    "linear": lambda q, k, v, **kw: linear(q, k, v, chunk_size=4, **kw),
    "performer": lambda q, k, v, **kw: performer(q, k, v, rng=jax.random.key(1), num_features=8, chunk_size=4,
                                                 **kw),
    "local": lambda q, k, v, **kw: local(q, k, v, block_size=4, **kw),
    "longformer": lambda q, k, v, **kw: longformer(q, k, v, window=3, global_positions=(0, 7), **kw),
    "bigbird": lambda q, k, v, **kw: bigbird(q, k, v, block_size=2, num_random_blocks=2, seed=3, **kw),
    "reformer": lambda q, k, v, **kw: reformer(q, k, v, rng=jax.random.key(2), chunk_size=4, **kw),
}


# One case runs with the fast tests, every op and direction with the slow ones.
FAST = {("performer", False)}
CASES = [pytest.param(name, causal, marks=() if (name, causal) in FAST else pytest.mark.slow)
         for name in sorted(OPS) for causal in (True, False)]


@pytest.mark.parametrize("name,causal", CASES)
def test_row_chunks_equal_one_piece(name, causal):
  with jax.enable_x64(True):
    _check_row_chunks(name, causal)


def _check_row_chunks(name, causal):
  ks = jax.random.split(jax.random.key(0), 5)
  q, k = (jax.random.normal(kk, (2, 13, 5, 4), jnp.float64) for kk in ks[:2])
  v = jax.random.normal(ks[2], (2, 13, 5, 5), jnp.float64)
  cot = jax.random.normal(ks[3], v.shape, jnp.float64)
  mask = jax.random.bernoulli(ks[4], 0.8, (2, 13)).at[:, 0].set(True)
  op = OPS[name]

  def run(chunks):
    def loss(q, k, v):
      return jnp.sum(op(q, k, v, causal=causal, mask=mask, row_chunks=chunks) * cot)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  (want, want_grads) = run(1)
  for chunks in (2, 10):  # 2 batches x 5 heads: one batch per block, and one row per block
    got, grads = run(chunks)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)


def test_row_chunk_count():
  assert common.num_row_chunks(8, 8192, None, op="t") == 8  # one row of 8192 positions per chunk
  assert common.num_row_chunks(64, 1024, None, op="t") == 8  # 8 rows of 1024
  assert common.num_row_chunks(3, 100, None, op="t") == 1
  assert common.num_row_chunks(3, 100, 5, op="t") == 3  # at most one chunk per row
  with pytest.raises(ValueError, match="row_chunks"):
    common.num_row_chunks(3, 100, 0, op="t")
