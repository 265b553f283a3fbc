"""YOSO's collision probability: `p = (1 - arccos(q . k)/pi)^tau`, the chance that `tau` random hyperplane
bits agree on two unit vectors.

`expected_collision` is YOSO-E's attention weight with its exact derivative; `surrogate_collision` has the
same value with the paper's lower-bound derivative `(tau/2) p` (eq. 4), the gradient the sampled backward
estimates. Below float64 the arccos is a polynomial (`arccos_poly`), cheaper than XLA:CPU's arccos in YOSO-E's
L^2 elementwise pass.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any

# Abramowitz & Stegun 4.4.46: arccos(x) = sqrt(1 - x) * sum_n c_n x^n on [0, 1], |error| <= 2e-8.
_ACOS_COEFFS = (1.5707963050, -0.2145988016, 0.0889789874, -0.0501743046, 0.0308918810, -0.0170881256,
                0.0066700901, -0.0012624911)


def arccos_poly(x: Array) -> Array:
  """arccos on [-1, 1] from A&S 4.4.46 and arccos(-x) = pi - arccos(x): |error| <= 2e-8 (float32-exact).

  XLA:CPU lowers jnp.arccos to an atan2 of a sqrt, several times slower than this Horner polynomial, which
  matters in YOSO-E's L^2 elementwise pass.
  """
  a = jnp.abs(x)
  r = jnp.asarray(_ACOS_COEFFS[-1], x.dtype)
  for c in _ACOS_COEFFS[-2::-1]:
    r = r * a + c
  r = jnp.sqrt(1 - a) * r
  return jnp.where(x >= 0, r, np.pi - r)


def _collision_base(cos: Array) -> Array:
  """1 - arccos(cos)/pi: the polynomial arccos up to float32, jnp.arccos for wider types (exact tests)."""
  acos = arccos_poly(cos) if jnp.finfo(cos.dtype).bits <= 32 else jnp.arccos(cos)
  return 1.0 - acos / np.pi


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _collision(cos: Array, tau: int) -> Array:
  return jax.lax.integer_pow(_collision_base(cos), tau)


@_collision.defjvp
def _collision_jvp(tau, primals, tangents):
  # d/dc (1 - arccos(c)/pi)^tau = tau base^(tau-1) / (pi sqrt(1 - c^2)): re-uses base^(tau-1) from the value,
  # so the forward keeps one elementwise pass and no transcendental beyond one sqrt and one rsqrt.
  (cos,), (dcos,) = primals, tangents
  base = _collision_base(cos)
  low = jax.lax.integer_pow(base, tau - 1)
  slope = (tau / np.pi) * low * jax.lax.rsqrt((1 - cos) * (1 + cos))
  return low * base, slope * dcos


def expected_collision(cos: Array, tau: int) -> Array:
  """(1 - arccos(cos)/pi)^tau, the collision probability of `tau` hyperplane bits, with its exact derivative.

  The cosine is clipped a few ulps inside [-1, 1] so that rounding (|q.k| slightly above 1) gives no NaN and
  the arccos derivative stays finite when a query is parallel to a key.
  """
  eps = 8 * float(jnp.finfo(cos.dtype).eps)
  return _collision(jnp.clip(cos, -1.0 + eps, 1.0 - eps), tau)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def surrogate_collision(cos: Array, tau: int) -> Array:
  """expected_collision with the paper's lower-bound derivative (tau/2) * p in place of the exact one (eq. 4).

  The exact derivative grows without bound as the cosine approaches 1; the surrogate is what YOSO trains with.
  """
  return expected_collision(cos, tau)


@surrogate_collision.defjvp
def _surrogate_collision_jvp(tau, primals, tangents):
  (cos,), (dcos,) = primals, tangents
  p = expected_collision(cos, tau)
  return p, (tau / 2) * p * dcos

