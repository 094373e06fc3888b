"""The per-shard zero that orders leaves (`optax4bit._leafwise.sequential_map`).

`sequential_map` keeps one leaf's update after another's with a runtime zero
made from the previous leaf's stored codes. Made outside the per-shard code
from a sharded result, that zero costs a collective: on a classic ``Mesh``
XLA all-gathered whole leaves' codes to pick one element (issue 37). Within
`order_zeros`, the per-shard runners (`optax4bit.sharding.per_shard` under
``shard_map``, `optax4bit._gspmd.run_auto` under ``custom_partitioning``)
make it from each device's own shard and return it as a replicated scalar:
it is 0 on every device, so nothing crosses devices.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax.numpy as jnp
from jax.sharding import PartitionSpec

_ORDER_ZEROS = contextvars.ContextVar("optax4bit_order_zeros", default=None)


@contextlib.contextmanager
def order_zeros(zero_of: Callable):
  """Collects, in the list it yields, ``zero_of((update, new_moments))`` of
  every per-shard leaf update run inside, computed on each device's shard."""
  zeros = []
  token = _ORDER_ZEROS.set((zero_of, zeros))
  try:
    yield zeros
  finally:
    _ORDER_ZEROS.reset(token)


def request():
  """The current `order_zeros` request (for a per-shard runner), or None."""
  return _ORDER_ZEROS.get()


def zero_specs(ordering) -> tuple:
  """The out specs of the order zero: a replicated scalar, if asked for."""
  return (PartitionSpec(),) if ordering else ()


def with_local_zero(run: Callable, ordering) -> Callable:
  """``run`` (returning ``(update, raw_new, new_moments)`` for one shard)
  returning ``(update, raw_new)`` and, if ``ordering`` (a `request`) asks for
  it, the order zero of that shard."""
  def ordered(*args):
    token = _ORDER_ZEROS.set(None)  # nested updates are not leaves of the outer map
    try:
      update, raw_new, new = run(*args)
    finally:
      _ORDER_ZEROS.reset(token)
    if ordering is None:
      return update, raw_new
    return update, raw_new, jnp.asarray(ordering[0]((update, new)), jnp.int32)
  return ordered


def collect(ordering, new_raw, zero: list):
  """Hands the zero a per-shard runner returned to `order_zeros`; returns
  ``new_raw``."""
  if ordering:
    ordering[1].extend(zero)
  return new_raw
