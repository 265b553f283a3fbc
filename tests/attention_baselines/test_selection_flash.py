"""The selected-blocks kernel (attention_baselines/selection_flash.py) in interpret mode on CPU.

Against a from-definition float64 softmax over each query's set (its chosen blocks, or every block, with the
causal and window rules and the key mask): outputs and gradients, several query tiles, several key tiles per
block (tile caps shrunk to 16), a ragged last block. MoBA's and NSA's implementation="pallas" against their
XLA paths and numpy definitions (float64; MoBA in both directions, NSA with gates and compression MLPs), with
NaN/Inf behind masks inert, no future dependence (Jacobian), the "auto" choice made per platform, and the
kernels' lowering for CUDA (Triton); the TPU compile is the registry's test
(tests/attention_core/test_tpu_kernels_compile.py -k "moba or nsa").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines import selection_flash
from attention_baselines.moba import moba
from attention_baselines.nsa import nsa
from attention_core import contract, pallas
from tests.attention_baselines.definitions import inputs
from tests.attention_baselines.test_moba import reference as moba_reference
from tests.attention_baselines.test_nsa import PLAN as NSA_PLAN
from tests.attention_baselines.test_nsa import _mlps as nsa_mlps
from tests.attention_baselines.test_nsa import reference as nsa_reference

TRITON_OK = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
FAST_COMPILE = (("xla_backend_optimization_level", 0),)  # interpreted kernels compile slowly


def definition(q, k, v, real, ids, *, block, causal, window, scale, key_stride=1, key_offset=0):
  """Softmax of query i over the keys j of its set: real[j], j's block among ids[i] (every block for None),
  position p_j = j * key_stride + key_offset <= i when causal, p_j > i - window when window > 0. q [rows, P,
  d], k [rows, N, d]: jnp float64, so that its gradients are the definition's too."""
  n, length = k.shape[1], q.shape[1]
  kpos, qpos = jnp.arange(n) * key_stride + key_offset, jnp.arange(length)[:, None]
  ok = real[:, None, :]
  if causal:
    ok = ok & (kpos <= qpos)
  if window:
    ok = ok & (kpos > qpos - window)
  if ids is not None:
    ok = ok & jnp.any(ids[..., None] == (jnp.arange(n) // block), axis=-2)  # [rows, P, N]
  s = jnp.where(ok, jnp.einsum("rqd,rkd->rqk", q, k) * scale, -jnp.inf)
  top = jnp.max(s, axis=-1, keepdims=True)
  w = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  den = jnp.sum(w, axis=-1, keepdims=True)
  return jnp.einsum("rqk,rke->rqe", w / jnp.where(den > 0, den, 1.0), v)


def _random_case(seed, *, rows, length, block, causal, chosen):
  g = np.random.default_rng(seed)
  nb = -(-length // block)
  n = nb * block
  q = jnp.asarray(g.normal(size=(rows, length, 5)))
  k = jnp.asarray(g.normal(size=(rows, n, 5)))
  v = jnp.asarray(g.normal(size=(rows, n, 6)))
  real = jnp.asarray((g.random((rows, n)) < 0.8) & (np.arange(n) < length))
  ids = None
  if chosen:  # random choices (-1 = unused slot), the own block always among them, causal: none after it
    own = np.arange(length) // block
    ids = g.integers(-1, nb, size=(rows, length, chosen))
    if causal:
      ids = np.where(ids > own[None, :, None], -1, ids)
    ids[:, :, 0] = own
    ids = jnp.asarray(ids, jnp.int32)
  return q, k, v, real, ids


# (causal, window, chosen blocks per query or 0 = every block, block). Tile caps of 16 give several query
# tiles and, for blocks over 16 keys, several key tiles per block, with its ragged padding.
KERNEL_CASES = [(True, 0, 3, 3), (False, 0, 2, 40), (True, 9, 0, 20)]


@pytest.mark.parametrize("stride,offset,also_window", [(3, 5, 0), (2, 3, 6),
                                                       pytest.param(1, 0, 11, marks=pytest.mark.slow)])
def test_strided_key_positions_and_a_second_window_softmax(monkeypatch, stride, offset, also_window):
  """Keys at positions j * stride + offset under the causal rule (NSA's compressed blocks), and with
  also_window a second softmax in the same pass over the keys inside the window (NSA's window branch): each
  output and the gradients of their sum equal the definition's, float64, several tiles."""
  monkeypatch.setattr(selection_flash, "TILE_CAPS", (16, 16))
  with jax.enable_x64(True):
    q, k, v, real, ids = _random_case(stride + offset, rows=2, length=37, block=4, causal=True, chosen=2)
    plan = dict(block=4, causal=True, window=0, scale=0.4, key_stride=stride, key_offset=offset)
    cots = [jnp.asarray(np.random.default_rng(i).normal(size=(2, 37, 6))) for i in (1, 2)]

    def kernel(q, k, v):
      out = selection_flash.attend(q, k, v, real, ids, **plan, also_window=also_window)
      return out if also_window else (out,)

    def want(q, k, v):
      outs = [definition(q, k, v, real, ids, **plan)]
      if also_window:
        outs.append(definition(q, k, v, real, None, **dict(plan, window=also_window)))
      return tuple(outs)

    def loss(f, q, k, v):
      return sum(jnp.sum(o * c) for o, c in zip(f(q, k, v), cots, strict=False))

    got, expected = jax.jit(kernel)(q, k, v), jax.jit(want)(q, k, v)
    for a, b in zip(got, expected, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    grads = [jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1, 2)))(q, k, v)
             for f in (kernel, want)]
    _close(grads[0], grads[1], 1e-11, 1e-12)


@pytest.mark.slow  # ~5 s a case in interpret mode on a loaded 2-core machine
@pytest.mark.parametrize("causal,window,chosen,block", KERNEL_CASES)
def test_kernel_equals_the_definition_in_float64(monkeypatch, causal, window, chosen, block):
  monkeypatch.setattr(selection_flash, "TILE_CAPS", (16, 16))
  with jax.enable_x64(True):
    q, k, v, real, ids = _random_case(block + 10 * chosen, rows=3, length=37, block=block, causal=causal,
                                      chosen=chosen)
    plan = dict(block=block, causal=causal, window=window, scale=0.4)

    def both(q, k, v, cot):
      got = selection_flash.attend(q, k, v, real, ids, **plan)
      want = definition(q, k, v, real, ids, **plan)
      grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2))(q, k, v) for f in (
          lambda q, k, v: selection_flash.attend(q, k, v, real, ids, **plan),
          lambda q, k, v: definition(q, k, v, real, ids, **plan))]
      return got, want, grads

    cot = jnp.asarray(np.random.default_rng(1).normal(size=(3, 37, 6)))
    got, want, (g_got, g_want) = jax.jit(both)(q, k, v, cot)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    for a, b in zip(g_got, g_want, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


@functools.cache
def _moba(implementation, causal, block_size=3, top_k=2, options=()):
  """jit of (q, k, v, mask, cot) -> (out, d sum(out * cot) / d(q, k, v)) of moba (compiled once per run)."""
  def run(q, k, v, mask, cot):
    f = lambda q, k, v: moba(q, k, v, causal=causal, mask=mask, block_size=block_size,  # noqa: E731
                             top_k=top_k, implementation=implementation)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cot)
  return jax.jit(run, compiler_options=dict(options) or None)


def _close(got, want, rtol, atol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def check_inert_and_causal(run, q, k, v, mask, cot, causal, *, rtol, atol, extra=()):
  """run(q, k, v, mask, *extra, cot) -> (out, grads): NaN keys and Inf values at masked positions change no
  output and get no gradient; causal: for i = 1, 4, 7, ... (inside blocks and at their ends for blocks of
  2, 3 and 4), outputs up to i ignore NaN keys and values after i, and a cotangent on outputs up to i gives
  those keys and values no gradient (the Jacobian's blocks above the diagonal are zero)."""
  clean, g_clean = run(q, k, v, mask, *extra, cot)
  bad = ~mask[:, :, None, None]
  out, grads = run(q, jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v), mask, *extra, cot)
  _close((out, grads), (clean, g_clean), rtol, atol)
  assert not np.any(np.asarray(grads[1])[~np.asarray(mask)]) and not np.any(np.asarray(grads[2])[~np.asarray(
      mask)])
  if not causal:
    return
  length = q.shape[1]
  for i in range(1, length - 1, 3):
    future = (jnp.arange(length) > i)[None, :, None, None]
    out, _ = run(q, jnp.where(future, jnp.nan, k), jnp.where(future, jnp.nan, v), mask, *extra, cot)
    np.testing.assert_allclose(out[:, :i + 1], clean[:, :i + 1], rtol=rtol, atol=atol)
    _, grads = run(q, k, v, mask, *extra, jnp.where(future, 0.0, cot))
    for g in grads[1:3]:
      assert not np.any(np.asarray(g)[:, i + 1:]), i


def test_moba_kernel_equals_xla_is_inert_behind_masks_and_causal():
  """float32, causal, masked keys: outputs and gradients equal the XLA path's; NaN/Inf at masked keys and
  after each query are inert (`check_inert_and_causal`)."""
  q, k, v, mask = inputs(3, length=13, dtype=jnp.float32)
  cot = jax.random.normal(jax.random.key(4), v.shape, jnp.float32)
  kernel = _moba("pallas", True, options=FAST_COMPILE)
  _close(kernel(q, k, v, mask, cot), _moba("xla", True)(q, k, v, mask, cot), 1e-4, 1e-5)
  check_inert_and_causal(kernel, q, k, v, mask, cot, True, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # the kernel's and the XLA path's compiles, ~15 s on a loaded 2-core machine
def test_moba_kernel_bidirectional_equals_xla_and_definition_in_float64():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(9, length=13)
    cot = jax.random.normal(jax.random.key(6), v.shape, jnp.float64)
    got = _moba("pallas", False, 4, 2)(q, k, v, mask, cot)
    np.testing.assert_allclose(got[0], moba_reference(q, k, v, mask, causal=False, block_size=4, top_k=2),
                               rtol=1e-10, atol=1e-12)
    _close(got, _moba("xla", False, 4, 2)(q, k, v, mask, cot), 1e-10, 1e-12)
    check_inert_and_causal(_moba("pallas", False, 4, 2), q, k, v, mask, cot, False, rtol=1e-12, atol=1e-13)


def test_auto_chooses_per_platform():
  """"auto": the kernel on GPU and TPU (on TPU at any length: it copies in only the blocks it reads), XLA on
  CPU; "xla" and "pallas" as asked; an unknown value is the op's to reject."""
  choose = functools.partial(selection_flash.choose_implementation, op="t")
  for platform, auto in {"cpu": "xla", "gpu": "pallas", "tpu": "pallas"}.items():
    with contract.traced_for(platform):
      assert choose("auto") == auto, platform
      assert choose("xla") == "xla"
      assert choose("pallas") == "pallas"
  assert choose("flash") == "flash"
  for op in (moba, nsa):
    with pytest.raises(ValueError, match="'implementation'"):
      op(*(jnp.zeros((1, 8, 1, 4)),) * 3, causal=True, implementation="flash")


@pytest.mark.all_platforms
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])  # ~2 s each
def test_moba_kernel_lowers_for_cuda(causal):
  """Forward and forward+backward exported for CUDA hold the Triton kernels (1 and 3 of them), traced as on a
  GPU (its tiles) from this CPU host."""
  fn = lambda q, k, v: moba(q, k, v, causal=causal, block_size=64, top_k=3)  # noqa: E731  ("auto")
  spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

  def fwd_bwd(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  for f, kernels in ((fn, 1), (fwd_bwd, 3)):
    text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=TRITON_OK)(
        spec, spec, spec).mlir_module()
    assert text.count("xla.gpu.triton") == kernels and "tpu_custom_call" not in text


def _nsa(implementation, **kwargs):
  """jit of (q, k, v, mask, gates, cot) -> (out, d sum(out * cot) / d(q, k, v, gates)) of nsa."""
  def run(q, k, v, mask, gates, cot):
    f = lambda q, k, v, g: nsa(q, k, v, causal=True, mask=mask, gates=g, **NSA_PLAN,  # noqa: E731
                               implementation=implementation, **kwargs)
    out, vjp = jax.vjp(f, q, k, v, gates)
    return out, vjp(cot)
  return jax.jit(run)


@pytest.mark.slow  # the kernel's (two calls: selection, window) and the XLA path's compiles, ~30 s loaded
def test_nsa_kernel_equals_xla_and_definition_in_float64():
  """Selection and window branches through the kernel: outputs and gradients (q, k, v, gates) equal the XLA
  path's, outputs the numpy definition's (with the compression MLPs); inert behind masks, causal."""
  with jax.enable_x64(True):
    q, k, v, mask = inputs(12, length=14)
    gates = jax.random.uniform(jax.random.key(13), (*q.shape[:3], 3), jnp.float64)
    cot = jax.random.normal(jax.random.key(14), v.shape, jnp.float64)
    key_mlp, value_mlp, kwargs = nsa_mlps(2, 4, 3)
    kernel = _nsa("pallas", **kwargs)
    got = kernel(q, k, v, mask, gates, cot)
    np.testing.assert_allclose(got[0], nsa_reference(q, k, v, mask, **NSA_PLAN, gates=gates, key_mlp=key_mlp,
                                                     value_mlp=value_mlp), rtol=1e-10, atol=1e-12)
    _close(got, _nsa("xla", **kwargs)(q, k, v, mask, gates, cot), 1e-10, 1e-12)
    check_inert_and_causal(kernel, q, k, v, mask, cot, True, rtol=1e-12, atol=1e-13, extra=(gates,))


@pytest.mark.slow  # the TPU interpreter: ~15 s on a loaded 2-core machine
def test_moba_kernel_tpu_branch_in_the_tpu_interpreter():
  """The TPU branch (each program's block list in SMEM, its blocks copied in from HBM) in JAX's TPU
  interpreter, with its race detector: three query tiles of 16, outputs and gradients equal the XLA path's."""
  q, k, v, mask = inputs(17, batch=1, length=36, dtype=jnp.float32)
  cot = jax.random.normal(jax.random.key(18), v.shape, jnp.float32)
  with pallas.simulate("tpu", detect_races=True):
    got = jax.block_until_ready(_moba("auto", True, options=FAST_COMPILE)(q, k, v, mask, cot))
    assert not pallas.races_found()
  _close(got, _moba("xla", True)(q, k, v, mask, cot), 1e-4, 1e-5)
