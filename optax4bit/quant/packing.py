"""Two 4-bit codes per uint8 along the last axis, the even element in the low
nibble; an odd last axis is padded by one zero nibble."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed_length(length: int, bits: int) -> int:
  return (length + 1) // 2 if bits == 4 else length


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Packs uint8 codes (values < 2**bits) along the last axis."""
  if bits == 8:
    return codes.astype(jnp.uint8)
  if codes.shape[-1] % 2:
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
  pairs = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
  return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: jax.Array, length: int, bits: int) -> jax.Array:
  """Inverse of `pack`: uint8 codes with last axis ``length``."""
  if bits == 8:
    return packed
  pairs = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)
  return pairs.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))[..., :length]
