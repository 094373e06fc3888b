"""`jax.ffi.ffi_call` for the C++ kernel's targets, refused by name where the
computation is compiled for another platform.

The targets are registered for XLA's CPU backend only. Compiled for a GPU
(``implementation="cpu"`` with arrays on a GPU, or ``"auto"`` traced with a
CPU default device and run on GPU arrays), XLA would fail with "No FFI
handler registered ... on a platform CUDA", which names neither optax4bit nor
the argument to change. `kernel_call` routes the call's first operand through
an identity primitive whose lowering is empty on CPU (nothing is added to the
computation) and raises a `ValueError` that says what to do on any other
platform.

Example:
  >>> import jax.numpy as jnp
  >>> from optax4bit.cpu import kernel_call
  >>> x = jnp.ones(3)
  >>> bool((kernel_call.on_cpu_only(x) == x).all())  # identity on the CPU
  True
"""

from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

__all__ = ["kernel_call", "on_cpu_only"]

_ON_CPU_ONLY = Primitive("optax4bit_cpu_kernel_operand")
_ON_CPU_ONLY.def_abstract_eval(lambda x: x)
# Outside a trace the primitive compiles itself (once per shape), so the same
# lowering decides.
_ON_CPU_ONLY.def_impl(jax.jit(_ON_CPU_ONLY.bind))
batching.primitive_batchers[_ON_CPU_ONLY] = lambda args, dims: (_ON_CPU_ONLY.bind(*args),
                                                                dims[0])


def _refuse(ctx, x):
  del x
  platforms = ", ".join(repr(p) for p in ctx.module_context.platforms)
  raise ValueError(
      "optax4bit's C++ CPU kernel (implementation='cpu', or 'auto' traced while the default "
      f"device was a CPU) cannot run in a computation compiled for {platforms}: XLA runs it on "
      "CPU devices only. Pass implementation='auto' with the arrays' device as the default "
      "device (it picks the Pallas kernels on a GPU), or implementation='jnp'.")


mlir.register_lowering(_ON_CPU_ONLY, lambda ctx, x: [x], platform="cpu")
mlir.register_lowering(_ON_CPU_ONLY, _refuse)


def on_cpu_only(x: jax.Array) -> jax.Array:
  """``x`` itself; compiling it for a platform other than the CPU raises a
  `ValueError` naming ``implementation``."""
  return _ON_CPU_ONLY.bind(x)


def kernel_call(target: str, result_shape_dtypes, **kwargs):
  """`jax.ffi.ffi_call` of a CPU kernel target (same arguments), whose first
  operand goes through `on_cpu_only`."""
  call = jax.ffi.ffi_call(target, result_shape_dtypes, **kwargs)

  def guarded(first, *operands, **attributes):
    return call(on_cpu_only(first), *operands, **attributes)

  return guarded
