"""scripts/check_kernels.py, profile_ops.py and tune_kernels.py on CPU, and the kernels' per-backend tiles.

The scripts are meant for a GPU or TPU host; here they run in interpret mode (or on a hand-written trace) so
that their logic is checked where CI runs: the checker passes on agreeing paths and fails on a planted
disagreement, the profiler sums only device events, the tuner restores nothing it should not.
"""

from __future__ import annotations

import gzip
import json

import pytest

from attention_core import contract
from combiner import flash
from scripts import check_kernels, profile_ops, tune_kernels


@pytest.mark.slow
def test_check_kernels_passes_when_formulations_agree(capsys):
  assert check_kernels.main(["--length", "40", "--head_dim", "8", "--only", "yoso"]) == 0
  out = capsys.readouterr().out
  assert "yoso onehot vs sorted" in out and "yoso_sketch pallas vs sorted" in out and "all passed" in out


@pytest.mark.slow
def test_check_kernels_fails_on_a_planted_disagreement(monkeypatch, capsys):
  from yoso import attention

  real = attention.yoso

  def off_by_a_little(*args, formulation, **kw):  # the fused side drifts by 5%
    out = real(*args, formulation=formulation, **kw)
    return out * 1.05 if formulation == "pallas" else out

  monkeypatch.setattr(attention, "yoso", off_by_a_little)
  assert check_kernels.main(["--length", "40", "--head_dim", "8", "--only", "yoso"]) == 1
  assert "FAIL" in capsys.readouterr().out


def test_check_kernels_rejects_unknown_groups():
  with pytest.raises(SystemExit):
    check_kernels.main(["--only", "combiner,nonsense"])


def test_check_kernels_covers_every_plan_in_both_directions():
  names = [name for name, _, _ in check_kernels.combiner_cases(1000)]
  plans = {name.split()[0] for name in names}
  assert plans == {"combiner_fixed", "combiner_logsparse", "combiner_axial_rowmajor",
                   "combiner_axial_vertical", "combiner_axial_horizontal", "combiner_mixture",
                   "combiner_mixture_joint", "sparse_fixed", "sparse_axial", "sparse_logsparse"}
  assert sum("causal=True" in n for n in names) == sum("causal=False" in n for n in names) == len(plans)
  kws = [kw for _, _, kw in check_kernels.combiner_cases(1000)]
  assert {kw.get("pooling") for kw in kws} >= {"max", "mean"} and any(kw.get("deepsets") for kw in kws)


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


def test_tile_caps_follow_the_platform():
  with contract.traced_for("cpu"):
    assert flash.tile_caps() == (flash.BLOCK_Q, flash.BLOCK_K)  # CPU: interpret mode, TPU-shaped tiles
  with contract.traced_for("gpu"):
    assert flash.tile_caps() == (flash.GPU_BLOCK_Q, flash.GPU_BLOCK_K)
    assert flash.group_length(1000) == flash.GPU_BLOCK_Q


@pytest.mark.slow
def test_tune_kernels_runs_every_variant(monkeypatch, capsys):
  monkeypatch.setattr(tune_kernels, "VARIANTS", tune_kernels.VARIANTS[:3])
  for name in ("BLOCK_Q", "BLOCK_K", "GPU_BLOCK_Q", "GPU_BLOCK_K", "SPLIT_TILES", "GPU_PARAMS"):
    monkeypatch.setattr(flash, name, getattr(flash, name))  # restored after the test
  assert tune_kernels.main(["--ops", "combiner_fixed", "--length", "48", "--heads", "1", "--head_dim", "16",
                            "--dtype", "float32", "--repeats", "1"]) == 0
  rows = capsys.readouterr().out.strip().splitlines()[1:]
  assert len(rows) == 3 and all(row.endswith(" ms") for row in rows)
