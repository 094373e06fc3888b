"""Running a backend's fused kernel on one leaf: directly, or per shard.

A backend's fused step (`optax4bit.cpu.ffi.CpuSteps`,
`optax4bit.pallas.steps.PallasSteps`) hands `run_fused` its kernel as a
single-device ``local_update``; `run_fused` runs it on the whole leaf, under
``shard_map`` where the sharding is known (`optax4bit._shard_map`), or under
``custom_partitioning`` on an ``Auto`` mesh (`optax4bit._gspmd`), or declines
the leaf (None: the jnp engine runs it).
"""

from __future__ import annotations

from typing import Callable, Optional

from optax4bit import _gspmd
from optax4bit import _shard_map
from optax4bit import _state_sharding as _placement
from optax4bit._leaf_context import LeafContext

__all__ = ["run_fused"]


def run_fused(local_update: _shard_map.LocalUpdate, grad, moments: tuple, side: tuple,
              consts: tuple, covers_shard: Callable[[tuple], bool], context: LeafContext,
              keys: Optional[tuple] = None, hashes_global_index: bool = False):
  """Runs a fused kernel's ``local_update`` (see `optax4bit._shard_map.per_shard`)
  on one leaf: directly if the leaf is not sharded, per shard if it is.
  Returns None (the caller runs the jnp path) when the shards are uneven (the
  jnp path raises optax4bit's alignment error) or ``covers_shard(local_shape)``
  is False. ``keys``: one PRNG key (or None) per moment, for stochastic
  rounding; ``hashes_global_index``: whether the kernel hashes each element's
  index in the global leaf (from its `optax4bit._leaf_context.Shard`) as the
  jnp path does; if not, sharded leaves with stochastic rounding run the jnp
  path. ``context``: the leaf's (its ordering request reaches the per-shard
  runners)."""
  keys = (None,) * len(moments) if keys is None else tuple(keys)
  stochastic = any(k is not None for k in keys)
  sharding = _placement.leaf_sharding(grad)
  if sharding is None:
    if _placement.on_auto_mesh(grad):  # XLA tells the sharding when it partitions
      if (not hashes_global_index and stochastic) or not covers_shard(tuple(grad.shape)):
        return None
      return _gspmd.run_auto(local_update, grad, moments, side, keys, consts,
                             covers_shard=covers_shard, ordering=context.ordering)
    return local_update(grad, moments, side, keys, context.shard, consts)
  if not hashes_global_index and stochastic:
    return None
  try:
    local_shape = tuple(sharding.shard_shape(tuple(grad.shape)))
  except ValueError:
    return None
  if not covers_shard(local_shape):
    return None
  return _shard_map.per_shard(local_update, sharding, grad, moments, side, keys, consts,
                              ordering=context.ordering)
