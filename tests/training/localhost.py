"""Training entry points run as several JAX processes on localhost (jax.distributed, CPU devices): the
harness of the multi-process tests."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
# The two-process run the multi-process tests interrupt, and their reference: 20 steps, a checkpoint every 5.
STEPS, EVERY = 20, 5
CONFIG = ["--config", "configs/default.py:smoke", f"--config.train.num_steps={STEPS}",
          f"--config.train.checkpoint_every={EVERY}", "--config.train.log_every=5"]
_REFERENCE: dict[str, str] = {}


def xla_flags(devices: int) -> str:
  """The test session's XLA flags (tests/conftest.py: the cheap CPU code generation) with `devices` CPU
  devices in place of its eight."""
  count = "--xla_force_host_platform_device_count"
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
  return " ".join([*flags, f"{count}={devices}"])


def launch(script: str, args: list[str], workdir: str, *, processes: int = 2,
           devices: int = 2) -> list[subprocess.Popen]:
  """Starts processes 0 .. processes-1 of `script` (each with `devices` CPU devices) on a fresh localhost
  coordinator port; each one's output goes to a log file beside `workdir` (`proc.log_path`)."""
  import portpicker

  port = portpicker.pick_unused_port()
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
  procs = []
  for pid in range(processes):
    cmd = [sys.executable, "-u", script, *args, "--workdir", workdir,
           f"--coordinator_address=localhost:{port}", f"--num_processes={processes}", f"--process_id={pid}"]
    log = open(os.path.join(os.path.dirname(workdir), f"{script}.{pid}.{port}.log"), "w")
    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env))
    procs[-1].log_path = log.name
  return procs


def finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[str]:
  """Waits for every process (killing what outlives `timeout`), asserts each exited 0, returns their logs."""
  outputs = []
  for p in procs:
    try:
      p.wait(timeout=timeout)
    finally:
      if p.poll() is None:
        p.kill()
        p.wait()
    with open(p.log_path) as f:
      outputs.append(f.read())
  for p, out in zip(procs, outputs, strict=True):
    assert p.returncode == 0, out[-4000:]
  return outputs


def uninterrupted(base: str) -> str:
  """The workdir of an uninterrupted two-process run of CONFIG under `base` (one per test process: the
  reference every interrupted run must end equal to)."""
  if "workdir" not in _REFERENCE:
    workdir = os.path.join(base, "uninterrupted", "run")
    os.makedirs(os.path.dirname(workdir))
    finish(launch("train.py", [*CONFIG, "--noprogress"], workdir))
    _REFERENCE["workdir"] = workdir
  return _REFERENCE["workdir"]


def final_metrics(workdir: str) -> dict:
  """metrics.json without what differs between an interrupted run and its reference (the start step)."""
  import json

  with open(os.path.join(workdir, "metrics.json")) as f:
    return {k: v for k, v in json.load(f).items() if k != "start_step"}
