"""scripts/adaptive_spans.py end to end in its `smoke` setting: the local task (the recall task runs the same
code on the default data, and each task costs its compilations) trains through train.py's loop for two steps
and the table has one row per layer with a span per head (the learned values are not checked: the measured
setting is in docs/results.md); a bad flag is one `ERROR:` line and exit 2 before anything runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts import adaptive_spans
from tests.training.test_usage_errors import ROOT, assert_one_line


@pytest.mark.slow  # a tiny model compiled, trained and evaluated
def test_smoke_setting_prints_a_span_per_head_for_every_layer(tmp_path, capsys):
  out = tmp_path / "spans.md"
  assert adaptive_spans.main(["--workdir_root", str(tmp_path / "runs"), "--setting", "smoke", "--steps", "2",
                              "--tasks", "local", "--no_progress", "--output", str(out)]) == 0
  s = adaptive_spans.SETTINGS["smoke"]
  lines = out.read_text().strip().splitlines()
  assert lines == capsys.readouterr().out.strip().splitlines()[-len(lines):]  # printed as written
  assert lines[0].split("|")[3:3 + s["heads"]] == [f" head {h} " for h in range(s["heads"])]
  rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
  assert len(rows) == s["layers"]
  for layer, row in enumerate(rows):
    assert row[0] == f"local (synthetic_local, L={s['seq_len']})" and row[1] == str(layer)
    assert len(row) == 2 + s["heads"] + 2
    spans = [float(v) for v in row[2:2 + s["heads"] + 1]]  # per head, then their mean
    assert all(0 <= z <= s["seq_len"] for z in spans)
    assert row[-1].endswith(")") and "chance" in row[-1]
  assert (tmp_path / "runs" / "local-smoke" / "metrics.json").exists()


@pytest.mark.parametrize("argv,name", [(["--steps", "0"], "--steps must be >= 1"),
                                       (["--tasks", "nope"], "--tasks: invalid choice: 'nope'"),
                                       (["--setting", "huge"], "--setting: invalid choice: 'huge'")])
def test_bad_flags_are_one_line_and_run_nothing(argv, name, tmp_path):
  proc = subprocess.run([sys.executable, "-m", "scripts.adaptive_spans", "--workdir_root",
                         str(tmp_path / "runs"), *argv], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert_one_line(proc, name)
  assert not (tmp_path / "runs").exists()
