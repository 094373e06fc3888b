"""Which implementation runs a step: the fused kernels of a backend or the jnp
reference, leaf by leaf.

Every optimizer of the library takes ``implementation=``:

* ``"auto"`` (default): the engine of the platform the update is compiled
  for (`per_platform`; a CPU host compiling for a TPU picks the TPU's):
  on a CUDA GPU the Pallas kernels where they compile (probed on the default
  device; a GPU the process cannot probe runs the XLA engine), and the XLA
  engine on the leaves they decline (8-bit ones included); the XLA engine
  on any other GPU; on the CPU the
  compiled C++ kernels of `optax4bit.cpu` where they are installed and faster
  than the jnp path (their AVX-512 and AVX2 builds; 4-bit AdamW, AdamW with a
  factored second moment, SGD with momentum and `adamw_8bit`; everything else
  runs the jnp engine, with the kernel's 4-bit codecs); on a TPU the Pallas TPU
  kernels of `optax4bit.tpu` (leaves they do not cover run the jnp engine);
  the jnp reference elsewhere. Outside a trace the default device's platform decides
  (``jax.default_backend()`` unless ``jax.default_device`` names another).
* ``"jnp"``: the jnp reference (`optax4bit._leafwise`), always.
* ``"xla"``: the XLA engine (`optax4bit.xla`): every leaf in one piece, no
  loop, no gather, any platform; the jnp reference's codes.
* ``"tpu"``: the Pallas TPU (Mosaic) kernels of `optax4bit.tpu`: 4-bit and
  8-bit leaves of two axes or more whose rows are a multiple of 256 elements, in one or two passes, no
  loop; other quantized leaves run the jnp engine. Lowers only for a TPU.
* ``"tpu_interpret"``: the same kernels in Pallas interpret mode, on any
  backend (slow; for tests).
* ``"cpu"``: the C++ kernel of `optax4bit.cpu` (XLA CPU backend); an error at
  construction if it is not installed, and a `ValueError` naming
  ``implementation`` where the update is compiled for a GPU
  (`optax4bit._platform.compiled_only_for`).
  ``jax.export`` refuses its custom calls (no serialization compatibility
  guarantee): use ``"jnp"`` for an update you export on CPU.
* ``"pallas"``: the Pallas kernels, lowered through Triton
  (``jax.experimental.pallas.triton.CompilerParams``); needs a CUDA GPU (a
  `ValueError` naming ``implementation`` where the update is compiled for
  another platform).
* ``"pallas_interpret"``: the same kernels in Pallas interpret mode, on any
  backend (slow; for tests).
* a `PallasConfig`: interpret mode and tiling options.

The choice is made when the update is traced, by `resolve` and
`per_platform`, the one place that reads ``implementation``: it gives a
`Backend`, whose fused
steps (`optax4bit.pallas.steps.PallasSteps`, `optax4bit.cpu.ffi.CpuSteps`:
`FusedSteps`) decline the leaves their kernels do not cover, which then run
the jnp reference with the backend's codecs.

Layers: `optax4bit.transform` and `optax4bit.quantize_state` ask
`per_platform` for a backend; the backends (`optax4bit.pallas`,
`optax4bit.cpu`) share the
step definitions and their coefficients (`optax4bit._steps`) and never import
each other.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, TypeVar, Union

import jax

from optax4bit import cpu as _cpu
from optax4bit._leaf_context import Codecs, LeafContext
from optax4bit._platform import default_platform, installed_platforms
from optax4bit._steps import FusedStep
from optax4bit._validation import IMPLEMENTATIONS
from optax4bit.cpu import codec as _cpu_codec
from optax4bit.cpu import ffi as _cpu_ffi
from optax4bit.pallas import steps as _pallas_steps
from optax4bit.pallas.steps import PallasConfig
from optax4bit.tpu import steps as _tpu_steps
from optax4bit.xla import codec as _xla_codec
from optax4bit.xla import steps as _xla_steps

__all__ = ["IMPLEMENTATIONS", "Backend", "FallbackSteps", "FusedSteps", "Implementation", "check_implementation",
           "codecs", "fused_steps", "per_platform", "resolve"]

Implementation = Union[str, PallasConfig]
T = TypeVar("T")


class FusedSteps(Protocol):
  """A backend's fused steps."""

  def run(self, step: FusedStep, grad, moments: Sequence, side: Sequence = (),
          keys: Optional[Sequence] = None, *, context: LeafContext) -> Optional[tuple]:
    """``step`` on one leaf: ``(update, new_moments)``, or None where the
    backend's kernels do not cover the leaf."""


class Backend(NamedTuple):
  """What runs an update: ``steps``, the fused steps (None: the jnp engine
  runs every leaf), ``codecs``, the 4-bit codecs the jnp engine runs in
  place of its own (None: the jnp codecs), ``whole_leaves``: whether
  reductions ahead of the steps (4-bit Factor's row and column sums) run on
  whole leaves rather than in chunks of rows, and ``row_sums``: how those
  reductions sum a leaf's rows (None: ``jnp.sum`` over the last axis; the
  XLA engine's `optax4bit.xla.steps.row_sums` fuses with its first pass)."""
  steps: Optional[FusedSteps] = None
  codecs: Optional[Codecs] = None
  whole_leaves: bool = False
  row_sums: Optional[Callable[[jax.Array], jax.Array]] = None


@dataclasses.dataclass(frozen=True)
class FallbackSteps:
  """Fused steps that run ``first``, and ``then`` on the leaves ``first``
  declines, with ``then_codecs`` as the leaf's codecs (None: the context's).

  Example:
    >>> from optax4bit import dispatch
    >>> steps = dispatch.resolve("auto", platform="cpu").steps
    >>> dispatch.FallbackSteps(steps, dispatch.resolve("xla").steps).then
    XlaSteps()
  """
  first: FusedSteps
  then: FusedSteps
  then_codecs: Optional[Codecs] = None

  def run(self, step: FusedStep, grad, moments: Sequence, side: Sequence = (),
          keys: Optional[Sequence] = None, *, context: LeafContext = LeafContext()):
    out = self.first.run(step, grad, moments, side, keys, context=context)
    if out is not None:
      return out
    if self.then_codecs is not None:
      context = dataclasses.replace(context, codecs=self.then_codecs)
    return self.then.run(step, grad, moments, side, keys, context=context)


def _xla_backend() -> Backend:
  return Backend(_xla_steps.XlaSteps(), _xla_codec, whole_leaves=True,
                 row_sums=_xla_steps.row_sums)


def _tpu_backend(interpret: bool = False) -> Backend:
  return Backend(_tpu_steps.TpuSteps(interpret=interpret), whole_leaves=True)


def _invalid(implementation) -> ValueError:
  return ValueError(f"implementation must be one of {IMPLEMENTATIONS} or an "
                    f"optax4bit.pallas.PallasConfig, got {implementation!r}.")


def check_implementation(implementation: Implementation, *,
                         fused: bool = True) -> Implementation:
  """Validates ``implementation`` at construction time. ``fused=False``
  (`optax4bit.quantize_state`, whose update is a black box): only ``"auto"``
  and ``"jnp"``."""
  if not fused:
    if implementation in ("auto", "jnp"):
      return implementation
    if isinstance(implementation, str) and implementation in IMPLEMENTATIONS:
      raise NotImplementedError(
          "quantize_state wraps a black-box transformation: its update is whatever "
          "inner.update computes, so it cannot be fused into a kernel "
          f"(implementation={implementation!r}). Use implementation='auto' or 'jnp' (the "
          "decode / encode around inner.update run as jnp), or a hand-written optimizer "
          "(adamw_4bit, sgdm_4bit, ...) for fused kernels.")
    raise ValueError(f"implementation must be 'auto' or 'jnp' for quantize_state, got "
                     f"{implementation!r}.")
  if isinstance(implementation, PallasConfig):
    return implementation
  if implementation == "cpu" and not _cpu.available():
    raise ValueError(f"implementation='cpu' needs the compiled CPU kernel, but "
                     f"{_cpu.unavailable_reason()}.")
  if isinstance(implementation, str) and implementation in IMPLEMENTATIONS:
    return implementation
  raise _invalid(implementation)


def _auto(platform: str) -> tuple[str, Backend]:
  """The engine ``"auto"`` runs in a computation lowered for ``platform``
  (XLA's names: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``), named.

  The Pallas kernels run only where the default device is a CUDA GPU on which
  they compile (`optax4bit.pallas.steps.kernels_run_here`: the probe needs the
  GPU); a GPU the process cannot probe (a deviceless compile) runs the XLA
  engine, which compiles anywhere.
  """
  if platform == "cpu":
    steps = _cpu_ffi.CpuSteps() if _cpu.faster_than_jnp() else None
    codecs_ = _cpu_codec if _cpu_codec.available() else None
    return ("cpu" if steps else "jnp, C++ codecs" if codecs_ else "jnp"), Backend(steps, codecs_)
  if platform == "cuda" and _pallas_steps.kernels_run_here():
    # Leaves the kernels decline (8-bit, other quantizers or shapes) run the
    # XLA engine: whole leaves, no loop (the jnp engine's row chunks are a
    # kernel launch per trip on a GPU).
    return "pallas", Backend(FallbackSteps(_pallas_steps.PallasSteps(PallasConfig().options),
                                           _xla_steps.XlaSteps(), _xla_codec))
  if platform in ("cuda", "rocm"):
    return "xla", _xla_backend()
  if platform == "tpu":
    return "tpu", _tpu_backend()
  return "jnp", Backend()


def resolve(implementation: Implementation, platform: Optional[str] = None) -> Backend:
  """The `Backend` of ``implementation`` for an update compiled for
  ``platform`` (``"cpu"``, ``"gpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``;
  default: the default device's, `optax4bit._platform.default_platform`).
  An update follows the platform it is lowered for through `per_platform`.

  Example:
    >>> from optax4bit import dispatch
    >>> dispatch.resolve("jnp")
    Backend(steps=None, codecs=None, whole_leaves=False, row_sums=None)
    >>> dispatch.resolve("xla").whole_leaves
    True
    >>> dispatch.resolve("auto", platform="tpu").steps
    TpuSteps(interpret=False)
    >>> dispatch.resolve("pallas_interpret").steps.options.interpret
    True
  """
  if isinstance(implementation, PallasConfig):
    return Backend(_pallas_steps.PallasSteps(implementation.options))
  if implementation in ("pallas", "pallas_interpret"):
    config = PallasConfig(interpret=implementation == "pallas_interpret")
    return Backend(_pallas_steps.PallasSteps(config.options))
  if implementation == "cpu":
    return Backend(_cpu_ffi.CpuSteps(), _cpu_codec if _cpu_codec.registered() else None)
  if implementation == "xla":
    return _xla_backend()
  if implementation in ("tpu", "tpu_interpret"):
    return _tpu_backend(implementation == "tpu_interpret")
  if implementation == "auto":
    platform = default_platform() if platform is None else platform
    return _auto("cuda" if platform == "gpu" else platform)[1]
  if implementation == "jnp":
    return Backend()
  raise _invalid(implementation)


def per_platform(implementation: Implementation, body: Callable[[Backend], T], *,
                 codecs_only: bool = False) -> T:
  """``body(backend)`` with the `Backend` of ``implementation``. For
  ``"auto"``, the backend of the platform the computation is lowered for
  (`jax.lax.platform_dependent`), not the process's default device: an
  update compiled for a TPU from a CPU host runs the TPU's engine. Every
  engine gives the same codes, so the state has one form on every platform.

  A branch is traced for each distinct engine of the platforms with their
  own (`_own_engine_platforms`): where the default device is a CPU, those
  this process can compile for (`optax4bit._platform.installed_platforms`:
  the CPU, TPUs where libtpu is installed, GPUs where a JAX plugin is); on
  an accelerator, its own platform. Where there are two or more, any other
  platform runs the jnp engine. So a machine with only a CPU traces one
  engine, and a GPU or TPU host two (its own and the jnp engine, for a
  computation compiled for its CPU). To `jax.export` from a machine with only
  a CPU for another platform, pass ``implementation="jnp"``. Only the
  lowered platform's branch is compiled. ``codecs_only``: engines that
  differ only in their steps count as one, for a ``body`` that reads only
  ``backend.codecs``. ``body`` must return a tree of arrays.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax4bit import dispatch
    >>> f = jax.jit(lambda x: dispatch.per_platform(
    ...     "auto", lambda backend: x + backend.whole_leaves))
    >>> f(jnp.float32(1)).item()  # the CPU's engine works in chunks of rows
    1.0
  """
  if implementation != "auto":
    return body(resolve(implementation))
  groups: dict = {}
  for platform in sorted(_own_engine_platforms()):
    name, backend = _auto(platform)
    key = backend.codecs if codecs_only else name
    groups.setdefault(key, (functools.partial(body, backend), []))[1].append(platform)
  if len(groups) == 1 and default_platform() == "cpu":
    (branch, _), = groups.values()
    return branch()
  default_key = None if codecs_only else "jnp"
  default = groups.pop(default_key, (functools.partial(body, Backend()), []))[0]
  if not groups:
    return default()
  branches = {platform: branch for branch, platforms in groups.values() for platform in platforms}
  return jax.lax.platform_dependent(default=default, **branches)


def _own_engine_platforms() -> set:
  """The platforms `per_platform` gives a branch of their own (its docstring)."""
  default = default_platform()
  if default == "cpu":
    return set(installed_platforms())
  if default == "gpu":
    return {p for p in installed_platforms() if p in ("cuda", "rocm")} or {"cuda"}
  return {default}


def fused_steps(implementation: Implementation) -> Optional[FusedSteps]:
  """``resolve(implementation).steps``: the fused steps, or None for the jnp
  reference. Call while tracing the update."""
  return resolve(implementation).steps


def codecs(implementation: Implementation) -> Optional[Codecs]:
  """``resolve(implementation).codecs``: the 4-bit codecs the jnp engine runs
  in place of its own where no fused step covers a leaf
  (`optax4bit.quantize_state`, and leaves the fused steps decline): the C++
  kernel's (`optax4bit.cpu.codec`) for ``"cpu"``, and for ``"auto"`` on the
  CPU where the kernel is installed; else None (the jnp codecs). Call while
  tracing."""
  return resolve(implementation).codecs
