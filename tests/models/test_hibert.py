"""HIBERT (models/hibert.py): the masked-sentence corruption, the hierarchy against a per-sentence
from-definition computation, padding inertness, the decoder's causality and the losses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import hibert as hibert_config
from models import hibert

MASK_ID, BOS_ID, EOS_ID, VOCAB = 4, 2, 3, 40


def documents(rng: np.random.Generator, b: int, s: int, t: int, *, pad_value: int = 0):
  """Random documents: per document 1..s real sentences, per sentence 2..t real tokens ending in EOS."""
  ids = np.full((b, s, t), pad_value, np.int32)
  mask = np.zeros((b, s, t), bool)
  for i in range(b):
    for j in range(int(rng.integers(1, s + 1))):
      n = int(rng.integers(2, t + 1))
      ids[i, j, :n] = np.append(rng.integers(5, VOCAB, n - 1), EOS_ID)
      mask[i, j, :n] = True
  return ids, mask, mask.any(-1)


def model_config(dtype: str = "float32"):
  c = hibert_config.get_config("smoke").model
  c.dtype = dtype
  return c


MASK = jax.jit(functools.partial(hibert.mask_sentences, mask_id=MASK_ID, rate=0.15))


@nnx.jit(static_argnames="deterministic")
def call(model, batch, deterministic=True):
  return model(batch, deterministic=deterministic)


def build(task: str, *, s: int = 6, t: int = 8, dtype: str = "float32", seed: int = 0) -> hibert.Hibert:
  return hibert.Hibert(model_config(dtype), task=task, vocab_size=VOCAB, sentence_len=t, max_sentences=s,
                       mask_id=MASK_ID, bos_id=BOS_ID, rngs=nnx.Rngs(params=seed, dropout=seed + 1,
                                                                      attention=seed + 2))


def test_masking_proportions_and_choices():
  rng = np.random.default_rng(0)
  ids, mask, smask = documents(rng, 64, 20, 8)
  smask[:, :] = True  # every sentence real (give the padded ones content)
  empty = ~mask.any(-1)
  ids[empty, 0], mask[empty, 0] = EOS_ID, True
  smask[3] = False  # one empty document: nothing chosen
  mask[3] = False
  out = jax.tree.map(np.asarray, MASK(jax.random.key(7), jnp.asarray(ids), jnp.asarray(mask),
                                      jnp.asarray(smask)))
  chosen, action = out["chosen"], out["action"]
  counts = chosen.sum(1)
  assert counts[3] == 0 and np.all(np.delete(counts, 3) == 3)  # round(0.15 * 20) per document
  share = np.array([(action == a).sum() for a in range(3)]) / chosen.sum()
  np.testing.assert_allclose(share, [0.8, 0.1, 0.1], atol=0.07)
  np.testing.assert_array_equal(action >= 0, chosen)
  real_rows = {(tuple(ids[i, j][mask[i, j]])) for i in range(64) for j in range(20) if smask[i, j]}
  for i, j in zip(*np.nonzero(smask), strict=True):
    got, got_mask, length = out["inputs"][i, j], out["mask"][i, j], mask[i, j].sum()
    if action[i, j] == 0:  # every token but the EOS replaced by [MASK]
      np.testing.assert_array_equal(got_mask, mask[i, j])
      assert np.all(got[:length - 1] == MASK_ID) and got[length - 1] == ids[i, j, length - 1]
    elif action[i, j] == 2:  # a real sentence of the batch
      assert tuple(got[got_mask]) in real_rows
    else:  # kept, or not chosen
      np.testing.assert_array_equal(got, ids[i, j])
      np.testing.assert_array_equal(got_mask, mask[i, j])
  again = MASK(jax.random.key(7), jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(smask))
  np.testing.assert_array_equal(np.asarray(again["inputs"]), out["inputs"])
  other = MASK(jax.random.key(8), jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(smask))
  assert not np.array_equal(np.asarray(other["chosen"]), chosen)


def test_padding_sentences_never_chosen():
  rng = np.random.default_rng(1)
  ids, mask, smask = documents(rng, 64, 20, 8)
  out = MASK(jax.random.key(0), jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(smask))
  chosen = np.asarray(out["chosen"])
  assert not np.any(chosen & ~smask)
  want = np.maximum(1, np.floor(0.15 * smask.sum(1) + 0.5))
  np.testing.assert_array_equal(chosen.sum(1), want)


@pytest.mark.slow  # > 3 s: one float64 trace of the model and of every sentence alone
def test_encoder_matches_per_sentence_definition():
  """d = DocumentEncoder(SentenceEncoder(sentence_i)[EOS] + p_i) over the real sentences alone, float64."""
  with jax.enable_x64(True):
    model = build("hibert_summarise", dtype="float64")
    rng = np.random.default_rng(2)
    ids, mask, smask = documents(rng, 2, 6, 8, pad_value=9)
    ids[0, 3:], mask[0, 3:], smask[0, 3:] = 9, False, False  # one document of 3 sentences, one of 1
    ids[1, 1:], mask[1, 1:], smask[1, 1:] = 9, False, False

    @nnx.jit
    def both(model):
      got = model.encode(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(smask), deterministic=True)
      wants = []
      for i in range(2):  # each real sentence alone, at its own length (shapes are static in the trace)
        vectors = []
        for j in np.nonzero(smask[i])[0]:
          n = int(mask[i, j].sum())
          h = model.sentence(jnp.asarray(ids[i, j, :n])[None], None, deterministic=True)  # [1, n, features]
          vectors.append(h[0, n - 1])
        x = jnp.stack(vectors)[None] + model.sentence_pos(len(vectors))[None]  # [1, real, features]
        for block in model.document:
          x = block(x, None, deterministic=True)
        wants.append(model.document_norm(x)[0])
      return got, wants

    got, wants = both(model)
    for i, want in enumerate(wants):
      np.testing.assert_allclose(np.asarray(got)[i, :want.shape[0]], np.asarray(want), rtol=1e-9, atol=1e-9)


@pytest.mark.slow  # > 3 s: builds and compiles both task models
def test_shapes_and_padding_inert():
  rng = np.random.default_rng(3)
  ids, mask, smask = documents(rng, 4, 6, 8)
  batch = {"inputs": jnp.asarray(ids), "mask": jnp.asarray(mask), "sentence_mask": jnp.asarray(smask)}
  noisy = np.where(mask, ids, rng.integers(5, VOCAB, ids.shape)).astype(np.int32)  # garbage in padding
  noisy_batch = {**batch, "inputs": jnp.asarray(noisy)}
  model = build("hibert_summarise")
  logits = np.asarray(call(model, batch))
  assert logits.shape == (4, 6, 2)
  np.testing.assert_allclose(np.asarray(call(model, noisy_batch))[smask], logits[smask], atol=1e-5)
  pre = build("hibert_pretrain")
  k = hibert.chosen_per_document(6, 0.15)
  outs = []
  for b in (batch, noisy_batch):
    nnx.reseed(pre, dropout=jax.random.key(5))
    outs.append(jax.tree.map(np.asarray, call(pre, b)))
  assert outs[0]["logits"].shape == (4, k, 8, VOCAB) and outs[0]["weights"].shape == (4, k, 8)
  w = outs[0]["weights"] > 0
  np.testing.assert_array_equal(outs[1]["weights"] > 0, w)
  np.testing.assert_allclose(outs[1]["logits"][w], outs[0]["logits"][w], atol=1e-5)
  assert w.sum(-1).max() > 0 and np.all(w.sum((1, 2)) > 0)  # every document predicts one sentence
  # The corruption follows the "dropout" stream: the same key (a step's, or evaluation's) gives the same.
  nnx.reseed(pre, dropout=jax.random.key(6))
  first = np.asarray(call(pre, batch)["targets"])
  nnx.reseed(pre, dropout=jax.random.key(6))
  np.testing.assert_array_equal(np.asarray(call(pre, batch)["targets"]), first)
  assert not np.array_equal(np.asarray(call(pre, batch)["targets"]), first)  # the stream moved on


def test_decoder_is_causal_and_reads_the_context():
  model = build("hibert_pretrain")
  rng = np.random.default_rng(4)
  ids, mask, smask = documents(rng, 2, 6, 8)
  ids[:, 0, :], mask[:, 0, :], smask[:, 0] = rng.integers(5, VOCAB, (2, 8)), True, True
  chosen = np.zeros((2, 6), bool)
  chosen[:, 0] = True
  d = jnp.asarray(rng.normal(size=(2, 6, 32)).astype(np.float32))

  @nnx.jit
  def predict(model, ids_, d_):
    return model.predict_sentences(d_, ids_, jnp.asarray(mask), jnp.asarray(chosen), deterministic=True)

  def logits(ids_, d_):
    return np.asarray(predict(model, jnp.asarray(ids_), d_)["logits"])[:, 0]  # [batch, tokens, vocab]

  base = logits(ids, d)
  for j in range(8):  # the token at j is read at positions > j only
    changed = ids.copy()
    changed[:, 0, j] = (ids[:, 0, j] - 5 + 1) % (VOCAB - 5) + 5
    diff = np.abs(logits(changed, d) - base).max(-1)  # [batch, tokens]
    assert np.all(diff[:, :j + 1] == 0) and (j == 7 or np.all(diff[:, j + 1] > 0))
  other_d = d.at[:, 0].set(jnp.asarray(rng.normal(size=(2, 32)).astype(np.float32)))
  assert np.abs(logits(ids, other_d) - base).max() > 1e-4


def test_losses_against_numpy():
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(2, 3, 4, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 3, 4))
  weights = (rng.random((2, 3, 4)) < 0.5).astype(np.float32)
  loss, sums = hibert.loss_and_sums("hibert_pretrain", {"logits": jnp.asarray(logits),
                                                        "targets": jnp.asarray(targets),
                                                        "weights": jnp.asarray(weights)}, {})
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), (nll * weights).sum() / weights.sum(), rtol=1e-5)
  assert float(sums["weight_sum"]) == weights.sum()
  two = rng.normal(size=(2, 5, 2)).astype(np.float32)
  labels = rng.integers(0, 2, (2, 5))
  smask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  loss, sums = hibert.loss_and_sums("hibert_summarise", jnp.asarray(two),
                                    {"labels": jnp.asarray(labels), "sentence_mask": jnp.asarray(smask),
                                     "valid": jnp.asarray([True, False])})
  logp = two - np.log(np.exp(two).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), nll[0, :3].mean(), rtol=1e-5)
  assert float(sums["correct_sum"]) == (two[0, :3].argmax(-1) == labels[0, :3]).sum()


def test_unknown_hibert_field_refused():
  c = model_config()
  c.hibert.layers = 3
  with pytest.raises(ValueError, match="unknown fields"):
    hibert.hibert_fields(c)
