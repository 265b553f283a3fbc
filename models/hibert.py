"""HIBERT (Zhang, Wei and Zhou, ACL 2019): a document encoder stacked on a sentence encoder (Flax NNX).

A document is [batch, sentences, tokens] ids; every sentence ends with an EOS token (the data pipeline appends
it). The model, as the paper:
- sentence encoder: a bidirectional Transformer encoder (`models.transformer.Encoder`, any registered
  attention by `config.model.attention.name`) over each sentence's tokens; the sentence vector is its output
  at the EOS token (the last real token of the sentence);
- document encoder: a bidirectional Transformer over the sentence vectors plus sentence position embeddings
  (learned tables here; the paper uses sinusoids), attention `config.model.hibert.document_attention`;
- `hibert_pretrain`: masked-sentence prediction (`mask_sentences`): a small causal Transformer decoder reads
  [BOS] + the original sentence, conditioned on the document encoder's output at that sentence, and predicts
  the sentence's tokens (EOS included);
- `hibert_summarise`: extractive summarisation as sentence labelling, p(y_i | D) = softmax(W d_i), 2 classes.

Padding: `mask` [batch, sentences, tokens] (True = real token) and `sentence_mask` [batch, sentences]. Padding
tokens are masked keys in the sentence encoder; padding sentences are masked keys in the document encoder and
carry no loss, so their contents change no real output.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from models import layers, registry, transformer

Array = Any
TASKS = ("hibert_pretrain", "hibert_summarise")
# Defaults of `config.model.hibert` (HIBERT_S: every stack 6 layers, d 512, 8 heads).
# init_from: a pretraining workdir whose encoder a summarisation run starts from (training/hibert.py).
DEFAULTS = dict(document_layers=6, decoder_layers=6, document_attention="dense", decoder_attention="dense",
                mask_rate=0.15, init_from=None)


def hibert_fields(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """`cfg.hibert` with the DEFAULTS for what it leaves out."""
  own = cfg.get("hibert", None)
  own = own.to_dict() if isinstance(own, ml_collections.ConfigDict) else dict(own or {})
  unknown = set(own) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"config.model.hibert has unknown fields {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
  return {**DEFAULTS, **own}


def chosen_per_document(num_sentences: int, rate: float) -> int:
  """The most sentences `mask_sentences` chooses in a document of `num_sentences`: max(1, round(rate * n))."""
  return max(1, int(rate * num_sentences + 0.5))


def mask_sentences(key: Array, ids: Array, mask: Array, sentence_mask: Array, *, mask_id: int,
                   rate: float = 0.15) -> dict[str, Array]:
  """The masked-sentence corruption of a batch of documents.

  Per document, max(1, round(rate * n)) of its n real sentences are chosen uniformly (none when n = 0); each
  chosen sentence, independently: with probability 0.8 every token but its EOS becomes `mask_id`, with 0.1 it
  is kept, with 0.1 it is replaced (tokens and mask) by a sentence drawn uniformly from the batch's real
  sentences. Returns {"inputs", "mask": the corrupted document [batch, sentences, tokens], "chosen" [batch,
  sentences] bool, "action" [batch, sentences] int32 (0 mask, 1 keep, 2 random; -1 not chosen)}.
  """
  k_choose, k_action, k_pick = jax.random.split(key, 3)
  b, s, t = ids.shape
  real = sentence_mask.astype(bool)  # [batch, sentences]
  n = jnp.sum(real, axis=1)  # [batch]
  want = jnp.where(n > 0, jnp.maximum(1, jnp.floor(rate * n + 0.5).astype(jnp.int32)), 0)  # [batch]
  scores = jnp.where(real, jax.random.uniform(k_choose, (b, s)), 2.0)  # padding ranks last
  rank = jnp.argsort(jnp.argsort(scores, axis=1), axis=1)  # [batch, sentences]
  chosen = (rank < want[:, None]) & real
  u = jax.random.uniform(k_action, (b, s))
  action = jnp.where(u < 0.8, 0, jnp.where(u < 0.9, 1, 2))
  action = jnp.where(chosen, action, -1).astype(jnp.int32)  # [batch, sentences]
  # [MASK] everywhere but the EOS (the last real token), which the sentence vector is read from.
  length = jnp.sum(mask, axis=-1)  # [batch, sentences]
  is_eos = jnp.arange(t)[None, None, :] == (length - 1)[..., None]  # [batch, sentences, tokens]
  masked = jnp.where(mask & ~is_eos, mask_id, ids)
  # A random real sentence of the batch for each position (used where action == 2).
  flat_real = real.reshape(-1)  # [batch * sentences]
  pick = jax.random.categorical(k_pick, jnp.where(flat_real, 0.0, -jnp.inf), shape=(b, s))  # [batch, sent.]
  pick = jnp.where(jnp.any(flat_real), pick, 0)
  rand_ids, rand_mask = ids.reshape(b * s, t)[pick], mask.reshape(b * s, t)[pick]  # [batch, sent., tokens]
  a = action[..., None]
  inputs = jnp.where(a == 0, masked, jnp.where(a == 2, rand_ids, ids))
  new_mask = jnp.where(a == 2, rand_mask, mask)
  return {"inputs": inputs.astype(ids.dtype), "mask": new_mask.astype(bool), "chosen": chosen,
          "action": action}


class DecoderBlock(nnx.Module):
  """Pre-LN decoder block: x + SelfAttn(LN(x)) (causal); x + Cross(LN(x), c); x + MLP(LN(x)).

  The cross-attention reads one memory position, the document encoder's output c for the sentence: the
  softmax over a single key is 1, so its output is the value and output projections of LN(c) at every
  position (its query and key projections would have no effect and are left out)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, dtype: Any, rngs: nnx.Rngs, seq_len: int):
    f = cfg.features
    self.norm1 = layers.LayerNorm(f, dtype=dtype, rngs=rngs)
    self.attention = registry.build(cfg.attention, features=f, num_heads=cfg.num_heads,
                                    head_dim=cfg.get("head_dim", None) or f // cfg.num_heads, causal=True,
                                    dtype=dtype, rngs=rngs, seq_len=seq_len)
    self.norm_context = layers.LayerNorm(f, dtype=dtype, rngs=rngs)
    self.value = layers.DenseGeneral((f,), (f,), in_axes=("embed",), out_axes=("mlp",), dtype=dtype,
                                     rngs=rngs)
    self.out = layers.DenseGeneral((f,), (f,), in_axes=("mlp",), out_axes=("embed",), dtype=dtype,
                                   rngs=rngs)
    self.norm2 = layers.LayerNorm(f, dtype=dtype, rngs=rngs)
    self.mlp = transformer.Mlp(f, cfg.mlp_dim, dropout_rate=cfg.dropout_rate, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

  def __call__(self, x: Array, mask: Array, context: Array, *, deterministic: bool) -> Array:
    """x [n, tokens, features], mask [n, tokens], context [n, features] -> [n, tokens, features]."""
    h = self.attention(self.norm1(x), mask, deterministic=deterministic)  # [n, tokens, features]
    x = x + self.dropout(h, deterministic=deterministic)
    c = self.out(self.value(self.norm_context(context)))  # [n, features]
    x = x + self.dropout(c[:, None, :], deterministic=deterministic)
    h = self.mlp(self.norm2(x), deterministic=deterministic)
    return x + self.dropout(h, deterministic=deterministic)  # [n, tokens, features]


def _stack_config(cfg: ml_collections.ConfigDict, layers_: int, attention: str) -> ml_collections.ConfigDict:
  """`cfg` with `num_layers` and the attention name replaced (its plan parameters dropped when the name
  changes)."""
  out = ml_collections.ConfigDict(cfg.to_dict())
  out.num_layers = int(layers_)
  if attention != cfg.attention.name:
    out.attention = ml_collections.ConfigDict({"name": attention, "params": {}})
  return out


class Hibert(nnx.Module):
  """`__call__(batch, *, deterministic)`: for `hibert_pretrain` {"logits" [batch, K, tokens, vocab],
  "targets" [batch, K, tokens], "weights" [batch, K, tokens]} over the K chosen-sentence slots per document;
  for `hibert_summarise` float32 logits [batch, sentences, 2]."""

  # A summarisation run that starts fresh takes the encoder of its `init_from` pretraining run.
  WARM_START = "training.hibert:warm_start"

  def __init__(self, cfg: ml_collections.ConfigDict, *, task: str, vocab_size: int, sentence_len: int,
               max_sentences: int, mask_id: int, bos_id: int, input_vocab_size: int | None = None,
               rngs: nnx.Rngs):
    if task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    own = hibert_fields(cfg)
    self.task, self.mask_id, self.bos_id = task, int(mask_id), int(bos_id)
    self.rate = float(own["mask_rate"])
    self.max_sentences = int(max_sentences)
    dtype = transformer.dtype_of(cfg.get("dtype", "float32"))
    f = cfg.features
    vocab_in = input_vocab_size or vocab_size
    self.sentence = transformer.Encoder(cfg, vocab_size=vocab_in, seq_len=sentence_len, causal=False,
                                        dtype=dtype, rngs=rngs)
    doc_cfg = _stack_config(cfg, own["document_layers"], own["document_attention"])
    doc_cfg.position_embedding, doc_cfg.max_len = "learned", 0
    self.sentence_pos = transformer.PositionEmbedding(doc_cfg, max_sentences, dtype=dtype, rngs=rngs)
    self.document = nnx.List([transformer.Block(doc_cfg, causal=False, dtype=dtype, rngs=rngs, layer=i,
                                                seq_len=max_sentences) for i in range(doc_cfg.num_layers)])
    self.document_norm = layers.LayerNorm(f, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    if task == "hibert_pretrain":
      dec_cfg = _stack_config(cfg, own["decoder_layers"], own["decoder_attention"])
      dec_cfg.position_embedding = "learned"
      self.decoder_pos = transformer.PositionEmbedding(dec_cfg, sentence_len, dtype=dtype, rngs=rngs)
      self.decoder = nnx.List([DecoderBlock(dec_cfg, dtype=dtype, rngs=rngs, seq_len=sentence_len)
                               for _ in range(dec_cfg.num_layers)])
      self.decoder_norm = layers.LayerNorm(f, dtype=dtype, rngs=rngs)
      self.head = layers.DenseGeneral((f,), (vocab_size,), in_axes=("embed",), out_axes=("vocab",),
                                      dtype=dtype, rngs=rngs)
      self.masking = rngs.dropout.fork()  # reseeded by every train step (and to a fixed key for evaluation)
    else:
      self.head = layers.DenseGeneral((f,), (2,), in_axes=("embed",), out_axes=(None,), dtype=dtype,
                                      rngs=rngs)

  def encode(self, ids: Array, mask: Array, sentence_mask: Array, *, deterministic: bool) -> Array:
    """ids, mask [batch, sentences, tokens]; sentence_mask [batch, sentences] -> the document encoder's
    output d [batch, sentences, features]."""
    b, s, t = ids.shape
    if s > self.max_sentences:
      raise ValueError(f"{s} sentences exceed the model's max_sentences={self.max_sentences}")
    mask = mask.astype(bool)
    # A sentence with no real token (padding) reads its first position so that no attention row is empty;
    # the document encoder then masks it out.
    empty = ~jnp.any(mask, axis=-1)  # [batch, sentences]
    safe = mask.at[..., 0].set(mask[..., 0] | empty)
    h = self.sentence(ids.reshape(b * s, t), safe.reshape(b * s, t), deterministic=deterministic)
    h = h.reshape(b, s, t, -1)  # [batch, sentences, tokens, features]
    eos = jnp.maximum(jnp.sum(safe, axis=-1) - 1, 0)  # [batch, sentences]: the EOS is the last real token
    vectors = jnp.take_along_axis(h, eos[..., None, None], axis=2)[:, :, 0]  # [batch, sentences, features]
    x = vectors + self.sentence_pos(s)[None]
    x = self.dropout(x, deterministic=deterministic)
    smask = sentence_mask.astype(bool)
    smask = smask.at[:, 0].set(smask[:, 0] | ~jnp.any(smask, axis=1))  # an empty document: no empty rows
    for block in self.document:
      x = block(x, smask, deterministic=deterministic)
    return self.document_norm(x)  # [batch, sentences, features]

  def __call__(self, batch: dict[str, Array], *, deterministic: bool) -> Any:
    ids, mask, smask = batch["inputs"], batch["mask"], batch["sentence_mask"]
    if self.task == "hibert_summarise":
      d = self.encode(ids, mask, smask, deterministic=deterministic)
      return self.head(d).astype(jnp.float32)  # [batch, sentences, 2]
    corrupt = mask_sentences(self.masking(), ids, mask.astype(bool), smask, mask_id=self.mask_id,
                             rate=self.rate)
    d = self.encode(corrupt["inputs"], corrupt["mask"], smask, deterministic=deterministic)
    return self.predict_sentences(d, ids, mask, corrupt["chosen"], deterministic=deterministic)

  def predict_sentences(self, d: Array, ids: Array, mask: Array, chosen: Array, *, deterministic: bool
                        ) -> dict[str, Array]:
    """The decoder over the K = chosen_per_document(sentences) slots of each document's chosen sentences
    (slots beyond a document's choice have zero weight)."""
    b, s, t = ids.shape
    k = min(chosen_per_document(s, self.rate), s)
    order = jnp.argsort(~chosen, axis=1, stable=True)[:, :k]  # [batch, K]: the chosen sentences first
    slot_valid = jnp.take_along_axis(chosen, order, axis=1)  # [batch, K]
    targets = jnp.take_along_axis(ids, order[..., None], axis=1)  # [batch, K, tokens]
    tmask = jnp.take_along_axis(mask.astype(bool), order[..., None], axis=1) & slot_valid[..., None]
    context = jnp.take_along_axis(d, order[..., None], axis=1)  # [batch, K, features]
    bos = jnp.full((b, k, 1), self.bos_id, targets.dtype)
    shifted = jnp.concatenate([bos, targets[..., :-1]], axis=-1).reshape(b * k, t)  # [batch * K, tokens]
    smask = jnp.concatenate([jnp.ones((b, k, 1), bool), tmask[..., :-1]], axis=-1).reshape(b * k, t)
    x = self.sentence.embed(shifted) + self.decoder_pos(t)[None]  # [batch * K, tokens, features]
    x = self.dropout(x, deterministic=deterministic)
    c = context.reshape(b * k, -1)
    for block in self.decoder:
      x = block(x, smask, c, deterministic=deterministic)
    logits = self.head(self.decoder_norm(x)).astype(jnp.float32).reshape(b, k, t, -1)  # [batch, K, tokens, V]
    return {"logits": logits, "targets": targets, "weights": tmask.astype(jnp.float32)}


def from_info(cfg: ml_collections.ConfigDict, info: Any, *, seed: int = 0) -> Hibert:
  """The model for a cnn_dailymail `DatasetInfo` (seq_len = tokens per sentence, max_segments = sentences)."""
  rngs = nnx.Rngs(params=seed, dropout=seed + 1, attention=seed + 2)
  return Hibert(cfg, task=info.task, vocab_size=info.vocab_size, sentence_len=info.seq_len,
                max_sentences=info.max_segments, mask_id=info.mask_id, bos_id=info.bos_id,
                input_vocab_size=info.input_vocab_size, rngs=rngs)


# -----------------------------------------------------------------------------------------------------------
# Losses (as sums, like models.metrics)


def _xent(logits: Array, labels: Array) -> Array:
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def loss_and_sums(task: str, out: Any, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
  """hibert_pretrain: token cross-entropy over the chosen sentences; hibert_summarise: sentence-label
  cross-entropy over the real sentences. Sums: nll_sum, weight_sum, correct_sum (tokens or sentences)."""
  if task == "hibert_pretrain":
    logits, labels, weights = out["logits"], out["targets"], out["weights"]  # [batch, K, tokens, (vocab)]
  elif task == "hibert_summarise":
    logits, labels = out, batch["labels"]  # [batch, sentences, 2], [batch, sentences]
    weights = batch["sentence_mask"].astype(jnp.float32)  # [batch, sentences]
  else:
    raise ValueError(f"unknown task {task!r}")
  if "valid" in batch:  # rows padding the last evaluation batch count nothing
    weights = weights * batch["valid"].astype(jnp.float32).reshape((-1,) + (1,) * (weights.ndim - 1))
  nll = _xent(logits, labels) * weights
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32) * weights
  sums = {"nll_sum": nll.sum(), "weight_sum": weights.sum(), "correct_sum": correct.sum()}
  return sums["nll_sum"] / jnp.maximum(sums["weight_sum"], 1.0), sums
