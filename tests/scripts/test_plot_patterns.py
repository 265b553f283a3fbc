"""scripts/plot_patterns.py: attention-pattern codes from a plan's sets, the reference patterns, the pictures
it writes and the committed ones in docs/patterns/; a bad flag is one `ERROR:` line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from scripts import plot_patterns as pp
from tests.training.test_usage_errors import assert_one_line

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _stand_in_sets(plan, length, i, *, causal, block_size):
  """Minimal fixed plan (own block direct, other blocks spans) to test the code matrix independently."""
  del plan
  visible = range(i + 1) if causal else range(length)
  direct = [j for j in visible if j // block_size == i // block_size]
  spans = {}
  for j in visible:
    if j // block_size != i // block_size:
      spans.setdefault(j // block_size, []).append(j)
  return direct, list(reversed(spans.values()))  # unordered on purpose: codes sort spans by first position


def test_pattern_codes_from_stand_in_sets():
  codes = pp.pattern_codes("fixed", 6, causal=True, sets_fn=_stand_in_sets, block_size=2)
  expected = np.array([[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [2, 2, 1, 0, 0, 0],
                       [2, 2, 1, 1, 0, 0],
                       [2, 2, 3, 3, 1, 0],
                       [2, 2, 3, 3, 1, 1]])
  np.testing.assert_array_equal(codes, expected)
  with pytest.raises(ValueError, match="twice"):
    pp.pattern_codes("x", 3, causal=False, sets_fn=lambda *a, **k: ([0, 1], [[1, 2]]))


@pytest.mark.parametrize("causal", [True, False])
def test_reference_patterns_cover_omega_and_sparse_supports_stay_inside(causal):
  length = 16
  omega = np.tril(np.ones((length, length), bool)) if causal else np.ones((length, length), bool)
  codes = pp.all_codes(length, 4)
  assert {stem for stem, _ in codes} == {stem for stem, *_ in pp.plan_panels(4)}
  for (stem, c), code in codes.items():
    if c != causal:
      continue
    assert np.all(np.diag(code) == pp.DIRECT), stem
    if stem.startswith("combiner_"):
      np.testing.assert_array_equal(code > 0, omega, err_msg=stem)  # full attention: every j in Omega_i
      assert code.max() >= 3, stem  # at least two spans somewhere
    else:
      assert np.all(code[~omega] == 0) and 0 < code.sum() < omega.sum(), stem
  rgb = pp.codes_to_rgb(codes["combiner_fixed", causal])
  assert rgb.shape == (length, length, 3)


def test_plot_patterns_writes_small_pngs(tmp_path):
  paths = pp.main(["--out_dir", str(tmp_path), "--length", "8", "--block", "2"])
  names = sorted(os.path.basename(p) for p in paths)
  expected = sorted([f"{stem}_{d}.png" for stem, *_ in pp.plan_panels(2) for d in ("causal", "bidirectional")]
                    + ["overview.png"])
  assert names == expected
  for path in paths:
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and 1000 < len(data) < 100_000, path


def test_committed_pattern_pictures_are_present_and_small():
  pictures = os.path.join(REPO_ROOT, "docs", "patterns")
  expected = [f"{stem}_{d}.png" for stem, *_ in pp.plan_panels(4) for d in ("causal", "bidirectional")]
  for name in expected + ["overview.png"]:
    size = os.path.getsize(os.path.join(pictures, name))
    assert 1000 < size < 100_000, name


@pytest.mark.parametrize("argv,name", [(["--length", "0"], "--length and --block must be >= 1"),
                                       (["--block", "x"], "--block: invalid int value: 'x'")])
def test_bad_flags_are_one_line_and_write_nothing(argv, name, tmp_path):
  proc = subprocess.run([sys.executable, "-m", "scripts.plot_patterns", "--out_dir", str(tmp_path / "out"),
                         *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
  assert_one_line(proc, name)
  assert not (tmp_path / "out").exists()
