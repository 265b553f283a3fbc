"""BlockBERT (blockwise attention with per-head block permutations): the op against its definition in
float64 (ragged blocks included), its identity case and its argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.blockbert import blockbert, default_shifts
from attention_baselines.local import local
from tests.attention_baselines.definitions import inputs, masked_softmax


def _allowed(length, n, shift):
  """[L, L] from the paper's mask: M_ij = 1 iff pi(block(i)) = block(j), block(i) = floor(i n / L)."""
  block = np.arange(length) * n // length
  return (block[:, None] + shift) % n == block[None, :]


def _reference(q, k, v, mask, n, shifts):
  out = np.zeros(v.shape)
  for h, s in enumerate(shifts):
    out[:, :, h:h + 1] = masked_softmax(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1],
                                        _allowed(q.shape[1], n, s), mask)
  return out


# One ragged case runs fast; a regular grid and a larger n with shifts beyond n run with the slow tests.
@pytest.mark.parametrize("length,n,shifts", [
    (11, 3, (0, 2, 1)),
    pytest.param(12, 2, (0, 1, 1), marks=pytest.mark.slow),
    pytest.param(13, 4, (3, 0, 5), marks=pytest.mark.slow)])
def test_blockbert_matches_definition(length, n, shifts):
  with jax.enable_x64(True):
    q, k, v, mask = inputs(length + n, length=length, heads=3)
    # the fast case passes the shifts as a traced per-head array (the module's, also under a heads-split
    # mesh), the others as a static tuple
    traced = length == 11
    out = jax.jit(lambda q, k, v, m, s: blockbert(q, k, v, causal=False, mask=m, num_blocks=n,
                                                  shifts=s if traced else shifts))(
        q, k, v, mask, jnp.asarray(shifts, jnp.int32))
    np.testing.assert_allclose(out, _reference(q, k, v, mask, n, shifts), rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # head 0 of the fast definition case is block-diagonal already
def test_blockbert_identity_is_block_diagonal():
  with jax.enable_x64(True):
    q, k, v, mask = inputs(3, length=12, heads=2)
    out = blockbert(q, k, v, causal=False, mask=mask, num_blocks=3, shifts=(0, 0))
    np.testing.assert_allclose(out, local(q, k, v, causal=False, mask=mask, block_size=4,
                                          implementation="xla"), rtol=1e-10, atol=1e-12)
    # no mask: every key real
    np.testing.assert_allclose(blockbert(q, k, v, causal=False, num_blocks=3, shifts=(0, 1)),
                               _reference(q, k, v, np.ones((2, 12), bool), 3, (0, 1)), rtol=1e-10,
                               atol=1e-12)


def test_blockbert_default_shifts_follow_the_paper():
  assert default_shifts(12, 2) == (0,) * 10 + (1, 1)  # 10:2 of (1, 2):(2, 1)
  assert default_shifts(12, 3) == (0,) * 10 + (1, 2)  # 10:1:1
  assert default_shifts(4, 2) == (0, 0, 0, 1)
  assert default_shifts(1, 2) == (0,)
  assert default_shifts(8, 1) == (0,) * 8


def test_blockbert_rejects_bad_arguments():
  q = k = v = jnp.zeros((2, 11, 2, 4))  # the checks fail before any compute
  with pytest.raises(ValueError, match="causal"):
    blockbert(q, k, v, causal=True)
  with pytest.raises(ValueError, match="num_blocks"):
    blockbert(q, k, v, causal=False, num_blocks=0)
  with pytest.raises(ValueError, match="shifts"):
    blockbert(q, k, v, causal=False, shifts=(0, 1, 1))
  with pytest.raises(ValueError, match="shifts"):
    blockbert(q, k, v, causal=False, shifts=jnp.zeros((2,), jnp.float32))


@pytest.mark.slow
def test_blockbert_module_passes_its_configured_shifts():
  """The module's `shifts` field reaches the op (as a per-head array); a wrong count is a config error."""
  from flax import nnx

  from configs import base
  from models import registry

  cfg = base.attention_config("blockbert")
  cfg.shifts = (1, 0)
  cfg.params.num_blocks = 3
  m = registry.build(cfg, features=8, num_heads=2, head_dim=4, causal=False, dtype=jnp.float32,
                     rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 10, 8))
  mask = jnp.ones((2, 10), bool).at[1, 7:].set(False)
  q, k, v = m.project(x)
  want = m.out(blockbert(q, k, v, causal=False, mask=mask, num_blocks=3, shifts=(1, 0)))
  np.testing.assert_allclose(m(x, mask, deterministic=True), want, rtol=1e-5, atol=1e-6)
  cfg.shifts = (0, 1, 1)
  with pytest.raises(ValueError, match="shifts"):
    registry.build(cfg, features=8, num_heads=2, head_dim=4, causal=False, dtype=jnp.float32,
                   rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_blockbert_masked_keys_get_no_gradient():
  q, k, v, mask = inputs(2, length=10, heads=3, dtype=jnp.float32)
  bad = ~mask[:, :, None, None]
  fn = lambda k, v: jnp.sum(blockbert(q, k, v, causal=False, mask=mask, num_blocks=3) ** 2)  # noqa: E731
  for g in jax.grad(fn, argnums=(0, 1))(jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.inf, v)):
    assert np.all(np.isfinite(np.asarray(g)))
    assert not np.any(np.asarray(g)[np.asarray(bad[..., 0, 0])])
