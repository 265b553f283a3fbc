"""Every registered op: NaN or Inf at masked keys / values, or (causal) at future positions, never reaches an
output that cannot see it (the op contract: select, don't multiply).

The test is driven by the op registry, so an op registered later is covered without touching this file. Each
op runs at a tiny length with its own `params(L)`; the poisoned run must leave every visible output finite and
equal to the clean run's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_core import registry as ops_registry

LENGTH, BATCH, HEADS, DIM = 16, 2, 2, 64  # head_dim 64: the registry params of some ops assume it
# Ops whose causal partition is chosen from every token's key: a future key picks its own cluster, which moves
# the balanced chunk boundaries of earlier tokens (Combiner-routed's eq. 12 partition). Their future *values*
# and masked keys are still checked.
PARTITION_FROM_FUTURE_KEYS = {"combiner_routed"}


def _inputs(seed: int):
  g = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(g.normal(size=(BATCH, LENGTH, HEADS, DIM)), jnp.float32) for _ in range(3))
  mask = np.ones((BATCH, LENGTH), bool)
  mask[1, [2, 5, 11, 15]] = False  # row 1 has masked keys inside and at the end of the sequence
  return q, k, v, jnp.asarray(mask)


def _cases(spec):
  """(causal, poisoned positions [batch, length] bool, visible query rows [batch, length] bool)."""
  _, _, _, mask = _inputs(0)
  mask = np.asarray(mask)
  out = []
  for causal in (c for c, ok in ((False, spec.bidirectional), (True, spec.causal)) if ok):
    out.append((causal, "masked", ~mask, mask))
  if spec.causal:
    future = np.zeros((BATCH, LENGTH), bool)
    future[:, LENGTH // 2 + 1:] = True
    out.append((True, "future", future, ~future & mask))
  return out


def _plant(x, where, value):
  return jnp.where(jnp.asarray(where)[:, :, None, None], value, x)


# The fast run keeps one or more of each family, the cheapest; these repeat a family covered fast (or are its
# most expensive members: logsparse, the mixtures, routing, sampled YOSO) and run with -m slow. An op
# registered later is not listed here, so it runs fast.
SLOW_OPS = frozenset({
    "bp_transformer",  # masked NaN covered fast by tests/attention_baselines/test_bp_transformer.py
    "combiner_axial_horizontal", "combiner_axial_vertical", "combiner_fixed_select", "combiner_logsparse",
    "combiner_mixture", "combiner_mixture_joint", "combiner_routed", "dense_xla", "performer", "reformer",
    "routing", "sinkhorn", "sparse_logsparse", "synthesizer_random", "yoso", "yoso_sketch",
    "yoso_sketch_c", "compressive"})  # compressive: the transformer_xl op again


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_OPS else n
                                  for n in ops_registry.names()])
def test_nonfinite_behind_masks_never_reaches_visible_outputs(name):
  spec = ops_registry.get(name)
  q, k, v, mask = _inputs(0)
  params = ops_registry.bench_params(spec, LENGTH)
  failures = []
  for causal, what, poison, visible in _cases(spec):
    fn = jax.jit(lambda q, k, v, m, c=causal: spec.fn(q, k, v, causal=c, mask=m, **params))
    clean = np.asarray(fn(q, k, v, mask))
    targets = ("v",) if what == "future" and name in PARTITION_FROM_FUTURE_KEYS else ("kv", "v")
    for value in (jnp.nan, jnp.inf):
      for target in targets:
        k2 = _plant(k, poison, value) if "k" in target else k
        v2 = _plant(v, poison, value) if "v" in target else v
        out = np.asarray(fn(q, k2, v2, mask))
        got, want = out[visible], clean[visible]
        if not np.all(np.isfinite(got)):
          failures.append(f"causal={causal} {what} {target}={value}: non-finite visible outputs")
        elif not np.allclose(got, want, rtol=1e-5, atol=1e-6):
          failures.append(f"causal={causal} {what} {target}={value}: visible outputs changed by "
                          f"{np.max(np.abs(got - want)):.3g}")
  assert not failures, f"{name}:\n" + "\n".join(failures)
