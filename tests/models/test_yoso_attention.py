"""YOSO at the model level: YOSO-C's depthwise convolution, the module's rng handling, tiny models that train.

The bidirectional check reads the generated recall records (`synthetic_recall`) as a masked-token task: every
answer token is replaced by a mask id and predicted from the whole sequence (the model must find the pair
token of the queried key, anywhere); the causal check trains a decoder LM on the same records.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from attention_core import registry as ops_registry
from configs import base
from data import synthetic
from models import metrics, registry, transformer
from yoso.attention import yoso, yoso_c
from yoso.conv import depthwise_conv


def _conv_reference(v, kernel, mask):
  v = np.where(np.asarray(mask)[:, :, None, None], np.asarray(v, np.float64), 0.0)
  b, length, h, e = v.shape
  size = kernel.shape[-1]
  out = np.zeros(v.shape)
  for i in range(length):
    for t in range(size):
      j = i + t - size // 2
      if 0 <= j < length:
        out[:, i] += np.asarray(kernel, np.float64)[None, :, t, None] * v[:, j]
  return out


def test_depthwise_conv_matches_definition_and_ignores_padding():
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    v = jnp.asarray(rng.normal(size=(2, 9, 3, 4)))
    kernel = jnp.asarray(rng.normal(size=(3, 5)))
    mask = jnp.ones((2, 9), bool).at[1, 6:].set(False)
    out = depthwise_conv(v, kernel, mask)
    np.testing.assert_allclose(out, _conv_reference(v, kernel, mask), rtol=1e-12, atol=1e-12)
    junk = v.at[1, 6:].set(1e3)
    np.testing.assert_array_equal(depthwise_conv(junk, kernel, mask), out)
    # yoso_c = yoso + the convolution, same rng, same hashes.
    q, k = jnp.asarray(rng.normal(size=(2, 9, 3, 8))), jnp.asarray(rng.normal(size=(2, 9, 3, 8)))
    key = jax.random.key(1, impl="rbg")
    np.testing.assert_allclose(
        yoso_c(q, k, v, rng=key, num_hashes=4, tau=3, conv_kernel=kernel, mask=mask),
        yoso(q, k, v, rng=key, num_hashes=4, tau=3, mask=mask) + out, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="'conv_kernel'"):
      yoso_c(q, k, v, rng=key, num_hashes=4, tau=3, conv_kernel=jnp.ones((3, 4)))


def _tiny_cfg(name: str, **fields) -> ml_collections.ConfigDict:
  c = base.base_config().model
  c.num_layers, c.features, c.num_heads, c.mlp_dim = 1, 32, 2, 64
  c.attention = base.attention_config(name)
  c.attention.params.num_hashes = 8 if name != "yoso_e" else None
  if name == "yoso_e":
    del c.attention.params["num_hashes"]
  c.attention.params.tau = 4
  for k, v in fields.items():
    c.attention[k] = v
  return c


@pytest.mark.slow
def test_module_rng_stream_conv_parameter_and_directions():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 12, 32)), jnp.float32)
  mask = jnp.ones((2, 12), bool).at[1, 9:].set(False)
  kwargs = dict(features=32, num_heads=2, head_dim=16, causal=False, dtype=jnp.float32)
  att = registry.build(_tiny_cfg("yoso").attention, rngs=nnx.Rngs(params=0, dropout=1, attention=2), **kwargs)
  a, b = att(x, mask, deterministic=True), att(x, mask, deterministic=True)
  assert float(jnp.max(jnp.abs(a - b))) > 1e-4  # each call draws fresh hash functions from the stream
  nnx.reseed(att, attention=7)
  c = att(x, mask, deterministic=True)
  nnx.reseed(att, attention=7)
  np.testing.assert_array_equal(c, att(x, mask, deterministic=True))  # a fixed seed repeats exactly (eval)
  # yoso_c owns a [heads, 33] kernel and uses it; conv_kernel_size adds one to yoso_e.
  c_att = registry.build(_tiny_cfg("yoso_c").attention, rngs=nnx.Rngs(0), **kwargs)
  assert c_att.conv[...].shape == (2, 33)
  # *YOSO-C: the same forward (same hashes, same kernel), the sketched backward.
  s_att = registry.build(_tiny_cfg("yoso_sketch_c").attention, rngs=nnx.Rngs(0), **kwargs)
  assert s_att.conv[...].shape == (2, 33)
  assert ops_registry.get("yoso_sketch_c").params(12)["backward_features"] == 1
  nnx.update(s_att, nnx.state(c_att))
  nnx.reseed(c_att, attention=3)
  nnx.reseed(s_att, attention=3)
  np.testing.assert_allclose(s_att(x, mask, deterministic=True), c_att(x, mask, deterministic=True),
                             rtol=1e-5, atol=1e-6)
  e_att = registry.build(_tiny_cfg("yoso_e", conv_kernel_size=5).attention, rngs=nnx.Rngs(0), **kwargs)
  out = e_att(x, mask, deterministic=True)
  e_att.conv[...] = jnp.zeros_like(e_att.conv[...])
  assert float(jnp.max(jnp.abs(out - e_att(x, mask, deterministic=True)))) > 1e-4
  with pytest.raises(ValueError, match="conv_kernel_size"):
    registry.build(_tiny_cfg("yoso", conv_kernel_size=4).attention, rngs=nnx.Rngs(0), **kwargs)
  # Causal: yoso runs (tests/yoso/test_causal.py); YOSO-C and any convolution read future values.
  causal = dict(kwargs, causal=True)
  c_yoso = registry.build(_tiny_cfg("yoso").attention, rngs=nnx.Rngs(params=0, dropout=1, attention=2),
                          **causal)
  y = c_yoso(x, mask, deterministic=True)
  assert y.shape == x.shape and np.all(np.isfinite(np.asarray(y)))
  with pytest.raises(ValueError, match="causal"):
    registry.build(_tiny_cfg("yoso_c").attention, rngs=nnx.Rngs(0), **causal)
  with pytest.raises(ValueError, match="conv_kernel_size.*causal"):
    registry.build(_tiny_cfg("yoso_e", conv_kernel_size=5).attention, rngs=nnx.Rngs(0), **causal)


def _recall_records(step: int, batch_size: int = 16):
  """(records' tokens, weights) [batch, 32] and the vocabulary size of a small synthetic recall task."""
  data = ml_collections.ConfigDict({"data": dict(synthetic.DEFAULTS, seq_len=32, num_pairs=4, num_keys=6,
                                                  num_values=4)})
  source = synthetic.RecallSource(data, "train", seed=0)
  recs = [source[step * batch_size + i] for i in range(batch_size)]
  return (np.stack([r["inputs"] for r in recs]), np.stack([r["weights"] for r in recs]),
          synthetic.vocab_size(data))


def _train(model, task: str, batch, steps: int) -> list[float]:
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, batch):
    def loss_fn(model):
      return metrics.loss_and_sums(task, model(batch, deterministic=False), batch)[0]

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt, batch(i))) for i in range(steps)]
  assert all(np.isfinite(losses))
  return losses


@pytest.mark.slow  # test_tiny_causal_yoso_lm_trains is the fast one
def test_tiny_yoso_model_trains_on_recall_records():
  vocab = _recall_records(0)[2]
  mask_id = vocab  # one extra input id

  def batch(step):
    tokens, weights, _ = _recall_records(step)
    return {"inputs": jnp.asarray(np.where(weights > 0, mask_id, tokens)), "targets": jnp.asarray(tokens),
            "weights": jnp.asarray(weights), "mask": jnp.ones(tokens.shape, bool)}

  model = transformer.build_model(_tiny_cfg("yoso"), task="mlm", vocab_size=vocab, seq_len=32,
                                  input_vocab_size=vocab + 1)
  losses = _train(model, "mlm", batch, 40)
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  assert last < 0.7 * first, (first, last)


def test_tiny_causal_yoso_lm_trains():
  # A decoder LM with causal YOSO attention (fresh hashes every step) on the recall records: every token.
  vocab = _recall_records(0)[2]

  def batch(step):
    tokens = _recall_records(step)[0]
    return {"inputs": jnp.asarray(tokens), "mask": jnp.ones(tokens.shape, bool)}

  model = transformer.build_model(_tiny_cfg("yoso"), task="lm", vocab_size=vocab, seq_len=32)
  assert model.encoder.blocks[0].attention.causal
  losses = _train(model, "lm", batch, 20)
  first, last = np.mean(losses[:3]), np.mean(losses[-3:])
  assert last < 0.8 * first, (first, last)
