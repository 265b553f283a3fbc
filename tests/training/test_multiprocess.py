"""Two JAX processes on localhost (2 CPU devices each) train like one process with 4 devices (to float
rounding), resume bit-exactly after SIGKILL, and shard the data disjointly; eval.py runs the same way. SIGTERM
to one of them stops both at the same step, saved, with exit 0, and the resumed run ends as the uninterrupted
one. kill -9 of one host (its supervisor, its training with it): the survivor's supervisor records the cause
and the last intact step, and the rerun ends as the uninterrupted one. Plus the flag checks."""

import hashlib
import json
import os
import re
import signal
import time

import jax
import numpy as np
import pytest

from runtime import distributed
from tests.training.localhost import CONFIG, EVERY, STEPS, final_metrics, uninterrupted
from tests.training.localhost import finish as _finish
from tests.training.localhost import launch as _launch
from training import checkpoints, experiment


@pytest.fixture
def straight(tmp_path_factory):
  """An uninterrupted two-process run: the reference every interrupted run must end equal to."""
  return uninterrupted(str(tmp_path_factory.getbasetemp()))


def _saved_steps(workdir: str) -> list[int]:
  ckpt = os.path.join(workdir, "checkpoints")
  names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
  return sorted(int(n) for n in names if n.isdigit())


def _config():
  from configs import default

  c = default.get_config("smoke")
  c.train.num_steps, c.train.checkpoint_every, c.train.log_every = STEPS, EVERY, 5
  return c


def _rows(batch) -> list[str]:
  """One digest per example of a host batch."""
  keys = sorted(batch)
  n = len(batch[keys[0]])
  return [hashlib.sha1(b"".join(np.ascontiguousarray(batch[k][i]).tobytes() for k in keys)).hexdigest()
          for i in range(n)]


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_after_sigkill(tmp_path, straight):
  workdir = str(tmp_path / "run")
  # 1. Two processes train; SIGKILL both as soon as the first checkpoint is complete (mid-run).
  procs = _launch("train.py", [*CONFIG, "--noprogress"], workdir)
  deadline = time.time() + 400
  try:
    while not _saved_steps(workdir) and time.time() < deadline and all(p.poll() is None for p in procs):
      time.sleep(0.02)
    for p in procs:
      p.send_signal(signal.SIGKILL)
  finally:
    for p in procs:
      p.wait()
  killed_at = _saved_steps(workdir)
  logs = [open(p.log_path).read() for p in procs]
  assert killed_at and max(killed_at) < STEPS, logs
  assert all(p.returncode == -signal.SIGKILL for p in procs), logs
  assert not os.path.exists(os.path.join(workdir, "metrics.json"))

  # 2. Both rerun with the same workdir: they resume from the checkpoint and finish.
  outputs = _finish(_launch("train.py", [*CONFIG, "--noprogress"], workdir))
  for out in outputs:
    assert "resumed from" in out and f"at step {max(killed_at)}" in out, out[-4000:]
  assert os.path.exists(os.path.join(workdir, "metrics.json"))

  # 3. Resume is exact: an uninterrupted two-process run ends with bitwise the same state (every parameter,
  # the key bias included, and the optimizer moments).
  config = _config()
  exp = experiment.Experiment(config, devices=jax.devices()[:4])
  states = []
  for wd in (workdir, straight):
    mgr = checkpoints.checkpoint_manager(wd, config, read_only=True)
    assert mgr.latest_step() == STEPS
    states.append(checkpoints.restore_checkpoint(mgr, exp, None))
    mgr.close()
  for tree in ("params", "opt_state"):
    a, b = (jax.tree.leaves(getattr(s, tree)) for s in states)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), tree
  restored = states[0]

  # 4. The reference: one process, 4 devices, the global batch of step s = host 0's batch then host 1's.
  state = exp.init_state()
  per_host = exp.per_host(int(config.train.batch_size)) // 2
  hosts = [iter(experiment.create_dataset(config, "train", batch_size=per_host, seed=int(config.seed),
                                          shard_index=i, shard_count=2)) for i in range(2)]
  for _ in range(STEPS):
    b0, b1 = next(hosts[0]), next(hosts[1])
    r0, r1 = _rows(b0), _rows(b1)
    assert len(set(r0)) == len(r0) and not set(r0) & set(r1)  # disjoint shards, full per-host batches
    batch = {k: np.concatenate([b0[k], b1[k]]) for k in b0}
    assert len(batch[next(iter(batch))]) == int(config.train.batch_size)  # together: the global batch
    state, _ = exp.train_step(state, batch)

  # 5. The two-process run's final parameters equal the reference's.
  # The key projection's bias shifts every logit of a query by the same q.b, which softmax cancels: its exact
  # gradient is 0, the computed one is rounding noise, and Adam turns noise into lr-sized steps in either run.
  # Every other parameter is compared; the key bias is shown to be inert by the equal loss below.
  errors = {}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored.params), jax.tree.leaves(state.params),
                          strict=True):
    name = jax.tree_util.keystr(path)
    if not ("['key']" in name and "bias" in name):
      errors[name] = _rel(a, b)
  worst = max(errors.items(), key=lambda kv: kv[1])
  print(f"two processes vs one: {len(errors)} parameters, largest relative difference {worst}")
  assert len(errors) >= 10 and worst[1] <= 1e-5, worst
  one = exp.evaluate(restored, config.eval_split, -1)
  ref = exp.evaluate(state, config.eval_split, -1)
  assert abs(one["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (one, ref)

  # 6. eval.py with two processes reports what one process computes from the same parameters.
  eval_out = _finish(_launch("eval.py", ["--max_batches=-1"], workdir))
  assert all("accuracy=" in out for out in eval_out), eval_out[0][-4000:]
  two = json.load(open(os.path.join(workdir, f"eval_{config.eval_split}_{STEPS}.json")))
  for k in ("loss", "accuracy"):
    assert abs(two[k] - one[k]) <= 1e-5 * max(1.0, abs(one[k])), (k, two[k], one[k])


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path, straight):
  workdir = str(tmp_path / "run")
  # 1. Two processes train; process 1 alone gets SIGTERM once it trains (its step-5 metrics line).
  procs = _launch("train.py", [*CONFIG, "--noprogress"], workdir)
  deadline = time.time() + 400
  try:
    while time.time() < deadline and all(p.poll() is None for p in procs):
      with open(procs[1].log_path) as f:
        if "\nstep 5:" in f.read():
          break
      time.sleep(0.01)
    procs[1].send_signal(signal.SIGTERM)
  except BaseException:
    for p in procs:
      p.kill()
    raise
  outputs = _finish(procs)  # both exit 0
  # 2. Both saved the same step, which process 0's status record names, and neither evaluated.
  saved = [re.findall(r"SIGTERM .*: saved checkpoint at step (\d+)", out) for out in outputs]
  assert all(len(s) == 1 for s in saved), [out[-3000:] for out in outputs]
  step = int(saved[0][0])
  assert saved[1] == saved[0] and 5 <= step < STEPS, saved
  with open(os.path.join(workdir, "status", "preempted.json")) as f:
    record = json.load(f)
  assert record["step"] == step and record["reason"].startswith("SIGTERM"), record
  assert max(_saved_steps(workdir)) == step
  assert not os.path.exists(os.path.join(workdir, "metrics.json"))
  # 3. Rerun: both resume from that step, finish, and end with the uninterrupted run's final metrics.
  outputs = _finish(_launch("train.py", [*CONFIG, "--noprogress"], workdir))
  assert all(f"at step {step}" in out for out in outputs), outputs[0][-3000:]
  metrics = [final_metrics(workdir), final_metrics(straight)]
  assert metrics[0] == metrics[1] and metrics[0]["step"] == STEPS, metrics
  assert os.path.exists(os.path.join(workdir, "status", "finished.json"))


def _kill_host_after_a_checkpoint(workdir: str, victim: int, after: int) -> tuple[dict, float, list[str]]:
  """Two processes train; once a checkpoint newer than `after` is complete, process `victim`'s host dies
  (its supervisor is killed, and its training with it). Returns the survivor's failed record, the seconds
  from the kill to the record, and both logs."""
  procs = _launch("train.py", [*CONFIG, "--noprogress", "--host_timeout_s=10"], workdir)
  record = os.path.join(workdir, "status", "failed.json")
  try:
    deadline = time.time() + 400
    while max(_saved_steps(workdir), default=-1) <= after:
      assert time.time() < deadline and all(p.poll() is None for p in procs), open(procs[0].log_path).read()
      time.sleep(0.05)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.time()
    while not os.path.exists(record) and time.time() - killed < 120:
      time.sleep(0.05)
    seconds = time.time() - killed
    procs[1 - victim].wait(timeout=120)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  logs = [open(p.log_path).read() for p in procs]
  assert os.path.exists(record), logs[1 - victim][-4000:]
  assert procs[1 - victim].returncode == 75, logs[1 - victim][-4000:]  # a host was lost: start again
  assert logs[1 - victim].rstrip().splitlines()[-1].startswith("ERROR: a host of this run was lost: ")
  with open(record) as f:
    return json.load(f), seconds, logs


@pytest.mark.slow
def test_a_lost_host_is_recorded_and_the_rerun_ends_as_the_uninterrupted_run(tmp_path, straight):
  """kill -9 of one host of two (its supervisor and its training), then of the other in the rerun: the
  survivor records the cause within 2 minutes each time, and a third run ends as the uninterrupted one."""
  workdir = str(tmp_path / "run")
  # 1. Process 1's host dies: JAX stops process 0, whose supervisor records it.
  failed, seconds, _ = _kill_host_after_a_checkpoint(workdir, victim=1, after=-1)
  print(f"process 1 killed: failed.json {seconds:.1f}s later: {failed['error']}")
  assert seconds < 120 and failed["cause"] == "host_lost" and failed["lost_processes"] == [1], failed
  # The survivor hears of it from JAX's heartbeats, or first from a collective whose other end is gone.
  assert failed["reported_by"] == 0 and ("process 1 of 2 stopped sending heartbeats" in failed["error"]
                                         or "the connection to process 1 of 2 broke" in failed["error"])
  first = failed["last_intact_step"]
  assert first in _saved_steps(workdir) and f"the last intact checkpoint is step {first}" in failed["error"]
  # 2. The rerun resumes from it; the coordinator's host dies after its next checkpoint: process 1 records it.
  failed, seconds, logs = _kill_host_after_a_checkpoint(workdir, victim=0, after=first)
  print(f"process 0 killed: failed.json {seconds:.1f}s later: {failed['error']}")
  assert f"resumed from {workdir}/checkpoints at step {first}" in logs[1], logs[1][-3000:]
  assert seconds < 120 and failed["cause"] == "host_lost" and failed["reported_by"] == 1, failed
  assert ("the coordinator (process 0 of 2) stopped answering" in failed["error"]
          or "the connection to process 0 of 2 broke" in failed["error"]), failed
  second = failed["last_intact_step"]
  assert first < second < STEPS
  # 3. Rerun: resumes from the last intact step (a half-written one set aside) and ends as the uninterrupted.
  outputs = _finish(_launch("train.py", [*CONFIG, "--noprogress"], workdir))
  assert all(f"at step {second}" in out for out in outputs), outputs[0][-3000:]
  assert final_metrics(workdir) == final_metrics(straight)


def test_distributed_flags_checked_and_optional():
  assert distributed.initialize() is False  # nothing asked: single process, no coordinator
  with pytest.raises(ValueError, match="num_processes"):
    distributed.initialize(num_processes=0)
  with pytest.raises(ValueError, match="process_id"):
    distributed.initialize(num_processes=2, process_id=2)
  with pytest.raises(ValueError, match="coordinator_address"):
    distributed.initialize(coordinator_address="localhost", num_processes=2, process_id=0)
