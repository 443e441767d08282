"""HLO inspection for tests and benchmarks: what a compiled program materializes.

Works on the text of an optimized module (`jax.jit(f).lower(...).compile()
.as_text()`); plain python, no jax import.

  parse_hlo            computation name -> its instructions (`HloInstr`)
  buffer_computations  the computations whose instructions own buffers
  full_table_ops       ops that write a table-sized array (copies, converts,
                       full passes), in-place updates and views exempt
  collective_bytes     per collective kind: count and bytes per device

`tests/hlo_test.py` holds the compiled sparse step to `full_table_ops(...) ==
[]`; the benchmark (`bench/bench.py`) reports both per case.
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")


@dataclasses.dataclass
class HloInstr:
  """One instruction of an HLO module's text."""
  name: str
  computation: str
  is_root: bool
  shape: str                       # the result type, e.g. "(f32[4], s32[])"
  opcode: str
  operands: list[str]
  attrs: str                       # everything after the operand list
  line: str

  def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in the result type (tuples flattened)."""
    return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
            for m in _ARRAY_RE.finditer(self.shape)
            if m.group(1) in _DTYPE_BYTES]

  def result_bytes(self) -> int:
    return sum(_DTYPE_BYTES[dt] * math.prod(dims)
               for dt, dims in self.arrays())


def _split_type(rest: str) -> tuple[str, str]:
  """Splits "TYPE opcode(...)..." into the type and the remainder."""
  rest = rest.strip()
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].strip()
  head, _, tail = rest.partition(" ")
  return head, tail.strip()


def _split_operands(rest: str) -> tuple[str, list[str], str]:
  """"opcode(a, b), attrs" -> (opcode, operand names, attrs)."""
  m = re.match(r"([\w\-]+)\((.*)$", rest)
  if not m:
    return rest.split(" ")[0], [], ""
  opcode, body = m.group(1), m.group(2)
  depth, end = 1, len(body)
  for i, ch in enumerate(body):
    depth += ch in "({["
    depth -= ch in ")}]"
    if depth == 0:
      end = i
      break
  names = re.findall(r"%([\w.\-]+)", body[:end])
  return opcode, names, body[end + 1:]


def parse_hlo(text: str) -> dict[str, list[HloInstr]]:
  """Computation name -> its instructions, from `compiled.as_text()`."""
  comps: dict[str, list[HloInstr]] = {}
  current = None
  for line in text.splitlines():
    if current is None:
      m = _COMP_RE.match(line)
      if m and not line.lstrip().startswith("HloModule"):
        current = ("ENTRY:" if m.group(1) else "") + m.group(2)
        comps[current] = []
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTR_RE.match(line)
    if not m:
      continue
    shape, rest = _split_type(m.group(3))
    opcode, operands, attrs = _split_operands(rest)
    comps[current].append(HloInstr(m.group(2), current, bool(m.group(1)),
                                   shape, opcode, operands, attrs, line))
  return comps


def _called(attrs: str, key: str) -> list[str]:
  m = re.search(key + r"=\{?([%\w.\-, ]+)\}?", attrs)
  if not m:
    return []
  return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]


def buffer_computations(comps: dict[str, list[HloInstr]]) -> set[str]:
  """Computations whose instructions produce real buffers.

  The entry computation, while bodies/conditions, conditional branches,
  `call`ed and async-wrapped computations. Not: fused computations (their
  instructions are evaluated element by element inside one loop; only the
  fusion's output is a buffer) and the scalar combiners of reduce / scatter
  / sort / all-reduce.
  """
  entry = [c for c in comps if c.startswith("ENTRY:")]
  keep, todo = set(entry), list(entry)
  by_plain = {c.split(":", 1)[-1]: c for c in comps}
  while todo:
    comp = todo.pop()
    for ins in comps[comp]:
      found = []
      if ins.opcode == "while":
        found += _called(ins.attrs, "body") + _called(ins.attrs, "condition")
      elif ins.opcode == "conditional":
        found += (_called(ins.attrs, "branch_computations") +
                  _called(ins.attrs, "true_computation") +
                  _called(ins.attrs, "false_computation"))
      elif ins.opcode == "call":
        found += _called(ins.attrs, "to_apply")
      elif ins.opcode.endswith("-start") or ins.opcode == "async-start":
        found += _called(ins.attrs, "calls")
      for name in found:
        full = by_plain.get(name)
        if full and full not in keep:
          keep.add(full)
          todo.append(full)
  return keep


@dataclasses.dataclass(frozen=True)
class TableSize:
  """What counts as table-sized: a leading dimension of `rows` (the table,
  its row state, a dense gradient), or at least `min_elements` elements
  (flat views of the shard)."""
  rows: int
  min_elements: int

  def matches(self, dims: tuple[int, ...]) -> bool:
    return bool(dims) and (dims[0] == self.rows or
                           math.prod(dims) >= self.min_elements)


# Ops that produce a table-sized result without touching its elements.
_VIEW_OPS = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "while",
    "conditional", "call", "optimization-barrier", "add-dependency",
    "after-all", "async-done", "copy-done"})
_INPLACE_OPS = frozenset({"scatter", "dynamic-update-slice"})


def _strip_bitcasts(instr: HloInstr, by_name: dict[str, HloInstr]) -> HloInstr:
  while instr.opcode == "bitcast" and instr.operands:
    instr = by_name.get(instr.operands[0], instr)
    if instr.opcode != "bitcast":
      break
  return instr


def _inplace_fusion(fusion: HloInstr, comps, by_comp_name,
                    size: TableSize) -> bool:
  """Whether a fusion is an in-place scatter / dynamic-update-slice.

  Its fused root (through bitcasts; each element of a tuple root) must be a
  scatter or dynamic-update-slice whose updated operand is (through bitcasts)
  a parameter of the fusion of the same type: no convert, copy or
  arithmetic on the table-sized operand inside the fusion.
  """
  called = _called(fusion.attrs, "calls")
  if not called or called[0] not in by_comp_name:
    return False
  body = comps[by_comp_name[called[0]]]
  by_name = {i.name: i for i in body}
  root = next((i for i in body if i.is_root), None)
  if root is None:
    return False
  roots = ([by_name[n] for n in root.operands if n in by_name]
           if root.opcode == "tuple" else [root])
  for r in roots:
    r = _strip_bitcasts(r, by_name)
    if r.opcode not in _INPLACE_OPS:
      if _big(r, size):
        return False
      continue
    target = _strip_bitcasts(by_name.get(r.operands[0], r), by_name)
    if target.opcode != "parameter":
      return False
    if [a[0] for a in target.arrays()] != [a[0] for a in r.arrays()]:
      return False
  return True


def _big(instr: HloInstr, size: TableSize) -> bool:
  return any(size.matches(dims) for _, dims in instr.arrays())


def full_table_ops(hlo_text: str, rows: int,
                   min_elements: int | None = None) -> list[HloInstr]:
  """Ops that materialize a table-sized array: copies, converts, full passes.

  An op counts if it sits in a buffer-producing computation (see
  `buffer_computations`; ops inside fused computations are elemental and
  only the fusion's output is a buffer) and its result holds a table-sized
  array: leading dimension `rows` (the table's row count: the table, its
  shard, the row state, a dense gradient), or at least `min_elements`
  elements (default `rows`; pass the shard's element count when per-batch
  arrays can have more than `rows` elements). Exempt: views and control flow
  (`_VIEW_OPS`: parameter, get-tuple-element, tuple, bitcast, while, ...),
  the in-place `scatter` / `dynamic-update-slice` (bare, or as the root of
  a fusion whose updated operand is a fusion parameter of the same dtype),
  and custom calls that alias an output to an operand (in-place Pallas
  kernels). Everything else -- `copy`, `convert`, `bitcast-convert`, a loop
  fusion writing the whole table, a collective on the whole table -- is
  returned.
  """
  size = TableSize(rows, rows if min_elements is None else min_elements)
  comps = parse_hlo(hlo_text)
  by_comp_name = {c.split(":", 1)[-1]: c for c in comps}
  bad = []
  for comp in buffer_computations(comps):
    for ins in comps[comp]:
      if not _big(ins, size) or ins.opcode in _VIEW_OPS:
        continue
      if ins.opcode in _INPLACE_OPS:
        continue
      if ins.opcode == "custom-call" and "output_to_operand_aliasing" in \
          ins.attrs:
        continue
      if ins.opcode == "fusion" and _inplace_fusion(ins, comps, by_comp_name,
                                                    size):
        continue
      bad.append(ins)
  return bad


_COLLECTIVES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "all-to-all": "all-to-all", "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce", "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}


def collective_bytes(hlo_text: str, group_size: int) -> dict[str, dict]:
  """Per collective kind: count, operand and result bytes per device, and
  the bytes each device sends over the wire (ring/pairwise estimate:
  all-gather result*(W-1)/W, all-to-all operand*(W-1)/W, all-reduce
  2*operand*(W-1)/W, reduce-scatter operand*(W-1)/W)."""
  comps = parse_hlo(hlo_text)
  by_name = {i.name: i for c in comps.values() for i in c}
  out: dict[str, dict] = {}
  w = max(group_size, 1)
  for comp in buffer_computations(comps):
    for ins in comps[comp]:
      kind = _COLLECTIVES.get(ins.opcode)
      if kind is None:
        continue
      operand = sum(by_name[n].result_bytes() for n in ins.operands
                    if n in by_name)
      result = ins.result_bytes()
      if ins.opcode.endswith("-start"):
        # Async starts return (operand, result[, scratch]) tuples.
        result = max(result - operand, 0) or operand
      wire = {"all-gather": result * (w - 1) / w,
              "all-to-all": operand * (w - 1) / w,
              "all-reduce": 2 * operand * (w - 1) / w,
              "reduce-scatter": operand * (w - 1) / w,
              "collective-permute": operand}[kind]
      entry = out.setdefault(kind, {"count": 0, "operand_bytes": 0,
                                    "result_bytes": 0, "wire_bytes": 0.0})
      entry["count"] += 1
      entry["operand_bytes"] += operand
      entry["result_bytes"] += result
      entry["wire_bytes"] += wire
  return out
