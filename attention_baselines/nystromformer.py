"""Nystromformer (Xiong et al., AAAI 2021) under the op contract: landmark (Nystrom) approximation of softmax.

out = softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V, with logits scaled by 1/sqrt(d) and the
landmarks Q~, K~ the means of `num_landmarks` contiguous segments of Q and K. pinv is the paper's iterative
Moore-Penrose approximation, Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4 from Z0 = A^T / (|A|_1 |A|_inf),
with `pinv_iterations` = 6 as in the paper. Cost O(L * m * d + m^3). Bidirectional only (every output mixes
all positions through the landmarks): causal=True is a ValueError.

Any length: the sequence is padded to whole segments of ceil(L / m) tokens; a landmark is the mean over the
real (unmasked) tokens of its segment, and a landmark whose segment has none is dropped (its row and column of
the landmark kernel become the identity, its column of softmax(Q K~^T) is zero), so masked tokens never
matter.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attention_core import contract
from attention_core.blocks import num_blocks, to_grid
from attention_core.combine import attend

Array = Any


def iterative_pinv(a: Array, iterations: int) -> Array:
  """The Nystromformer paper's iterative Moore-Penrose inverse of a: [..., m, m] (batched per matrix)."""
  m = a.shape[-1]
  eye = jnp.eye(m, dtype=a.dtype)
  norm_1 = jnp.max(jnp.sum(jnp.abs(a), axis=-2), axis=-1)  # max column sum
  norm_inf = jnp.max(jnp.sum(jnp.abs(a), axis=-1), axis=-1)  # max row sum
  z = jnp.swapaxes(a, -1, -2) / (norm_1 * norm_inf)[..., None, None]
  for _ in range(iterations):
    az = a @ z
    z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
  return z


def nystromformer(q: Array, k: Array, v: Array, *, causal: bool, mask: Array | None = None,
                  num_landmarks: int = 64, pinv_iterations: int = 6) -> Array:
  """Nystrom attention with `num_landmarks` segment-mean landmarks (at most L are used)."""
  op = "nystromformer"
  q, k, v, mask = contract.check_qkv(q, k, v, mask, op=op)
  if contract.check_bool(causal, name="causal", op=op):
    raise ValueError(f"{op}: argument 'causal' must be False: the landmarks summarise the whole sequence, "
                     "so Nystromformer (as published) has no causal form")
  num_landmarks = contract.check_positive_int(num_landmarks, name="num_landmarks", op=op)
  pinv_iterations = contract.check_positive_int(pinv_iterations, name="pinv_iterations", op=op)
  batch, length, heads, head_dim = q.shape
  ct = contract.softmax_dtype(q.dtype, k.dtype, v.dtype)
  segment = num_blocks(length, min(num_landmarks, length))  # tokens per segment
  m = num_blocks(length, segment)  # landmarks actually used
  keep = mask[:, :, None, None]  # [batch, L, 1, 1]
  qh = jnp.swapaxes(jnp.where(keep, q.astype(ct), 0.0), 1, 2)  # [batch, heads, L, d] (masked rows zero)
  kh = jnp.swapaxes(jnp.where(keep, k.astype(ct), 0.0), 1, 2)
  vh = jnp.swapaxes(jnp.where(keep, v.astype(ct), 0.0), 1, 2)  # [batch, heads, L, dv]
  counts = jnp.sum(to_grid(mask, m, segment, axis=1), axis=-1)  # [batch, m] real tokens per segment
  has = counts > 0
  denom = jnp.where(has, counts, 1).astype(ct)[:, None, :, None]
  q_land = jnp.sum(to_grid(qh, m, segment, axis=2), axis=3) / denom  # [batch, heads, m, d]
  k_land = jnp.sum(to_grid(kh, m, segment, axis=2), axis=3) / denom
  scale = contract.logit_scale(head_dim)
  land_valid = has[:, None, None, :]  # [batch, 1, 1, m]
  key_valid = mask[:, None, None, :]  # [batch, 1, 1, L]

  # softmax(Q~ K^T) V: [batch, heads, m, dv]
  l3 = jnp.einsum("bhmd,bhld->bhml", q_land, kh) * scale
  kernel3_v = attend(l3, key_valid, vh, "bhml,bhld->bhmd")
  # softmax(Q~ K~^T): [batch, heads, m, m]; dropped landmarks get identity rows and columns.
  l2 = jnp.einsum("bhmd,bhnd->bhmn", q_land, k_land) * scale
  a = attend(l2, land_valid, jnp.eye(m, dtype=ct), "bhmn,nk->bhmk")
  dropped = ~has[:, None, :, None] | ~land_valid  # [batch, 1, m, m]: row or column of a dropped landmark
  a = jnp.where(dropped, jnp.eye(m, dtype=ct), a)
  z = iterative_pinv(a, pinv_iterations)  # [batch, heads, m, m]
  # softmax(Q K~^T) (Z (softmax(Q~ K^T) V)): [batch, heads, L, dv]
  l1 = jnp.einsum("bhld,bhmd->bhlm", qh, k_land) * scale
  out = attend(l1, land_valid, z @ kernel3_v, "bhlm,bhmd->bhld")
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)
