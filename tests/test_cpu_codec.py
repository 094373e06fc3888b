"""The C++ kernel's 4-bit codecs (`optax4bit.cpu.codec`) against the jnp
codecs of `optax4bit.quant.array`, bit for bit, on every ISA path this CPU
runs, and `quantize_state` with them against ``implementation="jnp"``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit import dispatch
from optax4bit.cpu import codec
from optax4bit.quant import array as qarray
from optax4bit.quant import maps, normalize, packing
from optax4bit.quant.spec import QuantSpec
from test_cpu_kernel import _runnable_isas, isa_path

pytestmark = [pytest.mark.skipif(not codec.registered(), reason="the CPU kernel is not built"),
              pytest.mark.usefixtures("cpu_default_device")]

SPECS = ("B128/DE", "B128/NF", QuantSpec("block", "NF", 4, signed=True, block_size=128,
                                         stochastic=True),
         QuantSpec("block", "DE", 4, signed=True, block_size=128, stochastic=True),
         "B128/DE-0", "Rank-1/Linear", "Rank-1/SqrtDE-0", "Rank-1/SqrtLinear",
         *(QuantSpec("rank1", mapping, 4, signed=False, stochastic=True)
           for mapping in ("Linear", "SqrtDE-0", "SqrtLinear")))


def _values(shape, signed, seed=0):
  """Normal values over six decades, a zero block, NaN, +-inf, a huge and a
  subnormal-scaled row."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 0, shape)).astype(np.float32)
  flat = x.reshape(-1, shape[-1])
  flat[0, :128] = 0
  flat[1, 3], flat[1, 5], flat[1, 7] = np.nan, np.inf, -np.inf
  flat[2] *= np.float32(1e30)
  flat[-1] *= np.float32(1e-36)
  return x if signed else np.abs(x)


def _bits(x):
  return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape", [(64, 256), (3, 16, 384)], ids=str)
def test_codecs_equal_the_jnp_codecs(spec, shape):
  spec = QuantSpec.parse(spec) if isinstance(spec, str) else spec
  if spec.normalization == "rank1" and len(shape) != 2:
    shape = shape[1:]
  layout = normalize.layout_for(spec, shape)
  x = jnp.asarray(_values(shape, spec.signed))
  key = jax.random.key(7)
  origin = (5,) + (0,) * (len(shape) - 1)  # rows 5, ... of a larger leaf
  full_shape = (shape[0] + 9,) + shape[1:]
  seed = maps.rounding_seed(key) if spec.stochastic else None
  bases = maps.row_hash_bases(shape, origin, full_shape) if spec.stochastic else None
  scales = normalize.compute_scales(normalize.finite_abs(x), layout)
  uniform = maps.hashed_uniform(seed, shape, origin, full_shape) if spec.stochastic else None
  codes = qarray.encode(x, scales, spec, layout, uniform)
  values = qarray.decode(codes, scales, spec, layout, shape)
  given = None if layout.normalization == "block" else scales
  for isa in _runnable_isas():
    with isa_path(isa):
      out = jax.jit(lambda v: codec.encode(v, spec, layout, given, seed, bases))(x)
      decoded = jax.jit(lambda c, s: codec.decode(c, s, spec, layout, shape))(codes, scales)
      jax.block_until_ready((out, decoded))
    assert out is not None and decoded is not None
    np.testing.assert_array_equal(_bits(out[0]), _bits(codes), err_msg=isa)
    for got, want in zip(out[1], scales):
      np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=isa)
    np.testing.assert_array_equal(_bits(decoded), _bits(values), err_msg=isa)


def _stall(name):
  return QuantSpec.parse(name, stochastic=True, stall_only=True)


@pytest.mark.parametrize("spec", [_stall("B128/NF"), _stall("B128/DE"), _stall("B128/DE-0"),
                                  _stall("Rank-1/SqrtLinear"), _stall("Rank-1/SqrtDE-0"),
                                  _stall("Rank-1/Linear")], ids=str)
@pytest.mark.parametrize("shape", [(64, 256), (3, 16, 384)], ids=str)
def test_codecs_stall_rule_equals_the_jnp_codecs(spec, shape):
  """QuantSpec(stall_only=True) given the codes the values replace: the
  stochastic code where the nearest code is the stored one, else the nearest
  (stored codes half the nearest ones, half random, so both are taken); the
  table's fast path (NF, SqrtLinear, Linear) and its general one (DE, DE-0,
  SqrtDE-0). Without stored codes, plain stochastic rounding."""
  if spec.normalization == "rank1" and len(shape) != 2:
    shape = shape[1:]
  layout = normalize.layout_for(spec, shape)
  x = jnp.asarray(_values(shape, spec.signed, seed=1))
  origin = (5,) + (0,) * (len(shape) - 1)
  full_shape = (shape[0] + 9,) + shape[1:]
  seed = maps.rounding_seed(jax.random.key(3))
  bases = maps.row_hash_bases(shape, origin, full_shape)
  uniform = maps.hashed_uniform(seed, shape, origin, full_shape)
  scales = normalize.compute_scales(normalize.finite_abs(x), layout)
  nearest = maps.encode_nearest(normalize.normalize(x, scales, layout), spec.mapping, 4,
                                spec.signed)
  k_keep, k_codes = jax.random.split(jax.random.key(4))
  stored = packing.pack(jnp.where(jax.random.bernoulli(k_keep, 0.5, shape), nearest,
                                  jax.random.randint(k_codes, shape, 0, 16).astype(jnp.uint8)), 4)
  want = qarray.encode(x, scales, spec, layout, uniform, stored)
  plain = qarray.encode(x, scales, spec, layout, uniform)
  assert not np.array_equal(np.asarray(want), np.asarray(plain))  # the rule changes codes
  given = None if layout.normalization == "block" else scales
  for isa in _runnable_isas():
    with isa_path(isa):
      got = jax.jit(lambda v, c: codec.encode(v, spec, layout, given, seed, bases, c))(x, stored)
      got_plain = jax.jit(lambda v: codec.encode(v, spec, layout, given, seed, bases))(x)
      jax.block_until_ready((got, got_plain))
    np.testing.assert_array_equal(_bits(got[0]), _bits(want), err_msg=isa)
    np.testing.assert_array_equal(_bits(got_plain[0]), _bits(plain), err_msg=isa)
    for got_scale, want_scale in zip(got[1], scales):
      np.testing.assert_array_equal(_bits(got_scale), _bits(want_scale), err_msg=isa)


@pytest.mark.parametrize("spec,shape", [
    (QuantSpec.parse("B128/DE", bits=8), (4, 256)),    # 8 bits
    (QuantSpec.parse("B64/DE"), (4, 256)),             # another block size
    (QuantSpec.parse("Rank-1/Linear"), (2, 4, 256)),   # rank-1 of three axes
    (QuantSpec.parse("B128/DE"), (4, 200)),            # a ragged last axis
    (QuantSpec.parse("B128/Linear"), (4, 256)),        # Linear blocks: a closed form in jnp
    (QuantSpec.parse("Rank-1/DE-0"), (4, 256)),        # an unsigned map without its encoder
], ids=str)
def test_codecs_decline_what_they_do_not_cover(spec, shape):
  layout = normalize.layout_for(spec, shape)
  x = jnp.ones(shape, jnp.float32)
  scales = normalize.compute_scales(x, layout)
  given = None if layout.normalization == "block" else scales
  assert codec.encode(x, spec, layout, given, None, None) is None
  if spec.bits != 4 or shape[-1] % 128 or len(shape) == 3 and layout.normalization == "rank1":
    codes = qarray.encode(x, scales, spec, layout)
    assert codec.decode(codes, scales, spec, layout, shape) is None


def _train(tx, params, steps=4):
  state, out = tx.init(params), []
  update = jax.jit(tx.update)
  for i in range(steps):
    grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1)) * 1e-2 * (1 + 100 * (i == 2)), params)
    updates, state = update(grads, state, params)
    out.append(updates)
  return jax.tree.leaves((out, state))


@pytest.mark.parametrize("make", [
    lambda impl: optax4bit.quantize_state(optax.adam(1e-3), implementation=impl),
    pytest.param(lambda impl: optax4bit.quantize_state(
        optax.adam(1e-3), implementation=impl,
        spec_for={"mu": _stall("B128/NF"), "nu": _stall("Rank-1/SqrtLinear")}),
                 marks=pytest.mark.slow),
    lambda impl: optax4bit.quantize_state(optax.adam(1e-3), implementation=impl, recipe="paper",
                                          chunk_size=8192),
    # CI's time: Lion's slow EMA takes the same codec as adam's mu (the default's m).
    pytest.param(lambda impl: optax4bit.lion_4bit(1e-4, implementation=impl),
                 marks=pytest.mark.slow),
], ids=["adam", "adam-stall", "adam-paper-chunked", "lion_4bit"])
def test_quantize_state_with_the_codecs_equals_jnp(make):
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"w": 0.1 * jax.random.normal(keys[0], (256, 512)),
            "s": jax.random.normal(keys[1], (3, 64, 256)),
            "odd": jax.random.normal(keys[2], (100, 200))}
  if dispatch.codecs("auto") is not None:
    text = jax.jit(make("auto").update).lower(params, make("auto").init(params),
                                              params).as_text()
    assert "optax4bit_decode_4bit" in text and "optax4bit_encode_block_4bit" in text
  for got, want in zip(_train(make("auto"), params), _train(make("jnp"), params)):
    np.testing.assert_array_equal(_bits(np.atleast_1d(got)), _bits(np.atleast_1d(want)))
