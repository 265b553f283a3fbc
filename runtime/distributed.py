"""JAX multi-process setup shared by train.py and eval.py.

Cloud TPU pod slices (and the SLURM/GPU clusters JAX detects) need only `--multihost`:
`jax.distributed.initialize()` finds the coordinator, process count and index itself. Anywhere else (several
processes on one machine, a cluster JAX cannot detect) pass `--coordinator_address host:port --num_processes N
--process_id i` to every process. On CPU the cross-process collectives run on gloo.

A process that stops sending heartbeats for `--host_timeout_s` seconds (its host died, it was killed) makes
JAX's coordination service stop every other process of the run (training/supervisor.py reports it).
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
  flags.DEFINE_integer("host_timeout_s", HOST_TIMEOUT_S, "multi-process: seconds without a heartbeat after "
                       "which a process counts as lost and the run stops (jax.distributed's heartbeat "
                       "timeout)")


HOST_TIMEOUT_S = 100  # jax.distributed's own default


def requested(flags: Any) -> bool:
  """Whether the command line asks for several processes (`--multihost` or any explicit coordinator flag)."""
  return bool(flags.multihost) or any(getattr(flags, k) is not None for k in
                                      ("coordinator_address", "num_processes", "process_id"))


def initialize(*, multihost: bool = False, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               host_timeout_s: int = HOST_TIMEOUT_S) -> bool:
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
  if host_timeout_s < 1:
    raise ValueError(f"host_timeout_s must be >= 1, got {host_timeout_s}")
  import jax

  if given:  # processes on CPU (tests, one machine) exchange collectives through gloo
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**given, heartbeat_timeout_seconds=int(host_timeout_s))
  return True


def initialize_from_flags(flags: Any) -> bool:
  return initialize(multihost=flags.multihost, coordinator_address=flags.coordinator_address,
                    num_processes=flags.num_processes, process_id=flags.process_id,
                    host_timeout_s=flags.host_timeout_s)
