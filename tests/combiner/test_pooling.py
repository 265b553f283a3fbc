"""combiner/pooling.py's cummax: its value and gradient are those of a max over each prefix (ties split
evenly, as jnp.max's), in both scan directions and along any axis; its backward is a few cumulative ops, not
the associative scan JAX differentiates lax.cummax through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from combiner import pooling


def _prefix_max(x, axis: int, reverse: bool):
  """From the definition: the max of each prefix (suffix when reversed) as a masked [n, n] max."""
  xm = jnp.moveaxis(x, axis, -1)
  i = jnp.arange(xm.shape[-1])
  member = (i[None, :] >= i[:, None]) if reverse else (i[None, :] <= i[:, None])  # [t, s]
  return jnp.moveaxis(jnp.max(jnp.where(member, xm[..., None, :], -jnp.inf), axis=-1), -1, axis)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("values", ["normal", "ties", "leading_empty"])
def test_cummax_value_and_gradient_are_a_max_over_each_prefix(values, reverse):
  with jax.enable_x64(True):
    rng = np.random.default_rng(len(values) + reverse)
    shape = (3, 19, 5)
    x = rng.integers(-2, 3, shape).astype(np.float64) if values == "ties" else rng.normal(size=shape)
    if values == "leading_empty":  # members not yet real (masked to -inf), as pooling.masked gives them
      x[:, :6] = -np.inf
    g = rng.normal(size=shape)
    finite = np.isfinite(x)  # where a prefix has no member, the definition's gradient goes to its fill
    for axis in range(3):
      out, back = jax.vjp(lambda x, axis=axis: pooling.cummax(x, axis, reverse), jnp.asarray(x))
      want, want_back = jax.vjp(lambda x, axis=axis: _prefix_max(x, axis, reverse), jnp.asarray(x))
      np.testing.assert_array_equal(out, want)
      got = np.asarray(back(jnp.asarray(g))[0])
      assert np.isfinite(got).all()
      np.testing.assert_allclose(got[finite], np.asarray(want_back(jnp.asarray(g))[0])[finite], atol=1e-12)


def test_cummax_backward_is_a_few_ops():
  """The gradient's program: a handful of cumulative reductions and one gather, no log-depth slices."""
  x = jnp.zeros((4, 64, 8))
  grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(pooling.cummax(x, 1) ** 2)))(x)
  lax_grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jax.lax.cummax(x, axis=1) ** 2)))(x)
  slices = [str(e.primitive) for e in grad.jaxpr.eqns if "slice" in str(e.primitive)]
  assert len(slices) <= 3 and len(grad.jaxpr.eqns) < len(lax_grad.jaxpr.eqns) / 2, (slices, grad)
