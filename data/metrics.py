"""Bookkeeping of the density metrics, shared by eval.py and the tests.

Sums, not means, cross batches and hosts: accumulate `sum_nll` (natural-log units) and `count` (the sum of the
batch's `weights`, i.e. predicted sub-pixels or tokens), then convert once at the end.
"""

from __future__ import annotations

import math

import numpy as np


def token_nll(logits: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
  """(sum of weighted -log p(target), sum of weights) for logits [..., V], targets/weights [...] (NumPy)."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  log_z = np.log(np.exp(shifted).sum(axis=-1))
  picked = np.take_along_axis(shifted, np.asarray(targets)[..., None], axis=-1)[..., 0]
  nll = log_z - picked
  w = np.asarray(weights, np.float64)
  return float((nll * w).sum()), float(w.sum())


def bits_per_dim(sum_nll: float, count: float) -> float:
  """Bits per sub-pixel: mean NLL in nats over all predicted sub-pixels, divided by ln 2."""
  if count <= 0:
    raise ValueError(f"count must be > 0, got {count}")
  return sum_nll / count / math.log(2.0)


def perplexity(sum_nll: float, count: float) -> float:
  """exp(mean NLL per predicted token), the paper's sentence-piece-level perplexity."""
  if count <= 0:
    raise ValueError(f"count must be > 0, got {count}")
  return math.exp(sum_nll / count)
