"""Which implementation runs a step: the fused kernels of a backend or the jnp
reference, leaf by leaf.

Every optimizer of the library takes ``implementation=``:

* ``"auto"`` (default): the Pallas kernels on a CUDA GPU where they compile
  (the default device's platform, ``jax.default_backend()`` unless
  ``jax.default_device`` names another; not ROCm); the XLA engine on any
  other GPU; on the CPU the
  compiled C++ kernels of `optax4bit.cpu` where they are installed and faster
  than the jnp path (their AVX-512 and AVX2 builds; 4-bit AdamW, AdamW with a
  factored second moment, SGD with momentum and `adamw_8bit`; everything else
  runs the jnp engine, with the kernel's 4-bit codecs); the jnp reference
  elsewhere.
* ``"jnp"``: the jnp reference (`optax4bit._leafwise`), always.
* ``"xla"``: the XLA engine (`optax4bit.xla`): every leaf in one piece, no
  loop, no gather, any platform; the jnp reference's codes.
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

The choice is made once when the update is traced, by `resolve`, the one
place that reads ``implementation``: it returns a `Backend`, whose fused
steps (`optax4bit.pallas.steps.PallasSteps`, `optax4bit.cpu.ffi.CpuSteps`:
`FusedSteps`) decline the leaves their kernels do not cover, which then run
the jnp reference with the backend's codecs.

Layers: `optax4bit.transform` and `optax4bit.quantize_state` ask `resolve`
for a backend; the backends (`optax4bit.pallas`, `optax4bit.cpu`) share the
step definitions and their coefficients (`optax4bit._steps`) and never import
each other.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Sequence, Union

from optax4bit import cpu as _cpu
from optax4bit._leaf_context import Codecs, LeafContext
from optax4bit._platform import default_platform
from optax4bit._steps import FusedStep
from optax4bit._validation import IMPLEMENTATIONS
from optax4bit.cpu import codec as _cpu_codec
from optax4bit.cpu import ffi as _cpu_ffi
from optax4bit.pallas import steps as _pallas_steps
from optax4bit.pallas.steps import PallasConfig
from optax4bit.xla import codec as _xla_codec
from optax4bit.xla import steps as _xla_steps

__all__ = ["IMPLEMENTATIONS", "Backend", "FusedSteps", "Implementation", "check_implementation",
           "codecs", "fused_steps", "resolve"]

Implementation = Union[str, PallasConfig]


class FusedSteps(Protocol):
  """A backend's fused steps."""

  def run(self, step: FusedStep, grad, moments: Sequence, side: Sequence = (),
          keys: Optional[Sequence] = None, *, context: LeafContext) -> Optional[tuple]:
    """``step`` on one leaf: ``(update, new_moments)``, or None where the
    backend's kernels do not cover the leaf."""


class Backend(NamedTuple):
  """What runs an update: ``steps``, the fused steps (None: the jnp engine
  runs every leaf), ``codecs``, the 4-bit codecs the jnp engine runs in
  place of its own (None: the jnp codecs), and ``whole_leaves``: whether
  reductions ahead of the steps (4-bit Factor's row and column sums) run on
  whole leaves rather than in chunks of rows."""
  steps: Optional[FusedSteps] = None
  codecs: Optional[Codecs] = None
  whole_leaves: bool = False


def _xla_backend() -> Backend:
  return Backend(_xla_steps.XlaSteps(), _xla_codec, whole_leaves=True)


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


def resolve(implementation: Implementation, platform: Optional[str] = None) -> Backend:
  """The `Backend` of ``implementation`` for an update compiled for
  ``platform`` (``"cpu"``, ``"gpu"``, ...; default: the default device's,
  `optax4bit._platform.default_platform`). Call once per trace of an update.

  Example:
    >>> from optax4bit import dispatch
    >>> dispatch.resolve("jnp")
    Backend(steps=None, codecs=None, whole_leaves=False)
    >>> dispatch.resolve("xla").whole_leaves
    True
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
  if implementation == "auto":
    platform = default_platform() if platform is None else platform
    if platform == "cpu":
      return Backend(_cpu_ffi.CpuSteps() if _cpu.faster_than_jnp() else None,
                     _cpu_codec if _cpu_codec.available() else None)
    if platform == "gpu" and _pallas_steps.kernels_run_here():
      return Backend(_pallas_steps.PallasSteps(PallasConfig().options))
    if platform == "gpu":
      return _xla_backend()
    # On a TPU the jnp engine stays: the XLA engine's 4-bit pairs make XLA:TPU
    # transpose every array of a leaf (docs/kernels.md: 4.5x optax.adamw's
    # bytes and 1.5x the jnp engine's temp on a v5e).
    return Backend()
  if implementation == "jnp":
    return Backend()
  raise _invalid(implementation)


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
