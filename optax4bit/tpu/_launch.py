"""The host side of the TPU engine's kernels (`optax4bit.tpu._kernel`): each
pass's operands and their BlockSpecs, and the ``pallas_call`` of the stats and
step passes, ``jax.jit``ted with the plan and the step static."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from optax4bit.tpu._kernel import (BLOCK, COL, RANK1, ROW, Plan, pallas_modules,
                                   shuffle_matrices, stats_kernel, step_kernel, step_scratch)

__all__ = ["maxima", "per_row_operand", "per_row_result", "step"]


def _spec(plan: Plan, kind: str, shape: tuple):
  """The BlockSpec of an operand: ``"smem"`` (scalars), ``"whole"`` (every
  program reads all of it), ``"rows"`` (the program's rows),
  ``"per_row"`` (a per-row vector's, `per_row_operand`), ``"row_tile"`` (the
  program's entry of a ``(grid, 1, D)`` array), ``"slab"``
  (the entry of the slab the program's rows are in)."""
  pl, pltpu = pallas_modules()
  if kind == "smem":
    return pl.BlockSpec(memory_space=pltpu.MemorySpace.SMEM)
  if kind == "whole":
    return pl.BlockSpec(shape, lambda i, n=len(shape): (0,) * n)
  if kind == "rows":
    return pl.BlockSpec((plan.block_rows,) + tuple(shape[1:]), lambda i: (i, 0))
  if kind == "per_row":
    if plan.dense_rows:
      return pl.BlockSpec((1, 1, plan.block_rows), lambda i: (i, 0, 0))
    return pl.BlockSpec((plan.block_rows, 1), lambda i: (i, 0))
  if kind == "slab":
    return pl.BlockSpec((1,) + tuple(shape[1:]),
                        lambda i: (jax.lax.div(i * plan.block_rows, plan.slab_rows), 0, 0))
  return pl.BlockSpec((1,) + tuple(shape[1:]), lambda i: (i, 0, 0))


def per_row_operand(plan: Plan, vector):
  """An ``(R, 1)`` per-row vector as the kernels take it (`Plan.dense_rows`)."""
  if not plan.dense_rows:
    return vector
  padded = plan.grid[0] * plan.block_rows
  vector = jnp.pad(vector.reshape(-1), (0, padded - plan.rows))
  return vector.reshape(plan.grid[0], 1, plan.block_rows)


def per_row_result(plan: Plan, array):
  """Inverse of `per_row_operand`: ``(R, 1)``."""
  return array.reshape(-1, 1)[:plan.rows]


class _Operands:
  """The operands of one pass, in the order `_Program` reads them, with their
  BlockSpecs; ``index`` maps a name to its operand's position."""

  def __init__(self, plan: Plan):
    self.plan, self.args, self.specs, self.index = plan, [], [], {}

  def add(self, name, array, kind: str):
    self.index[name] = len(self.args)
    self.args.append(array)
    self.specs.append(_spec(self.plan, kind, tuple(array.shape)))


def _operands(plan: Plan, step_pass: bool, consts, seeds, row_bases, grad, moments, side,
              new_scales=None) -> _Operands:
  ops = _Operands(plan)
  if plan.num_consts:
    ops.add("consts", consts, "smem")
  if plan.seeded:
    ops.add("seeds", seeds, "smem")
  ops.add("shuffle", jnp.asarray(shuffle_matrices(), jnp.bfloat16), "whole")
  if plan.seeded and step_pass and plan.row_bases_operand:
    ops.add("row_bases", per_row_operand(plan, row_bases), "per_row")
  ops.add("grad", grad, "rows")
  for i in (range(len(plan.moments)) if step_pass else plan.global_moments):
    codes, *scales = moments[i]
    ops.add(("codes", i), codes, "rows")
    ops.add(("scale", i, 0), scales[0], "rows")
    if plan.moments[i].kind == RANK1:
      ops.args[-1] = per_row_operand(plan, scales[0])
      ops.specs[-1] = _spec(plan, "per_row", ops.args[-1].shape)
      ops.add(("scale", i, 1), scales[1], "whole")
  for k, (kind, array) in enumerate(zip(plan.side, side)):
    if kind == ROW:
      ops.add(("side", k), per_row_operand(plan, array), "per_row")
    else:
      ops.add(("side", k), array, "whole" if kind == COL else "slab")
  if step_pass:
    for i in plan.global_moments:
      ops.add(("new_scale", i, 0), per_row_operand(plan, new_scales[i][0]), "per_row")
      ops.add(("new_scale", i, 1), new_scales[i][1], "whole")
  return ops


# The passes are jitted with the plan and the step static: leaves of one shape
# and step (a model's layers) trace and lower their kernels once, not once each
# (a kernel's trace and Mosaic lowering took about 0.5 s, most of the compile).
@functools.partial(jax.jit, static_argnames=("plan", "rebuild_step", "interpret"))
def maxima(plan: Plan, rebuild_step: Callable, consts, seeds, grad, moments, side,
           interpret: bool) -> dict:
  """The stats pass: per global moment ``i``, its new value's row and column
  maxima ``((R, 1), (1, D))``. ``moments``: per moment ``(codes, *scales)``
  of the matrix view: block scales ``(R, D / 128)``; rank-1 ``(R, 1)`` (the
  minimum of the leading axes' maxima) and ``(1, D)``."""
  pl, _ = pallas_modules()
  ops = _operands(plan, False, consts, seeds, None, grad, moments, side)
  out_shapes, out_specs = [], []
  for _ in plan.global_moments:
    row_shape = (plan.grid[0], 1, plan.block_rows) if plan.dense_rows else (plan.rows, 1)
    for kind, shape in (("per_row", row_shape), ("row_tile", (plan.grid[0], 1, plan.cols))):
      out_shapes.append(jax.ShapeDtypeStruct(shape, jnp.float32))
      out_specs.append(_spec(plan, kind, shape))
  out = pl.pallas_call(
      functools.partial(stats_kernel, plan, rebuild_step), grid=plan.grid,
      in_specs=ops.specs, out_specs=out_specs, out_shape=out_shapes,
      interpret=interpret)(*ops.args)
  return {i: (per_row_result(plan, out[2 * k]), jnp.max(out[2 * k + 1], axis=0))
          for k, i in enumerate(plan.global_moments)}


@functools.partial(jax.jit, static_argnames=("plan", "rebuild_step", "interpret"))
def step(plan: Plan, rebuild_step: Callable, consts, seeds, row_bases, grad, moments, side,
         new_scales: dict, interpret: bool) -> tuple:
  """The step pass: ``(update, per moment (codes, block scales or ()))``,
  each written over the input it replaces. ``new_scales``: per global moment,
  ``(row_inverse, col)``: the maximum of `normalize.inverse_times_4` of its
  leading axes' new maxima ``(R, 1)``, and its last axis's ``(1, D)``."""
  pl, _ = pallas_modules()
  ops = _operands(plan, True, consts, seeds, row_bases, grad, moments, side, new_scales)
  out_shapes = [jax.ShapeDtypeStruct(grad.shape, grad.dtype)]
  # The update goes to a buffer of its own: written over the gradient, it made
  # XLA copy a gradient that is a jit argument first (8 bytes per parameter
  # more for an update jitted alone, 2026-11-29), and a train step's temp was
  # the same either way.
  aliases = {}
  out_specs = [_spec(plan, "rows", grad.shape)]
  for i, fmt in enumerate(plan.moments):
    codes, *scales = moments[i]
    buffers = [(("codes", i), codes)]
    if fmt.kind == BLOCK:
      buffers.append((("scale", i, 0), scales[0]))
    for name, array in buffers:
      aliases[ops.index[name]] = len(out_shapes)
      out_shapes.append(jax.ShapeDtypeStruct(array.shape, array.dtype))
      out_specs.append(_spec(plan, "rows", array.shape))
  _, pltpu = pallas_modules()
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0, grid=plan.grid, in_specs=ops.specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in step_scratch(plan)])
  out = pl.pallas_call(
      functools.partial(step_kernel, plan, rebuild_step), grid_spec=grid_spec,
      out_shape=out_shapes, input_output_aliases=aliases, interpret=interpret)(*ops.args)
  update, rest = out[0], iter(out[1:])
  new_moments = []
  for fmt in plan.moments:
    codes = next(rest)
    new_moments.append((codes, next(rest)) if fmt.kind == BLOCK else (codes,))
  return update, tuple(new_moments)
