"""Every "auto" choice is made per lowering platform (`attention_core.contract.per_platform`), not from the
   host.

An "auto" op traced on this CPU host and lowered for TPU (compile-only devices of a libtpu topology, or
jax.export with platforms=["tpu"]) holds the TPU kernels (Mosaic: `tpu_custom_call`), lowered for CUDA the
Triton ones, and lowered for CPU none: the CPU program is the one the XLA path compiles to. The TPU tests are
skipped where libtpu is not installed.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import combiner
from attention_baselines import common as baselines_common
from attention_baselines import dense as dense_module
from attention_core import contract
from combiner import kernel_plans
from scripts import compile_tpu  # noqa: F401  (libtpu for this process: scripts/compile_tpu.py)
from yoso import attention as yoso_attention

MOSAIC, TRITON = "tpu_custom_call", "xla.gpu.triton"
pytestmark = pytest.mark.all_platforms  # these tests are about the per-platform staging itself
TRITON_OK = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
SHAPE = (1, 256, 2, 128)  # Mosaic's (8, 128) tiles; bfloat16, as models run

OPS = {
    "combiner_fixed": lambda q, k, v: combiner.fixed(q, k, v, block_size=16, causal=True),
    "dense": lambda q, k, v: dense_module.dense(q, k, v, causal=True),
    "yoso": lambda q, k, v: yoso_attention.yoso(q, k, v, rng=jax.random.PRNGKey(0), num_hashes=2, tau=4),
}


def fwd_bwd(f):
  return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


@pytest.fixture(scope="module")
def tpu_spec():
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  mesh = jax.sharding.Mesh(np.array(topo.devices)[:1].reshape(1), ("x",))
  return jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=NamedSharding(mesh, P()))


def test_per_platform_branches_and_keys():
  seen = []

  def fn():
    seen.append(contract.backend())
    return jnp.zeros(3)

  jax.jit(lambda: contract.per_platform(fn)).lower()
  assert sorted(seen) == ["cpu", "gpu", "tpu"]  # one branch per platform, each traced for it
  seen.clear()
  jax.jit(lambda: contract.per_platform(fn, key=lambda: contract.backend() == "cpu")).lower()
  assert sorted(seen) == ["cpu", "gpu"]  # GPU and TPU share a key: one branch for both
  seen.clear()
  jax.jit(lambda: contract.per_platform(fn, key=lambda: 0)).lower()
  assert seen == [jax.default_backend()]  # every key agrees: traced once, no branches
  seen.clear()
  with contract.traced_for("tpu"):
    jax.jit(lambda: contract.per_platform(fn)).lower()
  assert seen == ["tpu"]  # inside a platform's trace, no nested branches
  assert contract.traced_platform() is None
  with contract.traced_for("gpu", also=("tpu",)):  # a branch that serves two platforms
    assert contract.backend() == "gpu" and contract.traced_platform() is None


def test_platform_choices_follow_the_traced_platform():
  with contract.traced_for("gpu"):
    assert kernel_plans.packs_heads(contract.backend())
    assert baselines_common.num_row_chunks(64, 1024, None, op="t") == 1
  with contract.traced_for("tpu"):
    assert not kernel_plans.packs_heads(contract.backend())
    assert contract.resolve_implementation("auto", op="t") == "pallas"
  with contract.traced_for("cpu"):
    assert baselines_common.num_row_chunks(64, 1024, None, op="t") == 8
    assert contract.resolve_implementation("auto", op="t") == "xla"
  with pytest.raises(ValueError, match="argument 'platform'"):
    with contract.traced_for("cuda"):
      pass


@pytest.mark.parametrize("name", sorted(OPS))
def test_auto_lowers_the_tpu_kernels_for_tpu_and_none_for_cpu(tpu_spec, name):
  f = OPS[name]
  cpu_spec = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
  for program in (f, fwd_bwd(f)):
    assert MOSAIC in jax.jit(program).lower(tpu_spec, tpu_spec, tpu_spec).as_text(), name
    assert MOSAIC not in jax.jit(program).lower(cpu_spec, cpu_spec, cpu_spec).as_text(), name
  exported = jax.export.export(jax.jit(fwd_bwd(f)), platforms=["tpu"])(cpu_spec, cpu_spec, cpu_spec)
  assert MOSAIC in exported.mlir_module(), name


@pytest.mark.parametrize("name", ["combiner_fixed", "dense"])
def test_auto_lowers_the_gpu_kernels_for_cuda(name):
  spec = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
  export = jax.export.export(jax.jit(fwd_bwd(OPS[name])), platforms=["cuda"], disabled_checks=TRITON_OK)
  text = export(spec, spec, spec).mlir_module()
  assert MOSAIC not in text
  if name == "combiner_fixed":
    assert TRITON in text
  elif dense_module._cudnn_available():  # JAX traces cuDNN attention only where cuDNN is installed
    assert "cudnn" in text


def _instructions(compiled) -> list[str]:
  """A compiled CPU program's instructions without metadata and with instruction numbers dropped."""
  lines = [re.sub(r", metadata=\{[^}]*\}", "", line) for line in compiled.as_text().splitlines()]
  return [re.sub(r"([%\w-]+)\.\d+", r"\1", line) for line in lines if re.match(r"\s*(ROOT )?%\S+ = ", line)]


@pytest.mark.parametrize("name", ["combiner_fixed", "dense"])
def test_auto_cpu_program_is_the_xla_program(name):
  fns = {"combiner_fixed": lambda impl: lambda q, k, v: combiner.fixed(q, k, v, block_size=4, causal=True,
                                                                       implementation=impl),
         "dense": lambda impl: lambda q, k, v: dense_module.dense(q, k, v, causal=True, implementation=impl)}
  spec = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.bfloat16)
  auto, xla = (jax.jit(fwd_bwd(fns[name](impl))).lower(spec, spec, spec).compile()
               for impl in ("auto", "xla"))
  assert _instructions(auto) == _instructions(xla)


def test_explicit_choices_keep_their_meaning(tpu_spec):
  cpu_spec = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
  xla = lambda q, k, v: combiner.fixed(q, k, v, block_size=16, causal=True, implementation="xla")  # noqa: E731
  assert MOSAIC not in jax.jit(xla).lower(tpu_spec, tpu_spec, tpu_spec).as_text()
  flash_dense = lambda q, k, v: dense_module.dense(q, k, v, causal=True, implementation="flash")  # noqa: E731
  with pytest.raises(ValueError, match="'flash' does not apply here"):  # decided for the host's backend
    jax.jit(flash_dense).lower(cpu_spec, cpu_spec, cpu_spec)
  with contract.traced_for("tpu"):  # ... unless traced for another platform
    assert MOSAIC in jax.jit(flash_dense).lower(tpu_spec, tpu_spec, tpu_spec).as_text()
