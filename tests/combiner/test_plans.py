"""The fast Combiner ops against the from-definition reference, and the contract checks of docs/design.md §7.

Every op is linear in v, so feeding one-hot values (v[b, j, h, :] = e_j, value_dim = L) returns the effective
attention matrix itself: out[b, i, h, :] = A[i, :]. That matrix is compared with `combiner.reference` in
float64, then checked for the properties the paper promises (rows sum to 1, exact causal zeros, full
support). Ops run on tiny shapes, several calls jitted into one program: on CPU, op-by-op dispatch compiles
every primitive at every new shape and costs more than compiling whole programs (see `run_many`).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import combiner
from attention_baselines.dense import dense
from combiner import reference as ref

PLANS = ("fixed", "logsparse", "axial_rowmajor", "axial_vertical", "axial_horizontal", "mixture_mean",
         "mixture_joint")


def plans(*slow: str) -> list:
  """PLANS as test cases, those named marked for the slow run (each test says why next to it)."""
  return [pytest.param(plan, marks=pytest.mark.slow) if plan in slow else plan for plan in PLANS]


HEADS, HEAD_DIM = 2, 3
# (length, block/row size): every size 1, 2, 3, 4, L appears at two lengths, with non-multiples (3/2, 5/4,
# 10/4, 17/3). A full cross product would only add compile time: each (length, size) is its own program.
# Size = L at larger lengths is checked against dense attention in test_degenerate_plans_equal_dense.
COMBOS = ((1, 1), (2, 2), (3, 2), (5, 1), (5, 4), (9, 3), (10, 4), (17, 3))
LOGSPARSE_LENGTHS = (1, 2, 3, 5, 10, 16, 17)
VARIANT_COMBOS = ((10, 4), (17, 3))  # where mean pooling and pool_q/pool_k are checked too
# Tiny programs compile far longer than they run, and XLA's backend optimisation is most of the compile time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def fast_jit(fn):
  return jax.jit(fn, compiler_options=FAST_COMPILE)


def run_many(fns, args, group=8):
  """[f(*a) for f, a in zip(fns, args)], compiled in groups of `group` calls per XLA program.

  Measured on this CPU: op-by-op (eager) dispatch of one tiny Combiner call costs ~2.5 s of primitive
  compiles, one jitted call ~0.7 s, and each further call in the same program ~0.1-0.2 s.
  """
  outs = []
  for s in range(0, len(fns), group):
    fs, xs = fns[s:s + group], args[s:s + group]
    outs += fast_jit(lambda xs, fs=fs: [f(*a) for f, a in zip(fs, xs, strict=True)])(xs)
  return [np.asarray(o) for o in outs]


def plan_call(plan, size):
  """(op(q, k, v, **kw) -> out, reference plan name, reference params) for a plan at a block/row size."""
  if plan == "fixed":
    return ((lambda q, k, v, **kw: combiner.fixed(q, k, v, block_size=size, **kw)), "fixed",
            {"block_size": size})
  if plan == "logsparse":
    return (lambda q, k, v, **kw: combiner.logsparse(q, k, v, **kw)), "logsparse", {}
  if plan.startswith("axial_"):
    direction = plan.removeprefix("axial_")
    return ((lambda q, k, v, **kw: combiner.axial(q, k, v, row_length=size, direction=direction, **kw)),
            plan, {"row_length": size})
  if plan.startswith("mixture_"):
    normalize = plan.removeprefix("mixture_")
    return ((lambda q, k, v, **kw: combiner.mixture(q, k, v, row_length=size, normalize=normalize, **kw)),
            "mixture", {"row_length": size, "normalize": normalize})
  raise AssertionError(plan)


def plan_combos(plan):
  return [(n, None) for n in LOGSPARSE_LENGTHS] if plan == "logsparse" else list(COMBOS)


# Random inputs come from NumPy: every eager jax.random call at a new shape is one more XLA compile.
def normal(g, shape, dtype=jnp.float64, scale=1.0):
  return jnp.asarray(scale * g.standard_normal(shape), dtype)


def random_qk(g, batch, length, scale=1.3, dtype=jnp.float64):
  """q, k with logits of order 1..3 (head_dim 3, entries ~ N(0, scale^2))."""
  shape = (batch, length, HEADS, HEAD_DIM)
  return normal(g, shape, dtype, scale), normal(g, shape, dtype, scale)


def relu_features(g, shape, dtype=jnp.float64):
  """DeepSets-style pooled features: relu of random normals, like the model's relu(Dense(q))."""
  return jnp.asarray(np.maximum(g.standard_normal(shape), 0.0), dtype)


def random_masks(g, batch, length, size):
  """[batch, length] bool: row 0 all real, the others random, the last one with a whole block/row masked."""
  mask = g.random((batch, length)) < 0.65
  mask[0] = True
  if batch > 2 and size is not None and length > size:
    mask[-1, size:2 * size] = False  # a fully masked block/row: its span must vanish, not poison the softmax
  for b in range(batch):
    if not mask[b].any():
      mask[b, length // 2] = True  # at least one real token
  return jnp.asarray(mask)


def one_hot_v(batch, length, dtype=jnp.float64):
  return jnp.asarray(np.broadcast_to(np.eye(length)[None, :, None, :], (batch, length, HEADS, length)), dtype)


def op_matrix(out):
  """[batch, L, heads, L] one-hot output -> [batch, heads, L, L] attention matrices."""
  return np.asarray(out).transpose(0, 2, 1, 3)


def allowed_matrix(length, causal, mask_row):
  allowed = np.broadcast_to(np.asarray(mask_row, bool)[None, :], (length, length))
  return allowed & np.tril(np.ones((length, length), bool)) if causal else allowed


def check_against_reference(a_op, ref_fn, q, k, mask, *, causal, full_support=True, pool_q=None, pool_k=None,
                            what=""):
  """Compares real query rows of the op's matrices with the reference and checks the contract properties."""
  batch, length = q.shape[:2]
  for b in range(batch):
    real = np.asarray(mask[b], bool)
    allowed = allowed_matrix(length, causal, real)
    for h in range(q.shape[2]):
      extra = {}
      if pool_q is not None:
        extra = {"pool_q": np.asarray(pool_q[b, :, h]), "pool_k": np.asarray(pool_k[b, :, h])}
      a_ref = ref_fn(np.asarray(q[b, :, h]), np.asarray(k[b, :, h]), mask=real, **extra)
      a = a_op[b, h]
      msg = f"{what} L={length} causal={causal} b={b} h={h}"
      assert np.all(np.isfinite(a)), msg
      np.testing.assert_allclose(a[real], a_ref[real], rtol=1e-10, atol=1e-13, err_msg=msg)
      np.testing.assert_allclose(a[real].sum(-1), 1.0, rtol=1e-12, err_msg=msg)
      if causal:  # exact zeros above the diagonal, padded query rows included (they feed the next layer)
        assert np.all(a[np.triu(np.ones((length, length), bool), 1)] == 0), msg
      assert np.all(a[real][~allowed[real]] == 0), msg  # masked keys get exactly nothing
      if full_support:
        assert np.all(a[real][allowed[real]] > 0), msg


# The widest definitions (logsparse's levels, both mixtures, vertical's columns) run with -m slow.
@pytest.mark.parametrize("plan", plans("logsparse", "mixture_joint", "mixture_mean", "axial_vertical"))
def test_op_equals_reference(plan):
  """Both directions at every (length, size); mean pooling and pool_q/pool_k at VARIANT_COMBOS."""
  with jax.enable_x64(True):
    g = np.random.default_rng(zlib.crc32(plan.encode()))
    fns, args, checks = [], [], []
    for length, size in plan_combos(plan):
      batch = 3
      op, ref_plan, params = plan_call(plan, size)
      q, k = random_qk(g, batch, length)
      mask = random_masks(g, batch, length, size)
      v = one_hot_v(batch, length)
      pq, pk = relu_features(g, q.shape), relu_features(g, k.shape)
      variants = [("max", False)]
      if (length, size) == VARIANT_COMBOS[0] or (size is None and length == 10):
        variants += [("mean", False), ("max", True)]
      if (length, size) == VARIANT_COMBOS[1] or (size is None and length == 17):
        variants += [("mean", True)]
      for causal in (True, False):
        for pooling, with_pool in variants:
          fns.append(lambda q, k, v, m, pq, pk, op=op, c=causal, p=pooling, w=with_pool: op(
              q, k, v, causal=c, mask=m, pooling=p, **({"pool_q": pq, "pool_k": pk} if w else {})))
          args.append((q, k, v, mask, pq, pk))
          def ref_fn(qq, kk, rp=ref_plan, pr=params, c=causal, p=pooling, **rk):
            return ref.attention_matrix(rp, qq, kk, causal=c, pooling=p, **pr, **rk)
          kw = {"pool_q": pq, "pool_k": pk} if with_pool else {}
          what = f"{plan}({size}) pooling={pooling} pool_qk={with_pool}"
          checks.append((ref_fn, q, k, mask, causal, kw, what))
    outs = run_many(fns, args)
    for out, (ref_fn, q, k, mask, causal, kw, what), a in zip(outs, checks, args, strict=True):
      assert out.dtype == np.float64 and out.shape == a[2].shape
      check_against_reference(op_matrix(out), ref_fn, q, k, mask, causal=causal, what=what, **kw)


def test_rowmajor_span_key_fn():
  """span_key_fn replaces the pooled span keys; an elementwise map is checked against the reference."""
  with jax.enable_x64(True):
    length, size, batch = 10, 3, 2
    g = np.random.default_rng(7)
    q, k = random_qk(g, batch, length)
    mask = random_masks(g, batch, length, size)
    fns = [lambda q, k, v, m, c=c: combiner.axial(q, k, v, row_length=size, direction="rowmajor", causal=c,
                                                  mask=m, span_key_fn=lambda kb: 1.5 * jnp.tanh(kb) + 0.3)
           for c in (True, False)]
    outs = run_many(fns, [(q, k, one_hot_v(batch, length), mask)] * 2)
    for out, causal in zip(outs, (True, False), strict=True):
      ref_fn = lambda qq, kk, c=causal, **rk: ref.attention_matrix(  # noqa: E731
          "axial_rowmajor", qq, kk, causal=c, row_length=size, span_key_fn=lambda kb: 1.5 * np.tanh(kb) + 0.3,
          **rk)
      check_against_reference(op_matrix(out), ref_fn, q, k, mask, causal=causal, what="rowmajor span_key_fn")


def _rand_fill(g, x, mask):
  """x with fresh random contents at masked positions."""
  noise = 3.0 * g.standard_normal(x.shape)
  return jnp.asarray(np.where(np.asarray(mask)[:, :, None, None], np.asarray(x), noise), x.dtype)


@pytest.mark.parametrize("plan", PLANS)
def test_padding_invariance(plan):
  """Random contents at masked positions (q, k, v, pool_q, pool_k) change no real output."""
  with jax.enable_x64(True):
    length, size, batch = 11, 3, 3
    op, _, _ = plan_call(plan, size)
    g = np.random.default_rng(11)
    q, k = random_qk(g, batch, length)
    v = normal(g, (batch, length, HEADS, 4))
    pq, pk = relu_features(g, q.shape), relu_features(g, k.shape)
    mask = random_masks(g, batch, length, size)
    real = np.asarray(mask)
    variants = [(True, "max", True), (True, "mean", False), (False, "max", False), (False, "mean", True)]
    fns = [lambda q, k, v, pq, pk, c=c, p=p, w=w: op(q, k, v, causal=c, mask=mask, pooling=p,
                                                     **({"pool_q": pq, "pool_k": pk} if w else {}))
           for c, p, w in variants]
    program = fast_jit(lambda xs: [f(*x) for f, x in zip(fns, xs, strict=True)])
    outs = []
    for _ in range(2):  # two random fillings of the padding, one compiled program
      x = tuple(_rand_fill(g, t, mask) for t in (q, k, v, pq, pk))
      outs.append([np.asarray(o) for o in program([x] * len(fns))])
    for a, b, what in zip(outs[0], outs[1], variants, strict=True):
      assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), what
      np.testing.assert_allclose(a[real], b[real], rtol=1e-12, atol=1e-13, err_msg=f"{plan} {what}")


def _layer(op, x, params, mask, *, causal):
  """A whole attention layer: x -> q, k, v (random linear maps) -> op -> output projection.

  The span abstractions pool DeepSets-style features relu(q W), relu(k W), so their path is checked too.
  """
  wq, wk, wv, wo, wpq, wpk = params
  batch, length, _ = x.shape
  split = lambda y: y.reshape(batch, length, HEADS, HEAD_DIM)  # noqa: E731
  q, k, v = split(x @ wq), split(x @ wk), split(x @ wv)
  out = op(q, k, v, causal=causal, mask=mask, pool_q=jax.nn.relu(q @ wpq), pool_k=jax.nn.relu(k @ wpk))
  return out.reshape(batch, length, HEADS * HEAD_DIM) @ wo


# Logsparse and the mixtures are the most expensive to compile: they run with -m slow.
@pytest.mark.parametrize("plan", plans("logsparse", "mixture_joint", "mixture_mean"))
def test_jacobian_causality_through_a_layer(plan):
  """d out_i / d x_j is exactly zero for j > i (causal) and nonzero for every real j <= i (full attention)."""
  with jax.enable_x64(True):
    length, model_dim, size = 10, 4, 3
    g = np.random.default_rng(13)
    width = HEADS * HEAD_DIM
    params = [normal(g, (model_dim, width)), normal(g, (model_dim, width)), normal(g, (model_dim, width)),
              normal(g, (width, model_dim)), normal(g, (HEAD_DIM, HEAD_DIM)), normal(g, (HEAD_DIM, HEAD_DIM))]
    x = normal(g, (1, length, model_dim))
    real = np.ones(length, bool)
    real[4] = False  # a padded token: still no path from the future
    op, _, _ = plan_call(plan, size)
    jac = fast_jit(jax.jacrev(lambda x: _layer(op, x, params, jnp.asarray(real[None]), causal=True)))(x)
    jac = np.abs(np.asarray(jac)[0, :, :, 0]).max(axis=(1, 3))  # [L_out, L_in]
    assert np.all(np.isfinite(jac))
    future = np.triu(np.ones((length, length), bool), 1)
    assert np.all(jac[future] == 0), f"{plan}: the future leaks, max {jac[future].max()}"
    past = np.tril(np.ones((length, length), bool)) & (real[None, :] | np.eye(length, dtype=bool))
    assert np.all(jac[real][past[real]] > 0), f"{plan}: some real past token has no influence"


# Logsparse and the joint mixture are the most expensive: they run with -m slow.
@pytest.mark.parametrize("plan", plans("logsparse", "mixture_joint"))
def test_gradients_match_finite_differences(plan):
  """check_grads (float64, order 1, rev mode) on causal/max and bidirectional/mean outputs with a key mask."""
  with jax.enable_x64(True):
    length, size, batch = 7, 3, 2
    g = np.random.default_rng(17)
    q, k = random_qk(g, batch, length, scale=1.0)
    v = normal(g, (batch, length, HEADS, 2))
    mask = random_masks(g, batch, length, size)
    op, _, _ = plan_call(plan, size)

    def f(q, k, v):
      real = mask[:, :, None, None]  # padded query rows are don't-care outputs
      causal_max = op(q, k, v, causal=True, mask=mask)
      bidir_mean = op(q, k, v, causal=False, mask=mask, pooling="mean")
      return jnp.concatenate([jnp.where(real, causal_max, 0), jnp.where(real, bidir_mean, 0)], axis=-1)

    # A NaN or Inf gradient fails this comparison too.
    check_grads(jax.jit(f), (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


# Logsparse and the joint mixture are the most expensive: they run with -m slow.
@pytest.mark.parametrize("plan", plans("logsparse", "mixture_joint"))
def test_bfloat16_close_to_float32(plan):
  length, size, batch = 12, 4, 2
  g = np.random.default_rng(19)
  q, k = random_qk(g, batch, length, dtype=jnp.float32)
  v = normal(g, (batch, length, HEADS, 4), jnp.float32)
  mask = random_masks(g, batch, length, size)
  op, _, _ = plan_call(plan, size)
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  f32 = [x.astype(jnp.float32) for x in bf]  # the same rounded inputs
  fns = [lambda q, k, v, c=c: op(q, k, v, causal=c, mask=mask) for c in (True, False)]
  program = fast_jit(lambda xs: [f(*x) for f, x in zip(fns * 2, xs, strict=True)])
  out_bf_c, out_bf_b, out_c, out_b = program([bf, bf, f32, f32])
  real = np.asarray(mask)
  for out_bf, out_32, causal in ((out_bf_c, out_c, True), (out_bf_b, out_b, False)):
    assert out_bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out_bf, np.float32)[real], np.asarray(out_32)[real], atol=2e-2,
                               err_msg=f"{plan} causal={causal}")


def _dense_cases(length):
  """Plans that degenerate to dense attention: block/row size L (and row_length 1 for vertical/horizontal)."""
  cases = [("fixed", length), ("axial_rowmajor", length)]
  for plan in ("axial_vertical", "axial_horizontal", "mixture_mean", "mixture_joint"):
    cases += [(plan, length), (plan, 1)]
  if length == 1:
    cases = [("logsparse", None)] + [(plan, 1) for plan in PLANS if plan != "logsparse"]
  return cases


@pytest.mark.slow  # each plan's reference equality runs fast (test_op_equals_reference)
def test_degenerate_plans_equal_dense():
  with jax.enable_x64(True):
    g = np.random.default_rng(23)
    for length in (1, 6):
      q, k = random_qk(g, 2, length)
      v = normal(g, (2, length, HEADS, 3))
      mask = random_masks(g, 2, length, None)
      real = np.asarray(mask)
      directions = (True, False) if length > 1 else (True,)  # at L = 1 both directions are the same set
      cases = [(plan, size, causal) for plan, size in _dense_cases(length) for causal in directions]
      outs = run_many([lambda q, k, v, p=p, s=s, c=c, mask=mask:
                         plan_call(p, s)[0](q, k, v, causal=c, mask=mask)
                       for p, s, c in cases], [(q, k, v)] * len(cases), group=12)
      for out, (plan, size, causal) in zip(outs, cases, strict=True):
        expect = np.asarray(dense(q, k, v, causal=causal, mask=mask))
        np.testing.assert_allclose(out[real], expect[real], rtol=1e-10, atol=1e-13,
                                   err_msg=f"{plan}({size}) L={length} causal={causal}")


# Logsparse and the mixtures are the most expensive to compile: they run with -m slow.
@pytest.mark.parametrize("plan", plans("logsparse", "mixture_joint", "mixture_mean"))
def test_no_nan_fully_masked_spans_and_huge_logits(plan):
  """Whole masked blocks/rows/columns and q scaled by 100: finite forward and gradient, rows sum to 1."""
  with jax.enable_x64(True):
    length, size, batch = 16, 4, 2
    g = np.random.default_rng(29)
    q, k = random_qk(g, batch, length)
    mask = np.ones((batch, length), bool)
    mask[0, 4:8] = False  # a whole block / row
    mask[1, 0:4] = False  # the first block / row: every causal span before it is empty
    mask[1, 8:12] = False
    mask[:, [1, 9]] = False  # column 1 is now fully masked in batch 1 (vertical spans)
    mask = jnp.asarray(mask)
    real = np.asarray(mask)
    op, _, _ = plan_call(plan, size)

    def value_and_grads(q, k, v, w, causal):
      out = op(q, k, v, causal=causal, mask=mask)
      loss = lambda *a: jnp.sum(op(*a, causal=causal, mask=mask) * w)  # noqa: E731
      return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for dtype in (jnp.float32,):  # float32 is where huge logits overflow; float64 shares the code path
      v = one_hot_v(batch, length, dtype)
      w = normal(g, v.shape, dtype)
      program = fast_jit(lambda q, k, v=v, w=w: [value_and_grads(q, k, v, w, c) for c in (True, False)])
      for scale in (1.0, 100.0):
        results = program((q * scale).astype(dtype), k.astype(dtype))
        for (out, grads), causal in zip(results, (True, False), strict=True):
          what = f"{plan} {dtype.__name__} causal={causal} scale={scale}"
          out = np.asarray(out)
          assert np.all(np.isfinite(out)), what
          np.testing.assert_allclose(out[real].sum(-1), 1.0, rtol=1e-5, err_msg=what)
          assert all(np.all(np.isfinite(g)) for g in grads), what


def _bad_calls():
  """(description, call, exception, name that the message must contain)."""
  good = jnp.ones((1, 6, 2, 3))
  ops = {
      "fixed": lambda q=good, k=good, v=good, **kw: combiner.fixed(
          q, k, v, **{"block_size": 2, "causal": True, **kw}),
      "logsparse": lambda q=good, k=good, v=good, **kw: combiner.logsparse(q, k, v, **{"causal": True, **kw}),
      "axial": lambda q=good, k=good, v=good, **kw: combiner.axial(
          q, k, v, **{"row_length": 2, "direction": "rowmajor", "causal": True, **kw}),
      "mixture": lambda q=good, k=good, v=good, **kw: combiner.mixture(
          q, k, v, **{"row_length": 2, "causal": True, **kw}),
  }
  cases = []
  for name, call in ops.items():
    cases += [
        (f"{name} list q", lambda c=call: c(q=[[1.0]]), TypeError, "'q'"),
        (f"{name} rank-3 q", lambda c=call: c(q=jnp.ones((1, 6, 3))), ValueError, "'q'"),
        (f"{name} k shape", lambda c=call: c(k=jnp.ones((1, 6, 2, 4))), ValueError, "'k'"),
        (f"{name} v length", lambda c=call: c(v=jnp.ones((1, 5, 2, 3))), ValueError, "'v'"),
        (f"{name} mask shape", lambda c=call: c(mask=jnp.ones((1, 5), bool)), ValueError, "'mask'"),
        (f"{name} pooling", lambda c=call: c(pooling="min"), ValueError, "'pooling'"),
        (f"{name} pool_q shape", lambda c=call: c(pool_q=jnp.ones((1, 6, 2, 4)), pool_k=good), ValueError,
         "'pool_q'"),
    ]
  for bad in (0, -1, 2.5):
    cases.append((f"fixed block_size={bad}", lambda b=bad: ops["fixed"](block_size=b), ValueError,
                  "'block_size'"))
    for name in ("axial", "mixture"):
      cases.append((f"{name} row_length={bad}", lambda b=bad, n=name: ops[n](row_length=b), ValueError,
                    "'row_length'"))
  cases.append(("axial direction", lambda: ops["axial"](direction="diagonal"), ValueError, "'direction'"))
  cases.append(("mixture normalize", lambda: ops["mixture"](normalize="sum"), ValueError, "'normalize'"))
  return cases


def raise_failure(what, call, exc, name) -> str | None:
  """None if `call()` raises `exc` with `name` in its message, else a line saying what happened instead."""
  try:
    call()
  except exc as e:
    return None if name in str(e) else f"{what}: message does not name {name}: {e}"
  except Exception as e:  # noqa: BLE001 - any other exception type is a failure to report
    return f"{what}: raised {type(e).__name__} instead of {exc.__name__}: {e}"
  return f"{what}: did not raise"


def test_invalid_arguments_raise_naming_the_parameter():
  failures = [f for case in _bad_calls() if (f := raise_failure(*case))]
  assert not failures, "\n".join(failures)
