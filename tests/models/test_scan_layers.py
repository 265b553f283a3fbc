"""model.scan_layers: the blocks as one lax.scan over their parameters stacked at call time compute what the
unrolled blocks do (loss, logits, gradients, sown losses, and the state the blocks update: random streams,
routing centroids, Performer features), with and without remat, one or two layers per loop iteration, and
with a segment memory; the model's program (forward and gradient) stops growing with depth; an attention
whose blocks differ by layer is a one-line config error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import metrics, stacked, transformer
from runtime import cli
from tests.models.test_transformer import LENGTH, VOCAB, batch_for, tiny_cfg


def _cfg(name: str, layers: int, scan: bool, **fields):
  cfg = tiny_cfg(name)
  cfg.num_layers, cfg.dropout_rate, cfg.scan_layers = layers, 0.1, scan
  cfg.update(fields)
  return cfg


def _step(name: str, scan: bool, **fields):
  """Loss, logits, gradients, sown values and the non-parameter state after one training forward."""
  model = transformer.build_model(_cfg(name, 3, scan, **fields), task="lm", vocab_size=VOCAB, seq_len=LENGTH)
  batch = batch_for("lm", np.random.default_rng(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    logits = m(batch, deterministic=False)  # dropout on: the blocks' random streams must advance alike
    sown = nnx.pop(m, nnx.Intermediate)
    return metrics.loss_and_sums("lm", logits, batch)[0], (logits, sown, nnx.state(m, nnx.Not(nnx.Param)))

  (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  return (loss, *aux, grads)


def _plain(tree):
  leaves = jax.tree.leaves(tree)
  return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
          for x in leaves]


def _assert_same(name: str, names: tuple[str, ...], unrolled: tuple, scanned: tuple) -> None:
  """The scanned model's results equal the unrolled one's, the blocks' entries of sown values, state and
  gradients converted from their stacked layout."""
  for what, a, b in zip(names, unrolled, scanned, strict=True):
    if what in ("sown", "state", "grads"):  # the blocks' entries stacked on a leading layer axis
      b = stacked.convert(b, like=a)
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for x, y in zip(_plain(a), _plain(b), strict=True):
      np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {what}")


def _same(name: str, **fields):
  unrolled, scanned = _step(name, False, **fields), _step(name, True, **fields)
  _assert_same(name, ("loss", "logits", "sown", "state", "grads"), unrolled, scanned)
  return unrolled


MEM = 4  # memory positions per layer


def _memory_cfg(name: str, scan: bool, **fields):
  cfg = _cfg(name, 3, scan, mem_len=MEM, **fields)
  if name == "compressive":  # a compressed FIFO too, its reconstruction loss sown
    cfg.compressed_mem_len = 4
    cfg.attention.update(compression="conv", compression_rate=2, reconstruction_loss=0.5)
  return cfg


def _memory_step(name: str, scan: bool, **fields):
  """Loss, logits, the memory left, sown values, state and gradients of the second of two segments, each
  reading the memory the one before left (the first an empty one)."""
  model = transformer.build_model(_memory_cfg(name, scan, **fields), task="lm", vocab_size=VOCAB,
                                  seq_len=LENGTH)
  batch = batch_for("lm", np.random.default_rng(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    _, memory = m({"inputs": batch["inputs"][:, ::-1]}, deterministic=False, memory=m.init_memory(2, MEM))
    logits, memory = m(batch, deterministic=False, memory=memory)
    sown = nnx.pop(m, nnx.Intermediate)
    loss = metrics.loss_and_sums("lm", logits, batch)[0]
    return loss, (logits, memory, sown, nnx.state(m, nnx.Not(nnx.Param)))

  (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  return (loss, *aux, grads)


@pytest.mark.slow  # ~20 s on 2 cores each
@pytest.mark.parametrize("name,fields", [
    ("transformer_xl", {}),
    ("compressive", {"remat": "full"}),  # the compression recomputed with the block
    ("adaptive_span", {"scan_unroll": 2}),  # a sown span penalty; one loop trip of two layers, then the third
    ("adaptive_span", {"remat": "full"}),  # as configs/adaptive_span.py:large runs it
])
def test_scanned_blocks_with_a_segment_memory(name, fields):
  """A memory's layers are stacked for the scan and split after it: the same logits, memory left (one entry
  per layer), sown losses, state and gradients as unrolled blocks."""
  unrolled, scanned = _memory_step(name, False, **fields), _memory_step(name, True, **fields)
  _assert_same(name, ("loss", "logits", "memory", "sown", "state", "grads"), unrolled, scanned)
  assert len(scanned[2]["layers"]) == 3 and np.isfinite(scanned[0])
  if name != "transformer_xl":
    assert jax.tree.leaves(scanned[3]), "the blocks' sown losses reach the train step"
  assert any(np.any(np.asarray(layer["valid"])) for layer in scanned[2]["layers"])


@pytest.mark.slow  # ~18 s on 2 cores: two jitted training forwards and gradients per attention
@pytest.mark.parametrize("name", [
    "dense",
    "routing",  # centroid updates written back; a sown loss
    "combiner_axial_vertical",
    "performer",  # redrawn random features
    "adaptive_span",  # a sown span penalty
])
def test_scanned_blocks_compute_what_unrolled_blocks_do(name):
  loss, _, sown, *_ = _same(name)
  assert np.isfinite(loss)
  if name in ("routing", "adaptive_span"):
    assert jax.tree.leaves(sown), "the blocks' sown losses reach the train step"


@pytest.mark.slow
def test_scanned_blocks_with_remat():
  _same("dense", remat="full")


@pytest.mark.slow
def test_scanned_blocks_two_per_iteration():
  """model.scan_unroll=2 over 3 layers: one loop trip of two layers and the third after it, recomputed in the
  backward pass; the same results as unrolled blocks."""
  _same("routing", remat="full", scan_unroll=2)


def _hlo_size(layers: int, scan: bool) -> int:
  model = transformer.build_model(_cfg("dense", layers, scan), task="lm", vocab_size=VOCAB, seq_len=LENGTH)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = batch_for("lm", np.random.default_rng(0))

  def loss(params):
    return nnx.merge(graphdef, params, rest, copy=True)(batch, deterministic=True).sum()

  return len(jax.jit(jax.grad(loss)).lower(params).as_text())


def test_the_scanned_program_does_not_grow_with_depth():
  assert _hlo_size(8, True) < 1.5 * _hlo_size(2, True)
  assert _hlo_size(8, False) > 2.5 * _hlo_size(2, False)


def test_blocks_that_differ_by_layer_are_a_config_error():
  """BigBird draws its random blocks per layer, so its blocks differ in structure and cannot be scanned."""
  with pytest.raises(ValueError, match="scan_layers=True needs blocks of one structure") as e:
    transformer.build_model(_cfg("bigbird", 2, True), task="mlm", vocab_size=VOCAB, seq_len=LENGTH)
  assert cli.user_error(e.value) is not None and "\n" not in str(e.value)
