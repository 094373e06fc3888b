"""What one leaf's update needs to know besides its arrays: `LeafContext`.

The engine (`optax4bit._leafwise`) and the backends' fused steps take it as
an argument. `optax4bit._leafwise.sequential_map` makes one per leaf (the
codecs, the row offset that orders leaves, the request for the per-shard
order zero); the per-shard runners (`optax4bit._shard_map`,
`optax4bit._gspmd`) make the one of a shard (`Shard`: where its block sits in
the global leaf, how its statistics become global).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Protocol

from optax4bit._order import Ordering


class Codecs(Protocol):
  """A backend's 4-bit codecs, bit-identical to `optax4bit.quant.array`'s
  (`optax4bit.cpu.codec`); each returns None where it does not apply."""

  def decode(self, codes, scales, spec, layout, shape):
    ...

  def encode(self, value, spec, layout, scales, seed, row_bases, stored_codes):
    ...


class Shard(NamedTuple):
  """One shard's block of a leaf, while a per-shard runner traces its update.

  Attributes:
    reduce_scales: ``(scales, layout) -> scales``: a block's rank-1 or tensor
      maxima made the global leaf's (``pmax`` over the other shards).
    global_shape: the global leaf's shape; None when the block is the whole
      leaf (a replicated leaf run on every device).
    origin: the global index, per axis, of the block's first element (traced
      ints); None with ``global_shape``.
  """
  reduce_scales: Callable
  global_shape: Optional[tuple] = None
  origin: Optional[tuple] = None


def shard_position(shard: Optional[Shard]) -> Optional[tuple]:
  """``(global_shape, origin)`` of a block that is part of a larger leaf, for
  the stochastic rounding hash (`optax4bit.quant.maps.row_hash_bases`); None
  for a whole leaf."""
  if shard is None or shard.origin is None:
    return None
  return shard.global_shape, shard.origin


@dataclasses.dataclass(frozen=True)
class LeafContext:
  """The context of one leaf's update.

  Attributes:
    codecs: the backend's codecs the engine runs in place of the jnp ones
      (`optax4bit.dispatch`), or None.
    row_offset: a runtime zero (traced int32, or the Python int 0) that the
      engine adds to every row it slices at, or subtracts from whole inputs
      (`optax4bit._leafwise.after_previous_leaf`): it keeps this leaf after
      the previous one.
    ordering: the `optax4bit._order.Ordering` request of a per-shard run of
      this leaf, or None.
    shard: the `Shard` being traced, or None outside a per-shard runner.
  """
  codecs: Optional[Codecs] = None
  row_offset: Any = 0
  ordering: Optional[Ordering] = None
  shard: Optional[Shard] = None

  def in_shard(self, shard: Shard, row_offset: Any = 0) -> "LeafContext":
    """The context of one shard of this leaf: same codecs, no ordering request
    (an update nested in a shard is not a leaf of the outer map)."""
    return LeafContext(self.codecs, row_offset, None, shard)
