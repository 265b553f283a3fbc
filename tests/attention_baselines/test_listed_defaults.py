"""The defaults a user cannot guess are named where an op is chosen: `train.py --list` (the registry's
descriptions) and the op's docstring."""

import pytest

from attention_baselines import adaptive_span, blockbert, etc, nsa
from training import listing

DEFAULTS = {
    "blockbert": (blockbert.blockbert, ["in six shifted", "cut to"]),
    "etc": (etc.etc, ["return_global=True", "not ETC's relative key vectors", "hard_g2l"]),
    "adaptive_span": (adaptive_span.adaptive_span, ["clamped to [0, max_span]"]),
    "nsa": (nsa.nsa, ["1/3", "previous", "3"]),
}


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_defaults_are_in_the_listing_and_the_docstring(name):
  text = {line.split()[0]: line for line in listing.listing().splitlines() if line.startswith("  ")
          and line.split()}
  fn, phrases = DEFAULTS[name]
  doc = " ".join(fn.__doc__.split())
  for phrase in phrases:
    assert phrase in text[name], (name, phrase)
    assert phrase in doc, (name, phrase)
