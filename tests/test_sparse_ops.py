"""The sparse baselines (combiner/sparse.py: Fixed, Logsparse, Axial) against the from-definition reference.

Same method as tests/test_combiner_ops.py: one-hot values return the attention matrix, compared in float64 with
`combiner.reference.sparse_attention_matrix`; the support must be exactly `reference.sparse_support`.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from baselines.dense import dense
from combiner import reference as ref
from combiner import sparse
from tests.test_combiner_ops import (COMBOS, HEADS, LOGSPARSE_LENGTHS, fast_jit, one_hot_v, op_matrix, random_masks,
                                     random_qk, run_many)

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


@pytest.mark.parametrize("plan", PLANS)
def test_sparse_op_equals_reference_and_support(plan):
  with jax.enable_x64(True):
    key = jax.random.key(zlib.crc32(plan.encode()))
    fns, args, checks = [], [], []
    for length, size in combos(plan) + ([(16, None)] if plan == "logsparse" else [(16, 4), (11, 4)]):
      key, kqk, km = jax.random.split(key, 3)
      op, params = sparse_call(plan, size)
      q, k = random_qk(kqk, 3, length)
      mask = random_masks(km, 3, length, size)
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
          a_ref = ref.sparse_attention_matrix(plan, np.asarray(q[b, :, h]), np.asarray(k[b, :, h]), causal=causal,
                                              mask=real, **params)
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
    ks = jax.random.split(jax.random.key(31), 8)
    q, k = random_qk(ks[0], batch, length)
    v = jax.random.normal(ks[1], (batch, length, HEADS, 4), jnp.float64)
    mask = random_masks(ks[2], batch, length, size)
    real = np.asarray(mask)
    program = fast_jit(lambda q, k, v: [op(q, k, v, causal=c, mask=mask) for c in (True, False)])
    outs = []
    for fill in (3, 4):
      f = jax.random.split(ks[fill], 3)
      x = [jnp.where(mask[:, :, None, None], t, 3.0 * jax.random.normal(kk, t.shape, t.dtype))
           for kk, t in zip(f, (q, k, v), strict=True)]
      outs.append([np.asarray(o) for o in program(*x)])
    for a, b, causal in zip(outs[0], outs[1], (True, False), strict=True):
      np.testing.assert_allclose(a[real], b[real], rtol=1e-12, atol=1e-13, err_msg=f"{plan} causal={causal}")
    # Jacobian of a whole layer (x -> q, k, v -> op -> projection): nothing flows from the future.
    dim = HEADS * q.shape[-1]
    w = [jax.random.normal(kk, (4, dim), jnp.float64) for kk in jax.random.split(ks[5], 3)]
    wo = jax.random.normal(ks[6], (dim, 4), jnp.float64)
    x = jax.random.normal(ks[7], (1, length, 4), jnp.float64)

    def layer(x):
      q, k, v = (jnp.reshape(x @ wi, (1, length, HEADS, -1)) for wi in w)
      return op(q, k, v, causal=True).reshape(1, length, dim) @ wo

    jac = np.abs(np.asarray(fast_jit(jax.jacrev(layer))(x))[0, :, :, 0]).max(axis=(1, 3))  # [L_out, L_in]
    assert np.all(jac[np.triu(np.ones((length, length), bool), 1)] == 0), plan
    for i in range(length):  # and it flows from exactly the sparse support
      assert list(np.flatnonzero(jac[i])) == ref.sparse_support(plan, length, i, causal=True, **sparse_call(
          plan, size)[1]), f"{plan} i={i}"


@pytest.mark.parametrize("plan", PLANS)
def test_sparse_gradients_bf16_and_huge_logits(plan):
  with jax.enable_x64(True):
    length, size, batch = 8, 3, 2
    ks = jax.random.split(jax.random.key(37), 4)
    q, k = random_qk(ks[0], batch, length, scale=1.0)
    v = jax.random.normal(ks[1], (batch, length, HEADS, 2), jnp.float64)
    mask = np.array(random_masks(ks[2], batch, length, size))
    mask[1, :] = True
    mask[1, [1, 2, 3, 5, 7]] = False  # logsparse i=4 or 6 may keep only itself: summaries all masked
    mask = jnp.asarray(mask)
    op, _ = sparse_call(plan, size)

    def f(q, k, v):
      real = mask[:, :, None, None]
      return jnp.concatenate([jnp.where(real, op(q, k, v, causal=c, mask=mask), 0) for c in (True, False)], -1)

    check_grads(jax.jit(f), (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    # q scaled by 100: finite forward and gradient in float32 and float64.
    for dtype in (jnp.float32, jnp.float64):
      args = [(100 * q).astype(dtype), k.astype(dtype), v.astype(dtype)]
      out, grads = fast_jit(lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(f(*b) ** 2), argnums=(0, 1, 2))(*a)))(
          *args)
      assert np.all(np.isfinite(np.asarray(out))) and all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  # bfloat16 inputs stay close to float32 on the same rounded inputs.
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out_bf = op(q, k, v, causal=True, mask=mask)
  assert out_bf.dtype == jnp.bfloat16
  out_32 = op(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True, mask=mask)
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(out_bf, np.float32)[real], np.asarray(out_32)[real], atol=2e-2)


def test_sparse_degenerate_sizes_equal_dense():
  with jax.enable_x64(True):
    for length in (1, 6):
      ks = jax.random.split(jax.random.key(41 + length), 3)
      q, k = random_qk(ks[0], 2, length)
      v = jax.random.normal(ks[1], (2, length, HEADS, 3), jnp.float64)
      mask = random_masks(ks[2], 2, length, None)
      cases = [("fixed", length), ("axial", length)] + ([("logsparse", None)] if length == 1 else [])
      cases = [(p, s, c) for p, s in cases for c in (True, False)]
      outs = run_many([lambda q, k, v, p=p, s=s, c=c: sparse_call(p, s)[0](q, k, v, causal=c, mask=mask)
                       for p, s, c in cases], [(q, k, v)] * len(cases))
      real = np.asarray(mask)
      for out, (plan, size, causal) in zip(outs, cases, strict=True):
        expect = np.asarray(dense(q, k, v, causal=causal, mask=mask))
        np.testing.assert_allclose(out[real], expect[real], rtol=1e-10, atol=1e-13,
                                   err_msg=f"sparse {plan}({size}) L={length} causal={causal}")


def test_sparse_invalid_arguments():
  good = jnp.ones((1, 6, 2, 3))
  calls = {"fixed": lambda **kw: sparse.fixed(**{"q": good, "k": good, "v": good, "block_size": 2, "causal": True,
                                                  **kw}),
           "logsparse": lambda **kw: sparse.logsparse(**{"q": good, "k": good, "v": good, "causal": True, **kw}),
           "axial": lambda **kw: sparse.axial(**{"q": good, "k": good, "v": good, "row_length": 2, "causal": True,
                                                 **kw})}
  failures = []

  def expect(what, call, exc, name):
    try:
      call()
    except exc as e:
      if name not in str(e):
        failures.append(f"{what}: message does not name {name}: {e}")
    except Exception as e:  # noqa: BLE001 - any other exception type is a failure to report
      failures.append(f"{what}: raised {type(e).__name__} instead of {exc.__name__}: {e}")
    else:
      failures.append(f"{what}: did not raise")

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
