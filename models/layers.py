"""Small NNX layers whose parameters carry logical axis names (embed, mlp, heads, kv, vocab).

Every parameter is created with `nnx.with_partitioning(init, axes, eager_sharding=False)`: the logical names
are stored as metadata and `train.py` maps them to mesh axes with the config's rule table, creating the
parameters already sharded (jit with `out_shardings`). `eager_sharding=False` keeps the modules constructible
without a mesh (tests, eval on one device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attention_core.norm import layer_norm

Array = Any
Axes = tuple[str | None, ...]

default_kernel_init = nnx.initializers.lecun_normal()
zeros_init = nnx.initializers.zeros_init()
ones_init = nnx.initializers.ones_init()


def param(rngs: nnx.Rngs, init: Any, shape: Sequence[int], axes: Axes, dtype: Any = jnp.float32) -> nnx.Param:
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {axes} do not match parameter shape {tuple(shape)}")
  return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=axes, eager_sharding=False)


class DenseGeneral(nnx.Module):
  """y = x . kernel + bias over the trailing `in_shape` dims of x, producing `out_shape` trailing dims.

  Parameters are float32 (`param_dtype`); the matmul runs in `dtype` (bfloat16 option) with float32
  accumulation left to XLA.
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *, in_axes: Axes, out_axes: Axes,
               dtype: Any = jnp.float32, use_bias: bool = True, kernel_init: Any = default_kernel_init,
               rngs: nnx.Rngs):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    self.dtype = dtype
    fan_in = 1
    for s in self.in_shape:
      fan_in *= s
    # The kernel is initialised as a 2-D [fan_in, fan_out] matrix so lecun init sees the true fan-in.
    fan_out = 1
    for s in self.out_shape:
      fan_out *= s

    def kernel_init_nd(key, shape, dtype):
      return kernel_init(key, (fan_in, fan_out), dtype).reshape(shape)

    self.kernel = param(rngs, kernel_init_nd, self.in_shape + self.out_shape,
                        tuple(in_axes) + tuple(out_axes))
    self.bias = param(rngs, zeros_init, self.out_shape, tuple(out_axes)) if use_bias else None

  def __call__(self, x: Array) -> Array:
    n_in = len(self.in_shape)
    kernel = self.kernel[...].astype(self.dtype)
    y = jax.lax.dot_general(x.astype(self.dtype), kernel,
                            (((tuple(range(x.ndim - n_in, x.ndim))), tuple(range(n_in))), ((), ())))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


class LayerNorm(nnx.Module):
  """Layer norm over the last dim, statistics in float32, with optional affine parameters on `axis_name`."""

  def __init__(self, features: int, *, axis_name: str | None = "embed", use_scale: bool = True,
               use_bias: bool = True, epsilon: float = 1e-6, dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.epsilon, self.dtype = epsilon, dtype
    self.scale = param(rngs, ones_init, (features,), (axis_name,)) if use_scale else None
    self.bias = param(rngs, zeros_init, (features,), (axis_name,)) if use_bias else None

  def __call__(self, x: Array) -> Array:
    y = layer_norm(x, self.epsilon)  # float32 (or wider) statistics and result
    if self.scale is not None:
      y = y * self.scale[...]
    if self.bias is not None:
      y = y + self.bias[...]
    return y.astype(self.dtype if x.dtype != jnp.float64 else x.dtype)


class Embed(nnx.Module):
  """Token embedding table [num_embeddings, features] with axes (vocab, embed)."""

  def __init__(self, num_embeddings: int, features: int, *, dtype: Any = jnp.float32, rngs: nnx.Rngs,
               axes: Axes = ("vocab", "embed")):
    self.dtype = dtype
    self.embedding = param(rngs, nnx.initializers.normal(stddev=features ** -0.5), (num_embeddings, features),
                           axes)

  def __call__(self, ids: Array) -> Array:
    return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)
