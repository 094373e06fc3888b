"""Every Pallas kernel of optax4bit compiled for real GPUs, on a machine without one.

For each kernel (standalone quantize / dequantize, the default recipe's
stochastic rounding included, and the fused steps of `adamw_4bit` with both
recipes, Nesterov, and the default's with the stall rule on m and on both
moments, `adamw_4bit_factor` and `sgdm_4bit` with both recipes, `sgdm_4bit`
with Nesterov), float32 and bfloat16, a regular and a ragged shape, this
script

1. lowers the jitted function for CUDA on the CPU with JAX's public staging
   API, ``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))``;
2. reads the Triton module of each ``__gpu$xla.gpu.triton`` custom call: its
   ``mhlo.backend_config`` dictionary holds the module as MLIR bytecode
   (``ir``) next to ``num_warps``, ``num_stages``, the grid and the kernel's
   name. JAX's own MLIR bindings (with jaxlib's Triton dialect registered)
   read the bytecode and print it as Triton IR text without locations: no
   parsing of ``pallas_call(debug=True)`` output;
3. compiles that text with the ``triton`` package from PyPI
   (``triton.compile(path, target=GPUTarget("cuda", cc, 32))``: TTIR ->
   TTGIR -> LLVM IR -> PTX -> cubin through Triton's bundled ``ptxas -v``)
   for sm_75 (T4), sm_80 (A100), sm_89 (L4) and sm_90a (H100), with the
   kernel's own ``num_warps`` and ``num_stages``;
4. reads registers per thread and spills from ``ptxas -v``, shared memory
   from the compiled kernel's metadata, and computes the theoretical
   occupancy (resident warps / maximum warps per SM, limited by registers,
   shared memory and blocks per SM).

It also derives, from the operands and results of each kernel's custom call,
the bytes a step reads and writes per parameter (gradient, codes, scales and
partial maxima, update), and the ideal time of one step for 1B parameters at
the HBM bandwidth of an A100 (2.0 TB/s) and an H100 (3.35 TB/s).

It counts each kernel's static SASS instructions (Triton's bundled
``nvdisasm``) and, with the threads each kernel launches, the instructions a
whole step executes per parameter (`step_instructions`).

The check fails (exit status 1) on a compile error, on any spill or stack
frame, on more than `REGISTER_BUDGET` registers per thread, and on a step
over its `INSTRUCTION_BUDGETS` (float32 (1024, 2048) leaf, sm_90a).

What this does *not* prove: on a GPU, XLA compiles these custom calls with
the Triton and LLVM bundled in jaxlib and the CUDA toolkit's ptxas, not with
PyPI's Triton; registers can differ by a few. If PyPI's Triton cannot parse
the IR that JAX emits (the two drift apart), `TritonDriftError` says so; if
the installed jaxlib or triton is not among the validated releases (`VALIDATED`), the
check fails and says so unless ``--allow-version-drift``.

    python benchmarks/gpu_compile.py                  # the whole matrix
    python benchmarks/gpu_compile.py --cases "adamw_4bit paper" --archs sm_80
    python benchmarks/gpu_compile.py --markdown       # tables for RESULTS.md

Needs ``pip install -e .[gpu-check]`` (the pinned ``triton``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

import optax4bit
from optax4bit import pallas

TRITON_TARGET = "__gpu$xla.gpu.triton"

# name: compute capability given to GPUTarget (90 gives sm_90a).
ARCHS = {"sm_75": 75, "sm_80": 80, "sm_89": 89, "sm_90a": 90}


@dataclasses.dataclass(frozen=True)
class SmLimits:
  """Per-SM limits of the CUDA occupancy calculator."""
  max_warps: int
  max_blocks: int
  shared_bytes: int       # shared memory per SM usable by blocks
  reserved_shared: int    # shared memory the system takes per block
  registers: int = 65536
  register_unit: int = 256  # registers are allocated per warp in units of 256
  warp_unit: int = 4        # ... and to groups of 4 warps


SM_LIMITS = {
    75: SmLimits(max_warps=32, max_blocks=16, shared_bytes=64 * 1024, reserved_shared=0),
    80: SmLimits(max_warps=64, max_blocks=32, shared_bytes=164 * 1024, reserved_shared=1024),
    89: SmLimits(max_warps=48, max_blocks=24, shared_bytes=100 * 1024, reserved_shared=1024),
    90: SmLimits(max_warps=64, max_blocks=32, shared_bytes=228 * 1024, reserved_shared=1024),
}

HBM_BYTES_PER_S = {"A100": 2.0e12, "H100": 3.35e12}

SHAPES = {"regular": (1024, 2048), "ragged": (300, 301)}
DTYPES = ("float32", "bfloat16")

# Registers per thread that no kernel may exceed, on any architecture: issue
# 16's goal, >= 25% theoretical occupancy on sm_80 and sm_90 (2 blocks of 8
# warps, or 4 of 4). The tile and warps defaults of optax4bit.pallas were
# chosen against it.
REGISTER_BUDGET = 128


# The PyPI triton (pyproject.toml's gpu-check extra pins it) and the jaxlib
# releases whose Triton IR it was checked to parse and compile: the whole matrix
# on the ragged leaf, every case and architecture (jaxlib 0.10.2 writes it with
# MLIR 23, as triton 3.8.0's LLVM; 0.11.2 and 0.12.0.1 with MLIR 24).
VALIDATED = {"jaxlib": ("0.10.2", "0.11.2", "0.12.0.1"), "triton": ("3.8.0",)}


def version_drift() -> list:
  """What differs from `VALIDATED` (empty when the installed pair is in it)."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  installed = {"jaxlib": jaxlib.__version__, "triton": triton_version()}
  return [f"{name} {installed[name]} is installed; this check was validated with {name} "
          f"{' or '.join(versions)}. Check that PyPI's triton still parses and compiles the "
          "Triton IR this jaxlib writes (`test_gpu_compile.py`), then update VALIDATED in "
          "benchmarks/gpu_compile.py and the pin of the gpu-check extra in pyproject.toml."
          for name, versions in VALIDATED.items() if installed[name] not in versions]


class TritonDriftError(RuntimeError):
  """PyPI's Triton cannot read the Triton IR that this JAX emits."""


class KernelCompileError(RuntimeError):
  """A kernel that Triton parsed but could not compile (or ptxas rejected)."""


# ----------------------------------------------------------------------------
# The kernels: functions whose CUDA lowering contains them.


def _quantize(spec):
  key = jax.random.key(0) if getattr(spec, "stochastic", False) else None  # a name: nearest
  return lambda dtype, shape: (lambda x: pallas.quantize(x, spec, key=key),
                               (jax.ShapeDtypeStruct(shape, dtype),))


def _dequantize(spec):

  def make(dtype, shape):
    q = jax.eval_shape(lambda x: optax4bit.quantize(x, spec),
                       jax.ShapeDtypeStruct(shape, jnp.float32))
    return (lambda q: pallas.dequantize(q, dtype)), (q,)

  return make


def _update(factory):

  def make(dtype, shape):
    tx = factory()
    params = {"w": jax.ShapeDtypeStruct(shape, dtype)}
    state = jax.eval_shape(tx.init, params)
    return (lambda g, s, p: tx.update(g, s, p)[0]), (params, state, params)

  return make


_PALLAS = dict(min_quantize_size=0, implementation="pallas")
# The default's first moment rounds by the stall rule (issue 50); these cases
# keep the other roundings' kernels compiled: m stochastic everywhere (the
# default until then), and the rule on v too.
_STOCHASTIC_M = optax4bit.recipes.RECIPES["default"].first_moment.replace(stall_only=False)
_STALL_V = optax4bit.recipes.RECIPES["default"].second_moment.replace(stall_only=True)

# name: make(dtype, shape) -> (function, abstract arguments)
CASES: dict = {
    "quantize B128/NF stochastic": _quantize(optax4bit.recipes.RECIPES["default"].first_moment),
    "quantize B128/DE": _quantize("B128/DE"),
    "quantize Rank-1/Linear": _quantize("Rank-1/Linear"),
    "quantize Rank-1/SqrtLinear": _quantize("Rank-1/SqrtLinear"),
    "dequantize B128/NF": _dequantize("B128/NF"),
    "dequantize B128/DE": _dequantize("B128/DE"),
    "dequantize Rank-1/Linear": _dequantize("Rank-1/Linear"),
    "dequantize Rank-1/SqrtLinear": _dequantize("Rank-1/SqrtLinear"),
    "adamw_4bit default": _update(lambda: optax4bit.adamw_4bit(1e-3, **_PALLAS)),
    "adamw_4bit paper": _update(lambda: optax4bit.adamw_4bit(1e-3, recipe="paper", **_PALLAS)),
    "adamw_4bit default m stochastic": _update(
        lambda: optax4bit.adamw_4bit(1e-3, first_moment=_STOCHASTIC_M, **_PALLAS)),
    "adamw_4bit default stall v": _update(
        lambda: optax4bit.adamw_4bit(1e-3, second_moment=_STALL_V, **_PALLAS)),
    "adamw_4bit paper nesterov": _update(
        lambda: optax4bit.adamw_4bit(1e-3, recipe="paper", nesterov=True, **_PALLAS)),
    "adamw_4bit paper B128/Linear v": _update(
        lambda: optax4bit.adamw_4bit(1e-3, recipe="paper", second_moment="B128/Linear",
                                     **_PALLAS)),
    "adamw_4bit_factor default": _update(lambda: optax4bit.adamw_4bit_factor(1e-3, **_PALLAS)),
    "adamw_4bit_factor paper": _update(
        lambda: optax4bit.adamw_4bit_factor(1e-3, recipe="paper", **_PALLAS)),
    "sgdm_4bit default": _update(lambda: optax4bit.sgdm_4bit(1e-3, **_PALLAS)),
    "sgdm_4bit paper": _update(lambda: optax4bit.sgdm_4bit(1e-3, recipe="paper", **_PALLAS)),
    "sgdm_4bit paper nesterov": _update(
        lambda: optax4bit.sgdm_4bit(1e-3, recipe="paper", nesterov=True, **_PALLAS)),
}


# ----------------------------------------------------------------------------
# 1.-2. The Triton modules of a function's CUDA lowering.


_ELEMENT_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i64": 8, "ui64": 8, "i32": 4,
                  "ui32": 4, "i16": 2, "ui16": 2, "i8": 1, "ui8": 1, "i1": 1}


@dataclasses.dataclass(frozen=True)
class Buffer:
  shape: tuple
  element: str  # MLIR element type: f32, bf16, ui8, ...

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * _ELEMENT_BYTES[self.element]


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  """One ``__gpu$xla.gpu.triton`` custom call of a lowered function."""
  name: str
  ttir: str          # Triton IR text (no locations)
  num_warps: int
  num_stages: int
  grid: tuple
  inputs: tuple      # Buffers read
  outputs: tuple     # Buffers written
  mlir_producer: str  # e.g. "MLIR23.0.0git", from the bytecode header


def _buffer(value_type) -> Buffer:
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  t = ir.RankedTensorType(value_type)
  return Buffer(tuple(t.shape), str(t.element_type))


def _triton_context():
  from jax._src.interpreters import mlir  # pylint: disable=import-outside-toplevel
  from jaxlib.triton import dialect  # pylint: disable=import-outside-toplevel
  ctx = mlir.make_ir_context()
  dialect.register_dialect(ctx)
  ctx.load_all_available_dialects()
  return ctx


def ttir_from_bytecode(bytecode: bytes) -> str:
  """The Triton IR text of a module serialized by JAX's Pallas lowering,
  printed by JAX's own MLIR (the version that wrote it) without locations."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  with _triton_context():
    module = ir.Module.parse(bytecode)
    return module.operation.get_asm(enable_debug_info=False)


def cuda_target():
  """A context in which Pallas lowers for CUDA without a GPU, for an H100: since
  JAX 0.12 the Triton lowering reads the compute capability from a GPU or an
  abstract one and raises without (0.10-0.11 fell back to an H100's 9.0)."""
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=h100))


def triton_kernels(fn: Callable, *args) -> list:
  """The Triton kernels of ``jax.jit(fn)`` lowered for CUDA, in program order.

  Raises a RuntimeError that names the custom call if this JAX lowers Pallas
  to something other than ``__gpu$xla.gpu.triton`` with the module in its
  backend config (jaxlib <= 0.10.2 does; later versions may compile the
  module to PTX inside jaxlib instead, which needs its CUDA plugin)."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  with cuda_target():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  module = lowered.compiler_ir("stablehlo")
  calls, others = [], []

  def visit(op):
    if op.name == "stablehlo.custom_call":
      target = ir.StringAttr(op.attributes["call_target_name"]).value
      (calls if target == TRITON_TARGET else others).append((target, op))
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  pallas_like = [t for t, _ in others if "triton" in t.lower() or "pallas" in t.lower()]
  if pallas_like:
    raise RuntimeError(
        f"jax {jax.__version__} lowers Pallas kernels to custom call(s) {sorted(set(pallas_like))}, "
        f"not {TRITON_TARGET!r} with the Triton module in its backend config; "
        "benchmarks/gpu_compile.py must learn to read them.")
  kernels = []
  for _, op in calls:
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    bytecode = ir.StringAttr(config["ir"]).value_bytes
    header = re.match(rb"ML\xefR.(MLIR[^\x00]*)\x00", bytecode, re.S)
    integer = lambda key: ir.IntegerAttr(config[key]).value
    kernels.append(TritonKernel(
        name=ir.StringAttr(config["name"]).value,
        ttir=ttir_from_bytecode(bytecode),
        num_warps=integer("num_warps"), num_stages=integer("num_stages"),
        grid=(integer("grid_x"), integer("grid_y"), integer("grid_z")),
        inputs=tuple(_buffer(v.type) for v in op.operands),
        outputs=tuple(_buffer(v.type) for v in op.results),
        mlir_producer=header.group(1).decode() if header else "?"))
  return kernels


# ----------------------------------------------------------------------------
# 3.-4. Compiling with PyPI's Triton.


@contextlib.contextmanager
def _captured_fd(fd: int):
  """Collects what C++ code writes to ``fd`` (MLIR's parse diagnostics)."""
  saved = os.dup(fd)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), fd)
    captured = {"text": ""}
    try:
      yield captured
    finally:
      os.dup2(saved, fd)
      os.close(saved)
      tmp.seek(0)
      captured["text"] = tmp.read().decode(errors="replace")


def triton_version() -> str:
  import triton  # pylint: disable=import-outside-toplevel
  return triton.__version__


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                           r"(\d+) bytes spill loads")


def compile_kernel(kernel: TritonKernel, arch: str, workdir: str) -> dict:
  """Compiles ``kernel`` for ``arch`` (a key of `ARCHS`) with PyPI's Triton.

  Returns registers, spill stores/loads, stack frame and shared bytes.
  Raises `TritonDriftError` if Triton cannot parse the module, and
  `KernelCompileError` if a later stage (or ptxas) fails.
  """
  import triton  # pylint: disable=import-outside-toplevel
  from triton import knobs  # pylint: disable=import-outside-toplevel
  from triton._C.libtriton import ir as tir  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.compiler.compiler import IRSource, make_backend  # pylint: disable=import-outside-toplevel

  target = GPUTarget("cuda", ARCHS[arch], 32)
  path = os.path.join(workdir, f"{kernel.name}.ttir")
  with open(path, "w") as f:
    f.write(kernel.ttir)
  with _captured_fd(2) as diagnostics:
    try:
      IRSource(path, tir.context(), make_backend(target))
      parse_error = None
    except Exception as e:  # pylint: disable=broad-except
      parse_error = e
  if parse_error is not None:
    raise TritonDriftError(
        f"triton {triton.__version__} (PyPI) cannot parse the Triton IR of kernel "
        f"{kernel.name!r} that jax {jax.__version__} emitted (bytecode by "
        f"{kernel.mlir_producer}): {parse_error}\n{diagnostics['text'].strip()}\n"
        "JAX's bundled Triton and the pinned PyPI triton have drifted apart: pin the "
        "triton release whose dialect matches this jaxlib (pyproject.toml, extra "
        "'gpu-check').")
  log = io.StringIO()
  with knobs.nvidia.scope(), knobs.compilation.scope(), knobs.cache.scope():
    knobs.nvidia.dump_ptxas_log = True   # ptxas -v output, printed by Triton
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas
    knobs.cache.dir = os.path.join(workdir, "cache")
    try:
      with contextlib.redirect_stdout(log):
        # FMA contraction on, as Triton (and XLA) default to; explicit
        # because newer Triton releases warn that their default will change.
        compiled = triton.compile(path, target=target, options={
            "num_warps": kernel.num_warps, "num_stages": kernel.num_stages,
            "enable_fp_fusion": True})
    except Exception as e:  # pylint: disable=broad-except
      raise KernelCompileError(f"{kernel.name} for {arch}: {type(e).__name__}: {e}\n"
                               f"{log.getvalue()}") from e
  text = log.getvalue()
  regs, spills = _PTXAS_REGS.search(text), _PTXAS_SPILLS.search(text)
  if regs is None or spills is None:
    raise KernelCompileError(f"{kernel.name} for {arch}: no 'ptxas -v' report in Triton's "
                             f"output:\n{text}")
  return dict(registers=int(regs.group(1)), stack_bytes=int(spills.group(1)),
              spill_store_bytes=int(spills.group(2)), spill_load_bytes=int(spills.group(3)),
              shared_bytes=int(compiled.metadata.shared), ptxas_log=text.strip(),
              instructions=sass_instructions(compiled.asm["cubin"], workdir))


_SASS_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)


def sass_instructions(cubin: bytes, workdir: str) -> Optional[int]:
  """Static SASS instructions of a cubin, by Triton's bundled ``nvdisasm``
  (None where it is missing): a proxy for the work per element where the
  kernels are not bound by memory (no GPU here to time them)."""
  import triton  # pylint: disable=import-outside-toplevel
  tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
  if not os.path.exists(tool):
    return None
  path = os.path.join(workdir, "kernel.cubin")
  with open(path, "wb") as f:
    f.write(cubin)
  listing = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
  return len(_SASS_OPCODE.findall(listing))


def occupancy(registers: int, shared_bytes: int, num_warps: int, cc: int) -> float:
  """Theoretical occupancy: resident warps / maximum warps per SM (the CUDA
  occupancy calculator's register, shared memory and block limits)."""
  sm = SM_LIMITS[cc]
  per_warp = -(-registers * 32 // sm.register_unit) * sm.register_unit
  warps_by_regs = (sm.registers // per_warp) // sm.warp_unit * sm.warp_unit
  blocks = min(warps_by_regs // num_warps, sm.max_blocks, sm.max_warps // num_warps)
  if shared_bytes:
    per_block = -(-shared_bytes // 128) * 128 + sm.reserved_shared
    blocks = min(blocks, sm.shared_bytes // per_block)
  return blocks * num_warps / sm.max_warps


# ----------------------------------------------------------------------------
# The bytes each kernel moves.


def traffic(kernel: TritonKernel, params: int, grad_dtype: str) -> dict:
  """Bytes read + written per parameter by one kernel, by kind of buffer:
  ``gradient`` (leaf-shaped inputs), ``update`` (leaf-shaped outputs),
  ``codes`` (uint8) and ``scales`` (everything else: scales, inverse scales,
  partial maxima, factored side inputs, coefficients)."""
  element = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[grad_dtype]
  out = dict(gradient=0.0, codes=0.0, scales=0.0, update=0.0)
  for buffers, dense_kind in ((kernel.inputs, "gradient"), (kernel.outputs, "update")):
    for b in buffers:
      if b.element in ("ui8", "i8"):
        kind = "codes"
      elif b.element == element and math.prod(b.shape) == params:
        kind = dense_kind
      else:
        kind = "scales"
      out[kind] += b.nbytes / params
  return out


# ----------------------------------------------------------------------------
# The matrix.


@dataclasses.dataclass
class Row:
  case: str
  kernel: str
  dtype: str
  shape: str
  arch: str
  num_warps: int
  registers: Optional[int] = None
  spill_store_bytes: Optional[int] = None
  spill_load_bytes: Optional[int] = None
  stack_bytes: Optional[int] = None
  shared_bytes: Optional[int] = None
  occupancy: Optional[float] = None
  bytes_per_param: Optional[dict] = None
  instructions: Optional[int] = None  # static SASS instructions (`sass_instructions`)
  threads_per_param: Optional[float] = None  # threads launched / parameters of the leaf
  note: str = ""

  @property
  def spills(self) -> int:
    return (self.spill_store_bytes or 0) + (self.spill_load_bytes or 0)

  @property
  def instructions_per_param(self) -> Optional[float]:
    """Static SASS instructions times threads launched, per parameter: the
    instructions a step executes per parameter where every thread runs its
    code once (no loops; a slow path never taken counts too)."""
    if self.instructions is None or self.threads_per_param is None:
      return None
    return self.instructions * self.threads_per_param


def collect(cases: Sequence[str], dtypes: Sequence[str], shapes: Sequence[str]) -> list:
  """``[(case, dtype, shape, [TritonKernel, ...]), ...]``."""
  out = []
  for case in cases:
    for dtype in dtypes:
      for shape_name in shapes:
        fn, args = CASES[case](jnp.dtype(dtype), SHAPES[shape_name])
        out.append((case, dtype, shape_name, triton_kernels(fn, *args)))
  return out


def kernel_labels(kernels: Sequence[TritonKernel]) -> list:
  """``step`` / ``encode`` (pass 2), numbered where a name repeats."""
  short = [k.name.replace("optax4bit_", "") for k in kernels]
  return [f"{s}{' #%d' % (short[:i].count(s) + 1) if short.count(s) > 1 else ''}"
          for i, s in enumerate(short)]


def run_matrix(cases: Sequence[str] = tuple(CASES), dtypes: Sequence[str] = DTYPES,
               shapes: Sequence[str] = tuple(SHAPES), archs: Sequence[str] = tuple(ARCHS),
               progress: Optional[Callable[[str], None]] = None) -> list:
  """Compiles every kernel of ``cases`` for ``archs``; a list of `Row`.

  A case whose lowering has no Triton kernel (a quantizer without a Pallas
  kernel: the optimizer falls back to jnp) gives one row with a note.
  Compile errors raise `KernelCompileError`, drift `TritonDriftError`."""
  rows = []
  with tempfile.TemporaryDirectory(prefix="optax4bit_gpu_compile_") as workdir:
    for case, dtype, shape_name, kernels in collect(cases, dtypes, shapes):
      params = math.prod(SHAPES[shape_name])
      if not kernels:
        rows.append(Row(case, "-", dtype, shape_name, "-", 0,
                        note="no Pallas kernel: this configuration runs the jnp path"))
        if progress:
          progress(format_row(rows[-1]))
        continue
      for label, kernel in zip(kernel_labels(kernels), kernels):
        moved = traffic(kernel, params, dtype)
        threads = kernel.num_warps * 32 * math.prod(kernel.grid) / params
        for arch in archs:
          result = compile_kernel(kernel, arch, workdir)
          row = Row(case, label, dtype, shape_name, arch, kernel.num_warps,
                    registers=result["registers"],
                    spill_store_bytes=result["spill_store_bytes"],
                    spill_load_bytes=result["spill_load_bytes"],
                    stack_bytes=result["stack_bytes"], shared_bytes=result["shared_bytes"],
                    occupancy=occupancy(result["registers"], result["shared_bytes"],
                                        kernel.num_warps, ARCHS[arch]),
                    bytes_per_param=moved, instructions=result["instructions"],
                    threads_per_param=threads)
          rows.append(row)
          if progress:
            progress(format_row(row))
  return rows


# Static SASS instructions per parameter of a whole step (every kernel of
# it), float32 (1024, 2048) leaf, sm_90a: issue 35's targets, where the kernels
# are bound by memory rather than instructions (an H100 retires about 130
# thread-instructions per parameter while its HBM moves a 4-bit step's
# 15 bytes). Where a target is not met yet, the budget is the figure reached
# (a guard against regressions) and the target is noted.
INSTRUCTION_BUDGETS = {
    # The default's stall rule on m (issue 50) costs 7 per parameter over
    # stochastic rounding everywhere (125.2): the threshold's load and
    # comparison, the stored code's nibble, the choice.
    "adamw_4bit default": 133,         # target 100
    "adamw_4bit paper": 77,            # target 80
    "adamw_4bit_factor default": 75,   # target 80
    "sgdm_4bit default": 59,           # target 60
}
BUDGET_SHAPE, BUDGET_ARCH, BUDGET_DTYPE = "regular", "sm_90a", "float32"


def step_instructions(rows: Sequence[Row], shape: str = BUDGET_SHAPE, arch: str = BUDGET_ARCH,
                      dtype: str = BUDGET_DTYPE) -> dict:
  """``{case: {kernel: instructions per parameter, ..., "total": their sum}}``."""
  steps = {}
  for r in rows:
    if (r.shape, r.arch, r.dtype) == (shape, arch, dtype) and r.instructions_per_param:
      steps.setdefault(r.case, {})[r.kernel] = r.instructions_per_param
  for kernels in steps.values():
    kernels["total"] = sum(kernels.values())
  return steps


def over_instruction_budget(rows: Sequence[Row], budgets: dict = INSTRUCTION_BUDGETS) -> list:
  """``(case, instructions per parameter, budget)`` of the steps over budget."""
  steps = step_instructions(rows)
  return [(case, steps[case]["total"], budget) for case, budget in budgets.items()
          if case in steps and steps[case]["total"] > budget]


def problems(rows: Sequence[Row], budget: int = REGISTER_BUDGET) -> list:
  """The compiled rows that fail the check: a spill, a stack frame, or more
  than ``budget`` registers per thread."""
  return [r for r in rows if r.registers is not None
          and (r.spills or r.stack_bytes or r.registers > budget)]


# ----------------------------------------------------------------------------
# Printing.

_HEADER = (f"{'kernel':46s} {'dtype':8s} {'shape':7s} {'arch':6s} {'warps':>5s} {'regs':>5s} "
           f"{'spills':>6s} {'shared':>7s} {'occupancy':>9s} {'SASS':>6s}")


def format_row(r: Row) -> str:
  name = f"{r.case}: {r.kernel}"
  if r.registers is None:
    return f"{name:46s} {r.dtype:8s} {r.shape:7s} {r.note}"
  return (f"{name:46s} {r.dtype:8s} {r.shape:7s} {r.arch:6s} {r.num_warps:5d} "
          f"{r.registers:5d} {r.spills:6d} {r.shared_bytes:7d} {100 * r.occupancy:8.1f}% "
          f"{r.instructions if r.instructions is not None else '-':>6}")


def markdown(rows: Sequence[Row], shape: str = "regular") -> str:
  """One line per kernel and dtype: registers and occupancy per arch."""
  archs = [a for a in ARCHS if any(r.arch == a for r in rows)]
  keys = []
  for r in rows:
    if r.shape == shape and (r.case, r.kernel, r.dtype) not in keys:
      keys.append((r.case, r.kernel, r.dtype))
  lines = ["| kernel | dtype | " + " | ".join(f"regs {a}" for a in archs)
           + " | spills | shared B | " + " | ".join(f"occ. {a}" for a in archs) + " |",
           "|---|---|" + "---:|" * (2 * len(archs) + 2)]
  for case, kernel, dtype in keys:
    sel = {r.arch: r for r in rows
           if (r.case, r.kernel, r.dtype, r.shape) == (case, kernel, dtype, shape)}
    if "-" in sel:
      lines.append(f"| {case} | {dtype} | {sel['-'].note} |")
      continue
    regs = " | ".join(str(sel[a].registers) for a in archs)
    occ = " | ".join(f"{100 * sel[a].occupancy:.1f}%" for a in archs)
    spills = sum(sel[a].spills for a in archs)
    shared = sorted({sel[a].shared_bytes for a in archs})
    lines.append(f"| {case}: {kernel} | {dtype} | {regs} | {spills} | "
                 f"{'/'.join(map(str, shared))} | {occ} |")
  return "\n".join(lines)


def roofline(rows: Sequence[Row], shape: str = "regular", params: float = 1e9) -> str:
  """Bytes per parameter of each fused step (all its kernels) and the ideal
  time for ``params`` parameters at HBM bandwidth."""
  steps = {}
  for r in rows:
    if r.shape != shape or r.bytes_per_param is None:
      continue
    key = (r.case, r.dtype)
    steps.setdefault(key, {}).setdefault(r.kernel, r.bytes_per_param)
  lines = ["| fused step | dtype | kernels | gradient | codes | scales | update | total B/param "
           "| " + " | ".join(f"ideal ms/1B {n}" for n in HBM_BYTES_PER_S) + " |",
           "|---|---|---|" + "---:|" * (5 + len(HBM_BYTES_PER_S))]
  for (case, dtype), kernels in steps.items():
    total = {k: sum(v[k] for v in kernels.values())
             for k in ("gradient", "codes", "scales", "update")}
    whole = sum(total.values())
    ideal = " | ".join(f"{1e3 * whole * params / bw:.2f}" for bw in HBM_BYTES_PER_S.values())
    lines.append(f"| {case} | {dtype} | {len(kernels)} | {total['gradient']:.3f} | "
                 f"{total['codes']:.3f} | {total['scales']:.3f} | {total['update']:.3f} | "
                 f"{whole:.3f} | {ideal} |")
  return "\n".join(lines)


def instructions_table(rows: Sequence[Row]) -> str:
  """Instructions per parameter of each step, per kernel (`step_instructions`)."""
  lines = [f"| step ({BUDGET_DTYPE}, {SHAPES[BUDGET_SHAPE]}, {BUDGET_ARCH}) | kernels | "
           "SASS per parameter | budget |", "|---|---|---:|---:|"]
  for case, kernels in step_instructions(rows).items():
    parts = ", ".join(f"{k} {v:.1f}" for k, v in kernels.items() if k != "total")
    lines.append(f"| {case} | {parts} | {kernels['total']:.1f} | "
                 f"{INSTRUCTION_BUDGETS.get(case, '-')} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
  parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
  parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
  parser.add_argument("--markdown", action="store_true", help="also print RESULTS.md tables")
  parser.add_argument("--json", help="also write the rows to this file")
  parser.add_argument("--allow-version-drift", action="store_true",
                      help="compile with a jaxlib/triton pair other than VALIDATED")
  args = parser.parse_args(argv)
  try:
    version = triton_version()
  except ImportError:
    print("The 'triton' package is not installed: pip install -e .[gpu-check]")
    return 2
  print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, triton {version} (PyPI); "
        f"shapes {SHAPES}")
  drift = version_drift()
  for problem in drift:
    print(f"{'WARNING' if args.allow_version_drift else 'FAIL'}: {problem}")
  if drift and not args.allow_version_drift:
    return 1
  print(_HEADER)
  try:
    rows = run_matrix(args.cases, args.dtypes, args.shapes, args.archs,
                      progress=lambda line: print(line, flush=True))
  except (TritonDriftError, KernelCompileError) as e:
    print(f"FAIL: {type(e).__name__}: {e}")
    return 1
  compiled = [r for r in rows if r.registers is not None]
  if compiled:
    worst = max(compiled, key=lambda r: r.registers)
    print(f"\n{len(compiled)} compiles; max registers {worst.registers} ({worst.case}: "
          f"{worst.kernel}, {worst.dtype}, {worst.arch}); spills in "
          f"{sum(r.spills > 0 for r in compiled)}")
  if args.markdown:
    for shape in args.shapes:
      print(f"\n{shape} {SHAPES[shape]}:\n" + markdown(rows, shape))
    print("\n" + roofline(rows, args.shapes[0]))
    print("\n" + instructions_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
  over = over_instruction_budget(rows)
  for case, count, budget in over:
    print(f"FAIL: {case}: {count:.1f} SASS instructions per parameter, budget {budget}")
  failed = problems(rows)
  if over and not failed:
    return 1
  if failed:
    print(f"\nFAIL: spills, stack frames or more than {REGISTER_BUDGET} registers per thread:\n"
          + "\n".join([_HEADER] + [format_row(r) for r in failed]))
    return 1
  print(f"ok: every kernel compiles with no spill and at most {REGISTER_BUDGET} registers")
  return 0


if __name__ == "__main__":
  sys.exit(main())
