"""libtpu only where it is used: a process loads the TPU compiler only when it imports scripts/compile_tpu.py,
which puts libtpu (installed apart from the environment's packages, README) on its path and sets libtpu's
environment for compiling only.

- Every test and script that compiles for TPUs with libtpu says so that one way, `from scripts import
  compile_tpu` (or `import scripts.compile_tpu`), before it first asks for libtpu (`importorskip("libtpu")`).
  Read from the source, so a new file that forgets it is named here.
- A plain JAX start prints nothing but its devices: no libtpu initialisation errors.
- LSA_TPU_COMPILER names another directory for libtpu.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
USES_LIBTPU = re.compile(r"get_topology_desc\(|import topologies\b|importorskip\(\s*[\"']libtpu|"
                         r"^\s*import libtpu\b|compile_tpu\.devices\(", re.M)
OPTS_IN = re.compile(r"^\s*(from scripts import compile_tpu\b|import scripts\.compile_tpu\b|"
                     r"from scripts\.compile_tpu import)", re.M)
ASKS = re.compile(r"importorskip\(\s*[\"']libtpu|^\s*import libtpu\b", re.M)


def _python_files() -> list[pathlib.Path]:
  skip = {ROOT / "scripts" / "compile_tpu.py", pathlib.Path(__file__).resolve()}
  hidden = lambda p: any(part.startswith(".") for part in p.relative_to(ROOT).parts)  # noqa: E731
  return sorted(p for p in ROOT.rglob("*.py") if not hidden(p) and p not in skip)


def test_every_user_of_libtpu_opts_in_before_asking_for_it():
  users, wrong = [], []
  for path in _python_files():
    text = path.read_text()
    if not USES_LIBTPU.search(text):
      continue
    users.append(path.relative_to(ROOT))
    opt_in, asks = OPTS_IN.search(text), ASKS.search(text)
    if opt_in is None or (asks is not None and asks.start() < opt_in.start()):
      wrong.append(str(path.relative_to(ROOT)))
  assert len(users) >= 5  # the compile tests and scripts this reads are still found
  assert not wrong, ("these files use libtpu without `from scripts import compile_tpu` before they ask for "
                     f"it (scripts/compile_tpu.py says why): {wrong}")


def _env() -> dict[str, str]:
  """This environment without the test session's JAX and libtpu settings: a plain start."""
  drop = ("JAX_", "XLA_", "TPU_", "ALLOW_MULTIPLE_LIBTPU_LOAD", "LSA_TPU_COMPILER")
  return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def test_a_plain_jax_start_prints_nothing_from_libtpu(tmp_path):
  code = "import importlib.util as u; s = u.find_spec('libtpu'); print(s and s.origin)"
  found = subprocess.run([sys.executable, "-c", code],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
  if found != "None":
    pytest.skip(f"libtpu is installed among this environment's packages ({found}): JAX finds it at every "
                "start; install it apart as the README says")
  proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices())"], env=_env(), cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
  assert re.fullmatch(r"\[\w+\(id=0\).*\]\n", proc.stdout), proc.stdout


def test_the_opt_in_puts_the_named_directory_on_the_path(tmp_path):
  (tmp_path / "libtpu").mkdir()
  (tmp_path / "libtpu" / "__init__.py").write_text("")
  code = ("import sys; import scripts.compile_tpu; import libtpu, os; "
          "print(sys.path[-1]); print(os.environ['ALLOW_MULTIPLE_LIBTPU_LOAD'], os.environ['JAX_PLATFORMS'])")
  proc = subprocess.run([sys.executable, "-c", code], env={**_env(), "LSA_TPU_COMPILER": str(tmp_path)},
                        cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == [str(tmp_path), "1 cpu"]
