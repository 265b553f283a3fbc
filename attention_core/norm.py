"""Layer normalisation without parameters, the one shared by the models and the routing projection."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = Any


def layer_norm(x: Array, eps: float = 1e-6) -> Array:
  """x [..., d] centred and scaled to unit variance over the last axis (no scale, no bias).

  Statistics run in float32, or float64 for float64 input; the result keeps that dtype so that callers apply
  their affine parameters before casting down. With unit variance the rows lie on the sphere of radius
  sqrt(d).
  """
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  centered = x - jnp.mean(x, axis=-1, keepdims=True)
  return centered * jax.lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True) + eps)
