"""scripts/hibert_rouge.py's user errors: a workdir that is not a run's and a bad flag are one line on
stderr and exit 2 (the script on a trained run: tests/training/test_hibert_train.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args,message", [
    (["--workdir", "{tmp}"], "ERROR: no config.json in {tmp}: is it a train.py workdir?"),
    (["--workdir", "{tmp}", "--top", "x"], "ERROR: argument --top: invalid int value: 'x'"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, args, message):
  argv = [a.format(tmp=tmp_path) for a in args]
  proc = subprocess.run([sys.executable, "-m", "scripts.hibert_rouge", *argv], capture_output=True, text=True,
                        cwd=ROOT, timeout=300)
  assert proc.returncode == 2 and proc.stdout == ""
  assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [message.format(tmp=tmp_path)]
