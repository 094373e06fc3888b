"""Two 4-bit codes per uint8 along the last axis, the even element in the low
nibble; an odd last axis is padded by one zero nibble.

Pairs of codes are read and written as one little-endian uint16 (a bitcast), so
XLA's CPU backend vectorizes packing instead of de-interleaving bytes element
by element. On accelerators the bitcast of `unpack` ends a fusion (XLA:GPU
writes the codes out as uint16 and reads them back): `unpack_fusible` gives
the same codes by a repeat and shifts, which fuse with the step that reads
them. (Packing the same way splits the step's fusion in two on XLA:GPU: the
bitcast `pack` is kept.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed_length(length: int, bits: int) -> int:
  return (length + 1) // 2 if bits == 4 else length


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Packs uint8 codes (values < 2**bits) along the last axis."""
  codes = codes.astype(jnp.uint8)
  if bits == 8:
    return codes
  if codes.shape[-1] % 2:
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
  pairs = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
  word = jax.lax.bitcast_convert_type(pairs, jnp.uint16)  # even code in the low byte
  return ((word & 0x000F) | ((word >> 4) & 0x00F0)).astype(jnp.uint8)


def unpack(packed: jax.Array, length: int, bits: int) -> jax.Array:
  """Inverse of `pack`: uint8 codes with last axis ``length``."""
  if bits == 8:
    return packed
  wide = packed.astype(jnp.uint16)
  word = (wide & 0x000F) | ((wide & 0x00F0) << 4)
  codes = jax.lax.bitcast_convert_type(word, jnp.uint8)
  return codes.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))[..., :length]


def unpack_fusible(packed: jax.Array, length: int, bits: int) -> jax.Array:
  """`unpack` without a bitcast: the same codes, fusible on accelerators
  (each byte repeated, then shifted by the parity of the element)."""
  if bits == 8:
    return packed
  repeated = jnp.repeat(packed, 2, axis=-1)
  odd = jax.lax.broadcasted_iota(jnp.uint8, repeated.shape, repeated.ndim - 1) & 1
  return ((repeated >> (odd << 2)) & 0x0F)[..., :length]
