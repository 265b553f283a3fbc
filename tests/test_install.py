"""The attention ops install as a library: `pip install .` into a fresh virtual environment, then README's
snippet runs as pasted from a directory outside the checkout (so only the installed packages are
importable)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_snippet() -> str:
  """The first Python block of README's "Attention ops" section."""
  text = (ROOT / "README.md").read_text()
  return re.search(r"## Attention ops.*?```python\n(.*?)```", text, re.S).group(1)


def test_installed_packages_are_the_op_packages_and_what_they_import():
  """pyproject's package list is closed under imports: every project module an installed package imports is
  installed too (read from the source; the install test below proves it by running)."""
  packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
  local = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} | {"train", "eval", "sample"}
  for package in packages:
    for path in (ROOT / package).rglob("*.py"):
      for name in re.findall(r"^\s*(?:from|import) ([a-z_]+)", path.read_text(), re.M):
        if name in local:
          assert name in packages, f"{path.relative_to(ROOT)} imports {name}, which is not installed"


@pytest.mark.slow
def test_readme_snippet_runs_as_pasted_on_simulated_devices(tmp_path):
  """The snippet from this checkout (no install), in a fresh process that simulates its own 8 CPU devices:
  the sharded call returns q's sharding and the one-device result."""
  (tmp_path / "snippet.py").write_text(readme_snippet())
  run = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.splitlines()[1] == "P('rows', None, 'cols', None) True", run.stdout


@pytest.mark.slow
def test_pip_install_then_readme_snippet(tmp_path):
  source = tmp_path / "source"
  source.mkdir()
  packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, source / name)
  for package in packages:
    shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(source)],
                       capture_output=True, text=True)
  assert pip.returncode == 0, pip.stderr[-3000:]
  elsewhere = tmp_path / "project"
  elsewhere.mkdir()
  (elsewhere / "snippet.py").write_text(readme_snippet())
  run = subprocess.run([str(venv / "bin" / "python"), "snippet.py"], cwd=elsewhere, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.startswith("(2, 1024, 4, 64) (2, 1024, 4, 64)"), run.stdout
  assert "P('rows', None, 'cols', None) True" in run.stdout, run.stdout  # the sharded call
