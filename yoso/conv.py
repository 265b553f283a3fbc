"""YOSO-C's depthwise convolution of V (paper section 4.2): one kernel per head, shared by its value dims.

Kept apart from the LSH attention because the model applies it on its own (it owns the kernel as a parameter).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = Any


def depthwise_conv(v: Array, kernel: Array, mask: Array | None = None) -> Array:
  """Per-head convolution of V along the sequence ("same" zero padding), one kernel per head shared by its
  dims.

  v: [batch, length, heads, value_dim]; kernel: [heads, size] or [size] (shared by all heads), size odd;
  mask: [batch, length] (padded tokens are zeroed first, so their contents never reach a real token).
  Returns [batch, length, heads, value_dim] in v's dtype. O(L * size * heads * value_dim).
  """
  if mask is not None:
    v = jnp.where(mask[:, :, None, None], v, 0)
  b, length, h, e = v.shape
  kernel = jnp.broadcast_to(jnp.asarray(kernel), (h, jnp.shape(kernel)[-1]))
  size = kernel.shape[-1]
  if size % 2 == 0:
    raise ValueError(f"depthwise_conv: the kernel size must be odd, got {size}")
  # Channels = heads * value_dim with each head's kernel repeated over its dims: a grouped (depthwise) conv.
  rhs = jnp.repeat(kernel.T, e, axis=1)[:, None, :].astype(v.dtype)  # [size, 1, heads * value_dim]
  out = jax.lax.conv_general_dilated(
      v.reshape(b, length, h * e), rhs, window_strides=(1,), padding=[(size // 2, size // 2)],
      dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=h * e)  # [batch, length, heads * e]
  return out.reshape(b, length, h, e)
