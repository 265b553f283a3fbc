"""JAX multi-process setup shared by train.py and eval.py.

Cloud TPU pod slices (and the SLURM/GPU clusters JAX detects) need only `--multihost`:
`jax.distributed.initialize()` finds the coordinator, process count and index itself. Anywhere else (several
processes on one machine, a cluster JAX cannot detect) pass `--coordinator_address host:port --num_processes N
--process_id i` to every process. On CPU the cross-process collectives run on gloo.
"""

from __future__ import annotations

from typing import Any


def define_flags() -> None:
  """The multi-process flags (absl), once per program."""
  from absl import flags

  flags.DEFINE_bool("multihost", False, "call jax.distributed.initialize() (Cloud TPU pods, multi-GPU hosts)")
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (implies multi-process)")
  flags.DEFINE_integer("num_processes", None, "number of JAX processes (with --coordinator_address)")
  flags.DEFINE_integer("process_id", None, "this process's index in [0, num_processes)")


def initialize(*, multihost: bool = False, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None) -> bool:
  """Calls `jax.distributed.initialize` when asked to; returns whether it did.

  Nothing happens without `multihost` or an explicit coordinator/process count/index. Explicit values are
  checked (a ValueError names the argument) and passed through; the ones left out JAX detects.
  """
  explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes,
              "process_id": process_id}
  given = {k: v for k, v in explicit.items() if v is not None}
  if not multihost and not given:
    return False
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  too_big = num_processes is not None and process_id is not None and process_id >= num_processes
  if process_id is not None and (process_id < 0 or too_big):
    raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got {process_id}")
  if coordinator_address is not None and ":" not in coordinator_address:
    raise ValueError(f"coordinator_address must be host:port, got {coordinator_address!r}")
  import jax

  if given:  # processes on CPU (tests, one machine) exchange collectives through gloo
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**given)
  return True


def initialize_from_flags(flags: Any) -> bool:
  return initialize(multihost=flags.multihost, coordinator_address=flags.coordinator_address,
                    num_processes=flags.num_processes, process_id=flags.process_id)
