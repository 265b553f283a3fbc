"""HIBERT through train.py's loop: the pretraining smoke run, then the summarisation smoke run starting from
its encoder (training/hibert_init.py), then ROUGE of its top-3 sentences (training/hibert_rouge.py)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from configs import hibert as hibert_config
from training import hibert_init, hibert_rouge, loop
from training.experiment import Experiment


@pytest.mark.slow  # > 3 s: two smoke runs through the training loop
def test_pretrain_then_summarise(tmp_path):
  pre = loop.train_and_evaluate(hibert_config.get_config("pretrain,smoke"), str(tmp_path / "pre"),
                                progress=False)
  assert pre["step"] == 4 and math.isfinite(pre["metrics"]["loss"]) and "perplexity" in pre["metrics"]
  config = hibert_config.get_config("summarise,smoke")
  config.model.hibert.init_from = str(tmp_path / "pre")
  exp = Experiment(config)
  start = hibert_init.pretrained(exp, exp.init_state())  # a fresh run: the pretrained encoder, a new head
  flat = lambda state: {p: np.asarray(jax.device_get(v[...])) for p, v in nnx.to_flat_state(state)}  # noqa: E731
  got, want = flat(start.params), flat(pre["state"].params)
  encoder = [p for p in got if p[0] in hibert_init.ENCODER]
  assert encoder and all(np.array_equal(got[p], want[p]) for p in encoder)
  assert ("head", "kernel") in got and got[("head", "kernel")].shape != want[("head", "kernel")].shape
  out = loop.train_and_evaluate(config, str(tmp_path / "sum"), progress=False)
  assert out["step"] == 4 and math.isfinite(out["metrics"]["loss"]) and "accuracy" in out["metrics"]
  rouge = hibert_rouge.summarise(out["experiment"], out["state"], max_documents=8)
  assert rouge["documents"] == 8
  for name in ("model", "oracle", "lead"):
    assert all(0.0 <= rouge[f"{name}_{k}"] <= 100.0 for k in hibert_rouge.ROUGE_TYPES)
  assert rouge["oracle_rouge2"] > rouge["lead_rouge2"]  # the stand-in's highlights restate inner sentences
