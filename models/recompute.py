"""Attention whose backward pass recomputes it from its inputs: nothing of the op's intermediates is kept.

For dense attention the kept intermediates are the [batch, heads, L, L] probabilities of every layer, which
at long lengths outgrow the rest of the step's memory (docs/benchmarks_training.md, "Training throughput");
recomputing costs one extra forward pass of the op only.

Why not `jax.checkpoint` / `nnx.remat` (`model.remat`): XLA:CPU removes optimisation barriers before
scheduling, and its scheduler then hoists every layer's recomputation right after the forward pass, where it
is live at the same time as all the others, so remat does not lower XLA:CPU's temp memory at all. Here
the recomputation reads its inputs through a zero that depends on the layer's output cotangent, so it cannot
start before that cotangent exists: layers are recomputed one at a time, in the order of the backward pass, on
every backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = Any


def _pin(x: Any, zero: Array) -> Any:
  """x + zero for floating arrays (a float add is never folded away by XLA), other leaves unchanged."""
  def add(a):
    return a + zero.astype(a.dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a
  return jax.tree.map(add, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def recompute_in_backward(fn: Callable[..., Array], *args: Any) -> Array:
  """fn(*args) (args: arrays or None; only floating arrays get gradients), keeping only `args` for the
  backward.

  The gradient is exactly jax.vjp(fn, *args)'s: the backward runs it on the same inputs.
  """
  return fn(*args)


def _fwd(fn: Callable[..., Array], *args: Any) -> tuple[Array, tuple]:
  return fn(*args), args


def _bwd(fn: Callable[..., Array], args: tuple, ct: Array) -> tuple:
  zero = jax.lax.stop_gradient(ct.reshape(-1)[0]) * 0  # NaN only if the cotangent already is
  args = _pin(args, zero)
  _, vjp = jax.vjp(fn, *args)
  grads = vjp(ct)
  # Non-floating inputs (boolean masks) take no cotangent.
  return tuple(None if g is None or g.dtype == jax.dtypes.float0 else g for g in grads)


recompute_in_backward.defvjp(_fwd, _bwd)
