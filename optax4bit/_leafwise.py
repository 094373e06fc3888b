"""Per-leaf, chunked updates of quantized moments (SPEC.md 3 and 4).

An optimizer step is an elementwise function of the gradient and the old
moments that returns the update and the new moments. This module runs such a
function over one parameter leaf with its moments stored quantized, so that the
decompressed float32 moments exist for one chunk of rows of one leaf at a time:

* A leaf larger than ``chunk_size`` elements is processed in chunks of rows
  along axis 0 inside a ``fori_loop``. Each chunk is read from and written back
  into the state buffers at the same place, so with a donated state XLA updates
  codes and scales in place and no state-sized temporary exists.
* Block-wise scales are local to a chunk: one pass suffices. Rank-1 and tensor
  scales need the maxima of the whole new moment: pass 1 runs the step and only
  reduces them; pass 2 runs the step again, writes the update and encodes every
  moment. Nothing float32 the size of the leaf is kept between the passes, and
  every chunk is read before it is overwritten, so the step may use any old
  moment to compute any new one.
* Leaves are chained with ``optimization_barrier`` so XLA cannot interleave
  them and keep several leaves' temporaries alive at once.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.quant import array as qarray
from optax4bit.quant import normalize
from optax4bit.quant.array import QuantizedArray

DEFAULT_CHUNK_SIZE = 1 << 20

# step_fn(grad_f32, old_moments_f32, side_inputs) -> (update_f32, new_moments_f32)
StepFn = Callable[[jax.Array, tuple, tuple], tuple]


def decode_moment(moment) -> jax.Array:
  """float32 value of a stored moment (quantized or plain)."""
  if isinstance(moment, QuantizedArray):
    return qarray.decode(moment.codes, moment.scales, moment.spec, moment.layout, moment.shape)
  return moment.astype(jnp.float32)


def _uniform(key, shape):
  return jax.random.uniform(key, shape, jnp.float32)


def encode_moment(value: jax.Array, like, key=None):
  """Stores float32 ``value`` the way ``like`` (the old moment) is stored."""
  if not isinstance(like, QuantizedArray):
    return value.astype(like.dtype)
  layout = like.layout
  scales = normalize.compute_scales(normalize.finite_abs(value), layout)
  uniform = _uniform(key, value.shape) if like.spec.stochastic else None
  codes = qarray.encode(value, scales, like.spec, layout, uniform)
  return QuantizedArray(codes, scales, like.spec, like.shape, like.dtype)


class _MomentPlan(NamedTuple):
  """How the buffers of one moment are sliced into chunks of leaf rows.

  ``*_factor`` is the number of leaf rows per row of that buffer along axis 0;
  ``None`` marks a buffer that is not sliced (it spans all rows).
  """
  quantized: bool
  codes_factor: int
  scale_factors: tuple  # per scale array: int factor or None (global maximum)

  @property
  def needs_second_pass(self) -> bool:
    return self.quantized and any(f is None for f in self.scale_factors)


def _plan(moment) -> _MomentPlan:
  if not isinstance(moment, QuantizedArray):
    return _MomentPlan(False, 1, ())
  ndim, layout = moment.ndim, moment.layout
  codes_factor = 2 if (ndim == 1 and moment.spec.bits == 4) else 1
  if layout.normalization == "block":
    if ndim == 1:
      factor = layout.block_size
    elif ndim == 2:
      factor = layout.rows_per_block
    else:
      factor = 1
    scale_factors = (factor,)
  elif layout.normalization == "rank1":
    scale_factors = (1,) + (None,) * (ndim - 1)
  else:
    scale_factors = (None,)
  return _MomentPlan(True, codes_factor, scale_factors)


def _chunk_rows(shape: tuple, plans: Sequence[_MomentPlan], chunk_size: int) -> int:
  """Rows per chunk: a multiple of every buffer's row factor."""
  align = 1
  for plan in plans:
    for factor in (plan.codes_factor,) + plan.scale_factors:
      if factor is not None:
        align = math.lcm(align, factor)
  row_elements = math.prod(shape[1:])
  rows = max(1, chunk_size // max(row_elements, 1)) // align * align
  return max(rows, align)


def _take_rows(x, start, rows, factor):
  """Rows ``[start, start + rows)`` of the leaf, in a buffer with ``factor``
  leaf rows per buffer row (``start`` is a multiple of ``factor``)."""
  return jax.lax.dynamic_slice_in_dim(x, start // factor, -(-rows // factor), axis=0)


def _put_rows(x, chunk, start, factor):
  return jax.lax.dynamic_update_slice_in_dim(x, chunk.astype(x.dtype), start // factor, axis=0)


def _chunk_side(side: tuple, num_rows: int, start, rows) -> tuple:
  return tuple(
      _take_rows(s, start, rows, 1) if (s.ndim and s.shape[0] == num_rows) else s
      for s in side)


def _materialized(tree):
  """Keeps XLA from fusing the step into the maxima that follow: a reduction
  fused with a long elementwise producer is not vectorized on CPU (10-20x
  slower); the chunk-sized float32 buffers this costs are the transient
  memory we budget for anyway."""
  return jax.lax.optimization_barrier(tree)


def update_leaf(step_fn: StepFn, grad: jax.Array, moments: tuple, side: tuple = (),
                keys: Optional[tuple] = None, chunk_size: int = DEFAULT_CHUNK_SIZE):
  """Runs ``step_fn`` over one leaf; returns ``(update, new_moments)``.

  Args:
    step_fn: elementwise step on float32 chunks (see module docstring).
    grad: the gradient leaf; the update comes back in its dtype.
    moments: the stored moments, each a `QuantizedArray` or a plain array.
    side: arrays of the leaf's rank broadcastable to it (e.g. factored second
      moments); sliced with the rows when their axis 0 spans the leaf's.
    keys: one PRNG key (or None) per moment, for stochastic rounding.
    chunk_size: elements per chunk; leaves no larger run in one piece.
  """
  keys = tuple(keys) if keys is not None else (None,) * len(moments)
  plans = tuple(_plan(m) for m in moments)
  num_rows = grad.shape[0] if grad.ndim else 1
  rows = _chunk_rows(grad.shape, plans, chunk_size) if grad.ndim else num_rows
  if rows >= num_rows:
    old = tuple(decode_moment(m) for m in moments)
    update, new = _materialized(step_fn(grad.astype(jnp.float32), old, side))
    new_moments = tuple(encode_moment(v, m, k) for v, m, k in zip(new, moments, keys))
    return update.astype(grad.dtype), new_moments
  return _update_leaf_chunked(step_fn, grad, moments, side, keys, plans, rows)


def _decode_chunk(moment, plan: _MomentPlan, buffers, start, rows, row_shape):
  """float32 old value of rows of a moment, read from the state buffers."""
  if not plan.quantized:
    return _take_rows(buffers, start, rows, 1).astype(jnp.float32)
  codes, scales = buffers
  chunk_scales = tuple(
      s if f is None else _take_rows(s, start, rows, f)
      for s, f in zip(scales, plan.scale_factors))
  shape = (rows,) + row_shape
  layout = normalize.layout_for(moment.spec, shape)
  return qarray.decode(_take_rows(codes, start, rows, plan.codes_factor), chunk_scales,
                       moment.spec, layout, shape)


def _update_leaf_chunked(step_fn, grad, moments, side, keys, plans, rows):
  num_rows, row_shape = grad.shape[0], grad.shape[1:]
  num_full = num_rows // rows
  tail = num_rows - num_full * rows

  def chunk_key(i, chunk_index):
    return None if keys[i] is None else jax.random.fold_in(keys[i], chunk_index)

  def run_step(buffers, start, size):
    g = _take_rows(grad, start, size, 1).astype(jnp.float32)
    old = tuple(_decode_chunk(m, p, b, start, size, row_shape)
                for m, p, b in zip(moments, plans, buffers))
    return _materialized(step_fn(g, old, _chunk_side(side, num_rows, start, size)))

  def chunk_layout(moment, size):
    return normalize.layout_for(moment.spec, (size,) + row_shape)

  # Pass 1 (rank-1 and tensor scales only): the maxima of the new moments.
  # Nothing is written, so pass 2 still reads every old moment intact.
  def stats_pass(start, size, chunk_index, new_global):
    del chunk_index
    _, new = run_step(buffers, start, size)
    new_global = list(new_global)
    for i, (moment, plan) in enumerate(zip(moments, plans)):
      if not plan.needs_second_pass:
        continue
      chunk_scales = normalize.compute_scales(normalize.finite_abs(new[i]),
                                              chunk_layout(moment, size))
      new_global[i] = tuple(
          jnp.maximum(acc, s) if f is None else _put_rows(acc, s, start, f)
          for s, acc, f in zip(chunk_scales, new_global[i], plan.scale_factors))
    return tuple(new_global)

  # Pass 2: the step; each chunk of every moment is read, then overwritten.
  def apply_pass(start, size, chunk_index, carry):
    update_buf, bufs = carry
    update, new = run_step(bufs, start, size)
    update_buf = _put_rows(update_buf, update, start, 1)
    bufs = list(bufs)
    for i, (moment, plan) in enumerate(zip(moments, plans)):
      if not plan.quantized:
        bufs[i] = _put_rows(bufs[i], new[i], start, 1)
        continue
      layout = chunk_layout(moment, size)
      if plan.needs_second_pass:
        chunk_scales = tuple(s if f is None else _take_rows(s, start, size, f)
                             for s, f in zip(new_global[i], plan.scale_factors))
      else:
        chunk_scales = normalize.compute_scales(normalize.finite_abs(new[i]), layout)
      uniform = (_uniform(chunk_key(i, chunk_index), new[i].shape)
                 if moment.spec.stochastic else None)
      codes = qarray.encode(new[i], chunk_scales, moment.spec, layout, uniform)
      codes_buf, scales_buf = bufs[i]
      if not plan.needs_second_pass:  # old global scales stay until the end
        scales_buf = tuple(_put_rows(s, c, start, f)
                           for s, c, f in zip(scales_buf, chunk_scales, plan.scale_factors))
      bufs[i] = (_put_rows(codes_buf, codes, start, plan.codes_factor), scales_buf)
    return update_buf, tuple(bufs)

  def run_pass(body, carry):
    carry = jax.lax.fori_loop(0, num_full, lambda c, cr: body(c * rows, rows, c, cr), carry)
    if tail:
      carry = body(num_full * rows, tail, num_full, carry)
    return carry

  buffers = tuple((m.codes, m.scales) if p.quantized else m for m, p in zip(moments, plans))
  new_global = tuple(tuple(jnp.zeros_like(s) for s in m.scales) if p.needs_second_pass else ()
                     for m, p in zip(moments, plans))
  if any(p.needs_second_pass for p in plans):
    new_global = run_pass(stats_pass, new_global)
  update_buf, buffers = run_pass(apply_pass, (jnp.zeros(grad.shape, grad.dtype), buffers))
  new_moments = []
  for moment, plan, buf, glob in zip(moments, plans, buffers, new_global):
    if not plan.quantized:
      new_moments.append(buf)
      continue
    codes, scales = buf
    new_moments.append(QuantizedArray(codes, tuple(glob) if plan.needs_second_pass else scales,
                                      moment.spec, moment.shape, moment.dtype))
  return update_buf, tuple(new_moments)


def sequential_map(fn: Callable, *leaf_lists: Sequence) -> list:
  """``[fn(*args) for args in zip(*leaf_lists)]``, forcing XLA to run the calls
  one after another so that their temporaries never coexist."""
  results = []
  previous = None
  for args in zip(*leaf_lists):
    if previous is not None:
      previous, args = jax.lax.optimization_barrier((previous, args))
      results[-1] = previous
    previous = fn(*args)
    results.append(previous)
  return results
