"""The dense and random Synthesizers against float64 references written from their paper."""

import jax
import numpy as np
import pytest

from attention_baselines.synthesizer import synthesizer_dense, synthesizer_random
from tests.attention_baselines.definitions import (
  H,
  L,
  close_on_real,
  inputs_at,
  run_jit,
  softmax_rows,
  synth_params,
)


def synthesizer_reference(q, v, mask, causal, logits_fn):
  q, v, mask = (np.asarray(x) for x in (q, v, mask))
  b, length, h, _ = q.shape
  vis = mask[:, None, :] & (np.tril(np.ones((length, length), bool)) if causal else True)
  out = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      w, _ = softmax_rows(logits_fn(q[bi, :, hi], hi), vis[bi])
      out[bi, :, hi] = w @ v[bi, :, hi]
  return out


@pytest.mark.parametrize("causal", [False, True])
def test_synthesizers_match_definition(causal):
  with jax.enable_x64(True):
    length = L
    q, k, v, mask = inputs_at(length, 4)
    dense_p, random_p = synth_params(length)
    w1, b1, w2, b2 = (np.broadcast_to(np.asarray(dense_p[n]), (H, *np.shape(dense_p[n])[1:]))
                      for n in ("w1", "b1", "w2", "b2"))
    got = run_jit(synthesizer_dense, q, k, v, mask, causal=causal, **dense_p)
    want = synthesizer_reference(
        q, v, mask, causal, lambda x, h: (np.maximum(x @ w1[h] + b1[h], 0) @ w2[h] + b2[h])[:, :length])
    close_on_real(got, want, mask)
    logits = np.asarray(random_p["logits"])
    got = run_jit(synthesizer_random, q, k, v, mask, causal=causal, **random_p)
    want = synthesizer_reference(q, v, mask, causal, lambda x, h: logits[h, :length, :length])
    close_on_real(got, want, mask)
    with pytest.raises(ValueError, match="'w2'"):
      synthesizer_dense(q, k, v, causal=causal, **dict(dense_p, w2=dense_p["w2"][:, :, :4]))
