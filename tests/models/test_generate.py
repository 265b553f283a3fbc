"""Cached decoding of whole models equals their forward pass (logits), and sampling from the decoder (op by
op: tests/attention_core/test_decode.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_core import registry as ops_registry


def test_op_without_decoder_names_it():
  from models.attention import check_decodable

  with pytest.raises(ValueError, match="yoso"):
    check_decodable(ops_registry.get("yoso"))


def _model(attention: str, params: dict, *, task: str = "lm", seq_len: int = 20, position: str = "learned",
           deepsets: bool = False, scan: bool = False):
  import ml_collections

  from models import transformer

  cfg = ml_collections.ConfigDict({
      "num_layers": 2, "features": 16, "num_heads": 2, "mlp_dim": 32, "dropout_rate": 0.0, "dtype": "float32",
      "position_embedding": position, "image_shape": (2, 2, 5),
      "attention": {"name": attention, "params": params, "dropout_rate": 0.0}, "scan_layers": scan})
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
               ("bigbird", {"block_size": 1, "num_random_blocks": 1}),
               ("moba", {"block_size": 4, "top_k": 2}),
               ("nsa", {"compress_block": 4, "compress_stride": 2, "select_block": 4, "num_selected": 3,
                        "window": 3})]


# The op-level tests (tests/attention_core/test_decode.py) cover every plan; at model level only the one
# below runs
# fast, the others (each a whole model compiled twice) run with `-m slow`.
FAST_MODEL_CASES = ("combiner_axial_rowmajor",)


@pytest.mark.parametrize("name,params", [c if c[0] in FAST_MODEL_CASES else
                                         pytest.param(*c, marks=pytest.mark.slow) for c in MODEL_CASES],
                         ids=[n for n, _ in MODEL_CASES])
def test_model_decode_equals_forward(name, params, decoding_matches_forward):
  """Prefill 5 tokens, then decode the rest: every position's logits equal the forward pass's."""
  length = 20
  model = _model(name, params, deepsets=name == "combiner_fixed", position="factorized" if name == "dense"
                 else "learned")
  decoding_matches_forward(model, length)


@pytest.mark.parametrize("name,params", [
    ("combiner_axial_rowmajor", {"row_length": 4}),
    pytest.param("combiner_fixed", {"block_size": 4}, marks=pytest.mark.slow)])
def test_stacked_blocks_decode_as_the_forward_pass(name, params, decoding_matches_forward):
  """Blocks stacked on a layer axis (model.scan_layers) decode by one scan over the layers and their stacked
  caches; the logits are the forward pass's, which are the per-layer model's."""
  model = _model(name, params, scan=True)
  assert model.encoder.scanned
  decoding_matches_forward(model, 20)
  tokens = jax.random.randint(jax.random.key(5), (2, 20), 0, 11)
  per_layer = _model(name, params)
  np.testing.assert_allclose(model({"inputs": tokens}, deterministic=True),
                             per_layer({"inputs": tokens}, deterministic=True), rtol=1e-5, atol=1e-5)


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
