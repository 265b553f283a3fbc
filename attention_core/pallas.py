"""The one way op packages call Pallas kernels: lowered per platform, with float32-accumulating tile dots.

`platform_call` wraps `pl.pallas_call` in `lax.platform_dependent`, which lowers only the branch of the
platform compiled for: Triton on GPU, Mosaic on TPU, interpret mode on CPU. So one program exports to TPU and
CUDA from a CPU host (the lowering tests) and runs, interpreted, in the CPU test suite. Under
`simulate("tpu")` the CPU branch is the TPU one (its block specs, SMEM scalars, compiler params) run in JAX's
TPU interpreter, which models TPU memory spaces and can detect races: the TPU kernels' test on a CPU host.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attention_core import contract

Array = Any


_SIMULATED: contextvars.ContextVar[Any] = contextvars.ContextVar("simulated", default=None)


@contextlib.contextmanager
def simulate(platform: str = "tpu", **params: Any) -> Iterator[Any]:
  """Ops traced under this context make the TPU choices (`contract.traced_for`) and run every Pallas kernel
  on CPU in the TPU interpreter: `platform_call`'s TPU branch, and kernels called directly (JAX's TPU flash
  attention), through `pltpu.force_tpu_interpret_mode`. params: `pltpu.InterpretParams` fields
  (detect_races=True, ...). Yields the InterpretParams; a test traces and runs inside the context."""
  contract.check_choice(platform, name="platform", allowed=("tpu",), op="pallas.simulate")
  interpret = pltpu.InterpretParams(**params)
  token = _SIMULATED.set(interpret)
  try:
    with contract.traced_for(platform), pltpu.force_tpu_interpret_mode(interpret):
      yield interpret
  finally:
    _SIMULATED.reset(token)


def races_found() -> bool:
  """Whether the TPU interpreter's race detector (`simulate(detect_races=True)`) flagged the last kernel
  it ran (its state lives from one kernel's start to the next's)."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call

  races = interpret_pallas_call.races
  return bool(races is not None and races.races_found)


def platform_call(kernel, *, gpu_params: Any, tpu_params: Any, tpu_kw: dict | None = None,
                  tpu_kernel: Any = None, tpu_finish: Any = None, platform: str | None = None, **kw):
  """pl.pallas_call(kernel, **kw) with `gpu_params` (Triton) on CUDA/ROCm, `tpu_params` (Mosaic) on TPU and
  interpret=True on CPU (under `simulate`, the TPU branch in the TPU interpreter); `tpu_kw` replaces entries
  of kw on TPU (in_specs with scalars in SMEM, a grid that walks rows through VMEM in chunks, ...) and
  `tpu_kernel`, when given, replaces the kernel there (one that copies its tiles from HBM itself);
  `tpu_finish` maps the TPU call's outputs to the others' (partial sums over a grid axis, summed).
  platform: emit that platform's call alone, for code only ever lowered for it (None:
  `contract.traced_platform()`, set inside a `contract.per_platform`
  branch; a custom_vjp's rules are traced outside it, so kernels pass the platform their primal saw)."""
  def branch(body=kernel, finish=None, **extra):
    return lambda *args: (finish or (lambda out: out))(pl.pallas_call(body, **{**kw, **extra})(*args))

  def call(*args):
    gpu = branch(compiler_params=gpu_params)
    tpu_specs = dict(tpu_kw or {}, body=tpu_kernel or kernel, finish=tpu_finish)
    tpu = branch(compiler_params=tpu_params, **tpu_specs)
    simulated = _SIMULATED.get()
    if simulated is not None:
      return branch(compiler_params=tpu_params, **tpu_specs, interpret=simulated)(*args)
    # Inside a `contract.per_platform` branch only that platform's program is ever lowered.
    per_platform = {"cpu": branch(interpret=True), "gpu": gpu, "tpu": tpu}
    only = platform or contract.traced_platform()
    if only is not None:
      return per_platform[only](*args)
    return lax.platform_dependent(*args, cpu=per_platform["cpu"], cuda=gpu, rocm=gpu, tpu=tpu)
  return call


def dot(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
  """a @ b of two 2-D tiles (either transposed) with float32 accumulation (float64 stays float64)."""
  out = jnp.float64 if jnp.float64 in (a.dtype, b.dtype) else jnp.float32
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=out)


def prefetched_loop(lo: Any, hi: Any, copies: Any, step: Any, carry: Any) -> Any:
  """fori_loop over [lo, hi) whose iteration i reads tiles copied from HBM into one of two VMEM slots (TPU):
  copies(i, slot) gives iteration i's DMA copies into `slot`; the next iteration's copies start before
  step(i, slot, carry) runs, so each copy runs under the previous tile's work."""
  @pl.when(lo < hi)
  def _():
    for copy in copies(lo, 0):
      copy.start()

  def body(i, c):
    slot = (i - lo) % 2

    @pl.when(i + 1 < hi)
    def _():
      for copy in copies(i + 1, 1 - slot):
        copy.start()

    for copy in copies(i, slot):
      copy.wait()
    return step(i, slot, c)

  return lax.fori_loop(lo, hi, body, carry)

