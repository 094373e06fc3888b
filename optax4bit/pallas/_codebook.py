"""The lookup tables the kernels read a 4-bit map through (numpy, built once).

Select trees over 16 constants cost a Triton kernel about 15 selects per
lookup; a lookup in a small table in global memory (cached in L1) costs an
address and one load. Three kinds of table, each exact:

* ``decode_pairs``: ``(256, 2)`` float32, the entries of the two codes of a
  packed byte, ``(table[b & 15], table[b >> 4])``: one 8-byte load decodes
  two elements.
* ``BucketTable``: the count of sorted thresholds below ``x``
  (`optax4bit.quant.maps.count_above`) by the bits of ``x``. The top
  ``9 + m`` bits of a float32 (sign, exponent and ``m`` mantissa bits) name
  a bucket, an interval of floats; ``m`` is the smallest with at most one
  threshold inside any bucket. A bucket stores that threshold (NaN if none:
  no comparison with NaN holds) and the count at its low end, so the count
  is ``base + (x > threshold)`` (``>=`` for inclusive counts; a quiet NaN
  ``x`` counts as 0 does, so that the encoders need no select): the same
  comparison with the same float32 threshold as the reference's search, so
  flushing of subnormals (XLA's CPU backend) changes both alike.
* ``entry_gaps``: ``(16, 3)`` float32, each entry times ``-2**24`` (the
  scale of stochastic rounding's draws, `_math.encode_stochastic`), the distance to the
  next one (``inf`` after the last, where stochastic rounding's probability
  is then 0) and that distance's correctly rounded reciprocal (0 for
  ``inf``), from which the kernels finish the division ``d / gap`` in two
  fused multiply-adds. A ``stall_only`` spec's table has a fourth column,
  the nearest rounding's threshold between each entry and the next
  (`optax4bit.quant.maps.midpoint_thresholds`, ``inf`` after the last), so
  that the stall rule's nearest code is its stochastic bracket's lower code
  plus one comparison (`_math.encode_stochastic`); for a map whose first two
  entries are equal (``DE-0``, ``SqrtDE-0``) a fifth, the threshold from the
  entry before, and a second comparison.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from optax4bit.quant import maps
from optax4bit.quant.spec import QuantSpec

_EXPONENT_BITS = 8
_MANTISSA_BITS = 23


@functools.lru_cache(maxsize=None)
def _decode_pairs(mapping: str, signed: bool) -> np.ndarray:
  table = maps.qmap(mapping, 4, signed)
  byte = np.arange(256)
  return np.stack([table[byte & 15], table[byte >> 4]], axis=1).astype(np.float32)


def decode_pairs(spec: QuantSpec) -> np.ndarray:
  """``(256, 2)`` float32: the decoded even and odd element of each byte."""
  return _decode_pairs(spec.mapping, spec.signed)


@functools.lru_cache(maxsize=None)
def _entry_gaps(mapping: str, signed: bool, midpoints: bool) -> np.ndarray:
  table = maps.qmap(mapping, 4, signed)
  gaps = np.append(np.diff(table), np.float32(np.inf)).astype(np.float32)
  # `_math.KernelMath.probability` divides by these without a range check.
  finite = gaps[np.isfinite(gaps) & (gaps != 0)]
  assert np.all((finite >= np.finfo(np.float32).tiny) & (finite <= 1)), (mapping, gaps)
  with np.errstate(divide="ignore"):
    reciprocals = np.float32(1) / gaps  # IEEE float32 division: correctly rounded
  # Times -2**24: exact (the entries are 0 or normal, at most 1), and negated so
  # that the kernels' difference is one fused multiply-add without a negation.
  scaled = table.astype(np.float32) * np.float32(-(2.0**24))
  columns = [scaled, gaps, reciprocals]
  if midpoints:
    # Nearest rounding's code counts the thresholds below ``n``; each lies in
    # [entry, next entry], so for the bracket's ``lower`` (``entries[lower] <=
    # n < entries[lower + 1]`` where ``n`` is in the table's range) those
    # after ``lower``'s are above ``n``. Where each is below the next entry,
    # those before are below ``n``, and the code is ``lower + (n >
    # thresholds[lower])`` (`_math.encode_stochastic`). Where the first two
    # entries are equal, the threshold between them is that entry, which
    # ``n`` need not pass; the bracket's ``lower`` is then never 0 (the
    # reference clips ``n`` to the first entry, which counts the second), and
    # the code is ``lower - 1 + (n > thresholds[lower - 1]) + (n >
    # thresholds[lower])``, with ``thresholds[lower - 1]`` a fifth column.
    thresholds = maps.midpoint_thresholds(mapping, 4, signed)
    assert np.all((table[:-1] <= thresholds) & (thresholds <= table[1:])), mapping
    columns.append(np.append(thresholds, np.float32(np.inf)))
    if not np.all(thresholds < table[1:]):
      assert table[0] == table[1] and np.all(thresholds[1:] < table[2:]), mapping
      # Row 0 is never read (``-inf``, as if no threshold were before it).
      columns.append(np.insert(thresholds, 0, np.float32(-np.inf)))
  return np.stack(columns, axis=1).astype(np.float32)


def entry_gaps(spec: QuantSpec) -> np.ndarray:
  """``(16, 3)`` float32: each table entry times ``-2**24``, the gap to the
  next entry and the gap's correctly rounded reciprocal; for a ``stall_only``
  spec, then the nearest rounding's threshold to the next entry, and for a
  map whose first two entries are equal the one from the entry before (see
  module)."""
  return _entry_gaps(spec.mapping, spec.signed, spec.stall_only)


def _bucket_bounds(mantissa: int) -> tuple:
  """The lowest and highest float32 of every bucket (bucket ``i`` is the
  floats whose bits shifted right by ``23 - mantissa`` are ``i``), for
  finite buckets: infinities and NaNs (exponent 255) are left out."""
  per_sign = 1 << (_EXPONENT_BITS + mantissa)
  width = 1 << (_MANTISSA_BITS - mantissa)
  finite = per_sign - (1 << mantissa)
  low_bits = np.arange(finite, dtype=np.uint32) * np.uint32(width)
  low = low_bits.view(np.float32)
  high = (low_bits + np.uint32(width - 1)).view(np.float32)
  # Negative floats: the same magnitudes, in the other order.
  return (np.concatenate([low, -high]), np.concatenate([high, -low]), per_sign, finite)


def _counts(x: np.ndarray, thresholds: np.ndarray, inclusive: bool) -> np.ndarray:
  above = x[:, None] >= thresholds[None] if inclusive else x[:, None] > thresholds[None]
  return above.sum(axis=1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class BucketTable:
  """``count_above`` of ``thresholds`` as a table lookup by bits (see module)."""
  shift: int          # bucket = bits >> shift (as uint32)
  inclusive: bool     # count thresholds <= x rather than < x
  entries: np.ndarray  # (buckets, 2) int32: threshold bits, count at the bucket's low end


def _build(thresholds: np.ndarray, inclusive: bool, floor: np.float32, mantissa: int):
  low, high, per_sign, finite = _bucket_bounds(mantissa)
  count = lambda x: _counts(np.maximum(x, floor), thresholds, inclusive)
  base, top = count(low), count(high)
  if np.any(top - base > 1):
    return None
  threshold = np.full(low.shape, np.nan, np.float32)
  # Where subnormals count as zero (XLA's CPU backend), a subnormal x meets a
  # zero threshold as +-0 does: those buckets compare with it too.
  subnormal = np.abs(high) < np.finfo(np.float32).tiny
  zero = count(np.where(np.signbit(low), np.float32(-0.0), np.float32(0.0)))
  jumps = np.nonzero((top > base) | (subnormal & (zero > base)))[0]
  # The threshold crossed inside the bucket is the (base)-th one.
  threshold[jumps] = thresholds[base[jumps]]
  table = np.zeros((2 * per_sign, 2), np.int32)
  nonfinite = np.full(per_sign - finite, np.nan, np.float32)
  zero_count = count(np.float32([0.0]))[0]
  for sign in range(2):
    rows = slice(sign * per_sign, sign * per_sign + finite)
    table[rows, 0] = threshold[sign * finite:(sign + 1) * finite].view(np.int32)
    table[rows, 1] = base[sign * finite:(sign + 1) * finite]
    # Exponent 255, no threshold: the first bucket holds +-inf (mantissa 0),
    # which counts as that end; the others only NaNs, which count as 0 does
    # (the reference codes NaN as 0). Every quiet NaN, and so every NaN that
    # arithmetic makes, has the top mantissa bit set: never inf's bucket.
    start = sign * per_sign + finite
    table[start:(sign + 1) * per_sign, 0] = nonfinite.view(np.int32)
    table[start, 1] = count(np.float32([-np.inf if sign else np.inf]))[0]
    table[start + 1:(sign + 1) * per_sign, 1] = zero_count
  return table


@functools.lru_cache(maxsize=None)
def bucket_table(mapping: str, signed: bool, inclusive: bool) -> BucketTable:
  """The bucket lookup of the midpoint thresholds (nearest rounding), or,
  ``inclusive``, of the entries above the first at ``max(x, entries[0])``
  (the lower entry of stochastic rounding's bracket, `maps.bracket` of the
  clipped value)."""
  entries = maps.qmap(mapping, 4, signed)
  # Stochastic rounding never rounds 0 up only where 0 is an entry or below
  # the first: then a NaN, which never rounds up, can take 0's lookup.
  assert 0 in entries or entries[0] > 0, (mapping, signed)
  if inclusive:  # the reference clips to the first entry first
    thresholds, floor = entries[1:], entries[0]
  else:
    thresholds, floor = maps.midpoint_thresholds(mapping, 4, signed), np.float32(-np.inf)
  thresholds = np.asarray(thresholds, np.float32)
  for mantissa in range(1, 8):
    entries = _build(thresholds, inclusive, floor, mantissa)
    if entries is not None:
      entries.setflags(write=False)
      return BucketTable(_MANTISSA_BITS - mantissa, inclusive, entries)
  raise AssertionError(f"no bucket width separates the thresholds of {mapping}")
