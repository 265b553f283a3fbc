"""The XLA paths of the grid plans run in chunks of query rows (`combiner.common.map_rows`): the chunked and
the one-piece programs compute the same attention and gradients, and chunking lowers the compiled program's
temporary memory."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import combiner
from combiner import common

# 13 positions on rows of 3: 5 rows, the last one ragged; 3 chunks of 2 rows pad the grid by one more row.
LENGTH, ROW, CHUNKS = 13, 3, 3
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _variants():
  out = []
  for causal in (True, False):
    for pooling in ("max", "mean"):
      for direction in ("rowmajor", "vertical", "horizontal"):
        op = functools.partial(combiner.axial, direction=direction, causal=causal, pooling=pooling)
        out.append((f"axial_{direction}", op))
      for normalize in ("mean", "joint"):
        out.append((f"mixture_{normalize}", functools.partial(combiner.mixture, normalize=normalize,
                                                              causal=causal, pooling=pooling)))
    out.append(("sparse_axial", functools.partial(combiner.sparse.axial, causal=causal)))
  # The span-key hook and the DeepSets pooling inputs are applied before the chunks.
  out.append(("axial_rowmajor_hook", functools.partial(combiner.axial, direction="rowmajor", causal=True,
                                                       span_key_fn=jnp.tanh)))
  out.append(("mixture_deepsets", lambda q, k, v, **kw: combiner.mixture(
      q, k, v, causal=True, pooling="mean", pool_q=jnp.sin(q), pool_k=jnp.cos(q), **kw)))
  return out


def _loss_and_grads(op, q, k, v, mask, ct, chunks):
  def loss(q, k, v):
    out = op(q, k, v, row_length=ROW, mask=mask, implementation="xla", query_chunks=chunks)
    return jnp.sum(out * ct), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


@pytest.mark.slow  # every direction and pooling in float64: the longest case here; CI runs the slow tests too
def test_chunked_rows_equal_one_piece():
  with jax.enable_x64(True):
    keys = jax.random.split(jax.random.key(7), 5)
    q, k = (jax.random.normal(kk, (2, LENGTH, 2, 3), jnp.float64) for kk in keys[:2])
    v = jax.random.normal(keys[2], (2, LENGTH, 2, 4), jnp.float64)  # value_dim != head_dim
    ct = jax.random.normal(keys[3], (2, LENGTH, 2, 4), jnp.float64)
    mask = jax.random.bernoulli(keys[4], 0.7, (2, LENGTH)).at[1, 3:6].set(False)  # one whole row masked
    hidden = ~mask[:, :, None, None]
    k, v = jnp.where(hidden, jnp.nan, k), jnp.where(hidden, jnp.inf, v)  # masked keys reach no output
    variants = _variants()

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(q, k, v, mask, ct):
      return [[_loss_and_grads(op, q, k, v, mask, ct, c) for c in (1, CHUNKS)] for _, op in variants]

    for (name, _), (one, chunked) in zip(variants, run(q, k, v, mask, ct), strict=True):
      for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(chunked), strict=True):
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12, err_msg=name)


def test_automatic_chunks_follow_the_byte_budget(monkeypatch):
  """With a budget of one grid row's logits every row is its own chunk; the result is unchanged."""
  q = jax.random.normal(jax.random.key(0), (1, LENGTH, 2, 3))
  op = functools.partial(combiner.axial, row_length=ROW, direction="vertical", causal=True,
                         implementation="xla")
  one = jax.jit(functools.partial(op, query_chunks=1))(q, q, q)
  assert common.row_chunks(5, 100, None, op="t") == 1
  monkeypatch.setattr(common, "QUERY_CHUNK_BYTES", 1)
  assert common.row_chunks(5, 100, None, op="t") == 5
  assert "while" in jax.jit(op).lower(q, q, q).as_text()
  np.testing.assert_allclose(jax.jit(op)(q, q, q), one, rtol=1e-6, atol=1e-6)


def test_chunks_lower_temp_memory():
  """Forward+backward of axial-vertical at L = 4096, rows of 64, head_dim 8 (the [L, sqrt(L)] logits outweigh
  the [L, head_dim] tensors): eight chunks keep under half the temporaries."""
  shape = jax.ShapeDtypeStruct((1, 4096, 2, 8), jnp.float32)

  def temp(chunks):
    def loss(q, k, v):
      return jnp.sum(combiner.axial(q, k, v, row_length=64, direction="vertical", causal=True,
                                    implementation="xla", query_chunks=chunks))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes

  assert temp(8) < 0.5 * temp(1)


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True])
def test_bad_query_chunks(chunks):
  q = jnp.zeros((1, 4, 1, 2))
  with pytest.raises(ValueError, match="query_chunks"):
    combiner.axial(q, q, q, row_length=2, direction="vertical", causal=True, query_chunks=chunks)
  with pytest.raises(ValueError, match="query_chunks"):
    combiner.mixture(q, q, q, row_length=2, causal=True, query_chunks=chunks)
