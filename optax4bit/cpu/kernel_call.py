"""`jax.ffi.ffi_call` for the C++ kernel's targets, refused by name where the
computation is compiled for another platform.

The targets are registered for XLA's CPU backend only. Compiled for another
platform (``implementation="cpu"`` with arrays on a GPU or TPU; ``"auto"``
exported for another platform from a process that compiles only for the CPU,
or for several platforms at once), the call
raises a `ValueError`
that says what to do (`optax4bit._platform.compiled_only_for` on its first
operand) instead of XLA's "No FFI handler registered ... on a platform CUDA".

Example:
  >>> import jax, jax.numpy as jnp
  >>> from optax4bit.cpu.kernel_call import kernel_call
  >>> call = kernel_call("optax4bit_decode_4bit", jax.ShapeDtypeStruct((1, 128), jnp.float32))
  >>> callable(call)
  True
"""

from __future__ import annotations

import jax

from optax4bit._platform import compiled_only_for

__all__ = ["kernel_call"]

_ERROR = ("optax4bit's C++ CPU kernel (implementation='cpu'; or 'auto' in a process that "
          "compiles only for the CPU, or lowered for several platforms at once) cannot run in a "
          "computation compiled for {platforms}: XLA runs it on CPU devices only. Pass "
          "implementation='jnp' (any platform, and several at once), or 'auto' in a process "
          "with the platform's compiler installed (the engine of the platform compiled for).")


def kernel_call(target: str, result_shape_dtypes, **kwargs):
  """`jax.ffi.ffi_call` of a CPU kernel target (same arguments), refused with
  a `ValueError` naming ``implementation`` where compiled for another platform."""
  call = jax.ffi.ffi_call(target, result_shape_dtypes, **kwargs)

  def guarded(first, *operands, **attributes):
    return call(compiled_only_for(first, ("cpu",), _ERROR), *operands, **attributes)

  return guarded
