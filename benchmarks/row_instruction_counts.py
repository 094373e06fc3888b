"""Instructions the C++ kernel's row passes execute per element, per ISA path,
counted under qemu-user: a measure that does not depend on the machine's load
or on having the CPU at hand (aarch64 here).

`row_instruction_counts.cc` is compiled with setup.py's flags, statically, for
each target whose compiler and qemu exist here: aarch64 (the baseline path,
NEON code there; with GCC and with Clang), x86-64 AVX2 and x86-64 baseline
(qemu 7.2 emulates no AVX-512). qemu logs every translated block (``-d in_asm``) and every block it
runs (``-d exec,nochain``); the instructions of the blocks run, with 2 passes
minus with 0 (the setup), over 2 x 16 x 2048 elements, give the count per
element of one pass of each step: 4-bit Adam (stats and apply pass, paper and
default recipes), 4-bit momentum (stochastic rounding), 8-bit Adam, and the
default recipe with m, then both moments, rounded by the stall rule
(``QuantSpec(stall_only=True)``; "-" for a kernel without it).

On the x86 paths the counts track the row harness's times: the baseline path
executes 12x the AVX2 path's instructions per element (Adam) and takes 12-13x
its time (benchmarks/RESULTS.md).

Usage (from the repository root; needs g++, aarch64-linux-gnu-g++,
qemu-aarch64-static and qemu-x86_64-static, and clang++ for its row; Debian:
g++-aarch64-linux-gnu, qemu-user-static, clang):
  python benchmarks/row_instruction_counts.py
  python benchmarks/row_instruction_counts.py --source /tmp/old  # another checkout's kernel
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from optax4bit.cpu import ffi  # noqa: E402  pylint: disable=wrong-import-position

STEPS = ("4-bit Adam, paper", "4-bit Adam, default", "4-bit momentum", "8-bit Adam",
         "4-bit Adam, default, m stall", "4-bit Adam, default, m+v stall")
_NO_STALL_RULE = 4  # the exit status of steps 4 and 5 for a kernel without the stall rule
ROWS, COLUMNS = 16, 2048
# target: (compiler and its target flag, qemu, the path's namespace)
TARGETS = {
    "aarch64 baseline": (["aarch64-linux-gnu-g++"], "qemu-aarch64-static", "baseline"),
    "aarch64 baseline, Clang": (["clang++", "--target=aarch64-linux-gnu"], "qemu-aarch64-static",
                                "baseline"),
    "x86-64 avx2": (["g++"], "qemu-x86_64-static", "avx2"),
    "x86-64 baseline": (["g++"], "qemu-x86_64-static", "baseline"),
}


def _compile(cxx: list, path: str, source: str, out: str) -> None:
  import jaxlib  # pylint: disable=import-outside-toplevel
  include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
  subprocess.run([*cxx, "-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno",
                  "-fno-trapping-math", f"-DROWS_PATH={path}", f"-I{include}", f"-I{source}",
                  f"-I{ROOT}", os.path.join(ROOT, "benchmarks", "row_instruction_counts.cc"),
                  "-static", "-o", out, "-lpthread"], check=True, capture_output=True)


def _instructions(qemu: str, binary: str, step: int, passes: int, tables8: str):
  """Instructions qemu ran for the binary: each block run, times its size
  (None where the kernel lacks the step)."""
  with tempfile.NamedTemporaryFile(suffix=".log") as log:
    run = subprocess.run([qemu, "-d", "in_asm,exec,nochain", "-D", log.name, binary, str(step),
                          str(passes), tables8], capture_output=True, check=False)
    if run.returncode == _NO_STALL_RULE and step >= 4:
      return None
    run.check_returncode()
    sizes, total, start, size = {}, 0, None, 0
    with open(log.name) as f:
      for line in f:
        if line.startswith("IN:"):
          start, size = None, 0
        elif line.startswith("0x") and ":  " in line:  # one instruction of a block
          start = int(line.split(":")[0], 16) if start is None else start
          size += 1
        elif start is not None and (not line.strip() or line.startswith("Trace")):
          sizes[start], start = size, None
        if line.startswith("Trace"):  # Trace n: host [cs_base/pc/flags/cflags] symbol
          total += sizes[int(line.split("[")[1].split("/")[1], 16)]
  return total


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--source", default=ROOT,
                      help="the checkout whose optax4bit/cpu kernel is counted")
  args = parser.parse_args()
  source = os.path.abspath(args.source)
  print(f"kernel source: {source}; instructions per element of one pass "
        f"({ROWS} x {COLUMNS} leaf)")
  print("| path | " + " | ".join(STEPS) + " |")
  print("|---|" + "---:|" * len(STEPS))
  with tempfile.TemporaryDirectory() as tmp:
    tables8 = os.path.join(tmp, "tables8.bin")
    with open(tables8, "wb") as f:
      f.write(ffi._tables_8bit("DE", "DE").astype(np.float32).tobytes())  # pylint: disable=protected-access
      f.write(ffi._buckets("DE", "DE").astype(np.int32).tobytes())  # pylint: disable=protected-access
    for name, (cxx, qemu, path) in TARGETS.items():
      if not (shutil.which(cxx[0]) and shutil.which(qemu)):
        print(f"| {name} | no {cxx[0]} or {qemu} |")
        continue
      binary = os.path.join(tmp, "".join(c if c.isalnum() else "_" for c in name))
      _compile(cxx, path, source, binary)
      counts = []
      for step in range(len(STEPS)):
        two, none = (_instructions(qemu, binary, step, passes, tables8) for passes in (2, 0))
        counts.append("-" if two is None else f"{(two - none) / (2 * ROWS * COLUMNS):.1f}")
      print(f"| {name} | " + " | ".join(counts) + " |", flush=True)


if __name__ == "__main__":
  main()
