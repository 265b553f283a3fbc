"""The TPU branch of every kernel runs here, in JAX's TPU interpreter
   (`attention_core.pallas.simulate("tpu")`).

Under `simulate` the "auto" ops make the TPU choices (the fused Combiner plans with TPU tiles and layout,
dense's Splash attention, YOSO's pallas formulation) and each Pallas call runs its TPU block specs,
SMEM scalars and compiler params in the interpreter, which models TPU memory spaces and detects races. The
outputs and gradients equal the XLA path in float32 (tolerances as in tests/combiner/test_flash.py). The race
detector sees the last kernel each run executes (its state lasts from one kernel to the next).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import combiner
from attention_baselines.dense import dense
from attention_core import pallas
from combiner import frames
from yoso.attention import yoso

BATCH, HEADS, HEAD_DIM, VALUE_DIM = 2, 2, 8, 5
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # interpreted programs compile slowly


def inputs(length: int, value_dim: int = VALUE_DIM, seed: int = 0, heads: int = HEADS,
           head_dim: int = HEAD_DIM):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q, k = (jax.random.normal(kk, (BATCH, length, heads, head_dim)) for kk in keys[:2])
  v = jax.random.normal(keys[2], (BATCH, length, heads, value_dim))
  mask = jax.random.bernoulli(keys[3], 0.75, (BATCH, length)).at[:, 0].set(True)
  return q, k, v, mask, jax.random.normal(keys[4], v.shape)


def value_and_grads(fn, q, k, v, cotangent):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(cotangent))


def compare_simulated(op, length, *, value_dim=VALUE_DIM, heads=HEADS, head_dim=HEAD_DIM, atol=2e-5,
                      rtol=2e-5, **kw):
  """op(..., implementation="auto") run as on a TPU, in the interpreter, against implementation="xla"."""
  q, k, v, mask, cotangent = inputs(length, value_dim, heads=heads, head_dim=head_dim)
  run = functools.partial(value_and_grads, cotangent=cotangent)
  with pallas.simulate("tpu", detect_races=True):
    got = jax.jit(lambda q, k, v: run(lambda *a: op(*a, mask=mask, implementation="auto", **kw), q, k, v),
                  compiler_options=FAST_COMPILE)(q, k, v)
    got = jax.block_until_ready(got)
    assert not pallas.races_found()
  want = run(lambda *a: op(*a, mask=mask, implementation="xla", **kw), q, k, v)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=rtol, err_msg=name)


PLANS = {
    "fixed": functools.partial(combiner.fixed, block_size=4),
    "fixed_select": functools.partial(combiner.fixed, block_size=4, select=2),
    "sparse_fixed": functools.partial(combiner.sparse.fixed, block_size=4),
    "logsparse": combiner.logsparse,
    "sparse_logsparse": combiner.sparse.logsparse,
    "axial_rowmajor": functools.partial(combiner.axial, row_length=4, direction="rowmajor"),
    "axial_vertical": functools.partial(combiner.axial, row_length=4, direction="vertical"),
    "axial_horizontal": functools.partial(combiner.axial, row_length=3, direction="horizontal"),
    "sparse_axial": functools.partial(combiner.sparse.axial, row_length=4),
    "mixture": functools.partial(combiner.mixture, row_length=3),
    "mixture_joint": functools.partial(combiner.mixture, row_length=4, normalize="joint"),
}


# (plan, length, causal): ragged lengths (not multiples of the block or row), both directions, a key mask;
# logsparse at 40 tokens in tiles of 16 (below) reaches the levels built over several tiles; at 48 (whole
# tiles) the bidirectional plan's reversed half reads the arrays' tiles backwards.
@pytest.mark.slow  # about 20 s a case: the interpreter runs the kernels' TPU branch op by op
@pytest.mark.parametrize("plan,length,causal", [
    ("fixed", 13, True),
    *(pytest.param(*case) for case in (
        ("fixed", 13, False), ("fixed_select", 21, True), ("sparse_fixed", 13, False),
        ("logsparse", 13, True), ("logsparse", 40, False), ("logsparse", 48, False),
        ("sparse_logsparse", 40, True),
        ("axial_rowmajor", 11, True),
        ("axial_vertical", 11, True), ("axial_vertical", 11, False), ("axial_horizontal", 11, True),
        ("sparse_axial", 11, False), ("mixture", 11, True), ("mixture", 11, False),
        ("mixture_joint", 11, True))),
])
def test_combiner_tpu_branch_equals_xla(monkeypatch, plan, length, causal):
  monkeypatch.setattr(frames, "TILE", 16)
  compare_simulated(PLANS[plan], length, causal=causal)


@pytest.mark.slow
@pytest.mark.parametrize("plan,length,causal", [("fixed_select", 21, True), ("axial_vertical", 11, False)])
def test_heads_folded_into_lanes_in_tpu_interpreter(monkeypatch, plan, length, causal):
  """Blocks of 2 of 4 heads of 64 folded into 128 lanes (`frames.Frame.layout`): the second block's DMA
  copies of rows from HBM start at lane 128 (fixed_select), a column pass reads [batch, rows, cols * heads *
  64] (axial_vertical); the values (dim 5) take blocks of their own axis."""
  monkeypatch.setattr(frames, "TILE", 16)
  monkeypatch.setattr(frames, "HEAD_BLOCK", 2)
  compare_simulated(PLANS[plan], length, heads=4, head_dim=64, causal=causal)


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_dense_tpu_kernel_equals_xla(causal):
  """Splash attention (`attention_baselines.splash`, dense's TPU kernel): a ragged length padded to its
     tiles."""
  compare_simulated(dense, 13, value_dim=HEAD_DIM, causal=causal)


@pytest.mark.slow
@pytest.mark.parametrize("causal,features,length", [(False, None, 24), (False, 2, 24), (True, None, 24),
                                                    (False, 2, 300)])
def test_yoso_pallas_formulation_equals_sorted(causal, features, length, monkeypatch):
  """YOSO's table kernels (build/read, the sketched tables) and the exact backward's pair sums; at length 300
  the TPU build walks its rows in three chunks of 128, and the reads take their hashes one chunk each."""
  from yoso import backward, kernels

  monkeypatch.setattr(backward, "COUNTS_MAX_LENGTH", 0)  # the LSH tables, not the short-sequence counts
  monkeypatch.setattr(kernels, "BUILD_ROWS", 128)
  monkeypatch.setattr(kernels, "READ_TABLES_VMEM", 1)
  q, k, v, mask, cotangent = inputs(length)

  def run(formulation):
    def fn(q, k, v):
      return yoso(q, k, v, rng=jax.random.PRNGKey(5), num_hashes=2, tau=3, mask=mask, causal=causal,
                  backward_features=features, formulation=formulation)
    return value_and_grads(fn, q, k, v, cotangent)

  with pallas.simulate("tpu", detect_races=True):
    got = jax.block_until_ready(jax.jit(lambda: run("auto"), compiler_options=FAST_COMPILE)())
    assert not pallas.races_found()
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, run("sorted"), strict=True):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_routed_tpu_branch_equals_xla(monkeypatch, causal):
  """The routed plan's kernels in the TPU interpreter with its race detector (causal: its own,
  `combiner.routed_kernels`; bidirectional: Combiner-Fixed's over the rank order, gathered inside the
  custom_vjp): chunks of 20 in frame rows of two 16-position tiles, a key mask, skewed clusters. Padded
  query rows are don't-care: they carry no cotangent and are compared as zeros."""
  monkeypatch.setattr(frames, "TILE", 16)
  q, k, v, mask, cotangent = inputs(40)
  ids = jnp.minimum(jax.random.randint(jax.random.PRNGKey(3), (BATCH, 40, HEADS), 0, 4), 1)
  cotangent = jnp.where(mask[:, :, None, None], cotangent, 0.0)

  def run(implementation):
    def op(q, k, v):
      out = combiner.routed(q, k, v, cluster_ids=ids, num_clusters=2, causal=causal, mask=mask,
                            implementation=implementation)
      return jnp.where(mask[:, :, None, None], out, 0.0)
    return value_and_grads(op, q, k, v, cotangent)

  with pallas.simulate("tpu", detect_races=True):
    got = jax.block_until_ready(jax.jit(lambda: run("auto"), compiler_options=FAST_COMPILE)())
    assert not pallas.races_found()
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, run("xla"), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5, err_msg=name)
