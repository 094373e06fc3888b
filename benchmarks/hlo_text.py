"""Reading an optimized HLO module's text (``compiled.as_text()``): its
instructions, and the bytes its entry computation's instructions read and
write. Shared by ``benchmarks/gpu_step_kernels.py`` and
``benchmarks/tpu_compile.py``."""

from __future__ import annotations

import math
import re
from typing import Iterator, NamedTuple

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([0-9,]*)\]")
# Instructions that move no data of their own.
_FREE = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant",
                   "after-all", "partition-id", "replica-id"})


class Instruction(NamedTuple):
  """One instruction line ``%name = SHAPE opcode(operands...)``."""
  in_entry: bool
  name: str
  shape: str
  opcode: str
  operands: tuple


def instructions(hlo: str) -> Iterator[Instruction]:
  """Every instruction of the module, in order, with whether it belongs to
  the entry computation."""
  in_entry = False
  for line in hlo.splitlines():
    if line and not line[0].isspace():
      in_entry = line.startswith("ENTRY")
      continue
    match = re.match(r"\s*(?:ROOT )?(%\S+) = (.*)", line)
    if not match:
      continue
    name, rest = match.groups()
    depth, end = 0, 0
    for end, char in enumerate(rest):  # a tuple shape holds spaces: skip to its end
      depth += {"(": 1, ")": -1}.get(char, 0) if rest[0] == "(" else 0
      if depth == 0 and char == " ":
        break
    opcode = re.match(r"\s*([a-z-]+)\(([^)]*)\)", rest[end:])
    if opcode:
      operands = tuple(re.sub(r"/\*.*?\*/", "", o).strip()
                       for o in opcode.group(2).split(",") if o.strip())
      yield Instruction(in_entry, name, rest[:end], opcode.group(1), operands)


def shape_bytes(shape: str) -> int:
  """Bytes of the arrays an HLO shape names (a tuple's elements summed)."""
  return sum(_ITEM_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in _ARRAY.findall(shape))


def entry_bytes(hlo: str) -> int:
  """Bytes the entry computation's instructions read and write: each one's
  operands and result, for every instruction but parameters, tuples,
  bitcasts and constants. A kernel (fusion, custom call, copy, ...) reads its
  operands from memory and writes its result, so on a GPU this is the
  traffic of the step; a while loop's body is not counted (its operands and
  result once)."""
  shapes, total = {}, 0
  for inst in instructions(hlo):
    if not inst.in_entry:
      continue
    shapes[inst.name] = inst.shape
    if inst.opcode not in _FREE:
      total += shape_bytes(inst.shape) + sum(shape_bytes(shapes.get(o, "")) for o in inst.operands)
  return total


def custom_call_bytes(hlo: str, target: str) -> int:
  """Bytes the custom calls of ``target`` read and write (operands and
  result, as `entry_bytes` counts an instruction), anywhere in the module.
  XLA:TPU's cost analysis leaves a Pallas TPU kernel (``tpu_custom_call``)
  out of its ``bytes accessed``; a kernel that reads each input block once
  and writes each output block once moves exactly these bytes."""
  calls = set(re.findall(r"(%\S+) = [^\n]*custom_call_target=\"" + re.escape(target) + '"', hlo))
  shapes, total = {}, 0
  for inst in instructions(hlo):
    shapes[inst.name] = inst.shape
    if inst.name in calls:
      total += shape_bytes(inst.shape) + sum(shape_bytes(shapes.get(o, "")) for o in inst.operands)
  return total
