"""Generated datasets the data tests read (offline): small LRA files, text corpora and their tokenizers."""

from __future__ import annotations

import pytest

from data import testing


@pytest.fixture(scope="module")
def lra_dir(tmp_path_factory):
  base = str(tmp_path_factory.mktemp("lra"))
  testing.write_lra(base, seed=3, num_examples=12)
  return base


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
  out = {}
  for name in ("wiki40b", "c4"):
    base = str(tmp_path_factory.mktemp(name))
    testing.write_text(name, base, seed=5, num_examples=30)
    out[name] = base
  return out
