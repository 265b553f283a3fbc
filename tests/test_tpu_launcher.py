"""scripts/tpu.py --dry_run: the exact gcloud commands for a v4-8 (spot) and a v5e-16 (on-demand) run,
quoting of user input, and the clear errors; nothing is executed (subprocess is blocked)."""

import os
import shlex
import subprocess
import sys

import pytest

from scripts import tpu


@pytest.fixture(autouse=True)
def no_commands(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError(f"a dry run ran {args}")

  monkeypatch.setattr(subprocess, "run", refuse)


def dry_run(capsys, command, *argv):
  assert tpu.main([command, "--dry_run", *argv]) == 0
  lines = capsys.readouterr().out.splitlines()
  return [line for line in lines if not line.startswith("#")]


def test_v4_8_spot_run(capsys):
  cmds = dry_run(capsys, "run", "--name", "c4-comb", "--zone", "us-central2-b", "--accelerator", "v4-8",
                 "--spot", "--config", "configs/c4.py", "--workdir", "gs://bucket/c4", "--",
                 "--config.seed=1", "--gin_bindings=attention.deepsets = True")
  create = ("gcloud compute tpus queued-resources create c4-comb --node-id c4-comb --zone us-central2-b "
            "--accelerator-type v4-8 --runtime-version tpu-ubuntu2204-base --spot")
  assert cmds[0] == create
  assert cmds[1] == ("gcloud compute tpus queued-resources describe c4-comb --zone us-central2-b "
                     "'--format=value(state.state)'")
  argv = [shlex.split(c) for c in cmds]
  ssh = [a for a in argv if a[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
  assert all(a[5] == "c4-comb" and a[6:8] == ["--zone", "us-central2-b"] for a in ssh)
  setup = next(a[-1] for a in ssh if "pip install" in a[-1])
  assert "--worker=all" in next(a for a in ssh if "pip install" in a[-1])
  assert f"'jax[tpu]=={tpu.pinned('jax')}'" in setup
  assert "-r requirements.txt -r requirements-tpu.txt" in setup
  scp = next(a for a in argv if a[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"])
  assert scp[6] == "c4-comb:~/code.tar.gz" and "--worker=all" in scp
  train = next(a for a in ssh if "train.py" in a[-1])
  assert "--worker=all" in train
  remote = shlex.split(train[-1].split("setsid nohup ", 1)[1].split(" > ")[0])
  assert remote == ["~/venv/bin/python", "train.py", "--multihost", "--config", "configs/c4.py",
                    "--workdir", "gs://bucket/c4", "--noprogress", "--config.seed=1",
                    "--gin_bindings=attention.deepsets = True"]
  assert train[-1].endswith("> ~/train.log 2>&1 < /dev/null &")
  # The watch: state, process on worker 0, final metrics; after a preemption: delete, then start again.
  delete = ("gcloud compute tpus queued-resources delete c4-comb --zone us-central2-b --force --quiet")
  assert delete in cmds and "gcloud storage ls gs://bucket/c4/metrics.json" in cmds
  assert cmds[cmds.index(delete) + 1] == create


def test_v5e_16_on_demand_create_and_logs(capsys):
  cmds = dry_run(capsys, "create", "--name", "v5", "--zone", "us-west4-a", "--accelerator", "v5e-16",
                 "--project", "my-proj")
  assert cmds[0] == ("gcloud compute tpus queued-resources create v5 --node-id v5 --zone us-west4-a "
                     "--project my-proj --accelerator-type v5litepod-16 "
                     "--runtime-version v2-alpha-tpuv5-lite")
  cmds = dry_run(capsys, "logs", "--name", "v5", "--zone", "us-west4-a")
  assert cmds == ["gcloud compute tpus tpu-vm ssh v5 --zone us-west4-a --worker=0 --command "
                  "'tail -n +1 -F ~/train.log'"]
  cmds = dry_run(capsys, "create", "--name", "v5", "--zone", "us-west4-a", "--accelerator", "v5e-16",
                 "--best_effort", "--runtime", "v2-alpha-tpuv5-lite")
  assert cmds[0].endswith("--runtime-version v2-alpha-tpuv5-lite --best-effort")


def test_repo_url_is_quoted_and_errors_are_clear(capsys):
  cmds = dry_run(capsys, "copy", "--name", "n", "--zone", "z", "--repo_url", "https://x/y.git; rm -rf ~",
                 "--ref", "v1")
  remote = shlex.split(cmds[0])[-1]
  assert "'https://x/y.git; rm -rf ~'" in remote and remote.endswith("checkout -q v1")
  with pytest.raises(SystemExit, match="v4-8 or v5e-16"):
    tpu.main(["create", "--name", "n", "--zone", "z", "--accelerator", "tpu8", "--dry_run"])
  with pytest.raises(SystemExit, match="--config and --workdir"):
    tpu.main(["run", "--name", "n", "--zone", "z", "--accelerator", "v4-8", "--dry_run"])
  with pytest.raises(SystemExit):
    tpu.main(["create", "--name", "n", "--zone", "z", "--accelerator", "v4-8", "--spot", "--best_effort"])


def test_run_recreates_the_slice_after_a_preemption(monkeypatch, capsys):
  """`run` without --dry_run against a scripted gcloud: ACTIVE and training, then SUSPENDED (preempted): the
  queued resource is deleted and recreated and training started again; it ends when metrics.json exists."""
  states = iter(["ACTIVE", "ACTIVE", "SUSPENDED", "ACTIVE", "ACTIVE"])
  running = iter([0, 1])  # pgrep: still training, then no longer
  issued = []

  def fake(self, cmd, *, check=True, capture=False):
    issued.append(" ".join(cmd))
    if "describe" in cmd:
      return 0, next(states)
    if "pgrep" in cmd[-1]:
      return next(running), ""
    return 0, ""

  monkeypatch.setattr(tpu.Runner, "__call__", fake)
  monkeypatch.setattr(tpu.time, "sleep", lambda s: None)
  assert tpu.main(["run", "--name", "n", "--zone", "z", "--accelerator", "v4-8", "--spot", "--config",
                   "configs/default.py", "--workdir", "gs://b/w", "--delete_after"]) == 0
  kinds = [c.split()[4] if c.startswith("gcloud compute tpus queued-resources") else
           ("pgrep" if "pgrep" in c else "train" if "train.py" in c else c.split()[1]) for c in issued]
  creates = [i for i, k in enumerate(kinds) if k == "create"]
  deletes = [i for i, k in enumerate(kinds) if k == "delete"]
  trains = [i for i, k in enumerate(kinds) if k == "train"]
  assert len(creates) == 2 and len(trains) == 2 and len(deletes) == 2  # recreated once, deleted at the end
  assert creates[0] < trains[0] < deletes[0] < creates[1] < trains[1] < deletes[1] == len(kinds) - 1
  assert "training finished" in capsys.readouterr().out


def test_the_compile_check_runs_first_with_the_config_flags(capsys):
  capsys.readouterr()
  assert tpu.main(["create", "--dry_run", "--name", "n", "--zone", "z", "--accelerator", "v5e-16", "--config",
                   "configs/c4.py", "--", "--config.train.batch_size", "64", "--noprogress",
                   "--gin_bindings=attention.deepsets = True"]) == 0
  lines = capsys.readouterr().out.splitlines()
  check = shlex.split(lines[0].split(": ", 1)[1])
  assert lines[0].startswith("# compile check")
  assert lines[1].startswith("gcloud compute tpus queued-resources create")
  assert check[1].endswith("scripts/compile_tpu.py") and check[-5:] == [
      "--topology", "v5e-16", "--config.train.batch_size", "64", "--gin_bindings=attention.deepsets = True"]
  assert tpu.main(["create", "--dry_run", "--name", "n", "--zone", "z", "--accelerator", "v5e-16", "--config",
                   "configs/c4.py", "--skip_compile_check"]) == 0
  assert "compile check" not in capsys.readouterr().out


def test_no_slice_is_created_when_the_config_does_not_fit(tmp_path):
  """The real launcher, with a `gcloud` on PATH that records its calls: the compile check of a batch no chip
  holds fails, so gcloud is never called."""
  pytest.importorskip("libtpu")
  log = tmp_path / "gcloud.log"
  (tmp_path / "gcloud").write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
  (tmp_path / "gcloud").chmod(0o755)
  env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
  proc = subprocess.Popen([sys.executable, "-m", "scripts.tpu", "create", "--name", "n", "--zone", "z",
                           "--accelerator", "v5e-1", "--config", "configs/default.py:smoke", "--",
                           "--config.train.batch_size=4194304"], cwd=tpu.ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 1
  assert "does not fit on v5e-1" in err and "not creating n" in err.splitlines()[-1]
  assert not log.exists()
