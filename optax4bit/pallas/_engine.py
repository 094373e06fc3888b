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
update over the gradient when their dtypes match, the codes and block scales
over the old ones; a program reads its tile before it writes it). With the
gradient and the state donated, the step then needs no leaf-sized
temporary; the update written into a fresh buffer while the gradient stays
alive for a second pass would be one, which XLA:GPU does not schedule one
leaf at a time. The stats pass reads only the old moments of the global
moments (it sees the others as zeros), so a global moment may depend only on
the dense inputs, the side inputs, the coefficients and its *own* old value.
Every optimizer of this package satisfies that.

Numerics follow the jnp reference operation by operation: the same decode
(table entry times scale), the same normalization ``n = (x * (4 / scale)) *
0.25`` with the reciprocal taken on the scale arrays (for rank-1 ``4 / min(mu)
== max(4 / mu)``), NaN mapped to 0, and the same select-tree / closed-form
encoders (`optax4bit.quant.maps`), so in interpret mode the quantizers
reproduce the reference bit for bit. Stochastic rounding takes one uint32
seed per new moment (an input after the coefficients) and draws, for the
element at row ``r`` and column ``c`` of the ``(R, D)`` view, the hashed
uniform of flat index ``r * D + c`` (modulo 2**32; for a shard, ``base[r] +
c`` with the row's index in the whole leaf as an input), exactly
`optax4bit.quant.maps.hashed_uniform`'s draw for that element, whatever the
tiling; its encoder is `maps.encode_stochastic` operation by operation. On the GPU,
divisions and square roots use correctly rounded PTX (``div.rn.f32``,
``sqrt.rn.f32``; Triton's own ``/`` is the approximate ``div.full.f32``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit._platform import compiled_only_for
from optax4bit.pallas import _operands
from optax4bit.pallas._geometry import (
    DEFAULT_NUM_WARPS,
    DEFAULT_TILE_BYTES,
    Format,
    Geometry,
    geometry,
    moment_format,
)
from optax4bit.quant import maps, normalize
from optax4bit.quant.array import QuantizedArray
from optax4bit.quant.spec import QuantSpec

def _pallas():
  """``(pl, plgpu)``, imported on first use: importing Pallas costs a
  noticeable part of ``import optax4bit``, and most runs use no kernel."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return pl, plgpu


# ----------------------------------------------------------------------------
# Kernel side.


class KernelMath:
  """Division and square root, correctly rounded on both backends."""

  def __init__(self, triton: bool):
    self.triton = triton

  def _asm(self, asm: str, *args):
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
    args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in args]
    constraints = "=r," + ",".join("r" for _ in args)
    _, plgpu = _pallas()
    (out,) = plgpu.elementwise_inline_asm(
        asm, args=args, constraints=constraints, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out

  def div(self, a, b):
    if self.triton:
      return self._asm("div.rn.f32 $0, $1, $2;", a, b)
    return a / b

  def sqrt(self, x):
    if self.triton:
      return self._asm("sqrt.rn.f32 $0, $1;", x)
    return jnp.sqrt(x)

  def inverse_times_4(self, s):
    return normalize.inverse_times_4(s, self.div)


@dataclasses.dataclass(frozen=True)
class SideInput:
  """A float32 array broadcast against the leaf: ``"row"`` (R,) or
  ``"lead_col"`` (A, D), indexed by (row // axis_rows, column)."""
  kind: str


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _load(ref, index, mask):
  _, plgpu = _pallas()
  return plgpu.load(ref.at[index], mask=mask, other=jnp.zeros((), ref.dtype))


def _finite_abs(x, mask):
  return jnp.where(mask & jnp.isfinite(x), jnp.abs(x), np.float32(0))


def hashed_uniform(seed, index):
  """`optax4bit.quant.maps.hashed_uniform` of uint32 element indices (flat
  indices in the leaf, modulo 2**32) under a uint32 ``seed``."""
  bits = maps.mix32(index ^ seed)
  return (bits >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)


def encode_stochastic(n, uniform, spec: QuantSpec, div=jnp.divide):
  """`optax4bit.quant.maps.encode_stochastic`, operation by operation, with
  the division taken by ``div`` (correctly rounded on the GPU)."""
  table = maps.qmap(spec.mapping, spec.bits, spec.signed)
  n = jnp.clip(n, table[0], table[-1])
  lower, low_value, _ = maps.bracket(n, table)
  # The gap to the next entry from a table of the same float32 differences
  # rather than from the bracket's upper entry: one float fewer live through
  # the search keeps the ragged steps within ptxas's register targets.
  gaps = np.append(np.diff(table), np.float32(0))
  decided = [(lower & (1 << (spec.bits - 1 - level))) != 0 for level in range(spec.bits)]
  gap = maps._select_by_bits(decided, list(gaps))  # pylint: disable=protected-access
  round_up_probability = jnp.where(gap > 0, div(n - low_value, jnp.where(gap > 0, gap, 1)), 0)
  return lower + (uniform < round_up_probability).astype(jnp.int32)


def _encode(x, inverse_times_4, spec: QuantSpec, uniform=None, div=jnp.divide):
  """Codes of ``x`` given ``4 / scale`` (`normalize.normalize`, then the
  table's encoder; ``uniform``: the draws of stochastic rounding)."""
  n = (x * inverse_times_4) * np.float32(0.25)
  n = jnp.where(jnp.isnan(n), np.float32(0), n)
  if spec.stochastic:
    return encode_stochastic(n, uniform, spec, div).astype(jnp.int32)
  return maps.encode_nearest(n, spec.mapping, spec.bits, spec.signed).astype(jnp.int32)


def _pack(code_even, code_odd, valid_odd):
  return (code_even | (jnp.where(valid_odd, code_odd, 0) << 4)).astype(jnp.uint8)


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


def _kernel(plan: _Plan, fn: Callable, stats_pass: bool, triton: bool, *refs):
  geo = plan.geo
  it = iter(refs)
  coef_ref = next(it) if plan.num_coef else None
  seed_ref = next(it) if plan.seeded else None
  base_ref = next(it) if plan.row_based else None
  dense_refs = [next(it) for _ in range(plan.dense_in)]
  old_refs = []
  for fmt, read in zip(plan.old, plan.old_read):
    count = {"block": 2, "group": 2, "rank1": 3}[fmt.kind] if read else 0
    old_refs.append([next(it) for _ in range(count)])
  side_refs = [next(it) for _ in plan.side]
  inv_refs = []
  if not stats_pass:
    for fmt in plan.new:
      if not fmt.local:
        inv_refs.append([next(it) for _ in range(2 if fmt.kind == "rank1" else 1)])
  outs = list(it)

  pl, plgpu = _pallas()
  i, j = pl.program_id(0), pl.program_id(1)
  br, nbt, s = geo.tile
  shape = geo.tile
  row = i * br + _iota(shape, 0)
  seg = j * nbt + _iota(shape, 1)
  byte = seg * s + _iota(shape, 2)
  row_1 = i * br + _iota((br, 1, 1), 0)
  valid_row = row_1 < geo.rows
  valid = (row < geo.rows) & (byte < geo.half)
  cols = (2 * byte, 2 * byte + 1)
  valids = (valid, valid & (cols[1] < geo.cols))
  kmath = KernelMath(triton)
  coef = tuple(coef_ref[k] for k in range(plan.num_coef))

  def uniforms(k: int, fmt: Format):
    """Stochastic rounding's draws for new moment ``k`` (even, odd halves):
    hashed flat element indices ``row * D + column`` of the leaf."""
    if not fmt.spec.stochastic:
      return None, None
    seed = seed_ref[k]
    if base_ref is not None:  # a shard of a larger leaf
      row_index = _load(base_ref, row_1, valid_row)
    else:
      row_index = row_1.astype(jnp.uint32) * np.uint32(geo.cols % 2**32)
    return tuple(hashed_uniform(seed, row_index + c.astype(jnp.uint32)) for c in cols)

  def row_index(fmt: Format):
    """Flat index of the group scale of each row (group formats)."""
    lead_index = jax.lax.div(row_1, np.int32(geo.axis_rows))
    in_lead = jax.lax.rem(row_1, np.int32(geo.axis_rows))
    return lead_index * _operands.num_groups(fmt, geo) + jax.lax.div(in_lead, np.int32(fmt.group_rows))

  def per_element_scale(fmt: Format, scale_refs, combine):
    """Scale (or inverse) of the even and odd elements."""
    if fmt.kind == "block":
      block = jax.lax.div(byte, np.int32(fmt.block_bytes))
      value = _load(scale_refs[0], (row, block), valid)
      return value, value
    if fmt.kind == "group":
      value = _load(scale_refs[0], row_index(fmt), valid_row)
      return value, value
    row_value = _load(scale_refs[0], row_1, valid_row)
    return tuple(combine(row_value, _load(scale_refs[1], c, v)) for c, v in zip(cols, valids))

  # Inputs of both halves.
  dense = [[_load(ref, (row, c), v).astype(jnp.float32) for ref in dense_refs]
           for c, v in zip(cols, valids)]
  old = [[], []]
  for fmt, refs_k in zip(plan.old, old_refs):
    if not refs_k:  # not needed in this pass (and possibly overwritten already)
      old[0].append(jnp.zeros(shape, jnp.float32))
      old[1].append(jnp.zeros(shape, jnp.float32))
      continue
    packed = _load(refs_k[0], (row, byte), valid).astype(jnp.int32)
    codes = (packed & 15, packed >> 4)
    scale = per_element_scale(fmt, refs_k[1:], jnp.minimum)
    for h in range(2):
      value = maps.decode(codes[h], fmt.spec.mapping, fmt.spec.bits, fmt.spec.signed)
      old[h].append(value * scale[h])
  side = [[], []]
  for side_input, ref in zip(plan.side, side_refs):
    if side_input.kind == "row":
      value = _load(ref, row_1, valid_row)
      side[0].append(value)
      side[1].append(value)
    else:
      lead_index = jax.lax.div(row, np.int32(geo.axis_rows))
      for h in range(2):
        side[h].append(_load(ref, (lead_index, cols[h]), valids[h]))

  results = [fn(kmath, coef, tuple(dense[h]), tuple(old[h]), tuple(side[h])) for h in range(2)]

  out_it = iter(outs)
  row_2 = i * br + _iota((br, nbt), 0)
  seg_2 = j * nbt + _iota((br, nbt), 1)
  valid_2 = (row_2 < geo.rows) & (seg_2 < geo.num_segs)
  if not stats_pass:
    for k, dtype in enumerate(plan.dense_out):
      ref = next(out_it)
      for h in range(2):
        plgpu.store(ref.at[row, cols[h]], results[h][0][k].astype(dtype), mask=valids[h])
  inv_it = iter(inv_refs)
  for k, fmt in enumerate(plan.new):
    values = (results[0][1][k], results[1][1][k])
    if stats_pass:  # the partial maxima of the moments whose scales span tiles
      if fmt.local:
        continue
      absolute = [_finite_abs(values[h], valids[h]) for h in range(2)]
      seg_max = jnp.maximum(absolute[0].max(axis=2), absolute[1].max(axis=2))
      plgpu.store(next(out_it).at[row_2, seg_2], seg_max, mask=valid_2)
      if fmt.kind == "rank1":
        col_ref = next(out_it)
        tile_row = jnp.full((nbt, s), i, jnp.int32)
        byte_2 = (j * nbt + _iota((nbt, s), 0)) * s + _iota((nbt, s), 1)
        for h in range(2):
          col_c = 2 * byte_2 + h
          plgpu.store(col_ref.at[tile_row, col_c], absolute[h].max(axis=0),
                      mask=col_c < geo.cols)
      continue
    uniform = uniforms(k, fmt)
    if fmt.local:
      codes_ref, scales_ref = next(out_it), next(out_it)
      absolute = [_finite_abs(values[h], valids[h]) for h in range(2)]
      seg_max = jnp.maximum(absolute[0].max(axis=2), absolute[1].max(axis=2))
      inverse = (kmath.inverse_times_4(seg_max)[:, :, None],) * 2
      plgpu.store(scales_ref.at[row_2, seg_2], seg_max, mask=valid_2)
    else:
      codes_ref = next(out_it)
      inverse = per_element_scale(fmt, next(inv_it), jnp.maximum)
    codes = [_encode(values[h], inverse[h], fmt.spec, uniform[h], kmath.div) for h in range(2)]
    plgpu.store(codes_ref.at[row, byte], _pack(codes[0], codes[1], valids[1]), mask=valid)


_COMPILED_FOR_CPU_ERROR = (
    "optax4bit's Pallas kernels (implementation='pallas', or 'auto' traced while the default "
    "device was a GPU) compile for GPUs only, and this computation is compiled for {platforms}. "
    "Pass implementation='auto' with the arrays' device as the default device, 'jnp', or "
    "'pallas_interpret' (the kernels in interpret mode, slow).")


def _call(plan: _Plan, fn, stats_pass: bool, inputs: list, out_shapes: list, aliases: dict,
          options: "Options"):
  kernel = functools.partial(_kernel, plan, fn, stats_pass, not options.interpret)
  pl, plgpu = _pallas()
  if not options.interpret:
    inputs = [compiled_only_for(inputs[0], ("cuda", "rocm"), _COMPILED_FOR_CPU_ERROR),
              *inputs[1:]]
  return pl.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=plan.geo.grid,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=options.num_warps, num_stages=1),
      interpret=options.interpret,
      name=f"optax4bit_{'stats' if stats_pass else 'step'}",
  )(*inputs)


@dataclasses.dataclass(frozen=True)
class Options:
  """Static options of a kernel launch."""
  interpret: bool = False
  tile_bytes: int = DEFAULT_TILE_BYTES
  num_warps: int = DEFAULT_NUM_WARPS


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
      overwrites (or None).
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
  geo = geometry(shape, specs, options.tile_bytes)
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
  plan = _Plan(geo, 0 if coef is None else int(coef.shape[0]), seeded, row_based,
               len(dense_in), old_fmts,
               tuple(s for _, s in side), tuple(jnp.dtype(d) for d in dense_out), new_fmts,
               (True,) * len(old))
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

  new_scales = [None] * len(new_fmts)
  deferred = [k for k, fmt in enumerate(new_fmts) if not fmt.local]
  if deferred:
    # Stats pass: the partial maxima of the moments whose scales span tiles
    # (rank-1, tensor). It reads only their own old moments, and writes nothing
    # else, so that the step pass below can overwrite every input it reads.
    read = tuple(any(alias[k] == m for k in deferred) for m in range(len(old)))
    inputs, _ = assemble(read)
    out_shapes = []
    for k in deferred:
      out_shapes.append(jax.ShapeDtypeStruct((geo.rows, geo.num_segs), jnp.float32))
      if new_fmts[k].kind == "rank1":
        out_shapes.append(jax.ShapeDtypeStruct((geo.row_tiles, geo.cols), jnp.float32))
    outs = list(_call(dataclasses.replace(plan, old_read=read), fn, True, inputs, out_shapes,
                      {}, options))
    for k in deferred:
      row_part = outs.pop(0)
      col_part = outs.pop(0) if new_fmts[k].kind == "rank1" else None
      new_scales[k] = _operands.scales_from_partials(new_fmts[k], geo, row_part, col_part,
                                                     reduce_scales)

  # Step pass: the update and every new moment, each written over the input
  # it replaces (the gradient, the old codes and block scales): with donated
  # buffers the step needs no leaf-sized temporary.
  inputs, position = assemble(plan.old_read)
  for k in deferred:
    inputs.extend(_operands.encode_operands(new_scales[k], new_fmts[k], geo))
  out_shapes, aliases = [], {}
  for k, dtype in enumerate(plan.dense_out):
    if k < len(dense_in) and jnp.dtype(dense_in[k].dtype) == dtype:
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
