"""The jnp side of the Pallas kernels: a moment's scale arrays in the views
the kernels read (decode and encode operands), and the reference's scale
arrays rebuilt from what the stats pass of a kernel writes."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from optax4bit.pallas._geometry import Format, Geometry
from optax4bit.quant import normalize
from optax4bit.quant.array import QuantizedArray


def num_groups(fmt: Format, geo: Geometry) -> int:
  return -(-geo.axis_rows // fmt.group_rows)


def _rank1_vectors(scales: tuple, fmt: Format, geo: Geometry, combine) -> tuple:
  """Per-row ``(R,)`` and per-column ``(D,)`` vectors whose ``combine`` is the
  per-element value of rank-1 (or tensor) scales."""
  layout = normalize.layout_for(fmt.spec, geo.shape)
  if layout.normalization == "tensor":
    (s,) = scales
    s = s.reshape(())
    return jnp.full((geo.rows,), s), jnp.full((geo.cols,), s)
  ndim = len(geo.shape)
  row = scales[0].reshape(scales[0].shape[:-1])
  for stat in scales[1:-1]:
    row = combine(row, stat.reshape(stat.shape[:-1]))
  row = jnp.broadcast_to(row, geo.shape[:-1]).reshape(geo.rows)
  col = scales[ndim - 1].reshape(geo.cols)
  return row, col


def decode_operands(q: QuantizedArray, fmt: Format, geo: Geometry) -> tuple:
  """Arrays a kernel reads to decode ``q``: codes ``(R, H)`` then scales."""
  codes = q.codes.reshape(geo.rows, geo.half)
  if fmt.kind == "block":
    (s,) = q.scales
    return codes, s.reshape(geo.rows, -1)
  if fmt.kind == "group":
    (s,) = q.scales
    return codes, s.reshape(-1)
  return (codes,) + _rank1_vectors(q.scales, fmt, geo, jnp.minimum)


def encode_operands(scales: tuple, fmt: Format, geo: Geometry) -> tuple:
  """Inverse scales (times 4) a pass-2 kernel multiplies by."""
  inverse = tuple(map(normalize.inverse_times_4, scales))
  if fmt.kind == "block":
    return (inverse[0].reshape(geo.rows, -1),)
  if fmt.kind == "group":
    return (inverse[0].reshape(-1),)
  return _rank1_vectors(inverse, fmt, geo, jnp.maximum)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def scales_from_partials(fmt: Format, geo: Geometry, row_part: jax.Array,
                         col_part: Optional[jax.Array],
                         reduce_scales: Optional[Callable] = None) -> tuple:
  """The reference's scale arrays of a new moment from pass-1 partial maxima.

  ``row_part``: ``(R, num_segs)``, max |x| per row segment; ``col_part``:
  ``(row_tiles, D)``, max |x| per row tile and column (rank-1 only).
  ``reduce_scales(scales, layout)`` turns rank-1/tensor scales of a shard
  into those of the global tensor (see `optax4bit._shard_map.per_shard`).
  """
  shape = geo.shape
  layout = normalize.layout_for(fmt.spec, shape)
  shapes = normalize.scale_shapes(layout, shape)
  if fmt.kind == "block":
    k = fmt.block_bytes // geo.seg
    grouped = _pad_to(row_part, 1, k)
    grouped = grouped.reshape(geo.rows, grouped.shape[1] // k, k).max(axis=-1)
    return (grouped.reshape(shapes[0]),)
  row_max = row_part.max(axis=1)
  if fmt.kind == "group":
    g = fmt.group_rows
    per_row = _pad_to(row_max.reshape(geo.lead, geo.axis_rows), 1, g)
    groups = per_row.reshape(geo.lead, per_row.shape[1] // g, g).max(axis=-1)
    return (groups.reshape(shapes[0]),)
  if layout.normalization == "tensor":
    scales = (row_max.max().reshape(shapes[0]),)
  else:
    ndim = len(shape)
    lead = row_max.reshape(shape[:-1])
    stats = []
    for axis in range(ndim - 1):
      others = tuple(k for k in range(ndim - 1) if k != axis)
      stat = jnp.max(lead, axis=others, keepdims=True) if others else lead
      stats.append(stat[..., None].reshape(shapes[axis]))
    stats.append(col_part.max(axis=0).reshape(shapes[ndim - 1]))
    scales = tuple(stats)
  return scales if reduce_scales is None else tuple(reduce_scales(scales, layout))


def local_scales(scales_2d: jax.Array, fmt: Format, geo: Geometry) -> tuple:
  shapes = normalize.scale_shapes(normalize.layout_for(fmt.spec, geo.shape), geo.shape)
  return (scales_2d.reshape(shapes[0]),)
