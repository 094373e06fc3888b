"""Two 4-bit codes per uint8 along the last axis, the even element in the low
nibble; an odd last axis is padded by one zero nibble.

Pairs of codes are read and written as one little-endian uint16 (a bitcast), so
XLA vectorizes packing instead of de-interleaving bytes element by element.
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
