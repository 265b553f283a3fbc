"""scripts/check_kernels.py, profile_ops.py and tune_kernels.py on CPU, and the kernels' per-backend tiles.

The scripts are meant for a GPU or TPU host; here they run in interpret mode (or on a hand-written trace) so
that their logic is checked where CI runs: the checker passes on agreeing paths and fails on a planted
disagreement, the profiler sums only device events, the tuner restores nothing it should not; a bad flag of
any of them is one `ERROR:` line and exit 2.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import subprocess
import sys

import pytest

from combiner import frames, kernel_plans
from scripts import check_kernels, profile_ops, tune_kernels
from tests.training.test_usage_errors import ROOT, assert_one_line


@pytest.mark.slow
def test_check_kernels_passes_when_formulations_agree(capsys):
  assert check_kernels.main(["--length", "40", "--head_dim", "8", "--only", "yoso,yoso_sketch"]) == 0
  out = capsys.readouterr().out
  assert "yoso onehot vs sorted" in out and "yoso_sketch pallas vs sorted" in out and "all passed" in out


@pytest.mark.slow
def test_check_kernels_fails_on_a_planted_disagreement(monkeypatch, capsys):
  """An op whose fused formulation drifts by 5% (registered in place of YOSO's) fails the check."""
  from attention_core import registry

  spec = registry.get("yoso")

  @functools.wraps(spec.fn)  # keeps the op's module, so its declared formulations are found
  def off_by_a_little(*args, formulation, **kw):
    out = spec.fn(*args, formulation=formulation, **kw)
    return out * 1.05 if formulation == "pallas" else out

  monkeypatch.setitem(registry.OPS, "yoso", dataclasses.replace(spec, fn=off_by_a_little))
  assert check_kernels.main(["--length", "40", "--head_dim", "8", "--only", "yoso"]) == 1
  out = capsys.readouterr().out
  assert "FAIL yoso pallas vs sorted" in out and "ok   yoso onehot vs sorted" in out


def test_check_kernels_rejects_unknown_names(capsys):
  with pytest.raises(SystemExit):
    check_kernels.main(["--only", "combiner,nonsense"])
  assert "nonsense" in capsys.readouterr().err


BAD = [
    (["scripts.check_kernels", "--only", "combiner,nonsense"], "--only: 'nonsense' names no op with a fused"),
    (["scripts.check_kernels", "--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
    (["scripts.profile_ops"], "the following arguments are required: --ops"),
    (["scripts.profile_ops", "--ops", "dense", "--causal", "maybe"], "--causal: invalid choice: 'maybe'"),
    (["scripts.tune_kernels", "--length", "x"], "--length: invalid int value: 'x'"),
]


@pytest.mark.parametrize("argv,name", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags_are_one_line_and_exit_2(argv, name):
  env = {k: v for k, v in os.environ.items() if k != "LSA_DEBUG"}
  proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=120)
  assert_one_line(proc, name)


def test_check_kernels_covers_every_fused_op_in_both_directions():
  """The cases come from the registrations: every op with a fused path, each direction it runs fused, with
  max and mean pooling, DeepSets pools and value_dim != head_dim among them; a value that runs only on
  other platforms is left out."""
  from attention_core import registry

  fused = registry.fused_ops()
  names = check_kernels.select(None)
  assert set(names) == set(fused) >= {"combiner_fixed", "combiner_logsparse", "combiner_axial_rowmajor",
                                      "combiner_axial_vertical", "combiner_axial_horizontal",
                                      "combiner_mixture", "combiner_mixture_joint", "sparse_fixed",
                                      "sparse_axial", "sparse_logsparse", "dense", "yoso"}
  assert check_kernels.select("sparse") == ["sparse_axial", "sparse_fixed", "sparse_logsparse"]
  cases = check_kernels.cases(names, "gpu")
  for name in names:
    spec, path = registry.get(name), fused[name]
    mine = [c for c in cases if c.name == name]
    directions = {c.causal for c in mine}
    assert directions == ({True} if spec.causal and path.causal else set()) | (
        {False} if spec.bidirectional else set()) or not path.values_on("gpu"), name
  combiner = [c for c in cases if c.name.startswith("combiner_")]
  assert {c.pooling for c in combiner} == {"max", "mean"} and any(c.deepsets for c in combiner)
  assert any(c.half_value_dim for c in combiner) and all(c.value == "pallas" for c in combiner)
  assert all(not c.half_value_dim for c in cases if c.value == "flash")


def test_profile_sums_device_events_only(tmp_path):
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "X", "pid": 1, "name": "PjitFunction(step)", "dur": 900.0},
      {"ph": "X", "pid": 2, "name": "combiner_flash_fwd", "dur": 10.0},
      {"ph": "X", "pid": 2, "name": "combiner_flash_fwd", "dur": 12.0},
      {"ph": "X", "pid": 2, "name": "loop_transpose_fusion", "dur": 3.5},
      {"ph": "i", "pid": 2, "name": "marker"},
  ]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  totals, count = profile_ops.device_kernel_times(str(path))
  assert dict(totals) == {"combiner_flash_fwd": 22.0, "loop_transpose_fusion": 3.5}
  assert count == 3


def test_frames_follow_the_platform():
  """Rows of a frame: whole tiles of the platform's cap (TPU-shaped in interpret mode), at least 16
  positions on TPU (bfloat16 sublane packing); GPUs get heads-packed frames and per-group partial sums."""
  assert kernel_plans.frame_cols(1000, "cpu") == kernel_plans.frame_cols(1000, "tpu") == 1024
  assert kernel_plans.frame_cols(1000, "gpu") == 1024 and kernel_plans.frame_cols(200, "tpu") == 256
  assert kernel_plans.frame_cols(600, "gpu") == 1024 and kernel_plans.frame_cols(600, "tpu") == 640
  assert kernel_plans.frame_cols(5, "cpu") == 8 and kernel_plans.frame_cols(5, "tpu") == 16
  assert kernel_plans.frame_cols(48, "tpu") == 64
  assert kernel_plans.packs_heads("gpu") and kernel_plans.partial_banks("gpu")
  assert not kernel_plans.packs_heads("tpu") and not kernel_plans.partial_banks("tpu")
  assert frames.GPU_TILE <= frames.TILE


@pytest.mark.slow
def test_tune_kernels_runs_every_variant(monkeypatch, capsys):
  monkeypatch.setattr(tune_kernels, "VARIANTS", tune_kernels.VARIANTS[:3])
  for name in ("TILE", "GPU_TILE", "GPU_PARAMS"):
    monkeypatch.setattr(frames, name, getattr(frames, name))  # restored after the test
  assert tune_kernels.main(["--ops", "combiner_fixed", "--length", "48", "--heads", "1", "--head_dim", "16",
                            "--dtype", "float32", "--repeats", "1"]) == 0
  rows = capsys.readouterr().out.strip().splitlines()[1:]
  assert len(rows) == 3 and all(row.endswith(" ms") for row in rows)
