"""The Pallas TPU (Mosaic) kernels of one leaf: a stats pass and a step pass.

A leaf is a matrix ``(R, D)`` with ``D`` a multiple of 256; its packed 4-bit
codes are ``(R, D / 2)`` uint8, its 8-bit codes ``(R, D)`` (a byte per
element: no nibbles to spread). A program owns ``BR`` whole rows (`Plan`) and
walks them in chunks of 256 elements, whose codes are 128 bytes: one lane
tile. Everything elementwise runs on pieces of 128 elements (one lane tile of
float32), chunk element ``c`` in piece ``c // 128``, in a loop over the
chunk's two pieces: unrolled, the step's code was twice as long, and XLA:TPU
compiled it in about twice the time.

**Nibbles without lane shuffles.** A byte holds two neighbouring elements
(even in the low nibble, `optax4bit.quant.packing`). Spreading 128 bytes to
256 elements, and gathering them back, is a lane permutation that Mosaic has
no cheap instruction for (strided lane loads need a 128-wide array, and XLA
relayouts every array of the leaf). Both are matrix products on the MXU, exact
in bfloat16 with float32 accumulation: a byte (< 256) or a code (< 16) is an
exact bfloat16, and each output sums at most two exact products. ``bytes @
SPREAD[p]`` puts byte ``64 p + j`` in lanes ``2 j`` and ``2 j + 1`` of piece
``p``; a lane's parity picks its nibble. ``codes[0] @ GATHER[0] + codes[1] @
GATHER[1]`` puts ``even + 16 * odd`` in byte lanes. About 256 multiply-adds
per element and moment, a fifth of the memory time on a v5e.

**Passes.** Rank-1 scales span every tile, so where a new moment has them a
stats pass runs the step first and writes only their maxima: per row (whole
in a program) and per column and row tile (reduced with jnp after it). Block
scales (128 or 256 elements along the last axis: a piece or a chunk) are the
block's own maximum, known inside the step pass. The step pass decodes, steps, encodes
and writes the update and the new moments over the inputs they replace
(``input_output_aliases``), but the update, which gets a buffer of its own.

**Numerics** are the jnp engine's, operation for operation, through the same
functions (`optax4bit.quant.maps`, `optax4bit.quant.normalize`, the step of
`optax4bit._steps`) on the pieces' values: the same codes bit for bit in
interpret mode. Stochastic rounding hashes each element's flat index in the
global leaf (``row_bases[r] + c``, `optax4bit.quant.maps.row_hash_bases`:
an operand for a shard, ``r * D`` computed in the kernel for a whole leaf).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.quant import maps, normalize
from optax4bit.quant.spec import QuantSpec

CHUNK = 256           # elements per chunk: 128 code bytes, one lane tile of uint8
PIECE = 128           # elements per piece: one lane tile of float32
TILE_BYTES = 1 << 19  # about this many bytes of float32 per program and operand
# A program's rows: all of a leaf's if they fit in TILE_BYTES, else a multiple of
# the uint8 sublane tile (32) (the last tile ragged, its rows past the leaf masked).
ROW_TILE = 32
# Longer rows unroll into too many chunks per program (compile time).
MAX_COLUMNS = 8192

# The kernels' formats of a moment: block maxima of one piece, or rank-1 maxima.
BLOCK, RANK1 = "block", "rank1"
# Side inputs: "row" (R, 1); "col" (1, D) or (1, 1), the same for every row;
# "slab" (S, 1, D) or (S, 1, 1), one per slab of `Plan.slab_rows` rows.
ROW, COL, SLAB = "row", "col", "slab"


def shuffle_matrices() -> np.ndarray:
  """``(128, 512)`` bfloat16-exact 0/1/16 matrices side by side: SPREAD[0],
  SPREAD[1], GATHER[0], GATHER[1] (the module docstring)."""
  out = np.zeros((PIECE, 4 * PIECE), np.float32)
  j = np.arange(PIECE // 2)
  for piece in range(2):
    spread = out[:, piece * PIECE:(piece + 1) * PIECE]
    spread[64 * piece + j, 2 * j] = 1
    spread[64 * piece + j, 2 * j + 1] = 1
    gather = out[:, (2 + piece) * PIECE:(3 + piece) * PIECE]
    gather[2 * j, 64 * piece + j] = 1
    gather[2 * j + 1, 64 * piece + j] = 16
  return out


@dataclasses.dataclass(frozen=True)
class MomentFormat:
  """A moment's quantizer, where its scales come from and, for ``BLOCK``,
  the elements of a block (a piece or a chunk)."""
  spec: QuantSpec
  kind: str  # BLOCK or RANK1
  block: int = PIECE

  def block_index(self, chunk, half: int):
    """The block of the chunk's piece ``half`` (its column in the block scales)."""
    return 2 * chunk + half if self.block == PIECE else chunk


@dataclasses.dataclass(frozen=True)
class Plan:
  """One leaf's kernels: the leaf as a matrix ``(rows, cols)``, rows per
  program, its moments' formats, its side inputs' kinds (``ROW``, ``COL``,
  ``SLAB``), the rows of a slab (for ``SLAB`` side inputs) and the number of
  float32 step constants."""
  rows: int
  cols: int
  block_rows: int
  moments: tuple      # MomentFormats
  side: tuple         # ROW, COL or SLAB per side input
  num_consts: int
  slab_rows: int = 0
  # Stochastic rounding's row hash bases: an operand (a shard of a leaf, at
  # its origin in the global leaf), or for a whole leaf ``row * cols``,
  # computed in the kernel (an XLA fusion per leaf less).
  row_bases_operand: bool = False

  @property
  def grid(self) -> tuple:
    return (-(-self.rows // self.block_rows),)

  @property
  def ragged(self) -> bool:
    return self.rows % self.block_rows != 0

  @property
  def dense_rows(self) -> bool:
    """Whether per-row vectors travel lane-dense, as ``(grid, 1, BR)``: an
    ``(R, 1)`` array is padded to 128 lanes in a TPU's memory (512 bytes a
    row), and a program turns its ``(1, BR)`` into ``(BR, 1)`` (for ``BR`` a
    multiple of 8; a leaf of fewer rows is one program, its vectors small)."""
    return self.block_rows % 8 == 0

  @property
  def seeded(self) -> tuple:
    return tuple(i for i, m in enumerate(self.moments) if m.spec.stochastic)

  @property
  def global_moments(self) -> tuple:
    return tuple(i for i, m in enumerate(self.moments) if m.kind == RANK1)


def block_rows(rows: int, cols: int, slab_rows: int = 0) -> Optional[int]:
  """Rows per program for a ``(rows, cols)`` leaf: all of them where they
  fit in about `TILE_BYTES` of float32, else the largest power-of-two
  multiple of `ROW_TILE` that does (dividing ``slab_rows`` where that is
  given; None if none does)."""
  fit = max(ROW_TILE, TILE_BYTES // (4 * cols))
  if rows <= fit and (not slab_rows or rows == slab_rows):
    return rows
  target = 1 << (fit.bit_length() - 1)
  while target >= ROW_TILE:
    if not slab_rows or slab_rows % target == 0:
      return target
    target //= 2
  return None


def covers(shape: tuple, formats: tuple) -> bool:
  """Whether the kernels run a leaf of ``shape`` with these moment formats:
  rows of a multiple of 256 elements (at most `MAX_COLUMNS`), and for more
  than two axes a second-to-last axis of a multiple of 32 (so that viewing
  the leaf as a matrix moves no data)."""
  if len(shape) < 2 or shape[-1] % CHUNK or shape[-1] > MAX_COLUMNS:
    return False
  if len(shape) > 2 and shape[-2] % ROW_TILE:
    return False
  return all(f is not None for f in formats)


def moment_format(spec: QuantSpec, layout: normalize.Layout) -> Optional[MomentFormat]:
  """The kernels' format of a moment (None where they do not cover it): 4 or
  8 bits, blocks of a piece or a chunk along the last axis, or rank-1."""
  if spec.bits not in (4, 8):
    return None
  if layout.normalization == "block" and layout.block_size in (PIECE, CHUNK) and \
      layout.rows_per_block == 1:
    return MomentFormat(spec, BLOCK, layout.block_size)
  if layout.normalization == "rank1":
    return MomentFormat(spec, RANK1)
  return None


# ----------------------------------------------------------------------------
# Kernel side: one program, `BR` rows.


def _int_codes(n, spec: QuantSpec, uniform, stored):
  """int32 codes of normalized ``n``: `optax4bit.quant.array.encode`'s,
  before packing."""
  if not spec.stochastic:
    return maps.encode_nearest(n, spec.mapping, spec.bits, spec.signed, dtype=jnp.int32)
  codes = maps.encode_stochastic(n, uniform, spec.mapping, spec.bits, spec.signed,
                                 dtype=jnp.int32)
  if spec.stall_only:
    nearest = maps.encode_nearest(n, spec.mapping, spec.bits, spec.signed, dtype=jnp.int32)
    codes = jnp.where(nearest == stored, codes, nearest)
  return codes


def _bf16_dot(x, matrix):
  return jnp.dot(x.astype(jnp.float32).astype(jnp.bfloat16), matrix,
                 preferred_element_type=jnp.float32)


class _Program:
  """The refs of one program, named, and the per-piece reads and writes."""

  def __init__(self, plan: Plan, step_pass: bool, refs):
    self.plan = plan
    it = iter(refs)
    self.consts = next(it) if plan.num_consts else None
    self.seeds = next(it) if plan.seeded else None
    self.shuffle = next(it)
    row_bases_ref = next(it) if plan.seeded and step_pass and plan.row_bases_operand else None
    self.grad = next(it)
    read = range(len(plan.moments)) if step_pass else plan.global_moments
    self.old = {i: tuple(next(it) for _ in range(2 if plan.moments[i].kind == BLOCK else 3))
                for i in read}
    self.side = tuple(next(it) for _ in plan.side)
    self.new_scales = ({i: (next(it), next(it)) for i in plan.global_moments}
                       if step_pass else {})
    self.out = tuple(it)
    # uint32 hash bases of the program's rows (BR, 1), read or computed here,
    # outside the chunk loop (interpret mode lowers no program_id inside it).
    self.row_bases = None
    if plan.seeded and step_pass:
      if row_bases_ref is not None:
        self.row_bases = self.per_row(row_bases_ref).astype(jnp.uint32)
      else:  # int32 products wrap as `maps.row_hash_bases`' uint32 ones.
        pl, _ = pallas_modules()
        rows = pl.program_id(0) * plan.block_rows + jax.lax.broadcasted_iota(
            jnp.int32, (plan.block_rows, 1), 0)
        self.row_bases = (rows * np.int32(plan.cols)).astype(jnp.uint32)

  def spread(self, packed, half):
    """int32 bytes ``(BR, 128)`` -> the int32 codes of the chunk's piece
    ``half`` (traced)."""
    lane_is_odd = (jax.lax.broadcasted_iota(jnp.int32, packed.shape, 1) & 1) == 1
    both = _bf16_dot(packed, self.shuffle[:, _lanes(half, PIECE)]).astype(jnp.int32)
    return jnp.where(lane_is_odd, both >> 4, both & 15)

  def gather(self, codes):
    """The int32 codes of a chunk's two pieces -> its int32 bytes."""
    packed = sum(_bf16_dot(codes[p], self.shuffle[:, (2 + p) * PIECE:(3 + p) * PIECE])
                 for p in range(2))
    return packed.astype(jnp.int32)

  def scales_of_piece(self, refs, fmt: MomentFormat, chunk, half: int):
    """A piece's scales: ``((BR, 1),)`` block, ``((BR, 1), (1, 128))`` rank-1
    (the leading axes' minimum, then the last axis's), and the
    `normalize.Layout` that expands them (a block scale per row of the
    piece broadcasts like a tensor scale)."""
    if fmt.kind == BLOCK:
      return ((_column(refs[1][...], fmt.block_index(chunk, half)),),
              normalize.Layout("tensor", 0, 1))
    return ((self.per_row(refs[1]), refs[2][:, _piece_lanes(2 * chunk + half)]),
            normalize.Layout("rank1", 0, 1))

  def per_row(self, ref):
    """A per-row vector's ``(BR, 1)`` values (`Plan.dense_rows`)."""
    return ref[0].reshape(self.plan.block_rows, 1) if self.plan.dense_rows else ref[...]

  def store_per_row(self, ref, values):
    if self.plan.dense_rows:
      ref[0] = values.reshape(1, self.plan.block_rows)
    else:
      ref[...] = values

  def side_piece(self, piece):
    out = []
    for kind, ref in zip(self.plan.side, self.side):
      if kind == ROW:
        out.append(self.per_row(ref))
      elif ref.shape[-1] == 1:
        out.append(ref[0] if kind == SLAB else ref[...])
      else:
        out.append(ref[0, :, _piece_lanes(piece)] if kind == SLAB else
                   ref[:, _piece_lanes(piece)])
    return tuple(out)

  def valid_rows(self):
    """Whether each row of the program is in the leaf (``(BR, 1)``)."""
    pl, _ = pallas_modules()
    first = pl.program_id(0) * self.plan.block_rows
    rows = first + jax.lax.broadcasted_iota(jnp.int32, (self.plan.block_rows, 1), 0)
    return rows < self.plan.rows

  def step_fn(self, rebuild_step):
    consts = tuple(self.consts[k] for k in range(self.plan.num_consts))
    return rebuild_step(consts)

  def uniform(self, k: int, piece):
    """Stochastic rounding's draws of moment ``k`` for a piece."""
    seed = self.seeds[k].astype(jnp.uint32)
    bases = self.row_bases
    column = jax.lax.broadcasted_iota(jnp.uint32, (1, PIECE), 1) + \
        (piece * PIECE).astype(jnp.uint32)
    return maps.uniform_of_index(seed, bases + column)


def _lanes(index, width: int):
  """The lanes of the ``index``-th (traced) run of ``width`` (a multiple of 128)."""
  pl, _ = pallas_modules()
  return pl.ds(pl.multiple_of(index * width, width), width)


def _piece_lanes(piece):
  return _lanes(piece, PIECE)


def _column(values, index):
  """Column ``index`` (traced) of non-negative ``values`` as ``(BR, 1)``: the
  maximum of the row where every other column is 0 (exact)."""
  lanes = jax.lax.broadcasted_iota(jnp.int32, values.shape, 1)
  return jnp.max(jnp.where(lanes == index, values, np.float32(0)), axis=1, keepdims=True)


def _decoded_piece(program: _Program, chunk, half):
  """Piece ``half`` of chunk ``chunk`` (both traced): ``(grad, old values,
  old codes, side)``."""
  plan = program.plan
  piece = 2 * chunk + half
  old_values = [None] * len(plan.moments)
  old_codes = [None] * len(plan.moments)
  for i, fmt in enumerate(plan.moments):
    if i not in program.old:
      continue
    refs = program.old[i]
    if fmt.spec.bits == 4:
      codes = program.spread(refs[0][:, _lanes(chunk, PIECE)].astype(jnp.int32), half)
    else:  # A byte per code: the piece's own lanes.
      codes = refs[0][:, _piece_lanes(piece)].astype(jnp.int32)
    scales, layout = program.scales_of_piece(refs, fmt, chunk, half)
    values = maps.decode(codes, fmt.spec.mapping, fmt.spec.bits, fmt.spec.signed)
    old_values[i] = values * normalize.expand_scales(scales, layout, values.shape)
    old_codes[i] = codes
  grad = program.grad[:, _piece_lanes(piece)].astype(jnp.float32)
  values = tuple(jnp.zeros(grad.shape, jnp.float32) if v is None else v for v in old_values)
  return grad, values, old_codes, program.side_piece(piece)


def _halves(body, init):
  """``body(half, carry)`` for a chunk's two pieces, as a loop: unrolled, a
  kernel's code doubles, and XLA:TPU's compile time with it."""
  return jax.lax.fori_loop(0, 2, body, init)


def _chunks(plan: Plan, body, init):
  """``body(chunk, carry)`` over the row's chunks, as a loop (a kernel of
  unrolled chunks compiles for minutes on long rows)."""
  return jax.lax.fori_loop(0, plan.cols // CHUNK, body, init)


def stats_kernel(plan: Plan, rebuild_step: Callable, *refs):
  """Pass 1: per global moment, the maxima of ``|new|`` (finite) per row
  ``(BR, 1)`` and per column of this row tile ``(1, 1, D)``."""
  program = _Program(plan, False, refs)
  step = program.step_fn(rebuild_step)
  # The rows of a ragged last tile past the leaf hold whatever was in memory.
  valid = program.valid_rows() if plan.ragged else None

  def chunk_maxima(chunk, row_max):
    def piece_maxima(half, row_max):
      grad, old, _, side = _decoded_piece(program, chunk, half)
      _, new = step(grad, old, side)
      row_max = list(row_max)
      for k, i in enumerate(plan.global_moments):
        magnitude = normalize.finite_abs(new[i])
        if valid is not None:
          magnitude = jnp.where(valid, magnitude, np.float32(0))
        row_max[k] = jnp.maximum(row_max[k], jnp.max(magnitude, axis=1, keepdims=True))
        column_ref = program.out[2 * k + 1]
        column_ref[0, :, _piece_lanes(2 * chunk + half)] = jnp.max(magnitude, axis=0,
                                                                   keepdims=True)
      return tuple(row_max)

    return _halves(piece_maxima, row_max)

  zeros = jnp.zeros((plan.block_rows, 1), jnp.float32)
  row_max = _chunks(plan, chunk_maxima, (zeros,) * len(plan.global_moments))
  for k in range(len(plan.global_moments)):
    program.store_per_row(program.out[2 * k], row_max[k])


def step_kernel(plan: Plan, rebuild_step: Callable, *refs):
  """Pass 2: the update and every new moment, encoded (block moments with
  their own maxima, global ones with the stats pass's). Per chunk, a loop
  over its pieces steps and keeps the new moments (and the codes they
  replace, for a ``stall_only`` spec) in VMEM scratch; the block maxima
  follow, then a loop over the pieces encodes, and 4-bit codes are gathered
  into bytes."""
  num_scratch = len(step_scratch(plan))
  program = _Program(plan, True, refs[:len(refs) - num_scratch])
  scratch = iter(refs[len(refs) - num_scratch:])
  step = program.step_fn(rebuild_step)
  update_ref, *moment_out = program.out
  outs = iter(moment_out)
  code_refs, block_scale_refs, new_refs, stored_refs, codes_refs = [], [], [], [], []
  for fmt in plan.moments:
    code_refs.append(next(outs))
    block_scale_refs.append(next(outs) if fmt.kind == BLOCK else None)
    new_refs.append(next(scratch))
    stored_refs.append(next(scratch) if fmt.spec.stall_only else None)
    codes_refs.append(next(scratch) if fmt.spec.bits == 4 else None)

  def chunk_step(chunk, block_scales):
    def piece_step(half, carry):
      grad, old, stored, side = _decoded_piece(program, chunk, half)
      update, new = step(grad, old, side)
      update_ref[:, _piece_lanes(2 * chunk + half)] = update.astype(update_ref.dtype)
      for i in range(len(plan.moments)):
        new_refs[i][half] = new[i]
        if stored_refs[i] is not None:
          stored_refs[i][half] = stored[i]
      return carry

    _halves(piece_step, 0)
    block_scales = list(block_scales)
    inverses = [None] * len(plan.moments)
    for i, fmt in enumerate(plan.moments):
      if fmt.kind != BLOCK:
        continue
      maxima = [jnp.max(normalize.finite_abs(new_refs[i][half]), axis=1, keepdims=True)
                for half in range(2)]
      if fmt.block == CHUNK:  # One block over both pieces.
        maxima = [jnp.maximum(*maxima)] * 2
      lanes = jax.lax.broadcasted_iota(jnp.int32, block_scales[i].shape, 1)
      for half in range(1 if fmt.block == CHUNK else 2):  # a chunk's block: one column
        block_scales[i] = jnp.where(lanes == fmt.block_index(chunk, half), maxima[half],
                                    block_scales[i])
      inverses[i] = [normalize.inverse_times_4(m) for m in maxima]

    def piece_encode(half, carry):
      piece = 2 * chunk + half
      for i, fmt in enumerate(plan.moments):
        if fmt.kind == BLOCK:
          inverse = jnp.where(half == 0, *inverses[i])
        else:
          # The leading axes' maxima come combined, as the maximum of their
          # inverses (`normalize.normalize`'s for rank-1, in another order).
          row_inverse, col = program.new_scales[i]
          inverse = jnp.maximum(program.per_row(row_inverse),
                                normalize.inverse_times_4(col[:, _piece_lanes(piece)]))
        n = normalize.normalize_by_inverse(new_refs[i][half], inverse)
        uniform = program.uniform(plan.seeded.index(i), piece) if fmt.spec.stochastic else None
        stored = stored_refs[i][half] if stored_refs[i] is not None else None
        codes = _int_codes(n, fmt.spec, uniform, stored)
        if fmt.spec.bits == 4:
          codes_refs[i][half] = codes
        else:
          code_refs[i][:, _piece_lanes(piece)] = codes.astype(jnp.uint8)
      return carry

    _halves(piece_encode, 0)
    for i, fmt in enumerate(plan.moments):
      if fmt.spec.bits == 4:
        codes = [codes_refs[i][half] for half in range(2)]
        code_refs[i][:, _lanes(chunk, PIECE)] = program.gather(codes).astype(jnp.uint8)
    return tuple(block_scales)

  init = tuple(jnp.zeros(ref.shape, jnp.float32) if ref is not None else jnp.zeros((), jnp.float32)
               for ref in block_scale_refs)
  block_scales = _chunks(plan, chunk_step, init)
  for ref, scales in zip(block_scale_refs, block_scales):
    if ref is not None:
      ref[...] = scales


def step_scratch(plan: Plan) -> list:
  """The step pass's VMEM scratch, per moment in order: its new values of a
  chunk's two pieces (float32), the codes they replace (a ``stall_only``
  spec's) and their new codes (4-bit), each ``(2, BR, 128)``."""
  shape = (2, plan.block_rows, PIECE)
  out = []
  for fmt in plan.moments:
    out.append((shape, jnp.float32))
    if fmt.spec.stall_only:
      out.append((shape, jnp.int32))
    if fmt.spec.bits == 4:
      out.append((shape, jnp.int32))
  return out


def pallas_modules():
  """``(pallas, pallas.tpu)``, imported when a kernel is built."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  return pl, pltpu
