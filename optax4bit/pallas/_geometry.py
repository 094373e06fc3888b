"""How the Pallas kernels tile a leaf (`Geometry`) and lay out each of its
moments (`Format`); which leaves and quantizers they do not cover
(`Unsupported`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from optax4bit.quant import normalize
from optax4bit.quant.packing import packed_length
from optax4bit.quant.spec import QuantSpec

# Bytes of codes per tile (each byte is two elements) and warps per program:
# 1024 bytes = 2048 elements over 8 warps, 8 elements per thread, for the
# quantizers; the fused steps run on twice that (`optax4bit.pallas.steps`).
# Chosen by ptxas -v (benchmarks/gpu_compile.py): with 32 per thread the fused
# steps need up to 255 registers; with 16, at most 128 (>= 25% occupancy on
# sm_80/sm_90a) and no spill. 4 per thread would leave many kernels at 64
# registers, where ptxas starts to spill. Tunable with `PallasConfig`.
DEFAULT_TILE_BYTES = 1024
# The stats pass (partial maxima of rank-1/tensor moments) tiles by this many
# times the step's bytes where those tiles cover the leaf exactly: it holds no
# encoder's values, so it has registers to spare (at most 128 at the steps'
# 2048 bytes), and more elements per thread share the index arithmetic and
# the column reductions. With masks (ragged leaves) larger tiles than the
# default spill at ptxas's 64-register target: those use the default tile.
STATS_TILE_FACTOR = 4
# Segment width (bytes) when no moment is block-wise local.
DEFAULT_SEGMENT_BYTES = 64
DEFAULT_NUM_WARPS = 8


class Unsupported(ValueError):
  """A leaf or quantizer that the kernels do not handle (the caller falls
  back to the jnp reference)."""


def _pow2_ceil(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _pow2_floor(n: int) -> int:
  return 1 << (max(1, int(n)).bit_length() - 1)


def check_spec(spec: QuantSpec) -> None:
  """Raises `Unsupported` for quantizers without a kernel."""
  if spec.bits != 4:
    raise Unsupported(f"{spec}: the Pallas kernels are 4-bit only.")
  if spec.normalization == "block" and spec.block_size < 2:
    raise Unsupported(f"{spec}: blocks of one element have no Pallas kernel.")


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The matrix view of a leaf and its tiling (all static)."""
  shape: tuple
  rows: int        # R
  cols: int        # D
  lead: int        # A: product of the axes before the last two (1 for ndim <= 2)
  axis_rows: int   # size of axis -2 (1 for 1-D leaves)
  seg: int         # S, bytes per segment
  segs_per_tile: int  # NBT
  rows_per_tile: int  # BR

  @property
  def half(self) -> int:  # H
    return packed_length(self.cols, 4)

  @property
  def num_segs(self) -> int:
    return -(-self.half // self.seg)

  @property
  def row_tiles(self) -> int:
    return -(-self.rows // self.rows_per_tile)

  @property
  def grid(self) -> tuple:
    return (self.row_tiles, -(-self.num_segs // self.segs_per_tile))

  @property
  def exact(self) -> bool:
    """Whether the tiles cover the leaf exactly (an even last axis, whole
    row tiles and segment tiles): the kernels then need no masks."""
    return (self.cols % 2 == 0 and self.rows % self.rows_per_tile == 0
            and self.half % (self.seg * self.segs_per_tile) == 0)

  @property
  def tile(self) -> tuple:
    return (self.rows_per_tile, self.segs_per_tile, self.seg)


@dataclasses.dataclass(frozen=True)
class Format:
  """How one quantized moment is laid out and when it is encoded."""
  spec: QuantSpec
  shape: tuple
  kind: str            # "block" (g == 1), "group" (g > 1 rows per block), "rank1" (and tensor)
  block_bytes: int = 0  # block: B // 2
  group_rows: int = 1   # group: g
  local: bool = False


def _layout(spec: QuantSpec, shape: tuple) -> normalize.Layout:
  return normalize.layout_for(spec, shape)


def segment_bytes(specs: Sequence[QuantSpec], shape: tuple) -> int:
  """S: the smallest block (in bytes) among block-wise moments with one block
  per row segment; those become local."""
  candidates = []
  for spec in specs:
    layout = _layout(spec, shape)
    if layout.normalization == "block" and layout.rows_per_block == 1:
      candidates.append(layout.block_size // 2)
  if candidates:
    return min(candidates)
  return min(DEFAULT_SEGMENT_BYTES, _pow2_ceil(packed_length(shape[-1], 4)))


def geometry(shape: tuple, specs: Sequence[QuantSpec], tile_bytes: int = DEFAULT_TILE_BYTES,
             segment: Optional[int] = None) -> Geometry:
  shape = tuple(int(n) for n in shape)
  if not shape or math.prod(shape) == 0:
    raise Unsupported(f"shape {shape}: the kernels need ndim >= 1 and at least one element.")
  for spec in specs:
    check_spec(spec)
  seg = segment_bytes(specs, shape) if segment is None else segment
  cols = shape[-1]
  rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
  axis_rows = shape[-2] if len(shape) > 1 else 1
  lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
  half = packed_length(cols, 4)
  num_segs = -(-half // seg)
  tile_bytes = max(int(tile_bytes), seg)
  # Rows first: the rank-1 column maxima of the stats pass take one float per row
  # tile and column, so few rows per tile would make them leaf-sized.
  rows_per_tile = min(_pow2_ceil(rows), _pow2_floor(tile_bytes // seg))
  segs_per_tile = min(_pow2_ceil(num_segs), _pow2_floor(tile_bytes // (seg * rows_per_tile)))
  return Geometry(shape, rows, cols, lead, axis_rows, seg, segs_per_tile, rows_per_tile)


def moment_format(spec: QuantSpec, geo: Geometry) -> Format:
  check_spec(spec)
  layout = _layout(spec, geo.shape)
  if layout.normalization == "block":
    if layout.rows_per_block > 1:
      return Format(spec, geo.shape, "group", group_rows=layout.rows_per_block)
    block_bytes = layout.block_size // 2
    if block_bytes < geo.seg:
      raise Unsupported(f"{spec}: blocks of {layout.block_size} elements are smaller than the "
                        f"tile segment of {2 * geo.seg} elements chosen for this leaf.")
    return Format(spec, geo.shape, "block", block_bytes=block_bytes,
                  local=block_bytes == geo.seg)
  return Format(spec, geo.shape, "rank1")
