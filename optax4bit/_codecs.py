"""The 4-bit codecs of the jnp engine (`optax4bit._leafwise`): decode and
encode of a quantized moment or chunk, by `optax4bit.quant.array` or, while
a backend's codecs are in use (`using_codecs`, set by
`optax4bit.dispatch.codecs`' caller), by that backend's bit-identical ones."""

from __future__ import annotations

import contextlib

import jax

from optax4bit import sharding as _sharding
from optax4bit.quant import array as qarray
from optax4bit.quant import maps, normalize

# The codecs of a backend that the engine runs in place of `qarray.decode`
# and `qarray.encode` (`optax4bit.dispatch.codecs`: the C++ kernel's on CPU),
# set while an update is traced; none: the jnp ones.
_native_codecs: list = []


@contextlib.contextmanager
def using_codecs(codecs):
  """Runs the engine, while tracing inside the block, with ``codecs`` (a
  module with ``decode`` and ``encode`` as `optax4bit.cpu.codec`'s, which
  return None where they do not apply) or, for None, the jnp codecs."""
  _native_codecs.append(codecs)
  try:
    yield
  finally:
    _native_codecs.pop()


def decode(codes, scales, spec, layout, shape) -> jax.Array:
  """`optax4bit.quant.array.decode`, by the codecs in use."""
  codecs = _native_codecs[-1] if _native_codecs else None
  value = None if codecs is None else codecs.decode(codes, scales, spec, layout, shape)
  return qarray.decode(codes, scales, spec, layout, shape) if value is None else value


def hash_origin(shape, first_row=0):
  """``(origin, full_shape)`` of `maps.hashed_uniform` for rows ``first_row,
  ...`` of a leaf (of this shard's block of it, under
  `optax4bit.sharding.per_shard`): the same draw for an element of the global
  leaf whatever the chunking and sharding."""
  origin, full_shape = (0,) * len(shape), None
  shard = _sharding.shard_origin()
  if shard is not None:
    full_shape, origin = shard
  origin = (origin[0] + first_row,) + tuple(origin[1:]) if shape else ()
  return origin, full_shape


def encode(value, spec, layout, key, first_row=0, scales=None):
  """``(codes, scales)`` of float32 ``value`` (rows ``first_row, ...`` of its
  leaf): under ``scales`` (rank-1 or tensor ones of the whole leaf) or, for
  None, its own block maxima."""
  seed = origin = full_shape = None
  if spec.stochastic:
    origin, full_shape = hash_origin(value.shape, first_row)
    seed = maps.rounding_seed(key)
  codecs = _native_codecs[-1] if _native_codecs else None
  if codecs is not None:
    bases = None if seed is None else maps.row_hash_bases(value.shape, origin, full_shape)
    out = codecs.encode(value, spec, layout, scales, seed, bases)
    if out is not None:
      return out
  if scales is None:
    scales = normalize.compute_scales(normalize.finite_abs(value), layout)
  uniform = None if seed is None else maps.hashed_uniform(seed, value.shape, origin, full_shape)
  return qarray.encode(value, scales, spec, layout, uniform), scales
