"""The adaptive-span module over a Transformer-XL memory (`model.mem_len`): with a memory its output is the
op called with its weights and spans (the op with a memory is checked against its definition in
tests/attention_baselines/test_adaptive_span_memory.py); slow: a tiny LM with a memory and no position
embedding trains (and its spans receive gradient), the new memory is a constant to the parameters, segments
with a memory that covers the past equal one pass over the sequence, and recompute changes no gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attention_baselines.adaptive_span import adaptive_span
from configs import base
from models import metrics, registry, transformer
from tests.models import memory_checks

FEATURES, HEADS, HEAD_DIM = 8, 2, 4


def _module(**fields):
  cfg = base.attention_config("adaptive_span")
  cfg.params.max_span, cfg.params.ramp = 6, 2
  cfg.span_init = 0.7  # spans of 4.2 tokens: keys up to distance 6 weigh, the memory's far end does not
  for key, value in fields.items():
    cfg[key] = value
  return registry.build(cfg, features=FEATURES, num_heads=HEADS, head_dim=HEAD_DIM, causal=True,
                        dtype=jnp.float32, rngs=nnx.Rngs(0), seq_len=5)


def test_module_with_memory_is_the_op_with_its_weights():
  """Keys and values from concat([memory, x]) with the memory's and the segment's masks, queries from x; the
  memory (9) is longer than any span reaches (6 + 2), which the op handles."""
  m = _module()
  m.span_ratio[...] = jnp.asarray([0.3, 0.8])  # spans 1.8 and 4.8
  g = np.random.default_rng(2)
  x = jnp.asarray(g.normal(size=(2, 5, FEATURES)), jnp.float32)
  memory = jnp.asarray(g.normal(size=(2, 9, FEATURES)), jnp.float32)
  mask = jnp.asarray([[True] * 5, [True] * 3 + [False] * 2])
  memory_mask = jnp.asarray([[True] * 9, [False] * 6 + [True] * 3])  # row 1's stream restarted 3 back

  @nnx.jit
  def both(m, x, mask, memory, memory_mask):
    keys = jnp.concatenate([memory_mask, mask], axis=1)  # [batch, M + L]
    context = jnp.concatenate([memory, x], axis=1)  # [batch, M + L, features]
    o = adaptive_span(m.query(x), m.key(context), m.value(context), causal=True, mask=keys, spans=m.spans(),
                      max_span=6, ramp=2.0, block_size=4)  # [batch, L, heads, head_dim]
    return m(x, mask, deterministic=True, memory=memory, memory_mask=memory_mask), m.out(o)

  got, want = both(m, x, mask, memory, memory_mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _lm(*, mem_len, seq_len, **fields):
  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 1, 16, 2, 32
  cfg.position_embedding, cfg.mem_len = "none", mem_len
  cfg.attention = base.attention_config("adaptive_span")
  for key, value in fields.items():
    cfg.attention[key] = value
  return transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=seq_len)


@pytest.mark.slow  # ~10 s of CPU: ten steps of two segments, compiled once
def test_tiny_lm_with_memory_trains():
  """Streams with period 3 (the next token is the one 3 back) in two segments of 8, the second reading the
  first's memory of 8: the loss falls, and the spans and every attention weight receive gradient."""
  model = _lm(mem_len=8, seq_len=8, span_init=0.5, span_loss=1e-3, params={"ramp": 4})
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, tokens):
    def loss_fn(model):
      memory = model.init_memory(tokens.shape[0], 8)
      total = 0.0
      for s in range(2):
        segment = tokens[:, 8 * s:8 * (s + 1)]
        batch = {"inputs": segment, "mask": jnp.ones(segment.shape, bool)}
        logits, memory = model(batch, deterministic=False, memory=memory)
        total = total + metrics.loss_and_sums("lm", logits, batch)[0]
      sown = nnx.pop(model, nnx.Intermediate)
      return total / 2 + sum(jnp.sum(v) for v in jax.tree.leaves(sown))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss, grads

  losses = []
  for i in range(10):
    start = np.random.default_rng(i).integers(0, 8, size=(8, 3))
    loss, grads = step(model, opt, jnp.asarray(np.tile(start, (1, 6))[:, :16], jnp.int32))
    losses.append(float(loss))
    if i == 0:
      att = grads["encoder"]["blocks"][0]["attention"]
      assert np.all(np.abs(np.asarray(att["span_ratio"][...])) > 0)
      for name in ("query", "key", "value", "out"):
        assert float(jnp.abs(att[name]["kernel"][...]).sum()) > 0, name
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


@pytest.mark.slow  # ~5 s: three gradients compiled; tests/models/test_recurrence.py checks it fast
def test_memory_gets_no_gradient():
  """The memory a segment returns is a constant to the parameters (the model stops its gradient), so the
  next segment's gradient is the one it has with that memory held fixed."""
  model = _lm(mem_len=4, seq_len=4, span_init=0.8, params={"ramp": 2})
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, 11)
  weights = jax.random.normal(jax.random.key(4), (2, 4, 16), jnp.float32)
  memory_checks.assert_memory_gets_no_gradient(model, tokens, weights, 4, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # ~5 s; fast: the module with a memory against the op, the op against its definition
def test_segments_with_memory_equal_the_whole_sequence():
  """Three segments of 4 through 2 layers with a memory of 8 (every earlier position) give the logits of one
  pass over the 12 tokens: the soft mask and the relative position embeddings depend only on distances,
  max_span (6) and R are fixed when the model is built, and there is no absolute position embedding (the
  paper's setting)."""
  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 2, 16, 2, 32
  cfg.position_embedding, cfg.mem_len = "none", 8
  cfg.attention = base.attention_config("adaptive_span")
  cfg.attention.relative_positions = True
  cfg.attention.params.max_span, cfg.attention.params.ramp = 6, 2
  model = transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=4)
  for block, ratio in zip(model.encoder.blocks, ([0.2, 0.9], [0.5, 0.7]), strict=True):
    block.attention.span_ratio[...] = jnp.asarray(ratio)  # spans 1.2 .. 5.4: some keys partly weighed
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 11)
  memory_checks.assert_segments_equal_whole(model, tokens, 4, 8)


@pytest.mark.slow
@pytest.mark.parametrize("relative_positions", [False, True])
def test_recompute_gives_the_same_loss_and_gradients(relative_positions):
  grads = memory_checks.assert_recompute_changes_nothing(
      lambda **fields: _module(relative_positions=relative_positions, **fields), FEATURES)
  assert float(jnp.abs(grads["span_ratio"][...]).max()) > 0
  if relative_positions:
    assert float(jnp.abs(grads["positions"][...]).max()) > 0


def test_max_span_zero_is_a_plan_the_module_builds():
  """max_span = 0 (every span clamped to 0: only the ramp's R keys weigh) is what the op accepts, so a config
  may set it; a negative one is refused naming the field."""
  cfg = base.attention_config("adaptive_span")
  cfg.params.max_span, cfg.params.ramp = 0, 2
  m = registry.build(cfg, features=FEATURES, num_heads=HEADS, head_dim=HEAD_DIM, causal=True,
                     dtype=jnp.float32, rngs=nnx.Rngs(0), seq_len=5)
  out = m(jnp.ones((1, 5, FEATURES)), None, deterministic=True)
  assert out.shape == (1, 5, FEATURES) and bool(jnp.isfinite(out).all())
  cfg.params.max_span = -1
  with pytest.raises(ValueError, match="max_span must be >= 0"):
    registry.build(cfg, features=FEATURES, num_heads=HEADS, head_dim=HEAD_DIM, causal=True,
                   dtype=jnp.float32, rngs=nnx.Rngs(0), seq_len=5)
