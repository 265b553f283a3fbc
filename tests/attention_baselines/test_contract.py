"""The attention-op contract for every baseline besides dense: causality (zero Jacobian to the future),
masked keys holding NaN change nothing, no mask equals an all-real mask, automatic parameters, the
registrations and argument checks."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.linformer import linformer
from attention_baselines.nystromformer import nystromformer
from attention_baselines.performer import orthogonal_features
from attention_baselines.reformer import reformer
from attention_baselines.sinkhorn import sinkhorn
from attention_baselines.synthesizer import synthesizer_dense, synthesizer_random
from attention_core import registry as ops_registry
from tests.attention_baselines.definitions import (
  L,
  inputs,
  inputs_at,
  sinkhorn_params,
  synth_params,
)

# -- Performer, linear, local, Longformer, BigBird, none --------------------------------------------------

OPS = {
    "performer": dict(features=orthogonal_features(jax.random.key(0), 6, 4), chunk_size=3),
    "linear": dict(chunk_size=3),
    "local": dict(block_size=3),
    "longformer": dict(window=2, global_positions=(0, 6)),
    "bigbird": dict(block_size=2, num_random_blocks=1),
    "none": {},
}


def _ops(slow) -> list:
  """OPS' names, the ones in `slow` marked for the slow run."""
  return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in sorted(OPS)]


# A Jacobian per op: only the cheapest (none) runs fast; the others' causality is also checked fast by their
# definitions (causal references) and by tests/attention_core/test_masked_nonfinite.py.
@pytest.mark.parametrize("name", _ops({"bigbird", "linear", "local", "longformer", "performer"}))
def test_causal_outputs_do_not_depend_on_the_future(name):
  fn = functools.partial(ops_registry.get(name).fn, causal=True, **OPS[name])
  q, k, v, _ = inputs(1, batch=1, length=9, dtype=jnp.float32)
  # reverse mode: the Jacobian through the backward the ops train with (some are hand-written)
  jac = jax.jacrev(lambda q, k, v: fn(q, k, v), argnums=(0, 1, 2))(q, k, v)  # each [1, 9, h, dv, 1, 9, h, d]
  future = np.triu(np.ones((9, 9), bool), 1)  # [output position, input position]
  for j in jac:
    j = np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7))  # [output position, input position]
    assert np.all(j[future] == 0.0)


# BigBird's, Longformer's and linear's compiles (a gradient each) are the slowest: they run with the slow
# tests, as do causal Performer and causal local; bidirectional local, none and bidirectional Performer run
# fast.
@pytest.mark.parametrize("name,causal", [
    pytest.param(name, causal, marks=pytest.mark.slow if name in ("bigbird", "linear", "longformer")
                 or (name, causal) in (("performer", True), ("local", True)) else ())
    for name in sorted(OPS) for causal in (True, False)])
def test_masked_keys_holding_nan_change_nothing(name, causal):
  fn = functools.partial(ops_registry.get(name).fn, causal=causal, **OPS[name])
  q, k, v, mask = inputs(2, length=10, dtype=jnp.float32)
  bad = ~mask[:, :, None, None]
  out = fn(q, k, v, mask=mask)
  poisoned = fn(q, jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v), mask=mask)
  np.testing.assert_allclose(poisoned, out, rtol=1e-6, atol=1e-6)
  grads = jax.grad(lambda k, v: jnp.sum(fn(q, k, v, mask=mask) ** 2), argnums=(0, 1))(
      jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
    assert not np.any(np.asarray(g)[np.asarray(bad[..., 0, 0])])  # masked keys get zero gradient


# Ops that skip their masking work when given no mask; one case with the fast tests.
NO_MASK_FAST = {("linear", True)}


NO_MASK_CASES = [pytest.param(name, causal, marks=() if (name, causal) in NO_MASK_FAST else pytest.mark.slow)
                 for name in ("linear", "local", "performer") for causal in (True, False)]


@pytest.mark.parametrize("name,causal", NO_MASK_CASES)
def test_no_mask_equals_an_all_real_mask(name, causal):
  """Without a mask the op skips its selects: outputs and gradients equal those under an all-True mask, in
  float64, with a ragged last chunk or block."""
  fn = functools.partial(ops_registry.get(name).fn, causal=causal, **OPS[name])
  with jax.enable_x64(True):
    q, k, v, _ = inputs(9, length=10)
    cot = jax.random.normal(jax.random.key(10), v.shape, jnp.float64)

    def run(mask):
      loss = lambda q, k, v: jnp.sum(fn(q, k, v, mask=mask) * cot)  # noqa: E731
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    want, want_grads = run(jnp.ones(q.shape[:2], bool))
    got, grads = run(None)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for g, w in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-13)


# BigBird, Performer and Longformer at their automatic parameters are the slowest to compile: -m slow.
@pytest.mark.parametrize("name", _ops({"bigbird", "longformer", "performer"}))
def test_registered_ops_run_at_their_automatic_parameters(name):
  spec = ops_registry.get(name)
  q, k, v, mask = inputs(4, batch=1, length=37, head_dim=8, dtype=jnp.bfloat16)
  for causal in (True, False):
    out = spec.fn(q, k, v, causal=causal, mask=mask, **ops_registry.bench_params(spec, 37))
    assert out.shape == v.shape and out.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


# -- Reformer, Linformer, Nystromformer, Sinkhorn, Synthesizers ------------------------------------------

SIZED_OPS = ("linformer", "nystromformer", "reformer", "sinkhorn", "synthesizer", "synthesizer_random")


def _op(name, length):
  """(op with its parameters bound, supports causal) for the contract tests."""
  dense_p, random_p = synth_params(length)
  e, f = (jax.random.normal(jax.random.key(s), (4, length), jnp.float64) for s in (7, 8))
  shared_qk = lambda q, k, v, **kw: reformer(q, q, v, **kw)  # noqa: E731
  return {
      "reformer": (shared_qk, dict(rng=jax.random.key(1), n_hashes=2, n_buckets=4, chunk_size=3), True),
      "linformer": (linformer, dict(proj_k=e, proj_v=f), False),
      "nystromformer": (nystromformer, dict(num_landmarks=3), False),
      "sinkhorn": (sinkhorn, sinkhorn_params(length, 3), True),
      "synthesizer": (synthesizer_dense, dense_p, True),
      "synthesizer_random": (synthesizer_random, random_p, True),
  }[name]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "linformer" else n
                                  for n in SIZED_OPS])  # linformer's compile is the slowest: -m slow
def test_nan_in_masked_positions_changes_nothing(name):
  with jax.enable_x64(True):
    q, k, v, _ = inputs_at(L, 6)
    mask = jnp.array([[True] * 9 + [False] * 3, [True, False, True, True, False, True] * 2])
    fn, params, has_causal = _op(name, L)
    bad = ~mask[:, :, None, None]
    qn, kn, vn = (jnp.where(bad, jnp.nan, x) for x in (q, k, v))
    real = np.asarray(mask)[:, :, None, None]
    for causal in ([False, True] if has_causal else [False]):
      run = jax.jit(lambda q, k, v, causal=causal: fn(q, k, v, causal=causal, mask=mask, **params))
      clean, dirty = np.where(real, run(q, k, v), 0.0), np.where(real, run(qn, kn, vn), 0.0)
      assert np.all(np.isfinite(dirty))
      np.testing.assert_allclose(dirty, clean, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["reformer", "sinkhorn", "synthesizer", "synthesizer_random"])
def test_causal_ops_read_no_future(name):
  """d out[i] / d (q, k, v)[j] = 0 for every j > i."""
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = inputs_at(length, 8, p_mask=1.0)
    fn, params, _ = _op(name, length)
    out = lambda q, k, v: fn(q, k, v, causal=True, mask=mask, **params)  # noqa: E731
    jac = jax.jit(jax.jacrev(out, argnums=(0, 1, 2)))(q, k, v)
    future = np.triu(np.ones((length, length), bool), 1)  # [i, j]: j > i
    for j in jac:  # [B, L, H, DV, B, L, H, D]
      block = np.abs(np.asarray(j)).sum(axis=(0, 2, 3, 4, 6, 7))  # [L_out, L_in]
      assert np.all(block[future] == 0.0)
    dv = np.abs(np.asarray(jac[2])).sum(axis=(0, 2, 3, 4, 6, 7))
    assert dv[np.tril(np.ones((length, length), bool), -1)].sum() > 0  # the past is read


def test_registry_and_bad_arguments():
  for name in SIZED_OPS:
    spec = ops_registry.get(name)
    assert spec.bidirectional and spec.causal == (name not in ("linformer", "nystromformer"))
    assert set(inspect.signature(spec.params).parameters) <= {"length", "head_dim"}
  q, k, v, _ = inputs_at(8, 0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="'n_buckets'"):
    reformer(q, q, v, causal=False, rng=jax.random.key(0), n_buckets=3)
  with pytest.raises(ValueError, match="'chunk_size'"):
    reformer(q, q, v, causal=False, rng=jax.random.key(0), chunk_size=0)
  with pytest.raises(ValueError, match="'num_landmarks'"):
    nystromformer(q, k, v, causal=False, num_landmarks=0)
  with pytest.raises(ValueError, match="'sort_w2'"):
    sinkhorn(q, k, v, causal=False, **dict(sinkhorn_params(8, 2), sort_w2=jnp.ones((1, 5, 2))))
  with pytest.raises(ValueError, match="'temperature'"):
    sinkhorn(q, k, v, causal=False, **dict(sinkhorn_params(8, 2), temperature=0.0))
