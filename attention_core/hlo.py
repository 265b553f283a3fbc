"""Collective communication read from compiled HLO text: which collectives a program runs and how many bytes.

`collectives(compiled.as_text())` lists every all-gather, all-reduce, reduce-scatter, collective-permute and
all-to-all (synchronous or `-start` of an async pair) with its operand bytes and replica-group size.
`bytes_per_device` turns them into the bytes one device receives under the usual bandwidth-optimal algorithms
(ring all-gather / reduce-scatter, reduce-scatter + all-gather for all-reduce):

  all-gather          operand x (g - 1)          (every other member's shard)
  reduce-scatter      operand x (g - 1) / g
  all-reduce          operand x 2 (g - 1) / g
  all-to-all          operand x (g - 1) / g
  collective-permute  operand
"""

from __future__ import annotations

import dataclasses
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}

_SHAPE = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
# `%name = <result type> <kind>[-start](<operands>), attributes...`
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_INSTRUCTION = re.compile(
    r"^(?P<result>.*?)\s(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<args>.*)$")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # one of KINDS
  operand_bytes: int  # all operands together
  group_size: int  # devices per replica group (collective-permute: 1)

  @property
  def received_bytes(self) -> float:
    """Bytes one device receives under the algorithms of the module docstring."""
    g = self.group_size
    if self.kind == "all-gather":
      return self.operand_bytes * (g - 1)
    if self.kind == "all-reduce":
      return self.operand_bytes * 2 * (g - 1) / g
    if self.kind in ("reduce-scatter", "all-to-all"):
      return self.operand_bytes * (g - 1) / g
    return float(self.operand_bytes)  # collective-permute


def shape_bytes(text: str) -> int:
  """Total bytes of every array type (`f32[8,16]`) written in `text`."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * DTYPE_BYTES[dtype]
  return total


def _operands(rest: str) -> str:
  """The text inside the instruction's argument parentheses (the opening one is already consumed)."""
  return rest[:_closing(rest, depth=1)]


def _closing(text: str, depth: int) -> int:
  """Index of the parenthesis that closes `depth` open ones (counting those in `text`), or len(text)."""
  for i, ch in enumerate(text):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return i
  return len(text)


def _group_size(attributes: str) -> int:
  m = _GROUPS_IOTA.search(attributes)
  if m:
    return int(m.group(1).split(",")[-1])
  m = _GROUPS_LIST.search(attributes)
  if m:
    return len([d for d in m.group(1).split(",") if d])
  return 1


def _split_top(text: str) -> list[str]:
  """Splits at commas outside brackets and braces."""
  parts, depth, cur = [], 0, []
  for ch in text:
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  parts.append("".join(cur))
  return [p.strip() for p in parts if p.strip()]


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction of an HLO module's text (`jax.jit(f).lower(...).compile().as_text()`).

  An operand's bytes come from its type where XLA prints it inline, else from the instruction that defines the
  operand's name; the `-done` half of an async pair carries no new data and is skipped.
  """
  types: dict[str, str] = {}
  found = []
  for line in hlo_text.splitlines():
    d = _DEFINITION.match(line)
    if d is None:
      continue
    rest = d.group("rest")
    m = _INSTRUCTION.match(rest)
    types[d.group("name")] = rest[:_tuple_end(rest)] if rest.startswith("(") else rest.split(" ", 1)[0]
    if m is not None:
      found.append(m)
  out = []
  for m in found:
    kind = m.group("kind")
    operands = _operands(m.group("args"))
    attributes = m.group("args")[len(operands):]
    total = 0
    for token in _split_top(operands):
      inline = shape_bytes(token)
      name = token.split()[-1].lstrip("%")
      total += inline if inline else shape_bytes(types.get(name, ""))
    group = 1 if kind == "collective-permute" else _group_size(attributes)
    out.append(Collective(kind, total, group))
  return out


def _tuple_end(text: str) -> int:
  """Length of the parenthesised tuple type that `text` starts with."""
  return min(_closing(text, depth=0) + 1, len(text))


def bytes_per_device(hlo_text: str) -> float:
  """Bytes one device receives over all collectives of the program (see the module docstring)."""
  return sum(c.received_bytes for c in collectives(hlo_text))


def summary(hlo_text: str) -> dict[str, float]:
  """Received bytes per device by collective kind, plus "total"."""
  out: dict[str, float] = {}
  for c in collectives(hlo_text):
    out[c.kind] = out.get(c.kind, 0.0) + c.received_bytes
  out["total"] = sum(out.values())
  return out
