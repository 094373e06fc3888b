"""The fused XLA CPU kernel of 4-bit Adam, called through ``jax.ffi``.

The C++ library (``adam_4bit.cc``, built by ``setup.py`` as an optional
extension) registers two FFI targets for XLA's CPU backend. For one 2-D leaf
with the default quantizers (first moment ``B128/DE``, second moment
``Rank-1/Linear``, nearest rounding) and a last axis that is a multiple of 128,
one update is two calls:

1. ``stats``: the row and column maxima of the new second moment (rank-1
   scales need the whole new moment before any element is encoded);
2. ``apply``: row by row, decode both moments, run the float32 Adam step,
   write the update over the (float32) gradient and re-encode both moments in
   place (``input_output_aliases``), split over as many threads as XLA's
   intra-op pool has.

It computes what the jnp reference computes: the same float32 operations in
the same order, the reciprocal forms XLA compiles the reference to (see
`optax4bit.pallas.optim`), no fused multiply-adds and subnormals flushed, as
on XLA's CPU backend. The equivalence tests compare codes, scales and updates
with the jnp path. Other leaves, quantizers and optimizers run the jnp
reference.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.metadata
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit import sharding as _sharding
from optax4bit.pallas.optim import adam_coefficients
from optax4bit.quant import maps, normalize
from optax4bit.quant.array import QuantizedArray
from optax4bit.quant.spec import QuantSpec

__all__ = ["available", "unavailable_reason", "covers", "adam_leaf", "CpuSteps"]

_LIBRARY = "_adam_4bit"
_STATS_TARGET = "optax4bit_adam_4bit_stats"
_APPLY_TARGET = "optax4bit_adam_4bit_apply"
_FIRST_MOMENT = QuantSpec.parse("B128/DE", signed=True)
_SECOND_MOMENT = QuantSpec.parse("Rank-1/Linear", signed=False)
# The 16 DE values, then the 15 midpoint thresholds nearest rounding compares with.
_DE_TABLE = np.concatenate([maps.qmap("DE", 4, True),
                            maps.midpoint_thresholds("DE", 4, True)]).astype(np.float32)


def _library_path() -> Optional[str]:
  here = os.path.dirname(os.path.abspath(__file__))
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    path = os.path.join(here, _LIBRARY + suffix)
    if os.path.exists(path):
      return path
  return None


def _version_tuple(version: str) -> tuple:
  parts = []
  for part in version.split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


@functools.cache
def _load() -> Optional[str]:
  """Loads the library and registers its targets; returns why it cannot."""
  path = _library_path()
  if path is None:
    return ("optax4bit was installed without its compiled CPU kernel "
            "(reinstall with a C++17 compiler to build it)")
  try:
    library = ctypes.CDLL(path)
    library.Optax4bitBuildJaxlibVersion.restype = ctypes.c_char_p
    built = library.Optax4bitBuildJaxlibVersion().decode()
  except (OSError, AttributeError) as e:
    return f"the compiled CPU kernel {path} cannot be loaded: {e}"
  running = importlib.metadata.version("jaxlib")
  # XLA's FFI runs handlers built against older headers, not newer ones.
  if built == "unknown" or _version_tuple(running) < _version_tuple(built):
    return (f"the compiled CPU kernel was built against jaxlib {built}, newer than the "
            f"installed jaxlib {running} (reinstall optax4bit)")
  jax.ffi.register_ffi_target(
      _STATS_TARGET, jax.ffi.pycapsule(library.Optax4bitAdam4bitStats), platform="cpu")
  jax.ffi.register_ffi_target(
      _APPLY_TARGET, jax.ffi.pycapsule(library.Optax4bitAdam4bitApply), platform="cpu")
  return None


def available() -> bool:
  """Whether the compiled CPU kernel is installed and usable with this jaxlib.

  Example:
    >>> import optax4bit.cpu
    >>> isinstance(optax4bit.cpu.available(), bool)
    True
  """
  return _load() is None


def unavailable_reason() -> Optional[str]:
  """Why `available` is False (None when it is True)."""
  return _load()


def covers(grad, moments) -> bool:
  """Whether the kernel computes this leaf: a 2-D leaf with at least one row,
  a last axis that is a multiple of 128 and moments quantized with exactly
  ``B128/DE`` (signed) and ``Rank-1/Linear`` (unsigned), nearest rounding."""
  if len(moments) != 2 or not all(isinstance(m, QuantizedArray) for m in moments):
    return False
  m, v = moments
  shape = tuple(grad.shape)
  return (m.spec == _FIRST_MOMENT and v.spec == _SECOND_MOMENT and len(shape) == 2
          and shape[0] > 0 and shape[1] % 128 == 0
          and jnp.issubdtype(grad.dtype, jnp.floating))


def _stats_call(grad, v: QuantizedArray, coef):
  row, col = v.scales
  return jax.ffi.ffi_call(
      _STATS_TARGET,
      (jax.ShapeDtypeStruct(row.shape, jnp.float32), jax.ShapeDtypeStruct(col.shape, jnp.float32)),
      vmap_method="sequential")(grad, v.codes, row, col, coef)


def _apply_call(grad, m: QuantizedArray, v: QuantizedArray, new_scales, coef, nesterov: bool):
  (block_scales,) = m.scales
  row, col = v.scales
  new_row, new_col = new_scales
  out_types = (jax.ShapeDtypeStruct(grad.shape, jnp.float32),
               jax.ShapeDtypeStruct(m.codes.shape, jnp.uint8),
               jax.ShapeDtypeStruct(block_scales.shape, jnp.float32),
               jax.ShapeDtypeStruct(v.codes.shape, jnp.uint8))
  return jax.ffi.ffi_call(
      _APPLY_TARGET, out_types, input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
      vmap_method="sequential")(grad, m.codes, block_scales, v.codes, row, col, new_row,
                                new_col, coef, jnp.asarray(_DE_TABLE),
                                nesterov=np.bool_(nesterov))


def adam_leaf(grad, moments, coef, nesterov: bool, reduce_scales=None):
  """One Adam step of a leaf `covers` accepts; returns ``(update, (m, v))``.

  ``coef``: `optax4bit.pallas.optim.adam_coefficients`. ``reduce_scales``: see
  `optax4bit.sharding.per_shard` (turns a shard's rank-1 maxima into global ones).
  """
  m, v = moments
  g = grad.astype(jnp.float32)
  new_scales = _stats_call(g, v, coef)
  if reduce_scales is not None:
    new_scales = tuple(reduce_scales(new_scales, normalize.layout_for(v.spec, v.shape)))
  update, m_codes, block_scales, v_codes = _apply_call(g, m, v, new_scales, coef, nesterov)
  new_m = QuantizedArray(m_codes, (block_scales,), m.spec, m.shape, m.dtype)
  new_v = QuantizedArray(v_codes, tuple(new_scales), v.spec, v.shape, v.dtype)
  return update.astype(grad.dtype), (new_m, new_v)


class CpuSteps:
  """The fused steps of `optax4bit.pallas.dispatch.fused_steps` on XLA's CPU
  backend: Adam only; every method returns ``(update, new_moments)`` or None
  where the kernel does not cover the leaf (the caller runs the jnp path)."""

  def adam(self, grad, moments, b1, b2, eps, eps_root, count_inc, nesterov: bool, keys=None):
    moments = tuple(moments)
    if not covers(grad, moments):
      return None
    coef = adam_coefficients(b1, b2, eps, eps_root, count_inc)

    def local(g, local_moments, side, keys, reduce_scales, consts):
      del side, keys
      return adam_leaf(g, local_moments, consts[0], nesterov, reduce_scales)

    return _sharding.run_fused(
        local, grad, moments, (), (coef,),
        lambda local_shape: covers(jax.ShapeDtypeStruct(local_shape, grad.dtype), moments), keys)

  def factored(self, *args, **kwargs):
    del args, kwargs
    return None

  def momentum(self, *args, **kwargs):
    del args, kwargs
    return None
