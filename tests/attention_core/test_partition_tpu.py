"""Every op with a fused kernel, called directly inside a plain jax.jit with q, k, v sharded over the batch,
the heads or both of a 4-chip TPU mesh with arbitrary axis names, compiles for TPU (libtpu ahead of time) with
its Mosaic kernels in the program and no collective but the loss's reduction (attention_core.partition).
The fast run compiles one case per op on v5e (batch and heads both split, forward + backward), but for the
ops of test_tpu_kernels_compile.SLOW_TO_COMPILE, which repeat a kernel family (`-m slow`); `-m slow` also
compiles the batch-only and heads-only splits and the forward alone; `-m tpu_grid` every case on v6e too
(`cases`). Skipped without libtpu."""

from __future__ import annotations

import pytest

from scripts import compile_tpu  # noqa: F401  (libtpu for this process: scripts/compile_tpu.py)

pytest.importorskip("libtpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from attention_core import contract, hlo  # noqa: E402
from attention_core import registry as ops_registry  # noqa: E402
from tests.attention_core import test_tpu_kernels_compile as kernels  # noqa: E402  (libtpu's environment)

# Batch over "rows" and heads over "cols"; the batch or the heads alone leave the other axis unused (the op's
# own VJP: test_partition.py).
SPLITS = {"both": P("rows", None, "cols", None), "batch": P("rows"), "heads": P(None, None, "cols")}
BATCH, LENGTH, HEADS, HEAD_DIM = 4, 1024, 4, 128


def cases() -> list:
  """(generation, op, split, backward): fast, the representative (v5e, both, forward + backward) of every
  op not in SLOW_TO_COMPILE; slow, every other split and the forward alone of those ops, the representative of
  the SLOW_TO_COMPILE ops (their kernel families are compiled fast already) and one v6e case; the rest
  (`-m tpu_grid`) every case on v6e and the other cases of the SLOW_TO_COMPILE ops."""
  out = []
  for gen in ("v5e", "v6e"):
    for name in kernels.FUSED:
      repeat = name in kernels.SLOW_TO_COMPILE
      for split in SPLITS:
        for backward in (True, False):
          representative = (split, backward) == ("both", True)
          if gen == "v5e" and representative and not repeat:
            marks = []
          elif gen == "v5e" and (representative or not repeat) or (gen, name) == ("v6e", "combiner_fixed") \
              and representative:
            marks = [pytest.mark.slow]
          else:
            marks = [pytest.mark.tpu_grid]
          out.append(pytest.param(gen, name, split, backward, marks=marks,
                                  id=f"{gen}-{name}-{split}-{'fwd+bwd' if backward else 'fwd'}"))
  return out


def compiled_text(gen: str, name: str, spec: P, backward: bool, kind=AxisType.Explicit) -> str:
  """The TPU program of the op (and with `backward` the gradients of its sum, returned with the sum) called
  in a plain jit on a 2 x 2 mesh named ("rows", "cols") with q, k, v placed by `spec`."""
  mesh = jax.sharding.Mesh(np.array(kernels.tpu_devices(gen, 4)[:4]).reshape(2, 2), ("rows", "cols"),
                           axis_types=(kind, kind))
  op = ops_registry.get(name)
  path = ops_registry.fused_path(op)
  causal = op.causal and path.causal
  params = {**ops_registry.bench_params(op, LENGTH, batch=BATCH, heads=HEADS, head_dim=HEAD_DIM,
                                        dtype=jnp.bfloat16), path.argument: path.kernels[0]}
  x = jax.ShapeDtypeStruct((BATCH, LENGTH, HEADS, HEAD_DIM), jnp.bfloat16, sharding=NamedSharding(mesh, spec))

  def f(q, k, v):
    return op.fn(q, k, v, causal=causal, **params)

  def loss(q, k, v):
    return jnp.sum(f(q, k, v).astype(jnp.float32))

  step = jax.value_and_grad(loss, argnums=(0, 1, 2)) if backward else f
  with jax.set_mesh(mesh), contract.traced_for("tpu"):
    return jax.jit(step).lower(x, x, x).compile().as_text()


def only_the_loss_reduction(text: str) -> list[str]:
  """The collectives of a compiled program other than all-reduces of a scalar (the loss's sum)."""
  return [f"{c.kind} of {c.operand_bytes} bytes" for c in hlo.collectives(text)
          if not (c.kind == "all-reduce" and c.operand_bytes <= 8)]


@pytest.mark.parametrize("gen,name,split,backward", cases())
def test_fused_op_in_a_plain_jit_compiles_sharded_without_collectives(gen, name, split, backward):
  text = compiled_text(gen, name, SPLITS[split], backward)
  assert kernels.KERNEL_MARKER in text, f"{name}: no TPU kernel in the program"
  assert only_the_loss_reduction(text) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["combiner_fixed", "yoso", "dense"])
def test_auto_axes_in_the_data_x_model_layout_compile_without_collectives(name):
  """On Auto axes the op splits the batch over "rows" and the heads over "cols" (the last axis), so inputs
  placed that way need no collective either."""
  text = compiled_text("v5e", name, SPLITS["both"], True, kind=AxisType.Auto)
  assert kernels.KERNEL_MARKER in text
  assert only_the_loss_reduction(text) == []
