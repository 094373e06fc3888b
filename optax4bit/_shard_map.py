"""Running one leaf's update per shard under ``jax.shard_map``.

A leaf whose sharding is known (explicit mesh axes, a concrete sharded array)
runs its ordinary single-device update on each device's local block: block
scales are local, rank-1 and tensor scales are reduced with ``lax.pmax``
over the mesh axes of the other dimensions (`Shard.reduce_scales`), and
stochastic rounding hashes the element's index in the global leaf
(`Shard.origin`). `shard_runner` (where a shard sits) and `split_moments` /
`join_moments` (quantized moments as plain arrays) also serve the
``custom_partitioning`` runner of ``Auto`` meshes (`optax4bit._gspmd`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from optax4bit import _order
from optax4bit import _state_sharding as _placement
from optax4bit._leaf_context import Shard
from optax4bit.quant import normalize
from optax4bit.quant.array import QuantizedArray

# local_update(grad, moments, side, keys, shard, consts) -> (update, new_moments):
# the single-device update of a leaf's block (`per_shard`).
LocalUpdate = Callable


def _global_max(dim_axes: tuple, scales: tuple, layout: normalize.Layout) -> tuple:
  """Rank-1 and tensor scales computed on a local block, reduced to the
  maxima of the global tensor (block scales are local: alignment holds)."""
  if layout.normalization == "rank1":
    out = []
    for axis, s in enumerate(scales):
      names = tuple(a for d, axes in enumerate(dim_axes) if d != axis for a in axes)
      out.append(jax.lax.pmax(s, names) if names else s)
    return tuple(out)
  if layout.normalization == "tensor":
    names = tuple(a for axes in dim_axes for a in axes)
    return tuple(jax.lax.pmax(s, names) if names else s for s in scales)
  return scales


def _static_key(x):
  """A value's identity as a static argument: floats by their bits (``0.0``
  and ``-0.0`` differ, a NaN equals itself)."""
  if isinstance(x, (float, np.floating)):
    return type(x), float(x).hex()
  return type(x), x


class _Rebuild:
  """``rebuild(consts)``: the partial with its array arguments replaced.
  Rebuilds of the same function with the same static arguments are equal and
  hash alike, so that a kernel traced for one leaf is reused for the next
  leaf of the same shape (`jax.jit`'s cache, `optax4bit.tpu._launch`)."""

  def __init__(self, func, treedef, leaves, dynamic):
    self._func, self._treedef, self._dynamic = func, treedef, tuple(dynamic)
    self._static = tuple(None if d else x for x, d in zip(leaves, dynamic))
    key = (func, treedef, self._dynamic,
           tuple(_static_key(x) for x, d in zip(leaves, dynamic) if not d))
    try:
      self._hash = hash(key)
      self._key = key
    except TypeError:  # An unhashable static argument: equal to itself only.
      self._hash, self._key = id(self), None

  def __call__(self, new_consts):
    it = iter(new_consts)
    args, keywords = self._treedef.unflatten(
        [next(it) if d else x for x, d in zip(self._static, self._dynamic)])
    return functools.partial(self._func, *args, **keywords)

  def __eq__(self, other):
    if self._key is None or not isinstance(other, _Rebuild) or other._key is None:
      return self is other
    return self._key == other._key

  def __hash__(self):
    return self._hash


def hoist_partial(fn: Callable):
  """Splits ``fn`` into ``(rebuild, consts)`` with ``rebuild(consts) == fn``.

  ``consts`` are the array arguments of a ``functools.partial`` (e.g. traced
  bias corrections); they must enter ``shard_map`` as arguments, since a
  ``shard_map`` cannot close over arrays with explicit sharding. Python
  numbers stay static, so the arithmetic is exactly that of ``fn``.
  ``rebuild`` is hashable: equal for equal functions and static arguments.
  """
  if not isinstance(fn, functools.partial):
    return _Rebuild(fn, jax.tree.structure(((), {})), [], []), ()
  leaves, treedef = jax.tree.flatten((fn.args, fn.keywords))
  dynamic = [isinstance(x, (jax.Array, jax.core.Tracer)) for x in leaves]
  consts = tuple(x for x, d in zip(leaves, dynamic) if d)
  return _Rebuild(fn.func, treedef, leaves, dynamic), consts


def split_moments(moments: tuple) -> tuple:
  """``(raw, info)``: each `QuantizedArray` of ``moments`` as ``(codes,
  scales)`` and its ``(spec, dtype)`` (a plain moment as itself and None).
  A `QuantizedArray` keeps its global shape as static aux data; its raw
  arrays can enter a per-shard function, which rebuilds local ones
  (`join_moments`)."""
  raw = tuple(m.to_raw() if isinstance(m, QuantizedArray) else m for m in moments)
  info = tuple((m.spec, m.dtype) if isinstance(m, QuantizedArray) else None for m in moments)
  return raw, info


def join_moments(raw: tuple, info: tuple, leaf_shape: tuple) -> tuple:
  """The moments of a leaf of ``leaf_shape`` from `split_moments`' output."""
  return tuple(r if i is None else QuantizedArray.from_raw(r, i[0], leaf_shape, i[1])
               for r, i in zip(raw, info))


def shard_runner(mesh, param_spec: PartitionSpec, shape: tuple):
  """``(spec, local_shape, as_shard)`` of a leaf of ``shape`` split by
  ``param_spec`` (padded to the leaf's rank). ``as_shard(fn)`` runs
  ``fn(shard)`` as this device's shard, inside a per-shard context
  (``shard_map``, a ``custom_partitioning`` lowering), with ``shard`` the
  `Shard` that tells where it sits and reduces its rank-1/tensor maxima over
  the other shards."""
  spec = PartitionSpec(*_placement.padded_spec(param_spec, len(shape)))
  entries = tuple(spec)
  counts = _placement.shard_counts(mesh, entries)
  local_shape = tuple(n // k for n, k in zip(shape, counts))
  dim_axes = tuple(_placement.mesh_axes(e) for e in entries)

  def as_shard(fn):
    origin = tuple(jax.lax.axis_index(axes) * n if axes else 0
                   for axes, n in zip(dim_axes, local_shape))
    return fn(Shard(functools.partial(_global_max, dim_axes), shape, origin))

  return spec, local_shape, as_shard


def per_shard(local_update: LocalUpdate, sharding: NamedSharding, grad, moments: tuple,
              side: tuple, keys: tuple, consts: tuple = (),
              ordering: Optional[_order.Ordering] = None):
  """Runs ``local_update`` on each shard of one leaf under ``jax.shard_map``.

  ``local_update(grad, moments, side, keys, shard, consts)`` is the
  single-device update of a leaf (it sees local blocks; ``shard`` is the
  `Shard` being run; ``consts`` are replicated arrays it needs, see
  `hoist_partial`). ``ordering``: see `optax4bit._order`. Returns
  ``(update, new_moments)`` of the global leaf.
  """
  mesh, shape = sharding.mesh, tuple(grad.shape)
  spec, local_shape, as_shard = shard_runner(mesh, sharding.spec, shape)

  def spec_of(x):
    return _placement.state_partition_spec(spec, shape, tuple(x.shape))

  for m in moments:
    if isinstance(m, QuantizedArray):
      _placement.check_alignment(m, mesh, spec)
  raw, info = split_moments(moments)
  raw_specs = jax.tree.map(spec_of, raw)
  side_specs = tuple(spec_of(s) for s in side)
  key_specs = jax.tree.map(lambda _: PartitionSpec(), keys)

  def run(g, raw_moments, side_local, keys_local, consts_local):
    update, new = as_shard(lambda shard: local_update(
        g, join_moments(raw_moments, info, local_shape), side_local, keys_local, shard,
        consts_local))
    return update, split_moments(new)[0], new

  def matched(x, s):
    if _placement.is_tracer(x) and _placement.is_explicit(sharding):
      return jax.sharding.reshard(x, NamedSharding(mesh, s))
    return x

  args = (grad, raw, tuple(side), tuple(keys), tuple(consts))
  arg_specs = (spec, raw_specs, side_specs, key_specs, tuple(PartitionSpec() for _ in consts))
  args = jax.tree.map(matched, args, arg_specs,
                      is_leaf=lambda x: x is None)
  # check_vma=False: the single-device engine carries old and new statistics
  # in one loop carry, which varying-axis typing would reject; the out_specs
  # hold by construction (statistics are reduced with pmax before they leave).
  update, new_raw, *zero = jax.shard_map(
      _order.with_local_zero(run, ordering), mesh=mesh, in_specs=arg_specs,
      out_specs=(spec, raw_specs, *_order.zero_specs(ordering)), check_vma=False)(*args)
  return update, join_moments(_order.collect(ordering, new_raw, zero), info, shape)
