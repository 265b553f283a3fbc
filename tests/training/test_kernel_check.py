"""The fused-kernel check before training (training/kernel_check.py): a kernel failure injected as a Mosaic or
Triton compile error would raise (KERNEL_CHECK_INJECT) trains on the XLA path under "auto", saying so in the
log and the workdir, and resumes the same way; a kernel named explicitly stops train.py with one line."""

import json
import os
import subprocess
import sys

import jax
import pytest

from tests.training.localhost import xla_flags
from tests.training.smoke import smoke
from training import config_io, evaluate, kernel_check, loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INJECTED = "Mosaic failed to compile the flash kernel (injected)"


def _train(workdir, *flags):
  cmd = [sys.executable, "-u", "train.py", "--config", "configs/default.py:smoke", "--workdir", str(workdir),
         "--noprogress", *flags]
  env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu", **{kernel_check.INJECT_ENV: INJECTED})
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _record(workdir):
  return json.loads((workdir / "status" / "kernel_check.json").read_text())


def test_where_auto_means_xla_nothing_runs(tmp_path, monkeypatch):
  monkeypatch.delenv(kernel_check.INJECT_ENV, raising=False)
  for name in ("combiner_fixed", "dense", "yoso", "local", "performer"):
    config = smoke(name)
    assert kernel_check.checked_config(config, str(tmp_path)) is config  # CPU: "auto" is the XLA path
  assert not (tmp_path / "status").exists()
  names = ("combiner_fixed", "dense", "yoso", "local")
  choices = {name: kernel_check.kernel_choice(smoke(name)) for name in names}
  assert [(c.field, c.requested, c.xla) for c in choices.values()] == [
      ("implementation", "auto", "xla"), ("implementation", "auto", "xla"),
      ("params.formulation", "auto", "sorted"), ("implementation", "auto", "xla")]
  assert kernel_check.kernel_choice(smoke("performer")) is None  # no fused path
  assert kernel_check.kernel_choice(kernel_check.with_choice(smoke(), "implementation", "xla")) is None
  fallback = kernel_check.with_choice(smoke("yoso"), "params.formulation", "sorted")
  assert fallback.model.attention.params.formulation == "sorted"


@pytest.mark.slow
def test_injected_failure_under_auto_trains_on_xla_and_resumes(tmp_path, monkeypatch, capsys):
  workdir = tmp_path / "run"
  monkeypatch.setenv(kernel_check.INJECT_ENV, INJECTED)
  config = smoke("combiner_fixed", **{"train.num_steps": 2, "train.eval_batches": 1})
  with loop.testing_hooks(devices=jax.devices()[:1]):
    result = loop.train_and_evaluate(config, str(workdir), progress=False)
  assert result["step"] == 2 and result["experiment"].config.model.attention.implementation == "xla"
  err = capsys.readouterr().err.splitlines()
  warning = [line for line in err if line.startswith("WARNING: kernel check")]
  assert len(warning) == 1 and warning[0].startswith(
      "WARNING: kernel check: combiner_fixed implementation=auto on cpu failed at [8, 64, 2, 16] float32: "
      f"InjectedKernelFailure: {INJECTED}; the model runs on the XLA path "
      f"(model.attention.implementation=xla), recorded in {workdir}/status/kernel_check.json")
  record = _record(workdir)
  assert (record["requested"], record["used"], record["ok"]) == ("auto", "xla", False)
  assert record["reason"] == f"InjectedKernelFailure: {INJECTED}"
  assert json.loads((workdir / "status" / "finished.json").read_text())["step"] == 2
  # config.json keeps the config as given: a resume passes the workdir's checks, restores the checkpoint
  # and falls back again.
  saved = config_io.load_config(str(workdir))
  assert saved.model.attention.implementation == "auto"
  with loop.testing_hooks(devices=jax.devices()[:1]):
    again = loop.train_and_evaluate(saved, str(workdir), progress=False)
  assert again["start_step"] == 2 and again["experiment"].config.model.attention.implementation == "xla"
  assert again["metrics"]["loss"] == pytest.approx(result["metrics"]["loss"], rel=1e-6)
  assert _record(workdir)["used"] == "xla" and _record(workdir)["time"] > record["time"]
  # eval.py (and sample.py) restore through the same check, and record nothing.
  last = _record(workdir)
  metrics = evaluate.evaluate_workdir(str(workdir), devices=jax.devices()[:1])
  assert metrics["loss"] == pytest.approx(result["metrics"]["loss"], rel=1e-6) and _record(workdir) == last


@pytest.mark.slow
def test_injected_failure_of_a_named_kernel_stops_with_one_line(tmp_path):
  workdir = tmp_path / "run"
  proc = _train(workdir, "--config.model.attention.implementation=pallas")
  assert proc.returncode == 1, proc.stdout + proc.stderr
  err = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr and len([line for line in err if line.startswith("ERROR")]) == 1
  assert err[-1].startswith("ERROR: kernel check: combiner_fixed implementation=pallas on cpu failed at "
                            "[8, 64, 2, 16] float32: InjectedKernelFailure: " + INJECTED)
  assert "not started (--config.model.attention.implementation=auto falls back" in err[-1]
  # A new run that fails to start leaves the workdir as it found it (here: absent), records included; the
  # reason is the one line above (a watcher reads it in the log).
  assert not workdir.exists()


def test_a_kernel_that_differs_only_at_padded_query_rows_passes(monkeypatch):
  """The causal routed plan's kernels leave padded query rows to themselves (don't-care under the op
  contract), where its XLA path attends them: the check compares real rows, gives padded ones no cotangent
  and requires them finite."""
  monkeypatch.delenv(kernel_check.INJECT_ENV, raising=False)
  config = kernel_check.with_choice(smoke("combiner_routed"), "implementation", "pallas")
  result = kernel_check.check(config, kernel_check.kernel_choice(config), "cpu")
  assert result["ok"], result
  assert max(result["errors"].values()) < 1e-5, result
