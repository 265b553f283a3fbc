"""Cached decoding of the Compressive Transformer (models/compressive_attention.py): the decoder keeps the
FIFO window and the compressed memory and compresses each group of c states that leaves the window, so its
logits equal, position by position, the model's segment recurrence with segments of c tokens over the same
tokens (float64), through a prefilled prompt and then one step per token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.memory_checks import run_segments
from tests.models.test_compressive import VOCAB, config
from tests.models.test_recurrence import random_model

BATCH, MEM, COMPRESSED, RATE, GROUPS, PROMPT = 2, 4, 2, 3, 7, 5


def segments(model, tokens):
  """The model's segment recurrence with segments of c tokens: logits [batch, length, vocab]."""
  return run_segments(model, tokens, RATE, MEM)[0]


def decoded(model, tokens):
  """Prefill of PROMPT tokens, then one jitted step per position: logits [batch, length, vocab]."""
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda state, cache, prompt: nnx.merge(graphdef, state).prefill(cache, prompt))
  step = jax.jit(lambda state, cache, token, t: nnx.merge(graphdef, state).decode(cache, token, t))
  logits, cache = prefill(state, model.init_cache(BATCH, tokens.shape[1]), tokens[:, :PROMPT])
  out = [logits]
  for t in range(PROMPT + 1, tokens.shape[1]):
    logits, cache = step(state, cache, tokens[:, t - 1], jnp.int32(t))
    out.append(logits[:, None])
  for layer in cache:  # the compressed FIFO is full
    assert np.asarray(layer.state["compressed_valid"]).all()
  return jnp.concatenate(out, axis=1)


# conv fast (learned compression); max_pool, most_used (usage accumulated over the group) and dilated_conv
# with two layers slow.
@pytest.mark.parametrize("kind,layers", [("conv", 1)] + [
    pytest.param(kind, layers, marks=pytest.mark.slow)
    for kind, layers in (("max_pool", 1), ("most_used", 1), ("dilated_conv", 2))])
def test_decoding_equals_the_segment_recurrence(kind, layers):
  # 7 groups of 3 through a window of 4 and 2 compressed slots: the compressed FIFO fills and drops its
  # oldest; the prompt of 5 ends inside a group.
  with jax.enable_x64(True):
    c = config(kind, layers=layers)
    c.compressed_mem_len = COMPRESSED
    model = random_model(c, seq_len=RATE, seed=3)
    tokens = jax.random.randint(jax.random.key(4), (BATCH, GROUPS * RATE), 0, VOCAB)
    want = segments(model, tokens)
    got = decoded(model, tokens)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    if kind != "max_pool":
      return
    # The compressed memory matters: without it (Transformer-XL's memory alone) the late logits differ.
    c.compressed_mem_len = 0
    plain = segments(random_model(c, seq_len=RATE, seed=3), tokens)
    assert np.abs(np.asarray(plain - want)[:, -RATE:]).max() > 1e-6
