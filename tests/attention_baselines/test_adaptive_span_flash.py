"""The adaptive-span kernels (attention_baselines/adaptive_span_flash.py), implementation="pallas", against
the op's XLA path: float64 interpret mode with tiles of 8 (several query and key tiles, a ragged last one),
outputs and the gradients of q, k, v, the spans and the relative position table, causal and bidirectional, key
masks, value_dim != head_dim, a memory before the segment, spans at 0 and at max_span (the one-sided d/dz);
the TPU kernels (HBM tiles copied by the kernels) in the TPU interpreter with its race detector; NaN and Inf
behind masks and after the query inert; "auto" per platform; the Triton lowering for CUDA; and libtpu
compiles: the whole gradient on v5e (v4, v5p, v6e with -m slow) and fwd+bwd at L = 4096 within 3x Splash's
device ops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines import adaptive_span_flash
from attention_baselines.adaptive_span import adaptive_span, choose_implementation
from attention_core import contract, pallas
from attention_core import registry as ops_registry
from tests.attention_baselines.definitions import inputs
from tests.attention_baselines.test_selection_flash import TRITON_OK, check_inert_and_causal

PLAN = dict(max_span=9, ramp=2.5)
SPLASH_DENSE_OPS = 58  # Splash attention, fwd+bwd at L = 4096 on v5e (docs/benchmarks.md)


@functools.cache
def _grads(implementation, causal, positions, memory, dtype=jnp.float64):
  """jit((q, k, v, mask, spans, table, cot) -> (out, grads of sum(out * cot) w.r.t. q, k, v, spans and, with
  positions, the table))."""
  def loss(q, k, v, mask, z, p, cot):
    out = adaptive_span(q, k, v, mask=mask, spans=z, causal=causal, positions=p if positions else None,
                        implementation=implementation, block_size=5, **PLAN)
    return jnp.sum(out * cot), out

  args = (0, 1, 2, 4, 5) if positions else (0, 1, 2, 4)
  return jax.jit(jax.grad(loss, argnums=args, has_aux=True))


def _case(seed, memory, length=21, dtype=jnp.float64):
  q, _, _, _ = inputs(seed, length=length, dtype=dtype)
  _, k, v, mask = inputs(seed + 1, length=length + memory, dtype=dtype)
  table = jax.random.normal(jax.random.key(seed + 2), (2, 12, q.shape[-1]), dtype)
  cot = jax.random.normal(jax.random.key(seed + 3), (*q.shape[:3], v.shape[-1]), dtype)
  return q, k, v, mask, table, cot


# Fast: causal with positions and a memory, bidirectional with positions; spans on the corners (0, max_span)
# and between them. The others repeat them with -m slow (a compilation of each path).
CASES = [pytest.param(*c, marks=() if fast else pytest.mark.slow) for *c, fast in [
    (True, True, 11, (0.0, 9.0), True), (False, True, 0, (1.3, 6.6), True),
    (True, False, 0, (1.3, 6.6), False), (False, False, 0, (0.0, 9.0), False),
    (True, True, 0, (2.0, 4.5), False), (True, False, 30, (6.6, 0.0), False)]]


@pytest.mark.parametrize("causal,positions,memory,spans", CASES)
def test_kernels_equal_the_xla_path(causal, positions, memory, spans, monkeypatch):
  monkeypatch.setitem(adaptive_span_flash.TILE_CAPS, "cpu", 8)
  with jax.enable_x64(True):
    q, k, v, mask, table, cot = _case(3 + memory, memory)
    z = jnp.asarray(spans)
    want_grads, want = _grads("xla", causal, positions, memory)(q, k, v, mask, z, table, cot)
    got_grads, got = _grads("pallas", causal, positions, memory)(q, k, v, mask, z, table, cot)
    real = np.asarray(mask)[:, memory:, None, None]  # padded query rows are don't-care
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert np.all(np.abs(np.asarray(want_grads[3])) > 1e-6)  # both heads' spans are in the gradient


@pytest.mark.slow  # the TPU interpreter: ~35 s
def test_tpu_kernels_in_the_tpu_interpreter(monkeypatch):
  """The TPU branch (tiles copied from HBM by the kernels, two slots) with the race detector, float32,
  causal with positions and a memory, tiles of 8."""
  monkeypatch.setitem(adaptive_span_flash.TILE_CAPS, "tpu", 8)
  q, k, v, mask, table, cot = _case(5, 13, length=37, dtype=jnp.float32)
  z = jnp.array([9.0, 2.0])
  want_grads, want = _grads("xla", True, True, 13, jnp.float32)(q, k, v, mask, z, table, cot)

  def loss(q, k, v, z, p):
    out = adaptive_span(q, k, v, mask=mask, spans=z, causal=True, positions=p, implementation="pallas",
                        **PLAN)
    return jnp.sum(out * cot), out

  with pallas.simulate("tpu", detect_races=True):
    got_grads, got = jax.block_until_ready(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, k, v, z, table))
    assert not pallas.races_found()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_masked_and_future_nonfinite_keys_are_inert(monkeypatch):
  """float32, causal, with positions: NaN keys and Inf values at masked positions and after each query
  change no output and get no gradient (`check_inert_and_causal`)."""
  monkeypatch.setitem(adaptive_span_flash.TILE_CAPS, "cpu", 8)
  q, k, v, mask, table, cot = _case(7, 0, length=13, dtype=jnp.float32)
  z = jnp.array([3.0, 6.6])

  @jax.jit
  def run(q, k, v, mask, cot):
    f = lambda q, k, v: adaptive_span(q, k, v, mask=mask, spans=z, causal=True, positions=table,  # noqa: E731
                                      implementation="pallas", **PLAN)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cot)

  check_inert_and_causal(run, q, k, v, mask, cot, True, rtol=1e-5, atol=1e-6)


def test_auto_chooses_per_platform():
  """"auto": the kernels on GPU and TPU, XLA on CPU, and XLA on GPUs with positions (no lane rotation in
  Triton), where an explicit "pallas" traced for every platform from this host takes XLA too."""
  expected = {"cpu": ("xla", "xla", "pallas"), "gpu": ("pallas", "xla", "xla"),
              "tpu": ("pallas", "pallas", "pallas")}
  for platform, (plain, with_positions, explicit) in expected.items():
    with contract.traced_for(platform):
      assert choose_implementation("auto", None) == plain, platform
      assert choose_implementation("auto", jnp.zeros(1)) == with_positions, platform
      assert choose_implementation("pallas", jnp.zeros(1), strict=True) == explicit, platform
      assert choose_implementation("xla", None) == "xla"
  with pytest.raises(ValueError, match="'implementation'"):
    adaptive_span(*(jnp.zeros((1, 8, 1, 4)),) * 3, causal=True, spans=jnp.ones(1), max_span=4,
                  implementation="flash")


@pytest.mark.all_platforms
def test_kernels_lower_for_cuda():
  """Forward and forward+backward exported for CUDA hold the Triton kernels (1 and 3), traced as on a GPU
  from this CPU host; with positions the GPU program is the XLA path (no Triton kernel)."""
  spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  params = dict(spans=jnp.array([40.0, 100.0]), max_span=256, ramp=32.0)
  table = jnp.zeros((1, 288, 64), jnp.bfloat16)
  for positions, counts in ((None, (1, 3)), (table, (0, 0))):
    fn = lambda q, k, v, p=positions: adaptive_span(q, k, v, causal=True, positions=p, **params)  # noqa: E731

    def fwd_bwd(q, k, v, fn=fn):
      return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    for f, kernels in zip((fn, fwd_bwd), counts, strict=True):
      text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=TRITON_OK)(
          spec, spec, spec).mlir_module()
      assert text.count("xla.gpu.triton") == kernels and "tpu_custom_call" not in text


def _tpu_program(gen: str, length: int, *, heads: int, head_dim: int, all_grads: bool, causal: bool = True):
  """jax.grad of sum(adaptive_span) compiled for one chip of `gen`, bfloat16, batch 1, implementation="auto",
  with the registry's stand-ins (spans, position table): as constants and gradients of q, k, v, or
  (all_grads) as arguments with theirs too."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from scripts import compile_tpu

  pytest.importorskip("libtpu")  # requirements-tpu-compile.txt
  g = compile_tpu.GENERATIONS[gen]
  device = compile_tpu.devices(compile_tpu.Slice(g, min(g.shapes)))[0]
  spec = ops_registry.get("adaptive_span")
  params = ops_registry.bench_params(spec, length, heads=heads, head_dim=head_dim)
  z, p = params.pop("spans"), params.pop("positions")
  placed = NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), P())
  shaped = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731
  x = shaped((1, length, heads, head_dim), jnp.bfloat16)

  def loss(q, k, v, z, p):
    return jnp.sum(spec.fn(q, k, v, causal=causal, spans=z, positions=p, **params).astype(jnp.float32))

  if all_grads:
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(
        x, x, x, shaped(z.shape, z.dtype), shaped(p.shape, p.dtype)).compile()
  return jax.jit(jax.grad(lambda q, k, v: loss(q, k, v, z, p), argnums=(0, 1, 2))).lower(x, x, x).compile()


@pytest.mark.all_platforms
@pytest.mark.parametrize("gen", ["v5e", *(pytest.param(g, marks=pytest.mark.slow) for g in ("v4", "v5p",
                                                                                            "v6e"))])
def test_every_kernel_compiles_for_tpu(gen):
  """All four kernels (forward, dq, dk/dv, the position table's gradient) at a ragged length, both
  directions."""
  for causal in (True, False):
    text = _tpu_program(gen, 1000, heads=2, head_dim=64, all_grads=True, causal=causal).as_text()
    assert text.count("tpu_custom_call") >= 4


@pytest.mark.all_platforms
def test_device_ops_within_three_times_splash():
  """v5e, L = 4096, bfloat16, 16 heads of 128, causal, fwd+bwd of the sum (q, k, v): at most 3x Splash dense's
  58 device ops (the XLA path's loop over key-block offsets ran about 800)."""
  from attention_core.hlo import device_ops

  found = device_ops(_tpu_program("v5e", 4096, heads=16, head_dim=128, all_grads=False).as_text())
  assert found.ops <= 3 * SPLASH_DENSE_OPS, found
