"""YOSO's table formulations: the Pallas kernels (interpreted) and the one-hot form equal the sorted table
sums, agree on the same draws, lower for accelerators; the stable sort by code; finite expected
collisions."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.yoso.definitions import seeded_inputs, seeded_key
from yoso.attention import yoso
from yoso.collision import expected_collision


@contextlib.contextmanager
def _interpreted(platform):
  """Yields (dtype, tolerance) for a kernel test: float64 in the generic Pallas interpreter (None, exact), or
  float32 with the TPU branch in the TPU interpreter (no float64 there: float32 operands, split in two
  bfloat16 parts, give about 2^-16), which also checks that the kernel made no race."""
  from attention_core import pallas
  if platform is None:
    with jax.enable_x64(True):
      yield np.float64, 1e-12
    return
  with pallas.simulate(platform, detect_races=True):
    yield np.float32, 1e-4
  assert not pallas.races_found()


def _close(got, want, tol):
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.max(np.abs(want))))


@pytest.mark.parametrize("length,platform", [(1, None), (130, None), (130, "tpu")])
def test_kernels_equal_the_table_sums(length, platform, monkeypatch):
  # build sums (weighted) rows per bucket, read sums (weighted) table rows over hashes, codes >= buckets
  # write and read nothing; two row sets share one one-hot; a length past one tile pads. On TPU the build
  # walks its rows in chunks and the read takes its hashes one per chunk (partial sums, summed after).
  from attention_core import pallas
  from yoso import kernels
  monkeypatch.setattr(kernels, "BUILD_ROWS", 128)
  monkeypatch.setattr(kernels, "READ_TABLES_VMEM", 1)
  rng = np.random.default_rng(length)
  g, m, buckets = 2, 3, 8
  wcodes = rng.integers(0, buckets + 1, size=(g, m, length)).astype(np.int32)  # buckets: no bucket
  rcodes = rng.integers(0, buckets + 1, size=(g, m, length)).astype(np.int32)
  rows_a, rows_b = rng.normal(size=(g, length, 5)), rng.normal(size=(g, length, 3))
  w_build, w_read = rng.normal(size=(g, m, length)), rng.normal(size=(g, m, length))
  onehot_w = (wcodes[..., None] == np.arange(buckets)).astype(float)  # [g, m, L, B]
  onehot_r = (rcodes[..., None] == np.arange(buckets)).astype(float)
  want_a = np.einsum("gmlc,gle->gmce", onehot_w, rows_a)
  want_b = np.einsum("gmlc,gml,gle->gmce", onehot_w, w_build, rows_b)

  with _interpreted(platform) as (dtype, tol):
    tables = kernels.build(jnp.asarray(wcodes), [jnp.asarray(rows_a, dtype), jnp.asarray(rows_b, dtype)],
                           jnp.asarray(w_build, dtype), [False, True], buckets=buckets, operands="float32")
    assert platform is None or not pallas.races_found()  # the detector's state is the last kernel's
    outs = kernels.read(jnp.asarray(rcodes), [jnp.asarray(want_a, dtype), jnp.asarray(want_b, dtype)],
                        jnp.asarray(w_read, dtype), [True, False], operands="float32")
  _close(tables[0], want_a, tol)
  _close(tables[1], want_b, tol)
  _close(outs[0], np.einsum("gmlc,gml,gmce->gle", onehot_r, w_read, want_a), tol)
  _close(outs[1], np.einsum("gmlc,gmce->gle", onehot_r, want_b), tol)


@pytest.mark.parametrize("la,lb,codes,platform", [
    (300, 260, 3, None), (300, 260, 3, "tpu"),
    pytest.param(130, 5, 40, None, marks=pytest.mark.slow),
    pytest.param(130, 5, 40, "tpu", marks=pytest.mark.slow),
    pytest.param(1, 1, 1, None, marks=pytest.mark.slow)])
def test_pair_sums_equal_the_colliding_pairs(la, lb, codes, platform):
  # out_a = sum_b [code_a = code_b] (x_a . y_b) z_b over code-sorted rows, with runs of one code across
  # several tiles (3 codes), codes the other side lacks (40 codes, 5 rows), a ragged tile. On TPU the kernel
  # copies its range's tiles from HBM itself, into two slots.
  from yoso import kernels
  rng = np.random.default_rng(la + lb)
  a_codes = np.sort(rng.integers(0, codes, size=(2, la)), axis=1).astype(np.int32)
  b_codes = np.sort(rng.integers(0, codes, size=(2, lb)), axis=1).astype(np.int32)
  x, y, z = rng.normal(size=(2, la, 5)), rng.normal(size=(2, lb, 5)), rng.normal(size=(2, lb, 3))
  want = np.einsum("gab,gae,gbe,gbd->gad", a_codes[:, :, None] == b_codes[:, None, :], x, y, z)
  with _interpreted(platform) as (dtype, tol):
    got = kernels.pair_sums(jnp.asarray(a_codes), jnp.asarray(x, dtype), jnp.asarray(b_codes),
                            jnp.asarray(y, dtype), jnp.asarray(z, dtype), operands="float32")
  _close(got, want, tol)


def test_kernel_operands_split_float32_in_two_bfloat16_parts():
  # float32 rows and weights go to the matmuls as hi + lo bfloat16 parts: relative error near 2^-16, far
  # below bfloat16's 2^-8, which the "bfloat16" operands give.
  from yoso import kernels
  rng = np.random.default_rng(0)
  codes = jnp.asarray(rng.integers(0, 4, size=(1, 2, 200)), jnp.int32)
  rows = jnp.asarray(rng.normal(size=(1, 200, 16)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(1, 2, 200)), jnp.float32)
  want = np.einsum("gmlc,gml,gle->gmce", np.asarray(codes)[..., None] == np.arange(4), np.asarray(weights),
                   np.asarray(rows, np.float64))
  errors = {}
  for operands in kernels.OPERANDS:
    (table,) = kernels.build(codes, [rows], weights, buckets=4, operands=operands)
    errors[operands] = float(np.max(np.abs(np.asarray(table) - want)) / np.max(np.abs(want)))
  assert errors["float32"] < 1e-5 < 1e-3 < errors["bfloat16"] < 2e-2, errors


# The fast run keeps one formulation with features; the others run with -m slow.
@pytest.mark.parametrize("formulation,features", [pytest.param("onehot", None, marks=pytest.mark.slow),
                                                  pytest.param("onehot", 2, marks=pytest.mark.slow),
                                                  pytest.param("pallas", None, marks=pytest.mark.slow),
                                                  pytest.param("pallas", 2, marks=pytest.mark.slow)])
def test_formulations_agree_on_the_same_draws(formulation, features, monkeypatch):
  # Sorted tables, one-hot matmuls and the fused kernels: the same codes, so the same estimate and gradients
  # up to float32 rounding (float32 operands go to the matmuls as two bfloat16 parts: relative error near
  # 2^-16).
  from yoso import backward as ya
  monkeypatch.setattr(ya, "COUNTS_MAX_LENGTH", 0)  # the LSH tables, not the short-sequence counts
  q, k, v = seeded_inputs(4, b=2, length=40, d=8, e=6, dtype=jnp.float32)
  mask = jnp.ones((2, 40), bool).at[1, 30:].set(False)
  v = v.at[1, 33].set(jnp.nan)  # behind the mask: reaches nothing
  cot = jnp.asarray(np.random.default_rng(0).normal(size=v.shape), jnp.float32)

  def run(formulation):
    def fn(q, k, v):
      return yoso(q, k, v, rng=seeded_key(5), num_hashes=4, tau=4, mask=mask, backward_features=features,
                  formulation=formulation)

    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(cot))

  for name, got, want in zip(["out", "dq", "dk", "dv"], run(formulation), run("sorted"), strict=True):
    assert np.all(np.isfinite(got)), name
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


@pytest.mark.all_platforms
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("features", [None, 1])
def test_pallas_formulation_lowers_for_accelerators(platform, features):
  # bf16 inputs, L above the short-sequence threshold: forward and forward+backward carry the kernels.
  from yoso import backward as ya
  shape = jax.ShapeDtypeStruct((1, ya.COUNTS_MAX_LENGTH + 100, 2, 64), jnp.bfloat16)

  def forward(q, k, v):
    return yoso(q, k, v, rng=jax.random.key(0), num_hashes=4, tau=8, formulation="pallas",
                backward_features=features)

  def fwdbwd(q, k, v):
    return jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  for fn in (forward, fwdbwd):
    module = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        shape, shape, shape).mlir_module()
    assert marker in module, f"no Pallas kernel in the {platform} program"
  assert ("_pair_kernel" in module) == (features is None)  # the exact dQ/dK's code-sorted pair sums


@pytest.mark.all_platforms
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_onehot_formulation_lowers_for_accelerators(platform):
  # bf16 inputs, L above the short-sequence threshold: forward and forward+backward (tables for dV, dQ, dK).
  from yoso import backward as ya
  shape = jax.ShapeDtypeStruct((1, ya.COUNTS_MAX_LENGTH + 512, 2, 64), jnp.bfloat16)

  def forward(q, k, v):
    return yoso(q, k, v, rng=jax.random.key(0), num_hashes=4, tau=8, formulation="onehot")

  def fwdbwd(q, k, v):
    return jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  for fn in (forward, fwdbwd):
    module = jax.export.export(jax.jit(fn), platforms=[platform])(shape, shape, shape).mlir_module()
    assert "dot_general" in module


def test_sort_by_code_is_a_stable_sort_in_both_forms():
  # Packed int32 keys (code * L + row) when they fit, argsort otherwise (tau = 24 tables): same order.
  from yoso import tables as ya
  rng = np.random.default_rng(7)
  for buckets, length in ((257, 1000), ((1 << 24) + 1, 300)):
    assert (buckets * length < 2**31) == (buckets == 257)
    codes = rng.integers(0, min(buckets, 40), size=length)  # few distinct codes: many ties to keep in order
    order, sorted_codes = jax.jit(ya._sort_by_code, static_argnums=1)(jnp.asarray(codes, jnp.int32), buckets)
    want = np.argsort(codes, kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(sorted_codes, codes[want])


def test_expected_collision_is_finite_at_parallel_vectors():
  c = jnp.array([1.0, -1.0, 1.0000001, 0.3], jnp.float32)
  p, g = jax.value_and_grad(lambda c: jnp.sum(expected_collision(c, 8)))(c)
  assert np.isfinite(p) and np.all(np.isfinite(np.asarray(g)))
