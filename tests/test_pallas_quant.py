"""Standalone Pallas quantize/dequantize kernels against the jnp reference.

Interpret mode runs the kernels on the CPU; every comparison here is bit for
bit (the quantizers involve no arithmetic that XLA could contract or
re-associate). The CUDA lowering tests export the kernels for ``cuda`` with
``jax.export`` on this CPU-only machine, so Pallas/Triton lowering errors fail
CI without a GPU (errors inside Triton's own compiler passes only show on a
GPU).
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax4bit
from conftest import export_cuda
from optax4bit import pallas
from optax4bit.pallas import _codebook, _geometry, _math
from optax4bit.quant import maps
from optax4bit.quant.spec import QuantSpec, as_spec

# Small tiles so that tiny shapes still run several programs along both grid
# axes (and ragged edge tiles).
TILE = 64


def _spec(name: str, stochastic: bool = False) -> QuantSpec:
  spec = as_spec(name, signed=None if name.endswith(("/DE", "/NF")) else False)
  return QuantSpec.parse(name, signed=spec.signed, stochastic=True) if stochastic else spec


def _data(shape, dtype, signed, seed=0):
  x = np.random.RandomState(seed).standard_normal(shape) * 3
  x = x if signed else np.abs(x)
  return jnp.asarray(x, dtype)


def _assert_same(q, ref):
  assert q.spec == ref.spec and q.shape == ref.shape and q.dtype == ref.dtype
  np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(ref.codes))
  assert len(q.scales) == len(ref.scales)
  for a, b in zip(q.scales, ref.scales):
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# (shape, spec): ragged last blocks, odd last axes, blocks of several short
# rows (axis -1 <= half a block), 1-D (rank-1 falls back to B128), 3-D rank-1,
# tensor scales, blocks larger than the tile segment.
CASES = [
    ((5, 301), "B128/DE"),
    ((3, 4, 20), "B128/DE"),
    ((257,), "Rank-1/Linear"),
    ((5, 301), "Rank-1/Linear"),
    ((3, 5, 70), "Rank-1/DE-0"),
    ((6, 33), "Tensor/Linear"),
    ((4, 300), "B256/DE"),
    # The default recipe's maps (nearest rounding here; stochastic below).
    ((5, 301), "B128/NF"),
    ((3, 5, 70), "Rank-1/SqrtDE-0"),
    pytest.param((257,), "Rank-1/SqrtDE-0", marks=pytest.mark.slow),
    # Tiles that cover the leaf exactly: no masks, and the stats pass on 4x tiles.
    ((8, 256), "Rank-1/SqrtDE-0"),
]

KEY = jax.random.key(7)

# Stochastic rounding: local blocks (one pass), blocks of several short rows
# (two passes), rank-1 (2-D, 3-D and 1-D) and tensor scales (two passes).
STOCHASTIC_CASES = [
    ((5, 301), "B128/NF"),
    ((3, 4, 20), "B128/NF"),
    pytest.param((4, 300), "B256/DE", marks=pytest.mark.slow),
    ((5, 301), "Rank-1/SqrtDE-0"),
    ((8, 256), "Rank-1/SqrtDE-0"),  # exact tiles (see CASES)
    pytest.param((3, 5, 70), "Rank-1/DE-0", marks=pytest.mark.slow),
    pytest.param((257,), "Rank-1/SqrtDE-0", marks=pytest.mark.slow),
    pytest.param((6, 33), "Tensor/Linear", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,name", CASES)
def test_quantize_matches_reference(shape, name):
  spec = _spec(name)
  x = _data(shape, jnp.float32, spec.signed)
  q = jax.jit(lambda x: pallas.quantize(x, spec, interpret=True, tile_bytes=TILE))(x)
  _assert_same(q, optax4bit.quantize(x, spec))


@pytest.mark.parametrize("shape,name", STOCHASTIC_CASES)
def test_quantize_stochastic_matches_reference(shape, name):
  """The kernels draw `maps.hashed_uniform`'s numbers for each element: the
  same codes as `optax4bit.quantize` with the same key, bit for bit."""
  spec = _spec(name, stochastic=True)
  x = _data(shape, jnp.float32, spec.signed)
  q = jax.jit(lambda x, k: pallas.quantize(x, spec, key=k, interpret=True,
                                           tile_bytes=TILE))(x, KEY)
  ref = optax4bit.quantize(x, spec, key=KEY)
  _assert_same(q, ref)
  # The draws matter: another key gives other codes.
  assert (q.codes != optax4bit.quantize(x, spec, key=jax.random.key(8)).codes).any()


def test_quantize_stochastic_multi_row_tiles_and_edge_values():
  """Tiles of 4 rows; zero rows, non-finite values, values on table entries
  (round-up probability 0) and bfloat16 input."""
  x = np.array(_data((5, 301), jnp.float32, True))
  x[1] = 0.0
  x[2, 3], x[2, 200], x[3, 7] = np.inf, -np.inf, np.nan
  x[4, :16] = optax4bit.qmap("NF") * np.abs(x[4]).max()
  for name in ("B128/NF", "Rank-1/SqrtDE-0"):
    spec = _spec(name, stochastic=True)
    for dtype in (jnp.float32, jnp.bfloat16):
      xs = jnp.asarray(x if spec.signed else np.abs(x), dtype)
      _assert_same(pallas.quantize(xs, spec, key=KEY, interpret=True, tile_bytes=256),
                   optax4bit.quantize(xs, spec, key=KEY))


def _gather_row(table, index):
  row = jnp.asarray(table)[index]
  return tuple(row[..., k] for k in range(row.shape[-1]))


_TABLES = [("NF", True), ("DE", True), ("DE", False), ("DE-0", False), ("SqrtDE-0", False),
           ("SqrtLinear", False), ("Linear", False)]


def _bucket_edges(bucket) -> np.ndarray:
  """Both ends of every bucket, as float32 (NaN buckets left out)."""
  width = np.uint32(1 << bucket.shift)
  low = np.arange(bucket.entries.shape[0], dtype=np.uint32) * width
  ends = np.concatenate([low, low + (width - np.uint32(1))]).view(np.float32)
  return ends[~np.isnan(ends)]


@pytest.mark.parametrize("mapping,signed", _TABLES)
def test_bucket_lookup_counts_exactly_as_the_reference_search(mapping, signed):
  """The kernels' table lookup by a float's bits (`_codebook.BucketTable`)
  against `maps.count_above` (nearest) and `maps.bracket` of the clipped
  value (stochastic). Both counts are step functions of ``x`` that can only
  change at a threshold or a bucket edge, so agreeing on every bucket's two
  ends and on each threshold and its neighbours is agreeing on every float."""
  table = optax4bit.qmap(mapping, 4, signed)
  mids = maps.midpoint_thresholds(mapping, 4, signed)
  for inclusive, thresholds in ((False, mids), (True, table[1:])):
    bucket = _codebook.bucket_table(mapping, signed, inclusive)
    near = np.concatenate([thresholds, np.nextafter(thresholds, np.float32(np.inf)),
                           np.nextafter(thresholds, np.float32(-np.inf))])
    x = np.concatenate([_bucket_edges(bucket), near, -near,
                        np.float32([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40])])
    x = jnp.asarray(x.astype(np.float32))
    got = _math.count_below(x, bucket, bucket.entries, _gather_row)
    if inclusive:
      want, _, _ = maps.bracket(jnp.clip(x, table[0], table[-1]), table)
    else:
      want = maps.count_above(x, mids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mapping,signed", _TABLES)
def test_stochastic_rounding_gaps_suit_the_unchecked_division(mapping, signed):
  """`KernelMath.probability` divides by these gaps with the fast path of
  ``div.rn.f32`` only: they must be normal numbers at most 1, 0 or inf."""
  negated_scaled, gap, reciprocal = _codebook.entry_gaps(
      as_spec(f"B128/{mapping}", signed=signed)).T
  np.testing.assert_array_equal(negated_scaled / np.float32(-(2.0**24)),
                                optax4bit.qmap(mapping, 4, signed))
  assert gap[-1] == np.inf and reciprocal[-1] == 0
  for g, r in zip(gap[:-1], reciprocal[:-1]):
    if g != 0:
      assert r == _round32(1 / fractions.Fraction(float(g))), (g, r)
  finite = gap[:-1]
  assert np.all((finite == 0) | ((finite >= np.finfo(np.float32).tiny) & (finite <= 1)))


def _round32(exact) -> np.float32:
  """``exact`` (a Fraction) rounded to the nearest float32, ties to even."""
  guess = np.float32(float(exact))
  candidates = [np.nextafter(guess, np.float32(-np.inf)), guess,
                np.nextafter(guess, np.float32(np.inf))]
  return min(candidates, key=lambda c: (abs(fractions.Fraction(float(c)) - exact),
                                        int(np.array(c).view(np.uint32)) & 1))


def _fma32(a, b, c) -> np.float32:
  frac = lambda x: fractions.Fraction(float(x))
  return _round32(frac(a) * frac(b) + frac(c))


def test_division_by_reciprocal_is_correctly_rounded_for_stochastic_rounding():
  """`KernelMath.probability`'s PTX, emulated with exact fused multiply-adds:
  the quotient of ``div.rn`` for every gap of every 4-bit map and
  differences ``d`` spread over ``[0, gap]`` and down to 2**-40 of it, times
  2**24 as `_math.encode_stochastic` scales them, so the decisions are too."""
  rng = np.random.RandomState(3)
  for mapping, signed in _TABLES:
    _, gaps, reciprocals = _codebook.entry_gaps(as_spec(f"B128/{mapping}", signed=signed))[:-1].T
    for gap, r in zip(gaps, reciprocals):
      if gap == 0:
        continue
      ds = gap * np.concatenate([rng.uniform(0, 1, 48), 2.0 ** -rng.uniform(0, 40, 16), [1.0]])
      ds = ds * 2.0**24
      for d in ds.astype(np.float32):
        q = _fma32(d, r, 0)
        q = _fma32(r, _fma32(-gap, q, d), q)
        assert q == _round32(fractions.Fraction(float(d)) / fractions.Fraction(float(gap))), (
            mapping, d, gap)


def test_kernel_encoders_match_maps():
  """The kernels' encoders (`optax4bit.pallas._math`, table lookups, no clip)
  against `maps.encode_nearest` / `maps.encode_stochastic`, with
  `maps.uniform_of_index` and the kernels' scaled draws those of
  `maps.hashed_uniform`."""
  seed = maps.rounding_seed(KEY)
  u = maps.hashed_uniform(seed, (7, 300), (3,), (10, 300))  # rows 3..9
  index = (3 * 300 + jnp.arange(7 * 300, dtype=jnp.uint32)).reshape(7, 300)
  np.testing.assert_array_equal(np.asarray(maps.uniform_of_index(seed, index)), np.asarray(u))
  scaled_u = maps.scaled_uniform_of_folded_index(maps.fold16(index), maps.fold16(seed))
  np.testing.assert_array_equal(np.asarray(scaled_u), np.asarray(u) * np.float32(2.0**24))
  rng = np.random.RandomState(0)
  for mapping, signed in _TABLES:
    table = optax4bit.qmap(mapping, 4, signed)
    n = rng.uniform(-1.2 if signed else -0.1, 1.2, (7, 300)).astype(np.float32)
    n[0, :16] = table  # exactly on entries
    n[1, :16] = np.nextafter(table, np.float32(2))
    n[2, :16] = np.nextafter(table, np.float32(-2))
    n[3, :6] = [0.0, -0.0, np.inf, -np.inf, table[0] / 2, -1e-40]
    # Quiet NaNs of both signs (x86's default NaN, NVIDIA's canonical one, a
    # payload) code as 0 does; +-inf share a bucket with no quiet NaN.
    n[3, 6:10] = np.uint32([0xFFC00000, 0x7FFFFFFF, 0x7FC00001, 0xFFFFFFFF]).view(np.float32)
    n = jnp.asarray(n)
    reference_n = jnp.where(jnp.isnan(n), 0.0, n)
    bracket = _codebook.bucket_table(mapping, signed, inclusive=True)
    np.testing.assert_array_equal(
        np.asarray(_math.encode_stochastic(n, scaled_u, bracket, bracket.entries,
                                           _codebook.entry_gaps(as_spec(f"B128/{mapping}",
                                                                        signed=signed)),
                                           _gather_row)),
        np.asarray(maps.encode_stochastic(reference_n, u, mapping, 4, signed)))
    spec = as_spec(f"B128/{mapping}", signed=signed)
    nearest = _codebook.bucket_table(mapping, signed, inclusive=False)
    np.testing.assert_array_equal(
        np.asarray(_math.encode_nearest(n, spec, nearest, nearest.entries, _gather_row,
                                        _math.KernelMath(triton=False))),
        np.asarray(maps.encode_nearest(reference_n, mapping, 4, signed)))
    codes = jnp.arange(256, dtype=jnp.int32)
    even, odd = _math.decode_bytes(codes, _codebook.decode_pairs(spec), _gather_row)
    np.testing.assert_array_equal(np.asarray(even), table[np.arange(256) & 15])
    np.testing.assert_array_equal(np.asarray(odd), table[np.arange(256) >> 4])


def test_kernel_stall_rule_matches_the_reference():
  """`_math.encode_stochastic` with stored codes (``stall_only``): the
  stochastic code where the nearest code is the stored one, the nearest code
  elsewhere, as `optax4bit.quant.array.encode`, bit for bit for every 4-bit
  map; on and beside every nearest threshold (where the kernel's nearest
  code, the bracket's lower code plus one comparison, could go wrong),
  entries, specials and NaNs, with stored codes equal to the nearest ones for
  half the elements (both branches)."""
  seed = maps.rounding_seed(KEY)
  rng = np.random.RandomState(1)
  for mapping, signed in _TABLES:
    spec = QuantSpec.parse(f"B128/{mapping}", signed=signed, stochastic=True, stall_only=True)
    table = optax4bit.qmap(mapping, 4, signed)
    mids = maps.midpoint_thresholds(mapping, 4, signed)
    edges = [mids, np.nextafter(mids, np.float32(2)), np.nextafter(mids, np.float32(-2)),
             table, np.nextafter(table, np.float32(2)), np.nextafter(table, np.float32(-2)),
             np.float32([0.0, -0.0, np.inf, -np.inf, table[0] / 2, -1e-40, 1e-40]),
             np.uint32([0xFFC00000, 0x7FFFFFFF, 0x7FC00001]).view(np.float32)]
    n = np.concatenate(edges + [rng.uniform(-1.2 if signed else -0.1, 1.2, 512)])
    n = jnp.asarray(np.resize(n.astype(np.float32), (8, 128)))
    u = maps.hashed_uniform(seed, n.shape)
    index = jnp.arange(n.size, dtype=jnp.uint32).reshape(n.shape)
    scaled_u = maps.scaled_uniform_of_folded_index(maps.fold16(index), maps.fold16(seed))
    reference_n = jnp.where(jnp.isnan(n), 0.0, n)
    nearest = maps.encode_nearest(reference_n, mapping, 4, signed).astype(jnp.int32)
    stochastic = maps.encode_stochastic(reference_n, u, mapping, 4, signed).astype(jnp.int32)
    stored = jnp.where(jnp.asarray(rng.rand(*n.shape) < 0.5), nearest,
                       jnp.asarray(rng.randint(0, 16, n.shape), jnp.int32))
    want = jnp.where(nearest == stored, stochastic, nearest)
    bracket = _codebook.bucket_table(mapping, signed, inclusive=True)
    got = _math.encode_stochastic(n, scaled_u, bracket, bracket.entries,
                                  _codebook.entry_gaps(spec), _gather_row, stored=stored)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=mapping)
    assert (nearest != stochastic).any() and (nearest != stored).any(), mapping


def test_quantize_stall_only_rounds_stochastically():
  """`pallas.quantize` has no stored codes: a ``stall_only`` spec rounds every
  element stochastically, as `optax4bit.quantize` does."""
  spec = QuantSpec.parse("B128/NF", stochastic=True, stall_only=True)
  x = _data((5, 301), jnp.float32, True)
  q = pallas.quantize(x, spec, key=KEY, interpret=True, tile_bytes=TILE)
  _assert_same(q, optax4bit.quantize(x, spec, key=KEY))
  np.testing.assert_array_equal(
      np.asarray(q.codes),
      np.asarray(optax4bit.quantize(x, spec.replace(stall_only=False), key=KEY).codes))


def _linear_test_values() -> np.ndarray:
  """float32 around every Linear entry and midpoint, the specials, and a
  spread over [-2, 2]."""
  points = np.concatenate([(np.arange(16) + 1) / 16, (np.arange(17) + 0.5) / 16]).astype(np.float32)
  near = [points, np.nextafter(points, np.float32(2)), np.nextafter(points, np.float32(-2))]
  specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-39, np.inf, -np.inf, np.nan, 3e38, -3e38,
                       1.0 + 2**-23, 2**-24], np.float32)
  spread = np.random.RandomState(5).uniform(-2, 2, 4096).astype(np.float32)
  return np.concatenate(near + [specials, spread])


def test_linear_code_conversion_matches_maps():
  """`KernelMath.linear_code`'s GPU path, ``min(cvt.rpi.u32.f32(n * 16 -
  1.5), 15)``, emulated with the PTX ISA's rules for a float-to-integer
  ``cvt`` (round up; clamp to the destination's range; NaN to 0), against
  `maps.encode_nearest` of NaN-as-0 values (what `normalized` gives it), and
  the interpret path against the same."""
  n = _linear_test_values()
  with np.errstate(invalid="ignore", over="ignore"):
    scaled = n * np.float32(16) - np.float32(1.5)  # n * 16 is exact
    converted = np.where(np.isnan(scaled), 0, np.clip(np.ceil(scaled.astype(np.float64)), 0,
                                                      2.0**32 - 1))
  emulated = np.minimum(converted, 15).astype(np.int64)
  reference = np.asarray(maps.encode_nearest(jnp.asarray(np.where(np.isnan(n), 0, n)), "Linear",
                                             4, False)).astype(np.int64)
  np.testing.assert_array_equal(emulated, reference)
  interpret = _math.KernelMath(triton=False).linear_code(jnp.asarray(n), 4)
  np.testing.assert_array_equal(np.asarray(interpret), reference)


def test_finite_abs_keys_give_the_largest_finite_magnitude():
  """`_math.finite_abs_key`'s unsigned maximum, read back by `abs_of_key`,
  is the largest finite ``|x|`` (0 where none), per row and over all, with
  signed zeros, subnormals, infinities, NaNs and masks."""
  rng = np.random.RandomState(11)
  x = (rng.standard_normal((6, 64)) * 10.0 ** rng.uniform(-40, 38, (6, 64))).astype(np.float32)
  x[0, :5] = [np.inf, -np.inf, np.nan, -np.nan, -3e38]
  x[1] = np.where(rng.uniform(size=64) < 0.5, np.inf, np.nan)  # nothing finite
  x[2] = -0.0
  x[3, :] = np.float32(-1e-45) * np.arange(64)  # subnormals only
  mask = rng.uniform(size=(6, 64)) < 0.7
  for m in (None, mask):
    keys = _math.finite_abs_key(jnp.asarray(x), None if m is None else jnp.asarray(m))
    keep = np.isfinite(x) & (True if m is None else m)
    want = np.where(keep, np.abs(x), np.float32(0))
    for axis in (0, 1, None):
      got = np.asarray(_math.abs_of_key(keys.max(axis=axis)))
      # Bits, not values: no flush of subnormals on either side.
      np.testing.assert_array_equal(got.view(np.uint32), want.max(axis=axis).view(np.uint32))


@pytest.mark.parametrize("name", ["B128/DE", "Rank-1/Linear"])
def test_quantize_multi_row_tiles(name):
  """Tiles of 4 rows (ragged second row tile of a 5-row leaf)."""
  spec = _spec(name)
  x = _data((5, 301), jnp.float32, spec.signed)
  _assert_same(pallas.quantize(x, spec, interpret=True, tile_bytes=256),
               optax4bit.quantize(x, spec))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_quantize_half_precision_input(dtype):
  x = _data((3, 130), dtype, True)
  q = pallas.quantize(x, "B128/DE", interpret=True, tile_bytes=TILE)
  _assert_same(q, optax4bit.quantize(x, "B128/DE"))


def test_quantize_zero_blocks_and_non_finite():
  x = np.array(_data((4, 256), jnp.float32, True))
  x[1] = 0.0  # an all-zero row: scale 0, dequantizes to exact zeros
  x[2, 3], x[2, 200], x[3, 7] = np.inf, -np.inf, np.nan
  x = jnp.asarray(x)
  for name in ("B128/DE", "Rank-1/Linear"):
    spec = _spec(name)
    xs = x if spec.signed else jnp.abs(x)
    q = pallas.quantize(xs, spec, interpret=True, tile_bytes=TILE)
    _assert_same(q, optax4bit.quantize(xs, spec))


def test_quantize_extreme_scales():
  """Scales above 2**126 (reciprocal subnormal) and tiny scales."""
  x = np.array(_data((4, 256), jnp.float32, True))
  x[0] *= 1e37
  x[1] *= 1e-36
  x = jnp.asarray(x)
  for name in ("B128/DE", "Rank-1/Linear"):
    spec = _spec(name)
    xs = x if spec.signed else jnp.abs(x)
    _assert_same(pallas.quantize(xs, spec, interpret=True, tile_bytes=TILE),
                 optax4bit.quantize(xs, spec))


@pytest.mark.parametrize("shape,name", [((5, 301), "B128/DE"), ((3, 4, 20), "B128/DE"),
                                        ((3, 5, 70), "Rank-1/Linear"), ((257,), "Rank-1/DE-0"),
                                        ((5, 301), "B128/NF"), ((3, 5, 70), "Rank-1/SqrtDE-0")])
def test_dequantize_matches_reference(shape, name):
  spec = _spec(name, stochastic=name.endswith("/NF"))  # as the default recipe stores it
  q = optax4bit.quantize(_data(shape, jnp.float32, spec.signed), spec, key=KEY)
  for dtype in (jnp.float32, jnp.bfloat16):
    out = pallas.dequantize(q, dtype, interpret=True, tile_bytes=TILE)
    assert out.dtype == dtype and out.shape == shape
    np.testing.assert_array_equal(np.asarray(out), np.asarray(optax4bit.dequantize(q, dtype)))


def test_unsupported_specs_raise():
  x = jnp.ones((4, 256))
  with pytest.raises(ValueError, match="4-bit only"):
    pallas.quantize(x, QuantSpec("block", "DE", bits=8, signed=True, block_size=256),
                    interpret=True)
  with pytest.raises(ValueError, match="stochastic.*key"):  # as optax4bit.quantize
    pallas.quantize(x, QuantSpec.parse("B128/DE", stochastic=True), interpret=True)
  with pytest.raises(ValueError, match="floating-point"):
    pallas.quantize(jnp.ones((4, 4), jnp.int32), "B128/DE", interpret=True)
  with pytest.raises(ValueError, match="QuantizedArray"):
    pallas.dequantize(x, interpret=True)


def test_tiling_is_power_of_two_and_covers_the_leaf():
  for shape, names in [((5, 301), ["B128/DE", "Rank-1/Linear"]), ((257,), ["B128/DE"]),
                       ((3, 4, 20), ["B128/DE"]), ((7, 1), ["Rank-1/Linear"]),
                       ((1000, 4096), ["B2048/DE", "B128/Linear"])]:
    specs = [_spec(n) for n in names]
    geo = _geometry.geometry(shape, specs)
    for n in geo.tile:
      assert n & (n - 1) == 0
    rows_covered = geo.grid[0] * geo.rows_per_tile
    bytes_covered = geo.grid[1] * geo.segs_per_tile * geo.seg
    assert rows_covered >= geo.rows and bytes_covered >= geo.half
    assert geo.rows_per_tile * geo.segs_per_tile * geo.seg <= _geometry.DEFAULT_TILE_BYTES
  # A large matrix: 16 rows per tile, so the rank-1 column maxima of pass 1
  # take 4 / 16 bytes per element, not a leaf-sized float32 buffer.
  geo = _geometry.geometry((4096, 4096), [_spec("B128/DE"), _spec("Rank-1/Linear")])
  assert geo.tile == (16, 1, 64)


# ----------------------------------------------------------------------------
# CUDA lowering (no GPU needed).


def _triton_calls(exported) -> int:
  return exported.mlir_module().count("stablehlo.custom_call @__gpu$xla.gpu.triton")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name,passes", [("B128/DE", 1), ("Rank-1/Linear", 2),
                                         ("B2048/DE", 2), ("Tensor/Linear", 2),
                                         ("B128/NF", 1), ("Rank-1/SqrtDE-0", 2)])
def test_quantize_lowers_for_cuda(name, passes, dtype):
  x = jnp.zeros((5, 301), dtype)
  exported = export_cuda(lambda x: pallas.quantize(x, _spec(name)), x)
  assert _triton_calls(exported) == passes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name,passes", [("B128/NF", 1), ("Rank-1/SqrtDE-0", 2),
                                         ("B2048/DE", 2)])
def test_quantize_stochastic_lowers_for_cuda(name, passes, dtype):
  x = jnp.zeros((5, 301), dtype)
  spec = _spec(name, stochastic=True)
  exported = export_cuda(lambda x, k: pallas.quantize(x, spec, key=k), x, KEY)
  assert _triton_calls(exported) == passes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_lowers_for_cuda(dtype):
  for shape, name in [((5, 301), "B128/DE"), ((3, 4, 20), "B128/DE"), ((5, 301), "Rank-1/Linear"),
                      ((5, 301), "B128/NF"), ((5, 301), "Rank-1/SqrtDE-0")]:
    q = optax4bit.quantize(jnp.ones(shape), _spec(name))
    assert _triton_calls(export_cuda(lambda q: pallas.dequantize(q, dtype), q)) == 1
