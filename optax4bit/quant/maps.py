"""Quantization tables and nearest-entry encoding (jnp reference).

Encoding is a binary search over the decision thresholds between neighbouring
table entries: ``bits`` compares per element, each compare's threshold picked
by a small tree of selects (no gather, which XLA's CPU backend does not
vectorize and which is slow on accelerators). The 8-bit tables (``DE``,
``DE-0``) are evaluated and searched in closed form instead
(`optax4bit.quant.dynamic_map`, bit for bit the table); ``Linear`` tables
have closed forms too.

Thresholds are the midpoints between entries, except for ``SqrtDE-0`` and
``SqrtLinear``, which round ``sqrt(x)`` to the nearest ``DE-0`` or ``Linear``
entry: their entries are the squares of those maps' entries and their
thresholds the squares of their midpoints.

Stochastic rounding draws its uniforms from a counter-based hash of the
element's index (`hashed_uniform`), so that every backend (jnp, the C++ CPU
kernel, the Pallas kernels) draws the same numbers for the same element, and
the result does not depend on how a leaf is chunked.
"""

from __future__ import annotations

import functools
import statistics
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.quant import dynamic_map
from optax4bit.quant.spec import (FOUR_BIT_ONLY_MAPPINGS, MAPPINGS, SIGNED_ONLY_MAPPINGS,
                                  SUPPORTED_BITS, UNSIGNED_ONLY_MAPPINGS)

__all__ = ["qmap"]


def _dynamic_exponent_map(bits: int, signed: bool) -> np.ndarray:
  """bitsandbytes' dynamic map (``create_dynamic_map``) with E = N = bits - 1."""
  exponent_bits = non_sign_bits = bits - 1
  values = []
  for i in range(exponent_bits):
    extra = 0 if signed else 1
    num_points = 2 ** (i + non_sign_bits - exponent_bits + extra) + 1
    edges = np.linspace(0.1, 1.0, num_points)
    midpoints = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - (exponent_bits - 1))
    values.extend(midpoints)
    if signed:
      values.extend(-midpoints)
  values.extend([0.0, 1.0])
  table = np.sort(np.asarray(values, dtype=np.float64)).astype(np.float32)
  assert table.size == 2**bits, table.size
  return table


def _normal_float_map() -> np.ndarray:
  """The 4-bit normal-float map (NF4 of Dettmers et al., QLoRA, 2023): 8
  quantiles of N(0, 1) for the positive half and 7 for the negative half,
  evenly spaced in probability from 0.5 to ``1 - (1/32 + 1/30) / 2``
  (excluded at 0.5), plus 0, scaled so that the largest is 1."""
  normal = statistics.NormalDist()
  offset = 0.5 * (1 - 1 / 32 + 1 - 1 / 30)
  positive = [normal.inv_cdf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
  negative = [-normal.inv_cdf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
  values = np.sort(np.asarray(positive + negative + [0.0], dtype=np.float64))
  return values / values.max()


# The maps that code sqrt(x) with another map: each to the map of its roots.
_SQRT_MAP_ROOTS = {"SqrtDE-0": "DE-0", "SqrtLinear": "Linear"}


@functools.lru_cache(maxsize=None)
def _table(mapping: str, bits: int, signed: bool) -> np.ndarray:
  if mapping == "Linear":
    table = (np.arange(2**bits, dtype=np.float64) + 1) / 2**bits
  elif mapping == "DE":
    table = _dynamic_exponent_map(bits, signed)
  elif mapping == "NF":
    table = _normal_float_map()
  elif mapping in _SQRT_MAP_ROOTS:
    table = _table(_SQRT_MAP_ROOTS[mapping], 4, False).astype(np.float64) ** 2
  else:  # DE-0: zero replaced by the smallest non-zero entry.
    table = _dynamic_exponent_map(bits, False)
    table[0] = table[1]
  table = table.astype(np.float32)
  table.setflags(write=False)
  return table


def qmap(mapping: str, bits: int = 4, signed: Optional[bool] = None) -> np.ndarray:
  """Returns the sorted quantization table of a mapping.

  Args:
    mapping: ``"DE"``, ``"DE-0"``, ``"Linear"``, ``"NF"``, ``"SqrtDE-0"`` or
      ``"SqrtLinear"``.
    bits: 4 or 8 (``NF``, ``SqrtDE-0`` and ``SqrtLinear``: 4); the table has ``2**bits``
      float32 entries.
    signed: ``DE`` only: whether the table covers [-1, 1] (default) or [0, 1].
      ``DE-0``, ``Linear``, ``SqrtDE-0`` and ``SqrtLinear`` exclude zero and exist only
      unsigned; ``NF`` exists only signed.

  Returns:
    A read-only float32 numpy array, sorted ascending.

  Example:
    >>> import optax4bit
    >>> optax4bit.qmap("Linear")[:3]
    array([0.0625, 0.125 , 0.1875], dtype=float32)
    >>> float(optax4bit.qmap("DE", signed=True)[0])
    -0.887499988079071
  """
  if mapping not in MAPPINGS:
    raise ValueError(f"mapping must be one of {MAPPINGS}, got {mapping!r}.")
  if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
    raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}.")
  if signed is None:
    signed = mapping not in UNSIGNED_ONLY_MAPPINGS
  if signed and mapping in UNSIGNED_ONLY_MAPPINGS:
    raise ValueError(f"mapping {mapping!r} excludes zero and has no signed table.")
  if not signed and mapping in SIGNED_ONLY_MAPPINGS:
    raise ValueError(f"mapping {mapping!r} has no unsigned table.")
  if bits != 4 and mapping in FOUR_BIT_ONLY_MAPPINGS:
    raise ValueError(f"mapping {mapping!r} exists for 4 bits only, got bits={bits}.")
  return _table(mapping, bits, bool(signed))


@functools.lru_cache(maxsize=None)
def midpoint_thresholds(mapping: str, bits: int, signed: bool) -> np.ndarray:
  """``2**bits - 1`` float32 thresholds ``t`` with ``x > t[k]`` exactly when
  ``x`` is strictly nearer to entry ``k + 1`` than to entry ``k`` (for
  ``SqrtDE-0`` and ``SqrtLinear``: ``sqrt(x)`` nearer to the square roots of
  the entries).

  The real midpoint of two float32 numbers is exact in float64; when it is not
  a float32 number we take the float32 just below it, so that a float32 ``x``
  compares against the threshold as it would against the exact midpoint (a
  tie, ``x`` equal to the exact midpoint, goes to the lower index). The
  squared midpoints of the roots are taken in float64 the same way.
  """
  if mapping in _SQRT_MAP_ROOTS:
    roots = _table(_SQRT_MAP_ROOTS[mapping], 4, False).astype(np.float64)
    exact = ((roots[:-1] + roots[1:]) / 2) ** 2
  else:
    table = _table(mapping, bits, signed).astype(np.float64)
    exact = (table[:-1] + table[1:]) / 2
  rounded = exact.astype(np.float32)
  too_high = rounded.astype(np.float64) > exact
  rounded[too_high] = np.nextafter(rounded[too_high], np.float32(-np.inf))
  rounded.setflags(write=False)
  return rounded


def _select_by_bits(decided: list, values: list):
  """``values[i]`` where ``i`` is spelled by the boolean arrays ``decided`` (MSB
  first), as a tree of selects over Python constants."""
  if len(values) == 1:
    return np.float32(values[0])
  half = len(values) // 2
  return jnp.where(decided[0], _select_by_bits(decided[1:], values[half:]),
                   _select_by_bits(decided[1:], values[:half]))


def count_above(x: jax.Array, bounds: np.ndarray, *, inclusive: bool = False) -> jax.Array:
  """Number of sorted ``bounds`` below ``x`` (``x > b``, or ``x >= b`` if
  ``inclusive``), by binary search: ``log2(len(bounds) + 1)`` compares (at
  most 15 bounds: 4-bit tables)."""
  num_levels = int(np.log2(bounds.size + 1))
  assert 2**num_levels == bounds.size + 1 and num_levels <= 4, bounds.size
  compare = jnp.greater_equal if inclusive else jnp.greater
  decided = []
  for level in range(num_levels):
    step = 2 ** (num_levels - 1 - level)
    candidates = [bounds[prefix * 2 * step + step - 1] for prefix in range(2**level)]
    decided.append(compare(x, _select_by_bits(decided, candidates)))
  count = jnp.zeros(x.shape, jnp.int32)
  for level, bit in enumerate(decided):
    count = count + bit.astype(jnp.int32) * (2 ** (num_levels - 1 - level))
  return count


def bracket(x: jax.Array, table: np.ndarray):
  """``(lower, table[lower], table[min(lower + 1, size - 1)])`` for ``x`` in
  ``[table[0], table[-1]]``, ``lower`` the largest ``k`` with ``table[k] <=
  x``: `count_above` over ``table[1:]`` (inclusive), which for 16 entries
  also carries the last bound passed and the last one failed along its
  search (the entries either side of ``x`` are both on the path), 8 selects
  instead of two 15-select trees. 4-bit tables only."""
  num_levels = int(np.log2(table.size))
  assert 2**num_levels == table.size and num_levels <= 4, table.size
  decided = []
  low = jnp.full(x.shape, table[0], jnp.float32)
  high = jnp.full(x.shape, table[-1], jnp.float32)
  for level in range(num_levels):
    step = 2 ** (num_levels - 1 - level)
    bound = _select_by_bits(decided, [table[prefix * 2 * step + step]
                                      for prefix in range(2**level)])
    passed = x >= bound
    low = jnp.where(passed, bound, low)
    high = jnp.where(passed, high, bound)
    decided.append(passed)
  lower = jnp.zeros(x.shape, jnp.int32)
  for level, bit in enumerate(decided):
    lower = lower + bit.astype(jnp.int32) * (2 ** (num_levels - 1 - level))
  return lower, low, high


def encode_nearest(n: jax.Array, mapping: str, bits: int, signed: bool,
                   dtype=jnp.uint8) -> jax.Array:
  """Codes (``dtype``, uint8 by default) of the nearest table entries to
  float32 ``n``; ties go to the lower index; values outside the table clamp
  to its ends."""
  if mapping == "Linear":
    # Entries (i + 1) / 2**b, midpoints (i + 1.5) / 2**b: exact in float32.
    levels = 2**bits
    code = jnp.clip(jnp.ceil(n * np.float32(levels) - np.float32(1.5)), 0, levels - 1)
    return code.astype(dtype)
  if bits == 8:
    return dynamic_map.encode_nearest(n, mapping, signed).astype(dtype)
  return count_above(n, midpoint_thresholds(mapping, bits, signed)).astype(dtype)


def encode_stochastic(n: jax.Array, uniform: jax.Array, mapping: str, bits: int,
                      signed: bool, dtype=jnp.uint8) -> jax.Array:
  """Unbiased stochastic rounding between the two neighbouring entries
  (codes of ``dtype``, uint8 by default).

  ``uniform`` holds U[0, 1) draws shaped like ``n``. Values outside the table
  clamp to its ends first (the only biased case).
  """
  table = _table(mapping, bits, signed)
  n = jnp.clip(n, table[0], table[-1])
  if mapping == "Linear" and bits == 8:
    # Entries (i + 1) / 2**b: the entry below n in closed form, exact in float32.
    lower = jnp.clip(jnp.floor(n * np.float32(2**bits)).astype(jnp.int32) - 1, 0, 2**bits - 1)
    low_value = decode(lower, mapping, bits, signed)
    high_value = decode(jnp.minimum(lower + 1, 2**bits - 1), mapping, bits, signed)
  elif bits == 8:
    lower, low_value, high_value = dynamic_map.bracket(n, mapping, signed)
  else:
    lower, low_value, high_value = bracket(n, table)
  gap = high_value - low_value
  round_up_probability = jnp.where(gap > 0, (n - low_value) / jnp.where(gap > 0, gap, 1), 0)
  return (lower + (uniform < round_up_probability).astype(jnp.int32)).astype(dtype)


def decode(codes: jax.Array, mapping: str, bits: int, signed: bool) -> jax.Array:
  """float32 table entries for integer ``codes``."""
  if mapping == "Linear":
    return (codes.astype(jnp.float32) + 1) * np.float32(1.0 / 2**bits)
  table = _table(mapping, bits, signed)
  if bits <= 4:
    codes = codes.astype(jnp.int32)
    decided = [(codes & (1 << (bits - 1 - level))) != 0 for level in range(bits)]
    return _select_by_bits(decided, list(table))
  return dynamic_map.decode(codes, mapping, signed)


# Stochastic rounding's random numbers: a counter-based hash of the element
# index, cheap in every backend (two integer multiplies), unlike a PRNG stream.
_MIX_MULTIPLIERS = (np.uint32(0x21F0AAAD), np.uint32(0x735A2D97))


def fold16(x: jax.Array) -> jax.Array:
  """``x ^ (x >> 16)`` of uint32 ``x``, the first step of `mix32`. It
  distributes over xor (``fold16(a ^ b) == fold16(a) ^ fold16(b)``), so a
  kernel folds an element's index once for every seed it is hashed with."""
  return x ^ (x >> np.uint32(16))


def mix32(x: jax.Array) -> jax.Array:
  """A bijective avalanche mix of uint32 values (C. Wellons' ``lowbias32``
  triple with the constants of his hash-prospector search)."""
  return _mix32_after_fold(fold16(x))


def _mix32_after_fold(x: jax.Array) -> jax.Array:
  x = x * _MIX_MULTIPLIERS[0]
  x = x ^ (x >> np.uint32(15))
  x = x * _MIX_MULTIPLIERS[1]
  return x ^ (x >> np.uint32(15))


def rounding_seed(key: jax.Array) -> jax.Array:
  """The uint32 seed of `hashed_uniform` for a JAX PRNG key (typed or raw)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  words = key.reshape(-1).astype(jnp.uint32)
  seed = mix32(words[0])
  for word in words[1:]:
    seed = mix32(seed ^ word)
  return seed


def stream_key(key: jax.Array, index) -> jax.Array:
  """The key of stochastic rounding's stream ``index`` of ``key``: what
  ``jax.random.fold_in(key, index)`` is for a PRNG stream, without its
  threefry hash. Its data is ``(rounding_seed(key), index)``, so its
  `rounding_seed` is ``mix32(mix32(rounding_seed(key)) ^ index)``: distinct
  streams get distinct seeds (`mix32` is a bijection) for a dozen integer
  operations. The optimizers key each leaf and moment this way every step:
  ~110 scalar instructions per threefry, two per quantized leaf, took XLA:TPU
  0.5-0.8 s to compile on a 15-leaf model. Its only use is `rounding_seed`.

  Example:
    >>> import jax
    >>> from optax4bit.quant import maps
    >>> key = jax.random.key(0)
    >>> a, b = (maps.rounding_seed(maps.stream_key(key, i)) for i in (0, 1))
    >>> bool(a != b)
    True
  """
  data = jnp.stack([rounding_seed(key), jnp.asarray(index, jnp.uint32)])
  return jax.random.wrap_key_data(data, impl="threefry2x32")


def row_hash_bases(shape: tuple, origin: tuple = (), full_shape: Optional[tuple] = None):
  """uint32 flat index (modulo 2**32), in a tensor of shape ``full_shape``,
  of the first element of each row (last axis) of its block of shape
  ``shape`` starting at ``origin``: shape ``(prod(shape[:-1]),)``. Element
  ``c`` of row ``r`` of the block has flat index ``bases[r] + c``; kernels
  that hash indices take these for blocks of sharded leaves."""
  full_shape = tuple(shape) if full_shape is None else tuple(full_shape)
  origin = tuple(origin) + (0,) * (len(shape) - len(origin))
  lead = tuple(shape[:-1])
  bases = jnp.full(lead, origin[-1], jnp.int32).astype(jnp.uint32)
  stride = full_shape[-1]
  for axis in reversed(range(len(lead))):
    position = jax.lax.broadcasted_iota(jnp.uint32, lead, axis)
    position = position + jnp.asarray(origin[axis]).astype(jnp.uint32)
    bases = bases + position * np.uint32(stride % 2**32)
    stride *= full_shape[axis]
  return bases.reshape(-1)


def hashed_uniform(seed: jax.Array, shape: tuple, origin: tuple = (),
                   full_shape: Optional[tuple] = None) -> jax.Array:
  """U[0, 1) float32 draws for a block of shape ``shape`` of a tensor of
  shape ``full_shape`` (default ``shape``) whose first element has index
  ``origin`` (per axis, ints or traced; missing axes 0).

  Element ``e`` (row-major flat index in the whole tensor, modulo 2**32)
  draws ``(mix32(e ^ seed) >> 8) / 2**24``: the same number whatever block
  or shard computes it.
  """
  full_shape = tuple(shape) if full_shape is None else tuple(full_shape)
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    position = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    if axis < len(origin):
      position = position + jnp.asarray(origin[axis]).astype(jnp.uint32)
    index = index + position * np.uint32(stride % 2**32)
    stride *= full_shape[axis]
  return uniform_of_index(seed, index)


def uniform_of_index(seed: jax.Array, index: jax.Array) -> jax.Array:
  """The U[0, 1) float32 draw of uint32 flat element ``index`` under uint32
  ``seed``: ``(mix32(index ^ seed) >> 8) / 2**24`` (`hashed_uniform` of one
  element; kernels compute the index themselves)."""
  return scaled_uniform_of_folded_index(fold16(index), fold16(seed)) * np.float32(2.0**-24)


def scaled_uniform_of_folded_index(folded_index: jax.Array,
                                   folded_seed: jax.Array) -> jax.Array:
  """`uniform_of_index` times 2**24 (an integer below 2**24, exact in
  float32) from the `fold16` of the index and of the seed: kernels fold an
  index once for all its seeds, and compare the draw with a probability
  scaled alike."""
  return (_mix32_after_fold(folded_index ^ folded_seed) >> np.uint32(8)).astype(jnp.float32)
