"""The TPU engine's fused steps: Pallas TPU (Mosaic) kernels per leaf.

`TpuSteps` runs a leaf of two or more axes whose moments are all 4-bit or
8-bit, with block scales of 128 or 256 elements along the last axis or rank-1
scales, and whose
last axis is a multiple of 256 (at most 8192; with more than two axes the
second-to-last a multiple of 32): viewed as a matrix ``(rows, last axis)``,
a stats pass where a moment has rank-1 scales, then one step pass
(`optax4bit.tpu._kernel`, launched by `optax4bit.tpu._launch`). A leaf with only plain (not quantized) moments
runs as whole-leaf XLA ops. Every other leaf is declined (None) and runs the
jnp engine. Codes are the jnp engine's bit for bit (in interpret mode, where
the arithmetic is XLA's CPU arithmetic), updates equal it to float32
rounding. Sharded leaves run per shard (`optax4bit._fused_leaf`), each
element hashed at its index in the global leaf, rank-1 maxima reduced over
the shards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from optax4bit import _codecs
from optax4bit import _leafwise
from optax4bit import _shard_map
from optax4bit._fused_leaf import run_fused
from optax4bit._leaf_context import LeafContext
from optax4bit._steps import FusedStep
from optax4bit.quant import maps, normalize
from optax4bit.quant.array import QuantizedArray
from optax4bit.tpu import _kernel
from optax4bit.tpu import _launch

__all__ = ["TpuSteps"]


def _formats(moments: tuple) -> tuple:
  return tuple(_kernel.moment_format(m.spec, m.layout) for m in moments)


def _side_kind(shape: tuple, leaf_shape: tuple) -> Optional[str]:
  """A side input's `_kernel` kind: per row ``(..., A, 1)`` as the leaf's
  leading axes; the same for every row (all leading axes 1); per slab (one
  per index of the axes before ``A``); else None."""
  if len(shape) != len(leaf_shape) or shape[-1] not in (1, leaf_shape[-1]):
    return None
  lead, leaf_lead = shape[:-1], leaf_shape[:-1]
  if lead == leaf_lead and shape[-1] == 1:
    return _kernel.ROW
  if all(n == 1 for n in lead):
    return _kernel.COL
  if lead == leaf_lead[:-1] + (1,):
    return _kernel.SLAB
  return None


@dataclasses.dataclass(frozen=True)
class TpuSteps:
  """The fused per-leaf steps of one update as Pallas TPU kernels.
  ``interpret``: run them in Pallas interpret mode (any backend; tests)."""
  interpret: bool = False

  def run(self, step: FusedStep, grad: jax.Array, moments: Sequence,
          side: Sequence[jax.Array] = (), keys: Optional[Sequence] = None, *,
          context: LeafContext = LeafContext()):
    """``step`` on one leaf: ``(update, new_moments)``, or None where the
    kernels do not cover it. ``side``: for ``"factored"``, the ``(row, col,
    row_mean)`` of the updated factored second moment; ``keys``: one PRNG
    key (or None) per moment."""
    moments = tuple(moments)
    if not any(isinstance(m, QuantizedArray) for m in moments):
      return _plain_update(step, grad, moments, side, context)
    if not all(isinstance(m, QuantizedArray) for m in moments) or \
        not jnp.issubdtype(grad.dtype, jnp.floating):
      return None
    formats = _formats(moments)
    rebuild, consts = _shard_map.hoist_partial(step.elementwise())
    if not _kernel.covers(tuple(grad.shape), formats) or not all(
        jnp.shape(c) == () and jnp.result_type(c) == jnp.float32 for c in consts):
      return None
    keys = (None,) * len(moments) if keys is None else tuple(keys)
    interpret = self.interpret

    def covers_shard(shape: tuple) -> bool:
      kinds = [_side_kind(tuple(jnp.shape(s)), tuple(grad.shape)) for s in side]
      return _kernel.covers(shape, formats) and _plan(shape, formats, kinds, 0) is not None

    if not covers_shard(tuple(grad.shape)):
      return None

    def local(grad, moments, side, keys, shard, consts):
      leaf_context = context if shard is None else context.in_shard(shard)
      return _local_update(rebuild, leaf_context, grad, moments, side, keys, consts, interpret)

    return run_fused(local, grad, moments, tuple(side), consts, covers_shard, context, keys,
                     hashes_global_index=True)


def _plan(shape: tuple, formats: tuple, side_kinds, num_consts: int) -> Optional[_kernel.Plan]:
  if None in side_kinds:
    return None
  rows, cols = math.prod(shape[:-1]), shape[-1]
  slab_rows = shape[-2] if _kernel.SLAB in side_kinds else 0
  block_rows = _kernel.block_rows(rows, cols, slab_rows)
  if block_rows is None:
    return None
  return _kernel.Plan(rows, cols, block_rows, formats, tuple(side_kinds), num_consts, slab_rows)


def _plain_update(step: FusedStep, grad, moments, side, context: LeafContext):
  """A leaf with no quantized moment, as whole-leaf XLA ops (the jnp engine's
  step on the whole leaf; XLA fuses it into one kernel, with no loop)."""
  if not jnp.issubdtype(grad.dtype, jnp.inexact):
    grad = grad.astype(jnp.float32)
  old = tuple(_leafwise.decode_moment(m, context) for m in moments)
  update, new = step.elementwise()(grad.astype(_leafwise.compute_dtype(grad)), old, tuple(side))
  return (_leafwise.cast(update, grad.dtype),
          tuple(_leafwise.encode_moment(v, m, context) for v, m in zip(new, moments)))


def _matrix_scales(moment: QuantizedArray, rows: int, cols: int) -> tuple:
  """A moment's scales for the kernels' matrix view: block ``(R, D / 128)``;
  rank-1 the minimum of the leading axes' maxima ``(R, 1)`` (a minimum is
  exact in any order: `normalize.expand_scales`'s value) and the last
  axis's ``(1, D)``."""
  scales = moment.scales
  if moment.layout.normalization == "block":
    return (scales[0].reshape(rows, -1),)
  lead = scales[0]
  for s in scales[1:-1]:
    lead = jnp.minimum(lead, s)
  lead = jnp.broadcast_to(lead, moment.shape[:-1] + (1,))
  return lead.reshape(rows, 1), scales[-1].reshape(1, cols)


def _rank1_scales(row_max, col_max, moment: QuantizedArray, context: LeafContext) -> tuple:
  """The scales (`normalize.scale_shapes`) of a rank-1 moment from the
  maxima of its matrix view's rows and columns, reduced over the shards."""
  shape = moment.shape
  per_row = row_max.reshape(shape[:-1])
  scales = []
  for axis in range(len(shape) - 1):
    others = tuple(k for k in range(len(shape) - 1) if k != axis)
    scales.append(jnp.max(per_row, axis=others, keepdims=True)[..., None])
  scales.append(col_max.reshape((1,) * (len(shape) - 1) + (shape[-1],)))
  scales = tuple(scales)
  if context.shard is not None:
    scales = context.shard.reduce_scales(scales, moment.layout)
  return scales


def _local_update(rebuild, context: LeafContext, grad, moments, side, keys, consts,
                  interpret: bool):
  shape = tuple(grad.shape)
  rows, cols = math.prod(shape[:-1]), shape[-1]
  formats = _formats(moments)
  side_kinds = [_side_kind(tuple(s.shape), shape) for s in side]
  plan = _plan(shape, formats, side_kinds, len(consts))
  consts_vector = jnp.stack([jnp.asarray(c, jnp.float32) for c in consts]) if consts else None
  seeds = row_bases = None
  if plan.seeded:
    seeds = jax.lax.bitcast_convert_type(
        jnp.stack([maps.rounding_seed(keys[i]) for i in plan.seeded]), jnp.int32)
    origin, full_shape = _codecs.hash_origin(shape, context)
    if full_shape is not None:  # a shard: its rows' bases in the global leaf
      plan = dataclasses.replace(plan, row_bases_operand=True)
      bases = maps.row_hash_bases(shape, origin, full_shape)
      row_bases = jax.lax.bitcast_convert_type(bases, jnp.int32).reshape(rows, 1)
  raw = tuple((m.codes.reshape(rows, cols // 2 if m.spec.bits == 4 else cols),
               *_matrix_scales(m, rows, cols)) for m in moments)
  side_arrays = []
  for s, kind in zip(side, side_kinds):
    s = jnp.asarray(s, jnp.float32)
    if kind == _kernel.ROW:
      s = s.reshape(rows, 1)
    elif kind == _kernel.COL:
      s = s.reshape(1, s.shape[-1])
    else:
      s = s.reshape(-1, 1, s.shape[-1])
    side_arrays.append(s)
  side_arrays = tuple(side_arrays)
  matrix = grad.reshape(rows, cols)
  new_scales, kernel_scales = {}, {}
  if plan.global_moments:
    maxima = _launch.maxima(plan, rebuild, consts_vector, seeds, matrix, raw, side_arrays,
                            interpret)
    for i, (row_max, col_max) in maxima.items():
      new_scales[i] = _rank1_scales(row_max, col_max, moments[i], context)
      lead_inverse = normalize.inverse_times_4(new_scales[i][0])
      for s in new_scales[i][1:-1]:
        lead_inverse = jnp.maximum(lead_inverse, normalize.inverse_times_4(s))
      lead_inverse = jnp.broadcast_to(lead_inverse, shape[:-1] + (1,)).reshape(rows, 1)
      kernel_scales[i] = (lead_inverse, new_scales[i][-1].reshape(1, cols))
  update, new_raw = _launch.step(plan, rebuild, consts_vector, seeds, row_bases, matrix, raw,
                                 side_arrays, kernel_scales, interpret)
  new_moments = []
  for i, (r, m) in enumerate(zip(new_raw, moments)):
    scales = (r[1].reshape(m.scales[0].shape),) if i not in new_scales else new_scales[i]
    new_moments.append(QuantizedArray(r[0].reshape(m.codes.shape), scales, m.spec, m.shape,
                                      m.dtype))
  return _leafwise.cast(update.reshape(shape), grad.dtype), tuple(new_moments)
