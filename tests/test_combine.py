"""The shared softmax: merging partial softmaxes equals one joint softmax over the union of their pieces."""

import jax
import jax.numpy as jnp
import numpy as np

from core.combine import Piece, joint_softmax, merge, normalize, partial_softmax


def test_merge_equals_joint_softmax_with_empty_and_far_apart_partials():
  rng = np.random.default_rng(0)
  q, n, d = 6, 5, 3
  shifts = (0.0, -1000.0, 800.0)  # logits hundreds apart: rescaling must neither overflow nor drop rows
  valid = rng.random((len(shifts), q, n)) < 0.6
  valid[:, :3] = False
  valid[1, 0, :2] = True  # row 0: valid only in the far-negative piece
  valid[2, 2, 1:] = True  # row 1: valid nowhere; row 2: only in the far-positive piece
  valid[:, 3:, 0] = True
  with jax.enable_x64(True):
    pieces = []
    for shift, ok in zip(shifts, valid, strict=True):
      values = jnp.asarray(rng.standard_normal((q, n, d)))
      pieces.append(Piece(jnp.asarray(rng.standard_normal((q, n)) + shift), jnp.asarray(ok),
                          lambda w, values=values: jnp.einsum("qn,qnd->qd", w, values)))
    expected = joint_softmax(pieces)
    merged = normalize(merge([partial_softmax([p]) for p in pieces]))
    np.testing.assert_allclose(merged, expected, rtol=1e-12, atol=1e-300)
    assert np.all(np.isfinite(merged))
    np.testing.assert_array_equal(merged[1], 0.0)  # no valid entry anywhere: zeros, not NaN
    assert np.all(merged[0] != 0.0) and np.all(merged[2] != 0.0)  # single-piece rows survive the rescaling
