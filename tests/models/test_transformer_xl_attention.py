"""The Transformer-XL module: with and without memory its output is the op called with its weights (r from
W_{k,R} applied to the sinusoids, u, v), its parameters carry logical axes and receive gradient, it needs a
causal model, and a tiny decoder LM with it trains; slow: segment recurrence through a whole model equals one
pass over the sequence, cached decoding equals the forward pass, a sharded mesh equals one device, recompute
changes no gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attention_baselines.transformer_xl import sinusoid, transformer_xl
from configs import base
from models import metrics, registry, transformer
from tests.models.memory_checks import assert_recompute_changes_nothing, assert_segments_equal_whole

FEATURES, HEADS, HEAD_DIM = 8, 2, 4


def _module(causal=True, **fields):
  cfg = base.attention_config("transformer_xl")
  for key, value in fields.items():
    cfg[key] = value
  m = registry.build(cfg, features=FEATURES, num_heads=HEADS, head_dim=HEAD_DIM, causal=causal,
                     dtype=jnp.float32, rngs=nnx.Rngs(0))
  g = np.random.default_rng(1)  # the biases start at zero: give them values the test can see
  m.u[...] = jnp.asarray(g.normal(size=(HEADS, HEAD_DIM)), jnp.float32)
  m.v_bias[...] = jnp.asarray(g.normal(size=(HEADS, HEAD_DIM)), jnp.float32)
  return m


def test_module_with_and_without_memory_is_the_op_with_its_weights():
  m = _module()
  g = np.random.default_rng(2)
  x = jnp.asarray(g.normal(size=(2, 5, FEATURES)), jnp.float32)
  memory = jnp.asarray(g.normal(size=(2, 3, FEATURES)), jnp.float32)
  mask = jnp.asarray([[True] * 5, [True] * 3 + [False] * 2])
  memory_mask = jnp.asarray([[True] * 3, [False] * 3])  # row 1's stream has just restarted

  @nnx.jit
  def both(m, x, mask, memory, memory_mask):
    def want(context, keys):
      r = jnp.einsum("nf,fhd->nhd", sinusoid(context.shape[1], FEATURES), m.pos_key.kernel[...])
      o = transformer_xl(m.query(x), m.key(context), m.value(context), r=r, u=m.u[...], v_bias=m.v_bias[...],
                         mask=keys)
      return m.out(o)

    keys = jnp.concatenate([memory_mask, mask], axis=1)
    context = jnp.concatenate([memory, x], axis=1)
    return (m(x, mask, deterministic=True), want(x, mask),
            m(x, mask, deterministic=True, memory=memory, memory_mask=memory_mask), want(context, keys),
            m(x, None, deterministic=True, memory=memory), want(context, None))

  got, want, got_mem, want_mem, got_all, want_all = both(m, x, mask, memory, memory_mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_mem, want_mem, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_all, want_all, rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(got_mem - got).max()) > 1e-4  # the memory is read
  specs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
  assert tuple(specs["pos_key"]["kernel"].get_value()) == ("embed", "heads", "kv")
  assert tuple(specs["u"].get_value()) == ("heads", "kv")
  assert tuple(specs["v_bias"].get_value()) == ("heads", "kv")


def test_needs_a_causal_model_and_owns_its_weights():
  with pytest.raises(ValueError, match="causal=False"):
    _module(causal=False)
  cfg = base.attention_config("transformer_xl")
  cfg.params.u = 0.0
  with pytest.raises(ValueError, match="not plan parameters"):
    registry.build(cfg, features=FEATURES, num_heads=HEADS, head_dim=HEAD_DIM, causal=True, dtype=jnp.float32,
                   rngs=nnx.Rngs(0))


def _lm(**fields):
  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 1, 16, 2, 32
  cfg.attention = base.attention_config("transformer_xl")
  for key, value in fields.items():
    cfg.attention[key] = value
  return transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=16)


def test_tiny_lm_trains_and_every_weight_learns():
  """A decoder LM on sequences that repeat with period 3 (the next token is the one 3 back): the loss falls,
  and W_{k,R}, u and v receive gradient."""
  model = _lm()
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, batch):
    def loss_fn(model):
      return metrics.loss_and_sums("lm", model(batch, deterministic=False), batch)[0]

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss, grads

  def batch(i):
    start = np.random.default_rng(i).integers(0, 8, size=(8, 3))
    tokens = np.tile(start, (1, 6))[:, :16].astype(np.int32)  # [8, 16]
    return {"inputs": jnp.asarray(tokens), "mask": jnp.ones(tokens.shape, bool)}

  losses = []
  for i in range(12):
    loss, grads = step(model, opt, batch(i))
    losses.append(float(loss))
    if i == 0:
      att = grads["encoder"]["blocks"][0]["attention"]
      for name in ("u", "v_bias"):
        assert float(jnp.abs(att[name][...]).sum()) > 0, name
      assert float(jnp.abs(att["pos_key"]["kernel"][...]).sum()) > 0
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


@pytest.mark.slow
def test_model_decode_equals_forward(decoding_matches_forward):
  model = _lm()
  for block in model.encoder.blocks:  # non-zero biases, so the decoder's use of them is checked
    block.attention.u[...] = 0.3 * jnp.ones_like(block.attention.u[...])
    block.attention.v_bias[...] = -0.2 * jnp.ones_like(block.attention.v_bias[...])
  decoding_matches_forward(model, 16)


@pytest.mark.slow
def test_model_on_a_mesh_equals_single_device():
  """Heads split over "model" (r, u and v split with them) and the batch over "data": the same loss and
  gradients as one device."""
  from tests.models import test_shard_map_attention as shard

  cfg, task = shard.model_config("transformer_xl")
  net = transformer.build_model(cfg, task=task, vocab_size=11, seq_len=shard.LENGTH)
  ids = jax.random.randint(jax.random.key(1), (shard.BATCH, shard.LENGTH), 0, 11)
  shard.assert_close(shard.loss_and_grads(net, ids, shard.cpu_mesh(4, 2)), shard.loss_and_grads(net, ids))


@pytest.mark.slow
def test_recompute_gives_the_same_loss_and_gradients():
  assert_recompute_changes_nothing(_module, FEATURES)


@pytest.mark.slow  # fast: the module with a memory against the op, the op against its definition
def test_segments_with_memory_equal_the_whole_sequence():
  """Segment recurrence (`model.mem_len`): three segments of 4 through 2 layers with a memory of 8 (every
  earlier position) give the logits of one pass over the 12 tokens, as relative positions do not depend on
  where a segment starts (no absolute position embedding)."""
  cfg = base.base_config().model
  cfg.num_layers, cfg.features, cfg.num_heads, cfg.mlp_dim = 2, 16, 2, 32
  cfg.position_embedding, cfg.mem_len = "none", 8
  cfg.attention = base.attention_config("transformer_xl")
  model = transformer.build_model(cfg, task="lm", vocab_size=11, seq_len=4)
  for block in model.encoder.blocks:
    block.attention.u[...] = 0.5 * jnp.ones_like(block.attention.u[...])
    block.attention.v_bias[...] = -0.5 * jnp.ones_like(block.attention.v_bias[...])
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 11)
  assert_segments_equal_whole(model, tokens, 4, 8)
