"""Per-shard leaf updates on ``Auto`` meshes (classic GSPMD), without a wrapper.

Under ``jit`` on a ``jax.sharding.Mesh(devices, names)`` a traced leaf names
its mesh but not its ``PartitionSpec``: at trace time nobody knows how it is
sharded. XLA does, when it partitions the program. `run_auto` wraps one
leaf's update in ``jax.experimental.custom_partitioning``: XLA's partitioner
calls back with the gradient's actual sharding, and the callback returns the
same per-shard update `optax4bit._shard_map.per_shard` runs under
``shard_map`` (local chunks, rank-1/tensor scales reduced with ``pmax``,
stochastic rounding hashing global indices). Nothing state-sized is gathered
and the bits equal the single-device run's. A replicated leaf (data
parallelism) runs the ordinary update on every device.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Optional

import jax
import numpy as np
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from optax4bit import _order
from optax4bit import _shard_map
from optax4bit import _state_sharding as _placement
from optax4bit._leaf_context import Shard
from optax4bit.quant.array import QuantizedArray


def _identity(scales, layout):
  del layout
  return scales


# The update of a replicated leaf, the whole leaf on every device.
_WHOLE = Shard(_identity)


def run_auto(local_update: _shard_map.LocalUpdate, grad, moments: tuple, side: tuple,
             keys: tuple, consts: tuple, covers_shard: Optional[Callable[[tuple], bool]] = None,
             ordering: Optional[_order.Ordering] = None):
  """``local_update`` (see `optax4bit._shard_map.per_shard`) on one leaf whose
  sharding XLA will choose; returns ``(update, new_moments)``.

  ``covers_shard(local_shape)``: for a fused kernel, whether it computes a
  shard of that shape; where it does not, the leaf runs whole on every
  device (XLA gathers it), as without this module. ``ordering``: see
  `optax4bit._order`."""
  shape = tuple(grad.shape)
  raw, info = _shard_map.split_moments(moments)
  impls = tuple(None if k is None else jax.random.key_impl(k) for k in keys)
  key_data = tuple(None if k is None else jax.random.key_data(k) for k in keys)

  def run_raw(shard, leaf_shape, g, raw_moments, side_, data, consts_):
    keys_ = tuple(None if d is None else jax.random.wrap_key_data(d, impl=i)
                  for d, i in zip(data, impls))
    update, new = local_update(g, _shard_map.join_moments(raw_moments, info, leaf_shape), side_,
                               keys_, shard, consts_)
    return update, _shard_map.split_moments(new)[0], new

  def run(shard, leaf_shape, *a):
    # With sequential_map's zero (see `optax4bit._order`), made
    # per shard: a replicated scalar output.
    return _order.with_local_zero(functools.partial(run_raw, shard, leaf_shape), ordering)(*a)

  args = (grad, raw, tuple(side), key_data, tuple(consts))
  # custom_partitioning takes no closed-over constants (8-bit tables are):
  # they enter as replicated operands of the one-device function.
  closed, out_shapes = jax.make_jaxpr(functools.partial(run, _WHOLE, shape),
                                      return_shape=True)(*args)
  out_tree = jax.tree.structure(out_shapes)
  tables = tuple(closed.consts)

  def whole(tables_, *a):
    flat = jax.core.eval_jaxpr(closed.jaxpr, list(tables_), *jax.tree.leaves(a))
    return jax.tree.unflatten(out_tree, flat)

  def per_shard_of(shard, leaf_shape):
    return lambda tables_, *a: run(shard, leaf_shape, *a)

  fn = custom_partitioning(whole)
  zero_spec = _order.zero_specs(ordering)

  def specs(spec):
    of = lambda x: _placement.state_partition_spec(spec, shape, tuple(x.shape))  # noqa: E731
    return (tuple(PartitionSpec() for _ in tables), spec, jax.tree.map(of, raw),
            tuple(of(s) for s in side),
            jax.tree.map(lambda _: PartitionSpec(), key_data),
            tuple(PartitionSpec() for _ in consts))

  def given_spec(arg_shapes):
    given = arg_shapes[1].sharding  # the gradient's
    return given.spec if isinstance(given, NamedSharding) else PartitionSpec()

  def infer(mesh, arg_shapes, result_shape):  # the GSPMD partitioner's propagation
    del result_shape
    spec, _, _ = _shard_map.shard_runner(mesh, given_spec(arg_shapes), shape)
    specs_ = specs(spec)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), (specs_[1], specs_[2]) + zero_spec,
                        is_leaf=lambda s: isinstance(s, PartitionSpec))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    spec, local_shape, as_shard = _shard_map.shard_runner(mesh, given_spec(arg_shapes), shape)
    if local_shape != shape and covers_shard is not None and not covers_shard(local_shape):
      spec, local_shape = PartitionSpec(), shape  # the kernel needs the whole leaf
    for m in moments:
      if isinstance(m, QuantizedArray):
        _placement.check_alignment(m, mesh, spec)
    arg_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(spec),
                                 is_leaf=lambda s: isinstance(s, PartitionSpec))
    out_shardings = (arg_shardings[1], arg_shardings[2]) + tuple(
        NamedSharding(mesh, s) for s in zero_spec)
    if local_shape == shape:  # replicated: the whole update on every device
      return mesh, per_shard_of(_WHOLE, shape), out_shardings, arg_shardings

    def lower(tables_, *a):
      del tables_
      return as_shard(lambda shard: run(shard, local_shape, *a))

    return mesh, lower, out_shardings, arg_shardings

  # Propagation: the update has the gradient's factors, each new state array
  # its old one's; every other dimension is a factor of its own.
  names = (f"f{i}" for i in itertools.count())
  operands = [tuple(next(names) for _ in np.shape(x))
              for x in tables + tuple(jax.tree.leaves(args))]
  first = len(tables)  # the gradient, then the old state arrays
  results = operands[first:first + 1 + len(jax.tree.leaves(raw))] + [()] * len(zero_spec)
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=SdyShardingRule(
                       operand_mappings=tuple(operands), result_mappings=tuple(results)))
  update, new_raw, *zero = fn(tables, *args)
  return update, _shard_map.join_moments(_order.collect(ordering, new_raw, zero), info,
                                         shape)
