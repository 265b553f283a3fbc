"""The one way op packages call Pallas kernels: lowered per platform, with float32-accumulating tile dots.

`platform_call` wraps `pl.pallas_call` in `lax.platform_dependent`, which lowers only the branch of the
platform compiled for: Triton on GPU, Mosaic on TPU, interpret mode on CPU. So one program exports to TPU and
CUDA from a CPU host (the lowering tests) and runs, interpreted, in the CPU test suite.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

Array = Any


def platform_call(kernel, *, gpu_params: Any, tpu_params: Any, tpu_in_specs: Any = None, **kw):
  """pl.pallas_call(kernel, **kw) with `gpu_params` (Triton) on CUDA/ROCm, `tpu_params` (Mosaic) on TPU and
  interpret=True on CPU; `tpu_in_specs` replaces `in_specs` on TPU (scalars a kernel loops by live in SMEM
  there)."""
  def branch(**extra):
    return lambda *args: pl.pallas_call(kernel, **{**kw, **extra})(*args)

  def call(*args):
    gpu = branch(compiler_params=gpu_params)
    tpu = {} if tpu_in_specs is None else {"in_specs": tpu_in_specs}
    return lax.platform_dependent(*args, cpu=branch(interpret=True), cuda=gpu, rocm=gpu,
                                  tpu=branch(compiler_params=tpu_params, **tpu))
  return call


def dot(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
  """a @ b of two 2-D tiles (either transposed) with float32 accumulation (float64 stays float64)."""
  out = jnp.float64 if jnp.float64 in (a.dtype, b.dtype) else jnp.float32
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=out)
