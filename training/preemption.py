"""Preemption: SIGTERM (what Cloud TPU and most schedulers send first) asks the training loop to stop."""

from __future__ import annotations

import signal


class Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and exits cleanly."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread (e.g. some test runners): no handler, nothing to restore
      self._previous = None
    return self

  def _handle(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
