"""The XLA engine's fused steps: one leaf's update as whole-leaf XLA ops.

`XlaSteps` runs every leaf, quantized or not, in one piece: decode the
moments, the elementwise step of `optax4bit._steps`, the new moments' scales
and their encoding, with no loop and no gather, so that XLA fuses decode,
step and encode into a few kernels per leaf (the jnp engine's row chunks in
``fori_loop``s are shaped for CPU caches; on an accelerator each trip is a
kernel launch). Codes are the jnp engine's bit for bit (the same
`optax4bit._leafwise.decode_moment` / `encode_moment`, with the gather-free
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

__all__ = ["XlaSteps"]


def _new_scales(step, inputs: tuple, moments: tuple, context: LeafContext) -> tuple:
  """The scales every quantized new moment is encoded with (None for a
  plain one): its block, rank-1 or tensor maxima, the global leaf's in a
  shard. Each scale array is reduced from its own recomputation of the step
  (``step(*inputs)``, its inputs through an optimization barrier): XLA does
  not fuse reductions over different axes, and would otherwise store the
  float32 moment for the second one."""
  out = []
  for i, moment in enumerate(moments):
    if not isinstance(moment, QuantizedArray):
      out.append(None)
      continue
    count = len(normalize.scale_shapes(moment.layout, moment.shape))
    scales = []
    for j in range(count):
      # The scale's index in the barrier: identical barriers would be merged.
      *recomputed, _ = jax.lax.optimization_barrier((*inputs, np.int32(j)))
      _, new = step(*recomputed)
      scales.append(normalize.compute_scales(normalize.finite_abs(new[i]), moment.layout)[j])
    scales = tuple(scales)
    if context.shard is not None and moment.layout.normalization != "block":
      scales = context.shard.reduce_scales(scales, moment.layout)
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

  scales = (None,) * len(moments)
  if any(isinstance(m, QuantizedArray) for m in moments):
    scales = _new_scales(step, (grad, moments, side), moments, context)
    grad, moments, side, scales = jax.lax.optimization_barrier((grad, moments, side, scales))
  update, new = step(grad, moments, side)
  new_moments = tuple(_leafwise.encode_moment(value, moment, context, key, moment_scales)
                      for value, moment, key, moment_scales in zip(new, moments, keys, scales))
  return _leafwise.cast(update, grad.dtype), new_moments


@dataclasses.dataclass(frozen=True)
class XlaSteps:
  """The fused per-leaf steps of one update as whole-leaf XLA ops. `run`
  returns ``(update, new_moments)``; it declines (None) only a sharded leaf
  whose shards are uneven (the jnp engine then raises its alignment error)."""

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
