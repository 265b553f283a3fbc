"""Cached decoding equals the causal forward pass: op by op, and for whole models (logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core import registry as ops_registry

# (op name, plan parameters): lengths below cross block and row boundaries (block/row 4, ragged last one).
OP_CASES = [
    ("dense", {}),
    ("combiner_fixed", {"block_size": 4}),
    ("combiner_fixed", {"block_size": 4, "pooling": "mean"}),
    ("combiner_axial_rowmajor", {"row_length": 4}),
    ("combiner_axial_vertical", {"row_length": 4}),
    ("combiner_axial_horizontal", {"row_length": 4, "pooling": "mean"}),
    ("combiner_logsparse", {}),
    ("combiner_logsparse", {"pooling": "mean"}),
    ("combiner_mixture", {"row_length": 4}),
    ("combiner_mixture_joint", {"row_length": 3}),
    ("sparse_fixed", {"block_size": 4}),
    ("sparse_axial", {"row_length": 4}),
    ("sparse_logsparse", {}),
    ("linear", {"chunk_size": 4}),
    ("performer", {"rng": jax.random.key(1), "num_features": 16, "chunk_size": 4}),
    ("local", {"block_size": 4}),
    ("local", {"block_size": 32}),
    ("longformer", {"window": 3, "global_positions": (0, 7, -2)}),
    ("longformer", {"window": 4, "global_positions": ()}),
    ("bigbird", {"block_size": 3, "global_blocks": (0, -2), "num_random_blocks": 2, "seed": 3}),
]


def _qkv(seed: int, batch: int, length: int, heads: int, dim: int, pooled: bool = False):
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (batch, length, heads, dim)
  q, k, v, pq, pk = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)
  return (q, k, v, pq, pk) if pooled else (q, k, v)


def _decode_all(spec, params, q, k, v, prompt: int = 0, pool_q=None, pool_k=None, **extra):
  """Prefills `prompt` positions, then steps through the rest (one compiled scan); the stepped outputs."""
  batch, length, heads, dim = q.shape
  dec = spec.decode
  pooled = {} if pool_q is None else {"pool_q": pool_q, "pool_k": pool_k}

  @jax.jit
  def run(q, k, v, pooled):
    cache = dec.init_cache(batch, heads, length, dim, v.shape[-1], q.dtype, **params)
    if prompt:
      head = {name: x[:, :prompt] for name, x in pooled.items()}
      cache = dec.prefill(cache, q[:, :prompt], k[:, :prompt], v[:, :prompt], **head, **params, **extra)

    def body(cache, t):
      def at(x):
        return jax.lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)

      out, cache = dec.step(cache, at(q), at(k), at(v), t, **{n: at(x) for n, x in pooled.items()}, **params,
                            **extra)
      return cache, out

    _, outs = jax.lax.scan(body, cache, jnp.arange(prompt, length))
    return jnp.swapaxes(outs, 0, 1)  # [batch, length - prompt, heads, value_dim]

  return run(q, k, v, pooled)


@pytest.mark.parametrize("name,params", OP_CASES,
                         ids=[f"{n}-{ {k: v for k, v in p.items() if k != 'rng'} }" for n, p in OP_CASES])
def test_op_step_equals_forward(name, params):
  spec = ops_registry.get(name)
  length = 19  # ragged: not a multiple of 4 or 3, > 16 so logsparse has 5 levels
  q, k, v = _qkv(0, 2, length, 2, 8)
  full = spec.fn(q, k, v, causal=True, **params)
  stepped = _decode_all(spec, params, q, k, v, prompt=6)
  np.testing.assert_allclose(stepped, full[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,params", [("combiner_fixed", {"block_size": 4}),
                                         ("combiner_axial_rowmajor", {"row_length": 4}),
                                         ("combiner_mixture", {"row_length": 4, "pooling": "mean"})])
def test_op_step_equals_forward_with_pooled_inputs(name, params):
  """DeepSets-style pool_q / pool_k (and the learned span key for rowmajor) reach the cached summaries."""
  spec = ops_registry.get(name)
  q, k, v, pq, pk = _qkv(1, 1, 13, 2, 8, pooled=True)
  extra = {}
  if name == "combiner_axial_rowmajor":
    w = jax.random.normal(jax.random.key(3), (8, 8))
    extra["span_key_fn"] = lambda s: jnp.tanh(s @ w)  # [batch, rows, heads, head_dim]
  full = spec.fn(q, k, v, causal=True, pool_q=pq, pool_k=pk, **params, **extra)
  stepped = _decode_all(spec, params, q, k, v, prompt=5, pool_q=pq, pool_k=pk, **extra)
  np.testing.assert_allclose(stepped, full[:, 5:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,params", [("linear", {"chunk_size": 4}), ("local", {"block_size": 4}),
                                         ("performer", {"rng": jax.random.key(2), "num_features": 16}),
                                         ("longformer", {"window": 3, "global_positions": (0, 4)}),
                                         ("bigbird", {"block_size": 3, "num_random_blocks": 1})],
                         ids=["linear", "local", "performer", "longformer", "bigbird"])
def test_op_step_keeps_nonfinite_values_where_the_forward_does(name, params):
  """A NaN or Inf value reaches exactly the outputs it reaches in the forward pass: local's ring keeps the
  previous block's NaN from the next block; linear's and Performer's summaries carry it to every later token
  of its head."""
  spec = ops_registry.get(name)
  q, k, v = _qkv(3, 2, 19, 2, 8)
  v = v.at[0, 3, 0, 1].set(jnp.nan).at[1, 9, 1, 0].set(jnp.inf)  # one in the prompt, one after it
  full = spec.fn(q, k, v, causal=True, **params)
  stepped = _decode_all(spec, params, q, k, v, prompt=6)
  assert np.isnan(stepped).any() and np.isfinite(stepped).any()
  np.testing.assert_allclose(stepped, full[:, 6:], rtol=1e-5, atol=1e-5)  # NaN positions must match too


def test_performer_step_rescales_when_a_later_key_raises_the_max():
  """The forward pass stabilises every key by the row's max, set here by a large key after the prompt; the
  decoder rescales its summaries when that key arrives, and still equals the forward pass."""
  spec = ops_registry.get("performer")
  params = {"rng": jax.random.key(5), "num_features": 16}
  q, k, v = _qkv(4, 2, 19, 2, 8)
  k = k.at[:, 12].multiply(3.0)
  stepped = _decode_all(spec, params, q, k, v, prompt=6)
  np.testing.assert_allclose(stepped, spec.fn(q, k, v, causal=True, **params)[:, 6:], rtol=2e-5, atol=2e-5)


def test_op_without_decoder_names_it():
  from models.attention import check_decodable

  with pytest.raises(ValueError, match="yoso"):
    check_decodable(ops_registry.get("yoso"))


def _model(attention: str, params: dict, *, task: str = "lm", seq_len: int = 20, position: str = "learned",
           deepsets: bool = False):
  import ml_collections

  from models import transformer

  cfg = ml_collections.ConfigDict({
      "num_layers": 2, "features": 16, "num_heads": 2, "mlp_dim": 32, "dropout_rate": 0.0, "dtype": "float32",
      "position_embedding": position, "image_shape": (2, 2, 5),
      "attention": {"name": attention, "params": params, "dropout_rate": 0.0}})
  if deepsets:
    cfg.attention.deepsets = True
  return transformer.build_model(cfg, task=task, vocab_size=11, seq_len=seq_len, seed=0)


MODEL_CASES = [("dense", {}), ("combiner_fixed", {"block_size": 4}),
               ("combiner_axial_rowmajor", {"row_length": 4}), ("combiner_axial_vertical", {"row_length": 4}),
               ("combiner_axial_horizontal", {"row_length": 4}), ("combiner_logsparse", {}),
               ("combiner_mixture", {"row_length": 4}), ("sparse_fixed", {"block_size": 4}),
               ("sparse_axial", {"row_length": 4}), ("sparse_logsparse", {}), ("linear", {"chunk_size": 4}),
               ("performer", {"num_features": 16, "chunk_size": 4}), ("local", {"block_size": 4}),
               ("longformer", {"window": 3, "global_positions": (0, 7, -3)}),
               ("bigbird", {"block_size": 1, "num_random_blocks": 1})]


# The op-level tests cover every plan; at model level the plans not below run with `-m slow`.
FAST_MODEL_CASES = ("dense", "combiner_fixed", "combiner_axial_rowmajor", "combiner_logsparse")


@pytest.mark.parametrize("name,params", [c if c[0] in FAST_MODEL_CASES else
                                         pytest.param(*c, marks=pytest.mark.slow) for c in MODEL_CASES],
                         ids=[n for n, _ in MODEL_CASES])
def test_model_decode_equals_forward(name, params, decoding_matches_forward):
  """Prefill 5 tokens, then decode the rest: every position's logits equal the forward pass's."""
  length = 20
  model = _model(name, params, deepsets=name == "combiner_fixed", position="factorized" if name == "dense"
                 else "learned")
  decoding_matches_forward(model, length)


@pytest.mark.slow
def test_model_decode_from_bos_without_prompt():
  from models.generate import Decoder

  model = _model("combiner_fixed", {"block_size": 4}, seq_len=9)
  tokens = jax.random.randint(jax.random.key(4), (1, 9), 0, 11)
  full = model({"inputs": tokens}, deterministic=True)
  dec = Decoder(model)
  cache = dec.init_cache(1, 9)
  for t in range(9):
    out, cache = dec.decode(cache, tokens[:, max(t - 1, 0)], t)
    np.testing.assert_allclose(out, full[:, t], rtol=1e-5, atol=1e-5)


def test_decode_needs_a_causal_model_and_a_decodable_op():
  with pytest.raises(ValueError, match="causal"):
    _model("dense", {}, task="mlm").init_cache(1, 8)
  with pytest.raises(ValueError, match="yoso"):
    _model("yoso", {}).init_cache(1, 8)


@pytest.mark.slow
def test_sampling_is_deterministic_and_respects_the_prompt():
  from models.generate import Decoder, filter_logits, generate

  model = Decoder(_model("combiner_fixed", {"block_size": 4}, seq_len=12))
  prompt = jnp.array([[1, 2, 3], [4, 5, 6]])
  a = generate(model, jax.random.key(0), num_samples=2, length=12, prompt=prompt, top_k=5, top_p=0.9)
  b = generate(model, jax.random.key(0), num_samples=2, length=12, prompt=prompt, top_k=5, top_p=0.9)
  c = generate(model, jax.random.key(1), num_samples=2, length=12, prompt=prompt, top_k=5, top_p=0.9)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[:, :3], prompt)
  assert a.shape == (2, 12) and not np.array_equal(a, c)
  # Greedy decoding picks the forward pass's argmax at every position.
  g = generate(model, jax.random.key(0), num_samples=2, length=12, prompt=prompt, temperature=0)
  full = nnx.merge(model.graphdef, model.state)({"inputs": g}, deterministic=True)
  np.testing.assert_array_equal(g[:, 3:], jnp.argmax(full, -1)[:, 3:])
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  assert np.isfinite(filter_logits(logits, top_k=2)).sum() == 2
  assert np.isfinite(filter_logits(logits, top_p=0.7)).sum() == 2  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
