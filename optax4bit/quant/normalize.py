"""Scales of the three normalizations, all kept at the tensor's rank.

Layouts (``x`` of shape ``(..., r, d)``):

* ``tensor``: one scale of shape ``(1,) * ndim``.
* ``block`` with block size ``B``: blocks run along the last axis, scales have
  shape ``(..., r, ceil(d / B))``; a ragged last block is allowed. When the last
  axis is shorter than half a block, a block instead covers ``g = B // d``
  consecutive whole rows (scales ``(..., ceil(r / g), 1)``), so that short rows
  do not pay one float32 scale per few elements; when ``d`` divides ``B`` this
  is exactly the paper's block of ``B`` consecutive elements of the flattened
  tensor.
* ``rank1``: one vector per axis ``k``, shaped ``(1, .., n_k, .., 1)``; the
  scale of an element is the minimum over axes of its vectors' entries.
  1-D tensors fall back to ``B128``.

Maxima ignore non-finite values, so one inf or NaN never spreads to its block,
row or column.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.quant.spec import RANK1_FALLBACK_BLOCK, QuantSpec


class Layout(NamedTuple):
  """Static description of how a spec normalizes a tensor of one shape."""
  normalization: str  # "tensor", "block" or "rank1", after the 1-D fallback.
  block_size: int
  rows_per_block: int  # > 1 when a block spans whole rows of axis -2.


def layout_for(spec: QuantSpec, shape: tuple) -> Layout:
  if spec.normalization == "rank1" and len(shape) < 2:
    return Layout("block", RANK1_FALLBACK_BLOCK, 1)
  if spec.normalization == "block":
    rows = 1
    if len(shape) >= 2 and 2 * shape[-1] <= spec.block_size:
      rows = spec.block_size // shape[-1]
    return Layout("block", spec.block_size, rows)
  return Layout(spec.normalization, 0, 1)


def scale_shapes(layout: Layout, shape: tuple) -> tuple:
  """Shapes of the scale arrays for a tensor of ``shape``."""
  ndim = len(shape)
  if layout.normalization == "tensor":
    return ((1,) * ndim,)
  if layout.normalization == "rank1":
    return tuple(tuple(n if k == axis else 1 for k, n in enumerate(shape))
                 for axis in range(ndim))
  if layout.rows_per_block > 1:
    return (shape[:-2] + (math.ceil(shape[-2] / layout.rows_per_block), 1),)
  return (shape[:-1] + (math.ceil(shape[-1] / layout.block_size),),)


def row_factors(layout: Layout, ndim: int, bits: int) -> tuple:
  """Leaf rows (along axis 0) per row of each buffer of a quantized tensor of
  rank ``ndim``: the codes first, then each scale array; ``None`` for a
  buffer that spans all rows (a column statistic or a tensor scale). Chunks
  of rows, and shards of axis 0, must be multiples of these."""
  codes = 2 if (ndim == 1 and bits == 4) else 1  # a 1-D leaf packs pairs of rows
  if layout.normalization == "block":
    if ndim == 1:
      return codes, layout.block_size
    return codes, layout.rows_per_block if ndim == 2 else 1
  if layout.normalization == "rank1":
    return (codes, 1) + (None,) * (ndim - 1)
  return codes, None


def finite_abs(x: jax.Array) -> jax.Array:
  """|x| with non-finite entries replaced by 0, for maxima."""
  return jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  size = x.shape[axis]
  extra = -size % multiple
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def compute_scales(abs_x: jax.Array, layout: Layout) -> tuple:
  """The scale arrays of ``abs_x`` (non-negative, finite) for ``layout``."""
  ndim = abs_x.ndim
  if layout.normalization == "tensor":
    return (jnp.max(abs_x, keepdims=True),)
  if layout.normalization == "rank1":
    return tuple(
        jnp.max(abs_x, axis=tuple(k for k in range(ndim) if k != axis), keepdims=True)
        for axis in range(ndim))
  if layout.rows_per_block > 1:
    g = layout.rows_per_block
    padded = _pad_axis(abs_x, -2, g)
    grouped = padded.reshape(padded.shape[:-2] + (padded.shape[-2] // g, g * padded.shape[-1]))
    return (jnp.max(grouped, axis=-1, keepdims=True),)
  b = layout.block_size
  padded = _pad_axis(abs_x, -1, b)
  blocks = padded.reshape(padded.shape[:-1] + (padded.shape[-1] // b, b))
  return (jnp.max(blocks, axis=-1),)


def _expand(scales: tuple, layout: Layout, shape: tuple, combine) -> jax.Array:
  if layout.normalization == "tensor":
    return scales[0]
  if layout.normalization == "rank1":
    out = scales[0]
    for stat in scales[1:]:
      out = combine(out, stat)
    return out
  (s,) = scales
  if layout.rows_per_block > 1:
    g = layout.rows_per_block
    rows = jnp.broadcast_to(s[..., None], s.shape[:-1] + (g, 1))
    return rows.reshape(s.shape[:-2] + (s.shape[-2] * g, 1))[..., :shape[-2], :]
  b = layout.block_size
  cols = jnp.broadcast_to(s[..., None], s.shape + (b,))
  return cols.reshape(s.shape[:-1] + (s.shape[-1] * b,))[..., :shape[-1]]


def expand_scales(scales: tuple, layout: Layout, shape: tuple) -> jax.Array:
  """Per-element scale, broadcastable to ``shape`` (rank-1: the minimum of
  the axes' maxima)."""
  return _expand(scales, layout, shape, jnp.minimum)


def normalize(x: jax.Array, scales: tuple, layout: Layout,
              inverses: Optional[tuple] = None) -> jax.Array:
  """The normalized tensor ``x * (1 / scale)``, NaN mapped to 0.

  The reciprocal is taken on the small scale arrays (for rank-1,
  ``1 / min(mu) == max(1 / mu)`` exactly), then multiplied: a division per
  element is several times slower on XLA's CPU backend. Elements with scale 0
  get 0 (``+-inf`` there gives NaN, hence 0); elsewhere ``+-inf`` stay
  infinite and clamp to the table's ends when encoded. ``inverses``: the
  `inverse_times_4` of each of ``scales``, computed beforehand (where the
  scales were made, so that XLA does not launch a kernel per scale array).
  """
  if inverses is None:
    inverses = tuple(map(inverse_times_4, scales))
  inverse = _expand(tuple(inverses), layout, x.shape, jnp.maximum)
  return normalize_by_inverse(x, inverse)


def normalize_by_inverse(x: jax.Array, inverse: jax.Array) -> jax.Array:
  """`normalize` given ``inverse``, the per-element `inverse_times_4` of the
  scale (for rank-1, the maximum of the axes' ``inverse_times_4``): for a
  kernel that combines some axes' inverses ahead of time."""
  n = (x * inverse) * np.float32(0.25)
  return jnp.where(jnp.isnan(n), np.float32(0), n)


def inverse_times_4(s: jax.Array, div=jnp.divide) -> jax.Array:
  """``4 / s`` (0 where ``s`` is 0), for `normalize`; ``div`` is the division
  to use (kernels pass their own).

  For a scale above 2**126 the plain reciprocal is subnormal, and XLA's CPU
  backend flushes subnormals to zero: every element of such a block would
  normalize to 0. ``4 / scale`` is normal for every finite scale (clamped to
  the float32 maximum for the one scale 2**-126, where it would overflow), and
  ``(x * (4 / scale)) * 0.25`` is bit-identical to ``x * (1 / scale)`` wherever
  that reciprocal is normal.
  """
  positive = s > 0
  inverse = jnp.minimum(div(np.float32(4), jnp.where(positive, s, np.float32(1))),
                        np.float32(np.finfo(np.float32).max))
  return jnp.where(positive, inverse, np.float32(0))
