"""The C++ kernel's 4-bit codecs on XLA's CPU backend: decode and encode of
one quantized array, for the jnp engine's chunks where no fused step exists
(`optax4bit.quantize_state` around any optax optimizer).

Three FFI targets of the same library as the fused Adam step, on the same
row kernels (its ISA paths included):

* ``decode``: ``table[code] * scale`` of ``B128`` (any 4-bit map) or
  ``Rank-1`` codes (the scale ``min(row max, column max)``);
* ``encode_block``: ``B128`` codes and block maxima of float32 values under a
  4-bit map encoded by thresholds (``DE``, ``NF``, ``DE-0``, ``SqrtDE-0``,
  ``SqrtLinear``),
  rounded to the nearest entry, stochastically (the draws of
  `optax4bit.quant.maps.hashed_uniform`) or, for a ``stall_only`` spec given
  the codes the values replace, stochastically only where the nearest code
  is the stored one;
* ``encode_rank1``: ``Rank-1/Linear``, ``Rank-1/SqrtDE-0`` or ``Rank-1/SqrtLinear``
  codes under given scales (those of the whole leaf, from the engine's first
  pass), rounded the same ways.

Each equals `optax4bit.quant.array.decode` / ``encode`` bit for bit (the same
normalization ``(x * (4 / scale)) * 0.25``, NaN read as 0, the same tables,
subnormals flushed). The functions return None where they do not apply (the
caller runs the jnp codec): other bit widths, block sizes or maps, rank-1
leaves of other than two axes, a last axis that is not a multiple of 128.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.cpu import ffi
from optax4bit.cpu.kernel_call import kernel_call
from optax4bit.quant import maps, normalize
from optax4bit.quant.spec import QuantSpec

__all__ = ["available", "decode", "encode", "registered"]

_DECODE = "optax4bit_decode_4bit"
_ENCODE_BLOCK = "optax4bit_encode_block_4bit"
_ENCODE_RANK1 = "optax4bit_encode_rank1_4bit"
_BLOCK_MAPS = ("DE", "NF", "DE-0", "SqrtDE-0", "SqrtLinear")
_RANK1_MAPS = ("Linear", "SqrtDE-0", "SqrtLinear")


@functools.cache
def registered() -> bool:
  """Whether the library loads; registers the codecs' targets once."""
  library = ffi.library()
  if library is None:
    return False
  for name, symbol in ((_DECODE, library.Optax4bitDecode4bit),
                       (_ENCODE_BLOCK, library.Optax4bitEncodeBlock4bit),
                       (_ENCODE_RANK1, library.Optax4bitEncodeRank14bit)):
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
  return True


def available() -> bool:
  """Whether ``implementation="auto"`` runs the codecs: the library loads and
  its ISA path beats the jnp path (`optax4bit.cpu.faster_than_jnp`)."""
  return registered() and ffi.faster_than_jnp()


def _rows(spec: QuantSpec, layout: normalize.Layout, shape: tuple) -> Optional[int]:
  """Rows of the 2-D view the codecs take, or None where they do not apply."""
  if spec.bits != 4 or not shape or shape[-1] % 128 or math.prod(shape) == 0:
    return None
  if layout.normalization == "block" and layout.block_size == 128 and layout.rows_per_block == 1:
    return math.prod(shape[:-1])
  if layout.normalization == "rank1" and len(shape) == 2:
    return shape[0]
  return None


def decode(codes, scales: tuple, spec: QuantSpec, layout: normalize.Layout,
           shape: tuple) -> Optional[jax.Array]:
  """`optax4bit.quant.array.decode`, or None where the codec does not apply."""
  rows = _rows(spec, layout, shape)
  if rows is None or spec.mapping not in maps.MAPPINGS:
    return None
  rank1 = layout.normalization == "rank1"
  first = scales[0].reshape(rows, -1)
  col = scales[1].reshape(1, -1) if rank1 else jnp.zeros((1,), jnp.float32)
  table = jnp.asarray(maps.qmap(spec.mapping, 4, spec.signed))
  values = kernel_call(_DECODE, jax.ShapeDtypeStruct((rows, shape[-1]), jnp.float32),
                       vmap_method="sequential")(
      codes.reshape(rows, -1), first, col, table, rank1=np.bool_(rank1))
  return values.reshape(shape)


def _tables(spec: QuantSpec) -> jax.Array:
  """The map's 16 entries, then its 15 midpoint thresholds."""
  return jnp.asarray(np.concatenate([maps.qmap(spec.mapping, 4, spec.signed),
                                     maps.midpoint_thresholds(spec.mapping, 4, spec.signed)]))


def _seeds_and_bases(seed: Optional[jax.Array], row_bases: Optional[jax.Array], rows: int):
  """The uint32 rounding seed (1,) and row hash bases (rows,) of a call (zeros
  for nearest rounding)."""
  seeds = jnp.zeros((1,), jnp.uint32) if seed is None else jnp.reshape(seed, (1,))
  bases = jnp.zeros((rows,), jnp.uint32) if row_bases is None else row_bases
  return seeds.astype(jnp.uint32), bases.astype(jnp.uint32)


def encode(x: jax.Array, spec: QuantSpec, layout: normalize.Layout, scales: Optional[tuple],
           seed: Optional[jax.Array], row_bases: Optional[jax.Array],
           stored_codes: Optional[jax.Array] = None):
  """``(codes, scales)`` as `optax4bit.quant.array.encode` gives them for
  float32 ``x``, or None where the codec does not apply.

  Block scales are computed here (``scales`` None); rank-1 ones are given.
  ``seed`` and ``row_bases`` (`optax4bit.quant.maps.rounding_seed`,
  `optax4bit.quant.maps.row_hash_bases`): stochastic rounding's draws.
  ``stored_codes``: the packed codes ``x`` replaces, which a ``stall_only``
  spec reads (None: it rounds stochastically everywhere).
  """
  shape = tuple(x.shape)
  rows = _rows(spec, layout, shape)
  if rows is None:
    return None
  stall = spec.stall_only and stored_codes is not None
  stored = (jnp.reshape(stored_codes, (rows, shape[-1] // 2)).astype(jnp.uint8) if stall
            else jnp.zeros((0,), jnp.uint8))
  if layout.normalization == "block":
    if spec.mapping not in _BLOCK_MAPS or scales is not None:
      return None
    codes, block_scales = kernel_call(
        _ENCODE_BLOCK,
        (jax.ShapeDtypeStruct((rows, shape[-1] // 2), jnp.uint8),
         jax.ShapeDtypeStruct((rows, shape[-1] // 128), jnp.float32)),
        vmap_method="sequential")(x.reshape(rows, -1), _tables(spec),
                                  *_seeds_and_bases(seed, row_bases, rows), stored,
                                  stochastic=np.bool_(spec.stochastic), stall=np.bool_(stall))
    return (codes.reshape(shape[:-1] + (shape[-1] // 2,)),
            (block_scales.reshape(shape[:-1] + (shape[-1] // 128,)),))
  if spec.mapping not in _RANK1_MAPS or spec.signed or scales is None:
    return None
  codes = kernel_call(_ENCODE_RANK1, jax.ShapeDtypeStruct((rows, shape[-1] // 2), jnp.uint8),
                      vmap_method="sequential")(
      x, scales[0], scales[1], _tables(spec), *_seeds_and_bases(seed, row_bases, rows), stored,
      linear=np.bool_(spec.mapping == "Linear" and not spec.stochastic),
      stochastic=np.bool_(spec.stochastic), stall=np.bool_(stall))
  return codes, tuple(scales)
