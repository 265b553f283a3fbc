"""Hyperplane LSH for YOSO attention (paper section 3.2), with Gaussian or fast Hadamard projections.

A hash is `tau` hyperplane bits; its code is `sum_b 2^b [r_b . x > 0]`, an integer in `[0, 2^tau)`. Two unit
vectors at angle `theta` share one bit with probability `1 - theta/pi` (Charikar, 2002), so with independent
bits they collide with probability `(1 - theta/pi)^tau`: the Bernoulli success probability YOSO attention is
built on.

Inputs are heads-major, `[batch, heads, length, dim]` (the layout in which XLA's CPU dot is fast). Hash
functions are drawn independently per head and shared along batch and length, so queries and keys hashed with
the same `rng` see the same functions. Both families take the rng explicitly; nothing here holds state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any

# The fast family: x -> H D3 H D2 H D1 x (Andoni et al., 2015), three rounds, each D a random +-1 diagonal.
FAST_ROUNDS = 3


def is_power_of_two(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def _codes_from_projections(proj: Array, num_hashes: int, tau: int) -> Array:
  """proj [..., >= m * tau] -> int32 codes [..., m]; bit b of hash t is coordinate t * tau + b."""
  bits = (proj[..., : num_hashes * tau] > 0).reshape(*proj.shape[:-1], num_hashes, tau)  # [..., m, tau]
  return sum(bits[..., b].astype(jnp.int32) << b for b in range(tau))


def gaussian_projections(rng: Array, *, heads: int, dim: int, num_hashes: int, tau: int, dtype: Any) -> Array:
  """Independent N(0, I) hyperplane normals: [heads, dim, num_hashes * tau]."""
  return jax.random.normal(rng, (heads, dim, num_hashes * tau), dtype)


def gaussian_codes(x: Array, r: Array, *, num_hashes: int, tau: int) -> Array:
  """Hyperplane LSH with Gaussian projections r [heads, dim, num_hashes * tau] (`gaussian_projections`):
  x [batch, heads, length, dim] -> int32 codes [b, h, L, m].

  Bits of different hashes and within a hash are independent, so the collision probability is exactly
  `(1 - theta/pi)^tau`. Cost O(dim * num_hashes * tau) per vector.
  """
  proj = jnp.einsum("bhld,hdn->bhln", x, r.astype(x.dtype))  # [batch, heads, length, num_hashes * tau]
  return _codes_from_projections(proj, num_hashes, tau)


def _sylvester(n: int) -> np.ndarray:
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


HADAMARD_RADIX = 16  # largest dense factor: small matmuls beat log2(d) butterfly passes on CPU


def hadamard(x: Array) -> Array:
  """Unnormalised fast Walsh-Hadamard transform along the last axis (power-of-two length, Sylvester order).

  H_d = H_a (x) H_b (x) ... with factors of at most HADAMARD_RADIX: the coordinates are viewed as a tensor
  [a, b, ...] and each factor is a small dense matmul on its axis, O(d * sum(factors)) = O(d log d) for a
  bounded radix, in a handful of passes instead of log2(d) butterflies.
  """
  d = x.shape[-1]
  if not is_power_of_two(d):
    raise ValueError(f"hadamard: the last axis must have a power-of-two length, got {d}")
  lead = x.shape[:-1]
  sizes = []
  while d > 1:
    sizes.append(min(d, HADAMARD_RADIX))
    d //= sizes[-1]
  y = x.reshape(*lead, *sizes)
  for _ in sizes:
    # Transform the last tensor axis, then rotate it to the front of the factor axes: after len(sizes) steps
    # every axis is transformed once and the original order is back.
    y = y @ jnp.asarray(_sylvester(y.shape[-1]), x.dtype)
    y = jnp.moveaxis(y, -1, len(lead))
  return y.reshape(x.shape)


def fast_signs(rng: Array, *, heads: int, dim: int, num_hashes: int, tau: int, dtype: Any) -> Array:
  """The random +-1 diagonals D1, D2, D3 of the fast rotations: [heads, FAST_ROUNDS, rotations, dim], with
  `ceil(num_hashes * tau / dim)` independent rotations (power-of-two dim only)."""
  if not is_power_of_two(dim):
    raise ValueError(f"fast_codes: argument 'hash'='fast' needs a power-of-two head_dim, got head_dim={dim}; "
                     f"use hash='gaussian'")
  rotations = -(-num_hashes * tau // dim)
  return jnp.swapaxes(jax.random.rademacher(rng, (FAST_ROUNDS, heads, rotations, dim), dtype), 0, 1)


def fast_codes(x: Array, signs: Array, *, num_hashes: int, tau: int) -> Array:
  """Hyperplane LSH with the fast approximate random rotation H D3 H D2 H D1, its diagonals `signs`
  [heads, FAST_ROUNDS, rotations, dim] (`fast_signs`): x [batch, heads, length, dim] -> int32 codes
  [b, h, L, num_hashes].

  Each rotation yields `dim` pseudo-random hyperplane coordinates, cut into the `num_hashes * tau` bits.
  Coordinates of one rotation are orthogonal rather than independent, so the collision probability matches
  `(1 - theta/pi)^tau` only approximately (closely for dim >= 32). Cost O(num_hashes * tau * log(dim)) per
  vector.
  """
  signs = signs.astype(x.dtype)
  y = x[..., None, :]  # [batch, heads, length, 1, dim]
  for r in range(FAST_ROUNDS):
    y = hadamard(y * signs[:, r][:, None])  # signs [heads, 1, rotations, dim] -> y [b, h, L, rotations, dim]
  proj = y.reshape(*x.shape[:-1], signs.shape[2] * x.shape[-1])  # [batch, heads, length, rotations * dim]
  return _codes_from_projections(proj, num_hashes, tau)


HASHES = {"gaussian": (gaussian_projections, gaussian_codes), "fast": (fast_signs, fast_codes)}


def hash_functions(rng: Array, *, heads: int, dim: int, num_hashes: int, tau: int, method: str = "gaussian",
                   dtype: Any = jnp.float32) -> Array:
  """The hash functions of family `method` for every head, drawn from `rng`, heads first (so that a heads
  shard takes its rows): gaussian [heads, dim, m * tau] normals, fast [heads, FAST_ROUNDS, rotations, dim]
  signs."""
  if method not in HASHES:
    raise ValueError(f"argument 'hash' must be one of {tuple(HASHES)}, got {method!r}")
  return HASHES[method][0](rng, heads=heads, dim=dim, num_hashes=num_hashes, tau=tau, dtype=dtype)


def codes(x: Array, functions: Array, *, num_hashes: int, tau: int, method: str = "gaussian") -> Array:
  """x [batch, heads, length, dim] hashed by `functions` (`hash_functions`) -> int32 codes [b, h, L, m]."""
  if x.ndim != 4:
    raise ValueError(f"hash_codes: x must be [batch, heads, length, dim], got shape {tuple(x.shape)}")
  return HASHES[method][1](x, functions, num_hashes=num_hashes, tau=tau)


def hash_codes(x: Array, rng: Array, *, num_hashes: int, tau: int, method: str = "gaussian") -> Array:
  """x [batch, heads, length, dim] -> int32 codes [b, h, L, m], the functions drawn from `rng` (in x's
  dtype)."""
  if x.ndim != 4:
    raise ValueError(f"hash_codes: x must be [batch, heads, length, dim], got shape {tuple(x.shape)}")
  functions = hash_functions(rng, heads=x.shape[1], dim=x.shape[3], num_hashes=num_hashes, tau=tau,
                             method=method, dtype=x.dtype)
  return codes(x, functions, num_hashes=num_hashes, tau=tau, method=method)
