"""What the YOSO tests hold the ops against: seeded inputs and keys, the paper's surrogate attention and
YOSO-E from their definitions."""


import jax
import jax.numpy as jnp
import numpy as np

from yoso.attention import l2_normalize


def seeded_key(seed):
  # RBG keys compile in a fraction of threefry's time; the op treats every key impl alike.
  return jax.random.key(seed, impl="rbg")


def seeded_inputs(seed, b=1, length=10, h=2, d=8, e=5, dtype=jnp.float64):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, length, h, d))
  # Keys correlated with queries give a spread of collision probabilities (not all near 2^-tau).
  k = q + 0.8 * rng.normal(size=(b, length, h, d))
  v = rng.normal(size=(b, length, h, e))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def surrogate(q, k, v, mask, tau, causal=False):
  """From the definition: P V on normalised q, k, where dP/d(q.k) is replaced by (tau/2) P (paper eq. 4);
  P_ij = 0 for j > i when causal."""
  qn, kn = l2_normalize(q), l2_normalize(k)
  cos = jnp.einsum("bqhd,bkhd->bhqk", qn, kn)

  @jax.custom_jvp
  def prob(c):
    return (1 - jnp.arccos(c) / np.pi) ** tau

  @prob.defjvp
  def _(primals, tangents):
    p = prob(primals[0])
    return p, (tau / 2) * p * tangents[0]

  length = q.shape[1]
  visible = mask[:, None, None, :] & (np.tri(length, dtype=bool) if causal else True)
  p = jnp.where(visible, prob(cos), 0.0)
  return jnp.einsum("bhqk,bkhe->bqhe", p, v)


def reference_yoso_e(q, k, v, mask, tau, normalize, causal=False):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros(v.shape)
  for bi in range(q.shape[0]):
    for hi in range(q.shape[2]):
      qn = q[bi, :, hi] / np.linalg.norm(q[bi, :, hi], axis=-1, keepdims=True)
      kn = k[bi, :, hi] / np.linalg.norm(k[bi, :, hi], axis=-1, keepdims=True)
      p = (1 - np.arccos(np.clip(qn @ kn.T, -1, 1)) / np.pi) ** tau * np.asarray(mask[bi])[None, :]
      if causal:
        p = np.tril(p)
      y = p @ v[bi, :, hi]
      out[bi, :, hi] = y / np.linalg.norm(y, axis=-1, keepdims=True) if normalize else y
  return out


def grads_of(fn, q, k, v):
  """d/d(q, k, v) of sum(fn(q, k, v) * cos(feature index)): a cotangent that weighs every feature."""
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * jnp.cos(jnp.arange(v.shape[-1]))), argnums=(0, 1, 2))(
      q, k, v)
