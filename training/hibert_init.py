"""HIBERT fine-tuning from its pretraining (the paper's recipe): `config.model.hibert.init_from` names a
`configs/hibert.py:pretrain` workdir; a summarisation run that starts fresh takes the hierarchical encoder's
parameters (sentence encoder with its embeddings, sentence positions, document encoder) from that workdir's
newest checkpoint that restores; the classifier starts fresh and the pretraining decoder is dropped. A run
that resumes from its own checkpoint (past step 0) reads nothing from there. The loop applies it to the state
it starts from (training/loop.py); the optimizer's initial state does not depend on the parameters' values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

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


def pretrained(exp: Any, state: Any) -> Any:
  """The train state `state` of a fresh run (step 0) with the encoder of the `init_from` pretraining run
  (unchanged without one, or past step 0)."""
  path = init_from(exp)
  if path is None or state.step != 0:
    return state
  if exp.task != "hibert_summarise":
    raise ValueError(f"config.model.hibert.init_from is for task 'hibert_summarise', not {exp.task!r}")
  from training import evaluate

  pre_exp, pre_state, mgr = evaluate.restore_workdir(path)
  mgr.close()
  if pre_exp.task != "hibert_pretrain":
    raise ValueError(f"config.model.hibert.init_from={path!r} is a {pre_exp.task!r} run, not hibert_pretrain")
  print(f"HIBERT encoder from {path} at step {pre_state.step}", flush=True)
  params = jax.device_put(transfer(state.params, jax.device_get(pre_state.params)), exp.param_shardings)
  return dataclasses.replace(state, params=params)
