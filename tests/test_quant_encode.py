"""Encoding: nearest entry with ties to the lower index, and stochastic rounding.

References are computed independently in float64 numpy (`conftest.argmin_codes`)
against the literal SPEC tables (8-bit: SPEC's recipe), never the library's.
"""

import functools
import zlib

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax4bit
from optax4bit import QuantSpec
from optax4bit.quant import maps
from conftest import (ALL_TABLES, PRESETS, argmin_codes, has_duplicates, near_midpoint,
                      parse_norm, reference_scale, reference_table, unpack_nibbles)

SIZE = 256  # fixed length of the encoded vectors, so each table compiles once.


@functools.lru_cache(maxsize=None)
def _jit_encode(mapping, bits, signed):
  return jax.jit(lambda n: maps.encode_nearest(n, mapping, bits, signed))


def _encode(values, mapping, bits, signed) -> np.ndarray:
  values = np.asarray(values, dtype=np.float32).ravel()
  out = []
  for start in range(0, values.size, SIZE):
    chunk = values[start:start + SIZE]
    padded = np.zeros(SIZE, np.float32)
    padded[:chunk.size] = chunk
    codes = np.asarray(_jit_encode(mapping, bits, signed)(padded))
    assert codes.dtype == np.uint8
    out.append(codes[:chunk.size])
  return np.concatenate(out)


def _assert_nearest(values, mapping, bits, signed):
  """Library codes == brute-force argmin (ties to the lower index)."""
  values = np.asarray(values, dtype=np.float32).ravel()
  table = reference_table(mapping, bits, signed)
  got = _encode(values, mapping, bits, signed)
  want = argmin_codes(values, table)
  assert np.all(got < 2**bits)
  # The decoded values always agree.
  bad = table[got] != table[want]
  assert not bad.any(), (
      f"{mapping}/{bits}/{signed}: n={values[bad][:8]!r} got codes {got[bad][:8]} "
      f"want {want[bad][:8]}")
  if not has_duplicates(table):
    np.testing.assert_array_equal(got, want)


def _adversarial(table) -> np.ndarray:
  """Entries, exact float64 midpoints and the float32 values around them,
  values outside [-1, 1], tiny values, signed zeros, infinities."""
  t64 = table.astype(np.float64)
  mids = (t64[:-1] + t64[1:]) / 2
  m32 = mids.astype(np.float32)
  up = np.float32(np.inf)
  down = np.float32(-np.inf)
  # Largest float32 <= midpoint and smallest float32 >= midpoint.
  floor32 = np.where(m32.astype(np.float64) > mids, np.nextafter(m32, down), m32)
  ceil32 = np.where(m32.astype(np.float64) < mids, np.nextafter(m32, up), m32)
  candidates = [
      table, np.nextafter(table, up), np.nextafter(table, down),
      m32, floor32, ceil32, np.nextafter(floor32, down), np.nextafter(ceil32, up),
      np.array([0.0, -0.0, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 1e30, -1e30, 3.4e38, -3.4e38,
                np.inf, -np.inf, 1e-38, -1e-38, 1e-45, -1e-45, 1e-30, -1e-30,
                -0.95, -0.9, -0.8875, -0.99, 0.9999999, -0.9999999], np.float32),
  ]
  return np.concatenate([np.asarray(c, np.float32).ravel() for c in candidates])


@pytest.mark.parametrize("mapping,bits,signed", ALL_TABLES)
def test_encode_adversarial(mapping, bits, signed):
  table = reference_table(mapping, bits, signed)
  values = _adversarial(table)
  _assert_nearest(values, mapping, bits, signed)
  _assert_nearest(-values, mapping, bits, signed)


@pytest.mark.parametrize("mapping,bits,signed", ALL_TABLES)
def test_encode_ties_go_to_lower_index(mapping, bits, signed):
  """Midpoints that are exact float32 numbers are ties: the lower entry wins."""
  table = reference_table(mapping, bits, signed).astype(np.float64)
  mids = (table[:-1] + table[1:]) / 2
  exact = (mids.astype(np.float32).astype(np.float64) == mids) & (table[:-1] < table[1:])
  assert exact.any()
  codes = _encode(mids[exact], mapping, bits, signed)
  np.testing.assert_array_equal(codes, np.nonzero(exact)[0])


def test_encode_hand_checked_4bit():
  """A few values worked out by hand from the SPEC tables."""
  # float32(0.00275) is exactly half of float32(0.0055): a tie -> 0 (code 7).
  # float32(0.775) lies just below 0.775, so -float32(0.775) is nearer -0.6625.
  n = np.float32([0.0, -0.0, 0.00275, 0.0028, 0.3, 0.33, -1.0, 1.0, 5.0, -0.775, -0.7751])
  np.testing.assert_array_equal(_encode(n, "DE", 4, True),
                                [7, 7, 7, 8, 11, 12, 0, 15, 15, 1, 0])
  # Linear: midpoint 1.5/16 (exact float32) -> code 0; 0 and negatives -> 0.
  n = np.float32([1.5 / 16, np.nextafter(np.float32(1.5 / 16), 1), 0.0, -3.0, 1.0, 0.96875])
  np.testing.assert_array_equal(_encode(n, "Linear", 4, False), [0, 1, 0, 0, 15, 14])


def test_de0_duplicate_smallest_entry():
  """DE-0's codes 0 and 1 both mean 0.00325 (documented behaviour): values up
  to 0.00325 encode to 0, values between it and the next midpoint to 1 (the
  thresholds sit at the midpoints between neighbours)."""
  table = reference_table("DE-0", 4, False)
  assert table[0] == table[1] == np.float32(0.00325)
  codes = _encode(np.float32([0.0, 0.003, 0.00325, 0.004, 0.0055]), "DE-0", 4, False)
  np.testing.assert_array_equal(codes, [0, 0, 0, 1, 1])
  np.testing.assert_array_equal(table[codes], np.float32([0.00325] * 5))


_moderate = st.floats(-1.25, 1.25, width=32)
_any_float = st.floats(width=32, allow_nan=False, allow_infinity=True)
_tiny = st.floats(-2.0**-10, 2.0**-10, width=32)


@st.composite
def _values_near_table(draw, table):
  """Table entries and midpoints, nudged by a few float32 ulps."""
  t = table.astype(np.float64)
  points = np.concatenate([t, (t[:-1] + t[1:]) / 2])
  base = np.float32(draw(st.sampled_from(points.tolist())))
  steps = draw(st.integers(-3, 3))
  direction = np.float32(np.inf if steps > 0 else -np.inf)
  for _ in range(abs(steps)):
    base = np.nextafter(base, direction)
  return float(base)


@pytest.mark.parametrize("mapping,bits,signed", ALL_TABLES)
@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(data=st.data())
def test_encode_matches_argmin_property(mapping, bits, signed, data):
  table = reference_table(mapping, bits, signed)
  element = st.one_of(_moderate, _any_float, _tiny, _values_near_table(table))
  values = data.draw(hnp.arrays(np.float32, SIZE, elements=element))
  _assert_nearest(values, mapping, bits, signed)


@pytest.mark.slow
@pytest.mark.parametrize("mapping,bits,signed", ALL_TABLES)
def test_encode_exhaustive_around_midpoints_and_entries(mapping, bits, signed):
  """Every float32 within 1000 ulps of every midpoint and entry (slow)."""
  table = reference_table(mapping, bits, signed)
  t64 = table.astype(np.float64)
  centres = np.concatenate([table, ((t64[:-1] + t64[1:]) / 2).astype(np.float32)])
  centres = np.concatenate([centres, -centres])
  ints = centres.view(np.int32)[:, None] + np.arange(-1000, 1001, dtype=np.int32)
  values = ints.view(np.float32).ravel()
  values = values[np.isfinite(values)]
  size = 1 << 14
  pad = -values.size % size
  padded = np.concatenate([values, np.zeros(pad, np.float32)]).reshape(-1, size)
  encode = jax.jit(lambda n: maps.encode_nearest(n, mapping, bits, signed))
  for row in padded:
    got = np.asarray(encode(row))
    want = argmin_codes(row, table)
    np.testing.assert_array_equal(table[got], table[want])
    if not has_duplicates(table):
      np.testing.assert_array_equal(got, want)


# --- Through quantize: codes of x / scale. -----------------------------------


@functools.lru_cache(maxsize=None)
def _jit_quantize(spec):
  return jax.jit(lambda x: optax4bit.quantize(x, spec))


def _spec(name, bits):
  return QuantSpec.parse(name, bits=bits)


def _codes(q, spec, shape):
  codes = np.asarray(q.codes)
  if spec.bits == 8:
    assert codes.shape == shape
    return codes
  assert codes.shape == shape[:-1] + ((shape[-1] + 1) // 2,)
  return unpack_nibbles(codes, shape[-1])


@pytest.mark.parametrize("name,bits", PRESETS)
@pytest.mark.parametrize("shape", [(16, 300), (4, 8, 128), (1000,), (40, 24)])
def test_quantize_codes_are_argmin_of_normalized(name, bits, shape):
  spec = _spec(name, bits)
  table = reference_table(spec.mapping, bits, spec.signed)
  rng = np.random.default_rng(zlib.crc32(repr((name, shape)).encode()))
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(
      rng.choice([1e-3, 1.0, 1e3], size=shape[:-1] + (1,)))
  if not spec.signed:
    x = np.abs(x)
  q = _jit_quantize(spec)(jnp.asarray(x))
  norm, block = parse_norm(name)
  scale = reference_scale(x, norm, block)
  n64 = x.astype(np.float64) / scale
  want = argmin_codes(n64, table)
  got = _codes(q, spec, shape)
  # float32 rounding of x / scale may flip an element lying within a few ulps
  # of a midpoint; there either neighbour is right.
  close = near_midpoint(n64, table)
  assert close.mean() < 1e-3
  far = ~close
  np.testing.assert_array_equal(table[got[far]], table[want[far]])
  if not has_duplicates(table):
    np.testing.assert_array_equal(got[far], want[far])
  assert np.all(np.abs(got[close].astype(int) - want[close].astype(int)) <= 1)


@pytest.mark.parametrize("name,bits", [("B128/DE", 4), ("B128/DE-0", 4), ("Tensor/Linear", 4),
                                       ("Rank-1/DE-0", 4), ("Rank-1/Linear", 4),
                                       ("B256/DE", 8), ("Tensor/DE", 8)])
def test_quantize_adversarial_exact(name, bits):
  """With a power-of-two scale x / scale is exact, so the codes must equal the
  brute-force argmin exactly, ties included."""
  spec = _spec(name, bits)
  table = reference_table(spec.mapping, bits, spec.signed)
  n = _adversarial(table)
  n = n[np.isfinite(n) & (np.abs(n) <= 1) & (np.abs(n) >= 2.0**-100)]
  if spec.signed:
    n = np.concatenate([n, -n, np.float32([0.0, -0.0])])
  else:
    n = np.concatenate([np.abs(n), np.float32([0.0])])
  width = 256 if bits == 8 else 128
  rows = -(-n.size // (width - 1))
  padded = np.resize(n, rows * (width - 1)).reshape(rows, width - 1)
  side = max(rows, width)
  # Square so that rank-1 scales are 4 too: 4.0 on the diagonal of every row/column.
  x = np.zeros((side, side), np.float32)
  x[:rows, 1:width] = padded * np.float32(4.0)
  np.fill_diagonal(x, 4.0)
  if not spec.signed:
    x = np.abs(x)
  q = _jit_quantize(spec)(jnp.asarray(x))
  norm, block = parse_norm(name)
  scale = reference_scale(x, norm, block)
  assert np.all(scale == 4.0)
  got = _codes(q, spec, x.shape)
  want = argmin_codes(x.astype(np.float64) / 4.0, table)
  np.testing.assert_array_equal(table[got], table[want])
  if not has_duplicates(table):
    np.testing.assert_array_equal(got, want)


# --- Stochastic rounding. ----------------------------------------------------

def test_stochastic_requires_key():
  x = jnp.ones((4, 128))
  for spec in (QuantSpec("block", "DE", signed=True, block_size=128, stochastic=True),
               QuantSpec.parse("Rank-1/Linear", stochastic=True)):
    with pytest.raises(ValueError, match="key"):
      optax4bit.quantize(x, spec)


def _neighbours(table, v):
  t = table.astype(np.float64)
  k = np.searchsorted(t, v, side="right") - 1
  return t[k], t[k + 1]


DRAWS = 100_000


@pytest.mark.parametrize("name,bits,values", [
    ("B128/DE", 4, [-0.8, -0.5, -0.05, 0.001, 0.3, 0.95]),
    ("B128/DE-0", 4, [0.005, 0.1, 0.5, 0.97]),
    ("Tensor/Linear", 4, [0.07, 0.3, 0.51, 0.99]),
    ("Rank-1/Linear", 4, [0.2, 0.8]),
    ("B256/DE", 8, [-0.5, 0.0123, 0.77]),
])
def test_stochastic_rounding_is_unbiased(name, bits, values):
  spec = QuantSpec.parse(name, bits=bits, stochastic=True)
  table = reference_table(spec.mapping, bits, spec.signed)
  width = spec.block_size or 128
  per_row = width - 1
  rows = -(-DRAWS // per_row)
  # Every row (and, for rank-1, column 0) holds the scale 1.0 in column 0,
  # so x / scale is x; each value fills `rows` rows.
  x = np.zeros((rows * len(values), width), np.float32)
  x[:, 0] = 1.0
  x[:, 1:] = np.repeat(np.float32(values), rows)[:, None]
  if spec.normalization == "rank1":
    x[0, :] = 1.0
  dq = jax.jit(lambda x, k: optax4bit.dequantize(optax4bit.quantize(x, spec, key=k)))(
      jnp.asarray(x), jax.random.key(0))
  dq = np.asarray(dq, np.float64)
  for i, v in enumerate(values):
    v = float(np.float32(v))
    block = dq[i * rows:(i + 1) * rows, 1:]
    if spec.normalization == "rank1" and i == 0:
      block = block[1:]
    lo, hi = _neighbours(table, v)
    assert lo < v < hi
    assert np.all((block == np.float32(lo)) | (block == np.float32(hi))), (v, np.unique(block))
    p = (v - lo) / (hi - lo)
    se = (hi - lo) * np.sqrt(p * (1 - p) / block.size)
    assert abs(block.mean() - v) <= 3 * se, (v, block.mean(), se)
    assert block.size >= DRAWS - per_row


def test_stochastic_is_reproducible_and_keyed():
  spec = QuantSpec.parse("B128/DE", stochastic=True)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32))
  f = jax.jit(lambda x, k: optax4bit.quantize(x, spec, key=k).codes)
  a = np.asarray(f(x, jax.random.key(1)))
  np.testing.assert_array_equal(a, np.asarray(f(x, jax.random.key(1))))
  assert not np.array_equal(a, np.asarray(f(x, jax.random.key(2))))


def test_stochastic_rounds_to_neighbours_only():
  """Each stochastic code is one of the two table entries around x / scale."""
  spec = QuantSpec.parse("B128/DE", stochastic=True)
  table = reference_table("DE", 4, True).astype(np.float64)
  x = np.random.default_rng(1).uniform(-1, 1, (32, 128)).astype(np.float32)
  x[:, 0] = 1.0
  q = jax.jit(lambda x, k: optax4bit.quantize(x, spec, key=k))(jnp.asarray(x),
                                                              jax.random.key(3))
  vals = table[unpack_nibbles(q.codes, 128)]
  n = np.clip(x.astype(np.float64), table[0], table[-1])
  k = np.clip(np.searchsorted(table, n, side="right") - 1, 0, 14)
  assert np.all((vals == table[k]) | (vals == table[k + 1]))


@pytest.mark.parametrize("mapping,bits,signed", [("NF", 4, True), ("DE", 4, True),
                                                 ("SqrtDE-0", 4, False), ("SqrtLinear", 4, False)])
def test_bracket_is_the_entries_either_side(mapping, bits, signed):
  """`maps.bracket` (the search stochastic rounding uses) against numpy's
  searchsorted, on the entries themselves, their neighbours and random values."""
  table = maps.qmap(mapping, bits, signed)
  rng = np.random.default_rng(0)
  x = np.concatenate([table, np.nextafter(table, np.float32(-np.inf)),
                      np.nextafter(table, np.float32(np.inf)),
                      rng.uniform(table[0], table[-1], 4096).astype(np.float32)])
  x = np.clip(x, table[0], table[-1]).astype(np.float32)
  x[np.abs(x) < np.finfo(np.float32).tiny] = 0  # XLA flushes subnormals (nextafter(0))
  lower, low, high = jax.jit(lambda v: maps.bracket(v, table))(x)
  expected = np.searchsorted(table, x, side="right") - 1
  np.testing.assert_array_equal(np.asarray(lower), expected)
  np.testing.assert_array_equal(np.asarray(low), table[expected])
  np.testing.assert_array_equal(np.asarray(high), table[np.minimum(expected + 1, table.size - 1)])
