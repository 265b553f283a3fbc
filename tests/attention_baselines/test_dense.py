"""Dense baseline: matches a from-definition softmax in float64, causal and key masks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.dense import dense
from attention_core import contract
from tests.attention_baselines import definitions


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 3, 8])
def test_dense_matches_definition(causal, length):
  with jax.enable_x64(True):
    ks = jax.random.split(jax.random.key(length), 4)
    q, k = (jax.random.normal(kk, (2, length, 3, 4), jnp.float64) for kk in ks[:2])
    v = jax.random.normal(ks[2], (2, length, 3, 5), jnp.float64)
    mask = jax.random.bernoulli(ks[3], 0.7, (2, length)).at[:, 0].set(True)
    out = dense(q, k, v, causal=causal, mask=mask)
    assert out.dtype == jnp.float64
    expected = definitions.masked_softmax(q, k, v, definitions.causal_allowed(length, causal), mask)
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


def test_dense_rejects_bad_input():
  q = jnp.ones((1, 4, 2, 3))
  with pytest.raises(ValueError, match="'v'"):
    dense(q, q, jnp.ones((1, 5, 2, 3)), causal=True)
  with pytest.raises(ValueError, match="'mask'"):
    dense(q, q, q, causal=True, mask=jnp.ones((1, 3), bool))
  with pytest.raises(TypeError, match="'q'"):
    dense([1, 2], q, q, causal=True)
  # An additive float mask (0 = keep, -inf = drop) cast to bool would mean the opposite: refused.
  with pytest.raises(TypeError, match="'mask' must be a bool"):
    dense(q, q, q, causal=True, mask=jnp.array([[0.0, 0.0, -jnp.inf, -jnp.inf]]))
  ints = dense(q, q, q, causal=True, mask=jnp.array([[1, 1, 0, 1]]))  # integer 0/1 masks stay accepted
  bools = dense(q, q, q, causal=True, mask=jnp.array([[True, True, False, True]]))
  np.testing.assert_array_equal(ints, bools)


@pytest.mark.parametrize("value_dim", [4, 7, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_xla_matches_dense(causal, value_dim):
  """Also where value_dim != head_dim (4), wider or narrower: jax's op takes one dim, the op pads."""
  from attention_baselines.dense import dense_xla
  ks = jax.random.split(jax.random.key(7), 4)
  q, k = (jax.random.normal(kk, (2, 6, 2, 4)) for kk in ks[:2])
  v = jax.random.normal(ks[2], (2, 6, 2, value_dim))
  mask = jnp.array([[True] * 6, [True, True, False, True, False, False]])
  got = dense_xla(q, k, v, causal=causal, mask=mask)
  assert got.shape == v.shape
  np.testing.assert_allclose(got, dense(q, k, v, causal=causal, mask=mask), rtol=1e-5, atol=1e-6)


# The fused paths. Their kernels need an accelerator, so on CPU the tests check (a) which path each backend,
# dtype and shape gets, (b) the cuDNN path's key-mask coordinate through jax.nn.dot_product_attention's XLA
# implementation, (c) the TPU path through Splash attention in interpret mode, and (d) that both lower for
# their platform (jax.export), forward and forward+backward.


def _inputs(key, shape, dtype=jnp.float32, value_dim=None):
  ks = jax.random.split(jax.random.key(key), 3)
  q, k = (jax.random.normal(kk, shape, dtype) for kk in ks[:2])
  v = jax.random.normal(ks[2], shape[:3] + (value_dim or shape[3],), dtype)
  return q, k, v


def test_fused_kernel_dispatch():
  from attention_baselines.dense import fused_kernel

  bf16, f32, f64 = jnp.bfloat16, jnp.float32, jnp.float64
  assert fused_kernel("gpu", (bf16,) * 3, 64, 64, masked=True) == ("cudnn", "")
  assert fused_kernel("gpu", (jnp.float16,) * 3, 64, 64, masked=False)[0] == "cudnn"
  assert fused_kernel("tpu", (bf16,) * 3, 64, 64, masked=True) == ("splash", "")
  assert fused_kernel("tpu", (f32,) * 3, 64, 64, masked=False)[0] == "splash"
  assert fused_kernel("tpu", (bf16,) * 3, 64, 32, masked=False)[0] == "splash"  # value_dim != head_dim
  for platform, dtypes, d, e, masked in [
      ("cpu", (bf16,) * 3, 64, 64, False),  # no fused kernel on CPU
      ("gpu", (f32,) * 3, 64, 64, False),  # cuDNN takes 16-bit inputs only
      ("gpu", (bf16, bf16, f32), 64, 64, False),  # mixed dtypes
      ("tpu", (f64,) * 3, 64, 64, False),
      ("gpu", (bf16,) * 3, 64, 32, False),  # value_dim != head_dim
      ("tpu", (jnp.float16,) * 3, 64, 64, False),  # Mosaic does not load float16
      ("gpu", (bf16,) * 3, 60, 60, False),  # not a multiple of 8
      ("gpu", (bf16,) * 3, 128, 128, True),  # 128 + the mask coordinate > 128 before Hopper
  ]:
    kernel, reason = fused_kernel(platform, dtypes, d, e, masked=masked)
    assert kernel is None and reason
  assert fused_kernel("gpu", (bf16,) * 3, 128, 128, masked=True, max_head_dim=256)[0] == "cudnn"


@pytest.mark.parametrize("platform, dtype, value_dim, expected", [
    ("cpu", jnp.bfloat16, 8, "xla"), ("gpu", jnp.bfloat16, 8, "cudnn"), ("gpu", jnp.float32, 8, "xla"),
    ("tpu", jnp.float32, 8, "splash"), ("tpu", jnp.float16, 8, "xla")])
def test_dense_auto_picks_the_backend_kernel(monkeypatch, platform, dtype, value_dim, expected):
  from attention_baselines import dense as dense_module

  called = []

  def spy(name):  # records the path; the fused ones return zeros (their kernels need the accelerator)
    real = getattr(dense_module, name)

    def fn(q, k, v, *rest):
      called.append(name)
      return real(q, k, v, *rest) if name == "_xla" else jnp.zeros(v.shape, v.dtype)
    return fn

  for name in ("_xla", "_cudnn", "_splash"):
    monkeypatch.setattr(dense_module, name, spy(name))
  monkeypatch.setattr(contract, "backend", lambda: platform)
  monkeypatch.setattr(dense_module, "_cudnn_available", lambda: True)  # as on a GPU host
  q, k, v = _inputs(0, (1, 4, 2, 8), dtype, value_dim)
  out = dense_module.dense(q, k, v, causal=True)
  assert called == ["_" + expected] and out.shape == v.shape and out.dtype == v.dtype
  called.clear()
  dense_module.dense(q, k, v, causal=True, implementation="xla")
  assert called == ["_xla"]
  if expected == "xla":
    with pytest.raises(ValueError, match="'implementation'='flash'"):
      dense_module.dense(q, k, v, causal=True, implementation="flash")
  with pytest.raises(ValueError, match="'implementation'"):
    dense_module.dense(q, k, v, causal=True, implementation="pallas")


@pytest.mark.parametrize("causal", [pytest.param(True, marks=pytest.mark.slow), False])
def test_cudnn_mask_coordinate_is_exact(monkeypatch, causal):
  # The cuDNN path's arguments, run by jax.nn.dot_product_attention's XLA implementation: the extra key-mask
  # coordinate must reproduce the masked softmax, and NaN in masked keys must not leak.
  from attention_baselines import dense as dense_module

  real = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, **kw: real(*a, **{**kw, "implementation": "xla"}))
  monkeypatch.setattr(contract, "backend", lambda: "gpu")
  monkeypatch.setattr(dense_module, "_cudnn_available", lambda: True)  # as on a GPU host
  q, k, v = _inputs(1, (2, 6, 2, 8), jnp.bfloat16)
  mask = jnp.array([[True, False, True, True, False, True], [False, False, True, False, False, False]])
  k, v = (t.at[:, 1].set(jnp.nan) for t in (k, v))  # masked in both rows
  out = dense_module.dense(q, k, v, causal=causal, mask=mask, implementation="flash")
  ref = dense(q, k, v, causal=causal, mask=mask, implementation="xla")
  assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=2e-2, rtol=2e-2)
  grad = jax.grad(lambda a, b, c: jnp.sum(dense_module.dense(a, b, c, causal=causal, mask=mask,
                                                             implementation="flash").astype(jnp.float32)),
                  argnums=(0, 1, 2))(q, jnp.nan_to_num(k), jnp.nan_to_num(v))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad)


@pytest.mark.all_platforms
@pytest.mark.slow
def test_pallas_tpu_path_in_interpret_mode(monkeypatch):
  # Splash attention, interpreted on CPU: forward and gradients equal the XLA path with a key mask, a
  # length that is not a multiple of the kernel's tile (padded with masked keys), a query with no visible key.
  from jax.experimental.pallas import tpu as pltpu

  from attention_baselines import dense as dense_module

  monkeypatch.setattr(contract, "backend", lambda: "tpu")
  q, k, v = _inputs(2, (1, 100, 1, 16))
  mask = jnp.ones((1, 100), bool).at[0, :3].set(False).at[0, 50].set(False)
  cot = jax.random.normal(jax.random.key(3), v.shape)

  def loss(impl, *qkv):
    return jnp.sum(dense_module.dense(*qkv, causal=True, mask=mask, implementation=impl) * cot)

  with pltpu.force_tpu_interpret_mode():
    out = dense_module.dense(q, k, v, causal=True, mask=mask, implementation="flash")
    grads = jax.grad(functools.partial(loss, "flash"), argnums=(0, 1, 2))(q, k, v)
  ref = dense(q, k, v, causal=True, mask=mask, implementation="xla")
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-4)
  assert float(jnp.max(jnp.abs(out[:, :3]))) == 0.0  # queries 0-2 see no key
  ref_grads = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref_grads, strict=True):
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4)


def _export(fn, platform, *shapes):
  disabled = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")]
  return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(*shapes).mlir_module()


@pytest.mark.all_platforms
@pytest.mark.parametrize("platform, marker", [("tpu", "tpu_custom_call"), ("cuda", "__cudnn$fmhaSoftmax")])
def test_dense_flash_lowers_for_the_accelerator(monkeypatch, platform, marker):
  # bf16, L = 1024, causal with a key mask: forward and forward+backward lower to the fused kernel.
  # jax asks the installed cuDNN for its version while tracing the cuDNN call, and a CPU-only install has no
  # CUDA plugin to answer; the version only selects kernel options, so the test supplies one. cuDNN's custom
  # calls carry no export compatibility guarantee, hence the disabled checks (the test serialises nothing).
  from jax._src.cudnn import fused_attention_stablehlo

  from attention_baselines import dense as dense_module

  monkeypatch.setattr(contract, "backend", lambda: "tpu" if platform == "tpu" else "gpu")
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
  shape = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((1, 1024), jnp.bool_)

  def forward(q, k, v, m):
    return dense_module.dense(q, k, v, causal=True, mask=m, implementation="flash")

  def fwdbwd(q, k, v, m):
    return jax.grad(lambda *a: jnp.sum(forward(*a, m).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  assert marker in _export(forward, platform, shape, shape, shape, mask)
  module = _export(fwdbwd, platform, shape, shape, shape, mask)
  assert marker in module and ("fmhaSoftmaxBackward" in module if platform == "cuda" else True)


@pytest.mark.all_platforms
def test_models_pick_up_the_fused_kernel_with_no_config_change(monkeypatch):
  # The default dense config, bf16 compute: a TPU train-step gradient of the whole LM lowers to the kernel.
  from flax import nnx

  from configs import base
  from models import transformer

  monkeypatch.setattr(contract, "backend", lambda: "tpu")
  c = base.base_config().model
  c.num_layers, c.features, c.num_heads, c.mlp_dim = 1, 128, 2, 64
  c.attention = base.attention_config("dense")
  c.dtype = "bfloat16"
  model = transformer.build_model(c, task="lm", vocab_size=13, seq_len=256)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, ids, mask):
    logits = nnx.merge(graphdef, params, rest)({"inputs": ids, "mask": mask}, deterministic=True)
    return jnp.sum(logits.astype(jnp.float32))

  tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  mask = jax.ShapeDtypeStruct((2, 256), jnp.bool_)
  module = jax.export.export(jax.jit(jax.grad(loss)), platforms=["tpu"])(params, tokens, mask).mlir_module()
  assert "tpu_custom_call" in module
