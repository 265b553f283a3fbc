"""Cached decoding equals the causal forward pass, op by op: each registration's decoder (prefill, then one
step per token) against its op (whole models: tests/models/test_generate.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core import registry as ops_registry

# (op name, plan parameters): lengths below cross block and row boundaries (block/row 4, ragged last one).
# The Combiner cases marked slow are the most expensive to compile (logsparse's levels, the joint mixture) or
# repeat a plan that test_op_step_equals_forward_with_pooled_inputs runs fast (fixed); they run with -m slow.
_SLOW = pytest.mark.slow
OP_CASES = [
    ("dense", {}),
    pytest.param("combiner_fixed", {"block_size": 4}, marks=_SLOW),
    pytest.param("combiner_fixed", {"block_size": 4, "pooling": "mean"}, marks=_SLOW),
    ("combiner_axial_rowmajor", {"row_length": 4}),
    ("combiner_axial_vertical", {"row_length": 4}),
    ("combiner_axial_horizontal", {"row_length": 4, "pooling": "mean"}),
    pytest.param("combiner_logsparse", {}, marks=_SLOW),
    pytest.param("combiner_logsparse", {"pooling": "mean"}, marks=_SLOW),
    ("combiner_mixture", {"row_length": 4}),
    pytest.param("combiner_mixture_joint", {"row_length": 3}, marks=_SLOW),
    ("sparse_fixed", {"block_size": 4}),
    ("sparse_axial", {"row_length": 4}),
    pytest.param("sparse_logsparse", {}, marks=_SLOW),
    ("linear", {"chunk_size": 4}),
    ("performer", {"rng": jax.random.key(1), "num_features": 16, "chunk_size": 4}),
    ("local", {"block_size": 4}),
    pytest.param("local", {"block_size": 32}, marks=_SLOW),
    ("longformer", {"window": 3, "global_positions": (0, 7, -2)}),
    pytest.param("longformer", {"window": 4, "global_positions": ()}, marks=_SLOW),
    ("bigbird", {"block_size": 3, "global_blocks": (0, -2), "num_random_blocks": 2, "seed": 3}),
    ("moba", {"block_size": 3, "top_k": 2}),
    ("nsa", {"compress_block": 4, "compress_stride": 2, "select_block": 4, "num_selected": 3, "window": 3}),
    # decoding is checked fast in tests/attention_baselines/test_transformer_xl.py (with a clamp)
    pytest.param("transformer_xl", "auto", marks=_SLOW),
    pytest.param("compressive", "auto", marks=_SLOW),  # the transformer_xl decoder again
    # decoding is checked fast in tests/combiner/test_selected.py (float64, select 1 and every block)
    pytest.param("combiner_fixed_select", "auto", marks=_SLOW),
]

# Every other registration with a decoder runs at its automatic parameters (and benchmark inputs), so a new op
# with a cached form is checked here, in the fast run, without editing this list.
_LISTED = {getattr(c, "values", c)[0] for c in OP_CASES}
ops_registry.load()
OP_CASES += [(name, "auto") for name in ops_registry.names()
             if ops_registry.get(name).decode is not None and name not in _LISTED]


def _qkv(seed: int, batch: int, length: int, heads: int, dim: int, pooled: bool = False):
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (batch, length, heads, dim)
  q, k, v, pq, pk = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)
  return (q, k, v, pq, pk) if pooled else (q, k, v)


def _decode_all(spec, params, q, k, v, prompt: int = 0, pool_q=None, pool_k=None, **extra):
  """Prefills `prompt` positions, then steps through the rest (one compiled scan); the stepped outputs."""
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
      def at(x):
        return jax.lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)

      out, cache = dec.step(cache, at(q), at(k), at(v), t, **{n: at(x) for n, x in pooled.items()}, **params,
                            **extra)
      return cache, out

    _, outs = jax.lax.scan(body, cache, jnp.arange(prompt, length))
    return jnp.swapaxes(outs, 0, 1)  # [batch, length - prompt, heads, value_dim]

  return run(q, k, v, pooled)


def _case_id(case) -> str:
  name, params = getattr(case, "values", case)  # a pytest.param or a plain tuple
  if params == "auto":
    return f"{name}-auto"
  return f"{name}-{ {k: v for k, v in params.items() if k != 'rng'} }"


@pytest.mark.parametrize("name,params", OP_CASES, ids=[_case_id(c) for c in OP_CASES])
def test_op_step_equals_forward(name, params):
  spec = ops_registry.get(name)
  length = 19  # ragged: not a multiple of 4 or 3, > 16 so logsparse has 5 levels
  if params == "auto":
    params = ops_registry.bench_params(spec, length, batch=2, heads=2, head_dim=8, dtype=jnp.float32)
  q, k, v = _qkv(0, 2, length, 2, 8)
  full = spec.fn(q, k, v, causal=True, **params)
  stepped = _decode_all(spec, params, q, k, v, prompt=6)
  np.testing.assert_allclose(stepped, full[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,params", [("combiner_fixed", {"block_size": 4}),
                                         ("combiner_axial_rowmajor", {"row_length": 4}),
                                         pytest.param("combiner_mixture", {"row_length": 4,  # the costliest
                                                                           "pooling": "mean"},
                                                      marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("name,params", [("linear", {"chunk_size": 4}), ("local", {"block_size": 4}),
                                         ("performer", {"rng": jax.random.key(2), "num_features": 16}),
                                         ("longformer", {"window": 3, "global_positions": (0, 4)}),
                                         ("bigbird", {"block_size": 3, "num_random_blocks": 1})],
                         ids=["linear", "local", "performer", "longformer", "bigbird"])
def test_op_step_keeps_nonfinite_values_where_the_forward_does(name, params):
  """A NaN or Inf value reaches exactly the outputs it reaches in the forward pass: local's ring keeps the
  previous block's NaN from the next block; linear's and Performer's summaries carry it to every later token
  of its head."""
  spec = ops_registry.get(name)
  q, k, v = _qkv(3, 2, 19, 2, 8)
  v = v.at[0, 3, 0, 1].set(jnp.nan).at[1, 9, 1, 0].set(jnp.inf)  # one in the prompt, one after it
  full = spec.fn(q, k, v, causal=True, **params)
  stepped = _decode_all(spec, params, q, k, v, prompt=6)
  assert np.isnan(stepped).any() and np.isfinite(stepped).any()
  np.testing.assert_allclose(stepped, full[:, 6:], rtol=1e-5, atol=1e-5)  # NaN positions must match too


def test_performer_step_rescales_when_a_later_key_raises_the_max():
  """The forward pass stabilises every key by the row's max, set here by a large key after the prompt; the
  decoder rescales its summaries when that key arrives, and still equals the forward pass."""
  spec = ops_registry.get("performer")
  params = {"rng": jax.random.key(5), "num_features": 16}
  q, k, v = _qkv(4, 2, 19, 2, 8)
  k = k.at[:, 12].multiply(3.0)
  stepped = _decode_all(spec, params, q, k, v, prompt=6)
  np.testing.assert_allclose(stepped, spec.fn(q, k, v, causal=True, **params)[:, 6:], rtol=2e-5, atol=2e-5)
