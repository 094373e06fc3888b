"""The per-shard zero that orders leaves (`optax4bit._leafwise.sequential_map`).

`sequential_map` keeps one leaf's update after another's with a runtime zero
made from the previous leaf's stored codes. Made outside the per-shard code
from a sharded result, that zero costs a collective: on a classic ``Mesh``
XLA all-gathered whole leaves' codes to pick one element (issue 37). Given an
`Ordering` (in the leaf's `optax4bit._leaf_context.LeafContext`), the
per-shard runners (`optax4bit._shard_map.per_shard` under ``shard_map``,
`optax4bit._gspmd.run_auto` under ``custom_partitioning``) make it from each
device's own shard and return it as a replicated scalar: it is 0 on every
device, so nothing crosses devices.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax.numpy as jnp
from jax.sharding import PartitionSpec


class Ordering(NamedTuple):
  """`sequential_map`'s request to a per-shard runner: ``zero_of((update,
  new_moments))`` of the shard's update, collected into ``zeros``."""
  zero_of: Callable
  zeros: list


def zero_specs(ordering: Optional[Ordering]) -> tuple:
  """The out specs of the order zero: a replicated scalar, if asked for."""
  return (PartitionSpec(),) if ordering else ()


def with_local_zero(run: Callable, ordering: Optional[Ordering]) -> Callable:
  """``run`` (returning ``(update, raw_new, new_moments)`` for one shard)
  returning ``(update, raw_new)`` and, if ``ordering`` asks for it, the order
  zero of that shard."""
  def ordered(*args):
    update, raw_new, new = run(*args)
    if ordering is None:
      return update, raw_new
    return update, raw_new, jnp.asarray(ordering.zero_of((update, new)), jnp.int32)
  return ordered


def collect(ordering: Optional[Ordering], new_raw, zero: list):
  """Hands the zero a per-shard runner returned to ``ordering``; returns
  ``new_raw``."""
  if ordering:
    ordering.zeros.extend(zero)
  return new_raw
