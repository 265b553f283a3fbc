"""Linformer against a float64 reference written from its paper; bidirectional only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_baselines.linformer import linformer
from tests.attention_baselines.definitions import L, inputs_at, run_jit, softmax_rows


def linformer_reference(q, k, v, mask, e, f):
  q, k, v, e, f = (np.asarray(x, np.float64) for x in (q, k, v, e, f))
  m = np.asarray(mask)[:, :, None, None]
  k, v = np.where(m, k, 0.0), np.where(m, v, 0.0)
  length, d = q.shape[1], q.shape[-1]
  out = np.zeros(v.shape)
  for bi in range(q.shape[0]):
    for hi in range(q.shape[2]):
      ek = e[:, :length] @ k[bi, :, hi]
      fv = f[:, :length] @ v[bi, :, hi]
      w, _ = softmax_rows(q[bi, :, hi] @ ek.T / np.sqrt(d), True)
      out[bi, :, hi] = w @ fv
  return out


def test_linformer_matches_definition_and_is_bidirectional_only():
  with jax.enable_x64(True):
    q, k, v, mask = inputs_at(L, 1)
    e, f = (jax.random.normal(jax.random.key(s), (4, 14), jnp.float64) for s in (7, 8))
    got = run_jit(linformer, q, k, v, mask, causal=False, proj_k=e, proj_v=f)
    np.testing.assert_allclose(got, linformer_reference(q, k, v, mask, e, f), rtol=1e-10, atol=1e-10)
    e2, f2 = jnp.stack([e, e]), jnp.stack([f, f])
    per_head = run_jit(linformer, q, k, v, mask, causal=False, proj_k=e2, proj_v=f2)
    np.testing.assert_allclose(per_head, got, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="'causal'"):
      linformer(q, k, v, causal=True, proj_k=e, proj_v=f)
    with pytest.raises(ValueError, match="'proj_k'"):
      linformer(q, k, v, causal=False, proj_k=e[:, :5], proj_v=f)
