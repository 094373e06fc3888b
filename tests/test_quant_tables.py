"""Quantization tables (qmap) pinned to SPEC.md, and QuantSpec parsing."""

import numpy as np
import pytest

import optax4bit
from optax4bit import QuantSpec, qmap
from conftest import (SPEC_DE0_4BIT, SPEC_DE_SIGNED_4BIT, SPEC_DE_UNSIGNED_4BIT,
                      SPEC_LINEAR_4BIT, de_reference)


# --- 4-bit tables: the literal SPEC numbers. ---------------------------------

@pytest.mark.parametrize("mapping,signed,expected", [
    ("DE", True, SPEC_DE_SIGNED_4BIT),
    ("DE", False, SPEC_DE_UNSIGNED_4BIT),
    ("DE-0", False, SPEC_DE0_4BIT),
    ("Linear", False, SPEC_LINEAR_4BIT),
])
def test_4bit_tables_equal_spec_literals(mapping, signed, expected):
  table = qmap(mapping, 4, signed)
  assert isinstance(table, np.ndarray)
  assert table.dtype == np.float32
  assert table.shape == (16,)
  np.testing.assert_array_equal(table, np.array(expected, dtype=np.float32))


def test_default_signedness():
  np.testing.assert_array_equal(qmap("DE"), np.float32(SPEC_DE_SIGNED_4BIT))
  np.testing.assert_array_equal(qmap("DE-0"), np.float32(SPEC_DE0_4BIT))
  np.testing.assert_array_equal(qmap("Linear"), np.float32(SPEC_LINEAR_4BIT))


def test_4bit_signed_de_is_asymmetric_with_zero():
  table = qmap("DE", 4, True)
  assert table[0] == np.float32(-0.8875) and table[-1] == 1.0
  assert -1.0 not in table
  assert np.sum(table == 0) == 1


def test_spec_literals_agree_with_the_spec_recipe():
  # Self-check of the reference: SPEC's DE recipe reproduces SPEC's literals.
  np.testing.assert_allclose(de_reference(4, True), SPEC_DE_SIGNED_4BIT, rtol=0, atol=1e-12)
  np.testing.assert_allclose(de_reference(4, False), SPEC_DE_UNSIGNED_4BIT, rtol=0, atol=1e-12)


# --- 8-bit tables. ------------------------------------------------------------

def test_8bit_de_signed():
  table = qmap("DE", 8, True)
  assert table.dtype == np.float32 and table.shape == (256,)
  assert table[0] == np.float32(-0.99296875)
  assert table[-1] == 1.0
  assert np.sum(table == 0) == 1
  np.testing.assert_array_equal(table, de_reference(8, True).astype(np.float32))


def test_8bit_de_unsigned():
  table = qmap("DE", 8, False)
  assert table.shape == (256,)
  assert table[0] == 0.0 and table[-1] == 1.0
  assert table[1] == np.float32(3.25e-7)
  np.testing.assert_array_equal(table, de_reference(8, False).astype(np.float32))


def test_8bit_de0_has_no_zero():
  table = qmap("DE-0", 8)
  assert table.shape == (256,)
  assert np.all(table > 0)
  assert table[0] == np.float32(3.25e-7)
  np.testing.assert_array_equal(table[1:], de_reference(8, False)[1:].astype(np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_linear_table(bits):
  table = qmap("Linear", bits)
  expected = (np.arange(2**bits, dtype=np.float64) + 1) / 2**bits
  np.testing.assert_array_equal(table, expected.astype(np.float32))
  assert np.all(table > 0)


@pytest.mark.parametrize("mapping,signed", [("DE", True), ("DE", False), ("DE-0", False),
                                            ("Linear", False)])
@pytest.mark.parametrize("bits", [4, 8])
def test_tables_sorted_and_in_range(mapping, bits, signed):
  table = qmap(mapping, bits, signed)
  assert table.size == 2**bits
  assert np.all(np.diff(table) >= 0)
  # Strictly increasing except DE-0's doubled smallest entry.
  assert np.sum(np.diff(table) == 0) == (1 if mapping == "DE-0" else 0)
  assert table[-1] == 1.0
  assert table[0] >= (-1.0 if signed else 0.0)
  if mapping in ("DE-0", "Linear"):
    assert np.all(table > 0), "zero-free maps must not contain 0"


def test_tables_are_read_only():
  table = qmap("DE")
  with pytest.raises(ValueError):
    table[0] = 0.5
  np.testing.assert_array_equal(qmap("DE"), np.float32(SPEC_DE_SIGNED_4BIT))


@pytest.mark.parametrize("kwargs,match", [
    (dict(mapping="Foo"), "mapping"),
    (dict(mapping="de"), "mapping"),
    (dict(mapping="DE", bits=3), "bits"),
    (dict(mapping="DE", bits=16), "bits"),
    (dict(mapping="DE", bits=True), "bits"),
    (dict(mapping="Linear", signed=True), "Linear"),
    (dict(mapping="DE-0", signed=True), "DE-0"),
])
def test_qmap_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    qmap(**kwargs)


# --- QuantSpec.parse. -------------------------------------------------------

@pytest.mark.parametrize("name,norm,mapping,signed,block", [
    ("B128/DE", "block", "DE", True, 128),
    ("B2048/DE", "block", "DE", True, 2048),
    ("B2048/DE-0", "block", "DE-0", False, 2048),
    ("B128/DE-0", "block", "DE-0", False, 128),
    ("B1/DE", "block", "DE", True, 1),
    ("Rank-1/Linear", "rank1", "Linear", False, 0),
    ("Rank-1/DE-0", "rank1", "DE-0", False, 0),
    ("Tensor/Linear", "tensor", "Linear", False, 0),
    ("Tensor/DE", "tensor", "DE", True, 0),
])
def test_parse(name, norm, mapping, signed, block):
  spec = QuantSpec.parse(name)
  assert (spec.normalization, spec.mapping, spec.signed, spec.block_size) == (
      norm, mapping, signed, block)
  assert spec.bits == 4 and spec.stochastic is False
  assert spec.name == name
  assert QuantSpec.parse(spec.name) == spec
  assert hash(spec) == hash(QuantSpec.parse(name))  # usable as static aux data


def test_parse_overrides():
  spec = QuantSpec.parse("B256/DE", bits=8)
  assert spec.bits == 8 and spec.block_size == 256 and spec.signed
  spec = QuantSpec.parse("B128/DE", signed=False)
  assert spec.mapping == "DE" and not spec.signed
  spec = QuantSpec.parse("Rank-1/Linear", signed=False, bits=8, stochastic=True)
  assert (spec.bits, spec.signed, spec.stochastic) == (8, False, True)
  assert QuantSpec.parse("B128/DE", stochastic=True) == QuantSpec(
      "block", "DE", 4, True, 128, True)
  assert str(QuantSpec.parse("B128/DE")) == "B128/DE (4-bit, signed)"


def test_top_level_exports():
  assert optax4bit.QuantSpec is QuantSpec
  assert optax4bit.qmap is qmap
  for name in ("QuantSpec", "QuantizedArray", "dequantize", "qmap", "quantize"):
    assert name in optax4bit.__all__


@pytest.mark.parametrize("name,kwargs,match", [
    ("B128/Foo", {}, "unknown quantizer name"),
    ("Block128/DE", {}, "unknown quantizer name"),
    ("B128", {}, "unknown quantizer name"),
    ("rank-1/Linear", {}, "unknown quantizer name"),
    ("Rank-2/Linear", {}, "unknown quantizer name"),
    ("", {}, "unknown quantizer name"),
    ("B100/DE", {}, "power of two"),
    ("B0/DE", {}, "power of two"),
    ("B384/DE", {}, "power of two"),
    ("B128/DE", dict(bits=3), "bits"),
    ("B128/DE", dict(bits=2), "bits"),
    ("B128/DE", dict(bits=16), "bits"),
    ("B128/DE-0", dict(signed=True), "DE-0"),
    ("Rank-1/Linear", dict(signed=True), "Linear"),
    ("Tensor/Linear", dict(signed=True), "signed"),
])
def test_parse_errors(name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    QuantSpec.parse(name, **kwargs)


def test_parse_rejects_non_strings():
  with pytest.raises(ValueError, match="str"):
    QuantSpec.parse(128)


@pytest.mark.parametrize("kwargs,match", [
    (dict(normalization="blocks", mapping="DE"), "normalization"),
    (dict(normalization="block", mapping="DE", block_size=100), "power of two"),
    (dict(normalization="block", mapping="DE", block_size=0), "power of two"),
    (dict(normalization="tensor", mapping="DE", block_size=128), "block_size"),
    (dict(normalization="tensor", mapping="Linear", signed=True), "signed"),
    (dict(normalization="tensor", mapping="DE", bits=5), "bits"),
])
def test_spec_constructor_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    QuantSpec(**kwargs)
