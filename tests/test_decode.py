"""Cached decoding equals the causal forward pass: op by op, and for whole models (logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ops_registry

# (op name, plan parameters): lengths below cross block and row boundaries (block/row 4, ragged last one).
OP_CASES = [
    ("dense", {}),
    ("combiner_fixed", {"block_size": 4}),
    ("combiner_fixed", {"block_size": 4, "pooling": "mean"}),
    ("combiner_axial_rowmajor", {"row_length": 4}),
    ("combiner_axial_vertical", {"row_length": 4}),
    ("combiner_axial_horizontal", {"row_length": 4, "pooling": "mean"}),
    ("combiner_logsparse", {}),
    ("combiner_logsparse", {"pooling": "mean"}),
    ("combiner_mixture", {"row_length": 4}),
    ("combiner_mixture_joint", {"row_length": 3}),
    ("sparse_fixed", {"block_size": 4}),
    ("sparse_axial", {"row_length": 4}),
    ("sparse_logsparse", {}),
]


def _qkv(seed: int, batch: int, length: int, heads: int, dim: int, pooled: bool = False):
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (batch, length, heads, dim)
  q, k, v, pq, pk = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)
  return (q, k, v, pq, pk) if pooled else (q, k, v)


def _decode_all(spec, params, q, k, v, prompt: int = 0, pool_q=None, pool_k=None, **extra):
  """Prefill the first `prompt` positions, then step through the rest (one compiled scan); the stepped outputs."""
  batch, length, heads, dim = q.shape
  dec = spec.decode
  pooled = {} if pool_q is None else {"pool_q": pool_q, "pool_k": pool_k}

  @jax.jit
  def run(q, k, v, pooled):
    cache = dec.init_cache(batch, heads, length, dim, v.shape[-1], q.dtype, **params)
    if prompt:
      head = {name: x[:, :prompt] for name, x in pooled.items()}
      cache = dec.prefill(cache, q[:, :prompt], k[:, :prompt], v[:, :prompt], **head, **params, **extra)

    def body(cache, t):
      at = lambda x: jax.lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)
      out, cache = dec.step(cache, at(q), at(k), at(v), t, **{n: at(x) for n, x in pooled.items()}, **params,
                            **extra)
      return cache, out

    _, outs = jax.lax.scan(body, cache, jnp.arange(prompt, length))
    return jnp.swapaxes(outs, 0, 1)  # [batch, length - prompt, heads, value_dim]

  return run(q, k, v, pooled)


@pytest.mark.parametrize("name,params", OP_CASES, ids=[f"{n}-{p}" for n, p in OP_CASES])
def test_op_step_equals_forward(name, params):
  spec = ops_registry.get(name)
  length = 19  # ragged: not a multiple of 4 or 3, > 16 so logsparse has 5 levels
  q, k, v = _qkv(0, 2, length, 2, 8)
  full = spec.fn(q, k, v, causal=True, **params)
  stepped = _decode_all(spec, params, q, k, v, prompt=6)
  np.testing.assert_allclose(stepped, full[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,params", [("combiner_fixed", {"block_size": 4}),
                                         ("combiner_axial_rowmajor", {"row_length": 4}),
                                         ("combiner_mixture", {"row_length": 4, "pooling": "mean"})])
def test_op_step_equals_forward_with_pooled_inputs(name, params):
  """DeepSets-style pool_q / pool_k (and the learned span key for rowmajor) reach the cached summaries."""
  spec = ops_registry.get(name)
  q, k, v, pq, pk = _qkv(1, 1, 13, 2, 8, pooled=True)
  extra = {}
  if name == "combiner_axial_rowmajor":
    w = jax.random.normal(jax.random.key(3), (8, 8))
    extra["span_key_fn"] = lambda s: jnp.tanh(s @ w)  # [batch, rows, heads, head_dim]
  full = spec.fn(q, k, v, causal=True, pool_q=pq, pool_k=pk, **params, **extra)
  stepped = _decode_all(spec, params, q, k, v, prompt=5, pool_q=pq, pool_k=pk, **extra)
  np.testing.assert_allclose(stepped, full[:, 5:], rtol=1e-5, atol=1e-5)


def test_op_without_decoder_names_it():
  from models.attention import check_decodable

  with pytest.raises(ValueError, match="yoso"):
    check_decodable(ops_registry.get("yoso"))
