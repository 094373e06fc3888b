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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from optax4bit import _state_sharding
from optax4bit.quant import array as qarray
from optax4bit.quant import normalize
from optax4bit.quant.array import QuantizedArray


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


def stored_value(x: jax.Array) -> jax.Array:
  """A scalar that XLA can only compute once ``x`` exists: its first element,
  or under explicit sharding (which forbids picking one element of a sharded
  axis) and on ``Auto`` mesh axes (where the flattening reshape would gather
  a split array) its maximum, a scalar all-reduce."""
  if _state_sharding.may_be_split(x):
    return jnp.max(x)
  return x.reshape(-1)[0]


def zero_after(result):
  """An int32 0 that XLA cannot compute before the leaf step that returned
  ``result = (update, stored)`` has finished: the sign bit of a stored value
  shifted out (``(u >> 31) >> 1``, which XLA does not fold). A Python 0
  outside ``jit`` (nothing to schedule) or when there is nothing to wait for.

  The values are read from what the step writes last and nothing changes
  afterwards: the codes of every quantized moment in ``stored``, and
  block-wise scales (rank-1 and tensor scales come from the first pass).
  Reading the update instead (only when nothing is quantized) keeps it alive
  past the caller's in-place transforms of it (weight decay, learning rate),
  and XLA then copies the gradient under it first."""
  update, stored = result
  written_last = []
  for moment in jax.tree.leaves(stored, is_leaf=qarray.is_quantized):
    if isinstance(moment, QuantizedArray):
      written_last.append(moment.codes)
      _, *scale_factors = normalize.row_factors(moment.layout, moment.ndim, moment.spec.bits)
      if None not in scale_factors:  # block-wise: written with the codes
        written_last.extend(moment.scales)
  candidates = [x for x in written_last or ([] if update is None else [update]) if x.size]
  if not candidates or not isinstance(candidates[0], jax.core.Tracer):
    return 0
  if _state_sharding.may_be_split(candidates[0]):
    candidates = [min(candidates, key=lambda x: x.size)]  # the cheapest to reduce
  else:
    # One element of each array: moments encoded by separate computations
    # (quantize_state's whole-leaf path) all finish before the next leaf.
    candidates = [x for x in candidates if x.dtype == jnp.uint8] or candidates[:1]
  zero = None
  for x in candidates:
    value = jnp.real(stored_value(x)).astype(jnp.float32)
    word = jax.lax.bitcast_convert_type(value, jnp.uint32)
    bit = jax.lax.shift_right_logical(
        jax.lax.shift_right_logical(word, np.uint32(31)), np.uint32(1)).astype(jnp.int32)
    zero = bit if zero is None else zero | bit
  return zero
