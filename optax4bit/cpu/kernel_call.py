"""`jax.ffi.ffi_call` for the C++ kernel's targets, refused by name where the
computation is compiled for another platform.

The targets are registered for XLA's CPU backend only. Compiled for a GPU
(``implementation="cpu"`` with arrays on a GPU, or ``"auto"`` traced with a
CPU default device and run on GPU arrays), the call raises a `ValueError`
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

_ERROR = ("optax4bit's C++ CPU kernel (implementation='cpu', or 'auto' traced while the default "
          "device was a CPU) cannot run in a computation compiled for {platforms}: XLA runs it on "
          "CPU devices only. Pass implementation='auto' with the arrays' device as the default "
          "device (it picks the Pallas kernels on a GPU), or implementation='jnp'.")


def kernel_call(target: str, result_shape_dtypes, **kwargs):
  """`jax.ffi.ffi_call` of a CPU kernel target (same arguments), refused with
  a `ValueError` naming ``implementation`` where compiled for another platform."""
  call = jax.ffi.ffi_call(target, result_shape_dtypes, **kwargs)

  def guarded(first, *operands, **attributes):
    return call(compiled_only_for(first, ("cpu",), _ERROR), *operands, **attributes)

  return guarded
