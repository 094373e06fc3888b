"""``QuantSpec(stall_only=True)``: stochastic rounding only where rounding to
the nearest entry would keep the stored code. Checked against a numpy
reference (brute-force nearest entry, the stochastic bracket in float32), on
an EMA that rounding to nearest stalls, and through the optimizers: each
engine's codes are those of the nearest and stochastic steps from the same
state, merged by the rule."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax4bit
from optax4bit.quant import array as qarray
from optax4bit.quant import maps, normalize, packing
from optax4bit.quant.array import QuantizedArray
from optax4bit.quant.spec import QuantSpec

M_STALL = QuantSpec.parse("B128/NF", stochastic=True, stall_only=True)
V_STALL = QuantSpec.parse("Rank-1/SqrtLinear", stochastic=True, stall_only=True)


def test_spec_validation_and_name():
  with pytest.raises(ValueError, match="stall_only=True .* needs stochastic=True"):
    QuantSpec.parse("B128/NF", stall_only=True)
  with pytest.raises(ValueError, match="stall_only must be a bool"):
    QuantSpec("block", "NF", 4, True, 128, True, 1)
  assert M_STALL.stall_only and M_STALL.stochastic
  assert str(M_STALL) == "B128/NF (4-bit, signed, stochastic where stalled)"
  assert M_STALL != QuantSpec.parse("B128/NF", stochastic=True)


def _reference_codes(n, uniform, stored, spec):
  """The rule in numpy: nearest entry by brute force (ties to the lower
  index; for the ``Sqrt`` maps, the nearest root to ``sqrt(n)``), the
  stochastic bracket in float32 as `maps.encode_stochastic`."""
  table = maps.qmap(spec.mapping, spec.bits, spec.signed).astype(np.float32)
  n = np.asarray(n, np.float32)
  wide, entries = n.astype(np.float64), table.astype(np.float64)
  if spec.mapping.startswith("Sqrt"):
    wide, entries = np.sqrt(np.maximum(wide, 0)), np.sqrt(entries)
  nearest = np.argmin(np.abs(wide[..., None] - entries), axis=-1)
  clipped = np.clip(n, table[0], table[-1])
  lower = np.searchsorted(table, clipped, side="right") - 1
  upper = np.minimum(lower + 1, table.size - 1)
  gap = table[upper] - table[lower]
  with np.errstate(divide="ignore", invalid="ignore"):
    p = np.where(gap > 0, (clipped - table[lower]) / np.where(gap > 0, gap, 1), 0)
  stochastic = lower + (np.asarray(uniform) < p.astype(np.float32))
  return np.where(nearest == stored, stochastic, nearest).astype(np.uint8)


@pytest.mark.parametrize("mapping,signed", [("NF", True), ("DE", True), ("SqrtLinear", False),
                                            ("Linear", False)])
def test_encode_matches_the_numpy_rule(mapping, signed):
  spec = QuantSpec("tensor", mapping, 4, signed, 0, True, True)
  k_x, k_c, k_u = jax.random.split(jax.random.key(3), 3)
  x = jax.random.uniform(k_x, (64, 96), minval=-1.0 if signed else 0.0, maxval=1.0)
  x = x.at[0, 0].set(1.0)  # the tensor scale is exactly 1: the normalized value is x
  # Stored codes: half the nearest codes of x (where the rule rounds stochastically).
  nearest = np.asarray(maps.encode_nearest(x, mapping, 4, signed))
  stored = np.where(np.asarray(jax.random.bernoulli(k_c, 0.5, x.shape)), nearest,
                    np.asarray(jax.random.randint(k_c, x.shape, 0, 16)))
  uniform = maps.hashed_uniform(maps.rounding_seed(k_u), x.shape)
  layout = normalize.layout_for(spec, x.shape)
  scales = normalize.compute_scales(normalize.finite_abs(x), layout)
  chex.assert_trees_all_equal(scales, (jnp.ones((), jnp.float32),))
  packed_stored = packing.pack(jnp.asarray(stored, jnp.uint8), 4)
  for fusible in (False, True):
    codes = qarray.encode(x, scales, spec, layout, uniform, packed_stored, fusible=fusible)
    got = np.asarray(packing.unpack(codes, x.shape[-1], 4))
    np.testing.assert_array_equal(got, _reference_codes(x, uniform, stored, spec))
  # Both branches of the rule are taken.
  assert 0.2 < np.mean(got == stored) < 0.9


def test_quantize_without_stored_codes_rounds_stochastically():
  x = jax.random.normal(jax.random.key(0), (8, 256))
  key = jax.random.key(1)
  got = optax4bit.quantize(x, M_STALL, key=key)
  want = optax4bit.quantize(x, M_STALL.replace(stall_only=False), key=key)
  chex.assert_trees_all_equal(got.codes, want.codes)


def test_an_ema_that_nearest_rounding_stalls_converges():
  """m <- 0.9 m + 0.1 g with g constant: rounded to nearest, m stops where a
  step is under half a gap, far from g; the stall rule reaches g on average,
  as stochastic rounding does."""
  g = jnp.linspace(0.05, 1.0, 128).reshape(1, 128)

  def run(spec):
    layout = normalize.layout_for(spec, g.shape)

    @jax.jit
    def step(codes, scales, t):
      m = qarray.decode(codes, scales, spec, layout, g.shape)
      m = 0.9 * m + 0.1 * g
      new_scales = normalize.compute_scales(normalize.finite_abs(m), layout)
      uniform = maps.hashed_uniform(maps.rounding_seed(jax.random.fold_in(jax.random.key(0), t)),
                                    g.shape)
      return qarray.encode(m, new_scales, spec, layout, uniform, codes), new_scales

    zero = qarray.zeros(g.shape, jnp.float32, spec)
    codes, scales, total = zero.codes, zero.scales, 0.0
    for t in range(400):
      codes, scales = step(codes, scales, t)
      if t >= 200:
        total = total + qarray.decode(codes, scales, spec, layout, g.shape)
    return float(jnp.mean(jnp.abs(total / 200 - g) / g))

  nearest = run(QuantSpec.parse("B128/NF"))
  stall = run(M_STALL)
  stochastic = run(M_STALL.replace(stall_only=False))
  assert nearest > 0.05, nearest  # stalled
  # Once m sits within half a gap of g every element stalls, so the rule rounds
  # as stochastic rounding does (the same draws): 0.036 both, against 0.090.
  assert stall < nearest / 2 and stochastic < nearest / 2, (nearest, stall, stochastic)


def _with_spec(moment, spec):
  return QuantizedArray(moment.codes, moment.scales, spec, moment.shape, moment.dtype)


# The chunked jnp engine, the C++ kernel (its fused step runs "cube"; "w",
# whose last axis is not a multiple of 128, runs the jnp engine) and the XLA
# engine in the default run; the whole-leaf jnp engine with -m slow.
@pytest.mark.parametrize("implementation,chunk_size", [
    pytest.param("jnp", None, marks=pytest.mark.slow),
    # CI's time (20 s): the default's m runs the rule, and the jnp engine's codes
    # are checked equal to the C++ and XLA engines' (tests/test_cpu_kernel.py,
    # tests/test_xla_engine.py), which the default run checks against the rule.
    pytest.param("jnp", 4096, marks=pytest.mark.slow), ("cpu", None), ("xla", None)])
def test_optimizer_codes_follow_the_rule(implementation, chunk_size):
  """From one state, the stall step's codes are the stochastic step's where
  the nearest step's codes equal the stored ones, and the nearest step's
  elsewhere: every engine."""
  if implementation == "cpu" and not optax4bit.cpu.available():
    pytest.skip("the C++ kernel is not built")
  params = {"w": jax.random.normal(jax.random.key(0), (40, 300)),
            "cube": jax.random.normal(jax.random.key(1), (2, 8, 256))}
  grads = lambda t: jax.tree.map(lambda p: jnp.sin(3.0 * p + t), params)

  def make(m_spec, v_spec):
    return optax4bit.scale_by_adam_4bit(first_moment=m_spec, second_moment=v_spec,
                                        min_quantize_size=0, chunk_size=chunk_size,
                                        implementation=implementation)

  tx = make(M_STALL, V_STALL)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(3):
    _, state = update(grads(t), state)

  def step(m_spec, v_spec):
    respec = lambda tree, spec: jax.tree.map(lambda q: _with_spec(q, spec), tree,
                                             is_leaf=qarray.is_quantized)
    start = state._replace(mu=respec(state.mu, m_spec), nu=respec(state.nu, v_spec))
    return jax.jit(make(m_spec, v_spec).update)(grads(3), start)[1]

  stall = step(M_STALL, V_STALL)
  stochastic = step(M_STALL.replace(stall_only=False), V_STALL.replace(stall_only=False))
  nearest = step(QuantSpec.parse("B128/NF"), QuantSpec.parse("Rank-1/SqrtLinear"))
  unpack = lambda q: np.asarray(packing.unpack(q.codes, q.shape[-1], 4))
  for moment in ("mu", "nu"):
    for name in params:
      old, got = getattr(state, moment)[name], getattr(stall, moment)[name]
      sr, near = getattr(stochastic, moment)[name], getattr(nearest, moment)[name]
      chex.assert_trees_all_equal(got.scales, near.scales)  # scales do not depend on rounding
      kept = unpack(near) == unpack(old)
      np.testing.assert_array_equal(unpack(got), np.where(kept, unpack(sr), unpack(near)),
                                    err_msg=f"{moment}[{name}]")
      assert 0.01 < kept.mean() < 0.99, (moment, name, kept.mean())
