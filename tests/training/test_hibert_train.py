"""HIBERT through train.py's loop: the pretraining smoke run, then the summarisation smoke run starting from
its encoder (training/hibert.py), then ROUGE of its top-3 sentences (training/hibert.py); and the
encoder transfer itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flax import nnx

from configs import hibert as hibert_config
from training import hibert, loop


def smoke(arg: str):
  c = hibert_config.get_config(f"{arg},smoke")
  c.train.num_steps, c.train.checkpoint_every, c.train.eval_batches = 2, 2, 1
  return c


@pytest.mark.slow  # > 3 s: two smoke runs through the training loop
def test_pretrain_then_summarise(tmp_path, capsys):
  pre = loop.train_and_evaluate(smoke("pretrain"), str(tmp_path / "pre"), progress=False)
  assert pre["step"] == 2 and math.isfinite(pre["metrics"]["loss"]) and "perplexity" in pre["metrics"]
  config = smoke("summarise")
  config.model.hibert.init_from = str(tmp_path / "pre")
  out = loop.train_and_evaluate(config, str(tmp_path / "sum"), progress=False)
  assert f"HIBERT encoder from {tmp_path / 'pre'} at step 2" in capsys.readouterr().out
  assert out["step"] == 2 and math.isfinite(out["metrics"]["loss"]) and "accuracy" in out["metrics"]
  rouge = hibert.summarise(out["experiment"], out["state"], max_documents=8)
  assert rouge["documents"] == 8
  for name in ("model", "oracle", "lead"):
    assert all(0.0 <= rouge[f"{name}_{k}"] <= 100.0 for k in hibert.ROUGE_TYPES)
  assert rouge["oracle_rouge2"] > rouge["lead_rouge2"]  # the stand-in's highlights restate inner sentences
  # The script restores the run's newest checkpoint and writes the same figures next to it.
  from scripts import hibert_rouge

  script = hibert_rouge.main(["--workdir", str(tmp_path / "sum"), "--max_documents", "8"])
  assert script["step"] == 2 and script["model_rouge2"] == rouge["model_rouge2"]
  assert (tmp_path / "sum" / f"rouge_{script['split']}_2.json").exists()


def test_transfer_takes_the_encoder_only():
  def state(seed: int, head: int, features: int = 4, decoder: bool = False) -> nnx.State:
    rng = np.random.default_rng(seed)
    p = lambda *shape: nnx.Param(rng.normal(size=shape).astype(np.float32))  # noqa: E731
    tree = {"sentence": {"embed": {"embedding": p(10, features)}}, "sentence_pos": {"table": p(6, features)},
            "document": {0: {"mlp": {"kernel": p(features, 8)}}}, "document_norm": {"scale": p(features)},
            "head": {"kernel": p(features, head)}}
    if decoder:
      tree["decoder_pos"] = {"table": p(8, features)}
    return nnx.State(tree)

  pre, fine = state(0, head=10, decoder=True), state(1, head=2)
  flat = lambda s: {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(s)}  # noqa: E731
  got, before, want = flat(hibert.transfer(fine, pre)), flat(fine), flat(pre)
  assert set(got) == set(before)  # the pretraining decoder is dropped
  for path, value in got.items():  # the encoder from the pretraining run, the head as it was
    np.testing.assert_array_equal(value, want[path] if path[0] in hibert.ENCODER else before[path])
  with pytest.raises(ValueError, match="the encoders must have the same sizes"):
    hibert.transfer(fine, state(0, head=10, features=3))
