"""The XLA engine's fused steps: one leaf's update as whole-leaf XLA ops.

`XlaSteps` runs every leaf in one piece (4-bit, 8-bit or plain moments): decode
the moments, the elementwise step of `optax4bit._steps`, the new moments'
scales and their encoding, with no loop and no gather, so that XLA fuses decode,
step and encode into a few kernels per leaf (the jnp engine's row chunks in
``fori_loop``s are shaped for CPU caches; on an accelerator each trip is a
kernel launch). Codes are the jnp engine's bit for bit (the same
`optax4bit._leafwise.decode_moment` / `encode_moment`, with the fusible
codecs of `optax4bit.xla.codec`); updates equal it to float32 rounding.
Sharded leaves run per shard (`optax4bit._fused_leaf`), as the other
backends' kernels do.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit import _leafwise
from optax4bit import _shard_map
from optax4bit._fused_leaf import run_fused
from optax4bit._leaf_context import LeafContext
from optax4bit._steps import FusedStep
from optax4bit.quant import normalize
from optax4bit.quant.array import QuantizedArray
from optax4bit.quant.spec import RANK1_FALLBACK_BLOCK

__all__ = ["XlaSteps", "row_sums"]


def _chunk_maxima(abs_x: jax.Array, chunk: int) -> jax.Array:
  """Maxima of ``abs_x`` (non-negative) over chunks of ``chunk`` elements of
  its last axis (a ragged last chunk padded with 0): shape ``(...,
  ceil(n / chunk))``."""
  return normalize.compute_scales(abs_x, normalize.Layout("block", chunk, 1))[0]


# Rows per partial maximum of `_column_maxima`'s first stage.
_ROWS_PER_PARTIAL = 32


def _column_maxima(abs_x: jax.Array) -> jax.Array:
  """Maxima of ``abs_x`` (non-negative) over all axes but the last (kept as
  size 1), in two stages: over groups of `_ROWS_PER_PARTIAL` rows (zero rows
  pad the last group), then over the groups. XLA:GPU fuses the recomputed
  step into a reduction over a middle axis, but not into one over the
  leading axis, for which it stored the float32 moment; the barrier keeps it
  from merging the stages back. Exact: a maximum in any order."""
  length = abs_x.shape[-1]
  rows = abs_x.reshape(-1, length)
  groups = -(-rows.shape[0] // _ROWS_PER_PARTIAL)
  if groups > 1:
    rows = jnp.pad(rows, [(0, groups * _ROWS_PER_PARTIAL - rows.shape[0]), (0, 0)])
    rows = jax.lax.optimization_barrier(
        jnp.max(rows.reshape(groups, _ROWS_PER_PARTIAL, length), axis=1))
  return jnp.max(rows, axis=0).reshape((1,) * (abs_x.ndim - 1) + (length,))


def row_sums(x: jax.Array) -> jax.Array:
  """Sums of ``x`` over its last axis (kept, of size 1) as this engine's first
  pass reads a leaf: over chunks of `RANK1_FALLBACK_BLOCK` (128) elements
  first, the recipes' first-moment blocks, behind an optimization barrier,
  then over the chunks (a last axis of another length: straight). XLA:GPU
  then takes 4-bit Factor's row sums of ``g**2`` in one fusion with the
  first pass's block maxima of the new first moment, reading the gradient
  once (a 100M update compiled for an H100: 25.1 against 29.1 bytes per
  parameter); summed straight they are a reduction of another shape, a
  kernel of their own. On a TPU the chunk sums' layout cost more than they
  save (the TPU engine keeps straight sums).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax4bit.xla import steps
    >>> steps.row_sums(jnp.ones((2, 256))).tolist()
    [[256.0], [256.0]]
  """
  length = x.shape[-1]
  if length % RANK1_FALLBACK_BLOCK:
    return jnp.sum(x, axis=-1, keepdims=True)
  chunks = x.reshape(x.shape[:-1] + (length // RANK1_FALLBACK_BLOCK, RANK1_FALLBACK_BLOCK))
  return jnp.sum(jax.lax.optimization_barrier(jnp.sum(chunks, axis=-1)), axis=-1, keepdims=True)


def _new_scales(step, inputs: tuple, moments: tuple, context: LeafContext) -> tuple:
  """The scales every quantized new moment is encoded with (None for a
  plain one): its block, rank-1 or tensor maxima, the global leaf's in a
  shard.

  Each group of reductions recomputes the step (``step(*inputs)``), the
  groups after the first with their inputs through an optimization barrier
  of their own: XLA fuses reductions of one shape into one kernel, but not
  reductions over different axes, and would otherwise store each float32
  new moment for the second one. The first group reads the inputs
  themselves, so that reductions of its shape over the same gradient outside
  the engine join its kernel (`row_sums`). The
  reductions along the last axis share one group: block maxima, and the
  maxima over chunks of the last axis that rank-1 maxima of the other axes,
  and tensor maxima, are taken from (a maximum is exact in any order: the
  same scales bit for bit). Rank-1 maxima of the last axis (over all the
  others) are a second group; blocks that span rows, one group each."""
  quantized = [m for m in moments if isinstance(m, QuantizedArray)]
  chunk = min((m.layout.block_size for m in quantized if m.layout.normalization == "block"
               and m.layout.rows_per_block == 1), default=RANK1_FALLBACK_BLOCK)
  groups = {}

  def recomputed(group, i):
    """The new moments, recomputed for ``group``; the ``i``-th one's |x|."""
    if group not in groups:
      args = inputs
      if groups:
        # The group's index in the barrier: identical barriers would be merged.
        *args, _ = jax.lax.optimization_barrier((*inputs, np.int32(len(groups))))
      groups[group] = step(*args)[1]
    return normalize.finite_abs(groups[group][i])

  out = []
  for i, moment in enumerate(moments):
    if not isinstance(moment, QuantizedArray):
      out.append(None)
      continue
    layout = moment.layout
    if layout.normalization == "block":
      along_rows = layout.rows_per_block == 1 and layout.block_size == chunk
      group = "last axis" if along_rows else ("blocks", i)
      scales = normalize.compute_scales(recomputed(group, i), layout)
    else:
      # Through a barrier: XLA would fold the two maxima into one reduction of
      # another shape than the block maxima's, and not fuse them.
      partial = jax.lax.optimization_barrier(_chunk_maxima(recomputed("last axis", i), chunk))
      scales = []
      for shape in normalize.scale_shapes(layout, moment.shape):
        if layout.normalization == "rank1" and shape[-1] > 1:  # the last axis's maxima
          scales.append(_column_maxima(recomputed("columns", i)))
        else:
          reduced = tuple(k for k, n in enumerate(shape[:-1]) if n == 1) + (partial.ndim - 1,)
          scales.append(jnp.max(partial, axis=reduced, keepdims=True))
      scales = tuple(scales)
      if context.shard is not None:
        scales = context.shard.reduce_scales(scales, layout)
    out.append(scales)
  return tuple(out)


def _local_update(rebuild_step, context: LeafContext, grad, moments, side, keys, shard,
                  consts):
  """One leaf (or one shard of it) in two passes over whole arrays: the
  step's new moments reduced to their scales, then the step again, its
  update and the moments encoded with those scales. Each pass reads the
  gradient and the codes; nothing leaf-sized is kept between them (XLA
  would otherwise store every float32 new moment and read it back: the
  inputs of pass 2 go through an optimization barrier, so that it
  recomputes the step rather than share pass 1's values)."""
  step_fn = rebuild_step(consts)
  if shard is not None:
    context = context.in_shard(shard)
  if not jnp.issubdtype(grad.dtype, jnp.inexact):
    grad = grad.astype(jnp.float32)  # as `optax4bit._leafwise.update_leaf`

  def step(grad, moments, side):
    old = tuple(_leafwise.decode_moment(m, context) for m in moments)
    return step_fn(grad.astype(_leafwise.compute_dtype(grad)), old, tuple(side))

  scales = inverses = (None,) * len(moments)
  if any(isinstance(m, QuantizedArray) for m in moments):
    scales = _new_scales(step, (grad, moments, side), moments, context)
    # Rank-1 and tensor scales' inverses before the barrier: XLA computes
    # them in the kernels of the scales' last reductions, where after it each
    # was a kernel of its own (XLA does not repeat a division per element of
    # the step). Block scales come out of a multi-output reduction that takes
    # no such epilogue; computed here they cost Factor a kernel more per leaf.
    inverses = tuple(
        None if s is None or m.layout.normalization == "block"
        else tuple(map(normalize.inverse_times_4, s)) for s, m in zip(scales, moments))
    grad, moments, side, scales, inverses = jax.lax.optimization_barrier(
        (grad, moments, side, scales, inverses))
  update, new = step(grad, moments, side)
  new_moments = tuple(
      _leafwise.encode_moment(value, moment, context, key, moment_scales, moment_inverses)
      for value, moment, key, moment_scales, moment_inverses
      in zip(new, moments, keys, scales, inverses))
  return _leafwise.cast(update, grad.dtype), new_moments


@dataclasses.dataclass(frozen=True)
class XlaSteps:
  """The fused per-leaf steps of one update as whole-leaf XLA ops. `run`
  returns ``(update, new_moments)``; it declines (None) a sharded leaf whose shards are uneven
  (the jnp engine then raises its alignment error)."""

  def run(self, step: FusedStep, grad: jax.Array, moments: Sequence,
          side: Sequence[jax.Array] = (), keys: Optional[Sequence] = None, *,
          context: LeafContext = LeafContext()):
    """``step`` on one leaf. ``side``: for ``"factored"``, the ``(row, col,
    row_mean)`` of the updated factored second moment; ``keys``: one PRNG
    key (or None) per moment; ``context``: the leaf's
    `optax4bit._leaf_context.LeafContext` (its codecs decode and encode)."""
    moments = tuple(moments)
    keys = (None,) * len(moments) if keys is None else tuple(keys)
    rebuild, consts = _shard_map.hoist_partial(step.elementwise())

    def local(grad, moments, side, keys, shard, consts):
      return _local_update(rebuild, context, grad, moments, side, keys, shard, consts)

    return run_fused(local, grad, moments, tuple(side), consts, lambda shape: True, context,
                     keys, hashes_global_index=True)
