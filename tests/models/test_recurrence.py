"""Segment recurrence (Transformer-XL memories) in the LM, checked in float64 against a from-definition
reference of the whole model: segments with a memory that covers the past equal full causal attention at any
depth, one layer with a shorter memory equals attention over a band, the memory gets no gradient, a reset
empties a row, and configs that cannot carry a memory are one-line errors."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base, validation
from models import attention, registry, transformer
from runtime.cli import UsageError
from tests.models.memory_checks import assert_memory_gets_no_gradient, run_segments

NAME = "memory_dense_test"
VOCAB = 11


class MemoryDense(attention.AttentionBase):
  """Test-only: causal dense attention over [memory; x], keys masked by memory_mask and mask."""

  MEMORY = True

  def __call__(self, x, mask, *, deterministic, memory=None, memory_mask=None):
    b, length, f = x.shape
    if memory is None:
      memory, memory_mask = jnp.zeros((b, 0, f), x.dtype), jnp.zeros((b, 0), bool)
    m = memory.shape[1]
    mask = jnp.ones((b, length), bool) if mask is None else mask
    q = self.query(x)  # [batch, length, heads, head_dim]
    both = jnp.concatenate([memory, x], axis=1)  # [batch, m + length, features]
    k, v = self.key(both), self.value(both)  # [batch, m + length, heads, head_dim]
    causal = jnp.arange(m + length)[None, :] <= m + jnp.arange(length)[:, None]  # [length, m + length]
    keys = jnp.concatenate([memory_mask, mask], axis=1)  # [batch, m + length]
    allowed = causal[None, None] & keys[:, None, None, :]  # [batch, 1, length, m + length]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])  # [batch, heads, length, m + length]
    p = jax.nn.softmax(jnp.where(allowed, s, -1e30), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)  # [batch, length, heads, head_dim]
    return self.output(o, deterministic=deterministic)


@contextlib.contextmanager
def registered():
  """MemoryDense registered as NAME while the block runs: never at import, since the registry-wide sweeps
  (tests/models/test_transformer.py) collect `registry.names()` and would take it up."""
  new = NAME not in registry.MODULES
  if new:
    registry.register_module(NAME, MemoryDense)
  try:
    yield
  finally:
    if new:
      registry.MODULES.pop(NAME, None)


@pytest.fixture(autouse=True)
def memory_module():
  with registered():
    yield


def model_config(*, layers=1, mem_len=0, dtype="float64", name=NAME):
  c = base.base_config().model
  c.num_layers, c.features, c.num_heads, c.mlp_dim = layers, 16, 2, 32
  c.dtype, c.position_embedding, c.mem_len = dtype, "none", mem_len
  c.attention = base.attention_config(name)
  return c


def random_model(cfg, seq_len, seed=0):
  """The LM with every parameter random (norm scales near 1, biases and kernels spread), so that no term of
  the reference is 0 or 1. Values are drawn on the host: nothing compiles but the model itself."""
  abstract = nnx.eval_shape(lambda: transformer.build_model(cfg, task="lm", vocab_size=VOCAB,
                                                            seq_len=seq_len))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  rng = np.random.default_rng(seed)

  def draw(path, x):
    n = rng.standard_normal(x.shape).astype(x.dtype)
    name = jax.tree_util.keystr(path)
    return 1 + 0.3 * n if "scale" in name else (0.3 * n if "bias" in name else 0.25 * n)

  def concrete(x):  # the rng streams' keys and counters
    is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return jax.random.key(seed) if is_key else np.zeros(x.shape, x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, params), jax.tree.map(concrete, rest))


@nnx.jit
def reference_logits(model, tokens, allowed):
  """The LM from its definition in float64 over the whole sequence tokens [batch, T], where query i reads
  key j iff allowed[i, j]: BOS-shifted embeddings, pre-LN blocks (attention, GELU MLP), final LN, head."""
  p = lambda v: jnp.asarray(v[...], jnp.float64)  # noqa: E731

  def ln(x, norm):
    c = x - x.mean(-1, keepdims=True)
    return c / jnp.sqrt((c * c).mean(-1, keepdims=True) + 1e-6) * p(norm.scale) + p(norm.bias)

  def dense(x, layer, spec):
    return jnp.einsum(spec, x, p(layer.kernel)) + p(layer.bias)

  enc = model.encoder
  ids = jnp.concatenate([jnp.full_like(tokens[:, :1], model.bos_id), tokens[:, :-1]], axis=1)  # [batch, T]
  x = p(enc.embed.embedding)[ids]  # [batch, T, features]
  for block in enc.blocks:
    a, h = block.attention, ln(x, block.norm1)
    q, k, v = (dense(h, lay, "btf,fhd->bthd") for lay in (a.query, a.key, a.value))  # [batch, T, heads, d]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])  # [batch, heads, T, T]
    w = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
    x = x + dense(jnp.einsum("bhqk,bkhd->bqhd", w, v), a.out, "bqhd,hdf->bqf")
    h = ln(x, block.norm2)
    x = x + dense(jax.nn.gelu(dense(h, block.mlp.up, "btf,fm->btm")), block.mlp.down, "btm,mf->btf")
  return dense(ln(x, enc.norm), model.head, "btf,fv->btv")  # [batch, T, vocab]


def test_memory_covering_the_past_equals_full_attention_at_any_depth():
  # Three segments of 4 through 2 layers with mem_len = 8 (every earlier position is in memory): each layer's
  # memory holds exactly the full model's hidden states there, so every logit equals full causal attention.
  with jax.enable_x64(True):
    model = random_model(model_config(layers=2, mem_len=8), seq_len=4)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, VOCAB)
    got, memory = run_segments(model, tokens, 4, 8)
    want = reference_logits(model, tokens, jnp.tril(jnp.ones((12, 12), bool)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # the logits are returned in float32
    # After 12 positions the memory of 8 is full, and the next segment reads the last token instead of BOS.
    assert all(bool(m["valid"].all()) for m in memory["layers"])
    np.testing.assert_array_equal(memory["token"], tokens[:, -1])


@pytest.mark.slow  # ~3 s; the fast run checks the memory against full attention
def test_one_layer_with_a_shorter_memory_attends_over_a_band():
  # One layer, segments of 4, mem_len = 3: position t of segment 2 (absolute 4 + t) reads keys [1, 4 + t].
  with jax.enable_x64(True):
    model = random_model(model_config(layers=1, mem_len=3), seq_len=4, seed=1)
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, VOCAB)
    got, _ = run_segments(model, tokens, 4, 3)
    i, j = jnp.arange(8)[:, None], jnp.arange(8)[None, :]
    allowed = (j <= i) & ((i < 4) | (j >= 4 - 3))
    np.testing.assert_allclose(got, reference_logits(model, tokens, allowed), rtol=1e-6, atol=1e-6)
    # ... which differs from full attention there (the memory really is truncated).
    full = reference_logits(model, tokens, jnp.tril(jnp.ones((8, 8), bool)))
    assert np.abs(got[:, 4:] - full[:, 4:]).max() > 1e-3


@pytest.mark.slow  # ~5 s: three gradients of a float64 model compiled
def test_memory_gets_no_gradient():
  with jax.enable_x64(True):
    model = random_model(model_config(layers=2, mem_len=4), seq_len=4, seed=2)
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, VOCAB)
    weights = jax.random.normal(jax.random.key(4), (2, 4, 16), jnp.float64)
    assert_memory_gets_no_gradient(model, tokens, weights, 4, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # ~5 s; the fast run checks a reset in the train step (tests/training/test_recurrence.py)
def test_reset_empties_a_row_and_invalid_memory_is_ignored():
  with jax.enable_x64(True):
    model = random_model(model_config(layers=2, mem_len=4), seq_len=4, seed=3)
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, VOCAB)
    seg1, seg2 = {"inputs": tokens[:, :4]}, {"inputs": tokens[:, 4:]}

    @nnx.jit
    def run(model):
      empty = model.init_memory(2, 4)
      memory = model(seg1, deterministic=True, memory=empty)[1]
      cleared = transformer.reset_memory(memory, jnp.array([True, False]))
      # Invalid slots are never read: random contents there change nothing.
      noisy = dict(empty, layers=[dict(m, hidden=jax.random.normal(jax.random.key(i), m["hidden"].shape))
                                  for i, m in enumerate(empty["layers"])])
      outs = [model(seg2, deterministic=True, memory=m)[0] for m in (cleared, empty, memory, noisy)]
      return empty, memory, cleared, outs

    empty, memory, cleared, (got, from_empty, from_memory, from_noise) = run(model)
    for key in ("token", "token_valid"):
      np.testing.assert_array_equal(cleared[key], [empty[key][0], memory[key][1]])
    for c, e, m in zip(cleared["layers"], empty["layers"], memory["layers"], strict=True):
      assert bool(m["valid"].all())
      for key in ("hidden", "valid"):
        np.testing.assert_array_equal(c[key], np.stack([e[key][0], m[key][1]]))
    np.testing.assert_allclose(got[0], from_empty[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], from_memory[1], rtol=1e-12, atol=1e-12)
    assert np.abs(from_empty[1] - from_memory[1]).max() > 1e-3  # the memory matters where it is valid
    np.testing.assert_allclose(from_noise, from_empty, rtol=1e-12, atol=1e-12)


def test_config_errors():
  def build(cfg, task):  # shapes only: the errors come from construction
    nnx.eval_shape(lambda: transformer.build_model(cfg, task=task, vocab_size=VOCAB, seq_len=8))

  with pytest.raises(ValueError) as e:
    build(model_config(mem_len=4, dtype="float32", name="dense"), "lm")
  assert str(e.value).splitlines()[0] == ("config.model.mem_len=4 needs an attention whose module takes a "
                                          "memory; attention 'dense' (OpAttention) takes none")
  with pytest.raises(ValueError, match="config.model.mem_len=4: segment recurrence is for task 'lm'"):
    build(model_config(mem_len=4, dtype="float32"), "mlm")
  c = base.base_config()
  c.model.mem_len = -1
  with pytest.raises(UsageError, match="config.model.mem_len must be >= 0"):
    validation.validate(c)
  c.model.mem_len, c.model.eval_mem_len = 0, 16
  with pytest.raises(UsageError, match="config.model.eval_mem_len=16 needs config.model.mem_len > 0"):
    validation.validate(c)
  c.model.mem_len = 8
  validation.validate(c)
  c.model.position_embedding = "relative"
  with pytest.raises(ValueError, match="'learned', 'factorized', 'none'"):
    build(c.model, "lm")
