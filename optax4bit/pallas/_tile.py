"""One Pallas program's tile of a leaf (`Tile`: its indices, masks, loads,
stores, per-element scales and hashed draws) and the Triton memory primitives
the kernels of `optax4bit.pallas._engine` use."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.pallas import _math, _operands
from optax4bit.pallas._geometry import Format, Geometry
from optax4bit.quant import maps


def pallas_modules():
  """``(pl, plgpu)``, imported on first use: importing Pallas costs a
  noticeable part of ``import optax4bit``, and most runs use no kernel."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return pl, plgpu


def iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def load(ref, index, mask=None):
  _, plgpu = pallas_modules()
  if mask is None:
    return plgpu.load(ref.at[index])
  return plgpu.load(ref.at[index], mask=mask, other=jnp.zeros((), ref.dtype))


def store(ref, index, value, mask=None):
  _, plgpu = pallas_modules()
  plgpu.store(ref.at[index], value, mask=mask)


def gather_row(table, index):
  """Row ``index`` of a small table, stored transposed (``(columns, N)``,
  `optax4bit.pallas._engine._table_operand`): each column's load is at a constant offset from the
  first (a tile-shaped ``(..., columns)`` load would need a change of layout
  both ways)."""
  return tuple(load(table, (np.int32(k), index)) for k in range(table.shape[0]))


@dataclasses.dataclass(frozen=True)
class Tile:
  """Indices of one program's tile: ``(BR, NBT, S)`` code bytes, each the
  even and the odd element of the leaf's ``(R, D)`` view; masks are None
  where the tiling covers the leaf exactly."""
  geo: Geometry
  row: Any
  byte: Any
  cols: tuple
  valid: Any
  valids: tuple
  row_1: Any          # (BR, 1, 1) rows
  valid_row: Any

  @classmethod
  def of_program(cls, geo: Geometry, i, j) -> "Tile":
    br, nbt, s = shape = geo.tile
    row = i * br + iota(shape, 0)
    byte = (j * nbt + iota(shape, 1)) * s + iota(shape, 2)
    row_1 = i * br + iota((br, 1, 1), 0)
    cols = (2 * byte, 2 * byte + 1)
    if geo.exact:
      return cls(geo, row, byte, cols, None, (None, None), row_1, None)
    valid = (row < geo.rows) & (byte < geo.half)
    return cls(geo, row, byte, cols, valid, (valid, valid & (cols[1] < geo.cols)), row_1,
               row_1 < geo.rows)

  def load_halves(self, ref):
    """The even and odd elements (float32) of a leaf-shaped ref."""
    return tuple(load(ref, (self.row, c), v).astype(jnp.float32)
                 for c, v in zip(self.cols, self.valids))

  def store_halves(self, ref, halves):
    """Writes the even and odd elements of a leaf-shaped ref: where the tile
    has no mask, interleaved in registers and stored contiguously (vector
    stores; loads stay per half, since their consumers' layouts differ)."""
    if self.valid is None:
      shape = self.row.shape + (2,)
      index = (jnp.broadcast_to(self.row[..., None], shape),
               self.cols[0][..., None] + iota(shape, len(shape) - 1))
      store(ref, index, jnp.stack([h.astype(ref.dtype) for h in halves], axis=-1))
      return
    for c, v, value in zip(self.cols, self.valids, halves):
      store(ref, (self.row, c), value.astype(ref.dtype), v)

  def group_index(self, fmt: Format):
    """Flat index of the group scale of each row (group formats)."""
    geo = self.geo
    lead_index = jax.lax.div(self.row_1, np.int32(geo.axis_rows))
    in_lead = jax.lax.rem(self.row_1, np.int32(geo.axis_rows))
    return (lead_index * _operands.num_groups(fmt, geo)
            + jax.lax.div(in_lead, np.int32(fmt.group_rows)))

  def per_element(self, fmt: Format, scale_refs, combine):
    """A moment's scale (or inverse scale) for the even and odd elements."""
    if fmt.kind == "block":
      block = jax.lax.div(self.byte, np.int32(fmt.block_bytes))
      value = load(scale_refs[0], (self.row, block), self.valid)
      return value, value
    if fmt.kind == "group":
      value = load(scale_refs[0], self.group_index(fmt), self.valid_row)
      return value, value
    row_value = load(scale_refs[0], self.row_1, self.valid_row)
    return tuple(combine(row_value, load(scale_refs[1], c, v))
                 for c, v in zip(self.cols, self.valids))

  def scaled_uniforms(self, seed, row_bases):
    """Stochastic rounding's draws times 2**24 (even, odd): hashed flat
    element indices ``row * D + column`` of the leaf (``row_bases[row] +
    column`` for a shard)."""
    if row_bases is not None:
      row_index = load(row_bases, self.row_1, self.valid_row)
    else:
      row_index = self.row_1.astype(jnp.uint32) * np.uint32(self.geo.cols % 2**32)
    # Folded once per element for all its moments' seeds (`maps.fold16`).
    even = maps.fold16(row_index + self.cols[0].astype(jnp.uint32))
    if row_bases is None and self.geo.cols % 2 == 0:
      # Even rows start at even indices, so an odd element's index differs from
      # its even neighbour's in bit 0 only, and so does its fold.
      odd = even ^ np.uint32(1)
    else:
      odd = maps.fold16(row_index + self.cols[1].astype(jnp.uint32))
    folded_seed = maps.fold16(seed)
    return tuple(maps.scaled_uniform_of_folded_index(folded, folded_seed) for folded in (even, odd))

  def segment_max(self, halves):
    """Per half, the `_math.finite_abs_key` keys of its elements (0's where
    masked), and the per (row, segment) maximum of the finite ``|x|`` of
    both halves."""
    keys = [_math.finite_abs_key(x, v) for x, v in zip(halves, self.valids)]
    # One reduction across lanes (of the halves' elementwise maximum), not two.
    return keys, _math.abs_of_key(jnp.maximum(keys[0], keys[1]).max(axis=2))
