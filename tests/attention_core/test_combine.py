"""The shared softmax: merging partial softmaxes equals one joint softmax over the union of their pieces."""

import jax
import jax.numpy as jnp
import numpy as np

from attention_core.combine import (
  Piece,
  attend,
  attend_zeros_hidden,
  joint_softmax,
  merge,
  normalize,
  partial_softmax,
)


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



def test_attend_zeros_hidden_equals_attend_with_gradients():
  """The hand-written backward equals autodiff of the guarded `attend`: key masks broadcast over queries,
  full masks with an empty row, huge masked logits, an output whose axes are permuted from the weights'."""
  rng = np.random.default_rng(1)
  cases = [("gnqk,gnkd->gnqd", (2, 3, 4, 5), (2, 3, 5, 6), (2, 3, 1, 5)),
           ("bhqk,bkhd->bqhd", (2, 3, 4, 5), (2, 5, 3, 6), (2, 3, 4, 5))]
  with jax.enable_x64(True):
    for contract, w_shape, v_shape, valid_shape in cases:
      valid = rng.random(valid_shape) < 0.6
      valid.reshape(-1, valid_shape[-1])[0] = False  # a row (or a key row shared by all queries) sees nothing
      full = np.broadcast_to(valid, w_shape)
      logits = jnp.asarray(np.where(full, rng.standard_normal(w_shape), 1e30))  # masked logits huge
      w_spec, rest = contract.split(",")
      v_spec, o_spec = rest.split("->")
      out_shape = jnp.einsum(contract, logits, jnp.zeros(v_shape)).shape
      reached = np.einsum(f"{w_spec},{o_spec}->{v_spec}", full.astype(float), np.ones(out_shape)) > 0
      values = jnp.asarray(np.where(reached, rng.standard_normal(v_shape), 0.0))  # the helper's premise
      cot = jnp.asarray(rng.standard_normal(out_shape))
      mask = jnp.asarray(valid)

      def loss(logits, values, fn, mask=mask, contract=contract, cot=cot):
        return jnp.sum(fn(logits, mask, values, contract) * cot)

      want, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(logits, values, attend)
      got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
          logits, values, attend_zeros_hidden)
      np.testing.assert_allclose(got, want, rtol=1e-12)
      for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
      assert np.all(np.asarray(grads[0])[~full] == 0)  # masked logits get no gradient
