"""The tiled leaf engine behind every Pallas kernel of this package.

A leaf of shape ``(..., D)`` is viewed as a matrix ``(R, D)`` (``R`` the
product of the leading axes; a 1-D leaf is ``(1, D)``); its packed 4-bit codes
as ``(R, H)`` with ``H = ceil(D / 2)``. A kernel program owns a tile of
``BR`` rows by ``NBT`` segments of ``S`` code bytes (all powers of two, as
Triton requires), i.e. up to ``2 * BR * NBT * S`` elements. Elements are
loaded as two halves, the even and the odd elements of the tile's bytes, with
array-indexed (gather-style) loads: they lower to plain Triton pointer
arithmetic, and unlike strided ``pl.ds`` slices they also run in interpret
mode. Both halves go through the same elementwise function, and the codes of
an even/odd pair are packed into one byte (even element in the low nibble, a
zero nibble past an odd last axis), exactly the layout of
`optax4bit.quant.packing`. Ragged tails are masked: nothing outside the leaf
is read, written, or counted in a maximum.

How a quantized moment is normalized decides when it can be encoded:

* ``local``: block-wise along the last axis with ``B / 2 == S`` bytes per
  block. Each tile row segment is one block, so its new scale (the block
  maximum) is known inside the program: decode, step and encode in one pass.
* ``global``: everything else (rank-1 and tensor scales, blocks of ``B / 2 >
  S`` bytes, and blocks of ``g > 1`` whole short rows). A stats pass runs
  the step first and writes nothing but partial maxima of the new value: one
  per (row, segment), and for rank-1/tensor also one per (row tile, column).
  Those small arrays are reduced with jnp into exactly the scales of the jnp
  reference (maxima are exact, so the order of reduction does not matter).
  No float32 buffer of the leaf's size exists at any time; the partial maxima
  cost ``4 / (2 * S)`` plus, for rank-1, ``4 / BR`` bytes per element, for
  one leaf at a time.

Then the step pass runs the step again and writes the update and every new
moment, each over the input it replaces (``input_output_aliases``: the
update over the gradient when their dtypes match, unless
``Options.update_in_place`` is off, the codes and block scales over the old
ones; a program reads its tile before it writes it). Where the gradient is
an intermediate (a train step) the step then needs no leaf-sized temporary;
the update written into a fresh buffer while the gradient stays alive for a
second pass would be one, which XLA:GPU does not schedule one leaf at a
time. A jit argument, donated or not, is writable only where it aliases an
output, so an update jitted alone copies each gradient first.

The stats pass reads only the old moments of the global
moments (it sees the others as zeros), so a global moment may depend only on
the dense inputs, the side inputs, the coefficients and its *own* old value.
Every optimizer of this package satisfies that.

Numerics follow the jnp reference operation by operation: the same decode
(table entry times scale), the same normalization ``n = (x * (4 / scale)) *
0.25`` with the reciprocal taken on the scale arrays (for rank-1 ``4 / min(mu)
== max(4 / mu)``), NaN mapped to 0, and encoders that give the reference's
codes bit for bit. The elementwise math is `optax4bit.pallas._math`; it reads
the 4-bit maps through small lookup tables (`optax4bit.pallas._codebook`,
kernel inputs after all others) instead of the reference's select trees.
Stochastic rounding takes one uint32 seed per new moment (an input after the
coefficients) and draws, for the element at row ``r`` and column ``c`` of the
``(R, D)`` view, the hashed uniform of flat index ``r * D + c`` (modulo
2**32; for a shard, ``base[r] + c`` with the row's index in the whole leaf as
an input), exactly `optax4bit.quant.maps.hashed_uniform`'s draw for that
element, whatever the tiling. A ``stall_only`` moment (stochastic rounding
only where the nearest code is the stored one) takes its stored codes from the
bytes of the old moment it overwrites, which the step pass loads to decode
anyway. On the GPU, what decides a code reproduces the
correctly rounded division exactly, and the update's division and square root
are approximate (`_math.KernelMath`). Where the tiles cover the leaf exactly
(`Geometry.exact`), the kernels carry no masks.

The two passes are `_stats_kernel` and `_step_kernel`, over the refs of
`_Refs` (named by what they hold) and the indices of one program's
`optax4bit.pallas._tile.Tile`,
each launched through a `jax.jit` of its `pallas_call` cached per plan
(`_launcher`), so that leaves of one shape share one lowered kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit._platform import compiled_only_for
from optax4bit.pallas import _codebook, _math, _operands
from optax4bit.pallas._geometry import (
    DEFAULT_NUM_WARPS,
    DEFAULT_TILE_BYTES,
    STATS_TILE_FACTOR,
    Format,
    Geometry,
    geometry,
    moment_format,
)
from optax4bit.pallas._tile import Tile, gather_row, iota, load, pallas_modules, store
from optax4bit.quant.array import QuantizedArray


# ----------------------------------------------------------------------------
# Kernel side.


@dataclasses.dataclass(frozen=True)
class SideInput:
  """A float32 array broadcast against the leaf: ``"row"`` (R,) or
  ``"lead_col"`` (A, D), indexed by (row // axis_rows, column)."""
  kind: str


def _table_operand(table: np.ndarray) -> jax.Array:
  return jnp.asarray(np.ascontiguousarray(table.T))


@dataclasses.dataclass(frozen=True)
class _Plan:
  geo: Geometry
  num_coef: int
  seeded: bool        # a uint32 seed per new moment follows the coefficients
  row_based: bool     # then the uint32 hash index of each row's first element
  dense_in: int
  old: tuple          # Formats of the old (decoded) moments
  side: tuple         # SideInputs
  dense_out: tuple    # dtypes
  new: tuple          # Formats of the new (encoded) moments
  old_read: tuple     # per old moment: whether this pass reads it (else zeros)
  # Per new moment, the old moment whose codes its stall rule compares with
  # (``stall_only`` specs; None: no rule). Empty where no moment has one.
  stall: tuple = ()


def _scale_count(fmt: Format) -> int:
  return 2 if fmt.kind == "rank1" else 1


def _encode_tables(fmt: Format) -> tuple:
  """The lookup tables of new moment ``fmt``'s encoder (`_codebook`)."""
  spec = fmt.spec
  if spec.stochastic:
    bucket = _codebook.bucket_table(spec.mapping, spec.signed, inclusive=True)
    return (bucket.entries, _codebook.entry_gaps(spec))
  if spec.mapping == "Linear":
    return ()
  return (_codebook.bucket_table(spec.mapping, spec.signed, inclusive=False).entries,)


@dataclasses.dataclass(frozen=True)
class _Refs:
  """The refs of one pass, by name (in the order of the call's operands)."""
  coef: Any
  seeds: Any
  row_bases: Any
  dense: tuple
  old: tuple            # per old moment: (codes, *scales), () if not read
  side: tuple
  inverse: tuple        # step pass: per new moment, its inverse scales (global ones)
  decode_tables: tuple  # per old moment: its decode table (None if not read)
  encode_tables: tuple  # step pass: per new moment, its encoder's tables
  out: tuple

  @classmethod
  def split(cls, plan: _Plan, stats_pass: bool, refs: Sequence) -> "_Refs":
    it = iter(refs)
    take = lambda n: tuple(next(it) for _ in range(n))
    coef = next(it) if plan.num_coef else None
    seeds = next(it) if plan.seeded else None
    row_bases = next(it) if plan.row_based else None
    dense = take(plan.dense_in)
    old = tuple(take(1 + _scale_count(f)) if read else ()
                for f, read in zip(plan.old, plan.old_read))
    side = take(len(plan.side))
    inverse = tuple(() if stats_pass or f.local else take(_scale_count(f)) for f in plan.new)
    decode_tables = tuple(next(it) if read else None for read in plan.old_read)
    encode_tables = tuple(() if stats_pass else take(len(_encode_tables(f))) for f in plan.new)
    return cls(coef, seeds, row_bases, dense, old, side, inverse, decode_tables, encode_tables,
               tuple(it))


def _inputs(plan: _Plan, refs: _Refs, tile: Tile):
  """The step function's inputs, per half: ``(dense, old, side)``; and per
  old moment its int32 code bytes (None where this pass does not read it)."""
  geo = plan.geo
  dense = list(zip(*(tile.load_halves(ref) for ref in refs.dense))) or [(), ()]
  old, old_bytes = [[], []], []
  for fmt, moment, table in zip(plan.old, refs.old, refs.decode_tables):
    if not moment:  # not needed in this pass (and possibly overwritten already)
      for h in range(2):
        old[h].append(jnp.zeros(geo.tile, jnp.float32))
      old_bytes.append(None)
      continue
    packed = load(moment[0], (tile.row, tile.byte), tile.valid).astype(jnp.int32)
    old_bytes.append(packed)
    values = _math.decode_bytes(packed, table, gather_row)
    scale = tile.per_element(fmt, moment[1:], jnp.minimum)
    for h in range(2):
      old[h].append(values[h] * scale[h])
  side = [[], []]
  for side_input, ref in zip(plan.side, refs.side):
    if side_input.kind == "row":
      value = load(ref, tile.row_1, tile.valid_row)
      values = (value, value)
    else:
      lead_index = jax.lax.div(tile.row, np.int32(geo.axis_rows))
      values = tuple(load(ref, (lead_index, c), v) for c, v in zip(tile.cols, tile.valids))
    for h in range(2):
      side[h].append(values[h])
  return [(tuple(dense[h]), tuple(old[h]), tuple(side[h])) for h in range(2)], old_bytes


def _program_ids(geo: Geometry):
  """The program's (row tile, segment tile). Where the tiles cover the leaf
  exactly, each is clamped to the grid by an unsigned minimum that never
  changes it: LLVM then knows the ids' range, so that an element's offset
  (below 2**31) folds its constant part into the load's immediate instead
  of a 64-bit address per element (about 3 instructions per parameter
  fewer). With masks (ragged leaves) the same hint made ptxas spill."""
  pl, _ = pallas_modules()
  if not geo.exact:
    return pl.program_id(0), pl.program_id(1)
  return tuple(jnp.minimum(pl.program_id(axis).astype(jnp.uint32),
                           np.uint32(size - 1)).astype(jnp.int32)
               for axis, size in enumerate(geo.grid))


def _segment_index(geo: Geometry, i, j):
  br, nbt, _ = geo.tile
  row = i * br + iota((br, nbt), 0)
  seg = j * nbt + iota((br, nbt), 1)
  return (row, seg), None if geo.exact else (row < geo.rows) & (seg < geo.num_segs)


def _stats_kernel(plan: _Plan, fn: Callable, triton: bool, *refs):
  """Pass 1: the partial maxima of the new moments whose scales span tiles:
  per (row, segment), and for rank-1 also per (row tile, column)."""
  refs = _Refs.split(plan, True, refs)
  geo = plan.geo
  i, j = _program_ids(geo)
  tile = Tile.of_program(geo, i, j)
  coef = tuple(refs.coef[k] for k in range(plan.num_coef))
  halves, _ = _inputs(plan, refs, tile)
  results = [fn(_math.KernelMath(triton), coef, *args) for args in halves]
  segment, segment_valid = _segment_index(geo, i, j)
  out = iter(refs.out)
  for k, fmt in enumerate(plan.new):
    if fmt.local:
      continue
    keys, seg_max = tile.segment_max((results[0][1][k], results[1][1][k]))
    store(next(out), segment, seg_max, segment_valid)
    if fmt.kind == "rank1":
      col_ref = next(out)
      nbt, s = geo.tile[1:]
      tile_row = jnp.full((nbt, s), i, jnp.int32)
      byte = (j * nbt + iota((nbt, s), 0)) * s + iota((nbt, s), 1)
      for h in range(2):
        col = 2 * byte + h
        store(col_ref, (tile_row, col), _math.abs_of_key(keys[h].max(axis=0)),
               None if geo.exact else col < geo.cols)


def _step_kernel(plan: _Plan, fn: Callable, triton: bool, *refs):
  """Pass 2: the dense outputs and every new moment, encoded."""
  refs = _Refs.split(plan, False, refs)
  geo = plan.geo
  i, j = _program_ids(geo)
  tile = Tile.of_program(geo, i, j)
  kmath = _math.KernelMath(triton)
  coef = tuple(refs.coef[k] for k in range(plan.num_coef))
  halves, old_bytes = _inputs(plan, refs, tile)
  results = [fn(kmath, coef, *args) for args in halves]
  out = iter(refs.out)
  for k in range(len(plan.dense_out)):
    tile.store_halves(next(out), (results[0][0][k], results[1][0][k]))
  segment, segment_valid = _segment_index(geo, i, j)
  for k, fmt in enumerate(plan.new):
    values = (results[0][1][k], results[1][1][k])
    codes_ref = next(out)
    if fmt.local:
      _, seg_max = tile.segment_max(values)
      inverse = (kmath.inverse_times_4(seg_max)[:, :, None],) * 2
      store(next(out), segment, seg_max, segment_valid)
    else:
      inverse = tile.per_element(fmt, refs.inverse[k], jnp.maximum)
    n = [_math.normalized(values[h], inverse[h]) for h in range(2)]
    spec, tables = fmt.spec, refs.encode_tables[k]
    if spec.stochastic:
      bucket = _codebook.bucket_table(spec.mapping, spec.signed, inclusive=True)
      scaled_uniform = tile.scaled_uniforms(refs.seeds[k], refs.row_bases)
      stored = (None, None)
      if plan.stall and plan.stall[k] is not None:
        # The stall rule's stored codes: the nibbles of the old moment's bytes
        # that this pass decoded (masked bytes load as 0 and are not stored).
        packed = old_bytes[plan.stall[k]]
        stored = (packed & 15, jax.lax.shift_right_logical(packed, np.int32(4)))
      codes = [_math.encode_stochastic(n[h], scaled_uniform[h], bucket, *tables, gather_row,
                                       kmath.probability, stored[h]) for h in range(2)]
    else:
      bucket = _codebook.bucket_table(spec.mapping, spec.signed, inclusive=False)
      codes = [_math.encode_nearest(n[h], spec, bucket, tables[0] if tables else None,
                                    gather_row, kmath) for h in range(2)]
    store(codes_ref, (tile.row, tile.byte), _math.pack(codes[0], codes[1], tile.valids[1]),
           tile.valid)


_COMPILED_FOR_CPU_ERROR = (
    "optax4bit's Pallas kernels (implementation='pallas', or 'auto' lowered for several "
    "platforms at once) compile for CUDA GPUs only, and this computation is compiled for "
    "{platforms}. Pass implementation='auto' (the engine of the platform the update is "
    "compiled for), 'jnp' to lower for several platforms, or 'pallas_interpret' (the kernels "
    "in interpret mode, slow).")


def _call(plan: _Plan, fn, stats_pass: bool, inputs: list, out_shapes: list, aliases: dict,
          options: "Options"):
  if not options.interpret:
    inputs = [compiled_only_for(inputs[0], ("cuda", "rocm"), _COMPILED_FOR_CPU_ERROR),
              *inputs[1:]]
  return _launcher(plan, fn, stats_pass, tuple(out_shapes), tuple(sorted(aliases.items())),
                   options)(*inputs)


@functools.lru_cache(maxsize=256)
def _launcher(plan: _Plan, fn, stats_pass: bool, out_shapes: tuple, aliases: tuple,
              options: "Options"):
  """The jitted `pallas_call` of a pass, one per plan: identical leaves then
  share one traced and lowered kernel (JAX lowers a nested jit once per
  jaxpr), where each call of a fresh `pallas_call` traced and lowered its own."""
  kernel = functools.partial(_stats_kernel if stats_pass else _step_kernel, plan, fn,
                             not options.interpret)
  pl, plgpu = pallas_modules()
  return jax.jit(pl.pallas_call(
      kernel,
      out_shape=list(out_shapes),
      grid=plan.geo.grid,
      input_output_aliases=dict(aliases),
      compiler_params=plgpu.CompilerParams(num_warps=options.num_warps, num_stages=1),
      interpret=options.interpret,
      name=f"optax4bit_{'stats' if stats_pass else 'step'}",
  ))


@dataclasses.dataclass(frozen=True)
class Options:
  """Static options of a kernel launch (``tile_bytes`` None: the default;
  ``update_in_place``: dense outputs over the dense inputs of their dtype)."""
  interpret: bool = False
  tile_bytes: Optional[int] = DEFAULT_TILE_BYTES
  num_warps: int = DEFAULT_NUM_WARPS
  update_in_place: bool = True


def run(fn: Callable, *, shape: tuple, coef: Optional[jax.Array] = None,
        dense_in: Sequence[jax.Array] = (), old: Sequence[QuantizedArray] = (),
        side: Sequence[tuple] = (), dense_out: Sequence[Any] = (),
        new: Sequence[tuple] = (), alias: Sequence[Optional[int]] = (),
        seeds: Sequence[Optional[jax.Array]] = (), row_bases: Optional[jax.Array] = None,
        options: Options = Options(), reduce_scales: Optional[Callable] = None):
  """Runs an elementwise step over one leaf with the Pallas kernels.

  Args:
    fn: ``fn(kmath, coef, dense, old, side) -> (dense_out, new)`` on float32
      arrays (called once for the even and once for the odd elements); ``coef``
      is a tuple of float32 scalars.
    shape: the leaf's shape.
    coef: float32 vector of scalar coefficients.
    dense_in: arrays of the leaf's shape (any float dtype).
    old: quantized moments to decode.
    side: ``(array, SideInput)`` pairs.
    dense_out: dtypes of the dense outputs.
    new: ``(spec, dtype)`` of the moments to encode.
    alias: per new moment, the index of the old moment whose buffers it
      overwrites (or None). A ``stall_only`` new moment's rule compares with
      that old moment's codes, the codes it replaces (without one it rounds
      stochastically everywhere, as `optax4bit.quant.array.encode` does
      without stored codes).
    seeds: per new moment, the uint32 seed of its stochastic rounding
      (`optax4bit.quant.maps.rounding_seed` of its key), or None for nearest
      rounding. Element ``e`` (flat index in the leaf) draws
      ``maps.hashed_uniform``'s number, so the codes are the jnp reference's.
    row_bases: for a shard of a larger leaf, the uint32 flat index in the
      whole leaf of each row's first element (`maps.row_hash_bases`); by
      default the leaf is whole (row ``r`` starts at ``r * D``).
    options: interpret mode and tiling.
    reduce_scales: cross-shard reduction of rank-1/tensor scales (see
      `_operands.scales_from_partials`).

  Returns:
    ``(dense_outputs, new_moments)``.
  """
  shape = tuple(shape)
  specs = [q.spec for q in old] + [spec for spec, _ in new]
  tile_bytes = options.tile_bytes or DEFAULT_TILE_BYTES
  geo = geometry(shape, specs, tile_bytes)
  old_fmts = tuple(moment_format(q.spec, geo) for q in old)
  new_fmts = tuple(moment_format(spec, geo) for spec, _ in new)
  alias = tuple(alias) if alias else (None,) * len(new)
  seeds = tuple(seeds) if seeds else (None,) * len(new)
  if len(seeds) != len(new):
    raise ValueError(f"seeds: expected one per new moment ({len(new)}), got {len(seeds)}.")
  for (spec, _), seed in zip(new, seeds):
    if spec.stochastic and seed is None:
      raise ValueError(f"{spec} rounds stochastically and needs a seed.")
  seeded = any(spec.stochastic for spec, _ in new)
  row_based = seeded and row_bases is not None
  stall = tuple(a if spec.stall_only else None for (spec, _), a in zip(new, alias))
  plan = _Plan(geo, 0 if coef is None else int(coef.shape[0]), seeded, row_based,
               len(dense_in), old_fmts,
               tuple(s for _, s in side), tuple(jnp.dtype(d) for d in dense_out), new_fmts,
               (True,) * len(old), stall if any(a is not None for a in stall) else ())
  head = ([] if coef is None else [coef.astype(jnp.float32)])
  if seeded:
    head.append(jnp.stack([jnp.zeros((), jnp.uint32) if seed is None or not spec.stochastic
                           else jnp.asarray(seed).astype(jnp.uint32).reshape(())
                           for (spec, _), seed in zip(new, seeds)]))
  if row_based:
    head.append(jnp.asarray(row_bases).astype(jnp.uint32).reshape(geo.rows))
  head += [x.reshape(geo.rows, geo.cols) for x in dense_in]
  old_ops = [_operands.decode_operands(q, f, geo) for q, f in zip(old, old_fmts)]
  side_ops = [jnp.asarray(a, jnp.float32) for a, _ in side]

  def assemble(read: Sequence[bool]):
    """Inputs of a pass and the input index of each read moment's codes."""
    inputs, position = list(head), {}
    for k, ops in enumerate(old_ops):
      if read[k]:
        position[k] = len(inputs)
        inputs.extend(ops)
    return inputs + side_ops, position

  decode_tables = [_table_operand(_codebook.decode_pairs(f.spec)) for f in old_fmts]
  encode_tables = [_table_operand(t) for f in new_fmts for t in _encode_tables(f)]

  def tables(read: Sequence[bool], encode: bool) -> list:
    return [t for t, r in zip(decode_tables, read) if r] + (encode_tables if encode else [])

  new_scales = [None] * len(new_fmts)
  deferred = [k for k, fmt in enumerate(new_fmts) if not fmt.local]
  if deferred:
    # Stats pass: the partial maxima of the moments whose scales span tiles
    # (rank-1, tensor). It reads only their own old moments, and writes nothing
    # else, so that the step pass below can overwrite every input it reads.
    read = tuple(any(alias[k] == m for k in deferred) for m in range(len(old)))
    inputs, _ = assemble(read)
    inputs += tables(read, False)
    # Larger tiles than the step's where they cover the leaf exactly: this pass
    # holds few values per element (no encoder), and more elements per thread
    # share the index arithmetic. With masks (ragged leaves) ptxas runs out of
    # registers above the default tile.
    stats_geo = geometry(shape, specs, tile_bytes * STATS_TILE_FACTOR, segment=geo.seg)
    if not stats_geo.exact:
      stats_geo = geometry(shape, specs, min(tile_bytes, DEFAULT_TILE_BYTES), segment=geo.seg)
    out_shapes = []
    for k in deferred:
      out_shapes.append(jax.ShapeDtypeStruct((geo.rows, geo.num_segs), jnp.float32))
      if new_fmts[k].kind == "rank1":
        out_shapes.append(jax.ShapeDtypeStruct((stats_geo.row_tiles, geo.cols), jnp.float32))
    outs = list(_call(dataclasses.replace(plan, geo=stats_geo, old_read=read), fn, True, inputs,
                      out_shapes, {}, options))
    for k in deferred:
      row_part = outs.pop(0)
      col_part = outs.pop(0) if new_fmts[k].kind == "rank1" else None
      new_scales[k] = _operands.scales_from_partials(new_fmts[k], stats_geo, row_part, col_part,
                                                     reduce_scales)

  # Step pass: the update and every new moment, each written over the input
  # it replaces (the gradient, the old codes and block scales): with donated
  # buffers the step needs no leaf-sized temporary.
  inputs, position = assemble(plan.old_read)
  for k in deferred:
    inputs.extend(_operands.encode_operands(new_scales[k], new_fmts[k], geo))
  inputs += tables(plan.old_read, True)
  out_shapes, aliases = [], {}
  for k, dtype in enumerate(plan.dense_out):
    if options.update_in_place and k < len(dense_in) and jnp.dtype(dense_in[k].dtype) == dtype:
      aliases[len(head) - len(dense_in) + k] = len(out_shapes)
    out_shapes.append(jax.ShapeDtypeStruct((geo.rows, geo.cols), dtype))
  for fmt, a in zip(new_fmts, alias):
    if a is not None:
      aliases[position[a]] = len(out_shapes)
    out_shapes.append(jax.ShapeDtypeStruct((geo.rows, geo.half), jnp.uint8))
    if fmt.local:
      if a is not None:
        aliases[position[a] + 1] = len(out_shapes)
      out_shapes.append(jax.ShapeDtypeStruct((geo.rows, geo.num_segs), jnp.float32))
  outs = list(_call(plan, fn, False, inputs, out_shapes, aliases, options))
  dense_results = [outs.pop(0).reshape(shape) for _ in plan.dense_out]
  new_codes = [None] * len(new_fmts)
  for k, fmt in enumerate(new_fmts):
    new_codes[k] = outs.pop(0)
    if fmt.local:
      new_scales[k] = _operands.local_scales(outs.pop(0), fmt, geo)

  codes_shape = shape[:-1] + (geo.half,)
  new_moments = tuple(
      QuantizedArray(c.reshape(codes_shape), tuple(s), spec, shape, jnp.dtype(dtype))
      for c, s, (spec, dtype) in zip(new_codes, new_scales, new))
  return tuple(dense_results), new_moments
