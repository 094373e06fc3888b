"""The fused XLA CPU kernels of the 4-bit optimizers and of 8-bit Adam, called
through ``jax.ffi``.

The C++ library (``kernels.cc``, built by ``setup.py`` as an optional
extension; the handlers of each step in its ``*_ffi.h``) registers FFI
targets for XLA's CPU backend. Its row kernels
(``encode_rows.h`` and ``adam_4bit_rows.h``, one set shared by all steps;
``first_moment_rows.h`` runs them for the steps without a quantized second
moment) are compiled per ISA path (`isas`); calls run the best one this CPU
runs (`isa`) unless ``OPTAX4BIT_CPU_ISA`` names another. They cover a leaf
of two axes or more (e.g. layers stacked for ``jax.lax.scan``: the rows are
the product of the leading axes) whose last axis is a multiple of 128, with
both recipes of `optax4bit.recipes` and any pairing of their quantizers (4
bits):

* first moment ``B128/DE`` or ``B128/NF``, rounded to the nearest entry,
  stochastically or stochastically where stalled (``stall_only``: the
  nearest code is the stored one) (the default recipe: ``B128/NF``,
  stochastic);
* second moment ``Rank-1/Linear``, ``Rank-1/SqrtDE-0`` or ``Rank-1/SqrtLinear``,
  rounded the same ways (the default recipe: ``Rank-1/SqrtLinear``,
  stochastic).

The maps' entries and thresholds (`_tables`) and the per-leaf stochastic
rounding seeds (`optax4bit.quant.maps.rounding_seed` of the moment's key) are
inputs of the calls. One Adam update (`CpuSteps.adam`) is two calls:

1. ``stats``: the row and column maxima of the new second moment (rank-1
   scales need the whole new moment before any element is encoded);
2. ``apply``: row by row, decode both moments, run the float32 Adam step,
   write the update over the (float32) gradient and re-encode both moments in
   place (``input_output_aliases``), split over as many threads as XLA's
   intra-op pool has.

The steps whose only quantized moment is the first are one call,
``first_moment_apply``, that does the same row by row with the first moment
alone: heavy-ball momentum (`CpuSteps.momentum`, ``sgdm_4bit``) and Adam with
a factored second moment (`CpuSteps.factored`, ``adamw_4bit_factor``; the
factors, updated by the jnp code of `optax4bit.transform`, come in as
inputs, per slice of a leaf of more than two axes).

It also covers `optax4bit.adamw_8bit`: both moments ``B256/DE`` with 8 bits
(the second also ``B256/DE-0``), nearest rounding, on a leaf of two axes or
more whose last axis is a multiple of 256. Block scales need no statistics of
the whole leaf: one call (``apply_8bit``) per leaf. Its nearest rounding looks
each code up in a table of buckets of the normalized value (`_buckets`)
instead of the jnp path's binary search over 255 thresholds; the codes are
the same.

It computes what the jnp reference computes, in the form XLA's CPU backend
compiles it to for a leaf the jnp path runs in chunks (every leaf of two rows
or more; see ``kernels.cc``): codes, scales and updates are bit for bit
those of ``implementation="jnp"`` there, stochastic rounding included (its
draws are `optax4bit.quant.maps.hashed_uniform`'s). For a one-row leaf XLA
compiles the reference's Adam update differently and the two may differ in the
last bits. Other leaves, quantizers and optimizers run the jnp reference.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.metadata
import logging
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax4bit._fused_leaf import run_fused
from optax4bit._leaf_context import LeafContext, shard_position
from optax4bit._steps import FusedStep, adam_coefficients
from optax4bit.cpu.kernel_call import kernel_call
from optax4bit.quant import maps, normalize
from optax4bit.quant.array import QuantizedArray
from optax4bit.quant.spec import QuantSpec

__all__ = ["available", "faster_than_jnp", "isa", "isas", "unavailable_reason", "covers",
           "covers_first_moment", "adam_leaf", "first_moment_leaf", "CpuSteps"]

_LIBRARY = "_kernels"
_STATS_TARGET = "optax4bit_adam_4bit_stats"
_APPLY_TARGET = "optax4bit_adam_4bit_apply"
_FIRST_MOMENT_TARGET = "optax4bit_first_moment_apply"
# The quantizers the kernel runs: every combination of a first and a second
# moment, each rounded to nearest, stochastically or by the stall rule.
_ROUNDINGS = ({"stochastic": False}, {"stochastic": True},
              {"stochastic": True, "stall_only": True})
_FIRST_MOMENTS = tuple(QuantSpec("block", mapping, 4, signed=True, block_size=128, **rounding)
                       for mapping in ("DE", "NF") for rounding in _ROUNDINGS)
_SECOND_MOMENTS = tuple(QuantSpec("rank1", mapping, 4, signed=False, **rounding)
                        for mapping in ("Linear", "SqrtDE-0", "SqrtLinear")
                        for rounding in _ROUNDINGS)
_APPLY_8BIT_TARGET = "optax4bit_adam_8bit_apply"
# The 8-bit quantizers (`optax4bit.adamw_8bit`'s, and its second moment without zero).
_FIRST_MOMENTS_8BIT = (QuantSpec("block", "DE", 8, signed=True, block_size=256),)
_SECOND_MOMENTS_8BIT = tuple(QuantSpec("block", mapping, 8, signed=False, block_size=256)
                             for mapping in ("DE", "DE-0"))
# The buckets of the 8-bit kernel's nearest rounding (NearestCodes256 in
# adam_8bit_rows.h, same constants): |n| clamped to [2**-23, 1], its exponent
# and top 7 mantissa bits.
_BUCKET_LOW_BITS = (127 - 23) << 23
_BUCKET_HIGH_BITS = 127 << 23
_BUCKET_SHIFT = 23 - 7
_BUCKETS = ((_BUCKET_HIGH_BITS - _BUCKET_LOW_BITS) >> _BUCKET_SHIFT) + 1


@functools.cache
def _first_moment_tables(mapping: str) -> np.ndarray:
  """The first moment's 16 entries, then the 15 thresholds nearest rounding
  compares with (the ``tables`` input of the first-moment call)."""
  return np.concatenate([maps.qmap(mapping, 4, True),
                         maps.midpoint_thresholds(mapping, 4, True)]).astype(np.float32)


@functools.cache
def _tables(first_mapping: str, second_mapping: str) -> np.ndarray:
  """The Adam calls' ``tables`` input: each moment's 16 entries, then the 15
  thresholds nearest rounding compares with; first moment, then second."""
  return np.concatenate([_first_moment_tables(first_mapping),
                         maps.qmap(second_mapping, 4, False),
                         maps.midpoint_thresholds(second_mapping, 4, False)]).astype(np.float32)


@functools.cache
def _tables_8bit(first_mapping: str, second_mapping: str) -> np.ndarray:
  """The 8-bit kernel's ``tables`` input: each moment's 256 entries."""
  return np.concatenate([maps.qmap(first_mapping, 8, True),
                         maps.qmap(second_mapping, 8, False)]).astype(np.float32)


def _moment_buckets(mapping: str, signed: bool) -> np.ndarray:
  """The entries of NearestCodes256 (adam_8bit_rows.h) for one map: per
  bucket of n (positive n, then negative), ``count << 16 | key``: the count
  of thresholds below all of the bucket's values and the key of the one
  threshold the bucket holds (0xffff if none)."""
  thresholds = maps.midpoint_thresholds(mapping, 8, signed)
  b = np.arange(_BUCKETS, dtype=np.int64)
  # The bucket's |n| range, 0 and +inf taken in by the clamp at the ends.
  low = np.where(b == 0, 0, _BUCKET_LOW_BITS + (b << _BUCKET_SHIFT))
  high = np.where(b == _BUCKETS - 1, 0x7F800000,
                  _BUCKET_LOW_BITS + ((b + 1) << _BUCKET_SHIFT) - 1)
  low, high = (x.astype(np.uint32).view(np.float32) for x in (low, high))
  below = lambda x: np.searchsorted(thresholds, x, side="left")  # thresholds < x
  ends = (b == 0) | (b == _BUCKETS - 1)  # n's low bits say nothing there
  entries = []
  # n in [low, high] (negative: [-high, -low]) is above the thresholds below
  # low (-high); the bucket holds those in [low, high) ([-high, -low)).
  for first, end, flip in ((below(low), below(high), 0), (below(-high), below(-low), 0xFFFF)):
    held = end - first
    if held.max() > 1 or held[ends].any():
      raise ValueError(f"8-bit {mapping}: a bucket of n holds more than one threshold, "
                       "or one where the clamp takes n in")
    bits = thresholds[np.minimum(first, thresholds.size - 1)].view(np.uint32).astype(np.int64)
    key = np.where(held == 1, (bits & 0xFFFF) ^ flip, 0xFFFF)
    entries.append(first << 16 | key)
  return np.concatenate(entries).astype(np.int32)


@functools.cache
def _buckets(first_mapping: str, second_mapping: str) -> np.ndarray:
  """The 8-bit kernel's ``buckets`` input: first moment, then second."""
  return np.concatenate([_moment_buckets(first_mapping, True),
                         _moment_buckets(second_mapping, False)])


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


# Forces the ISA path of the row kernels ("avx512", "avx2" or "baseline"),
# read when the library loads; for tests and benchmarks.
ISA_ENV = "OPTAX4BIT_CPU_ISA"
# The ISA paths whose kernels (Adam, momentum, factored) beat the jnp path
# (benchmarks/RESULTS.md); the baseline x86-64 path, without AVX2's 8-lane
# permutes, does not. The baseline path of aarch64, NEON code, is not yet
# timed against the jnp path on aarch64 hardware (only its instructions are
# counted, under qemu): "auto" runs jnp there until it is.
_FASTER_THAN_JNP = frozenset({"avx512", "avx2"})
_library = None  # set by `_load`


@functools.cache
def _load() -> Optional[str]:
  """Loads the library and registers its targets; returns why it cannot,
  logged once (the jnp path runs instead)."""
  reason = _load_library()
  if reason is not None:
    logging.getLogger(__name__).warning("optax4bit runs its jnp path on CPU: %s.", reason)
  return reason


def _load_library() -> Optional[str]:
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
  library.Optax4bitCpuIsa.restype = ctypes.c_char_p
  library.Optax4bitCpuIsas.restype = ctypes.c_char_p
  forced = os.environ.get(ISA_ENV)
  if forced and not library.Optax4bitUseCpuIsa(forced.encode()):
    return (f"{ISA_ENV}={forced} names no ISA path this CPU runs "
            f"({library.Optax4bitCpuIsas().decode()})")
  global _library
  _library = library
  jax.ffi.register_ffi_target(
      _STATS_TARGET, jax.ffi.pycapsule(library.Optax4bitAdam4bitStats), platform="cpu")
  jax.ffi.register_ffi_target(
      _APPLY_TARGET, jax.ffi.pycapsule(library.Optax4bitAdam4bitApply), platform="cpu")
  jax.ffi.register_ffi_target(_FIRST_MOMENT_TARGET,
                              jax.ffi.pycapsule(library.Optax4bitFirstMomentApply),
                              platform="cpu")
  jax.ffi.register_ffi_target(
      _APPLY_8BIT_TARGET, jax.ffi.pycapsule(library.Optax4bitAdam8bitApply), platform="cpu")
  return None


def available() -> bool:
  """Whether the compiled CPU kernel is installed and usable with this jaxlib.

  Example:
    >>> import optax4bit.cpu
    >>> isinstance(optax4bit.cpu.available(), bool)
    True
  """
  return _load() is None


def faster_than_jnp() -> bool:
  """Whether ``implementation="auto"`` runs the kernel on this CPU: where the
  ISA path it runs (`isa`) beats the jnp path (decided by ISA, never by
  timing): AVX-512 and AVX2. Elsewhere ``"auto"`` runs the jnp path: on
  x86-64 without AVX2 the kernel is slower (issue 15), on aarch64 its NEON
  path is not yet timed against it; ``implementation="cpu"`` still forces the
  kernel.

  Example:
    >>> import optax4bit.cpu
    >>> isinstance(optax4bit.cpu.faster_than_jnp(), bool)
    True
  """
  return isa() in _FASTER_THAN_JNP


def isa() -> Optional[str]:
  """The ISA path the kernel runs: ``"avx512"``, ``"avx2"`` or ``"baseline"``
  (the best this CPU runs unless ``OPTAX4BIT_CPU_ISA`` names another); None
  where the kernel is unavailable.

  Example:
    >>> import optax4bit.cpu
    >>> optax4bit.cpu.isa() in (None, "avx512", "avx2", "baseline")
    True
  """
  return None if _load() is not None else _library.Optax4bitCpuIsa().decode()


def isas() -> tuple:
  """The ISA paths this CPU runs, best first (empty where the kernel is
  unavailable)."""
  return () if _load() is not None else tuple(_library.Optax4bitCpuIsas().decode().split(","))


def _use_isa(name: str) -> None:
  """Makes later kernel calls, of compiled functions too, run the ISA path
  ``name`` (for tests; block on results before switching back: dispatch is
  asynchronous)."""
  if _load() is not None or not _library.Optax4bitUseCpuIsa(name.encode()):
    raise ValueError(f"this CPU runs the ISA paths {isas()}, not {name!r}")


def library() -> Optional[ctypes.CDLL]:
  """The loaded C++ library (its codecs' handlers live there too,
  `optax4bit.cpu.codec`), or None where it is unavailable."""
  return None if _load() is not None else _library


def unavailable_reason() -> Optional[str]:
  """Why `available` is False (None when it is True)."""
  return _load()


def _covers_grad(grad) -> bool:
  shape = tuple(grad.shape)
  return (len(shape) >= 2 and math.prod(shape[:-1]) > 0 and shape[-1] % 128 == 0
          and jnp.issubdtype(grad.dtype, jnp.floating))


# Leaves of more than two axes (e.g. layers stacked for jax.lax.scan) run as
# their rows: the kernels take the product of the leading axes as the rows
# (codes and block scales are laid out by rows already; reshaping a donated
# gradient instead would make XLA copy it). Their rank-1 scales are one vector
# per axis, where the kernels take a row scale and a column scale.
def _rank1_row_scales(scales: tuple, rows: int, encode: bool = False) -> tuple:
  """``(row, col)`` scales of a leaf's rows from its per-axis rank-1 scales.

  To decode, a row's scale is the minimum of its leading axes' entries (min
  is associative: the jnp path's scale). To encode, the jnp path multiplies
  by the largest of the axes' ``normalize.inverse_times_4``, which is 0 for a
  0 scale: the minimum of the positive entries (0 if none) has that inverse.
  """
  leading = scales[:-1]
  if encode:
    row = functools.reduce(jnp.minimum, [jnp.where(s > 0, s, jnp.inf) for s in leading])
    row = jnp.where(row < jnp.inf, row, 0.0)
  else:
    row = functools.reduce(jnp.minimum, leading)
  return row.reshape(rows, 1), scales[-1].reshape(1, -1)


def _rank1_axis_maxima(row_max, col_max, layout: normalize.Layout, shape: tuple) -> tuple:
  """Per-axis rank-1 maxima of a leaf of ``shape`` from its rows' and
  columns' maxima: the leading axes' by `normalize.compute_scales` over the
  row maxima (a maximum of maxima is exact)."""
  leading = normalize.compute_scales(row_max.reshape(shape[:-1] + (1,)), layout)[:-1]
  return leading + (col_max.reshape((1,) * (len(shape) - 1) + (-1,)),)


def covers(grad, moments) -> bool:
  """Whether the Adam kernel computes this leaf: a floating-point leaf of two
  axes or more (run as its rows, see `_rank1_row_scales`) with at least one
  row and moments quantized

  * with 4 bits as ``B128/DE`` or ``B128/NF`` (signed) and ``Rank-1/Linear``,
    ``Rank-1/SqrtDE-0`` or ``Rank-1/SqrtLinear`` (unsigned), each rounded to
    the nearest entry, stochastically or by the stall rule (``stall_only``),
    the last axis a multiple of 128; or
  * with 8 bits as ``B256/DE`` (signed) and ``B256/DE`` or ``B256/DE-0``
    (unsigned), nearest rounding (`optax4bit.adamw_8bit`), the last axis a
    multiple of 256 (blocks within rows)."""
  if len(moments) != 2 or not all(isinstance(m, QuantizedArray) for m in moments):
    return False
  m, v = moments
  if not _covers_grad(grad):
    return False
  if m.spec in _FIRST_MOMENTS_8BIT and v.spec in _SECOND_MOMENTS_8BIT:
    return grad.shape[-1] % 256 == 0
  return m.spec in _FIRST_MOMENTS and v.spec in _SECOND_MOMENTS


def covers_first_moment(grad, moment) -> bool:
  """Whether the momentum and factored kernels compute this leaf: a leaf
  `covers` accepts, with its first moment (the only quantized one) as there."""
  return (isinstance(moment, QuantizedArray) and moment.spec in _FIRST_MOMENTS
          and _covers_grad(grad))


def _is_8bit(moments) -> bool:
  return moments[0].spec.bits == 8


def _coefficients(b1, b2, eps, eps_root, count_inc) -> jax.Array:
  """`optax4bit._steps.adam_coefficients`, then the bias corrections
  ``1 - b2**t`` and ``1 - b1**(t + 1)`` by the expressions of
  `optax4bit._steps.adam_step`: XLA's CPU backend divides by them."""
  correction2 = 1 - b2**count_inc
  correction1_next = 1 - b1**optax.safe_increment(count_inc)
  return jnp.concatenate([adam_coefficients(b1, b2, eps, eps_root, count_inc),
                          jnp.stack([correction2, correction1_next]).astype(jnp.float32)])


def _tables_of(m: QuantizedArray, v: QuantizedArray):
  return jnp.asarray(_tables(m.spec.mapping, v.spec.mapping))


def _stats_call(grad, m: QuantizedArray, v: QuantizedArray, coef):
  row, col = v.scales
  return kernel_call(
      _STATS_TARGET,
      (jax.ShapeDtypeStruct(row.shape, jnp.float32), jax.ShapeDtypeStruct(col.shape, jnp.float32)),
      vmap_method="sequential")(grad, v.codes, row, col, coef, _tables_of(m, v))


def _seeds(moments, keys):
  """uint32 stochastic rounding seeds (`maps.rounding_seed`), 0 for a moment
  rounded to the nearest entry."""
  seeds = []
  for moment, key in zip(moments, keys):
    if moment.spec.stochastic:
      if key is None:
        raise ValueError(f"{moment.spec} rounds stochastically and needs a PRNG key.")
      seeds.append(maps.rounding_seed(key))
    else:
      seeds.append(jnp.uint32(0))
  return jnp.stack(seeds).astype(jnp.uint32)


def _apply_call(grad, m: QuantizedArray, v: QuantizedArray, new_scales, coef, nesterov: bool,
                seeds, row_bases):
  (block_scales,) = m.scales
  row, col = v.scales
  new_row, new_col = new_scales
  out_types = (jax.ShapeDtypeStruct(grad.shape, jnp.float32),
               jax.ShapeDtypeStruct(m.codes.shape, jnp.uint8),
               jax.ShapeDtypeStruct(block_scales.shape, jnp.float32),
               jax.ShapeDtypeStruct(v.codes.shape, jnp.uint8))
  return kernel_call(
      _APPLY_TARGET, out_types, input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3},
      vmap_method="sequential")(grad, m.codes, block_scales, v.codes, row, col, new_row,
                                new_col, coef, _tables_of(m, v), seeds, row_bases,
                                nesterov=np.bool_(nesterov),
                                m_stochastic=np.bool_(m.spec.stochastic),
                                v_stochastic=np.bool_(v.spec.stochastic),
                                v_linear=np.bool_(v.spec.mapping == "Linear"
                                                  and not v.spec.stochastic),
                                m_stall=np.bool_(m.spec.stall_only),
                                v_stall=np.bool_(v.spec.stall_only))


def _row_bases(shape, shard=None):
  """Each row's flat index in the whole leaf (global on a ``shard``, an
  `optax4bit._leaf_context.Shard`), for the stochastic rounding hash."""
  position = shard_position(shard)
  return (maps.row_hash_bases(shape) if position is None else
          maps.row_hash_bases(shape, position[1], position[0]))


def adam_leaf(grad, moments, coef, nesterov: bool, shard=None, keys=(None, None)):
  """One Adam step of a leaf `covers` accepts; returns ``(update, (m, v))``.

  ``coef``: `_coefficients`. ``shard``: the `optax4bit._leaf_context.Shard`
  run (its ``reduce_scales`` turns a shard's rank-1 maxima into global ones),
  or None for a whole leaf. ``keys``: one PRNG key (or None) per moment; a
  moment rounded stochastically needs one (its draws are those of
  `maps.hashed_uniform`).
  """
  m, v = moments
  seeds = _seeds(moments, keys)
  g = grad.astype(jnp.float32)
  rows = math.prod(g.shape[:-1])
  v_rows = QuantizedArray(v.codes, _rank1_row_scales(v.scales, rows), v.spec, v.shape, v.dtype)
  layout = normalize.layout_for(v.spec, v.shape)
  new_scales = _rank1_axis_maxima(*_stats_call(g, m, v_rows, coef), layout, g.shape)
  if shard is not None:
    new_scales = tuple(shard.reduce_scales(new_scales, layout))
  update, m_codes, block_scales, v_codes = _apply_call(
      g, m, v_rows, _rank1_row_scales(new_scales, rows, encode=True), coef, nesterov, seeds,
      _row_bases(g.shape, shard))
  new_m = QuantizedArray(m_codes, (block_scales,), m.spec, m.shape, m.dtype)
  new_v = QuantizedArray(v_codes, tuple(new_scales), v.spec, v.shape, v.dtype)
  return update.astype(grad.dtype), (new_m, new_v)


def first_moment_leaf(step: str, grad, m: QuantizedArray, coef, side=(), key=None, shard=None):
  """One step of a leaf `covers_first_moment` accepts whose only quantized
  moment is the first; returns ``(update, m)``.

  ``step``: ``"momentum"`` or ``"momentum_nesterov"`` (``coef``:
  `optax4bit._steps.momentum_coefficients`) or ``"factored"`` (``coef``:
  `_coefficients`; ``side``: the ``(row, col, row_mean)`` of the factored
  second moment, see `optax4bit._steps.factored_step`). ``key``: the PRNG key
  of a first moment rounded stochastically (else None). ``shard``: as in
  `adam_leaf` (block scales need no other shard: only its position counts).
  """
  (block_scales,) = m.scales
  g = grad.astype(jnp.float32)
  if step == "factored":  # per slice (leading index) of a leaf of more than two axes
    row, col, row_mean = side
    factors = (row.reshape(-1), col.reshape(-1), row_mean.reshape(-1))
  else:
    factors = (jnp.zeros((0,), jnp.float32),) * 3
  seed = _seeds((m,), (key,))
  out_types = (jax.ShapeDtypeStruct(g.shape, jnp.float32),
               jax.ShapeDtypeStruct(m.codes.shape, jnp.uint8),
               jax.ShapeDtypeStruct(block_scales.shape, jnp.float32))
  update, codes, block_scales = kernel_call(
      _FIRST_MOMENT_TARGET, out_types, input_output_aliases={0: 0, 1: 1, 2: 2},
      vmap_method="sequential")(g, m.codes, block_scales, coef,
                                jnp.asarray(_first_moment_tables(m.spec.mapping)), seed,
                                _row_bases(g.shape, shard), *factors, step=step,
                                m_stochastic=np.bool_(m.spec.stochastic),
                                m_stall=np.bool_(m.spec.stall_only))
  new_m = QuantizedArray(codes, (block_scales,), m.spec, m.shape, m.dtype)
  return update.astype(grad.dtype), new_m


def _apply_8bit_call(grad, m: QuantizedArray, v: QuantizedArray, coef, nesterov: bool):
  (m_scales,), (v_scales,) = m.scales, v.scales
  out_types = (jax.ShapeDtypeStruct(grad.shape, jnp.float32),
               jax.ShapeDtypeStruct(m.codes.shape, jnp.uint8),
               jax.ShapeDtypeStruct(m_scales.shape, jnp.float32),
               jax.ShapeDtypeStruct(v.codes.shape, jnp.uint8),
               jax.ShapeDtypeStruct(v_scales.shape, jnp.float32))
  mappings = (m.spec.mapping, v.spec.mapping)
  return kernel_call(
      _APPLY_8BIT_TARGET, out_types, input_output_aliases={0: 0, 1: 1, 2: 2, 3: 3, 4: 4},
      vmap_method="sequential")(grad, m.codes, m_scales, v.codes, v_scales, coef,
                                jnp.asarray(_tables_8bit(*mappings)),
                                jnp.asarray(_buckets(*mappings)), nesterov=np.bool_(nesterov))


def adam_8bit_leaf(grad, moments, coef, nesterov: bool):
  """One Adam step of an 8-bit leaf `covers` accepts, in one call (block
  scales need no statistics of the whole leaf); returns ``(update, (m, v))``."""
  m, v = moments
  update, m_codes, m_scales, v_codes, v_scales = _apply_8bit_call(
      grad.astype(jnp.float32), m, v, coef, nesterov)
  new_m = QuantizedArray(m_codes, (m_scales,), m.spec, m.shape, m.dtype)
  new_v = QuantizedArray(v_codes, (v_scales,), v.spec, v.shape, v.dtype)
  return update.astype(grad.dtype), (new_m, new_v)


class CpuSteps:
  """The fused steps of `optax4bit.dispatch.resolve` on XLA's CPU backend:
  Adam, Adam with a factored second moment and momentum."""

  def run(self, step: FusedStep, grad, moments, side=(), keys=None, *,
          context: LeafContext = LeafContext()):
    """``step`` on one leaf: ``(update, new_moments)``, or None where the
    kernel does not cover the leaf (the caller runs the jnp path). ``side``:
    for ``"factored"``, the ``(row, col, row_mean)`` of the (already updated)
    factored second moment, as `optax4bit.transform` computes them; ``keys``:
    one PRNG key (or None) per moment; ``context``: the leaf's."""
    moments = tuple(moments)
    if step.kind.startswith("adam"):
      return self._adam(grad, moments, step, keys, context)
    coef = (_coefficients(step.b1, step.b2, step.eps, step.eps_root, step.count_inc)
            if step.kind == "factored" else step.coefficients())
    return self._first_moment(step.kind, grad, moments[0], side, coef, keys, context)

  def _adam(self, grad, moments, step: FusedStep, keys, context):
    nesterov = step.nesterov
    if not covers(grad, moments):
      return None
    keys = (None,) * len(moments) if keys is None else tuple(keys)
    if any(m.spec.stochastic and k is None for m, k in zip(moments, keys)):
      return None  # the jnp path raises its error
    coef = _coefficients(step.b1, step.b2, step.eps, step.eps_root, step.count_inc)

    def local(g, local_moments, side, local_keys, shard, consts):
      del side
      if _is_8bit(local_moments):
        return adam_8bit_leaf(g, local_moments, consts[0], nesterov)
      return adam_leaf(g, local_moments, consts[0], nesterov, shard, local_keys)

    return run_fused(
        local, grad, moments, (), (coef,),
        lambda local_shape: covers(jax.ShapeDtypeStruct(local_shape, grad.dtype), moments),
        context, keys, hashes_global_index=True)

  def _first_moment(self, step, grad, moment, side, coef, keys, context):
    if not covers_first_moment(grad, moment):
      return None
    keys = (None,) if keys is None else tuple(keys)
    if moment.spec.stochastic and keys[0] is None:
      return None  # the jnp path raises its error

    def local(g, local_moments, local_side, local_keys, shard, consts):
      update, m = first_moment_leaf(step, g, local_moments[0], consts[0], local_side,
                                    local_keys[0], shard)
      return update, (m,)

    return run_fused(
        local, grad, (moment,), tuple(side), (coef,),
        lambda local_shape: covers_first_moment(
            jax.ShapeDtypeStruct(local_shape, grad.dtype), moment), context, keys,
        hashes_global_index=True)
