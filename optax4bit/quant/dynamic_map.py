"""The 8-bit dynamic-exponent maps (``DE``, ``DE-0``) in closed form: no table lookup.

A gather from the 256-entry table is a slow op on every accelerator (a TPU
moved 46x `optax.adamw`'s bytes with it), and a tree of 255 selects makes
XLA:GPU store the tree. The tables have a closed form instead. Their
non-negative half, by magnitude index ``q``, is 0 (``q = 0``), then levels
``i = 0..6`` of ``2**(i + g)`` entries each (``g = 0`` signed, 1 unsigned),
then 1 (``q = top``). Entry ``j`` of level ``i`` is the midpoint of
``linspace(0.1, 1)``'s cells times ``10**(i - 6)``: ``A_i + (2 j + 1) C_i``
with ``A_i = 0.1 * 10**(i - 6)`` and ``C_i = 0.45 * 10**(i - 6) / 2**(i + g)``.

`magnitude` evaluates it in float32 to the table's float32 value bit for bit
(every entry is checked in the tests): ``C_i`` is split so that ``k * C_hi``
is exact (``C_hi`` has 16 significant bits, ``k < 256``), ``A_hi + k * C_hi``
is summed without error (Knuth's two-sum), and the small remainder is added
in one rounding. The sum is within about 2**-44 of the real entry, and no
entry lies that close to a float32 rounding boundary. Products whose factors
are exact do not depend on whether the compiler contracts them into FMAs.

Encoding finds the entry below ``x`` from the level (7 compares against the
levels' first entries) and an estimate within the level, corrected by one
exact compare, then rounds to the nearer neighbour by comparing ``x - low``
with ``high - x``: both differences are exact (Sterbenz) where the
neighbours are within a factor 3 of each other, which holds everywhere but
between the signed map's first two non-zero entries, where the stored
midpoint threshold decides. Ties go where `optax4bit.quant.maps` sends them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["decode", "encode_nearest", "bracket"]

_LEVELS = 7
_SPLIT_BITS = 16  # C_hi's significant bits: k * C_hi exact for k < 2**8.


def _top(signed: bool) -> int:
  """The magnitude index of the entry 1."""
  return 128 if signed else 255


@functools.lru_cache(maxsize=None)
def _constants(signed: bool) -> dict:
  """float32 per-level constants (each a list of 7): the entries' sums, the
  levels' first magnitude indices and entries, and the entries either side."""
  offset = 0 if signed else 1
  a_hi, a_lo, c_hi, c_lo, inverse_2c = [], [], [], [], []
  for level in range(_LEVELS):
    scale = 10.0 ** (level - (_LEVELS - 1))
    a = 0.1 * scale
    c = 0.45 * scale / 2 ** (level + offset)
    a_hi.append(np.float32(a))
    a_lo.append(np.float32(a - float(np.float32(a))))
    mantissa, exponent = np.frexp(c)
    high = np.ldexp(np.round(mantissa * 2**_SPLIT_BITS), exponent - _SPLIT_BITS)
    c_hi.append(np.float32(high))
    c_lo.append(np.float32(c - high))
    inverse_2c.append(np.float32(1 / (2 * c)))
  first_index = [2 ** (level + offset) - offset for level in range(_LEVELS)]
  consts = {"a_hi": a_hi, "a_lo": a_lo, "c_hi": c_hi, "c_lo": c_lo, "inverse_2c": inverse_2c,
            "first_index": first_index,
            "last_position": [2 ** (level + offset) - 1 for level in range(_LEVELS)]}
  consts["first_entry"] = [_entry(consts, level, 0) for level in range(_LEVELS)]
  # The entries either side of each level, for `_floor_index` (1 past the top).
  last_entries = [_entry(consts, level, consts["last_position"][level])
                  for level in range(_LEVELS)]
  consts["previous_entry"] = [np.float32(0)] + last_entries[:-1]
  consts["next_entry"] = consts["first_entry"][1:] + [np.float32(1)]
  consts["next_second_entry"] = ([_entry(consts, level, 1) for level in range(1, _LEVELS)]
                                 + [np.float32(1)])
  if signed:
    # float32 neighbours of the midpoint of the first two non-zero entries.
    exact = (float(consts["first_entry"][0]) + float(consts["first_entry"][1])) / 2
    nearest = np.float32(exact)
    below = nearest if float(nearest) <= exact else np.nextafter(nearest, np.float32(0))
    above = nearest if float(nearest) >= exact else np.nextafter(nearest, np.float32(1))
    consts["first_midpoint"] = (below, above)
  return consts


def _entry(consts: dict, level: int, position: int) -> np.float32:
  """`magnitude`'s arithmetic in numpy float32 (no FMA) for one entry."""
  return _entry_value(np.float32(2 * position + 1), *(consts[k][level] for k in _SUM_CONSTANTS))


def _by_level(level: jax.Array, values: list):
  """``values[level]`` for ``level`` in 0..6, by a tree of selects over constants."""
  values = list(values) + [values[-1]]
  bits = [(level & 4) != 0, (level & 2) != 0, (level & 1) != 0]

  def pick(depth, candidates):
    if len(candidates) == 1:
      return np.asarray(candidates[0])
    half = len(candidates) // 2
    return jnp.where(bits[depth], pick(depth + 1, candidates[half:]),
                     pick(depth + 1, candidates[:half]))
  return pick(0, values)


def _int(condition):
  """A condition as int32 (Mosaic lowers no select between booleans)."""
  return condition.astype(jnp.int32)


# The per-level constants of an entry, in `_entry_value`'s order.
_SUM_CONSTANTS = ("a_hi", "a_lo", "c_hi", "c_lo")


def _entry_value(odd, a_hi, a_lo, c_hi, c_lo):
  """``A + odd * C`` rounded once: ``odd * c_hi`` is exact, ``a_hi`` plus it
  summed without error, the small rest added last (numpy or jnp float32)."""
  s, e = _two_sum(a_hi, odd * c_hi)
  return s + (e + (a_lo + odd * c_lo))


def _two_sum(a, b):
  """``(s, e)`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly."""
  s = a + b
  b_virtual = s - a
  return s, (a - (s - b_virtual)) + (b - b_virtual)


def magnitude(index: jax.Array, signed: bool) -> jax.Array:
  """float32 entry of the non-negative half's magnitude ``index`` (int32,
  0..top; ``top`` gives 1), equal to the table's float32 entry bit for bit."""
  consts = _constants(signed)
  offset = 0 if signed else 1
  shifted = index + offset
  level = sum((shifted >= 2**t).astype(jnp.int32) for t in range(1, _LEVELS + 1)) - offset
  level = jnp.clip(level, 0, _LEVELS - 1)
  position = shifted - jnp.left_shift(jnp.int32(1), level + offset)
  value = _entry_value((2 * position + 1).astype(jnp.float32),
                       *(_by_level(level, consts[k]) for k in _SUM_CONSTANTS))
  value = jnp.where(index <= 0, np.float32(0), value)
  return jnp.where(index >= _top(signed), np.float32(1), value)


def _floor_index(m: jax.Array, signed: bool):
  """``(q, low, high)`` for float32 ``0 <= m <= 1``: ``q`` the largest
  magnitude index with ``magnitude(q) <= m``, ``low = magnitude(q)`` and
  ``high = magnitude(q + 1)`` (1 at the top).

  The three entries around ``m`` come from its level's constants, picked
  once (entries past the level's ends are constants too): a third of the
  arithmetic of three `magnitude` calls, which matters for compile time."""
  consts = _constants(signed)
  level = sum((m >= first).astype(jnp.int32) for first in consts["first_entry"]) - 1
  in_level = jnp.clip(level, 0, _LEVELS - 1)
  pick = functools.partial(_by_level, in_level)
  level_constants = [pick(consts[k]) for k in _SUM_CONSTANTS]
  last = pick(consts["last_position"])
  # Position in the level (entries at integers), estimated to within 1/2 and
  # biased down by 1/2: the estimate is the entry below m or the one before.
  coordinate = (m - level_constants[0]) * pick(consts["inverse_2c"])
  position = jnp.clip(jnp.floor(coordinate - 1), -1, last).astype(jnp.int32)

  def entry(p):  # position p of the level
    return _entry_value((2 * p + 1).astype(jnp.float32), *level_constants)

  next_entry = pick(consts["next_entry"])
  below = jnp.where(position < 0, pick(consts["previous_entry"]), entry(position))
  above = jnp.where(position + 1 > last, next_entry, entry(position + 1))
  after = jnp.where(position + 2 > last,
                    jnp.where(position + 2 > last + 1, pick(consts["next_second_entry"]),
                              next_entry),
                    entry(position + 2))
  step_up = above <= m
  index = pick(consts["first_index"]) + position + step_up.astype(jnp.int32)
  low = jnp.where(step_up, above, below)
  high = jnp.where(step_up, after, above)
  # Below the first non-zero entry: the zero entry and the first.
  first = consts["first_entry"][0]
  zero = level < 0
  return (jnp.where(zero, 0, index), jnp.where(zero, np.float32(0), low),
          jnp.where(zero, first, high))


def encode_nearest(x: jax.Array, mapping: str, signed: bool) -> jax.Array:
  """`optax4bit.quant.maps.encode_nearest`'s 8-bit ``DE``/``DE-0`` codes
  (int32) of float32 ``x``: NaN to code 0, values beyond the table to its ends."""
  top = _top(signed)
  if signed:
    negative = x < 0
    m = jnp.minimum(jnp.abs(x), np.float32(1))
    index, low, high = _floor_index(m, True)
    # Selects of int32, not of booleans (Mosaic lowers no select of i1).
    nearer_high = jnp.where(negative, _int(m - low >= high - m), _int(m - low > high - m))
    # The first two non-zero entries: the midpoint's float32 neighbours decide
    # (ties: the lower code, the larger magnitude below zero).
    below, above = _constants(True)["first_midpoint"]
    nearer_high = jnp.where(index == 1, jnp.where(negative, _int(m >= above), _int(m > below)),
                            nearer_high)
    nearest = jnp.where(index >= top, top, index + nearer_high)
    codes = jnp.where(negative, 127 - jnp.minimum(nearest, 127), 127 + nearest)
  else:
    m = jnp.clip(x, np.float32(0), np.float32(1))
    index, low, high = _floor_index(m, False)
    codes = jnp.where(index >= top, top, index + (m - low > high - m).astype(jnp.int32))
    if mapping == "DE-0":
      codes = jnp.where(codes <= 1, (x > _constants(False)["first_entry"][0]).astype(jnp.int32),
                        codes)
  return jnp.where(jnp.isnan(x), 0, codes)


def bracket(x: jax.Array, mapping: str, signed: bool):
  """`optax4bit.quant.maps.bracket` of the 8-bit ``DE``/``DE-0`` table:
  ``(lower, table[lower], table[lower + 1])`` (the top entry twice at the
  top) for ``x`` already clipped to the table's range. Where ``x`` is an
  entry the upper value may differ from the table's; stochastic rounding
  then rounds to ``lower`` whatever it is."""
  if not signed:
    index, low, high = _floor_index(x, False)
    del mapping  # DE-0 differs only below its smallest entry, clipped away.
    return index, low, jnp.where(index >= _top(False), low, high)
  negative = x < 0
  index, low, high = _floor_index(jnp.abs(x), True)
  # Below zero the entry below x has the smallest magnitude >= |x|.
  inexact = low < jnp.abs(x)
  negative_lower = 127 - (index + inexact.astype(jnp.int32))
  positive_lower = 127 + index
  lower = jnp.where(negative, negative_lower, positive_lower)
  low_value = jnp.where(negative, -jnp.where(inexact, high, low), low)
  high_value = jnp.where(negative, -jnp.where(inexact, low, high), jnp.where(
      index >= _top(True), low, high))
  return lower, low_value, high_value


def decode(codes: jax.Array, mapping: str, signed: bool) -> jax.Array:
  """float32 entries of the 8-bit ``DE``/``DE-0`` table for integer ``codes``."""
  codes = codes.astype(jnp.int32)
  if signed:
    negative = codes < 127
    value = magnitude(jnp.abs(codes - 127), True)
    return jnp.where(negative, -value, value)
  value = magnitude(codes, False)
  if mapping == "DE-0":
    value = jnp.where(codes == 0, _constants(False)["first_entry"][0], value)
  return value
