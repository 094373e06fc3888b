"""Which implementation runs a step: the fused kernels of a backend or the jnp
reference, leaf by leaf.

Every optimizer of the library takes ``implementation=``:

* ``"auto"`` (default): the Pallas kernels on a CUDA GPU (the default
  device's platform, ``jax.default_backend()`` unless ``jax.default_device``
  names another; not ROCm); on the CPU the
  compiled C++ kernels of `optax4bit.cpu` where they are installed and faster
  than the jnp path (their AVX-512 and AVX2 builds; 4-bit AdamW, AdamW with a
  factored second moment, SGD with momentum and `adamw_8bit`; everything else
  runs the jnp engine, with the kernel's 4-bit codecs); the jnp reference
  elsewhere.
* ``"jnp"``: the jnp reference (`optax4bit._leafwise`), always.
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

The choice is made when the update is traced. A backend's fused steps
(`optax4bit.pallas.steps.PallasSteps`, `optax4bit.cpu.ffi.CpuSteps`) decline
the leaves their kernels do not cover, which then run the jnp reference.

Layers: `optax4bit.transform` asks `fused_steps` for a backend; the backends
(`optax4bit.pallas`, `optax4bit.cpu`) share the step definitions and their
coefficients (`optax4bit._steps`) and never import each other.
"""

from __future__ import annotations

from typing import Union

from optax4bit import cpu as _cpu
from optax4bit._platform import default_platform
from optax4bit._validation import IMPLEMENTATIONS
from optax4bit.cpu import codec as _cpu_codec
from optax4bit.cpu import ffi as _cpu_ffi
from optax4bit.pallas import steps as _pallas_steps
from optax4bit.pallas.steps import PallasConfig

__all__ = ["IMPLEMENTATIONS", "Implementation", "check_implementation", "codecs", "fused_steps"]

Implementation = Union[str, PallasConfig]


def check_implementation(implementation: Implementation) -> Implementation:
  """Validates ``implementation`` (at construction time)."""
  if isinstance(implementation, PallasConfig):
    return implementation
  if implementation == "cpu" and not _cpu.available():
    raise ValueError(f"implementation='cpu' needs the compiled CPU kernel, but "
                     f"{_cpu.unavailable_reason()}.")
  if isinstance(implementation, str) and implementation in IMPLEMENTATIONS:
    return implementation
  raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or an "
                   f"optax4bit.pallas.PallasConfig, got {implementation!r}.")


def fused_steps(implementation: Implementation):
  """The fused steps for ``implementation`` (`optax4bit.pallas.steps.PallasSteps`
  or `optax4bit.cpu.ffi.CpuSteps`), or None for the jnp reference. Call while
  tracing the update (``"auto"`` looks at the default device's platform)."""
  if implementation == "cpu" or (implementation == "auto" and default_platform() == "cpu"
                                 and _cpu.faster_than_jnp()):
    return _cpu_ffi.CpuSteps()
  config = _pallas_steps.resolve(implementation)
  return None if config is None else _pallas_steps.PallasSteps(config.options)


def codecs(implementation: Implementation):
  """The 4-bit codecs the jnp engine runs in place of its own where no fused
  step covers a leaf (`optax4bit.quantize_state`, and leaves the fused steps
  decline): the C++ kernel's (`optax4bit.cpu.codec`) for ``"cpu"``, and for
  ``"auto"`` on the CPU where the kernel beats the jnp path; else
  None (the jnp codecs). Call while tracing."""
  if implementation == "cpu" and _cpu_codec.registered():
    return _cpu_codec
  if implementation == "auto" and default_platform() == "cpu" and _cpu_codec.available():
    return _cpu_codec
  return None
