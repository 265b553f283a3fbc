"""Device operations a compiled TPU program executes, read from `compiled.as_text()`, for the kernels' bounds.

Counted: every instruction of the entry computation but bookkeeping (parameter, tuple, get-tuple-element,
constant, bitcast) and the `-done` half of an asynchronous pair; a `call` counts its callee's; a `while`
counts once plus its condition and body once per iteration (XLA's known trip count, else the constant N of a
condition `i < N`); a `conditional` once plus its costliest branch. Each is at least one trip to HBM on a TPU.
"""

from __future__ import annotations

import re
from typing import NamedTuple

BOOKKEEPING = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")


class Count(NamedTuple):
  ops: int
  custom_calls: int
  fusions: int

  def __add__(self, other):
    return Count(*(a + b for a, b in zip(self, other, strict=True)))

  def times(self, n: int) -> Count:
    return Count(*(a * n for a in self))


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """{name: [instruction text]} and the entry computation's name."""
  comps: dict[str, list[str]] = {}
  entry, current = "", None
  for raw in text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", raw)
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = m.group(1)
        comps[current] = []
        entry = current if line.startswith("ENTRY") else entry
    elif line.strip() == "}":
      current = None
    else:
      m = _LINE.match(line)
      if m:
        comps[current].append(m.group(2))
  return comps, entry


def _opcode(rest: str) -> str | None:
  """The opcode after the result type (which may be a tuple type with spaces and parentheses)."""
  depth, start = 0, 0
  if rest.startswith("("):
    for i, ch in enumerate(rest):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        start = i + 1
        break
  m = _OPCODE.search(rest, start - 1 if start else 0)
  return m.group(1) if m else None


def _trip_count(comps: dict[str, list[str]], rest: str, condition: str) -> int:
  """XLA's known trip count of a while, else N of its condition `i < N` (its one int constant), else 1."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
  if m:
    return int(m.group(1))
  bound = re.findall(r"s32\[\]\S*\s+constant\((-?\d+)\)", "\n".join(comps[condition]))
  return int(bound[0]) if len(bound) == 1 else 1


def count(text: str) -> Count:
  """Device ops, custom calls and fusions the program runs (module docstring)."""
  comps, entry = _computations(text)
  memo: dict[str, Count] = {}

  def of(name: str) -> Count:
    if name in memo:
      return memo[name]
    total = Count(0, 0, 0)
    for rest in comps[name]:
      op = _opcode(rest)
      if op is None or op in BOOKKEEPING or op.endswith("-done"):
        continue
      if op == "call":
        total += of(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1))
        continue
      if op == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
        condition = re.search(r"condition=%?([\w.\-]+)", rest).group(1)
        total += Count(1, 0, 0) + (of(body) + of(condition)).times(_trip_count(comps, rest, condition))
        continue
      if op == "conditional":
        m = re.search(r"branch_computations=\{([^}]*)\}", rest)
        branches = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else
                    re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest))
        total += Count(1, 0, 0) + max((of(b) for b in branches), key=lambda c: c.ops)
        continue
      total += Count(1, int(op == "custom-call"), int(op == "fusion"))
    memo[name] = total
    return total

  return of(entry)
