"""Dependencies point one way: core <- op packages <- models <- entry points.

Read from the source (no imports), so a violation is reported with the file and line that makes it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OP_PACKAGES = ("combiner", "routing", "yoso", "baselines")
# package -> top-level packages of this repository it must not import
FORBIDDEN = {
    "core": {"combiner", "routing", "yoso", "baselines", "models", "data", "configs", "scripts", "train",
             "eval", "runtime"},
    **{pkg: {"models", "data", "configs", "scripts", "train", "eval", "runtime"} for pkg in OP_PACKAGES},
    # the entry points' path layer and process setup: shared by train, eval and data, importing none of them
    "runtime": {"core", "combiner", "routing", "yoso", "baselines", "models", "data", "configs", "scripts",
                "train", "eval"},
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  tree = ast.parse(path.read_text(), filename=str(path))
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found.append((node.lineno, node.module))
  return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_one_way(package):
  offences = []
  for path in sorted((ROOT / package).rglob("*.py")):
    for line, module in _imports(path):
      if module.split(".")[0] in FORBIDDEN[package]:
        offences.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
  assert not offences, "\n".join(offences)
