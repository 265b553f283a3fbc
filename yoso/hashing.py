"""Hyperplane LSH for YOSO attention (paper section 3.2), with Gaussian or fast Hadamard projections.

A hash is `tau` hyperplane bits; its code is `sum_b 2^b [r_b . x > 0]`, an integer in `[0, 2^tau)`. Two unit
vectors at angle `theta` share one bit with probability `1 - theta/pi` (Charikar, 2002), so with independent bits
they collide with probability `(1 - theta/pi)^tau`: the Bernoulli success probability YOSO attention is built on.

Hash functions are drawn independently per head (axis -2 of `[..., heads, dim]`) and shared along the other
leading axes, so queries and keys hashed with the same `rng` see the same functions. Both families take the rng
explicitly; nothing here holds state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = Any

# The fast family: x -> H D3 H D2 H D1 x (Andoni et al., 2015), three rounds, each D a random +-1 diagonal.
FAST_ROUNDS = 3


def is_power_of_two(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def _codes_from_projections(proj: Array, num_hashes: int, tau: int) -> Array:
  """proj [..., heads, >= num_hashes * tau] -> int32 codes [..., heads, num_hashes]."""
  bits = (proj[..., : num_hashes * tau] > 0).astype(jnp.int32)
  bits = bits.reshape(*proj.shape[:-1], num_hashes, tau)  # [..., heads, num_hashes, tau]
  weights = jnp.left_shift(jnp.int32(1), jnp.arange(tau, dtype=jnp.int32))  # [tau]: 2^b
  return jnp.sum(bits * weights, axis=-1)


def gaussian_projections(rng: Array, *, heads: int, dim: int, num_hashes: int, tau: int, dtype: Any) -> Array:
  """Independent N(0, I) hyperplane normals: [heads, dim, num_hashes * tau]."""
  return jax.random.normal(rng, (heads, dim, num_hashes * tau), dtype)


def gaussian_codes(x: Array, rng: Array, *, num_hashes: int, tau: int) -> Array:
  """Hyperplane LSH with Gaussian projections. x [..., heads, dim] -> int32 codes [..., heads, num_hashes].

  Bits of different hashes and within a hash are independent, so the collision probability is exactly
  `(1 - theta/pi)^tau`. Cost O(dim * num_hashes * tau) per vector.
  """
  heads, dim = x.shape[-2:]
  r = gaussian_projections(rng, heads=heads, dim=dim, num_hashes=num_hashes, tau=tau, dtype=x.dtype)
  proj = jnp.einsum("...hd,hdn->...hn", x, r)  # [..., heads, num_hashes * tau]
  return _codes_from_projections(proj, num_hashes, tau)


def hadamard(x: Array) -> Array:
  """Unnormalised fast Walsh-Hadamard transform along the last axis (power-of-two length), O(d log d)."""
  d = x.shape[-1]
  if not is_power_of_two(d):
    raise ValueError(f"hadamard: the last axis must have a power-of-two length, got {d}")
  lead = x.shape[:-1]
  h = 1
  while h < d:
    # Butterfly on pairs (i, i + h) inside blocks of 2h: [a, b] -> [a + b, a - b].
    y = x.reshape(*lead, d // (2 * h), 2, h)
    a, b = y[..., 0, :], y[..., 1, :]
    x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
    h *= 2
  return x


def fast_codes(x: Array, rng: Array, *, num_hashes: int, tau: int) -> Array:
  """Hyperplane LSH with the fast approximate random rotation H D3 H D2 H D1 (power-of-two dim only).

  x [..., heads, dim] -> int32 codes [..., heads, num_hashes]. Each rotation yields `dim` pseudo-random
  hyperplane coordinates, so `ceil(num_hashes * tau / dim)` independent rotations are cut into the
  `num_hashes * tau` bits. Coordinates of one rotation are orthogonal rather than independent, so the collision
  probability matches `(1 - theta/pi)^tau` only approximately (closely for dim >= 32). Cost
  O(num_hashes * tau * log(dim)) per vector.
  """
  heads, dim = x.shape[-2:]
  if not is_power_of_two(dim):
    raise ValueError(f"fast_codes: argument 'hash'='fast' needs a power-of-two head_dim, got head_dim={dim}; "
                     f"use hash='gaussian'")
  rotations = -(-num_hashes * tau // dim)
  signs = jax.random.rademacher(rng, (FAST_ROUNDS, heads, rotations, dim), x.dtype)
  y = jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], rotations, dim))  # [..., heads, rotations, dim]
  for r in range(FAST_ROUNDS):
    y = hadamard(y * signs[r])
  proj = y.reshape(*x.shape[:-1], rotations * dim)  # [..., heads, rotations * dim]
  return _codes_from_projections(proj, num_hashes, tau)


HASHES = {"gaussian": gaussian_codes, "fast": fast_codes}


def hash_codes(x: Array, rng: Array, *, num_hashes: int, tau: int, method: str = "gaussian") -> Array:
  """Dispatches to a hash family by name: x [..., heads, dim] -> int32 codes [..., heads, num_hashes]."""
  if method not in HASHES:
    raise ValueError(f"argument 'hash' must be one of {tuple(HASHES)}, got {method!r}")
  return HASHES[method](x, rng, num_hashes=num_hashes, tau=tau)
