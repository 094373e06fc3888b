"""Per-leaf, chunked updates of quantized moments: the jnp engine.

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
* Leaves are chained by a data dependence (`sequential_map`) so XLA cannot
  interleave them and keep several leaves' temporaries alive at once.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit import _codecs
from optax4bit import _gspmd
from optax4bit import _order
from optax4bit import _shard_map
from optax4bit import _state_sharding as _placement
from optax4bit._leaf_context import LeafContext
from optax4bit._validation import DEFAULT_CHUNK_SIZE
from optax4bit.quant import normalize
from optax4bit.quant.array import QuantizedArray

# step_fn(grad_f32, old_moments_f32, side_inputs) -> (update_f32, new_moments_f32)
StepFn = Callable[[jax.Array, tuple, tuple], tuple]


def compute_dtype(x):
  """The dtype a step computes ``x`` in: float32 whatever the float dtype;
  complex leaves (never quantized) keep their complex dtype, as in optax."""
  return x.dtype if jnp.iscomplexobj(x) else jnp.float32


def decode_moment(moment, context: LeafContext) -> jax.Array:
  """float32 value of a stored moment (quantized or plain)."""
  if isinstance(moment, QuantizedArray):
    return _codecs.decode(moment.codes, moment.scales, moment.spec, moment.layout, moment.shape,
                          context)
  return moment.astype(compute_dtype(moment))


def encode_moment(value: jax.Array, like, context: LeafContext, key=None, scales=None,
                  inverses=None):
  """Stores float32 ``value`` the way ``like`` (the old moment) is stored (in
  a shard, rank-1 and tensor scales are the global leaf's), under ``scales``
  where given (those of ``value``, computed beforehand; ``inverses``: their
  `normalize.inverse_times_4`, see `optax4bit._codecs.encode`)."""
  if not isinstance(like, QuantizedArray):
    return value.astype(like.dtype)
  layout = like.layout
  if scales is None and layout.normalization != "block":  # block maxima never span shards
    scales = normalize.compute_scales(normalize.finite_abs(value), layout)
    if context.shard is not None:
      scales = context.shard.reduce_scales(scales, layout)
  codes, scales = _codecs.encode(value, like.spec, layout, key, context, scales=scales,
                                 stored_codes=like.codes, inverses=inverses)
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
  codes_factor, *scale_factors = normalize.row_factors(moment.layout, moment.ndim,
                                                       moment.spec.bits)
  return _MomentPlan(True, codes_factor, tuple(scale_factors))


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


def cast(x, dtype):
  """``x`` as ``dtype``; a complex ``x`` into a real ``dtype`` by its real part
  (a complex ``mu_dtype`` on real parameters: the imaginary part is 0)."""
  if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
    x = jnp.real(x)
  return x.astype(dtype)


def _put_rows(x, chunk, start, factor):
  return jax.lax.dynamic_update_slice_in_dim(x, cast(chunk, x.dtype), start // factor, axis=0)


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
                keys: Optional[tuple] = None, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                context: LeafContext):
  """Runs ``step_fn`` over one leaf; returns ``(update, new_moments)``.

  A leaf whose sharding is known (explicit sharding types, or a concrete
  sharded array) runs per shard under ``jax.shard_map`` (see
  `optax4bit._shard_map`; on ``Auto`` mesh axes `optax4bit._gspmd`): the
  chunks are then local rows, and no state-sized buffer is gathered.

  Args:
    step_fn: elementwise step on float32 chunks (see module docstring). To
      run per shard it must not close over traced values: pass them as
      arguments of a ``functools.partial`` (they enter ``shard_map`` as
      replicated inputs).
    grad: the gradient leaf; the update comes back in its dtype.
    moments: the stored moments, each a `QuantizedArray` or a plain array.
    side: arrays of the leaf's rank broadcastable to it (e.g. factored second
      moments); sliced with the rows when their axis 0 spans the leaf's.
    keys: one PRNG key (or None) per moment, for stochastic rounding.
    chunk_size: elements per chunk; leaves no larger run in one piece.
    context: the leaf's `LeafContext` (from `sequential_map`, or a shard's).
  """
  keys = tuple(keys) if keys is not None else (None,) * len(moments)
  if not jnp.issubdtype(grad.dtype, jnp.inexact):
    # An integer (or bool) leaf steps as optax's do: its gradient's values in
    # float32, and a float32 update (cast back, it would round to 0).
    grad = grad.astype(jnp.float32)
  if context.shard is None:
    sharding = _placement.leaf_sharding(grad)
    auto = sharding is None and _placement.on_auto_mesh(grad)
    if sharding is not None or auto:
      rebuild, consts = _shard_map.hoist_partial(step_fn)
      # The row offset (a traced 0 that orders leaves) enters as a const too.
      local = functools.partial(_local_update, rebuild, chunk_size, context)
      consts = consts + (jnp.asarray(context.row_offset, jnp.int32),)
      if auto:  # Auto mesh axes: XLA's partitioner tells the sharding (`_gspmd`)
        return _gspmd.run_auto(local, grad, moments, side, keys, consts,
                               ordering=context.ordering)
      return _shard_map.per_shard(local, sharding, grad, moments, side, keys, consts,
                                  ordering=context.ordering)
  plans = tuple(_plan(m) for m in moments)
  num_rows = grad.shape[0] if grad.ndim else 1
  rows = _chunk_rows(grad.shape, plans, chunk_size) if grad.ndim else num_rows
  halves = _chunk_rows(grad.shape, plans, 0) * 2 if grad.ndim else 0
  if halves and num_rows >= halves:
    # At least two chunks: XLA turns a one-trip loop into straight-line code
    # whose update is a fresh buffer, live until the caller applies it.
    rows = min(rows, num_rows // halves * (halves // 2))
  elif rows >= num_rows:
    old = tuple(decode_moment(m, context) for m in moments)
    update, new = _materialized(step_fn(grad.astype(compute_dtype(grad)), old, side))
    new_moments = tuple(encode_moment(v, m, context, k) for v, m, k in zip(new, moments, keys))
    return cast(update, grad.dtype), new_moments
  if grad.ndim == 1 and grad.dtype != compute_dtype(grad):
    # A bf16/f16 vector enters the loop as float32 (a copy; vectors are small).
    # Converted inside it, the conversion is fused into the step, which makes
    # LLVM contract the other product of ``a * g + b * m`` into an FMA when
    # ``m`` comes from the C++ codecs' decode: the C++ path then rounds
    # differently from the jnp one (1 ulp; issue 37). Float32 gradients get
    # the contraction of the jnp engine and the C++ kernel, ``fma(a, g, b * m)``.
    update, new_moments = _update_leaf_chunked(step_fn, grad.astype(compute_dtype(grad)),
                                               moments, side, keys, plans, rows, context)
    return cast(update, grad.dtype), new_moments
  return _update_leaf_chunked(step_fn, grad, moments, side, keys, plans, rows, context)


def grad_sums(grad: jax.Array, sums_fn: Callable, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
              context: LeafContext):
  """Reductions of the gradient taken chunk by chunk, ahead of `update_leaf`.

  Args:
    grad: the gradient leaf.
    sums_fn: ``g -> (row_stats, total_stats)`` on a float32 block of rows:
      ``row_stats`` keep the block's rows on axis 0, ``total_stats`` are sums
      that add up over blocks (e.g. Adafactor's column sums of ``g**2``).
    chunk_size: elements per chunk, as in `update_leaf`; None: the whole
      leaf at once (the XLA engine's).
    context: the leaf's `LeafContext`.

  Returns:
    ``(grad, row_stats, total_stats)`` for the whole leaf. ``grad`` holds the
    same values, threaded through the loop: given to `update_leaf`, it can be
    overwritten in place (reading the original outside a loop would make XLA
    copy it first).
  """
  num_rows = grad.shape[0] if grad.ndim else 1
  if (chunk_size is None or grad.ndim == 0 or num_rows < 2
      or _placement.may_be_split(grad)):  # whole-leaf sums
    row_stats, totals = sums_fn(grad.astype(jnp.float32))
    return grad, row_stats, totals
  # At least two chunks, for the same reason as in `update_leaf`.
  rows = min(max(1, chunk_size // max(math.prod(grad.shape[1:]), 1)), -(-num_rows // 2))
  offset = context.row_offset
  num_chunks = -(-num_rows // rows)
  row_shape = grad.shape[1:]
  chunk_shapes = jax.eval_shape(sums_fn, jax.ShapeDtypeStruct((rows,) + row_shape, jnp.float32))

  def body(c, carry):
    grad_buf, row_stats, totals = carry
    start = jnp.minimum(c * rows, num_rows - rows)  # the last block overlaps
    g = _take_rows(grad_buf, offset + start, rows, 1).astype(jnp.float32)
    chunk_rows, _ = sums_fn(g)
    fresh = (start + jnp.arange(rows) >= c * rows).reshape((rows,) + (1,) * len(row_shape))
    _, chunk_totals = sums_fn(jnp.where(fresh, g, 0.0))  # overlap rows counted once
    row_stats = tuple(_put_rows(acc, r, start, 1) for acc, r in zip(row_stats, chunk_rows))
    totals = tuple(acc + t for acc, t in zip(totals, chunk_totals))
    return grad_buf, row_stats, totals

  row_stats = tuple(jnp.zeros((num_rows,) + s.shape[1:], s.dtype) for s in chunk_shapes[0])
  totals = tuple(jnp.zeros(s.shape, s.dtype) for s in chunk_shapes[1])
  return jax.lax.fori_loop(0, num_chunks, body, (grad, row_stats, totals))


def _local_update(rebuild_step, chunk_size, context, grad, moments, side, keys, shard, consts):
  """`update_leaf` on one shard (see `optax4bit._shard_map.per_shard`)."""
  return update_leaf(rebuild_step(consts[:-1]), grad, moments, side, keys, chunk_size,
                     context=context.in_shard(shard, consts[-1]))


def _slice_chunk(plan: _MomentPlan, buffers, start, rows):
  """The stored rows of a moment: its codes and per-row scales (global scales
  whole)."""
  if not plan.quantized:
    return _take_rows(buffers, start, rows, 1)
  codes, scales = buffers
  return (_take_rows(codes, start, rows, plan.codes_factor),
          tuple(s if f is None else _take_rows(s, start, rows, f)
                for s, f in zip(scales, plan.scale_factors)))


def _decode_chunk(moment, plan: _MomentPlan, chunk, rows, row_shape, context: LeafContext):
  """float32 old value of rows of a moment from `_slice_chunk`'s output."""
  if not plan.quantized:
    return chunk.astype(compute_dtype(chunk))
  codes, scales = chunk
  shape = (rows,) + row_shape
  return _codecs.decode(codes, scales, moment.spec, normalize.layout_for(moment.spec, shape),
                        shape, context)


class _Schedule(NamedTuple):
  """Chunks of rows of one leaf. Chunk ``c`` covers rows ``[start(c),
  start(c) + rows)``. Where alignment allows, the last chunk starts at
  ``num_rows - rows``, inside the one before it (``overlap_last``); otherwise
  a ragged ``tail`` is handled on its own (XLA may then copy buffers)."""
  num_rows: int
  rows: int
  count: int          # chunks run by the loops
  overlap_last: bool
  tail: int           # rows of the ragged tail (0: none)
  offset: Any         # sequential_map's runtime zero, added to every start

  def start(self, c):
    local = jnp.minimum(c * self.rows, self.num_rows - self.rows) if self.overlap_last else (
        c * self.rows)
    return self.offset + local

  @property
  def tail_start(self):
    return self.offset + self.count * self.rows


def _schedule(num_rows: int, rows: int, align: int, offset) -> _Schedule:
  num_full = num_rows // rows
  overlap_last = num_full * rows < num_rows and (num_rows - rows) % align == 0
  tail = 0 if overlap_last else num_rows - num_full * rows
  return _Schedule(num_rows, rows, num_full + int(overlap_last), overlap_last, tail, offset)


class _LeafBuffers(NamedTuple):
  """How chunks of one leaf's buffers are read and written: the gradient
  buffer (where the update goes) and each moment's codes and scales."""
  step_fn: StepFn
  moments: tuple
  plans: tuple
  side: tuple
  num_rows: int
  row_shape: tuple
  context: LeafContext

  def run_step(self, grad_buf, bufs, start, size):
    """The step on a chunk, unmaterialized: callers materialize what they use
    (a barrier around all outputs would keep XLA from dropping the unused)."""
    g = _take_rows(grad_buf, start, size, 1).astype(compute_dtype(grad_buf))
    old = tuple(_decode_chunk(m, p, _slice_chunk(p, b, start, size), size, self.row_shape,
                              self.context)
                for m, p, b in zip(self.moments, self.plans, bufs))
    return self.step_fn(g, old, _chunk_side(self.side, self.num_rows, start, size))

  def chunk_layout(self, moment, size):
    return normalize.layout_for(moment.spec, (size,) + self.row_shape)

  def write(self, grad_buf, bufs, results, start):
    """Writes a chunk's ``(update, (codes, local scales) per moment)``."""
    update, out = results
    grad_buf = _put_rows(grad_buf, update, start, 1)
    bufs = list(bufs)
    for i, plan in enumerate(self.plans):
      if not plan.quantized:
        bufs[i] = _put_rows(bufs[i], out[i], start, 1)
        continue
      codes, local = out[i]
      codes_buf, scales_buf = bufs[i]
      if local:
        scales_buf = tuple(_put_rows(s, c, start, f)
                           for s, c, f in zip(scales_buf, local, plan.scale_factors))
      bufs[i] = (_put_rows(codes_buf, codes, start, plan.codes_factor), scales_buf)
    return grad_buf, tuple(bufs)

  def read_stored(self, grad_buf, bufs, start, size):
    """What `write` would write, read back: a no-op write."""
    out = []
    for plan, b in zip(self.plans, bufs):
      chunk = _slice_chunk(plan, b, start, size)
      if plan.quantized:
        codes, scales = chunk
        chunk = (codes, () if plan.needs_second_pass else scales)
      out.append(chunk)
    return _take_rows(grad_buf, start, size, 1), tuple(out)

  def results_row_factors(self):
    """Leaf rows per buffer row of each array in a chunk's results."""
    return (1, tuple(1 if not p.quantized else
                     (p.codes_factor, () if p.needs_second_pass else p.scale_factors)
                     for p in self.plans))


def _stats_pass(leaf: _LeafBuffers, sched: _Schedule, grad_buf, bufs):
  """Pass 1 (rank-1 and tensor scales only): the maxima of the new moments.
  Nothing is written, so pass 2 still reads every old moment intact. The
  gradient and state buffers ride through the loop's carry unchanged: read
  through it, XLA lets pass 2 overwrite them in place instead of copying."""

  def stats(start, size, carry):
    grad_buf, bufs, new_global = carry
    _, new = leaf.run_step(grad_buf, bufs, start, size)
    new = _materialized(tuple(v if p.needs_second_pass else None
                              for v, p in zip(new, leaf.plans)))
    new_global = list(new_global)
    for i, (moment, plan) in enumerate(zip(leaf.moments, leaf.plans)):
      if not plan.needs_second_pass:
        continue
      chunk_scales = normalize.compute_scales(normalize.finite_abs(new[i]),
                                              leaf.chunk_layout(moment, size))
      new_global[i] = tuple(
          jnp.maximum(acc, s) if f is None else _put_rows(acc, s, start, f)
          for s, acc, f in zip(chunk_scales, new_global[i], plan.scale_factors))
    return grad_buf, bufs, tuple(new_global)

  new_global = tuple(tuple(jnp.zeros_like(s) for s in m.scales) if p.needs_second_pass else ()
                     for m, p in zip(leaf.moments, leaf.plans))
  carry = jax.lax.fori_loop(0, sched.count, lambda c, cr: stats(sched.start(c), sched.rows, cr),
                            (grad_buf, bufs, new_global))
  if sched.tail:
    carry = stats(sched.tail_start, sched.tail, carry)
  return carry


def _write_behind(sched: _Schedule, compute: Callable, write: Callable, read_stored: Callable,
                  keep_written_rows: Callable, grad_buf, bufs):
  """Runs ``compute(grad_buf, bufs, start, size)`` on every chunk and writes
  its results with ``write``.

  Results of chunk c are written at iteration c + 1, before chunk c + 1 is
  read from the written buffers: a write never shares an iteration with the
  reads of the rows it replaces, so XLA updates every buffer in place (a
  write unordered with reads of the same buffer makes it copy the whole
  buffer). A ragged tail is computed before the loop (the loop carries its
  results, so its reads come before any write) and written last.
  """

  def body(c, carry):
    grad_buf, bufs, pending, tail_results = carry
    grad_buf, bufs = write(grad_buf, bufs, pending, sched.start(jnp.maximum(c - 1, 0)))
    results = compute(grad_buf, bufs, sched.start(c), sched.rows)
    if sched.overlap_last:
      results = keep_written_rows(
          results, read_stored(grad_buf, bufs, sched.start(c), sched.rows), c)
    return grad_buf, bufs, results, tail_results

  tail_results = compute(grad_buf, bufs, sched.tail_start, sched.tail) if sched.tail else ()
  stored = read_stored(grad_buf, bufs, sched.start(0), sched.rows)  # a no-op write at c = 0
  grad_buf, bufs, pending, tail_results = jax.lax.fori_loop(
      0, sched.count, body, (grad_buf, bufs, stored, tail_results))
  grad_buf, bufs = write(grad_buf, bufs, pending, sched.start(sched.count - 1))
  if sched.tail:
    grad_buf, bufs = write(grad_buf, bufs, tail_results, sched.tail_start)
  return grad_buf, bufs


def _apply_pass(leaf: _LeafBuffers, sched: _Schedule, grad_buf, bufs, new_global, keys,
                update_dtype):
  """Pass 2: the step. The update goes where the gradient was and each
  moment chunk where it was read from; moments with rank-1 or tensor scales
  are encoded with ``new_global`` (from `_stats_pass`), block-wise ones with
  their chunk's own scales."""

  def compute(grad_buf, bufs, start, size):
    update, new = _materialized(leaf.run_step(grad_buf, bufs, start, size))
    out = []
    for i, (moment, plan) in enumerate(zip(leaf.moments, leaf.plans)):
      if not plan.quantized:
        out.append(encode_moment(new[i], moment, leaf.context))  # in its stored dtype
        continue
      layout = leaf.chunk_layout(moment, size)
      chunk_scales = None
      if plan.needs_second_pass:
        chunk_scales = tuple(s if f is None else _take_rows(s, start, size, f)
                             for s, f in zip(new_global[i], plan.scale_factors))
      stored_codes = (_take_rows(bufs[i][0], start, size, plan.codes_factor)
                      if moment.spec.stall_only else None)
      codes, chunk_scales = _codecs.encode(new[i], moment.spec, layout, keys[i], leaf.context,
                                           start, chunk_scales, stored_codes)
      local = () if plan.needs_second_pass else chunk_scales  # global ones at the end
      out.append((codes, local))
    return cast(update, update_dtype), tuple(out)

  def keep_written_rows(results, stored, c):
    """The overlapping last chunk reads rows the chunk before it has already
    written: for those rows keep what is stored (final) instead of results
    computed from new values."""
    start = jnp.minimum(c * sched.rows, sched.num_rows - sched.rows)

    def keep(new, old, factor):
      first_row = start + factor * jnp.arange(new.shape[0])
      fresh = (first_row >= c * sched.rows).reshape((-1,) + (1,) * (new.ndim - 1))
      return jnp.where(fresh, new, old)

    return jax.tree.map(keep, results, stored, leaf.results_row_factors())

  return _write_behind(sched, compute, leaf.write, leaf.read_stored, keep_written_rows,
                       grad_buf, bufs)


def _update_leaf_chunked(step_fn, grad, moments, side, keys, plans, rows, context: LeafContext):
  """`update_leaf` in chunks of ``rows`` rows: `_stats_pass` if a moment has
  rank-1 or tensor scales, then `_apply_pass`. A whole leaf runs `jax.jit`ted
  on its step's rebuild, codecs and chunking, so that leaves of one shape (a
  model's layers) trace once: the jnp engine is also the branch an
  accelerator host traces for its CPU (`dispatch.per_platform`)."""
  if context.shard is not None:
    return _chunked_passes(step_fn, grad, moments, side, keys, plans, rows, context)
  rebuild, consts = _shard_map.hoist_partial(step_fn)
  zero = context.row_offset  # the Python 0 stays static
  return _chunked_once(rebuild, rows, context.codecs, isinstance(zero, int), grad, moments,
                       side, keys, consts, zero if not isinstance(zero, int) else None)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _chunked_once(rebuild, rows, codecs, first, grad, moments, side, keys, consts, zero):
  return _chunked_passes(rebuild(consts), grad, moments, side, keys,
                         tuple(_plan(m) for m in moments), rows,
                         LeafContext(codecs, 0 if first else zero))


def _chunked_passes(step_fn, grad, moments, side, keys, plans, rows, context: LeafContext):
  leaf = _LeafBuffers(step_fn, moments, plans, side, grad.shape[0], grad.shape[1:], context)
  sched = _schedule(grad.shape[0], rows, _chunk_rows(grad.shape, plans, 0), context.row_offset)
  bufs = tuple((m.codes, m.scales) if p.quantized else m for m, p in zip(moments, plans))
  grad_buf, new_global = grad, ()
  if any(p.needs_second_pass for p in plans):
    grad_buf, bufs, new_global = _stats_pass(leaf, sched, grad_buf, bufs)
    if context.shard is not None:
      new_global = tuple(context.shard.reduce_scales(g, m.layout) if p.needs_second_pass else g
                         for g, m, p in zip(new_global, moments, plans))
  grad_buf, bufs = _apply_pass(leaf, sched, grad_buf, bufs, new_global, keys, grad.dtype)
  # Unfused from what the caller does next, the last writes stay in place.
  update_buf, bufs = _materialized((grad_buf, bufs))
  new_moments = []
  for moment, plan, buf, glob in zip(moments, plans, bufs, new_global or ((),) * len(plans)):
    if not plan.quantized:
      new_moments.append(buf)
      continue
    codes, scales = buf
    new_moments.append(QuantizedArray(codes, tuple(glob) if plan.needs_second_pass else scales,
                                      moment.spec, moment.shape, moment.dtype))
  return update_buf, tuple(new_moments)


def sequential_map(fn: Callable, *leaf_lists: Sequence, codecs=None) -> list:
  """``[fn(context, *args) for args in zip(*leaf_lists)]``, run by XLA one
  call after another so that their temporaries never coexist; ``fn`` returns
  ``(update, stored)`` (``stored``: the leaf's new state) and passes its
  ``context`` (a `LeafContext` with ``codecs``, the backend's codecs or
  None) to `update_leaf`, `grad_sums`, `after_previous_leaf` and the fused
  steps.

  This is the one mechanism that orders leaves. XLA's scheduler ignores
  ``optimization_barrier`` orderings here (XLA:CPU drops them before
  scheduling), so call ``i + 1`` runs with a runtime zero derived from call
  ``i``'s stored codes (`optax4bit._order.zero_after`): `update_leaf` adds it to every row
  offset it slices at, and `after_previous_leaf` subtracts it from whole
  inputs. Either is a data dependence that keeps call ``i + 1`` after call
  ``i``. A call that runs per shard (``shard_map``, or ``custom_partitioning``
  on an ``Auto`` mesh) makes that zero from each device's own shard
  (`optax4bit._order`, asked by the context's ``ordering``), so ordering the
  leaves adds no collective whatever the mesh, the shardings and the order of
  the leaves.
  """
  results, local_zeros = [], []
  for args in zip(*leaf_lists):
    zero = 0
    if results:
      zero = functools.reduce(jnp.bitwise_or, local_zeros) if local_zeros else (
          _order.zero_after(results[-1]))
    ordering = _order.Ordering(_order.zero_after, [])
    results.append(fn(LeafContext(codecs, zero, ordering), *args))
    local_zeros = ordering.zeros
  return results


def after_previous_leaf(tree, context: LeafContext):
  """``tree`` with every floating array ``x`` replaced by ``x - 0``, the zero
  of `sequential_map`: bit-identical values (``x - (+0.0) == x``, signed
  zeros, infs and NaNs included) that XLA computes only after the previous
  leaf. For steps that do not go through `update_leaf`'s row offsets."""
  zero = context.row_offset
  if isinstance(zero, int):
    return tree

  def tie(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
      return x - zero.astype(x.dtype)
    return x

  return jax.tree.map(tie, tree)
