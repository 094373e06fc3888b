"""quantize / dequantize / QuantizedArray: error bound, scale layouts, packing,
dtypes, non-finite inputs, jit and pytree behaviour.

Scales are checked against numpy maxima written from SPEC.md (conftest), the
error bound against the reference tables' gaps, packing against a numpy nibble
unpacker.
"""

import functools
import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax4bit import QuantizedArray, QuantSpec, dequantize, quantize
from optax4bit.quant import array as qarray
from optax4bit.quant import packing
from conftest import (PRESETS, argmin_codes, parse_norm, reference_scale,
                      reference_scale_shape, reference_table, unpack_nibbles,
                      worst_case_error_fraction)

# XLA's CPU backend flushes subnormals to zero; allow an error of that size.
SUBNORMAL_SLACK = 2.0**-125


@functools.lru_cache(maxsize=None)
def _jit_round_trip(spec):
  def f(x):
    q = quantize(x, spec)
    return q, dequantize(q)
  return jax.jit(f)


_jit_dequantize = jax.jit(dequantize, static_argnums=1)


def _spec(name, bits=4, **kw):
  return QuantSpec.parse(name, bits=bits, **kw)


def _assert_error_bound(x, dq, spec):
  """|x - dq| <= scale * worst-case fraction elementwise (finite x only)."""
  norm, block = parse_norm(spec.name)
  table = reference_table(spec.mapping, spec.bits, spec.signed)
  frac = worst_case_error_fraction(table, spec.signed)
  scale = reference_scale(x, norm, block)
  x64 = np.asarray(x, np.float64)
  dq64 = np.asarray(dq, np.float64)
  assert not np.isnan(dq64).any()
  finite = np.isfinite(x64)
  err = np.abs(x64 - dq64)[finite]
  bound = (scale * (frac + 2.0**-20))[finite] + SUBNORMAL_SLACK
  worst = np.argmax(err - bound) if err.size else 0
  assert np.all(err <= bound), (
      f"{spec}: |x - dq| = {err[worst]!r} > bound {bound[worst]!r} at x = "
      f"{x64[finite][worst]!r}, scale {scale[finite][worst]!r}")


def test_worst_case_fractions_from_spec_tables():
  # Hand-checked from the SPEC tables: signed DE's largest gap (0.225) and its
  # uncovered end [-1, -0.8875] both give 0.1125; DE-0's largest gap 0.1125
  # gives 0.05625; Linear leaves [0, 1/16) uncovered: 1/16 (not half a gap).
  assert worst_case_error_fraction(reference_table("DE", 4, True), True) == pytest.approx(0.1125)
  assert worst_case_error_fraction(reference_table("DE-0", 4, False), False) == pytest.approx(
      0.05625)
  assert worst_case_error_fraction(reference_table("Linear", 4, False), False) == 1 / 16
  # Everywhere except the zero-free Linear maps the bound is half the largest gap.
  for mapping, bits, signed in (("DE", 4, True), ("DE", 4, False), ("DE-0", 4, False),
                                ("DE", 8, True), ("DE", 8, False), ("DE-0", 8, False)):
    table = reference_table(mapping, bits, signed).astype(np.float64)
    assert worst_case_error_fraction(table, signed) == np.max(np.diff(table)) / 2


# --- Error bound (hypothesis). ---------------------------------------------

BOUND_SHAPES = ((1000,), (7,), (16, 300), (40, 24), (3, 5, 130), (2, 3, 4, 64), (9, 1))


@st.composite
def _tensors(draw, signed):
  """A random tensor: normal values at a random magnitude, some zeroed rows,
  and a few hypothesis-chosen finite float32 values at random places."""
  shape = draw(st.sampled_from(BOUND_SHAPES))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  magnitude = np.float32(10.0 ** draw(st.integers(-30, 30)))
  x = (rng.standard_normal(shape) * magnitude).astype(np.float32)
  if len(shape) >= 2 and draw(st.booleans()):
    x[..., rng.integers(shape[-2]), :] = 0.0
  specials = draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                           max_size=6))
  for value in specials:
    x[tuple(rng.integers(n) for n in shape)] = value
  return x if signed else np.abs(x)


@pytest.mark.parametrize("name,bits", PRESETS)
@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(data=st.data())
def test_error_bound_property(name, bits, data):
  spec = _spec(name, bits)
  x = data.draw(_tensors(spec.signed))
  q, dq = _jit_round_trip(spec)(jnp.asarray(x))
  assert dq.shape == x.shape and dq.dtype == jnp.float32
  _assert_error_bound(x, dq, spec)


@pytest.mark.parametrize("name,bits", PRESETS)
def test_error_bound_at_the_worst_points(name, bits):
  """Values at the domain ends, midpoints of the largest gaps and huge/tiny
  magnitudes reach (but do not exceed) the bound."""
  spec = _spec(name, bits)
  table = reference_table(spec.mapping, bits, spec.signed).astype(np.float64)
  mids = (table[:-1] + table[1:]) / 2
  n = np.concatenate([mids, [0.0, 1.0], [-1.0] if spec.signed else []])
  width = 512
  x = np.zeros((width, width), np.float32)
  x[:, 1:1 + n.size] = n
  np.fill_diagonal(x, 1.0)  # scale 1 for every block, row and column
  for magnitude in (1.0, 3.0e-30, 7.0e37, 3.0e38):
    xm = (x * np.float32(magnitude)).astype(np.float32)
    _, dq = _jit_round_trip(spec)(jnp.asarray(xm))
    _assert_error_bound(xm, dq, spec)


# --- Scales and layouts. -----------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 7), (6, 300), (3, 4, 5), (2, 3, 4, 5), (2, 1, 3, 2)])
@pytest.mark.parametrize("mapping", ["Linear", "DE-0"])
def test_rank1_scales(shape, mapping):
  rng = np.random.default_rng(0)
  x = np.abs(rng.standard_normal(shape)).astype(np.float32) * np.float32(
      rng.uniform(0.1, 100, size=shape[:1] + (1,) * (len(shape) - 1)))
  q, dq = _jit_round_trip(_spec(f"Rank-1/{mapping}"))(jnp.asarray(x))
  assert len(q.scales) == x.ndim
  per_element = np.full(shape, np.inf)
  for axis, s in enumerate(q.scales):
    assert s.dtype == jnp.float32
    assert s.shape == tuple(n if k == axis else 1 for k, n in enumerate(shape))
    others = tuple(k for k in range(x.ndim) if k != axis)
    np.testing.assert_array_equal(np.asarray(s), np.abs(x).max(axis=others, keepdims=True))
    per_element = np.minimum(per_element, np.asarray(s))
  assert np.all(per_element >= np.abs(x))
  np.testing.assert_array_equal(per_element, reference_scale(x, "rank1"))
  # x / (per-element scale) <= 1: the codes are the argmin of that ratio.
  _assert_error_bound(x, dq, q.spec)


@pytest.mark.parametrize("name", ["Rank-1/Linear", "Rank-1/DE-0"])
@pytest.mark.parametrize("length", [7, 1000])
def test_rank1_1d_falls_back_to_b128(name, length):
  x = np.abs(np.random.default_rng(length).standard_normal(length)).astype(np.float32)
  q, dq = _jit_round_trip(_spec(name))(jnp.asarray(x))
  mapping = name.split("/")[1]
  q128, dq128 = _jit_round_trip(QuantSpec("block", mapping, block_size=128))(jnp.asarray(x))
  assert len(q.scales) == 1
  assert q.scales[0].shape == (math.ceil(length / 128),)
  np.testing.assert_array_equal(np.asarray(q.scales[0]), np.asarray(q128.scales[0]))
  np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(q128.codes))
  np.testing.assert_array_equal(np.asarray(dq), np.asarray(dq128))
  assert q.spec.normalization == "rank1"  # the spec is kept, only the layout falls back
  np.testing.assert_array_equal(
      np.asarray(q.scales[0]), [np.abs(x[i:i + 128]).max() for i in range(0, length, 128)])


@pytest.mark.parametrize("name,shape", [
    ("B128/DE", (6, 300)),      # ragged last block of 44
    ("B128/DE", (300,)),
    ("B128/DE", (2, 3, 129)),   # ragged last block of 1
    ("B128/DE", (4, 65)),       # just over half a block: one ragged block per row
    ("B128/DE", (4, 64)),       # half a block: 2 rows per block
    ("B128/DE", (64, 16)),      # 8 rows per block
    ("B128/DE", (10, 32)),      # 4 rows per block, ragged last group of 2 rows
    ("B128/DE", (3, 10, 32)),
    ("B128/DE", (5, 60)),       # 60 does not divide 128: blocks of 2 rows (120)
    ("B128/DE", (9, 1)),
    ("B128/DE", (1, 8)),
    ("B128/DE", (7,)),          # 1-D short: one (ragged) block
    ("B2048/DE", (6, 300)),     # 2 * 300 <= 2048: 6 rows per block
    ("B2048/DE", (64, 64)),
    ("B2048/DE", (3, 5000)),
    ("B128/DE-0", (6, 300)),
    ("B256/DE", (8, 1000)),
    ("B256/DE", (40, 24)),
])
def test_block_scales_layout(name, shape):
  bits = 8 if name.startswith("B256") else 4
  spec = _spec(name, bits)
  rng = np.random.default_rng(1)
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(
      rng.uniform(0.01, 100, size=shape))
  if not spec.signed:
    x = np.abs(x)
  q, dq = _jit_round_trip(spec)(jnp.asarray(x))
  assert len(q.scales) == 1
  s = np.asarray(q.scales[0])
  assert s.dtype == np.float32
  assert s.shape == reference_scale_shape(shape, "block", spec.block_size)
  assert s.ndim == x.ndim
  # Expand the stored scales with the documented layout and compare.
  expected = reference_scale(x, "block", spec.block_size)
  if len(shape) >= 2 and 2 * shape[-1] <= spec.block_size:
    g = spec.block_size // shape[-1]
    expanded = np.repeat(s, g, axis=-2)[..., :shape[-2], :]
  else:
    expanded = np.repeat(s, spec.block_size, axis=-1)[..., :shape[-1]]
  np.testing.assert_array_equal(np.broadcast_to(expanded, shape), expected)
  _assert_error_bound(x, dq, spec)


@pytest.mark.parametrize("name,shape", [
    ("B128/DE", (64, 16)), ("B128/DE", (2, 8, 32)), ("B128/DE", (16, 64)),
    ("B128/DE", (256, 1)), ("B2048/DE", (64, 64)), ("B2048/DE", (3, 256, 8)),
])
def test_short_last_axis_is_the_papers_flat_block(name, shape):
  """When d divides B and the rows fill whole blocks, a block is B consecutive
  elements of the flattened tensor, as in the paper."""
  spec = _spec(name)
  b = spec.block_size
  x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
  q, _ = _jit_round_trip(spec)(jnp.asarray(x))
  assert q.scales[0].shape == shape[:-2] + (shape[-2] * shape[-1] // b, 1)
  np.testing.assert_array_equal(np.asarray(q.scales[0]).ravel(),
                                np.abs(x).reshape(-1, b).max(axis=1))


def test_short_tensor_is_one_block():
  """Fewer rows than a block holds: one scale for everything."""
  x = np.random.default_rng(2).standard_normal((12, 1)).astype(np.float32)
  q, _ = _jit_round_trip(_spec("B128/DE"))(jnp.asarray(x))
  assert q.scales[0].shape == (1, 1)
  assert float(q.scales[0][0, 0]) == np.abs(x).max()


def test_tensor_scale():
  x = np.random.default_rng(3).standard_normal((3, 50, 7)).astype(np.float32)
  q, _ = _jit_round_trip(_spec("Tensor/Linear"))(jnp.abs(jnp.asarray(x)))
  assert len(q.scales) == 1 and q.scales[0].shape == (1, 1, 1)
  assert float(q.scales[0].ravel()[0]) == np.abs(x).max()


# --- Zeros never make NaN. ---------------------------------------------------


@pytest.mark.parametrize("name,bits", PRESETS + (("B128/DE", 8), ("Tensor/DE", 4)))
def test_all_zero_rows_and_blocks_dequantize_to_zero(name, bits):
  spec = _spec(name, bits)
  rng = np.random.default_rng(4)
  x = rng.standard_normal((12, 384)).astype(np.float32)
  x[3] = 0.0            # an all-zero row
  x[:, 128:256] = 0.0   # all-zero B128 blocks and rank-1 columns
  x[7, :] = -0.0
  if not spec.signed:
    x = np.abs(x)
  for xx in (x, np.zeros_like(x), np.zeros((1000,), np.float32)):
    q, dq = _jit_round_trip(spec)(jnp.asarray(xx))
    dq = np.asarray(dq)
    assert not np.isnan(dq).any()
    scale = reference_scale(xx, *parse_norm(name))
    zero = scale == 0
    np.testing.assert_array_equal(dq[zero], 0.0)
    for s in q.scales:
      assert not np.isnan(np.asarray(s)).any()
  _assert_error_bound(x, _jit_round_trip(spec)(jnp.asarray(x))[1], spec)


@pytest.mark.parametrize("name", ["Rank-1/Linear", "B128/DE-0", "Tensor/Linear",
                                  "Rank-1/DE-0"])
def test_zero_free_maps_never_decode_nonzero_blocks_to_zero(name):
  """The zero-point problem: a zero-free map rounds tiny values up, never to 0."""
  spec = _spec(name)
  x = np.abs(np.random.default_rng(5).standard_normal((8, 256))).astype(np.float32)
  x[1:, 3] = 0.0   # zeros (not a whole row or column: those have scale 0)
  x[2, 5] = 1e-12
  x[4, 100:200] = 0.0
  _, dq = _jit_round_trip(spec)(jnp.asarray(x))
  assert np.all(np.asarray(dq) > 0)


@pytest.mark.parametrize("name,bits", PRESETS)
def test_quantized_zeros_helper_matches_quantize(name, bits):
  spec = _spec(name, bits)
  for shape in ((4, 300), (1000,)):
    z = qarray.zeros(shape, jnp.bfloat16, spec)
    q, dq = _jit_round_trip(spec)(jnp.zeros(shape, jnp.float32))
    chex.assert_trees_all_equal(z.codes, q.codes)
    chex.assert_trees_all_equal(z.scales, q.scales)
    assert z.dtype == jnp.bfloat16 and z.spec == spec and z.shape == shape
    np.testing.assert_array_equal(np.asarray(dq), 0.0)


# --- Packing. ----------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 5, 6, 127, 128, 301])
def test_pack_unpack_round_trip(length):
  codes = np.random.default_rng(length).integers(0, 16, (3, 2, length)).astype(np.uint8)
  packed = np.asarray(jax.jit(packing.pack, static_argnums=1)(jnp.asarray(codes), 4))
  assert packed.dtype == np.uint8
  assert packed.shape == (3, 2, (length + 1) // 2)
  assert packing.packed_length(length, 4) == (length + 1) // 2
  np.testing.assert_array_equal(unpack_nibbles(packed, length), codes)
  unpack = jax.jit(packing.unpack, static_argnums=(1, 2))
  np.testing.assert_array_equal(np.asarray(unpack(jnp.asarray(packed), length, 4)), codes)
  if length % 2:  # the padding nibble is zero
    np.testing.assert_array_equal(packed[..., -1] >> 4, 0)


def test_pack_even_element_in_low_nibble():
  np.testing.assert_array_equal(packing.pack(jnp.array([[0x3, 0xA]], jnp.uint8), 4),
                                [[0xA3]])
  np.testing.assert_array_equal(packing.pack(jnp.array([1, 2, 3], jnp.uint8), 4), [0x21, 0x03])
  np.testing.assert_array_equal(packing.pack(jnp.array([15], jnp.uint8), 4), [0x0F])
  np.testing.assert_array_equal(packing.unpack(jnp.array([0xA3], jnp.uint8), 2, 4), [3, 10])


def test_pack_8bit_is_one_code_per_byte():
  codes = jnp.arange(256, dtype=jnp.uint8).reshape(2, 128)
  packed = packing.pack(codes, 8)
  assert packed.shape == (2, 128) and packing.packed_length(128, 8) == 128
  np.testing.assert_array_equal(packing.unpack(packed, 128, 8), codes)


def test_quantize_packs_even_element_in_low_nibble():
  # Signed DE, scale 1: -0.8875 -> code 0, 1.0 -> code 15, 0 -> code 7.
  f = _jit_round_trip(_spec("B128/DE"))
  q, _ = f(jnp.array([[-0.8875, 1.0, 0.0]]))
  np.testing.assert_array_equal(np.asarray(q.codes), [[0xF0, 0x07]])
  q, _ = f(jnp.array([[1.0, -0.8875, 1.0]]))
  np.testing.assert_array_equal(np.asarray(q.codes), [[0x0F, 0x0F]])


# --- Shapes, dtypes, nbytes. ---------------------------------------------------


@pytest.mark.parametrize("name,bits", PRESETS)
@pytest.mark.parametrize("shape", [(7,), (40, 24), (3, 5, 130), (2, 3, 4, 64)])
def test_shapes_and_nbytes(name, bits, shape):
  # The shapes are among BOUND_SHAPES, so compilations are shared.
  spec = _spec(name, bits)
  x = np.abs(np.random.default_rng(6).standard_normal(shape)).astype(np.float32)
  q, dq = _jit_round_trip(spec)(jnp.asarray(x))
  assert isinstance(q, QuantizedArray)
  assert q.shape == shape and q.ndim == len(shape) and q.size == x.size
  assert q.spec == spec and q.dtype == np.float32
  assert q.codes.dtype == jnp.uint8 and q.codes.ndim == len(shape)
  d = shape[-1]
  assert q.codes.shape == shape[:-1] + ((d + 1) // 2 if bits == 4 else d,)
  for s in q.scales:
    assert s.dtype == jnp.float32 and s.ndim == len(shape)
  assert dq.shape == shape
  assert q.nbytes == q.codes.size + 4 * sum(s.size for s in q.scales)
  assert q.nbytes == int(q.codes.nbytes + sum(s.nbytes for s in q.scales))
  _assert_error_bound(x, dq, spec)


@pytest.mark.parametrize("shape,spec,expected", [
    ((16, 300), "B128/DE", 16 * 150 + 4 * 16 * 3),
    ((64, 32), "Rank-1/Linear", 64 * 16 + 4 * (64 + 32)),
    ((4096, 4096), "Rank-1/Linear", 4096 * 2048 + 4 * 2 * 4096),
    ((1024, 1024), QuantSpec.parse("B256/DE", bits=8), 1024 * 1024 + 4 * 1024 * 4),
    ((1001,), "Tensor/Linear", 501 + 4),
])
def test_nbytes_hand_computed(shape, spec, expected):
  shapes = jax.eval_shape(lambda x: quantize(x, spec), jax.ShapeDtypeStruct(shape, jnp.float32))
  assert shapes.nbytes == expected


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["B128/DE", "Rank-1/Linear"])
def test_low_precision_inputs(dtype, name):
  spec = _spec(name)
  x = jnp.asarray(np.abs(np.random.default_rng(7).standard_normal((8, 200))), dtype)
  q = jax.jit(lambda x: quantize(x, spec))(x)
  q32 = jax.jit(lambda x: quantize(x, spec))(x.astype(jnp.float32))
  assert q.dtype == dtype
  chex.assert_trees_all_equal(q.codes, q32.codes)
  chex.assert_trees_all_equal(q.scales, q32.scales)
  for s in q.scales:
    assert s.dtype == jnp.float32
  dq32 = _jit_dequantize(q)
  assert dq32.dtype == jnp.float32  # the function's default
  dq = _jit_dequantize(q, dtype)
  assert dq.dtype == dtype
  assert jax.jit(lambda q: q.dequantize())(q).dtype == dtype  # the method: input dtype
  assert _jit_dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(dq), np.asarray(dq32.astype(dtype)))
  _assert_error_bound(np.asarray(x.astype(jnp.float32)), dq32, spec)


@pytest.mark.parametrize("bad,match", [
    (jnp.arange(10), "floating"),
    (jnp.float32(1.0), "axis"),
    (jnp.zeros((0, 3)), "element"),
])
def test_invalid_inputs(bad, match):
  with pytest.raises(ValueError, match=match):
    quantize(bad, "B128/DE")


def test_invalid_spec_and_q():
  with pytest.raises(ValueError, match="unknown quantizer name"):
    quantize(jnp.ones(4), "B128/XY")
  with pytest.raises(ValueError, match="QuantizedArray"):
    dequantize(jnp.ones(4))


# --- Non-finite inputs. ------------------------------------------------------


@pytest.mark.parametrize("name,bits", PRESETS)
def test_non_finite_inputs(name, bits):
  """NaN and +-inf never crash and never spread: scales are maxima over the
  finite values, finite positions keep the error bound, nothing decodes to NaN.
  Documented encodings: NaN encodes like 0 (nearest entry to 0), +inf as the
  top entry (+scale), -inf as the bottom entry (T[0] * scale), and a block /
  row / column with no finite non-zero value has scale 0 and decodes to 0."""
  spec = _spec(name, bits)
  table = reference_table(spec.mapping, bits, spec.signed).astype(np.float64)
  rng = np.random.default_rng(8)
  x = rng.standard_normal((6, 512)).astype(np.float32)
  if not spec.signed:
    x = np.abs(x)
  x[0, 5], x[1, 300], x[2, 7], x[5, 511] = np.nan, np.inf, -np.inf, np.nan
  x[3, 1:4] = [np.inf, -np.inf, np.nan]
  q, dq = _jit_round_trip(spec)(jnp.asarray(x))
  dq = np.asarray(dq, np.float64)
  assert np.all(np.isfinite(dq))
  for s in q.scales:
    assert np.all(np.isfinite(np.asarray(s)))
  norm, block = parse_norm(name)
  scale = reference_scale(x, norm, block)
  _assert_error_bound(x, dq, spec)
  zero_code = argmin_codes(0.0, table)
  nan = np.isnan(x)
  np.testing.assert_allclose(dq[nan], table[zero_code] * scale[nan], rtol=1e-7)
  pinf, ninf = x == np.inf, x == -np.inf
  np.testing.assert_allclose(dq[pinf], table[-1] * scale[pinf], rtol=1e-7)
  np.testing.assert_allclose(dq[ninf], table[0] * scale[ninf], rtol=1e-7)


def test_non_finite_only_block_has_zero_scale():
  x = np.zeros((2, 256), np.float32)
  x[0, :128] = np.nan
  x[0, 5] = np.inf
  x[1, :] = 1.0
  q, dq = _jit_round_trip(_spec("B128/DE"))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(q.scales[0]), [[0.0, 0.0], [1.0, 1.0]])
  np.testing.assert_array_equal(np.asarray(dq), [[0.0] * 256, [1.0] * 256])


# --- jit, pytree. --------------------------------------------------------------


@pytest.mark.parametrize("name,bits", [("B128/DE", 4), ("Rank-1/Linear", 4), ("B256/DE", 8)])
def test_jit_equals_no_jit(name, bits):
  spec = _spec(name, bits)
  x = np.random.default_rng(9).standard_normal((6, 300)).astype(np.float32)
  if not spec.signed:
    x = np.abs(x)
  x = jnp.asarray(x)
  q_eager = quantize(x, spec)
  q_jit = jax.jit(quantize, static_argnums=1)(x, spec)
  chex.assert_trees_all_equal(q_eager, q_jit)
  dq_eager = dequantize(q_eager)
  dq_jit = jax.jit(dequantize)(q_eager)
  chex.assert_trees_all_equal(dq_eager, dq_jit)
  assert dequantize(q_eager, jnp.bfloat16).dtype == jax.jit(
      dequantize, static_argnums=1)(q_eager, jnp.bfloat16).dtype == jnp.bfloat16


def test_pytree_leaves_and_aux_data():
  spec = _spec("Rank-1/Linear")
  x = jnp.abs(jnp.asarray(np.random.default_rng(10).standard_normal((4, 6, 8)), jnp.bfloat16))
  q, _ = _jit_round_trip(spec)(x)
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 1 + len(q.scales) == 4
  assert leaves[0] is q.codes
  assert all(isinstance(leaf, jax.Array) for leaf in leaves)  # no spec/shape/dtype leaf
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert (rebuilt.spec, rebuilt.shape, rebuilt.dtype) == (spec, (4, 6, 8), jnp.bfloat16)
  # Different specs / shapes / dtypes give different tree structures.
  assert jax.tree.structure(jax.eval_shape(lambda x: quantize(x, "Rank-1/DE-0"), x)) != treedef
  assert jax.tree.structure(
      jax.eval_shape(lambda x: quantize(x, spec), x.astype(jnp.float32))) != treedef
  # tree.map keeps the aux data.
  doubled = jax.tree.map(lambda a: a * 2 if a.dtype == jnp.float32 else a, q)
  assert isinstance(doubled, QuantizedArray) and doubled.spec == spec
  deq = jax.jit(dequantize)
  np.testing.assert_allclose(np.asarray(deq(doubled)), np.asarray(deq(q)) * 2, rtol=1e-6)
  assert "Rank-1/Linear" in repr(q) and "bfloat16" in repr(q)


def test_quantized_array_under_jit_and_eval_shape():
  spec = _spec("B128/DE")
  x = jnp.asarray(np.random.default_rng(11).standard_normal((5, 300)), jnp.float32)
  q, dq = _jit_round_trip(spec)(x)
  # Passing through jit.
  q2 = jax.jit(lambda q: q)(q)
  assert isinstance(q2, QuantizedArray)
  chex.assert_trees_all_equal(q, q2)
  chex.assert_trees_all_equal(jax.jit(lambda q: q.dequantize())(q), dq)
  # Built inside jit and returned.
  q3 = jax.jit(lambda x: quantize(x, "B128/DE"))(x)
  chex.assert_trees_all_equal(q, q3)
  # eval_shape.
  shapes = jax.eval_shape(lambda x: quantize(x, spec), x)
  assert isinstance(shapes, QuantizedArray)
  assert shapes.codes.shape == (5, 150) and shapes.codes.dtype == jnp.uint8
  assert shapes.scales[0].shape == (5, 3) and shapes.scales[0].dtype == jnp.float32
  assert shapes.spec == spec and shapes.shape == (5, 300)
  assert shapes.nbytes == q.nbytes
  out = jax.eval_shape(dequantize, q)
  assert out.shape == (5, 300) and out.dtype == jnp.float32
  # In a larger pytree, through jit with a donated-free update.
  state = {"m": q, "count": jnp.zeros([], jnp.int32)}
  new = jax.jit(lambda s: {"m": quantize(dequantize(s["m"]) * 0.5, spec),
                           "count": s["count"] + 1})(state)
  assert jax.tree.structure(new) == jax.tree.structure(state)


def test_raw_form_round_trips():
  """`QuantizedArray.to_raw` / `from_raw`: the same leaves and description."""
  q = quantize(jnp.arange(6 * 300, dtype=jnp.float32).reshape(6, 300), "Rank-1/Linear")
  codes, scales = q.to_raw()
  assert codes is q.codes and len(scales) == len(q.scales) == 2
  back = QuantizedArray.from_raw((codes, list(scales)), q.spec, [6, 300], q.dtype)
  assert (back.spec, back.shape, back.dtype) == (q.spec, q.shape, q.dtype)
  assert isinstance(back.scales, tuple)
  chex.assert_trees_all_equal(back, q)
