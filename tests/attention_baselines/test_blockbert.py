"""BlockBERT (blockwise attention with per-head block permutations): the op against its definition in
float64 (ragged blocks included), its identity case and its argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.blockbert import blockbert, default_shifts
from attention_baselines.local import local
from tests.attention_baselines.definitions import masked_softmax


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
    rng = np.random.default_rng(length + n)  # numpy inputs: no random-number programs to compile
    q, k, v = (rng.normal(size=(2, length, 3, dim)) for dim in (4, 4, 3))
    mask = rng.random((2, length)) < 0.75
    mask[:, 0] = True
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
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(2, 12, 2, 4)) for _ in range(3))
    mask = rng.random((2, 12)) < 0.75
    mask[:, 0] = True
    out, block_local, no_mask = jax.jit(lambda q, k, v, m: (
        blockbert(q, k, v, causal=False, mask=m, num_blocks=3, shifts=(0, 0)),
        local(q, k, v, causal=False, mask=m, block_size=4, implementation="xla"),
        blockbert(q, k, v, causal=False, num_blocks=3, shifts=(0, 1))))(q, k, v, mask)
    np.testing.assert_allclose(out, block_local, rtol=1e-10, atol=1e-12)
    # no mask: every key real
    np.testing.assert_allclose(no_mask, _reference(q, k, v, np.ones((2, 12), bool), 3, (0, 1)), rtol=1e-10,
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
  x = np.random.default_rng(0).normal(size=(2, 10, 8)).astype(np.float32)
  mask = np.ones((2, 10), bool)
  mask[1, 7:] = False

  @nnx.jit
  def both(m, x, mask):
    q, k, v = m.project(x)
    return m(x, mask, deterministic=True), m.out(blockbert(q, k, v, causal=False, mask=mask, num_blocks=3,
                                                           shifts=(1, 0)))

  got, want = both(m, x, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  cfg.shifts = (0, 1, 1)
  with pytest.raises(ValueError, match="shifts"):
    registry.build(cfg, features=8, num_heads=2, head_dim=4, causal=False, dtype=jnp.float32,
                   rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_blockbert_masked_keys_get_no_gradient():
  rng = np.random.default_rng(2)
  q, k, v = (rng.normal(size=(2, 10, 3, 4)).astype(np.float32) for _ in range(3))
  mask = rng.random((2, 10)) < 0.75
  mask[:, 0] = True
  bad = ~mask[:, :, None, None]
  fn = lambda k, v: jnp.sum(blockbert(q, k, v, causal=False, mask=mask, num_blocks=3) ** 2)  # noqa: E731
  for g in jax.jit(jax.grad(fn, argnums=(0, 1)))(np.where(bad, np.nan, k), np.where(bad, np.inf, v)):
    assert np.all(np.isfinite(np.asarray(g)))
    assert not np.any(np.asarray(g)[bad[..., 0, 0]])
