"""scripts/slurm.py: the sbatch script for multi-node GPU training, rendered and run as sbatch would run it
on a node, with a stand-in `srun` on PATH that records what it was asked to start; a bad flag, config file or
config override is one `ERROR:` line (exit 2) before anything is written."""

import os
import shlex
import subprocess
import sys

import pytest

from scripts import slurm
from tests.training.test_usage_errors import assert_one_line


def test_rendered_script_starts_train_py_multihost_on_every_gpu(tmp_path):
  out, logs = tmp_path / "job.sbatch", tmp_path / "logs"
  assert slurm.main(["--nodes", "2", "--gpus_per_node", "4", "--partition", "gpu", "--account", "lab",
                     "--time", "1-12:00:00", "--job_name", "c4-comb", "--log_dir", str(logs),
                     "--config", "configs/c4.py:attention=combiner_fixed",
                     "--workdir", "/shared/runs/c4 comb", "--out", str(out), "--",
                     "--config.model.dtype=bfloat16", "--gin_bindings=attention.deepsets = True"]) == 0
  text = out.read_text()
  sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
  assert sbatch == ["#SBATCH --job-name=c4-comb", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                    "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=8", "#SBATCH --time=1-12:00:00",
                    f"#SBATCH --output={logs}/%x-%j.out", "#SBATCH --open-mode=append",
                    "#SBATCH --signal=TERM@120", "#SBATCH --requeue", "#SBATCH --partition=gpu",
                    "#SBATCH --account=lab"]
  assert "{{" not in text and logs.is_dir()  # every field filled; sbatch needs the log directory to exist
  assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
  # Run as sbatch would on the first node; the stand-in srun records its argv and the environment.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  record = tmp_path / "srun.txt"
  (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$PWD" "$TRAINING_LOG" "$@" > {record}\n')
  (bin_dir / "srun").chmod(0o755)
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242")
  proc = subprocess.run(["bash", str(out)], env=env, capture_output=True, text=True, timeout=30)
  assert proc.returncode == 0, proc.stderr
  cwd, log, *argv = record.read_text().splitlines()
  assert cwd == slurm.ROOT and log == f"{logs}/c4-comb-4242.out"
  assert argv == ["--kill-on-bad-exit=1", os.path.join(slurm.ROOT, ".venv", "bin", "python"), "train.py",
                  "--multihost", "--config", "configs/c4.py:attention=combiner_fixed", "--workdir",
                  "/shared/runs/c4 comb", "--noprogress", "--config.model.dtype=bfloat16",
                  "--gin_bindings=attention.deepsets = True"]


def test_stdout_and_refusals(capsys):
  """Flag refusals come before the config is loaded (`--config c` is never read)."""
  assert slurm.main(["--nodes", "1", "--config", "configs/default.py", "--workdir", "runs/x"]) == 0
  text = capsys.readouterr().out
  assert text.startswith("#!/bin/bash\n") and "#SBATCH --gpus-per-node=8" in text
  assert "#SBATCH --partition" not in text and "\n\nset -euo pipefail" not in text
  srun = shlex.split(text.strip().splitlines()[-1])
  assert srun[3:6] == ["train.py", "--multihost", "--config"] and srun[-1] == "--noprogress"
  for argv, flag in ((["--nodes", "0"], "--nodes"), (["--nodes", "1", "--time", "2 days"], "--time"),
                     (["--nodes", "1", "--job_name", "a b"], "--job_name")):
    with pytest.raises(SystemExit) as e:
      slurm.main([*argv, "--config", "c", "--workdir", "w"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"ERROR: {flag} must"), err


BAD = [
    (["--nodes", "0"], "ERROR: --nodes must be >= 1, got 0"),
    (["--gpus_per_node", "x"], "--gpus_per_node: invalid int value"),
    (["--config", "configs/nope.py"], "--config: no config file configs/nope.py"),
    (["--config", "configs/default.py:attention=nope"], "attention.name 'nope' is not an attention"),
    (["--", "--config.model.num_layerz=3"], "--config.model.num_layerz: the config has no field"),
    (["--", "--config.model.num_layers=abc"], "--config.model.num_layers=abc"),
    (["--", "--config.optimizer.lr=-1"], "config.optimizer.lr"),
    (["--", "--gin_bindings=attention.bogus = 1"], "--gin_bindings"),
    (["--out", "{tmp}/no_such_dir/job.sbatch"], "--out {tmp}/no_such_dir/job.sbatch: no such directory"),
    (["--log_dir", "{tmp}/file/logs"], "--log_dir {tmp}/file/logs"),
]


@pytest.mark.parametrize("argv,name", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags_and_configs_are_one_line_and_nothing_is_written(argv, name, tmp_path):
  """The config and its overrides load as train.py loads them, before the script or the log directory is
  written: a mistake shows here, not when the job starts on the cluster."""
  (tmp_path / "file").write_text("not a directory")
  before = sorted(p.name for p in tmp_path.iterdir())
  argv = [a.format(tmp=tmp_path) for a in argv]
  cut = argv.index("--") if "--" in argv else len(argv)
  base = {"--nodes": "2", "--config": "configs/default.py", "--workdir": "/shared/w",
          "--out": str(tmp_path / "job.sbatch"), "--log_dir": str(tmp_path / "logs")}
  flags = argv[:cut]
  for flag, value in base.items():
    if flag not in flags:
      flags += [flag, value]
  proc = subprocess.run([sys.executable, "-m", "scripts.slurm", *flags, *argv[cut:]], cwd=slurm.ROOT,
                        capture_output=True, text=True, timeout=120)
  assert_one_line(proc, name.format(tmp=tmp_path))
  assert proc.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_script_and_the_default_log_directory_are_all_that_is_written(tmp_path, capsys):
  """Without --log_dir the job's log goes to <repo>/workdirs/slurm (the repository as the nodes see it, here
  a --repo of the test's), made with the script since sbatch does not make it; nothing else is written."""
  out = tmp_path / "jobs" / "job.sbatch"
  out.parent.mkdir()
  repo = tmp_path / "nodes" / "repo"
  assert slurm.main(["--nodes", "1", "--config", "configs/default.py:smoke", "--workdir", "/shared/w",
                     "--repo", str(repo), "--out", str(out)]) == 0
  logs = repo / "workdirs" / "slurm"
  assert f"log in {logs}" in capsys.readouterr().out
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
      "jobs", "jobs/job.sbatch", "nodes", "nodes/repo", "nodes/repo/workdirs", "nodes/repo/workdirs/slurm"]
  assert f"#SBATCH --output={logs}/%x-%j.out" in out.read_text().splitlines()


def test_module_runs_as_a_script():
  proc = subprocess.run([sys.executable, "-m", "scripts.slurm", "--help"], cwd=slurm.ROOT,
                        capture_output=True, text=True)
  assert proc.returncode == 0 and "sbatch" in proc.stdout


def test_readme_installs_jax_for_cuda_at_the_pinned_version():
  from scripts import tpu_commands

  with open(os.path.join(slurm.ROOT, "README.md")) as f:
    assert f'"jax[cuda12]=={tpu_commands.pinned("jax")}"' in f.read()
