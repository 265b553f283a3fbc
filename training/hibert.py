"""HIBERT's training-side behaviour (models/hibert.py, data/cnn_dailymail.py), which the model declares and
the shared training code reaches only through that declaration.

Warm start (the paper's recipe; `Hibert.WARM_START`): `config.model.hibert.init_from` names a
`configs/hibert.py:pretrain` workdir; a summarisation run that starts fresh takes the hierarchical encoder's
parameters (sentence encoder with its embeddings, sentence positions, document encoder) from that workdir's
newest checkpoint that restores; the classifier starts fresh and the pretraining decoder is dropped. A run
that resumes from its own checkpoint (past step 0) reads nothing from there; the optimizer's initial state
does not depend on the parameters' values.

ROUGE of the extractive summaries (the paper's evaluation; `python -m scripts.hibert_rouge`): for each
document of a split, in order, the model's p(y_i = 1 | D) ranks the kept sentences; the top `top` (T = 3 for
CNN/DailyMail, as the paper) are the summary, read in document order. Summary and highlights are scored with
the `rouge-score` package (Porter stemming): ROUGE-1 and ROUGE-2 F1, and ROUGE-L F1 at summary level over
newline-separated sentences (`rougeLsum`, what the ROUGE-1.5.5 script reports as ROUGE-L), each averaged over
the documents, in percent. One process (the state is read whole). The same for the oracle labels (`oracle`:
the data's greedy labels as the summary), the bound the model is trained towards, and `lead` (the first `top`
sentences), the usual baseline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from data import cnn_dailymail
from runtime import cli

# -----------------------------------------------------------------------------------------------------------
# Warm start

# The top-level modules of models.hibert.Hibert that both tasks share.
ENCODER = ("sentence", "sentence_pos", "document", "document_norm")


def init_from(exp: Any) -> str | None:
  own = exp.model_cfg.get("hibert", None)
  return (own.get("init_from", None) if own is not None else None) or None


def transfer(params: Any, source: Any) -> Any:
  """`params` (an nnx.State of nnx.Param) with every ENCODER entry replaced by `source`'s; a missing entry or
  another shape is an error (the two runs' encoders must have the same sizes)."""
  src = {path: var for path, var in nnx.to_flat_state(source)}
  out = []
  for path, var in nnx.to_flat_state(params):
    if path[0] in ENCODER:
      other = src.get(path)
      if other is None or other[...].shape != var[...].shape:
        got = "missing" if other is None else f"shape {other[...].shape}"
        raise ValueError(f"init_from: parameter {'/'.join(map(str, path))} is {got} in the pretraining run, "
                         f"{var[...].shape} here; the encoders must have the same sizes")
      var = var.replace(other[...])
    out.append((path, var))
  return nnx.from_flat_state(out)


def warm_start(exp: Any, state: Any) -> Any:
  """The train state `state` of a fresh run (step 0) with the encoder of the `init_from` pretraining run
  (unchanged without one, or past step 0)."""
  path = init_from(exp)
  if path is None or state.step != 0:
    return state
  if exp.task != "hibert_summarise":
    raise cli.mark_usage(ValueError(f"config.model.hibert.init_from is for task 'hibert_summarise', "
                                    f"not {exp.task!r}"))
  from training import evaluate

  pre_exp, pre_state, mgr = evaluate.restore_workdir(path)
  mgr.close()
  if pre_exp.task != "hibert_pretrain":
    raise cli.mark_usage(ValueError(f"config.model.hibert.init_from={path!r} is a {pre_exp.task!r} run, "
                                    "not hibert_pretrain"))
  print(f"HIBERT encoder from {path} at step {pre_state.step}", flush=True)
  params = jax.device_put(transfer(state.params, jax.device_get(pre_state.params)), exp.param_shardings)
  return dataclasses.replace(state, params=params)


# -----------------------------------------------------------------------------------------------------------
# ROUGE

ROUGE_TYPES = ("rouge1", "rouge2", "rougeLsum")


def select(scores: np.ndarray, sentence_mask: np.ndarray, top: int) -> list[list[int]]:
  """The indices of the `top` highest-scoring real sentences of each document, in document order.
  scores, sentence_mask: [documents, sentences]."""
  out = []
  for row, real in zip(scores, sentence_mask, strict=True):
    ranked = [int(i) for i in np.argsort(-row, kind="stable") if real[i]]
    out.append(sorted(ranked[:top]))
  return out


def rouge(summaries: list[list[str]], references: list[str]) -> dict[str, float]:
  """Mean F1 (percent) of each ROUGE type; a summary is its sentences, a reference its highlights text."""
  from rouge_score import rouge_scorer

  scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True, split_summaries=False)
  totals = dict.fromkeys(ROUGE_TYPES, 0.0)
  for sentences, reference in zip(summaries, references, strict=True):
    ref = "\n".join(s.strip() for s in reference.splitlines() if s.strip())
    scores = scorer.score(ref, "\n".join(sentences))
    for k in ROUGE_TYPES:
      totals[k] += scores[k].fmeasure
  n = max(len(summaries), 1)
  return {k: 100.0 * v / n for k, v in totals.items()}


def _source(config: Any, split: str) -> Any:
  """The split's records; the generated stand-in when the data is missing and `config.data.stand_in`."""
  import data

  try:
    return config, cnn_dailymail.source(config, split)
  except FileNotFoundError as e:
    if not data._wants_stand_in(config):
      raise
    with data._stand_in(config, e) as stand_in:
      return stand_in, cnn_dailymail.source(stand_in, split)


def summarise(exp: Any, state: Any, split: str | None = None, *, top: int = 3, max_documents: int = -1,
              batch_size: int | None = None) -> dict[str, Any]:
  """ROUGE of the model's top-`top` summaries of `split` (default config.eval_split), and of the oracle and
  lead-`top` summaries, over its first `max_documents` documents (-1 = all)."""
  if exp.task != "hibert_summarise":
    raise cli.mark_usage(ValueError(f"ROUGE needs a hibert_summarise model, got task {exp.task!r}"))
  split = split or exp.config.eval_split
  config, records = _source(exp.config, split)
  docs = cnn_dailymail.Documents(config)
  n = len(records) if max_documents < 0 else min(max_documents, len(records))
  batch_size = batch_size or int(exp.config.train.eval_batch_size)
  model = exp.model(state, jax.random.key(int(exp.config.eval_seed)))
  forward = nnx.jit(lambda m, batch: m(batch, deterministic=True))
  chosen, oracle, lead, references = [], [], [], []
  for start in range(0, n, batch_size):
    records_ = [records[i] for i in range(start, min(start + batch_size, n))]
    examples = [docs.example(r) for r in records_]
    examples += [examples[-1]] * (batch_size - len(examples))  # a full last batch (one compiled shape)
    batch = {k: np.stack([e[k] for e in examples]) for k in ("inputs", "mask", "sentence_mask", "labels")}
    logits = np.asarray(jax.device_get(forward(model, batch)))  # [batch, sentences, 2]
    scores = logits[..., 1] - logits[..., 0]  # log p(y = 1) - log p(y = 0): the same order as p(y = 1)
    picks = select(scores, batch["sentence_mask"], top)
    for j, record in enumerate(records_):
      sentences, highlights = docs.sentences(record)
      chosen.append([sentences[i] for i in picks[j]])
      oracle.append([s for s, y in zip(sentences, batch["labels"][j], strict=False) if y])
      lead.append(sentences[:top])
      references.append(highlights)
  out: dict[str, Any] = {"split": split, "documents": n, "top": top, "step": int(state.step)}
  for name, summaries in (("model", chosen), ("oracle", oracle), ("lead", lead)):
    out.update({f"{name}_{k}": v for k, v in rouge(summaries, references).items()})
  return out
