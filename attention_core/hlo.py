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


# ------------------------------------------------------------------------------------------ device ops
# Instructions that execute no work of their own: parameters, tuples and their elements, constants, bitcasts.
BOOKKEEPING = ("parameter", "tuple", "get-tuple-element", "constant", "bitcast", "opt-barrier")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class DeviceOps:
  """What a compiled program executes (`device_ops`): device operations, of which custom calls (kernels)
  and fusions."""

  ops: int
  custom_calls: int
  fusions: int


def _computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
  """{computation name: its instructions' (name, right-hand side)}, and the entry computation's name."""
  comps: dict[str, list[tuple[str, str]]] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and not _DEFINITION.match(line):
        current = m.group(2)
        comps[current] = []
        entry = current if m.group(1) else entry
      continue
    if line.strip() == "}":
      current = None
      continue
    d = _DEFINITION.match(line)
    if d:
      comps[current].append((d.group("name"), d.group("rest")))
  return comps, entry


def _opcode(rest: str) -> str | None:
  """The opcode of an instruction's right-hand side `<result type> opcode(operands), ...`."""
  after = rest[_tuple_end(rest):].lstrip() if rest.startswith("(") else rest.split(" ", 1)[-1]
  m = re.match(r"([\w\-]+)\(", after)
  return m.group(1) if m else None


def _trip_count(rest: str, comps: dict[str, list[tuple[str, str]]]) -> int:
  """A while loop's iterations: XLA's known trip count, else the bound N of a condition `i < N` on a counter
  from 0 (what jax.lax.fori_loop emits), else 1."""
  trips = _TRIP_COUNT.search(rest)
  if trips:
    return int(trips.group(1))
  cond = re.search(r"condition=%?([\w.\-]+)", rest)
  body = [r for _, r in comps.get(cond.group(1), [])] if cond else []
  bound = [re.search(r"constant\((\d+)\)", r) for r in body]
  bound = [int(b.group(1)) for b in bound if b]
  less = any("compare(" in r and "direction=LT" in r for r in body)
  return bound[0] if less and len(bound) == 1 else 1


def _executed(hlo_text: str) -> list[tuple[str, str, int]]:
  """(opcode, `origin`, times executed) of each device operation a compiled program runs: the entry
  computation's instructions and those of the computations it calls or loops over, bookkeeping left out
  (BOOKKEEPING), an asynchronous start/done pair once (at its start), a loop's body once per iteration (the
  loop itself and its condition not at all), a conditional's costliest branch."""
  comps, entry = _computations(hlo_text)
  memo: dict[str, list[tuple[str, str, int]]] = {}

  def walk(name: str) -> list[tuple[str, str, int]]:
    if name in memo:
      return memo[name]
    found: list[tuple[str, str, int]] = []
    for instruction, rest in comps.get(name, []):
      op = _opcode(rest)
      if op is None or op in BOOKKEEPING or op.endswith("-done"):
        continue
      if op == "while":
        n = _trip_count(rest, comps)
        sub = re.search(r"body=%?([\w.\-]+)", rest)
        found += [(o, r, n * k) for o, r, k in (walk(sub.group(1)) if sub else [])]
      elif op == "conditional":
        names = re.findall(r"branch_computations=\{([^}]*)\}", rest)
        branches = ([b.strip().lstrip("%") for b in names[0].split(",")] if names else
                    re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest))
        found += max((walk(b) for b in branches), key=lambda f: dataclasses.astuple(_totals(f)), default=[])
      elif op == "call":
        sub = re.search(r"to_apply=%?([\w.\-]+)", rest)
        found += walk(sub.group(1)) if sub else []
      else:
        found.append((op, origin(op, instruction, rest), 1))
    memo[name] = found
    return found

  return walk(entry)


def _totals(found: list[tuple[str, str, int]]) -> DeviceOps:
  return DeviceOps(sum(n for _, _, n in found), sum(n for op, _, n in found if op == "custom-call"),
                   sum(n for op, _, n in found if op == "fusion"))


def device_ops(hlo_text: str) -> DeviceOps:
  """Counts the device operations a compiled program (`compiled.as_text()`) executes (`_executed`: loops
  once per iteration, bookkeeping and the done half of async pairs left out). A fusion counts once."""
  return _totals(_executed(hlo_text))


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def origin(op: str, name: str, rest: str) -> str:
  """Where instruction `name` (opcode `op`, right-hand side `rest`) comes from, read from its JAX metadata:
  the primitive (`gather`, `pallas_call`, ...) after the innermost named scope it was traced in (a kernel's
  name), "(backward)" when traced in a transpose. Without metadata: a kernel's own name (XLA names a custom
  call after it), "XLA" for what the compiler added (memory-space copies and slices, layout changes)."""
  m = _OP_NAME.search(rest)
  if m is None:
    return re.sub(r"\.\d+$", "", name) if op == "custom-call" else "XLA"
  path = m.group(1).split(";")[0].split("/")
  scopes = [re.sub(r"\)+$", "", part).rsplit("(", 1)[-1] for part in path[1:-1]]
  scope = next((s for s in reversed(scopes) if s), "")
  label = f"{scope}/{path[-1]}" if scope else path[-1]
  return label + (" (backward)" if "transpose(" in m.group(1) else "")


def device_op_breakdown(hlo_text: str) -> list[tuple[int, str, str]]:
  """The device operations of `device_ops` grouped by (opcode, `origin`): (count, opcode, origin), most
  first. Its counts sum to `device_ops(hlo_text).ops`."""
  groups: dict[tuple[str, str], int] = {}
  for op, where, n in _executed(hlo_text):
    groups[op, where] = groups.get((op, where), 0) + n
  return sorted(((n, op, where) for (op, where), n in groups.items()), key=lambda t: (-t[0], t[1], t[2]))
