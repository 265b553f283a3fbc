"""Preemption: SIGTERM (what Cloud TPU and most schedulers send first) asks the training loop to stop at a
step boundary that every process agrees on; there it saves a checkpoint and returns, and train.py exits 0.

A checkpoint save is a collective: with several processes, all of them must save the same step, or one waits
in the save while another runs the next step. So the loop asks `Preemption.reached(step)` at every step
boundary, in every process, and saves when it answers True:

- One process (jax.distributed not initialised): a Python SIGTERM handler sets a flag, and the next boundary
  answers True.
- jax.distributed initialised (any process count): JAX's preemption sync manager, which
  `jax.distributed.initialize` starts, catches SIGTERM in whichever process receives it and tells the others
  through the coordination service; in the background they agree on the step after the furthest process's
  current one. `multihost_utils.reached_preemption_sync_point(step)` is a local check (no collective, no
  message) that turns True at that step in every process. One SIGTERM per run: the manager agrees once.
- jax.distributed initialised with JAX's preemption service turned off (`jax_enable_preemption_service`):
  the flag of each process is combined across processes at every boundary (one small all-gather per step),
  which agrees but costs a collective per step.

Under JAX's manager a notice that arrives while the run starts up (before the loop) stops a run that starts
from step 0 after its first step; a resumed run misses it (the manager then agrees on step 1) and trains on.
"""

from __future__ import annotations

import signal
import sys


def _jax_sync_point(step: int) -> bool | None:
  """Whether JAX's agreed preemption step is `step`, or None when its preemption sync manager is not
  running (jax.distributed not initialised, or the preemption service turned off)."""
  import jax
  from jax.experimental import multihost_utils

  if not jax.distributed.is_initialized():
    return None
  try:
    return bool(multihost_utils.reached_preemption_sync_point(int(step)))
  except RuntimeError:  # "Preemption sync manager has not been initialized": the service is off
    return None


class Preemption:
  """Context manager around the training loop: `reached(step)` at every step boundary, in every process, says
  whether to save and stop there (the same step in every process). `requested` is True once it has."""

  def __init__(self, start_step: int = 0):
    self.start_step = int(start_step)
    self.requested = False
    self.agreed_by_jax = False  # JAX's preemption sync manager decides (jax.distributed is initialised)
    self._flag = False  # this process received SIGTERM (the Python handler's paths)
    self._previous = None
    self._installed = False
    self._processes = 1

  def __enter__(self):
    import jax

    self._processes = jax.process_count()
    # Tell JAX's manager where this run starts (its counter starts at 0): a notice agreed from here on names a
    # step after start_step. Without the manager, SIGTERM is caught by a Python handler.
    self.agreed_by_jax = _jax_sync_point(self.start_step) is not None
    if not self.agreed_by_jax:
      if self._processes > 1:
        print("preemption: JAX's preemption service is off; the processes combine their SIGTERM flags at "
              "every step (one all-gather per step)", file=sys.stderr, flush=True)
      try:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
      except ValueError:  # not the main thread (e.g. some test runners): no handler, nothing to restore
        self._previous = None
    return self

  def _handle(self, signum, frame):
    self._flag = True

  def reached(self, step: int) -> bool:
    """Whether every process stops at `step` (call once per step boundary, in every process, in order)."""
    if self.requested:
      return True
    if self.agreed_by_jax:
      self.requested = bool(_jax_sync_point(step))
    elif self._processes > 1:
      import numpy as np
      from jax.experimental import multihost_utils

      flags = multihost_utils.process_allgather(np.asarray(self._flag, np.int32))
      self.requested = bool(np.any(flags))
    else:
      self.requested = self._flag
    return self.requested

  def reason(self) -> str:
    """What the status record and the log say about the stop."""
    if self._processes > 1 or self.agreed_by_jax:
      return (f"SIGTERM (a preemption notice to one or more of the {self._processes} processes; all stopped "
              "here)")
    return "SIGTERM"

  def __exit__(self, *exc):
    if self._installed:
      if self._previous is not None:
        signal.signal(signal.SIGTERM, self._previous)
      self._installed = False
