"""Bad command lines over every entry point, as real subprocesses: exit code 2, exactly one `ERROR:` line on
stderr naming the flag or config field, no traceback (runtime/cli.py); LSA_DEBUG=1 shows the traceback.

The fast cases fail before jax is imported (well under a second each); the sweep of config values, which
needs the attention registry (and so jax), is marked slow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = "configs/default.py:smoke"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """A workdir-looking directory (config.json), a plain file, a fake gcloud that logs its calls."""
  base = tmp_path_factory.mktemp("usage")
  (base / "w").mkdir()
  (base / "w" / "config.json").write_text("{}")
  (base / "file").write_text("not a directory")
  (base / "bin").mkdir()
  gcloud = base / "bin" / "gcloud"
  gcloud.write_text(f"#!/bin/sh\necho \"$@\" >> {base / 'gcloud.log'}\nexit 1\n")
  gcloud.chmod(0o755)
  return base


def run(argv: list[str], dirs, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  argv = [a.format(w=dirs / "w", file=dirs / "file", missing=dirs / "missing") for a in argv]
  extra = env or {}
  env = dict(os.environ, PATH=f"{dirs / 'bin'}{os.pathsep}{os.environ['PATH']}")
  env.pop("LSA_DEBUG", None)
  env.update(extra)
  return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, text=True, capture_output=True,
                        timeout=300)


def assert_one_line(proc: subprocess.CompletedProcess, name: str) -> None:
  lines = proc.stderr.splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("ERROR: ") and name in lines[0], lines[0]
  assert "Traceback" not in proc.stderr


TPU = ["-m", "scripts.tpu", "run", "--zone", "us-central2-b", "--accelerator", "v4-8", "--config", "c",
       "--workdir", "gs://b/w", "--dry_run"]

# (argv, the name the line must contain); none of these imports jax.
FAST = [
    (["eval.py", "--workdir", "{w}", "--max_batches=-5"], "--max_batches"),
    (["eval.py", "--workdir", "{missing}"], "--workdir"),
    (["eval.py", "--workdir", "{file}"], "--workdir"),
    (["eval.py", "--workdir", "{w}", "--step=x"], "--step"),
    (["sample.py", "--workdir", "{w}", "--temperature=-1"], "--temperature"),
    (["sample.py", "--workdir", "{w}", "--top_p=2"], "--top_p"),
    (["sample.py", "--workdir", "{w}", "--num_samples=-1"], "--num_samples"),
    (["sample.py", "--workdir", "{w}", "--top_k=-3"], "--top_k"),
    (["sample.py", "--workdir", "{w}", "--bogus_flag"], "bogus_flag"),
    ([*TPU, "--name", "--project=evil-proj"], "--name"),
    ([*TPU, "--name", "../../root/.ssh/x"], "--name"),
    ([*TPU, "--name", "Upper"], "--name"),
    ([*TPU, "--name", "a" * 64], "--name"),
    ([*TPU, "--name", "trailing-"], "--name"),
    ([*TPU, "--name", "n", "--ref=--output=/tmp/x"], "--ref"),
    ([*TPU, "--name", "n", "--zone=--project=evil"], "--zone"),
    ([*TPU, "--name", "n", "--poll_s=-5"], "--poll_s"),
    ([*TPU, "--name", "n", "--max_restarts=-1"], "--max_restarts"),
    ([*TPU, "--name", "n", "--accelerator", "tpu8"], "--accelerator"),
    (["-m", "scripts.reproduce", "--table", "nope"], "--table"),
    (["-m", "scripts.reproduce", "--table", "all", "--seeds", "0"], "--seeds"),
    (["-m", "scripts.benchmark", "--heads=0"], "--heads"),
    (["-m", "scripts.benchmark", "--time_budget_s=-1"], "--time_budget_s"),
    (["train.py", "--config", "configs/nope.py"], "--config"),
    # workdirs the OS refuses: under a file, a name too long for the filesystem
    (["train.py", "--config", SMOKE, "--workdir", "{file}/run"], "--workdir"),
    (["train.py", "--config", SMOKE, "--workdir", "{w}/" + "x" * 300 + "/run"], "--workdir"),
    (["train.py", "--config", f"{SMOKE},layrs=2"], "layrs"),
    (["train.py", "--config", f"{SMOKE},layers=x"], "layers"),
    # a ValueError of the config file's own get_config, with its message
    (["train.py", "--config", "configs/lra.py:cpu_budget"], "cpu_budget is a budget of listops_1024 alone"),
]

# Config values and faults found once the config is built (the attention registry imports jax): ~5 s each.
SLOW = [
    (["train.py", "--config", f"{SMOKE},attention=bogus"], "config.model.attention.name"),
    (["train.py", "--config", f"{SMOKE},features=0"], "config.model.features"),
    (["train.py", "--config", f"{SMOKE},heads=0"], "config.model.num_heads"),
    (["train.py", "--config", f"{SMOKE},mlp_dim=-1"], "config.model.mlp_dim"),
    (["train.py", "--config", f"{SMOKE},block_size=0"], "config.model.attention.params.block_size"),
    (["train.py", "--config", f"{SMOKE},lr=-1"], "config.optimizer.lr"),
    (["train.py", "--config", SMOKE, "--config.optimizer.lr=-1"], "config.optimizer.lr"),
    (["train.py", "--config", SMOKE, "--config.model.dropout_rate=1.5"], "config.model.dropout_rate"),
    (["train.py", "--config", SMOKE, "--config.train.num_stepz=3"], "--config.train.num_stepz"),
    (["train.py", "--config", SMOKE, "--workdir", "{file}"], "--workdir"),
    (["train.py", "--config", SMOKE, "--gin_bindings", "attention.bogus = 1"], "--gin_bindings"),
    (["train.py", "--config", SMOKE, "--gin_bindings", "attention.deepsets = ("], "--gin_bindings"),
    (["train.py", "--config", SMOKE, "--gin_file", "{missing}.gin"], "--gin_file"),
    (["train.py", "--config", SMOKE, "--heartbeat_s=0"], "--heartbeat_s"),
    (["-m", "scripts.compile_tpu", "--config", f"{SMOKE},heads=0", "--topology", "v5e-1"],
     "config.model.num_heads"),
    (["train.py", "--config", "configs/lra.py:task=listops,smoke", "--config.data.stand_in=False",
      "--config.data.data_dir={missing}", "--workdir", "{w}2"], "prepare it with"),
]


# Values only the model or the attention op can judge (the op's choices, its direction, the mesh against the
# devices): refused at the start, before a step is traced, and the new workdir is left as it was (absent).
AT_START = [
    ([f"{SMOKE},pooling=foo"], "argument 'pooling' must be one of"),
    ([f"{SMOKE},attention=combiner_mixture", "--config.model.attention.params.normalize=foo"], "'normalize'"),
    ([f"{SMOKE},attention=linformer"], "config.model.attention.name: attention 'linformer' does not support"),
    ([SMOKE, "--config.model.attention.implementation=bogus"], "'implementation' must be one of"),
    ([SMOKE, "--config.mesh.data=3"], "config.mesh"),
]


@pytest.mark.slow
@pytest.mark.parametrize("config,name", AT_START, ids=[" ".join(c) for c, _ in AT_START])
def test_values_the_model_refuses_stop_the_start_and_leave_no_workdir(config, name, dirs, tmp_path):
  workdir = tmp_path / "run"
  assert_one_line(run(["train.py", "--config", *config, "--workdir", str(workdir)], dirs), name)
  assert not workdir.exists()


def test_a_damaged_config_json_is_one_line(dirs, tmp_path):
  (tmp_path / "config.json").write_text('{"truncated": ')
  assert_one_line(run(["eval.py", "--workdir", str(tmp_path)], dirs), "config.json is not valid JSON")


@pytest.mark.parametrize("argv,name", FAST, ids=[" ".join(a[-2:]) for a, _ in FAST])
def test_bad_command_lines_are_one_line_and_exit_2(argv, name, dirs):
  assert_one_line(run(argv, dirs), name)


@pytest.mark.parametrize("argv,name", [
    (["train.py", "--config", f"{SMOKE},layers=-1"], "config.model.num_layers")])
def test_a_bad_config_value_is_refused_before_training(argv, name, dirs):
  """`layers=-1` trained with exit 0 before; now refused before any model is built or anything written."""
  assert_one_line(run(argv, dirs), name)


@pytest.mark.slow
@pytest.mark.parametrize("argv,name", SLOW, ids=[" ".join(a[-2:]) for a, _ in SLOW])
def test_bad_config_values_are_one_line_and_exit_2(argv, name, dirs):
  assert_one_line(run(argv, dirs), name)


def test_the_launcher_refuses_before_calling_gcloud(dirs):
  """An injected --name never reaches the fake gcloud on PATH (no dry run)."""
  log = dirs / "gcloud.log"
  proc = run(["-m", "scripts.tpu", "delete", "--zone", "z", "--name", "--project=evil-proj"], dirs)
  assert_one_line(proc, "--name")
  assert not log.exists() or "evil" not in log.read_text()


def test_debug_shows_the_traceback(dirs):
  for env, extra in (({"LSA_DEBUG": "1"}, []), (None, ["--debug"])):
    proc = run(["sample.py", "--workdir", "{w}", "--top_p=2", *extra], dirs, env)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "--top_p must be in (0, 1]" in proc.stderr


def test_help_lists_every_flag_of_the_entry_point_and_exits_0(dirs):
  """absl lists only the main module's flags and exits 1: --config, --debug and the processes' flags are
  defined elsewhere."""
  for script, flag in (("train.py", "--config:"), ("eval.py", "--workdir:"), ("sample.py", "--workdir:")):
    proc = run([script, "--help"], dirs)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert flag in proc.stdout and "--[no]debug:" in proc.stdout, proc.stdout[-3000:]
