"""scripts/slurm.py: the sbatch script for multi-node GPU training, rendered and run as sbatch would run it
on a node, with a stand-in `srun` on PATH that records what it was asked to start."""

import os
import shlex
import subprocess
import sys

import pytest

from scripts import slurm


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
    assert str(e.value).startswith(f"error: {flag} must")


def test_module_runs_as_a_script():
  proc = subprocess.run([sys.executable, "-m", "scripts.slurm", "--help"], cwd=slurm.ROOT,
                        capture_output=True, text=True)
  assert proc.returncode == 0 and "sbatch" in proc.stdout


def test_readme_installs_jax_for_cuda_at_the_pinned_version():
  from scripts import tpu_commands

  with open(os.path.join(slurm.ROOT, "README.md")) as f:
    assert f'"jax[cuda12]=={tpu_commands.pinned("jax")}"' in f.read()
