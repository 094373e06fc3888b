"""The 4-bit codecs of the jnp engine (`optax4bit._leafwise`): decode and
encode of a quantized moment or chunk, by `optax4bit.quant.array` or, where
the leaf's `optax4bit._leaf_context.LeafContext` names a backend's codecs
(`optax4bit.dispatch`), by that backend's bit-identical ones."""

from __future__ import annotations

import jax

from optax4bit._leaf_context import LeafContext, shard_position
from optax4bit.quant import array as qarray
from optax4bit.quant import maps, normalize


def decode(codes, scales, spec, layout, shape, context: LeafContext) -> jax.Array:
  """`optax4bit.quant.array.decode`, by the leaf's codecs."""
  codecs = context.codecs
  value = None if codecs is None else codecs.decode(codes, scales, spec, layout, shape)
  return qarray.decode(codes, scales, spec, layout, shape) if value is None else value


def hash_origin(shape, context: LeafContext, first_row=0):
  """``(origin, full_shape)`` of `maps.hashed_uniform` for rows ``first_row,
  ...`` of a leaf (of this shard's block of it, in a per-shard runner): the
  same draw for an element of the global leaf whatever the chunking and
  sharding."""
  origin, full_shape = (0,) * len(shape), None
  position = shard_position(context.shard)
  if position is not None:
    full_shape, origin = position
  origin = (origin[0] + first_row,) + tuple(origin[1:]) if shape else ()
  return origin, full_shape


def encode(value, spec, layout, key, context: LeafContext, first_row=0, scales=None,
           stored_codes=None, inverses=None):
  """``(codes, scales)`` of float32 ``value`` (rows ``first_row, ...`` of its
  leaf): under ``scales`` (rank-1 or tensor ones of the whole leaf) or, for
  None, its own block maxima. ``stored_codes``: the packed codes ``value``
  replaces (a ``stall_only`` spec's). ``inverses``: the scales'
  `normalize.inverse_times_4`, computed beforehand; only the XLA engine's
  codecs take them."""
  seed = origin = full_shape = None
  if spec.stochastic:
    origin, full_shape = hash_origin(value.shape, context, first_row)
    seed = maps.rounding_seed(key)
  codecs = context.codecs
  if codecs is not None:
    bases = None if seed is None else maps.row_hash_bases(value.shape, origin, full_shape)
    extra = {} if inverses is None else {"inverses": inverses}
    out = codecs.encode(value, spec, layout, scales, seed, bases, stored_codes, **extra)
    if out is not None:
      return out
  if scales is None:
    scales = normalize.compute_scales(normalize.finite_abs(value), layout)
  uniform = None if seed is None else maps.hashed_uniform(seed, value.shape, origin, full_shape)
  return qarray.encode(value, scales, spec, layout, uniform, stored_codes,
                       inverses=inverses), scales
