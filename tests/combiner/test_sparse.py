"""The sparse baselines (combiner/sparse.py: Fixed, Logsparse, Axial) against the from-definition reference.

Same method as tests/combiner/test_plans.py: one-hot values return the attention matrix, compared in float64
with `combiner.reference.sparse_attention_matrix`; the support must be exactly `reference.sparse_support`.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from attention_baselines.dense import dense
from combiner import reference as ref
from combiner import sparse
from tests.combiner.test_plans import (
  COMBOS,
  HEADS,
  LOGSPARSE_LENGTHS,
  fast_jit,
  normal,
  one_hot_v,
  op_matrix,
  raise_failure,
  random_masks,
  random_qk,
  run_many,
)

PLANS = ("fixed", "logsparse", "axial")


def sparse_call(plan, size):
  """(op(q, k, v, **kw), reference params) for a sparse baseline at a block/row size."""
  if plan == "fixed":
    return (lambda q, k, v, **kw: sparse.fixed(q, k, v, block_size=size, **kw)), {"block_size": size}
  if plan == "logsparse":
    return (lambda q, k, v, **kw: sparse.logsparse(q, k, v, **kw)), {}
  if plan == "axial":
    return (lambda q, k, v, **kw: sparse.axial(q, k, v, row_length=size, **kw)), {"row_length": size}
  raise AssertionError(plan)


def combos(plan):
  return [(n, None) for n in LOGSPARSE_LENGTHS] if plan == "logsparse" else list(COMBOS)


# Logsparse (the most levels to compile) runs with -m slow.
@pytest.mark.parametrize("plan", [pytest.param("logsparse", marks=pytest.mark.slow) if p == "logsparse" else p
                                  for p in PLANS])
def test_sparse_op_equals_reference_and_support(plan):
  with jax.enable_x64(True):
    g = np.random.default_rng(zlib.crc32(plan.encode()))
    fns, args, checks = [], [], []
    for length, size in combos(plan) + ([] if plan == "logsparse" else [(16, 4)]):
      op, params = sparse_call(plan, size)
      q, k = random_qk(g, 3, length)
      mask = random_masks(g, 3, length, size)
      for causal in (True, False):
        fns.append(lambda q, k, v, m, op=op, c=causal: op(q, k, v, causal=c, mask=m))
        args.append((q, k, one_hot_v(3, length), mask))
        checks.append((q, k, mask, causal, size, params))
    outs = run_many(fns, args)
    for out, (q, k, mask, causal, size, params) in zip(outs, checks, strict=True):
      assert out.dtype == np.float64
      a_op = op_matrix(out)
      length = q.shape[1]
      for b in range(q.shape[0]):
        real = np.asarray(mask[b])
        for h in range(HEADS):
          what = f"sparse {plan}({size}) L={length} causal={causal} b={b} h={h}"
          a = a_op[b, h]
          assert np.all(np.isfinite(a)), what
          a_ref = ref.sparse_attention_matrix(plan, np.asarray(q[b, :, h]), np.asarray(k[b, :, h]),
                                              causal=causal, mask=real, **params)
          np.testing.assert_allclose(a[real], a_ref[real], rtol=1e-10, atol=1e-13, err_msg=what)
          np.testing.assert_allclose(a[real].sum(-1), 1.0, rtol=1e-12, err_msg=what)
          if causal:
            assert np.all(a[np.triu(np.ones((length, length), bool), 1)] == 0), what
          for i in np.flatnonzero(real):
            support = ref.sparse_support(plan, length, int(i), causal=causal, mask=real, **params)
            assert list(np.flatnonzero(a[i])) == support, f"{what} i={i}"


@pytest.mark.parametrize("plan", PLANS)
def test_sparse_padding_invariance_and_causal_jacobian(plan):
  with jax.enable_x64(True):
    length, size, batch = 11, 3, 3
    op, _ = sparse_call(plan, size)
    g = np.random.default_rng(31)
    q, k = random_qk(g, batch, length)
    v = normal(g, (batch, length, HEADS, 4))
    mask = random_masks(g, batch, length, size)
    real = np.asarray(mask)
    program = fast_jit(lambda q, k, v: [op(q, k, v, causal=c, mask=mask) for c in (True, False)])
    outs = []
    for _ in range(2):
      x = [jnp.asarray(np.where(real[:, :, None, None], np.asarray(t), 3.0 * g.standard_normal(t.shape)))
           for t in (q, k, v)]
      outs.append([np.asarray(o) for o in program(*x)])
    for a, b, causal in zip(outs[0], outs[1], (True, False), strict=True):
      np.testing.assert_allclose(a[real], b[real], rtol=1e-12, atol=1e-13, err_msg=f"{plan} causal={causal}")
    # Jacobian of a whole layer (x -> q, k, v -> op -> projection): nothing flows from the future.
    dim = HEADS * q.shape[-1]
    w = [normal(g, (4, dim)) for _ in range(3)]
    wo = normal(g, (dim, 4))
    x = normal(g, (1, length, 4))

    def layer(x):
      q, k, v = (jnp.reshape(x @ wi, (1, length, HEADS, -1)) for wi in w)
      return op(q, k, v, causal=True).reshape(1, length, dim) @ wo

    jac = np.abs(np.asarray(fast_jit(jax.jacrev(layer))(x))[0, :, :, 0]).max(axis=(1, 3))  # [L_out, L_in]
    assert np.all(jac[np.triu(np.ones((length, length), bool), 1)] == 0), plan
    for i in range(length):  # and it flows from exactly the sparse support
      assert list(np.flatnonzero(jac[i])) == ref.sparse_support(plan, length, i, causal=True, **sparse_call(
          plan, size)[1]), f"{plan} i={i}"


# Logsparse (the most levels to compile) runs with -m slow.
@pytest.mark.parametrize("plan", [pytest.param("logsparse", marks=pytest.mark.slow) if p == "logsparse" else p
                                  for p in PLANS])
def test_sparse_gradients_bf16_and_huge_logits(plan):
  with jax.enable_x64(True):
    length, size, batch = 8, 3, 2
    g = np.random.default_rng(37)
    q, k = random_qk(g, batch, length, scale=1.0)
    v = normal(g, (batch, length, HEADS, 2))
    mask = np.array(random_masks(g, batch, length, size))
    mask[1, :] = True
    mask[1, [1, 2, 3, 5, 7]] = False  # logsparse i=4 or 6 may keep only itself: summaries all masked
    mask = jnp.asarray(mask)
    op, _ = sparse_call(plan, size)

    def f(q, k, v):
      real = mask[:, :, None, None]
      outs = [jnp.where(real, op(q, k, v, causal=c, mask=mask), 0) for c in (True, False)]
      return jnp.concatenate(outs, axis=-1)

    check_grads(jax.jit(f), (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    # q scaled by 100 in float32: finite forward and gradient. bfloat16 inputs: close to float32 on the same
    # rounded inputs. One compiled program for both.
    big = [(100 * q).astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)]
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    bf32 = [x.astype(jnp.float32) for x in bf]
    out, grads, out_bf, out_32 = fast_jit(lambda big, bf, bf32: (
        f(*big), jax.grad(lambda *b: jnp.sum(f(*b) ** 2), argnums=(0, 1, 2))(*big),
        op(*bf, causal=True, mask=mask), op(*bf32, causal=True, mask=mask)))(big, bf, bf32)
    assert np.all(np.isfinite(np.asarray(out))) and all(np.all(np.isfinite(np.asarray(gr))) for gr in grads)
    assert out_bf.dtype == jnp.bfloat16
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out_bf, np.float32)[real], np.asarray(out_32)[real], atol=2e-2)


def test_sparse_degenerate_sizes_equal_dense():
  with jax.enable_x64(True):
    for length in (1, 6):
      g = np.random.default_rng(41 + length)
      q, k = random_qk(g, 2, length)
      v = normal(g, (2, length, HEADS, 3))
      mask = random_masks(g, 2, length, None)
      cases = [("fixed", length), ("axial", length)] + ([("logsparse", None)] if length == 1 else [])
      cases = [(p, s, c) for p, s in cases for c in (True, False)]
      outs = run_many([lambda q, k, v, p=p, s=s, c=c, mask=mask:
                         sparse_call(p, s)[0](q, k, v, causal=c, mask=mask)
                       for p, s, c in cases], [(q, k, v)] * len(cases))
      real = np.asarray(mask)
      for out, (plan, size, causal) in zip(outs, cases, strict=True):
        expect = np.asarray(dense(q, k, v, causal=causal, mask=mask))
        np.testing.assert_allclose(out[real], expect[real], rtol=1e-10, atol=1e-13,
                                   err_msg=f"sparse {plan}({size}) L={length} causal={causal}")


def test_sparse_invalid_arguments():
  good = jnp.ones((1, 6, 2, 3))
  base = {"q": good, "k": good, "v": good, "causal": True}
  calls = {"fixed": lambda **kw: sparse.fixed(**{**base, "block_size": 2, **kw}),
           "logsparse": lambda **kw: sparse.logsparse(**{**base, **kw}),
           "axial": lambda **kw: sparse.axial(**{**base, "row_length": 2, **kw})}
  failures = []

  def expect(what, call, exc, name):
    if (failure := raise_failure(what, call, exc, name)):
      failures.append(failure)

  for plan, call in calls.items():
    expect(f"{plan} list q", lambda c=call: c(q=[[1.0]]), TypeError, "'q'")
    expect(f"{plan} rank-3 q", lambda c=call: c(q=jnp.ones((1, 6, 3))), ValueError, "'q'")
    expect(f"{plan} k shape", lambda c=call: c(k=jnp.ones((1, 6, 2, 4))), ValueError, "'k'")
    expect(f"{plan} v length", lambda c=call: c(v=jnp.ones((1, 5, 2, 3))), ValueError, "'v'")
    expect(f"{plan} mask shape", lambda c=call: c(mask=jnp.ones((1, 5), bool)), ValueError, "'mask'")
  for bad in (0, -1, 2.5):
    expect(f"fixed block_size={bad}", lambda b=bad: calls["fixed"](block_size=b), ValueError, "'block_size'")
    expect(f"axial row_length={bad}", lambda b=bad: calls["axial"](row_length=b), ValueError, "'row_length'")
  assert not failures, "\n".join(failures)
