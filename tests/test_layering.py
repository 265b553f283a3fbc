"""Dependencies point one way, floor by floor:

    runtime, attention_core  <-  op packages (combiner, routing, yoso, attention_baselines)  <-  models  <- 
    training  <- entry points (train.py, eval.py, sample.py) and scripts/

data/ (input pipelines) sits beside models: neither imports the other. configs/ import neither models/ nor
data/. Op packages import each other only where PEERS declares it. No entry point or script imports an entry
point, and no modules import each other in a circle.

Read from the source (no imports), every import statement of a file (inside functions too), so a violation is
reported with the file and line that makes it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OP_PACKAGES = ("combiner", "routing", "yoso", "attention_baselines")
ENTRY_POINTS = ("train", "eval", "sample")  # the root-level .py files run as `python X.py`
# Op package -> the other op packages it may import. Combiner-routed is the Combiner's `routed` plan over
# routing's clusters, registered with routing.
PEERS: dict[str, set[str]] = {pkg: set() for pkg in OP_PACKAGES} | {"routing": {"combiner"}}
BELOW_MODELS = {"attention_core", *OP_PACKAGES}
# Folder (or entry point) -> the top-level names of this repository it may import besides itself.
ALLOWED: dict[str, set[str]] = {
    "runtime": set(),
    "attention_core": set(),
    **{pkg: {"attention_core"} | PEERS[pkg] for pkg in OP_PACKAGES},
    "configs": {"attention_core", "runtime"},
    "data": {"attention_core", "runtime"},
    "models": BELOW_MODELS | {"configs", "runtime"},
    "training": BELOW_MODELS | {"configs", "runtime", "models", "data"},
    "scripts": BELOW_MODELS | {"configs", "runtime", "models", "data", "training"},
    **{name: BELOW_MODELS | {"configs", "runtime", "models", "data", "training"} for name in ENTRY_POINTS},
}
def _files(unit: str) -> list[pathlib.Path]:
  if unit in ENTRY_POINTS:
    return [ROOT / f"{unit}.py"]
  return sorted((ROOT / unit).rglob("*.py"))


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
  """(line, dotted module) for every import in the file, at module level or inside functions and classes;
  `from a import b` gives a.b (a module or a name in a; `_resolve` tells)."""
  tree = ast.parse(path.read_text(), filename=str(path))
  module = _module_name(path, root)
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: resolved against the file's package
        anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      found += [(node.lineno, f"{base}.{alias.name}" if base else alias.name) for alias in node.names]
  return found


def _source_files() -> list[pathlib.Path]:
  return [p for unit in ALLOWED for p in _files(unit)]


MODULES = {_module_name(p) for p in _source_files()}


def _resolve(name: str) -> str | None:
  """The most specific module of this repository that `name` (a module, or a name in one) refers to."""
  parts = name.split(".")
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in MODULES:
      return ".".join(parts[:n])
  return None


def _offences(unit: str) -> list[tuple[str, str]]:
  """("<file> -> <module>", message) for each import of `unit` its floor does not allow."""
  offences = []
  allowed = ALLOWED[unit]
  for path in _files(unit):
    rel = path.relative_to(ROOT)
    for line, name in _imports(path):
      top = name.split(".")[0]
      if top in ALLOWED and top != unit and top not in allowed:
        what = "an entry point" if top in ENTRY_POINTS else f"{top}/"
        offences.append((f"{rel} -> {_resolve(name) or name}",
                         f"{rel}:{line} imports {name} ({what}; {unit} may import {sorted(allowed)})"))
  return offences


def _cycles() -> list[str]:
  """Strongly connected groups of more than one module (Tarjan), over imports to the most specific module."""
  graph: dict[str, set[str]] = {m: set() for m in MODULES}
  for path in _source_files():
    here = _module_name(path)
    for _, name in _imports(path):
      target = _resolve(name)
      if target is not None and target != here:
        graph[here].add(target)
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  groups = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        groups.append("cycle: " + ", ".join(sorted(group)))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return groups


def test_rules_cover_every_source_folder():
  """A new top-level folder or entry point gets a floor here before its imports are trusted."""
  skip = {"tests", "docs", ".venv", ".git", ".ci"}
  folders = {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py")) and p.name not in skip}
  root_files = {p.stem for p in ROOT.glob("*.py")}
  assert folders <= set(ALLOWED), sorted(folders - set(ALLOWED))
  assert root_files <= set(ENTRY_POINTS), sorted(root_files - set(ENTRY_POINTS))


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_imports_point_one_way(unit):
  offences = [message for _, message in _offences(unit)]
  assert not offences, "\n".join(offences)


def test_no_import_cycles():
  cycles = _cycles()
  assert not cycles, "\n".join(cycles)


def test_function_level_imports_are_seen(tmp_path):
  """The walk reaches imports inside functions and methods, and resolves relative ones."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "mod.py").write_text("class A:\n  def f(self):\n    import models.layers\n\n"
                              "def g():\n  from . import other\n  from .sub import name\n")
  found = sorted(name for _, name in _imports(pkg / "mod.py", tmp_path))
  assert found == ["models.layers", "pkg.other", "pkg.sub.name"]
