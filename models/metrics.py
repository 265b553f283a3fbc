"""Losses and metrics per task, as sums so that batches, hosts and devices aggregate exactly.

`loss_and_sums(task, logits, batch)` returns the mean training loss of the batch and a dict of sums:
  nll_sum / weight_sum  (every task: summed cross-entropy in nats and the number of counted targets)
  correct_sum           (correctly predicted examples, or tokens at the weighted positions)
  word_sum              (lm batches that carry `words` [batch, length], the words credited to each token:
                        data.ordered's pg19 evaluation splits) the words of the counted targets
`summarize(task, sums)` turns accumulated sums into the reported metrics: `loss` (nats), plus
  bits_per_dim (image), perplexity (lm, mlm), accuracy (classify, retrieval; token accuracy for lm/mlm),
  word_perplexity = exp(nll_sum / word_sum) where a word_sum was accumulated (the NLL and the words are each
  summed over every batch first, so it is exact over a split, never a mean of per-batch perplexities).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from models import hibert

Array = Any


def _xent(logits: Array, labels: Array) -> Array:
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def loss_and_sums(task: str, logits: Array, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
  if task in hibert.TASKS:  # `logits`: the HIBERT model's output for its task
    return hibert.loss_and_sums(task, logits, batch)
  if task in ("lm", "image", "mlm"):
    targets = batch["targets"] if task == "mlm" else batch["inputs"]
    weights = batch.get("weights")
    if weights is None:
      weights = batch["mask"]
    weights = weights.astype(jnp.float32)  # [batch, length]
    nll = _xent(logits, targets) * weights  # [batch, length]
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32) * weights
    sums = {"nll_sum": nll.sum(), "weight_sum": weights.sum(), "correct_sum": correct.sum()}
    if task == "lm" and "words" in batch:
      sums["word_sum"] = (batch["words"].astype(jnp.float32) * weights).sum()
  elif task in ("classify", "retrieval"):
    valid = batch.get("valid")
    weights = (jnp.ones(logits.shape[0], jnp.float32) if valid is None
               else valid.astype(jnp.float32))  # [batch]
    labels = batch["label"]
    nll = _xent(logits, labels) * weights
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32) * weights
    sums = {"nll_sum": nll.sum(), "weight_sum": weights.sum(), "correct_sum": correct.sum()}
  else:
    raise ValueError(f"unknown task {task!r}")
  loss = sums["nll_sum"] / jnp.maximum(sums["weight_sum"], 1.0)
  return loss, sums


def summarize(task: str, sums: dict[str, float]) -> dict[str, float]:
  n = max(float(sums["weight_sum"]), 1.0)
  loss = float(sums["nll_sum"]) / n
  out = {"loss": loss}
  if task == "image":
    out["bits_per_dim"] = loss / math.log(2.0)
  elif task in ("lm", "mlm", "hibert_pretrain"):
    out["perplexity"] = math.exp(min(loss, 700.0))
  if float(sums.get("word_sum", 0.0)) > 0:
    out["word_perplexity"] = math.exp(min(float(sums["nll_sum"]) / float(sums["word_sum"]), 700.0))
  if "correct_sum" in sums:  # classification accuracy; token accuracy at the weighted positions for lm/mlm
    out["accuracy"] = float(sums["correct_sum"]) / n
  return out
