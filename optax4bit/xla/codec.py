"""The XLA engine's codecs: `optax4bit.quant.array`'s, with 4-bit codes
unpacked by ops that fuse with the step (``fusible=True``, see
`optax4bit.quant.packing`): the same codes bit for bit. The 8-bit tables are
evaluated and searched in closed form (`optax4bit.quant.dynamic_map`), with no
gather: as trees of 255 selects, XLA:GPU stored the trees' intermediates (an
`adamw_8bit` update of 100M parameters compiled for an H100 moved 1231 bytes
per parameter that way; the closed form moves 34.8)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from optax4bit.quant import array as qarray
from optax4bit.quant import maps, normalize
from optax4bit.quant.spec import QuantSpec

__all__ = ["decode", "encode"]


def decode(codes, scales: tuple, spec: QuantSpec, layout: normalize.Layout,
           shape: tuple) -> Optional[jax.Array]:
  """`optax4bit.quant.array.decode`, fusible."""
  return qarray.decode(codes, scales, spec, layout, shape, fusible=True)


def encode(value: jax.Array, spec: QuantSpec, layout: normalize.Layout,
           scales: Optional[tuple], seed: Optional[jax.Array],
           row_bases: Optional[jax.Array],
           stored_codes: Optional[jax.Array] = None,
           inverses: Optional[tuple] = None) -> Optional[tuple]:
  """``(codes, scales)`` of float32 ``value``, as `optax4bit._codecs.encode`:
  under ``scales`` (None: ``value``'s own maxima; ``inverses``: their
  `optax4bit.quant.normalize.inverse_times_4`, computed beforehand),
  stochastic rounding hashed from ``seed`` and the flat index of each row's
  first element (``row_bases``, `optax4bit.quant.maps.row_hash_bases`)."""
  if scales is None:
    scales = normalize.compute_scales(normalize.finite_abs(value), layout)
  uniform = None
  if spec.stochastic:
    bases = jnp.reshape(row_bases, value.shape[:-1] + (1,))
    column = jax.lax.broadcasted_iota(jnp.uint32, value.shape, value.ndim - 1)
    uniform = maps.uniform_of_index(seed, bases + column)
  return qarray.encode(value, scales, spec, layout, uniform, stored_codes, fusible=True,
                       inverses=inverses), scales
