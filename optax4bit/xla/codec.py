"""The XLA engine's codecs: `optax4bit.quant.array`'s, with 8-bit tables
searched and decoded by trees of selects instead of gathers (on a TPU a
gather from a 256-entry table is a slow op; `optax4bit.quant.maps`), and 4-bit
codes unpacked by ops that fuse with the step (`optax4bit.quant.packing`):
``fusible=True``.
Codes are bit for bit those of the jnp reference: the same compares against
the same thresholds, the same stochastic rounding hash, the same bytes."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from optax4bit.quant import array as qarray
from optax4bit.quant import maps, normalize
from optax4bit.quant.spec import QuantSpec

__all__ = ["decode", "encode"]


def decode(codes, scales: tuple, spec: QuantSpec, layout: normalize.Layout,
           shape: tuple) -> jax.Array:
  """`optax4bit.quant.array.decode`, fusible."""
  return qarray.decode(codes, scales, spec, layout, shape, fusible=True)


def encode(value: jax.Array, spec: QuantSpec, layout: normalize.Layout,
           scales: Optional[tuple], seed: Optional[jax.Array],
           row_bases: Optional[jax.Array]) -> tuple:
  """``(codes, scales)`` of float32 ``value``, as `optax4bit._codecs.encode`:
  under ``scales`` (None: ``value``'s own maxima), stochastic rounding hashed
  from ``seed`` and the flat index of each row's first element
  (``row_bases``, `optax4bit.quant.maps.row_hash_bases`)."""
  if scales is None:
    scales = normalize.compute_scales(normalize.finite_abs(value), layout)
  uniform = None
  if spec.stochastic:
    bases = jnp.reshape(row_bases, value.shape[:-1] + (1,))
    column = jax.lax.broadcasted_iota(jnp.uint32, value.shape, value.ndim - 1)
    uniform = maps.uniform_of_index(seed, bases + column)
  return qarray.encode(value, scales, spec, layout, uniform, fusible=True), scales
